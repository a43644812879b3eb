"""Epochs by progress under horovodrun: every rank ends each epoch at the same step."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("rank1_early", [0, 2])
def test_epochs_by_progress_end_at_the_same_step_on_every_rank(rank1_early):
    # Each rank used to end the epoch by its own reckoning: one step apart,
    # the ranks ran different numbers of steps and the job hung.
    job = run_ranks("progress_epochs.py", np=2, timeout=120,
                    args=["--rank1-early", rank1_early]).check()
    steps = {rank: rep["steps"] for rank, rep in job.reports.items()}
    assert steps[0] == steps[1] and len(steps[0]) == 3, steps
    assert job.reports[0]["params"] == job.reports[1]["params"]
