"""A silent partition of one host in a 3-host elastic job (tests/support/faults.py's job,
with hvd-adapt-discover wrapping the host list as a user would): its link goes down with no
reset, and ssh has NO keepalive on this bed, so nothing but hvd-adapt-discover's probe
ends the driver's ssh session to it (hvd_adapt/scheduling/sessions.py). Without that,
Horovod's driver waits for the session until the link heals, and each job here hits its
bound (``after_fault``): the test fails."""
import pytest

# Above hvd-adapt-discover's FREEZE_AFTER_END (6 s): a lost host is blacklisted until the
# next world has formed without it (docs/elastic.md).
COOLDOWN = ["--blacklist-cooldown-range", "7", "10"]

from support import bed as cluster
from support import faults
from support.training_logs import check_exactly_once, check_identical_replicas


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """The namespace cluster without ssh keepalive (conftest's bed sets one)."""
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    with cluster.Bed(3, launcher=True, root=str(tmp_path_factory.mktemp("bed"))) as made:
        assert "ServerAliveInterval" not in made.ssh_options
        yield made


def check_trained(job, epochs=3):
    assert job.returncode == 0, job.describe()
    check_exactly_once(job.commits, job.epochs, epochs, samples=faults.SAMPLES)
    check_identical_replicas(job.commits)


def sizes_after(job, since):
    return {entry["size"] for entry in job.commits if entry["time"] > since}


@pytest.mark.parametrize("fault", [faults.partition_dropped, faults.partition_listed],
                         ids=["dropped_by_discovery", "still_listed"])
def test_survivors_train_on_after_a_silent_partition(bed, job_dir, fault):
    job = faults.run_fault(bed, job_dir, fault, wrapped_discovery=True, launcher_args=COOLDOWN)
    try:
        check_trained(job)
        assert 2 in sizes_after(job, job.fault_time), job.describe()
        assert "ending the job's 1 session(s) to it" in job.output, job.describe()
    finally:
        bed.heal("h3")


def test_a_healed_host_rejoins(bed, job_dir):
    """Cut h3, the survivors train at 2, heal: h3's cut-off worker, which waited for the
    launcher, ends itself on what it finds (the world it trained in is gone), h3 answers
    again, rejoins with a fresh worker, and the job trains at 3 to its end; every sample
    once per epoch throughout, replicas identical."""
    job = faults.run_fault(bed, job_dir, faults.partition_then_heal, epochs=14,
                           after_fault=120, wrapped_discovery=True, launcher_args=COOLDOWN)
    try:
        assert job.heal_time is not None, f"never trained on at 2: {job.describe()}"
        assert job.ended_itself, f"h3's cut-off worker did not end itself: {job.describe()}"
        check_trained(job, epochs=14)
        assert 3 in sizes_after(job, job.heal_time), job.describe()
    finally:
        bed.heal("h3")
