"""Elastic recovery paths that used to lose work or crash healthy workers, under a real
elastic horovodrun (AdamW with weight decay, bf16 autocast with a GradScaler): a sync moves
every rank's restore point, slow workers join, a GradScaler's backed-off scale reaches a
joining worker, accumulator updates survive a removal raised between commits, and a host
added during a reset is not forgotten.
"""
import os

import pytest

from support.elastic_jobs import run_elastic, sizes_in_order
from support.training_logs import check_exactly_once, check_identical_replicas, read_attempts

pytestmark = [pytest.mark.distributed, pytest.mark.elastic]

RECIPE = ["--adamw", "--amp", "--batch-size", "8"]
HELD = ("step", "epoch", "position", "params", "optimizer", "scale", "generation")


def held(entry):
    return {key: entry[key] for key in HELD}


def test_a_worker_killed_right_after_a_joining_sync_leaves_the_joiner_at_the_synced_state():
    # 127.0.0.1 joins at step 4; localhost (rank 0) dies right after the sync,
    # before any commit. The joiner, alone, restores: to what it was synced
    # to, not to its own freshly built model at epoch 0, position 0.
    schedule = [(0, ["localhost:1"]), (4, ["localhost:1", "127.0.0.1:1"])]
    args = RECIPE + ["--epochs", "3", "--wait-steps", "[4]", "--kill-after-join", "localhost"]
    job, commits, epochs = run_elastic(schedule, np=1, min_np=1, max_np=2, worker_args=args)
    job.check()
    joiner = next(entries for entries in read_attempts(job.out_dir).values()
                  if entries[0]["host"] == "127.0.0.1")
    assert [e["size"] for e in joiner[:2]] == [2, 1], joiner
    synced, restored = joiner[0], joiner[1]
    assert synced["step"] == 4 and synced["epoch"] == 0 and synced["position"] > 0
    assert held(restored) == held(synced)
    assert {e["host"] for e in commits if e["step"] > 4} == {"127.0.0.1"}
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


def test_a_restart_from_a_checkpoint_whose_rank_0_dies_before_any_commit(tmp_path):
    path = str(tmp_path / "job.pt")
    hosts = [(0, ["localhost:1", "127.0.0.1:1"])]
    first, _, _ = run_elastic(hosts, np=2, min_np=1, max_np=2,
                              worker_args=RECIPE + ["--epochs", "2", "--checkpoint", path])
    first.check()
    args = RECIPE + ["--epochs", "4", "--checkpoint", path, "--kill-after-join", "localhost"]
    job, commits, epochs = run_elastic(hosts, np=2, min_np=1, max_np=2, worker_args=args)
    job.check()
    survivor = next(entries for entries in read_attempts(job.out_dir).values()
                    if entries[0]["host"] == "127.0.0.1")
    loaded, restored = survivor[0], survivor[1]
    # The restart began at the checkpoint (epoch 2), on both ranks, and the
    # survivor restored to it, not to its own fresh model.
    assert loaded["epoch"] == 2
    assert held(restored) == held(loaded)
    assert loaded["generation"] > 0
    check_exactly_once(commits, epochs, 4, first_epoch=2)
    check_identical_replicas(commits)


@pytest.mark.parametrize("seconds", [8, 40])
def test_a_worker_slow_to_start_joins(seconds):
    # ssh, a container and imports take seconds on a cluster: the survivors
    # wait in the rendezvous for the joining worker instead of timing out.
    schedule = [(0, ["localhost:1"]), (4, ["localhost:1", "127.0.0.1:1"])]
    args = RECIPE + ["--epochs", "3", "--wait-steps", "[4]", "--slow-join", seconds,
                     "--hold-seconds", seconds + 30]
    job, commits, epochs = run_elastic(schedule, np=1, min_np=1, max_np=2, worker_args=args,
                                       timeout=240)
    job.check()
    assert sizes_in_order(commits) == [1, 2]
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


def test_a_joining_worker_gets_the_backed_off_grad_scale():
    # The scale backs off twice (overflows at steps 1 and 2) before 127.0.0.1
    # joins at step 5: the joiner must unscale by the same factor as the survivor.
    schedule = [(0, ["localhost:1"]), (5, ["localhost:1", "127.0.0.1:1"])]
    args = RECIPE + ["--epochs", "3", "--wait-steps", "[5]", "--inf-steps", "[1, 2]"]
    job, commits, epochs = run_elastic(schedule, np=1, min_np=1, max_np=2, worker_args=args)
    job.check()
    assert sizes_in_order(commits) == [1, 2]
    assert min(e["scale"] for e in commits if e["size"] == 1) < 2.0 ** 12, "no back-off"
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


def test_accumulator_updates_survive_a_removal_raised_between_commits():
    # Commits every 4th step, host checks in between (the digits example's
    # pattern): the removed worker's counts since the last commit still count.
    schedule = [(0, ["localhost:1", "127.0.0.1:1"]), (6, ["localhost:1"])]
    args = RECIPE + ["--epochs", "3", "--wait-steps", "[6]", "--commit-every", "4"]
    job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=2, worker_args=args)
    job.check()
    assert sizes_in_order(commits) == [2, 1]
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


def test_a_host_added_during_a_reset_joins_without_another_discovery_change():
    # 127.0.0.1 is added at step 4 and starts slowly (8 s); 3 s into the reset
    # a second localhost slot is added. The driver tells rank 0 while it waits
    # in the rendezvous: that message must survive the reset, so the third
    # worker joins at the next commit although discovery never changes again.
    # (Where the driver forms the world of 3 while the world of 2 still meets,
    # waiting for its slow worker, the world of 2 never commits: [1, 3].)
    schedule = [(0, ["localhost:1"]), (4, ["localhost:1", "127.0.0.1:1"]),
                (4, ["localhost:2", "127.0.0.1:1"], 3.0)]
    args = RECIPE + ["--epochs", "3", "--wait-steps", "[4, 6]", "--slow-join", 8]
    job, commits, epochs = run_elastic(schedule, np=1, min_np=1, max_np=3, worker_args=args,
                                       timeout=240)
    job.check()
    assert sizes_in_order(commits) in ([1, 2, 3], [1, 3]), sizes_in_order(commits)
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)


@pytest.mark.parametrize("schedule,np,kill", [
    ([(0, ["localhost:2"]), (5, ["localhost:3"]), (10, ["localhost:2"])], 2, []),
    ([(0, ["localhost:2", "127.0.0.1:1"])], 3, ["--kill-step", "5", "--kill-host", "127.0.0.1"]),
], ids=["resize-2-3-2", "sigkill"])
def test_optimizer_state_on_disk_through_resizes_and_kills(schedule, np, kill, tmp_path):
    # The state travels to a joining worker a chunk at a time, a commit and a
    # restore are generations of files: the same checks as in memory.
    args = RECIPE + ["--epochs", "3", "--wait-steps", "[5, 10]", "--swap-dir", str(tmp_path)] + kill
    job, commits, epochs = run_elastic(schedule, np=np, min_np=1, max_np=3, worker_args=args,
                                       launcher_args=["--blacklist-cooldown-range", 1, 3])
    job.check()
    assert len(set(sizes_in_order(commits))) >= 2, sizes_in_order(commits)
    check_exactly_once(commits, epochs, 3)
    check_identical_replicas(commits)
    # Every process that ended removed its files; a killed one could not.
    left = [name for name in os.listdir(tmp_path) if name.startswith("hvd_adapt-swap")]
    assert len(left) <= (1 if kill else 0), left


def test_a_slow_but_healthy_worker_is_not_killed_by_its_watchdog():
    """localhost's second worker waits 8 s before every batch (a slow data loader) and
    127.0.0.1 dies at step 2. The fast survivor resets within Gloo's timeout (3 s here),
    the slow one once its wait ends, 5 s or more later; its heartbeat beats meanwhile, so
    its watchdog leaves it alone (_runtime/liveness.py). It trains on in the world of
    two."""
    schedule = [(0, ["localhost:2", "127.0.0.1:1"])]
    args = RECIPE + ["--samples", "16", "--epochs", "2", "--kill-step", "2",
                     "--kill-host", "127.0.0.1", "--slow-batches", "localhost:1:8"]
    job, commits, epochs = run_elastic(
        schedule, np=3, min_np=2, max_np=3, worker_args=args,
        launcher_args=["--blacklist-cooldown-range", 60, 61],
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "3"})
    job.check()
    assert "ending the worker" not in job.output, job.output[-3000:]
    check_exactly_once(commits, epochs, 2, samples=16)
    check_identical_replicas(commits)
    slow = [name.split(".")[1] for name in os.listdir(job.out_dir) if name.startswith("slow.")]
    assert len(slow) == 1, slow
    sizes = [e["size"] for e in commits if e["pid"] == f"commits.{slow[0]}.jsonl"]
    assert sizes[0] == 3 and sizes[-1] == 2, sizes
