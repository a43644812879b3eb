"""torch's CPU threads are shared among the replicas of a node (hvd_adapt/_threads.py)."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def share(report):
    return min(report["before"], max(1, report["cpus"] // report["local_size"]))


@pytest.mark.parametrize("launcher,np", [("gloo", 2), ("mpi", 2), ("gloo", 3), ("python", 1)])
def test_each_replica_gets_its_share_of_the_cpus(launcher, np):
    job = run_ranks("threads.py", np=np, launcher=launcher, env={"OMP_NUM_THREADS": None}).check()
    assert len(job.reports) == np
    for report in job.reports.values():
        assert report["local_size"] == np
        assert report["after"] == share(report), report
    if np == 1:
        assert job.reports[0]["after"] == job.reports[0]["before"]


def test_scripts_that_call_hvd_init_themselves_get_it_with_their_state():
    job = run_ranks("threads.py", np=2, args=["--hvd-init"], env={"OMP_NUM_THREADS": None}).check()
    assert all(r["after"] == share(r) for r in job.reports.values()), job.reports


def test_omp_num_threads_is_left_alone():
    job = run_ranks("threads.py", np=2, env={"OMP_NUM_THREADS": "2"}).check()
    assert all(r["before"] == r["after"] == 2 for r in job.reports.values()), job.reports
