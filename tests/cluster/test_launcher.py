"""The launcher and a busy rank in a 3-host elastic job on the namespace cluster, horovodrun on
a host of its own (h0; ssh without keepalive, as ssh's defaults have it): liveness by
evidence (hvd_adapt/_runtime/liveness.py). No healthy worker is killed: not while the
launcher is cut off from every worker (they still reach each other), however long, nor
rank 0 working alone for 30 s while a peer's host crashes. A worker is ended where its
launcher is gone for good (horovodrun SIGKILLed), and the survivors stop waiting for a
relaunch that the driver recorded as failed at once (not after a start timeout).

On c8cc5bc (before this work) both jobs fail: every watchdog killed its worker 10 s into
the launcher's outage ("the rendezvous server has not answered for 10 s") and
hvd-adapt-discover ended every session after 2 s, and rank 0 was killed 10 s after its
peers reset ("its peers reset 10 s ago and it did not follow"); a relaunch refused cost
the survivors HVD_ADAPT_START_TIMEOUT_SECONDS (60 s) each time."""
import json

import pytest

from support import bed as cluster
from support import faults
from support.training_logs import check_exactly_once, check_identical_replicas


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """Three worker hosts and the launcher's own, without ssh keepalive: with one, ssh ends
    every session 6 s into a launcher outage, and Horovod's driver gives up on every worker
    (docs/elastic.md)."""
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    with cluster.Bed(3, launcher=True, root=str(tmp_path_factory.mktemp("bed"))) as made:
        yield made


def finished(job):
    """The commits of the epochs rank 0 finished (a killed job's last epoch is partial), and
    how many."""
    done = {entry["epoch"] for entry in job.epochs}
    count = len(done)
    assert done == set(range(count)), job.describe()
    return [entry for entry in job.commits if entry["epoch"] < count], count


def test_the_launcher_cut_off_for_12_then_30_seconds_then_killed(bed, job_dir):
    """hvd-adapt-discover wraps the host list (a user's setup): its probes hear nothing
    from any host during an outage, and it keeps their sessions, since no worker resets.
    The workers train through both outages, never reset, and end once horovodrun is
    SIGKILLed (the launcher's session to each is gone)."""
    def inject(bed, job):
        faults.launcher_cut_off(bed, job)
        faults.kill_launcher(bed, job)

    job = faults.run_fault(bed, job_dir, inject, epochs=10 ** 6, after_fault=240,
                           wrapped_discovery=True)
    assert len(job.outages) == 2 and hasattr(job, "killed_at"), job.describe()
    commits, epochs = finished(job)
    check_exactly_once(commits, job.epochs, epochs, samples=faults.SAMPLES)
    check_identical_replicas(job.commits)
    # Nobody was ended and nobody reset: the three first workers trained throughout, at 3,
    # through each outage as well.
    assert "ending the worker" not in job.output, job.describe()
    assert "ending the job's" not in job.output, job.describe()
    assert len({entry["pid"] for entry in job.commits}) == 3, job.describe()
    assert {entry["size"] for entry in job.commits} == {3}, job.describe()
    for cut, healed in job.outages:
        assert any(cut + 1 < entry["time"] < healed for entry in job.commits), \
            (cut, healed, job.describe())
    assert any(entry["time"] > job.outages[-1][1] for entry in job.commits), job.describe()
    # horovodrun SIGKILLed: no orphan trains on.
    assert not job.left, (job.left, job.describe())


def test_rank_0_working_alone_is_not_killed_and_a_refused_relaunch_costs_no_timeout(
        bed, job_dir):
    """Rank 0 computes alone for 30 s (an evaluation); 5 s into it the last rank's host
    crashes, and a plain discovery still lists it. The third worker resets at once, rank 0
    when its work is done and its next collective fails, and the two train on. After each
    blacklist cooldown (1-3 s) the driver relaunches on the crashed host, ssh is refused,
    and the survivors, who asked the driver for the next world 2 s into their meeting, go
    on without it: the job finishes, and nobody waited out HVD_ADAPT_START_TIMEOUT_SECONDS
    (default, 60 s)."""
    job = faults.run_fault(bed, job_dir, faults.solo_work_then_crash, epochs=4,
                           after_fault=180, worker_args=["--solo-work", "[8, 30]"])
    try:
        assert job.crash_time is not None, job.describe()
        assert job.returncode == 0, job.describe()
        check_exactly_once(job.commits, job.epochs, 4, samples=faults.SAMPLES)
        check_identical_replicas(job.commits)
        assert "ending the worker" not in job.output, job.describe()
        # Rank 0 finished its work and trained on, in a world of two.
        with open(f"{job_dir}/solo_done") as f:
            rank_0 = f"commits.{json.loads(f.readline())['pid']}.jsonl"
        after = [entry for entry in job.commits if entry["time"] > job.crash_time + 25]
        assert {entry["size"] for entry in after} == {2}, job.describe()
        assert any(entry["pid"] == rank_0 for entry in after), job.describe()
        # The driver relaunched on h3 and ssh was refused, and nobody waited for it.
        assert "exit with status code 255" in job.output, job.describe()
        assert "did not start within" not in job.output, job.describe()
    finally:
        bed.heal(job.crashed or "h3")
