"""hvd_adapt.init(comm=...) under mpirun: one MPI world, two independent jobs, checked through
mpi4py's COMM_WORLD (not through Horovod)."""
import pytest

from support.launch import run_ranks

pytestmark = pytest.mark.distributed


def test_two_jobs_on_halves_of_an_mpi_world():
    job = run_ranks("comm_split.py", np=4, launcher="mpi").check()
    assert sorted(job.reports) == [0, 1, 2, 3]
    everyone = job.reports[0]["everyone"]
    assert all(rep["everyone"] == everyone for rep in job.reports.values())
    for half in (0, 1):
        members = [e for e in everyone if e["half"] == half]
        assert sorted(e["hvd_rank"] for e in members) == [0, 1]
        assert {e["hvd_size"] for e in members} == {2}
        # Collectives stayed within the half: world ranks 0+1 and 2+3.
        assert {e["sum_of_world_ranks"] for e in members} == {4 * half + 1}
        trained = sorted(i for e in members for i in e["trained"])
        assert trained == list(range(members[0]["samples"]))
        assert len({e["weight"] for e in members}) == 1
    assert everyone[0]["weight"] != everyone[2]["weight"]
