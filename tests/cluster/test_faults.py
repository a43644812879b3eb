"""One host's failure in a 3-host elastic job on the namespace cluster (real ssh, AdamW, a
GradScaler, autoscaling with accumulation): the job trains on, every sample once per epoch,
replicas identical. Each job gets ``after_fault`` seconds after the fault for about 15 s of
training: a survivor that waits out a 60 s Gloo timeout, hangs, or dies fails the test."""
import pytest

import faults
from training_logs import check_exactly_once, check_identical_replicas


def check_trained_on(job, sizes_after):
    assert job.returncode == 0, job.describe()
    check_exactly_once(job.commits, job.epochs, 3, samples=faults.SAMPLES)
    check_identical_replicas(job.commits)
    after = {entry["size"] for entry in job.commits if entry["time"] > job.fault_time}
    assert after & set(sizes_after), (after, job.describe())


def crash_dropped(bed, job):
    job.set_hosts(["h1:1", "h2:1"])    # the cluster's scheduler notices the host is gone
    bed.crash("h3")


def test_survivors_train_on_after_a_host_crash(bed, job_dir):
    job = faults.run_fault(bed, job_dir, crash_dropped)
    try:
        check_trained_on(job, sizes_after={2})
    finally:
        bed.heal("h3")


def test_the_job_lives_while_discovery_still_lists_a_crashed_host(bed, job_dir):
    """The host is down, its pod not yet gone: after the blacklist's cooldown (1-3 s here)
    Horovod's driver launches on it again, ssh is refused, and the survivors, who wait
    for the new world's workers to start, give up on it after
    HVD_ADAPT_START_TIMEOUT_SECONDS (10 s here) and ask for another world. On main the
    survivors waited for it in Gloo's rendezvous and died with it (``failure count ==
    3 -> stop running``)."""
    job = faults.run_fault(bed, job_dir, lambda bed, job: bed.crash("h3"), after_fault=120,
                           env={"HVD_ADAPT_START_TIMEOUT_SECONDS": "10"})
    try:
        check_trained_on(job, sizes_after={2})
    finally:
        bed.heal("h3")


def test_a_worker_twenty_seconds_slow_to_start_joins(bed, job_dir):
    """A cold joiner: the survivors wait for it in their own meeting, not in Gloo's
    rendezvous, whose timeout is now 5 s."""
    job = faults.run_fault(bed, job_dir, lambda bed, job: job.set_hosts(faults.ALL),
                           hosts=["h1:1", "h2:1"], np=2, after_fault=90,
                           worker_args=["--slow-join", "20"])
    check_trained_on(job, sizes_after={3})
