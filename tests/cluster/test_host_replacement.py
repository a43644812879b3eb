"""Every host of a job replaced mid-epoch, on the namespace cluster: h2 and h3 (the job's
only hosts; the launcher runs on h1) lose every process at once, and either the discovery
offers a new host, h4 with two slots, as soon as it answers, or h2 and h3 come back under
their names (a StatefulSet's pods). Horovod's driver then gives up ("No hosts from previous
set remaining, unable to broadcast state.", horovod#3197, or "failure count == 2", as the
failures and the new offer race; horovodrun at times hangs after saying it), or, with the
same names back, waits for ever with no worker. Under hvd-adapt-run the job is launched
again, resumes from its last checkpoint on the new hosts and finishes: every sample once
per finished epoch, replicas identical. Plain horovodrun (main) ends or hangs there."""
import os
import sys

import pytest

from support import faults
from support.training_logs import (check_exactly_once, check_identical_replicas,
                                   check_resumed_from_checkpoint, lineage, read_attempts)

SUPERVISOR = [sys.executable, "-m", "hvd_adapt.scheduling.job_supervisor"]
BED_HOSTS = 4      # the launcher's, two lost, one new


@pytest.mark.parametrize("new", ["h4", None], ids=["new_host", "same_names_back"])
def test_a_job_whose_every_host_is_replaced_mid_epoch_resumes_and_finishes(new, bed, job_dir):
    bed.crash("h4")    # down until it replaces the lost hosts
    job = faults.run_fault(
        bed, job_dir, lambda bed, job: faults.replace_all_hosts(bed, job, new=new),
        at_step=1, after_fault=240, np=2, min_np=2, hosts=["h2:1", "h3:1"],
        wrapped_discovery=True, worker_args=["--checkpoint", os.path.join(job_dir, "job.pt")],
        prefix=SUPERVISOR + ["--lock", os.path.join(job_dir, "job.lock"), "--"])
    try:
        assert job.returncode == 0, job.describe()
        restarts = [line for line in job.output.splitlines()
                    if "hvd-adapt-run: restart 1 of 3" in line]
        said = ("#3197", "every worker of the world failed", "every worker was lost")
        assert len(restarts) == 1 and any(s in restarts[0] for s in said), job.describe()
        attempts = read_attempts(job_dir)
        kept = lineage(job.commits, attempts)
        check_exactly_once(kept, job.epochs, 3, samples=faults.SAMPLES)
        check_identical_replicas(kept)
        check_resumed_from_checkpoint(job.commits, attempts, 1)
        assert len(kept) < len(job.commits), "the fault landed at an epoch's end"
        hosts = {(e["host"], e["size"]) for e in job.commits if e["time"] > job.answered}
        assert hosts == ({("h4", 2)} if new else {("h2", 2), ("h3", 2)}), hosts
    finally:
        for host in ("h2", "h3", "h4"):
            bed.heal(host)
