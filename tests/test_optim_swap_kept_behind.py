"""The generations "kept behind" (hvd_adapt/optim/swap.py, _unlink and _remove_behind): a
generation no one uses that cannot be recycled or removed while the folder (or its spare)
is immutable stays in the folder. Disk usage must stay bounded meanwhile where the file can
still be removed, and once the folder is writable again what was kept behind must go: a
week-long job must not fill the disk with generations it no longer tracks."""
import os
import re
import subprocess

import pytest
import torch

import hvd_adapt
from hvd_adapt import State
from test_optim_swap import assert_same, deep, mount, pair  # noqa: F401 (mount)
from test_optim_swap_folder import chattr, only_folder, started, step


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def generations(folder):
    return sorted(name for name in os.listdir(folder) if re.fullmatch(r"gen\d+\.bin", name))


def step_until_taken(model, opt, seed):
    """A step, tried again once where it was refused (the first try after the spare was made
    immutable cannot rename it: refused, parameters unchanged)."""
    try:
        step(model, opt, seed)
    except OSError:
        step(model, opt, seed)


def test_an_immutable_spare_neither_grows_the_folder_nor_leaves_files_once_mutable(tmp_path):
    # chattr +i on spare.bin (a hostile or careless admin, a backup tool's lock): renaming
    # the replaced generation over the spare fails (EPERM) at every step. The folder itself
    # is writable, so the replaced generation could be removed; today each step leaves one
    # whole generation behind, untracked, and none of them is ever removed after chattr -i.
    swap_dir = tmp_path / "swap"
    pairs = started(swap_dir)
    (model, opt), (reference, ref_opt) = pairs
    folder = only_folder(swap_dir)
    spare = folder / "spare.bin"
    chattr("+i", spare)
    problems = []
    try:
        for seed in range(3, 11):
            step_until_taken(model, opt, seed)
            step(reference, ref_opt, seed)
        while_immutable = generations(folder)
        if len(while_immutable) > 2:
            problems.append(f"8 steps with an immutable spare left {while_immutable} "
                            "(one live generation is in use)")
    finally:
        chattr("-i", spare)
    for seed in range(11, 14):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
    after = generations(folder)
    if len(after) > 1:
        problems.append(f"3 steps after chattr -i the folder still holds {after} "
                        "(one live generation and spare.bin are in use)")
    assert_same(pairs)
    assert not problems, "; ".join(problems)


def test_a_generation_kept_behind_at_a_restore_goes_once_the_folder_is_writable(tmp_path):
    # The folder immutable while an elastic restore drops the live generation: it is kept
    # behind (a warning). Once the folder is writable again, steps, commits and restores go
    # on as with the state in memory, and the folder must return to the files in use.
    swap_dir = tmp_path / "swap"
    pairs = pair(deep, str(swap_dir), buffer_mb=36 / 1024)
    (model, opt), (reference, ref_opt) = pairs
    state = State(model=model, optimizer=opt)
    ref_state = State(model=reference, optimizer=ref_opt)
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
        with pytest.raises(OSError):
            step(model, opt, 5)     # no new generation can be created: refused, clearly
    finally:
        chattr("-i", folder)
    for seed in range(5, 9):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
        state.commit()
        ref_state.commit()
    assert_same(pairs)
    # In use: the live generation (also the last commit's) and the spare.
    left = generations(folder)
    assert len(left) <= 1, f"the folder keeps {left} after it became writable again"


def test_a_file_system_read_only_for_a_while_leaves_no_generation_behind_each_time(mount):
    # The swap file system remounted read-only (EROFS, as after I/O errors) during an
    # elastic loop: steps are refused (parameters unchanged: holds), commits and restores go
    # on, then it is read-write again. Each such episode leaves one more generation behind,
    # untracked, until the optimizer is closed: disk usage grows with the episodes.
    point = mount("tmpfs", "8m")
    pairs = pair(deep, str(point), buffer_mb=36 / 1024)
    (model, opt), (reference, ref_opt) = pairs
    state = State(model=model, optimizer=opt)
    ref_state = State(model=reference, optimizer=ref_opt)
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
    # In use: the live generation (also the last commit's) and the spare.
    left = generations(folder)
    assert len(left) <= 1, f"after 4 read-only episodes the folder keeps {left}"
