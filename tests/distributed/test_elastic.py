"""Elastic runs under horovodrun with a host-discovery script that changes over time.

The discovery script follows the job's own progress file (steps committed),
so resizes land at chosen steps whatever the speed of the machine. The job
logs what every rank committed; the tests check that every epoch trained on
each sample exactly once and that accumulator totals equal the closed form of
a run without resizes.
"""
import collections
import os
import sys
import tempfile

import pytest

from support.elastic_jobs import FAST_HOROVODRUN, discovery_script, run_elastic, sizes_in_order
from support.launch import WORKERS, run_job
from support.training_logs import check_exactly_once, check_identical_replicas, read_attempts

pytestmark = [pytest.mark.distributed, pytest.mark.elastic]


@pytest.mark.parametrize("autoscale", [False, True], ids=["fixed-bsz", "autoscale"])
def test_resize_2_3_1_2_exactly_once(autoscale):
    # Resizes at steps that are not multiples of MEASURE_EVERY: a joining worker
    # must still measure the noise on the same steps as the survivors.
    schedule = [(0, ["localhost:2"]), (5, ["localhost:3"]), (10, ["localhost:1"]),
                (15, ["localhost:2"])]
    args = ["--batch-size", "8", "--wait-steps", "[5, 10, 15]"]
    if autoscale:
        # Three epochs of 60 samples are 24 steps at B0 but 6 at the largest
        # batch allowed (32): train until the last resize has come, whatever
        # the batch sizes chosen.
        args += ["--autoscale", "--epochs", str(10 ** 6), "--until-step", "17"]
    else:
        args += ["--epochs", "3"]
    # Without OMP_NUM_THREADS torch's threads follow the world: each of the
    # replicas on this host gets its share of the CPUs, again after each resize.
    env = {"OMP_NUM_THREADS": None} if autoscale else None
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=3, worker_args=args,
                                       env=env)
    job.check()
    assert sizes_in_order(commits) == [2, 3, 1, 2], sizes_in_order(commits)
    check_exactly_once(commits, epochs, 1 + max(e["epoch"] for e in epochs) if autoscale else 3)
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


def test_a_worker_killed_long_after_the_last_snapshot_loses_no_sample_and_no_step():
    # A budget so small that, after the first, only what must snapshot does (the epoch's
    # ends, the resize): the kill at step 5 sends the survivors back four commits or more,
    # to the first snapshot (the start's sync or the first commit), with everything of that
    # step (loader positions, accumulator totals, optimizer state, the commit log), and they
    # train those steps again.
    schedule = [(0, ["localhost:2", "127.0.0.1:1"])]
    args = ["--epochs", "3", "--batch-size", "9", "--kill-step", "5", "--kill-host", "127.0.0.1",
            "--snapshot-budget", "1e-9"]
    job, commits, epochs = run_elastic(schedule, np=3, min_np=1, max_np=3, worker_args=args)
    job.check()
    restored = [entries[1] for entries in read_attempts(job.out_dir).values()
                if len(entries) > 1]
    assert restored and all(entry["size"] == 2 and entry["step"] <= 1 for entry in restored), \
        [(e["size"], e["step"], e["generation"]) for e in restored]
    # What the world of 3 trained was never snapshotted: none of it stands.
    assert sizes_in_order(commits) == [2]
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


@pytest.mark.parametrize("gap", [0.1, 0.4], ids=["one-poll", "two-polls"])
def test_a_removal_and_an_addition_a_poll_or_two_apart(gap):
    # 127.0.0.1's worker is removed and, within one or two discovery polls
    # (0.2 s), a second localhost worker added. Where the survivor resets for
    # the removal alone (Horovod lets it skip the sync) while the new world
    # already holds the joining worker, two paths hung before the sync
    # agreement; this schedule did not hit that window on this machine (with
    # the agreement taken out it passes too), the test below times it. What
    # it checks is the rest: the job finishes, each sample once, replicas alike.
    schedule = [(0, ["localhost:1", "127.0.0.1:1"]), (6, ["localhost:1"]),
                (6, ["localhost:2"], gap)]
    # Held at step 8 too, so that the addition lands before the job ends.
    args = ["--epochs", "3", "--batch-size", "8", "--wait-steps", "[6, 8]"]
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=3, worker_args=args,
                                       timeout=150)
    job.check()
    assert sizes_in_order(commits)[-1] == 2, sizes_in_order(commits)
    assert {e["host"] for e in commits if e["step"] > 6} == {"localhost"}
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


def test_an_addition_between_a_removal_and_its_reset_joins_a_full_sync():
    # The survivor (rank 0) is interrupted for the removal of 127.0.0.1 alone,
    # so Horovod lets it skip its sync; before it resets, discovery adds a
    # second localhost slot, and the world built at the reset's rendezvous
    # holds a new worker that Horovod syncs in full. Without the agreement in
    # State's sync the two sat in different collectives until the timeout.
    schedule = [(0, ["localhost:1", "127.0.0.1:1"]), (6, ["localhost:1"]),
                (6, ["localhost:2"], "interrupted")]
    args = ["--epochs", "3", "--batch-size", "8", "--wait-steps", "[6]",
            "--pause-on-interrupt", "2"]
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=3, worker_args=args,
                                       timeout=120)
    job.check()
    after = [e for e in commits if e["step"] > 6]
    assert {(e["host"], e["size"]) for e in after} == {("localhost", 2)}, after[:4]
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


def test_a_raw_hvd_elastic_run_grows_with_a_worker_slow_to_start():
    """hvd_adapt.init() with Horovod's own hvd.elastic.run: its resets have no meeting, so
    they keep Horovod's Gloo timeout (30 s), and a joiner 12 s slow to start joins; its
    own init() meets the survivors in Gloo's rendezvous. When hvd_adapt.init() left its
    5 s timeout in the environment for every later hvd.init(), the survivors gave up on
    the joiner and the job died, and the joiner's meeting waited for them in vain."""
    out_dir = tempfile.mkdtemp(prefix="hvd_adapt_raw_elastic_")
    script = discovery_script(out_dir, [(0, ["localhost:2"]), (3, ["localhost:3"])])
    command = [sys.executable, FAST_HOROVODRUN, "-np", "2", "--min-np", "2", "--max-np", "3",
               "--network-interface", "lo", "--host-discovery-script", script,
               sys.executable, os.path.join(WORKERS, "raw_elastic.py"), "--slow-join", "12",
               "--steps", "30"]
    job = run_job(command, out_dir=out_dir, timeout=150)
    job.check()
    assert job.reports[0] == {"sizes": [2, 3], "step": 30}, job.reports
