"""Two elastic jobs share a pool of four namespace hosts through hvd-adapt-arbiter: one that
scales (its samples take an "accelerator"'s time) and one bound by its allreduce. Real ssh,
real horovodrun, AdamW and autoscaling; tests/support/pool.py says how the hosts' cores are
stood in for.

What it checks, from the logs: each job trains every sample once per epoch with identical
replicas across the arbiter's moves; no host ever runs workers of both jobs at once (every
worker process's whole life, lifetime.py); the job that had every host gives one back at a
commit for the job that arrives; and an arbiter killed mid-run, then restarted from its
state, costs the jobs nothing: no resize, no restore, from the kill until well after the
restart."""
import json
import os
import signal
import time

import pytest

from support import pool
from support.training_logs import check_exactly_once, check_identical_replicas

pytestmark = [pytest.mark.distributed, pytest.mark.elastic, pytest.mark.serial]

SAMPLES = 96
GIVE_BACK_SLOWLY = 8
# Seconds the arbiter stays dead, and the jobs are watched after its restart (a restarted
# arbiter makes no change by choice for --change-interval).
DOWN, AFTER = 15, 15
ARBITER = ("--change-interval", "30", "--gone-after", "10")


@pytest.fixture(scope="module")
def pool_bed(tmp_path_factory):
    from support import bed as cluster
    reason = cluster.missing()
    if reason:
        pytest.skip(reason)
    with cluster.Bed(5, ssh_options=cluster.KEEPALIVE,
                     root=str(tmp_path_factory.mktemp("bed"))) as made:
        yield made


def sizes_in(job, start, end):
    return {c["size"] for c in pool.rank0_commits(job) if start <= c["time"] <= end}


def test_two_jobs_share_four_hosts_through_the_arbiter_which_may_die(pool_bed, tmp_path):
    bed = pool_bed
    folder = str(tmp_path / "arbiter")
    hostfile = pool.write_hostfile(str(tmp_path / "pool"), pool.POOL)
    arbiter = pool.start_arbiter(bed, folder, hostfile, *ARBITER)
    # Both train until told to finish (at the end of an epoch), after the restart.
    a = pool.PoolJob("a", "scales", str(tmp_path / "a"), SAMPLES, None)
    b = pool.PoolJob("b", "comm", str(tmp_path / "b"), SAMPLES, None)
    events = {}
    try:
        # a asks for every host at first (no curve yet: its initial workers). Its first
        # host update is slow to take effect (rank 0 waits 8 s before the reset, within its
        # watchdog's grace): a host granted to b before a gave it back would run both
        # jobs' workers meanwhile.
        a.start(bed, pool.arbiter_discovery(a, folder, initial_np=4), np=4,
                worker_args=["--pause-on-interrupt", str(GIVE_BACK_SLOWLY)])
        assert pool.wait_until(lambda: sum(c["size"] == 4 for c in pool.rank0_commits(a)) >= 5,
                               300, [a]), a.output()[-5000:]
        events["b"] = time.time()
        b.start(bed, pool.arbiter_discovery(b, folder))
        # b's minimum needs a host: a gives one back at a commit, then b trains on it.
        assert pool.wait_until(lambda: len(pool.rank0_commits(b)) >= 10, 300, [a, b]), \
            b.output()[-5000:]
        # Kill it while nothing moves (a change decided just before the kill would still
        # be carried out by the jobs: that is not the kill's doing).
        for _ in range(3):
            assert pool.wait_until(lambda: pool.quiet_generation(folder, [a, b]) is not None,
                                   240, [a, b]), (a.output()[-3000:], b.output()[-3000:])
            generation = pool.quiet_generation(folder, [a, b])
            events["kill"] = time.time()
            arbiter.send_signal(signal.SIGKILL)
            arbiter.wait()
            with open(os.path.join(folder, "arbiter.json")) as f:
                if json.load(f)["generation"] == generation:
                    break
            arbiter = pool.start_arbiter(bed, folder, hostfile, *ARBITER)
        time.sleep(DOWN)
        events["restart"] = time.time()
        arbiter = pool.start_arbiter(bed, folder, hostfile, *ARBITER)
        time.sleep(AFTER)
        events["after"] = time.time()
        with open(os.path.join(folder, "arbiter.json")) as f:
            assert json.load(f)["generation"] == generation     # the restart changed nothing
        a.finish()
        b.finish()
        assert pool.wait_all([a, b], 300), (a.output()[-3000:], b.output()[-3000:])
    finally:
        pool.stop_all(bed, [a, b], arbiter)
    for job in (a, b):
        assert job.returncode == 0, job.output()[-5000:]
        commits, totals = job.logs()
        check_exactly_once(commits, totals, job.epochs_trained(), samples=SAMPLES)
        check_identical_replicas(commits)
    assert pool.shared_hosts([a, b]) == []
    # a trained on all four hosts until b came, then on fewer.
    assert sizes_in(a, 0, events["b"]) == {4}
    assert max(sizes_in(a, min(c["time"] for c in pool.rank0_commits(b)), events["kill"])) <= 3
    # From the kill until AFTER s after the restart: one world per job, no new attempt.
    for job in (a, b):
        window = (events["kill"] - 2, events["after"])
        assert len(sizes_in(job, *window)) == 1, (job.name, sizes_in(job, *window))
        assert not [t for t in pool.world_starts(job) if window[0] <= t <= window[1]], job.name
        steps = [c["step"] for c in pool.rank0_commits(job)
                 if window[0] <= c["time"] <= window[1] and c["optim"]]
        assert steps and steps == sorted(steps) and len(set(steps)) == len(steps), job.name
