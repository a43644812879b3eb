"""Elastic runs under horovodrun with a host-discovery script that changes over time.

The discovery script follows the job's own progress file (steps committed),
so resizes land at chosen steps whatever the speed of the machine. The job
logs what every rank committed; the tests check that every epoch trained on
each sample exactly once and that accumulator totals equal the closed form of
a run without resizes.
"""
import collections
import os
import stat
import sys
import tempfile

import pytest

from launch import WORKERS, run_job
from training_logs import SAMPLES, check_exactly_once, check_identical_replicas, read_logs

FAST_HOROVODRUN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "hvdrun_fast_discovery.py")

pytestmark = [pytest.mark.distributed, pytest.mark.elastic]


def discovery_script(out_dir, schedule):
    """``schedule``: [(first_step, [host lines])...], from step 0 on."""
    lines = ["#!/bin/bash", f'step=$(cat "{out_dir}/progress" 2>/dev/null || echo 0)']
    for i, (first, hosts) in enumerate(reversed(schedule)):
        keyword = "if" if i == 0 else "elif"
        lines.append(f'{keyword} [ "$step" -ge {first} ]; then')
        lines += [f'  echo "{h}"' for h in hosts]
    lines.append("fi")
    path = os.path.join(out_dir, "discover.sh")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def run_elastic(schedule, np, min_np, max_np, worker_args, timeout=180, env=None):
    out_dir = tempfile.mkdtemp(prefix="hvd_adapt_elastic_")
    command = [sys.executable, FAST_HOROVODRUN, "-np", str(np), "--min-np", str(min_np),
               "--max-np", str(max_np), "--network-interface", "lo",
               "--host-discovery-script", discovery_script(out_dir, schedule),
               sys.executable, os.path.join(WORKERS, "elastic_train.py"),
               "--samples", str(SAMPLES)] + [str(a) for a in worker_args]
    job = run_job(command, out_dir=out_dir, timeout=timeout, env=env)
    return (job,) + read_logs(out_dir)


def sizes_in_order(commits):
    by_step = {}
    for entry in commits:
        by_step.setdefault(entry["step"], set()).add(entry["size"])
    order = []
    for step in sorted(by_step):
        for size in sorted(by_step[step]):
            if not order or order[-1] != size:
                order.append(size)
    return order


@pytest.mark.parametrize("autoscale", [False, True], ids=["fixed-bsz", "autoscale"])
def test_resize_2_3_1_2_exactly_once(autoscale):
    schedule = [(0, ["localhost:2"]), (4, ["localhost:3"]), (8, ["localhost:1"]),
                (12, ["localhost:2"])]
    args = ["--epochs", "3", "--batch-size", "8", "--wait-steps", "[4, 8, 12]"]
    if autoscale:
        args.append("--autoscale")
    # Without OMP_NUM_THREADS torch's threads follow the world: each of the
    # replicas on this host gets its share of the CPUs, again after each resize.
    env = {"OMP_NUM_THREADS": None} if autoscale else None
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=3, worker_args=args,
                                       env=env)
    job.check()
    assert sizes_in_order(commits) == [2, 3, 1, 2], sizes_in_order(commits)
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)
    for entry in commits:
        share = min(entry["threads_before"], max(1, entry["cpus"] // entry["size"]))
        assert entry["threads"] == (share if autoscale else 1), entry
    if autoscale:
        by_step = collections.defaultdict(set)
        for entry in commits:
            by_step[(entry["step"], entry["size"])].add((entry["local_bsz"], entry["accum"]))
        assert all(len(choices) == 1 for choices in by_step.values()), by_step
        # After every resize the batch size was decided again, for the new world.
        decided = [e for e in commits if e["choice"] is not None]
        assert decided and all(e["choice"][2] == e["size"] for e in decided)


def test_worker_sigkill_exactly_once():
    schedule = [(0, ["localhost:2", "127.0.0.1:1"])]
    args = ["--epochs", "3", "--batch-size", "9", "--kill-step", "5", "--kill-host", "127.0.0.1"]
    job, commits, epochs = run_elastic(schedule, np=3, min_np=1, max_np=3, worker_args=args)
    job.check()
    assert sizes_in_order(commits) == [3, 2]
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)
