"""Step-time profile: buckets, stalls, the window of recent steps, elastic state."""
import pytest

from hvd_adapt.autoscale.profile import StepProfile


def test_profile_estimates_accumulation_time_from_sync_time():
    profile = StepProfile()
    profile.record(1, 2, 8, 0.3, optim=True)
    profile.record_sync(1, 2, 8, 0.1)
    arrays = profile.arrays()
    assert arrays["accum_step_time"][0] == pytest.approx(0.2)
    profile.record(1, 2, 8, 0.25, optim=False)
    assert profile.arrays()["accum_step_time"][0] == pytest.approx(0.25)
    assert profile.throughput(1, 2, 8, 1) == pytest.approx(2 * 8 * 2 / 0.55)


def test_a_stall_does_not_make_a_batch_size_look_slow():
    # Measured on digits: one 40 ms step among 1.3 ms ones at batch 126; with
    # a plain mean the run judged 126 slow and went back to 32 for good.
    profile = StepProfile()
    for _ in range(12):
        profile.record(1, 1, 126, 0.0013, optim=True)
    profile.record(1, 1, 126, 0.040, optim=True)
    assert profile.arrays()["optim_step_time"][0] == pytest.approx(0.0013)
    assert profile.throughput(1, 1, 126, 0) == pytest.approx(126 / 0.0013)
    # Steps that are merely uneven all count.
    profile.record(1, 1, 126, 0.0026, optim=True)
    assert profile.arrays()["optim_step_time"][0] == pytest.approx((12 * 0.0013 + 0.0026) / 13)


def test_profile_follows_the_recent_steps():
    profile = StepProfile()
    for _ in range(64):
        profile.record(1, 1, 32, 0.004, optim=True)
    for _ in range(64):
        profile.record(1, 1, 32, 0.001, optim=True)
    assert len(profile.state_dict()[(1, 1, 32)]["optim"]) == 64
    assert profile.arrays()["optim_step_time"][0] == pytest.approx(0.001)


def test_profile_ignores_bad_times_and_round_trips_through_state():
    profile = StepProfile()
    for seconds in (float("nan"), float("inf"), 0.0, -1.0):
        profile.record(1, 1, 8, seconds, optim=True)
    assert len(profile) == 0 and profile.throughput(1, 1, 8, 0) is None
    for i in range(100):
        profile.record(1, 2, 8, 0.01 + 1e-5 * i, optim=i % 2 == 0)
        profile.record_sync(1, 2, 8, 0.002)
    copy = StepProfile()
    copy.load_state_dict(profile.state_dict())
    for key, value in profile.arrays().items():
        assert copy.arrays()[key] == pytest.approx(value)
    # The window still holds after a restore: old steps leave as new ones come.
    for _ in range(64):
        copy.record(1, 2, 8, 0.5, optim=True)
    assert copy.arrays()["optim_step_time"][0] == pytest.approx(0.5)


def test_sizes_are_the_batch_sizes_with_optimizer_steps_in_one_world():
    p = StepProfile()
    p.record(1, 2, 16, 0.1, optim=True)
    p.record(1, 2, 8, 0.05, optim=False)    # an accumulation step alone times no size
    p.record(1, 1, 32, 0.1, optim=True)
    assert p.sizes(1, 2) == {16}
    p.record(1, 2, 8, 0.06, optim=True)
    assert p.sizes(1, 2) == {8, 16} and p.sizes(1, 1) == {32} and p.sizes(2, 2) == set()
