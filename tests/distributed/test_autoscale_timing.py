"""What several autoscaling replicas time before their first decision."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("recipe", [[], ["--amp"]], ids=["sgd-weight-decay", "adamw-bf16-scaler"])
def test_replicas_time_a_half_batch_until_their_world_has_timed_two_sizes(recipe):
    job = run_ranks("timing_halves.py", np=2, launcher="gloo", args=recipe).check()
    first, second = job.reports[0], job.reports[1]
    lengths = [len(ids) for _, ids in first["batches"]]
    # Both ranks split the same steps, so their accumulation cycles match.
    assert lengths == [len(ids) for _, ids in second["batches"]]
    # The first decide_every (8) steps: steps 0 and 4 as two halves of 8. Then
    # the world has timed 8 and 16, and no step is split again.
    assert lengths[:10] == [8, 8, 16, 16, 16, 8, 8, 16, 16, 16], lengths
    assert set(lengths[10:]) == {16}, str(lengths)
    assert first["sizes"] == [8, 16]
    # The halves consume the epoch as whole steps do: every sample once per epoch.
    for epoch in (0, 1):
        seen = [i for report in (first, second) for e, ids in report["batches"] if e == epoch
                for i in ids]
        assert sorted(seen) == list(range(512)), epoch
    assert first["params"] == second["params"]
    assert first["optim_state"] == second["optim_state"] and first["optim_state"]
