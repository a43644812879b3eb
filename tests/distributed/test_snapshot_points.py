"""Two ranks' restore points when commits skip their snapshots (``State(snapshot_budget=...)``):
every rank's is the same commit, whoever writes a checkpoint and whatever each rank's speed."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def job():
    """The cases of workers/snapshot_points.py, in one job."""
    return run_ranks("snapshot_points.py", np=2, timeout=240)


def test_a_checkpoint_after_a_skipped_commit_moves_every_ranks_restore_point_alike(job):
    reports = job.case("every_rank_checkpoints_then_restores")
    assert all(report["skipped"] for report in reports.values()), reports
    # Every rank snapshotted at save_checkpoint (rank 0 alone did before: a restore by hand
    # then left the ranks at different steps, found by an attack).
    assert reports[0]["restored"] == reports[1]["restored"] == reports[0]["saved"], reports
    assert reports[0]["saved"]["snapshot"] == reports[0]["saved"]["generation"]


def test_a_checkpoint_by_rank_zero_alone_is_realigned_at_the_next_commit(job):
    reports = job.case("rank_zero_checkpoints_alone")
    after = reports[0]["after_next_commit"]
    assert after == reports[1]["after_next_commit"], reports
    assert after["snapshot"] == after["generation"], "the next commit must snapshot everywhere"
    assert reports[0]["restored"] == reports[1]["restored"] == after, reports


def test_ranks_of_different_speeds_snapshot_at_the_same_commits(job):
    reports = job.case("ranks_of_different_speeds")
    assert reports[0] == reports[1], reports
