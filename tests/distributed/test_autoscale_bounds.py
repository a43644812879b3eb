"""Batch bounds in a real three-process job (the policy's grid over B0, max and local bounds
at 1, 2 and 3 replicas is in tests/autoscale/test_policy.py)."""
import pytest

from hvd_adapt.autoscale.policy import AutoscalePolicy
from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_three_ranks_refuse_impossible_bounds_and_keep_possible_ones():
    job = run_ranks("autoscale_bounds.py", np=3, timeout=150).check()
    assert sorted(job.reports) == [0, 1, 2]
    # The plain reference: the policy in this process at 3 replicas.
    expected = AutoscalePolicy.create(10, 10, (1, 8), gradient_accumulation=True).default(3)
    samples = []
    for rank, seen in job.reports.items():
        # Before, 4 x 3 = 12 > max_batch_size 8 silently.
        assert "at 3 replica(s)" in seen["refused"] and "4 x 3 replica(s) = 12 > 8" \
            in seen["refused"], rank
        for batch in seen["batches"]:
            assert (batch["local"], batch["accum"]) == expected, (rank, batch)
            assert 10 - 3 < batch["batch_size"] <= 10, (rank, batch)
            indices = batch["indices"]
            samples += indices[:len(indices) - batch["padded"]]
    assert sorted(samples) == list(range(50)), "every sample exactly once"
