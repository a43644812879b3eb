"""Optimizer state on disk at two ranks: every rank's parameters and optimizer state after
every step, bitwise those of the same job with the state in memory, also where the state's
layout changes (a layer unfrozen after a commit and a restore, a param group added, a rank
joining afresh and syncing, as at a resize) and large weights are stepped in pieces."""
import pytest

from launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("args", [["--kind", "adamw"], ["--kind", "adamw", "--amp"],
                                  ["--kind", "sgd"]], ids=["adamw", "adamw+amp", "sgd"])
def test_two_ranks_train_bitwise_as_with_the_state_in_memory(args, tmp_path):
    memory = run_ranks("swap_exact.py", np=2, args=args).check().reports
    swapped = run_ranks("swap_exact.py", np=2, args=args + ["--swap-dir", tmp_path]).check().reports
    steps = memory[0]["steps"]
    assert len(steps) == 12 and all(s["accumulation"] == 1 for s in steps)
    assert steps[-1]["noise"][0] > 0, "the noise was measured"
    for rank in (0, 1):
        assert memory[rank]["steps"] == steps
        assert swapped[rank]["steps"] == steps, rank


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


def test_a_step_that_fails_part_way_on_one_rank_is_undone_on_every_rank(tmp_path):
    reports = run_ranks("swap_faults.py", np=2, args=[tmp_path]).check().reports
    for rank in (0, 1):
        steps = {s["label"]: s for s in reports[rank]["steps"]}
        for label, step in steps.items():
            assert step["as_in_memory"], (rank, label)
            assert step["in_memory"], (rank, label)
            if label[0] in "35":
                assert step["unchanged"], (rank, label)
                assert step["error"], (rank, label)
            else:
                assert step["error"] is None, (rank, label)
        own = {"3 rank 0 optimizer error": (0, "RuntimeError: the inner optimizer failed"),
               "5 rank 1 read EIO": (1, "the file ends there (errno EIO)")}
        for label, (failing, message) in own.items():
            assert message in steps[label]["error"], (rank, label)
            if rank != failing:
                assert steps[label]["error"].startswith(
                    "SwapError: [Errno 5] the optimizer step was not taken on any rank"), rank
                assert f"rank {failing}: " in steps[label]["error"], rank
