"""Optimizer state on disk at two ranks: every rank's parameters and optimizer state after
every step, bitwise those of the same job with the state in memory, also where the state's
layout changes (a layer unfrozen after a commit and a restore, a param group added, a rank
joining afresh and syncing, as at a resize) and large weights are stepped in pieces."""
import json

import pytest

from support.elastic_jobs import run_elastic, sizes_in_order
from support.launch import run_ranks
from support.training_logs import check_exactly_once, check_identical_replicas

pytestmark = pytest.mark.distributed


RECIPES = ["adamw", "adamw+amp", "sgd"]


@pytest.fixture(scope="module")
def recipes_job(tmp_path_factory):
    """One job trains every recipe, in memory and then on disk (see swap_exact.py)."""
    root = tmp_path_factory.mktemp("swap_exact")
    return run_ranks("swap_exact.py", np=2, args=["--cases"] + RECIPES + ["--swap-root", root],
                     timeout=240)


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_train_bitwise_as_with_the_state_in_memory(recipe, recipes_job):
    runs = recipes_job.case(recipe)
    steps = runs[0]["memory"]["steps"]
    assert len(steps) == 12 and all(s["accumulation"] == 1 for s in steps)
    assert steps[-1]["noise"][0] > 0, "the noise was measured"
    for rank in (0, 1):
        assert runs[rank]["memory"]["steps"] == steps
        assert runs[rank]["swapped"]["steps"] == steps, rank
        # The swapped run's state was on disk at every step; the other's never.
        assert runs[rank]["memory"]["swap_steps"] == 0
        assert runs[rank]["swapped"]["swap_steps"] == 12, runs[rank]["swapped"]["swap_steps"]


def test_layouts_that_change_at_two_ranks_stay_bitwise_as_in_memory(tmp_path):
    memory = run_ranks("swap_layouts.py", np=2).check().reports
    swapped = run_ranks("swap_layouts.py", np=2, args=["--swap-dir", tmp_path]).check().reports
    steps = memory[0]["steps"]
    # Restored to step 2 (the unfrozen weight's state is dropped, and it starts again),
    # a group added after step 5, a joiner's sync after step 7.
    assert [s["steps"] for s in steps] == [
        [1.0], [2.0], [1.0, 3.0], [2.0, 4.0], [1.0, 3.0], [1.0, 2.0, 4.0], [2.0, 3.0, 5.0],
        [3.0, 4.0, 6.0], [4.0, 5.0, 7.0]]
    for rank in (0, 1):
        assert memory[rank]["steps"] == steps
        for got, want in zip(swapped[rank]["steps"], steps):
            assert got == want, (rank, want["label"])


def test_a_full_disk_on_one_rank_fails_the_step_on_every_rank_alike(tmp_path):
    import subprocess
    full = tmp_path / "full"
    full.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(full)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root and mount rights: {done.stderr.strip()}")
    try:
        reports = run_ranks("swap_full.py", np=2,
                            args=[tmp_path / "disk", full]).check().reports
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)
    for rank in (0, 1):
        assert "the optimizer step was not taken" in reports[rank]["error"], rank
        assert "No space left on device (errno ENOSPC)" in reports[rank]["error"], rank
        assert reports[rank]["unchanged"], rank
    assert reports[0]["after"] == reports[1]["after"], "training went on alike"


def test_a_step_that_fails_part_way_on_one_rank_is_every_ranks_until_a_restore(tmp_path):
    # Issue 43's promise: a failure after parameters moved on any rank raises on every rank
    # and leaves every rank's state broken alike until a restore (a rank that stepped on
    # alone would wait for the others in its next agreement), which returns every rank to
    # the commit bitwise; stepping again then trains as in memory.
    reports = run_ranks("swap_faults.py", np=2, args=[tmp_path]).check().reports
    for rank in (0, 1):
        steps = {s["label"]: s for s in reports[rank]["steps"]}
        for label, step in steps.items():
            assert step["in_memory"], (rank, label)
            assert step["as_in_memory"], (rank, label)
            if label[0] in "357":
                assert step["error"], (rank, label)
                assert step["broken"] and "restore a commit" in step["broken"], (rank, label)
                assert step["unchanged"], (rank, label)
            else:
                assert step["error"] is None, (rank, label)
        own = {"3 rank 0 optimizer error": (0, "RuntimeError: the inner optimizer failed"),
               "5 rank 1 read EIO": (1, "the file ends there (errno EIO)"),
               "7 rank 0 fails before it moved": (0, "the file ends there (errno EIO)")}
        for label, (failing, message) in own.items():
            assert message in steps[label]["error"], (rank, label)
            if rank != failing:
                assert steps[label]["error"].startswith(
                    "SwapError: [Errno 5] a swapped optimizer step failed after parameters "
                    "moved"), (rank, label)
                assert f"rank {failing}: " in steps[label]["error"], rank


def held_after_each_step(commits):
    """(step, world size) -> the set of every rank's (parameters, optimizer state, scale,
    noise) digests after that step."""
    held = {}
    for entry in commits:
        if entry["optim"]:
            held.setdefault((entry["step"], entry["size"]), set()).add(
                (entry["params"], json.dumps([entry.get("noise"), entry.get("optimizer"),
                                              entry.get("scale")])))
    return held


@pytest.mark.elastic
def test_an_elastic_resize_2_1_2_with_the_state_on_disk_is_bitwise_the_job_in_memory(tmp_path):
    # Elastic horovodrun, discovery 2 -> 1 -> 2 hosts: the removed worker's state goes,
    # the joining one gets rank 0's through the sync, a chunk at a time; bf16 autocast,
    # GradScaler and AdamW, as the same job with the state in memory, bit for bit.
    schedule = [(0, ["localhost:2"]), (5, ["localhost:1"]), (10, ["localhost:2"])]
    args = ["--adamw", "--amp", "--batch-size", "8", "--epochs", "3", "--wait-steps", "[5, 10]"]
    held = []
    for extra in ([], ["--swap-dir", str(tmp_path)]):
        job, commits, epochs = run_elastic(schedule, np=2, min_np=1, max_np=2,
                                           worker_args=args + extra)
        job.check()
        assert sizes_in_order(commits) == [2, 1, 2], sizes_in_order(commits)
        check_exactly_once(commits, epochs, 3)
        check_identical_replicas(commits)
        held.append(held_after_each_step(commits))
    memory, swapped = held
    assert sorted(swapped) == sorted(memory)
    for key in sorted(memory):
        assert swapped[key] == memory[key], key


def test_one_ranks_swap_folder_removed_fails_every_step_alike_and_loudly(tmp_path):
    # "A folder changed behind the job's back fails loudly at the next step": at two
    # ranks, only rank 1's folder removed. Both ranks must refuse that step alike (nothing
    # moved, no hang), rank 1's state dict must say why, and after a restore (an elastic
    # reset) the next step must fail alike again: no rank steps on alone.
    reports = run_ranks("swap_removed.py", np=2, args=[tmp_path]).check().reports
    for rank in (0, 1):
        seen = reports[rank]
        assert seen["before_as_reference"], rank
        assert seen["step_error"] and "No such file or directory" in seen["step_error"], \
            (rank, seen["step_error"])
        assert "rank 1: " in seen["step_error"], (rank, seen["step_error"])
        assert "the folder was removed behind this job's back" in seen["step_error"], rank
        assert seen["unchanged"], rank
        assert seen["restore_error"] is None, (rank, seen["restore_error"])
        assert seen["step_after_restore_error"] and "rank 1: " in seen[
            "step_after_restore_error"], (rank, seen["step_after_restore_error"])
    assert reports[0]["state_dict_error"] is None, reports[0]["state_dict_error"]
    assert "the folder was removed behind this job's back" in reports[1]["state_dict_error"]


def test_one_ranks_swap_folder_removed_raises_the_same_errno_on_every_rank(tmp_path):
    # "Both ranks fail the step alike": today rank 1 (its folder gone) raises errno ENOENT
    # and rank 0 errno EIO for the same refused step. A handler that branches on e.errno
    # (retry on EIO, stop on ENOENT) then takes different paths on the two ranks: the
    # one that retries waits in the step's collective for the one that stopped.
    reports = run_ranks("swap_removed.py", np=2, args=[tmp_path]).check().reports
    errors = [reports[rank]["step_error"].split("] ")[0] for rank in (0, 1)]
    assert errors[0] == errors[1], errors


def test_one_ranks_swap_folder_removed_fails_a_sync_on_every_rank_alike(tmp_path):
    # A sync (an elastic reset) writes a new file on every rank but the root, a region
    # broadcast at a time; its file was once created with no agreement first, unlike a
    # step's. Rank 1 cannot create it (its folder removed; a full disk alike) and
    # raises at once; rank 0 goes on into the broadcast of the first region and waits there
    # for a rank that left it (today it gets out only if rank 1 exits: "Horovod has been shut
    # down"). Both must fail the sync alike (as a step) and meet in the next collective;
    # today the job times out there.
    job = run_ranks("swap_removed.py", np=2, args=[tmp_path, "sync"], timeout=60)
    reports = job.check().reports
    errors = [reports[rank]["sync_error"] for rank in (0, 1)]
    assert all(error and error.startswith("sync: SwapError") for error in errors), errors
