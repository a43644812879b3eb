"""The SIGTERM drain under horovodrun, mpirun and elastic horovodrun: the checkpoint is on disk before any rank
exits, and a restarted job resumes at the drained step on every rank.

Launchers kill the remaining workers as soon as one exits non-zero, so a
rank that exited 143 while rank 0 was still writing lost the checkpoint.
"""
import os
import stat
import sys

import pytest

from launch import BIN, WORKERS, run_job, run_ranks

pytestmark = pytest.mark.distributed


def launch(launcher, args, tmp_path):
    if launcher != "elastic":
        return run_ranks("drain_job.py", np=2, launcher=launcher, args=args)
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/bash\necho localhost:2\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    command = [os.path.join(BIN, "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
               "--network-interface", "lo", "--host-discovery-script", str(discover),
               sys.executable, os.path.join(WORKERS, "drain_job.py")] + [str(a) for a in args]
    return run_job(command, timeout=180)


@pytest.mark.parametrize("launcher", ["gloo", "mpi", pytest.param("elastic", marks=pytest.mark.elastic)])
def test_drain_keeps_its_checkpoint_and_resumes_there(launcher, tmp_path):
    path = str(tmp_path / "job.pt")
    first = launch(launcher, ["--checkpoint", path, "--term-step", 5, "--slow-save", 2.0],
                   tmp_path)
    assert first.returncode != 0, first.output[-3000:]
    assert os.path.exists(path), first.output[-3000:]
    assert sorted(first.reports) == [0, 1], first.output[-3000:]
    drained = {rank: rep["drained"] for rank, rep in first.reports.items()}
    assert {rep["code"] for rep in first.reports.values()} == {143}
    # Both ranks stopped at the same commit, one step after the signal (the vote's delay).
    assert drained[0] == dict(drained[1], rank=0)
    assert drained[0]["steps"] in (5, 6), drained

    second = launch(launcher, ["--checkpoint", path, "--slow-save", 0.0], tmp_path).check()
    for rank, rep in second.reports.items():
        resumed = rep["resumed"]
        assert resumed == dict(drained[0], rank=rank), (rank, resumed, drained[0])


@pytest.mark.parametrize("first_np,second_np", [(2, 1), (1, 3)])
def test_a_checkpoint_written_at_one_world_size_resumes_at_another(first_np, second_np, tmp_path):
    path = str(tmp_path / "job.pt")
    args = ["--checkpoint", path, "--slow-save", 0.0]
    first = run_ranks("drain_job.py", np=first_np, args=args + ["--term-step", 5])
    assert first.returncode != 0 and os.path.exists(path), first.output[-3000:]
    drained = first.reports[0]["drained"]
    second = run_ranks("drain_job.py", np=second_np, args=args).check()
    assert sorted(second.reports) == list(range(second_np))
    for rank, rep in second.reports.items():
        assert rep["resumed"] == dict(drained, rank=rank), (rank, rep["resumed"], drained)
