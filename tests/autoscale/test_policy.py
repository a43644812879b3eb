"""The autoscale policy: bounds, the default split, hysteresis, and which steps the fit uses."""
import numpy as np
import pytest

from hvd_adapt.autoscale.policy import AutoscalePolicy
from hvd_adapt.autoscale.profile import StepProfile
from hvd_adapt.goodput import GradParams


def test_autoscale_hysteresis_keeps_a_close_choice():
    config = AutoscalePolicy.create(16, 512, (4, 128), gradient_accumulation=False)
    profile = StepProfile()
    for b in (16, 64):
        for _ in range(3):
            profile.record(1, 2, b, 0.01 + 0.001 * b, optim=True)
            profile.record_sync(1, 2, b, 0.005)
    grad = GradParams(sqr=1.0, var=2.0)
    best = config.choose(profile, grad, 1, 2, current=(8, 0), forced=True)
    assert best != (8, 0)
    assert config.choose(profile, grad, 1, 2, current=best, forced=False) == best
    # Without gradient statistics nothing is measured yet: the default.
    assert config.choose(profile, None, 1, 2, current=best, forced=False) == config.default(2)


@pytest.mark.parametrize("intercept_share", [0.84, 0.5, 0.2, 0.05])
def test_autoscale_from_one_measured_size_loses_little_whatever_the_step_time_shape(
        intercept_share):
    # A job starts at B0 = 32 with true step time alpha + beta * bsz, the
    # intercept's share at 32 being 0.84 (measured on the digits example)
    # down to 0.05 (per-sample compute dominates, as in a CNN). Each decision
    # sees the step times of every batch tried so far. One measured size
    # cannot tell these apart: unbounded, the first decision went to 170 in
    # every case, 0.51 of the best goodput where compute dominates. Bounded to
    # twice the batch timed, it loses little either way, and the second
    # decision (the first's batch timed too) finds the best.
    alpha = intercept_share * 1e-3
    beta = (1 - intercept_share) * 1e-3 / 32
    grad = GradParams(sqr=1.0, var=100.0 / 32)  # noise scale 100
    batch = np.arange(32, 513)
    goodput = batch / (alpha + beta * batch) * (100 + 32) / (100 + batch)
    config = AutoscalePolicy.create(32, 512, (8, 512), gradient_accumulation=False)
    profile = StepProfile()
    choice, relative = (32, 0), []
    for _ in range(2):
        for _ in range(8):
            profile.record(1, 1, choice[0], alpha + beta * choice[0], optim=True)
        choice = config.choose(profile, grad, 1, 1, current=choice, forced=False)
        relative.append(goodput[choice[0] - 32] / goodput.max())
    assert relative[0] >= 0.8, relative
    assert relative[1] >= 0.97, relative


def test_a_choice_at_most_doubles_the_batch_and_the_largest_local_batch_timed():
    # Cheap steps and a large noise scale: the model wants the largest batch.
    policy = AutoscalePolicy.create(32, 4096, (8, 2048), gradient_accumulation=True)
    grad = GradParams(sqr=1.0, var=1000.0)
    profile = StepProfile()
    for _ in range(4):
        profile.record(1, 2, 16, 0.010, optim=True)
        profile.record_sync(1, 2, 16, 0.002)
    local, accum = policy.choose(profile, grad, 1, 2, current=(16, 0), forced=False)
    assert local == 32, (local, accum)
    for _ in range(4):
        profile.record(1, 2, 32, 0.011, optim=True)
        profile.record_sync(1, 2, 32, 0.002)
    assert policy.choose(profile, grad, 1, 2, current=(32, 0), forced=False)[0] == 64
    # A world that timed nothing yet is bounded by what any world timed.
    assert policy.choose(profile, grad, 1, 3, current=(11, 0), forced=True)[0] <= 64
    # Accumulation steps never run are extrapolated too: the global batch at
    # most doubles the current one (or the replicas times the largest local
    # batch timed), however it is made up.
    accumulating = AutoscalePolicy.create(32, 4096, (8, 16), gradient_accumulation=True)
    profile = StepProfile()
    for _ in range(4):
        profile.record(1, 2, 16, 0.010, optim=True)
        profile.record_sync(1, 2, 16, 0.002)
    for current, most in (((8, 0), 64), ((16, 1), 128), ((16, 3), 256)):
        local, accum = accumulating.choose(profile, grad, 1, 2, current=current, forced=True)
        assert 2 * local * (accum + 1) == most, (current, local, accum)


def test_autoscale_fits_the_current_world_alone_once_it_measured_two_sizes():
    # Step times measured by the elastic demo, whose two and three replicas
    # share 2 cores: their compute steps are 4-30x slower than one replica's,
    # which the model (compute shared by every world) cannot fit together with
    # the single replica's. Fitted to all of it, the single-replica choice was
    # the initial 64, at 88k samples/s, where 220 had run at 172k.
    config = AutoscalePolicy.create(64, 1024, (16, 256), gradient_accumulation=True)
    profile = StepProfile()
    measured = [  # replicas, atomic bsz, accumulation step s, optimizer step s, sync s
        (1, 64, None, 0.725e-3, 0.0), (1, 220, None, 1.281e-3, 0.0),
        (2, 115, None, 43.4e-3, 8.6e-3), (2, 256, None, 38.1e-3, 14.7e-3),
        (3, 164, 4.91e-3, 84.8e-3, 79.9e-3)]
    for replicas, bsz, accum, optim, sync in measured:
        for _ in range(8):
            profile.record(1, replicas, bsz, optim, optim=True)
            if accum is not None:
                profile.record(1, replicas, bsz, accum, optim=False)
            if replicas > 1:
                profile.record_sync(1, replicas, bsz, sync)
    grad = GradParams(sqr=0.0263, var=0.133)  # noise scale about 320 samples
    local, accum = config.choose(profile, grad, 1, 1, current=(64, 0), forced=True)
    assert local * (accum + 1) >= 200, (local, accum)


def test_decide_says_what_the_choice_is_predicted_to_gain():
    policy = AutoscalePolicy.create(16, 512, (4, 128), gradient_accumulation=False)
    profile = StepProfile()
    for b in (16, 64):
        for _ in range(3):
            profile.record(1, 1, b, 0.01 + 0.0001 * b, optim=True)
    grad = GradParams(sqr=1.0, var=20.0)
    assert policy.decide(profile, None, 1, 1, current=(16, 0), forced=False) == ((16, 0), None)
    choice, (speedup, gain) = policy.decide(profile, grad, 1, 1, current=(16, 0), forced=False)
    assert choice[0] > 16 and speedup > 1 + policy.hysteresis
    batch = choice[0] * (choice[1] + 1)
    assert gain == pytest.approx((20.0 + 1.0) / (20.0 / (batch / 16) + 1.0))
    kept, (speedup, _) = policy.decide(profile, grad, 1, 1, current=choice, forced=False)
    assert kept == choice and speedup == pytest.approx(1.0)


def test_default_split_stays_within_max_batch_size():
    policy = AutoscalePolicy.create(128, 128)
    assert [policy.default(r) for r in (1, 2, 3, 5, 7)] == [(128, 0), (64, 0), (42, 0), (25, 0), (18, 0)]
    assert AutoscalePolicy.create(128, 1024).default(3) == (43, 0)
    # Accumulating: B0=10 in atomic batches of at most 4 is 3 x 3, not 3 x 4.
    assert AutoscalePolicy.create(10, 10, (1, 4), gradient_accumulation=True).default(1) == (3, 2)
    assert AutoscalePolicy.create(10, 12, (1, 4), gradient_accumulation=True).default(1) == (4, 2)


# -- the documented bounds at 1, 2 and 3 replicas ------------------------------------------
GRID_B0 = (1, 7, 8, 10, 64, 100, 256)
GRID_BOUNDS = ((None, None), (1, 1), (4, 8), (4, 16), (3, 5), (16, 256), (52, 60))


def _keeps_bounds(b0, max_bsz, lo, hi, accumulation, replicas, choice):
    """What docs/autoscaling.md promises, checked from the numbers alone: the broken ones."""
    atomic, accum = choice
    micro = replicas * (accum + 1)
    batch = micro * atomic
    broken = []
    if not 1 <= atomic <= hi:
        broken.append(f"local {atomic} outside [1, {hi}]")
    if atomic < lo:
        broken.append(f"local {atomic} < {lo}")
    if batch > max_bsz:
        broken.append(f"batch {batch} > max {max_bsz}")
    if batch + micro <= b0:
        broken.append(f"batch {batch} below B0 {b0} by more than rounding ({micro})")
    if accum and not accumulation:
        broken.append("accumulation without gradient_accumulation")
    return broken


def _possible(b0, max_bsz, lo, hi, accumulation, replicas):
    """Whether any (atomic, accum) keeps every bound: per accumulation count, the smallest
    atomic batch that keeps B0 and lo is the one to try (larger ones only add to the batch)."""
    for accum in range(max_bsz + 1 if accumulation else 1):
        micro = replicas * (accum + 1)
        atomic = max(lo, b0 // micro, 1)
        if not _keeps_bounds(b0, max_bsz, lo, hi, accumulation, replicas, (atomic, accum)):
            return True
    return False


@pytest.mark.parametrize("accumulation", [False, True], ids=["no-accumulation", "accumulation"])
def test_every_default_keeps_the_documented_bounds_or_names_what_gives_way(accumulation):
    # The batch stays within [B0 less rounding, max_batch_size] and the local batch within
    # local_bsz_bounds at every replica count where that is possible at all (a brute-force
    # search says); where it is not, autoscale_batch_size refuses the setting in that world
    # naming the numbers, and a world that a resize makes gets the documented fallback.
    checked = refused = 0
    for b0 in GRID_B0:
        for max_bsz in sorted({b0, b0 + 1, 2 * b0 + 3, 4 * b0}):
            for lo, hi in GRID_BOUNDS:
                try:
                    policy = AutoscalePolicy.create(b0, max_bsz, (lo, hi), accumulation)
                except ValueError:
                    continue
                lo_, hi_ = policy.local_bsz_bounds
                for replicas in (1, 2, 3):
                    case = (b0, max_bsz, lo_, hi_, accumulation, replicas)
                    choice = policy.default(replicas)
                    broken = _keeps_bounds(*case, choice)
                    conflict = policy.conflict(replicas)
                    possible = _possible(*case)
                    assert (conflict is None) == possible, (case, choice, conflict)
                    checked += 1
                    if conflict is None:
                        assert not broken, (case, choice)
                        assert AutoscalePolicy.create(b0, max_bsz, (lo, hi), accumulation,
                                                      num_replicas=replicas)
                        continue
                    refused += 1
                    with pytest.raises(ValueError) as e:
                        AutoscalePolicy.create(b0, max_bsz, (lo, hi), accumulation,
                                               num_replicas=replicas)
                    assert str(e.value) == conflict and f"at {replicas} replica(s)" in conflict
                    # The fallback: hi and (while replicas <= max) max_batch_size always hold.
                    atomic, accum = choice
                    assert atomic <= hi_, (case, choice)
                    if replicas <= max_bsz:
                        assert replicas * atomic * (accum + 1) <= max_bsz, (case, choice)
                    assert not [b for b in broken if "below B0" in b] or \
                        ("cannot reach" in conflict and atomic == hi_), (case, choice, conflict)
    assert checked > 300 and refused > 10, (checked, refused)


def test_the_settings_of_the_issue_are_refused_naming_the_numbers():
    # At 3 processes, B0 = 8, bounds (4, 8): the lower bound made a batch of 12 > max 8.
    with pytest.raises(ValueError, match=r"at 3 replica\(s\).*4 x 3 replica\(s\) = 12 > 8"):
        AutoscalePolicy.create(8, 8, (4, 8), num_replicas=3)
    assert AutoscalePolicy.create(8, 8, (4, 8), num_replicas=1).default(3) == (2, 0)
    # At 1 process, B0 = 256, bounds (4, 16) without accumulation: 1/16 of B0, silently.
    with pytest.raises(ValueError, match=r"reach batch_size 256.*16 x 1 replica\(s\) = 16"):
        AutoscalePolicy.create(256, 1024, (4, 16), gradient_accumulation=False, num_replicas=1)
    assert AutoscalePolicy.create(256, 1024, (4, 16), gradient_accumulation=True,
                                  num_replicas=1).default(1) == (16, 15)


def _timed_profile(replicas, sizes):
    profile = StepProfile()
    for size in sizes:
        for _ in range(4):
            profile.record(1, replicas, size, 0.01 + 0.0005 * size, optim=True)
            profile.record_sync(1, replicas, size, 0.002)
    return profile


@pytest.mark.parametrize("accumulation", [False, True], ids=["no-accumulation", "accumulation"])
def test_every_fitted_choice_keeps_the_documented_bounds(accumulation):
    # Fitted choices (cheap steps, a large noise scale: the model wants large batches, and
    # a small one: B0) at 1, 2 and 3 replicas keep the bounds that hold there.
    for b0 in (7, 64, 100):
        for max_bsz in (b0, 4 * b0):
            for lo, hi in ((1, 1), (4, 16), (3, 5), (16, 256)):
                try:
                    policy = AutoscalePolicy.create(b0, max_bsz, (lo, hi), accumulation)
                except ValueError:
                    continue
                for replicas in (1, 2, 3):
                    start = policy.default(replicas)
                    profile = _timed_profile(replicas, {start[0], max(1, start[0] // 2)})
                    for var in (1e4, 1e-3):
                        grad = GradParams(sqr=1.0, var=var)
                        for forced in (True, False):
                            choice = policy.choose(profile, grad, 1, replicas, start, forced)
                            case = (b0, max_bsz, lo, hi, accumulation, replicas)
                            if policy.conflict(replicas) is None:
                                assert not _keeps_bounds(*case, choice), (case, choice)
                            assert policy.allows(choice, replicas), (case, choice)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_noise_statistics_or_fits_are_skipped_with_a_warning(bad, caplog):
    policy = AutoscalePolicy.create(32, 512, (8, 256))
    profile = _timed_profile(1, {32, 64})
    for grad in (GradParams(sqr=bad, var=1.0), GradParams(sqr=1.0, var=bad)):
        caplog.clear()
        assert policy.choose(profile, grad, 1, 1, current=(64, 0), forced=False) == (64, 0)
        assert "decision skipped: the gradient noise statistics are not finite" in caplog.text
        # After a resize the current choice cannot stand: the default, not the smallest batch.
        assert policy.choose(profile, grad, 1, 1, current=(64, 0), forced=True) == (32, 0)
    # Non-finite step times never reach the fit (the profile leaves them out).
    profile.record(1, 1, 128, bad, optim=True)
    assert 128 not in profile.sizes(1, 1)
