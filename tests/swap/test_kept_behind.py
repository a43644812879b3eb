"""Files "left over" (hvd_adapt/swap/files.py, Folder._unlink): a state file no one uses that
cannot be written over or removed while the folder (or the file) is immutable or the file
system read-only stays in the folder. Disk usage must stay bounded meanwhile, and once the
folder is writable again what was left over must go: a week-long job must not fill the
disk with files it no longer uses."""
import os
import re
import subprocess

import pytest
import torch

import hvd_adapt
from hvd_adapt import State
from support.swap_pairs import (assert_same, chattr, deep, only_folder, pair, spare_of, started,
                                step)


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def state_files(folder):
    return sorted(name for name in os.listdir(folder) if re.fullmatch(r"state\d+\.bin", name))


def step_until_taken(model, opt, seed):
    """A step, tried again once where it was refused (the first try after the spare was made
    immutable cannot rename it: refused, parameters unchanged)."""
    try:
        step(model, opt, seed)
    except OSError:
        step(model, opt, seed)


def test_an_immutable_spare_neither_grows_the_folder_nor_leaves_files_once_mutable(tmp_path):
    # chattr +i on the spare (a hostile or careless admin, a backup tool's lock): the step
    # that would write over it fails (EPERM), the spare can be neither used nor removed. The
    # folder itself is writable, so steps go on with new files; no step may leave one more
    # file behind, and once the spare is mutable again it must go.
    swap_dir = tmp_path / "swap"
    pairs = started(swap_dir)
    (model, opt), (reference, ref_opt) = pairs
    folder = only_folder(swap_dir)
    spare = spare_of(folder)
    chattr("+i", spare)
    problems = []
    try:
        for seed in range(3, 11):
            step_until_taken(model, opt, seed)
            step(reference, ref_opt, seed)
        while_immutable = state_files(folder)
        if len(while_immutable) > 3:
            problems.append(f"8 steps with an immutable spare left {while_immutable} "
                            "(the live file, the spare and the immutable one)")
    finally:
        chattr("-i", spare)
    for seed in range(11, 14):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
    after = state_files(folder)
    if len(after) > 2:
        problems.append(f"3 steps after chattr -i the folder still holds {after} "
                        "(the live file and the spare are in use)")
    assert_same(pairs)
    assert not problems, "; ".join(problems)


def test_a_file_left_over_at_a_restore_goes_once_the_folder_is_writable(tmp_path):
    # The folder immutable while an elastic restore drops the live file and a step replaces
    # one: what cannot be removed is left over (a warning). Once the folder is writable
    # again, steps, commits and restores go on as with the state in memory, and the folder
    # must return to the files in use.
    swap_dir = tmp_path / "swap"
    pairs = pair(deep, str(swap_dir), buffer_mb=24 / 1024)
    (model, opt), (reference, ref_opt) = pairs
    state = State(model=model, optimizer=opt, snapshot_budget=None)
    ref_state = State(model=reference, optimizer=ref_opt, snapshot_budget=None)
    for seed in range(3):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
    state.commit()
    ref_state.commit()
    for seed in range(3, 5):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
    folder = only_folder(swap_dir)
    chattr("+i", folder)
    try:
        state.restore()
        ref_state.restore()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            step(model, opt, 5)     # written over the spare: taken; or refused, clearly
        except OSError:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            chattr("-i", folder)
            step(model, opt, 5)
        step(reference, ref_opt, 5)
    finally:
        chattr("-i", folder)
    for seed in range(6, 9):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
        state.commit()
        ref_state.commit()
    assert_same(pairs)
    # In use: the live file (also the last commit's) and the spare.
    left = state_files(folder)
    assert len(left) <= 2, f"the folder keeps {left} after it became writable again"


def test_a_file_system_read_only_for_a_while_leaves_no_file_behind_each_time(mount):
    # The swap file system remounted read-only (EROFS, as after I/O errors) during an
    # elastic loop: steps are refused (parameters unchanged), commits and restores go on,
    # then it is read-write again. No episode may leave a file behind for good: disk usage
    # must not grow with the episodes.
    point = mount("tmpfs", "8m")
    pairs = pair(deep, str(point), buffer_mb=24 / 1024)
    (model, opt), (reference, ref_opt) = pairs
    state = State(model=model, optimizer=opt, snapshot_budget=None)
    ref_state = State(model=reference, optimizer=ref_opt, snapshot_budget=None)
    for seed in range(3):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
    state.commit()
    ref_state.commit()
    folder = only_folder(point)
    seed = 3
    for _ in range(4):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
        seed += 1
        subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        try:
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(OSError):
                step(model, opt, seed)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            state.commit()
            ref_state.commit()
            state.restore()
            ref_state.restore()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(point)], check=True)
        step(model, opt, seed)
        step(reference, ref_opt, seed)
        seed += 1
        state.commit()
        ref_state.commit()
    assert_same(pairs)
    # In use: the live file (also the last commit's) and the spare.
    left = state_files(folder)
    assert len(left) <= 2, f"after 4 read-only episodes the folder keeps {left}"
