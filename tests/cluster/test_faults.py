"""One host's failure in a 3-host elastic job on the namespace cluster (real ssh, AdamW, a
GradScaler, autoscaling with accumulation): the job trains on, every sample once per epoch,
replicas identical. Each job gets ``after_fault`` seconds after the fault for about 15 s of
training: a survivor that waits out a 60 s Gloo timeout, hangs, or dies fails the test."""
from support import faults
from support.training_logs import check_exactly_once, check_identical_replicas


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


def test_a_worker_twenty_seconds_slow_to_start_joins(bed, job_dir):
    """A cold joiner: the survivors wait for it with Horovod's driver (their meeting asked
    it for the next world), not in Gloo's rendezvous, whose timeout is 5 s; it asks for
    that world when it arrives, and joins. (A crashed host that discovery still lists:
    tests/cluster/test_launcher.py.)"""
    job = faults.run_fault(bed, job_dir, lambda bed, job: job.set_hosts(faults.ALL),
                           hosts=["h1:1", "h2:1"], np=2, after_fault=90,
                           worker_args=["--slow-join", "20"])
    check_trained_on(job, sizes_after={3})
