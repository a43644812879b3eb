"""Every host of a job replaced mid-epoch, on the namespace cluster: h2 and h3 (the job's
only hosts; the launcher runs on h1) lose every process at once and the discovery offers a
new host, h4 with two slots, in their place as soon as it answers; Horovod's driver gives up ("No hosts from
previous set remaining, unable to broadcast state.", horovod#3197, or "failure count == 2",
as the failures and the new offer race). Under hvd-adapt-run the job is launched again,
resumes from its last checkpoint on the new host and finishes: every sample once per
finished epoch, replicas identical. Plain horovodrun (main) ends the job there."""
import os
import sys

import faults
from training_logs import (check_exactly_once, check_identical_replicas,
                           check_resumed_from_checkpoint, lineage, read_attempts)

SUPERVISOR = [sys.executable, "-m", "hvd_adapt.scheduling.job_supervisor"]
BED_HOSTS = 4      # the launcher's, two lost, one new


def run_replacement(bed, job_dir, prefix):
    """The job on h2 and h3 (hvd-adapt-discover wrapping the host list, a checkpoint at every
    epoch's end), every host replaced mid-epoch by h4 (down until then); returns the
    FaultJob."""
    bed.crash("h4")
    return faults.run_fault(
        bed, job_dir, faults.replace_all_hosts, at_step=1, after_fault=240, np=2, min_np=2,
        hosts=["h2:1", "h3:1"], wrapped_discovery=True, prefix=prefix,
        worker_args=["--checkpoint", os.path.join(job_dir, "job.pt")])


def test_a_job_whose_every_host_is_replaced_mid_epoch_resumes_and_finishes(bed, job_dir):
    lock = os.path.join(job_dir, "job.lock")
    job = run_replacement(bed, job_dir, SUPERVISOR + ["--lock", lock, "--"])
    try:
        assert job.returncode == 0, job.describe()
        restarts = [line for line in job.output.splitlines()
                    if "hvd-adapt-run: restart 1 of 3" in line]
        assert len(restarts) == 1 and ("#3197" in restarts[0] or "every worker of the world "
                                       "failed" in restarts[0]), job.describe()
        attempts = read_attempts(job_dir)
        kept = lineage(job.commits, attempts)
        check_exactly_once(kept, job.epochs, 3, samples=faults.SAMPLES)
        check_identical_replicas(kept)
        check_resumed_from_checkpoint(job.commits, attempts, 1)
        assert len(kept) < len(job.commits), "the fault landed at an epoch's end"
        assert {(e["host"], e["size"]) for e in job.commits if e["time"] > job.answered} == \
            {("h4", 2)}
    finally:
        for host in ("h2", "h3", "h4"):
            bed.heal(host)
