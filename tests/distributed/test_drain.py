"""The SIGTERM drain under horovodrun, mpirun and elastic horovodrun: the checkpoint is on disk before any rank
exits, and a restarted job resumes at the drained step on every rank.

Launchers kill the remaining workers as soon as one exits non-zero, so a
rank that exited 143 while rank 0 was still writing lost the checkpoint.
"""
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from support.full_disk import fill
from support.launch import BIN, WORKERS, horovodrun_command, launch_env, run_job, run_ranks

pytestmark = pytest.mark.distributed


def elastic_command(args, tmp_path):
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/bash\necho localhost:2\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    return [os.path.join(BIN, "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
            "--network-interface", "lo", "--host-discovery-script", str(discover),
            sys.executable, os.path.join(WORKERS, "drain_job.py")] + [str(a) for a in args]


def launch(launcher, args, tmp_path):
    if launcher != "elastic":
        return run_ranks("drain_job.py", np=2, launcher=launcher, args=args)
    return run_job(elastic_command(args, tmp_path), timeout=180)


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
    # Both ranks stopped at the same commit: the first after the signal.
    assert drained[0] == dict(drained[1], rank=0)
    assert drained[0]["steps"] == 5, drained

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


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("elastic", marks=pytest.mark.elastic)])
def test_a_drain_with_commits_3_s_apart_ends_before_horovodrun_kills(launcher, tmp_path):
    # horovodrun asked to stop (a scheduler's SIGTERM) passes SIGTERM on to its
    # workers and SIGKILLs them 5 s later (GRACEFUL_TERMINATION_TIME_S): with
    # commits 3 s apart, only a drain at the first commit after the signal
    # writes its checkpoint in time.
    path = str(tmp_path / "job.pt")
    args = ["--checkpoint", path, "--slow-save", 0.0, "--batch-seconds", 1.0,
            "--commit-every", 3]
    command = elastic_command(args, tmp_path) if launcher == "elastic" else \
        horovodrun_command(2, [os.path.join(WORKERS, "drain_job.py")] + [str(a) for a in args])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    commits = out_dir / "commits.txt"
    with open(out_dir / "output.log", "w") as log:
        proc = subprocess.Popen(command, env=launch_env(str(out_dir)), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 120
            while time.time() < deadline and not (
                    commits.exists() and len(commits.read_text().splitlines()) >= 2):
                time.sleep(0.05)
            signalled = time.time()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
    reports = {}
    deadline = time.time() + 10
    while len(reports) < 2 and time.time() < deadline:
        time.sleep(0.1)
        reports = {name: json.loads((out_dir / name).read_text())
                   for name in ("rank0.json", "rank1.json") if (out_dir / name).exists()}
    output = (out_dir / "output.log").read_text()
    assert sorted(reports) == ["rank0.json", "rank1.json"], output[-3000:]
    assert {rep["code"] for rep in reports.values()} == {143}
    logged = [(int(line.split()[0]), float(line.split()[1]))
              for line in commits.read_text().splitlines()]
    # No commit after the signal went by: the first one drained (it logs nothing).
    assert all(time_ < signalled for _, time_ in logged), (signalled, logged)
    assert {rep["drained"]["steps"] for rep in reports.values()} == {logged[-1][0] + 3}
    assert max(rep["time"] for rep in reports.values()) - signalled < 5.0
    resumed = launch("gloo", ["--checkpoint", path, "--slow-save", 0.0], tmp_path).check()
    assert resumed.reports[0]["resumed"] == reports["rank0.json"]["drained"]


@pytest.mark.parametrize("room", [12288, 0], ids=["fills-while-writing", "full"])
def test_a_drain_on_a_full_disk_raises_checkpoint_error_with_its_cause_on_every_rank(
        full_disk, room):
    # torch.save raised RuntimeError ("inline_container.cc ... unexpected pos") on rank 0,
    # which the drain did not catch: rank 0 failed, rank 1 waited for its word and was
    # SIGKILLed by the launcher, with no error.
    path = str(full_disk / "job.pt")
    fill(full_disk, leave=room)
    job = run_ranks("drain_job.py", np=2, timeout=150,
                    args=["--checkpoint", path, "--term-step", 5, "--slow-save", 0.0,
                          "--ballast", 16384])
    assert job.returncode != 0
    assert sorted(job.reports) == [0, 1], job.output[-3000:]
    for rank, rep in job.reports.items():
        assert "draining after SIGTERM: writing checkpoint" in rep["error"], (rank, rep)
        assert ("RuntimeError" if room else "OSError") in rep["error"], (rank, rep)
    # No temporary file left behind.
    assert set(os.listdir(full_disk)) <= {".hvd_adapt-checkpoint.lock", "filler"}
