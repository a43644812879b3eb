"""State.sync() under horovodrun: identical replicas afterwards, and nothing changed on rank 0.

Horovod's broadcast_optimizer_state steps every optimizer whose state is
empty with zero gradients; with weight decay that shrank every weight at a
job's start and gave a joining worker weights the others did not have.
"""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


CASES = [f"{optimizer}:{root_trained}:{wrapped}" for optimizer in ("sgd", "adamw")
         for root_trained in (0, 3) for wrapped in ("torch", "hvd_adapt")]


@pytest.fixture(scope="module")
def sync_job():
    """The eight cases in one job, one after the other, each on its own model, optimizer
    and State (one launch instead of eight)."""
    return run_ranks("sync_recipes.py", np=2, args=["--cases", ",".join(CASES)])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("root_trained", [0, 3], ids=["fresh-start", "worker-joins"])
@pytest.mark.parametrize("wrapped", ["torch", "hvd_adapt"])
def test_sync_copies_rank0_and_changes_nothing(sync_job, optimizer, root_trained, wrapped):
    case = f"{optimizer}:{root_trained}:{wrapped}"
    reports = sync_job.case(case)
    assert sorted(reports) == [0, 1]
    root = reports[0]
    for rank, rep in reports.items():
        # Every rank holds exactly rank 0's parameters and optimizer state as they were.
        assert rep["params"] == root["before"]["params"], rank
        assert rep["opt"] == root["before"]["opt"], rank
    assert reports[1]["opt_count"] == root["opt_count"]
    if root_trained == 0:
        assert root["opt_count"] == 0  # no step was taken to create state


def test_a_script_that_forgets_to_sync_is_synced_at_its_first_step_with_a_warning():
    job = run_ranks("no_sync.py", np=2).check()
    assert job.reports[0]["params"] == job.reports[1]["params"]
    assert "first optimizer step of 2 replicas came before any sync" in job.output
    assert "@hvd_adapt.run" in job.output


def test_a_survivor_that_skips_the_sync_and_a_joining_worker_agree_on_a_full_sync():
    # Before, the survivor broadcast its light values while the new worker
    # waited in the full sync's barrier: two ranks in two collectives, forever.
    job = run_ranks("sync_recipes.py", np=2, timeout=90,
                    args=["--optimizer", "adamw", "--root-trained", 3, "--wrapped",
                          "--survivor-skips-sync"]).check()
    root = job.reports[0]
    for rank, rep in job.reports.items():
        assert rep["params"] == root["before"]["params"], rank
        assert rep["opt"] == root["before"]["opt"], rank

