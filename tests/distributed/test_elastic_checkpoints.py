"""Whole-job checkpoints under real multi-process jobs: a failed write ends an elastic job
on every rank with its cause (instead of blacklisting a healthy host), and a restart
resumes from the newest checkpoint any rank holds, with one checkpoint folder per host and
rank 0 on another host than before."""
import os

import pytest

from support.elastic_jobs import run_elastic
from support.launch import WORKERS, horovodrun_command, run_job
from support.training_logs import SAMPLES, check_exactly_once, check_identical_replicas, read_attempts
from support.training_logs import read_logs

pytestmark = pytest.mark.distributed

RECIPE = ["--adamw", "--amp", "--batch-size", "8"]


@pytest.mark.elastic
def test_a_failed_checkpoint_write_stops_every_rank_with_its_cause(tmp_path):
    path = str(tmp_path / "ckpt" / "job.pt")
    schedule = [(0, ["localhost:1", "127.0.0.1:1"])]
    args = RECIPE + ["--epochs", "4", "--checkpoint", path, "--break-checkpoint-at-epoch", "1"]
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=2, worker_args=args)
    assert job.returncode not in (0, "timeout"), job.output[-3000:]
    for rank in (0, 1):
        lines = [line for line in job.output.splitlines() if line.startswith(f"[{rank}]<stderr>")]
        assert any("CheckpointError" in line and "writing checkpoint" in line
                   and "job.pt" in line for line in lines), job.output[-4000:]
    # Both ranks stopped at a commit right after the failed write: no reset, no
    # worker left to train on alone, and epoch 2 had barely begun.
    attempts = read_attempts(job.out_dir)
    assert len(attempts) == 2 and all(len(a) == 1 for a in attempts.values()), attempts
    steps = sorted({e["step"] for e in commits if e["epoch"] == 2})
    assert max(e["epoch"] for e in commits) == 2 and steps[-1] - steps[0] <= 1, steps


def restart(tmp_path, hosts, epochs):
    """elastic_train.py on two hosts (``hosts``, rank 0's first), each with a checkpoint
    folder of its own."""
    path = str(tmp_path / "{host}" / "job.pt")
    script = [os.path.join(WORKERS, "elastic_train.py"), "--samples", SAMPLES, "--epochs",
              epochs, "--checkpoint", path] + RECIPE
    job = run_job(horovodrun_command(2, [str(a) for a in script], hosts=hosts)).check()
    commits, totals = read_logs(job.out_dir)
    return job, commits, totals


def test_a_restart_resumes_from_the_newest_checkpoint_of_any_host(tmp_path):
    first, commits, _ = restart(tmp_path, "localhost:1,127.0.0.1:1", 2)
    assert sorted({e["epoch"] for e in commits}) == [0, 1]
    assert os.listdir(tmp_path / "localhost") and not (tmp_path / "127.0.0.1").exists()
    # Rank 0 now on 127.0.0.1, which has no checkpoint: rank 1's is resumed.
    second, commits, totals = restart(tmp_path, "127.0.0.1:1,localhost:1", 3)
    check_exactly_once(commits, totals, 3, first_epoch=2)
    check_identical_replicas(commits)
    starts = [a[0] for a in read_attempts(second.out_dir).values()]
    assert len({(s["epoch"], s["position"], s["params"], s["optimizer"]) for s in starts}) == 1
    assert starts[0]["epoch"] == 2
    # Rank 0 back on localhost, whose checkpoint is now the older one: the
    # newer (epoch 3, on 127.0.0.1) wins, so the job does not go back in time.
    third, commits, totals = restart(tmp_path, "localhost:1,127.0.0.1:1", 4)
    check_exactly_once(commits, totals, 4, first_epoch=3)
    assert {a[0]["epoch"] for a in read_attempts(third.out_dir).values()} == {3}
