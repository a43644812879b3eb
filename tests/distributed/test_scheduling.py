"""hvd-adapt-discover and hvd-adapt-worker under a real elastic horovodrun on localhost.

``localhost``, ``127.0.0.1`` and this machine's own name count as three
hosts for Horovod (each resolves to a local address, so no ssh is needed).
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from support.elastic_jobs import run_elastic, sizes_in_order, worker_command
from support.launch import BIN, launch_env
from support.soak import pauses
from support.training_logs import check_exactly_once, check_identical_replicas, read_attempts

pytestmark = [pytest.mark.distributed, pytest.mark.elastic, pytest.mark.serial]

DISCOVER = os.path.join(BIN, "hvd-adapt-discover")
WORKER = os.path.join(BIN, "hvd-adapt-worker")
SLOW_START = 8.0


def start_standby(out_dir, folder, host, worker_args):
    """``hvd-adapt-worker --standby`` for ``host``, as a pod's command would start it."""
    log = open(os.path.join(out_dir, f"standby.{host}.log"), "w")
    return subprocess.Popen(
        [WORKER, "--standby", "--standby-dir", folder, "--host", host, "--",
         *worker_command(worker_args)],
        env=launch_env(out_dir), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(condition, seconds):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def progress(out_dir):
    try:
        with open(os.path.join(out_dir, "progress")) as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def test_a_warm_standby_joins_without_stopping_the_survivor(tmp_path):
    # The new host's worker needs SLOW_START seconds before init() (a cluster's
    # container start and imports). It boots as a standby while the job trains
    # on one worker; hvd-adapt-discover offers the host only once the standby
    # is ready, and the launch stub hands the slot to it: the survivor's pause
    # is the rendezvous alone.
    out_dir, folder = str(tmp_path / "job"), str(tmp_path / "standbys")
    os.makedirs(out_dir)
    worker_args = ["--epochs", 14, "--batch-seconds", 0.25, "--slow-join", SLOW_START,
                   "--adamw", "--amp"]
    schedule = [(0, ["localhost:1"]), (6, ["localhost:1", "127.0.0.1:1"])]

    def discovery(script):
        return (f"{DISCOVER} --command {script} --standby-dir {folder} --ssh-port 0 "
                f"--min-np 1 --max-np 2 --state {out_dir}/discover.state.json")

    standbys = [start_standby(out_dir, folder, "localhost", worker_args)]
    result = {}
    job = threading.Thread(target=lambda: result.update(zip(
        ("job", "commits", "epochs"),
        run_elastic(schedule, np=1, min_np=1, max_np=2, worker_args=worker_args, timeout=240,
                    out_dir=out_dir, discovery=discovery, launch_prefix=[WORKER, "--standby-dir",
                                                                         folder, "--"]))))
    job.start()
    try:
        wait_for(lambda: progress(out_dir) >= 6 or not job.is_alive(), 120)
        booting_from = time.time()
        standbys.append(start_standby(out_dir, folder, "127.0.0.1", worker_args))
        job.join(300)
    finally:
        for standby in standbys:
            try:
                standby.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(standby.pid, 9)
                standby.wait()
    job_result, commits, epochs = result["job"], result["commits"], result["epochs"]
    job_result.check()
    assert [s.returncode for s in standbys] == [0, 0]
    assert sizes_in_order(commits) == [1, 2], sizes_in_order(commits)
    check_exactly_once(commits, epochs, 14)
    check_identical_replicas(commits)
    # Both slots ran in the booted standbys: the stub found one ready each time.
    assert "starting cold" not in job_result.output and "blacklist" not in job_result.output
    attempts = [a for entries in read_attempts(out_dir).values() for a in entries]
    joiner = [a for a in attempts if a["host"] == "127.0.0.1"]
    assert joiner and {a["ppid"] for a in joiner} == {standbys[1].pid}
    assert {a["ppid"] for a in attempts if a["host"] == "localhost"} == {standbys[0].pid}
    # The survivor trained alone while the standby booted, and paused far less
    # than the start-up it would otherwise have waited for.
    first_two = min(c["time"] for c in commits if c["size"] == 2)
    alone = [c for c in commits if c["size"] == 1 and booting_from + SLOW_START < c["time"]
             < first_two]
    assert len(alone) >= 4, alone
    assert pauses(commits)[0] < SLOW_START / 2, pauses(commits)


def test_the_wrapper_follows_a_base_discovery_that_changes(tmp_path):
    # A fake of the MPI Operator's discover_hosts.sh as pods come and go: the base
    # list grows, loses a host and gets it back; hvd-adapt-discover passes the
    # changes on (every host ready, no hints), keeping the existing host first.
    out_dir = str(tmp_path / "job")
    os.makedirs(out_dir)
    me = socket.gethostname()
    # Host names alone, one per line, as the operator's script prints them.
    schedule = [(0, ["localhost"]), (4, ["localhost", "127.0.0.1"]),
                (12, ["localhost"]), (20, [me, "localhost"])]

    def discovery(script):
        return (f"{DISCOVER} --command {script} --slots 1 --ssh-port 0 --min-np 1 --max-np 2 "
                f"--state {out_dir}/discover.state.json")

    job, commits, epochs = run_elastic(schedule, np=1, min_np=1, max_np=2, timeout=240,
                                       worker_args=["--epochs", 10 ** 6, "--until-step", 30,
                                                    "--wait-steps", "[4, 12, 20]"],
                                       out_dir=out_dir, discovery=discovery)
    job.check()
    assert sizes_in_order(commits) == [1, 2, 1, 2], sizes_in_order(commits)
    check_exactly_once(commits, epochs, len({e["epoch"] for e in epochs}))
    check_identical_replicas(commits)
    assert "blacklist" not in job.output
    hosts = {c["host"] for c in commits if c["size"] == 2}
    assert hosts == {"localhost", "127.0.0.1", me}, hosts


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def goodput_job(tmp_path, model_args, until_step, efficiency):
    """An autoscaling job on three "hosts" under hvd-adapt-discover with the job's hints:
    returns the job, its commits and the sizes it trained at, in order."""
    out_dir = str(tmp_path / "job")
    os.makedirs(out_dir)
    hints = str(tmp_path / "hints.json")
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"localhost:1\n127.0.0.1:1\n{socket.gethostname()}:1\n")
    discovery = (f"{DISCOVER} --hostfile {hostfile} --hints {hints} --ssh-port 0 "
                 f"--min-np 1 --max-np 3 --initial-np 1 --hold 8 --efficiency {efficiency}")
    job, commits, epochs = run_elastic(
        [(0, ["localhost:1"])], np=1, min_np=1, max_np=3, timeout=400, out_dir=out_dir,
        discovery=lambda script: discovery, env={"HVD_ADAPT_HINTS": hints},
        worker_args=[*model_args, "--autoscale", "--decide-every", 4, "--adamw",
                     "--epochs", 10 ** 6, "--until-step", until_step],
        # Polled every second, as in production: the wrapper's interpreter
        # start every 0.2 s would take a share of the two cores the workers
        # are timed on.
        launcher=os.path.join(BIN, "horovodrun"))
    job.check()
    check_exactly_once(commits, epochs, len({e["epoch"] for e in epochs}))
    check_identical_replicas(commits)
    assert "blacklist" not in job.output
    return job, commits, sizes_in_order(commits)


def test_a_compute_bound_job_is_offered_more_workers(tmp_path):
    # The three "hosts" share this machine's two cores: compute on those cores
    # would make a third worker slow down the other two (it did on a loaded CI
    # machine: sizes [1, 2, 3, 1]). Most of each sample's compute is therefore
    # a sleep, as on hosts that each have their own accelerator; the rest is a
    # real model's forward and backward, whose gradients the noise scale reads.
    # 0.1 s a sample, not 0.03: two workers sharing the two cores spend about
    # 0.1 s a step on their real compute, allreduce and commit, which at 0.03 s
    # a sample outweighed the sleep, timed a speed-up of 1.31-1.36 at two and
    # shrank the job to one (CI failed with sizes [1, 2, 1]).
    job, commits, sizes = goodput_job(
        tmp_path, ["--model", "deep", "--tokens", 32, "--sample-seconds", 0.1],
        until_step=60, efficiency=0.5)
    print(sizes, [line for line in job.output.splitlines() if "hvd-adapt-discover" in line])
    assert sizes[0] == 1 and max(sizes) >= 2, sizes
    assert sizes[-1] >= 2, sizes
    # Not only the first offer, made before two workers were timed: the job's
    # last curve, fitted on its own timings at two counts, still says a second
    # worker pays (what failed on CI, where it shrank back to one).
    hints = json.loads((tmp_path / "hints.json").read_text())
    assert hints["timed_two_counts"] and 2 in hints["replica_counts_timed"], hints
    speedup = {point["replicas"]: point["speedup"] for point in hints["curve"]}
    assert speedup[2] - speedup[1] >= 0.5, speedup


def test_a_communication_bound_job_stays_small(tmp_path):
    # The three "hosts" share this machine's two cores, with the launcher and
    # Horovod's threads: a second worker brings at most about 0.5 of one here
    # (a second machine would bring nearly 1), hence the lower efficiency.
    # 120 steps: it times two workers by step 20 or so and then trains about
    # 100 steps (several --hold periods) at one without being offered more.
    job, commits, sizes = goodput_job(tmp_path, ["--model", "wide"], until_step=120,
                                      efficiency=0.25)
    print(sizes, [line for line in job.output.splitlines() if "hvd-adapt-discover" in line])
    # The curve may send it to two workers once, to time what communication
    # costs; after that (or at once) it says a second worker does not pay.
    assert max(sizes) <= 2 and sizes[-1] == 1, sizes
