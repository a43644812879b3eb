"""bfloat16 and float16 through every collective path of a State at 2 ranks (Horovod 0.28
refuses to broadcast bfloat16: "Tensor type torch.BFloat16Tensor is not supported"): the
sync gives every rank rank 0's parameters, buffers and optimizer state bit for bit, commits
broadcast half-precision buffers, accumulators sum half-precision tensors, a checkpoint
reads back bit for bit."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_syncs_commits_and_checkpoints_bit_for_bit(dtype):
    job = run_ranks("half_state.py", np=2, args=["--dtype", dtype]).check()
    zero, one = job.reports[0], job.reports[1]
    assert zero["dtypes"] == one["dtypes"] == [f"torch.{dtype}"]
    # After the sync every rank holds what rank 0 built (its own parameters, BatchNorm
    # buffers, and no optimizer state: rank 1's was replaced by rank 0's, none).
    assert one["synced"] == zero["synced"] == {"params": zero["built"]["params"], "opt": {}}
    assert one["committed"] == zero["committed"]
    assert zero["committed"]["opt"], "AdamW's state in the model's dtype"
    assert one["loaded"] == zero["loaded"] == zero["committed"]
    assert zero["total"] == one["total"] != 0
