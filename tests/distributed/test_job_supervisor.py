"""``hvd-adapt-run`` around real horovodrun jobs (tests/distributed/workers/elastic_train.py:
AdamW with weight decay, bf16 autocast with a GradScaler, a checkpoint at every epoch's end):
where Horovod's driver gives up on a job that could go on (every host replaced mid-epoch,
horovod#3197; every worker killed at once) it launches the job again, which resumes from its
checkpoint and trains every sample once per finished epoch, replicas identical; where the
script ended (its own error on every rank, a drain after SIGTERM) or finished, it is not
launched again; the restart budget ends the job with horovodrun's code; and a second copy of
a running job is refused."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support.elastic_jobs import FAST_HOROVODRUN, worker_command
from support.launch import WORKERS, horovodrun_command, launch_env, run_job
from support.training_logs import (check_exactly_once, check_identical_replicas,
                                   check_resumed_from_checkpoint, lineage, read_attempts, read_logs)

pytestmark = [pytest.mark.distributed]

RECIPE = ["--adamw", "--amp", "--batch-size", "8"]
SUPERVISOR = [sys.executable, "-m", "hvd_adapt.scheduling.job_supervisor"]
# 60 samples, 8 a step: 8 steps an epoch. Faults land at step 11, mid-epoch 1, after the
# checkpoint of epoch 0.
FAULT_STEP = 11


def replacing_discovery(out_dir, step):
    """localhost:2 until rank 0 committed ``step`` steps, then 127.0.0.1:2 for good (the same
    machine under another name: every host of the job replaced at once)."""
    path = os.path.join(out_dir, "discover.sh")
    with open(path, "w") as f:
        f.write(f'#!/bin/bash\nd="{out_dir}"\n'
                f'step=$(cat "$d/progress" 2>/dev/null || echo 0)\n'
                f'if [ -f "$d/replaced" ] || [ "$step" -ge {step} ]; then\n'
                f'  touch "$d/replaced"; echo 127.0.0.1:2\nelse\n  echo localhost:2\nfi\n')
    os.chmod(path, 0o755)
    return path


def elastic_command(out_dir, worker_args, discovery=None):
    if discovery is None:
        discovery = os.path.join(out_dir, "discover.sh")
        with open(discovery, "w") as f:
            f.write("#!/bin/sh\necho localhost:2\n")
        os.chmod(discovery, 0o755)
    return [sys.executable, FAST_HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2",
            "--network-interface", "lo", "--host-discovery-script", discovery,
            *worker_command(worker_args)]


def supervised(command, out_dir, max_restarts=3, lock=None):
    return SUPERVISOR + ["--max-restarts", str(max_restarts),
                         "--lock", lock or os.path.join(out_dir, "job.lock"), "--"] + command


def restart_lines(output):
    return [line for line in output.splitlines() if "hvd-adapt-run: restart " in line]


def check_finished_across_restarts(job, epochs):
    commits, totals = read_logs(job.out_dir)
    attempts = read_attempts(job.out_dir)
    kept = lineage(commits, attempts)
    check_exactly_once(kept, totals, epochs)
    check_identical_replicas(kept)
    check_resumed_from_checkpoint(commits, attempts, 1)
    # The lost run trained past its checkpoint: what the lineage dropped is real work
    # done again, not a run that died at an epoch's end.
    assert len(kept) < len(commits)


@pytest.mark.elastic
@pytest.mark.parametrize("fault", ["hosts_replaced", "all_workers_killed"])
def test_a_job_the_driver_gave_up_on_is_launched_again_and_finishes(fault, tmp_path):
    out_dir = str(tmp_path)
    args = RECIPE + ["--epochs", "2", "--checkpoint", str(tmp_path / "job.pt"),
                     "--batch-seconds", "0.2"]
    if fault == "hosts_replaced":
        # Held at the step until the replacement's interrupt, however slow the machine.
        command = elastic_command(out_dir, args + ["--wait-steps", f"[{FAULT_STEP}]",
                                                   "--hold-seconds", "120"],
                                  replacing_discovery(out_dir, FAULT_STEP))
        said = "No hosts from previous set remaining, unable to broadcast state."
    else:
        command = elastic_command(out_dir, args + ["--kill-all-at-step", FAULT_STEP])
        said = "failure count == 2 -> stop running"
    job = run_job(supervised(command, out_dir), out_dir=out_dir, timeout=300)
    assert job.returncode == 0, job.output[-6000:]
    restarts = restart_lines(job.output)
    assert len(restarts) == 1 and said in restarts[0], restarts
    check_finished_across_restarts(job, 2)


@pytest.mark.elastic
def test_a_script_error_on_every_rank_is_not_launched_again(tmp_path):
    out_dir = str(tmp_path)
    command = elastic_command(out_dir, RECIPE + ["--epochs", "1", "--raise-at-step", "3"])
    job = run_job(supervised(command, out_dir), out_dir=out_dir, timeout=180)
    assert job.returncode == 1, job.output[-6000:]
    assert not restart_lines(job.output), job.output[-6000:]
    ended = [line for line in job.output.splitlines() if "hvd-adapt-run: the script ended" in line]
    assert len(ended) == 1 and "ValueError: a bug of the script's own at step 3" in ended[0] \
        and "exiting with 1" in ended[0], job.output[-4000:]
    # One launch: two processes, one attempt each.
    assert len(read_attempts(out_dir)) == 2


def test_the_restart_budget_ends_the_job_with_horovodruns_code(tmp_path):
    # A fixed-size job whose workers are all killed at step 2 of every launch: horovodrun
    # stops at the first worker lost, which the supervisor reads as a job that could go on.
    out_dir = str(tmp_path)
    command = horovodrun_command(2, [os.path.join(WORKERS, "elastic_train.py"), "--epochs", "1",
                                     "--kill-step", "2", "--kill-host", "localhost"])
    job = run_job(supervised(command, out_dir, max_restarts=1), out_dir=out_dir, timeout=180)
    assert job.returncode == 1, job.output[-6000:]
    restarts = restart_lines(job.output)
    assert len(restarts) == 1 and "restart 1 of 1" in restarts[0] \
        and "exited first, with 137" in restarts[0], restarts
    spent = [line for line in job.output.splitlines() if "restart budget is spent" in line]
    assert len(spent) == 1 and "--max-restarts 1" in spent[0] and "exiting with 1" in spent[0]
    assert {entries[0]["restarts"] for entries in read_attempts(out_dir).values()} == {0, 1}


@pytest.mark.elastic
def test_sigterm_drains_the_job_which_exits_143_and_is_not_launched_again(tmp_path):
    out_dir = str(tmp_path)
    checkpoint = str(tmp_path / "job.pt")
    command = elastic_command(out_dir, RECIPE + ["--epochs", "50", "--checkpoint", checkpoint,
                                                 "--drain", "--batch-seconds", "0.2"])
    with open(tmp_path / "output.log", "w") as log:
        proc = subprocess.Popen(supervised(command, out_dir), env=launch_env(out_dir),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(tmp_path / "committed") and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            stop(proc)
    output = (tmp_path / "output.log").read_text()
    assert code == 143, output[-6000:]
    assert not restart_lines(output), output[-6000:]
    assert "hvd-adapt-run: the script ended" in output and "SystemExit: 143" in output
    # Both ranks drained at one commit, which the checkpoint holds.
    drained = [json_lines(path) for path in tmp_path.glob("drained.*.jsonl")]
    assert len(drained) == 2 and {d[0]["code"] for d in drained} == {143}
    assert os.path.exists(checkpoint)
    assert {entries[0]["restarts"] for entries in read_attempts(out_dir).values()} == {0}


def stop(proc):
    """SIGKILL what is left of a supervisor's session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_job_runs_once_and_a_second_copy_meanwhile_is_refused(tmp_path):
    out_dir = str(tmp_path)
    script = os.path.join(WORKERS, "elastic_train.py")
    command = horovodrun_command(2, [script, "--epochs", "1", "--batch-seconds", "1.0"])
    # The default lock: the same command line in the same folder is the same job.
    first = subprocess.Popen(SUPERVISOR + ["--"] + command, env=launch_env(out_dir),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=out_dir,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(tmp_path / "committed") and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run(SUPERVISOR + ["--"] + command, env=launch_env(out_dir),
                                capture_output=True, text=True, cwd=out_dir, timeout=60)
        output = first.communicate(timeout=180)[0].decode()
    finally:
        stop(first)
    assert second.returncode == 1, second.stderr
    assert f"this job is already running (pid {first.pid} on" in second.stderr, second.stderr
    assert first.returncode == 0, output[-6000:]
    assert "hvd-adapt-run" not in output, output[-3000:]
    commits, totals = read_logs(out_dir)
    check_exactly_once(commits, totals, 1)
    assert len(read_attempts(out_dir)) == 2
