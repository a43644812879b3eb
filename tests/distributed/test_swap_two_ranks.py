"""Optimizer state on disk at two ranks: every rank's parameters and optimizer state after
every step, bitwise those of the same job with the state in memory."""
import pytest

from launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("args", [["--kind", "adamw"], ["--kind", "adamw", "--amp"],
                                  ["--kind", "sgd"]], ids=["adamw", "adamw+amp", "sgd"])
def test_two_ranks_train_bitwise_as_with_the_state_in_memory(args, tmp_path):
    memory = run_ranks("swap_exact.py", np=2, args=args).check().reports
    swapped = run_ranks("swap_exact.py", np=2, args=args + ["--swap-dir", tmp_path]).check().reports
    steps = memory[0]["steps"]
    assert len(steps) == 12 and all(s["accumulation"] == 1 for s in steps)
    assert steps[-1]["noise"][0] > 0, "the noise was measured"
    for rank in (0, 1):
        assert memory[rank]["steps"] == steps
        assert swapped[rank]["steps"] == steps, rank
