"""The optimizer state on disk at two ranks while one rank is stopped for
20 s (SIGSTOP/SIGCONT) between its backward and its step, during the other's swapped step
and during its own, and killed (SIGKILL) during its own swapped step, then both restarted
from the last checkpoint: the resumed run must be bitwise the uninterrupted one, and the
killed run's files go."""
import os

import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_a_rank_stopped_for_20_s_during_swapped_steps_finishes_as_in_memory(tmp_path):
    reports = run_ranks("swap_signals.py", np=2, args=["stop", tmp_path],
                        timeout=240).check().reports
    for rank in (0, 1):
        for step in reports[rank]["steps"]:
            assert step["error"] is None, (rank, step)
            assert step["as_in_memory"], (rank, step)
        assert reports[rank]["state_as_in_memory"], rank
    assert reports[1]["continued"] == 3, "rank 1 was stopped and continued three times"


def test_a_rank_killed_during_its_swapped_step_resumes_bitwise_from_the_checkpoint(
        tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    straight = run_ranks("swap_signals.py", np=2,
                         args=["straight", tmp_path / "straight", "--checkpoint",
                               tmp_path / "straight.pt"]).check().reports
    killed = run_ranks("swap_signals.py", np=2,
                       args=["kill", tmp_path / "swap", "--checkpoint", checkpoint], timeout=120)
    assert killed.returncode != 0 and not killed.reports, "rank 1 was killed: the job fails"
    resumed = run_ranks("swap_signals.py", np=2,
                        args=["resume", tmp_path / "swap", "--checkpoint", checkpoint]
                        ).check().reports
    for rank in (0, 1):
        assert resumed[rank]["digest"] == straight[rank]["digest"], rank
        assert straight[rank]["read"] > 0, "the state was read from disk"
    left = {rank: sorted(os.listdir(tmp_path / "swap" / f"rank{rank}")) for rank in (0, 1)}
    assert left == {0: [], 1: []}, f"swap folders left behind: {left}"
