"""The descriptors the state on disk opens (hvd_adapt/swap/files.py: each use of a file opens
it by name): none leaks over an elastic-style loop, and where the process runs out of
descriptors (ulimit -n) a step or a state dict either works or fails clearly, naming the
file it could not open, with the parameters unchanged."""
import gc
import os
import resource

import pytest
import torch

import hvd_adapt
from hvd_adapt import State
from support.swap_pairs import assert_same, deep, pair, started, step


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def test_no_descriptor_leaks_over_commits_restores_state_dicts_and_loads(tmp_path):
    # Holds today: kept as a guard of the descriptors' lifetimes.
    swap_dir = str(tmp_path / "swap")
    gc.collect()
    start = open_descriptors()
    pairs = pair(deep, swap_dir, buffer_mb=24 / 1024)
    (model, opt), (reference, ref_opt) = pairs
    state = State(model=model, optimizer=opt, snapshot_budget=None)
    ref_state = State(model=reference, optimizer=ref_opt, snapshot_budget=None)
    for seed in range(120):
        step(model, opt, seed)
        step(reference, ref_opt, seed)
        if seed % 3 == 0:
            state.commit()
            ref_state.commit()
        if seed % 7 == 0:
            opt.load_state_dict(opt.state_dict())
        if seed % 11 == 0:
            state.restore()
            ref_state.restore()
    assert_same(pairs)
    # The folder's descriptor (and the I/O threads' nothing).
    assert open_descriptors() - start <= 3
    del pairs, model, opt, state, reference, ref_opt, ref_state
    gc.collect()
    assert open_descriptors() <= start     # (gc may close one that was open at the start)
    assert not os.listdir(swap_dir)


def test_out_of_descriptors_a_step_or_state_dict_fails_naming_the_file(tmp_path):
    # ulimit -n reached: today the read of the live generation through its held descriptor
    # fails with "[Errno 24] Too many open files: '/proc/self/fd/N'": a descriptor number,
    # not the swap file, not "the step was not taken", nothing a user can act on; a state
    # dict's map of it raises torch's RuntimeError "unable to open file </proc/self/fd/N>".
    swap_dir = str(tmp_path / "swap")
    pairs = started(swap_dir)
    (model, opt), (reference, ref_opt) = pairs
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    problems = []
    taken = False
    try:
        for spare in range(-3, 4):
            for what, action in (("state_dict", opt.state_dict),
                                 ("step", lambda: step(model, opt, 3))):
                before = [p.detach().clone() for p in model.parameters()]
                limit = open_descriptors() + spare
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
                try:
                    action()
                    taken = taken or what == "step"
                except (OSError, RuntimeError) as e:   # torch.from_file raises RuntimeError
                    if "/proc/self/fd" in str(e) or swap_dir not in str(e):
                        problems.append(f"{what} at ulimit +{spare}: {type(e).__name__}: {e}")
                    if not all(torch.equal(p, q) for p, q in zip(model.parameters(), before)):
                        problems.append(f"{what} at ulimit +{spare} moved the parameters")
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                if taken:
                    break
            if taken:
                break
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if not taken:
        step(model, opt, 3)
    step(reference, ref_opt, 3)
    assert_same(pairs)
    assert not problems, "; ".join(problems)


def test_the_folder_removed_during_a_step_fails_loudly_and_moves_nothing_more(tmp_path):
    # A cleaner runs at any time, and with the state on disk most of the time is the step.
    # The folder is the job's own: removed behind its back while a step runs, the step
    # completes (its new file is open) and goes live; from then on every use of the state
    # fails loudly, naming the folder (issue 43: no longer worked around), and a step that
    # fails so moves nothing. Never a state read from elsewhere.
    import shutil
    swap_dir = tmp_path / "swap"
    pairs = started(swap_dir)
    (model, opt), (reference, ref_opt) = pairs
    opt.optimizer.calls = 0
    opt.optimizer.after = {2: lambda: shutil.rmtree(swap_dir)}
    try:
        step(model, opt, 3)
        step(reference, ref_opt, 3)
    except OSError:
        pass        # refused (parameters unchanged) would do too
    finally:
        opt.optimizer.after = {}
    with pytest.raises(OSError, match=rf"{swap_dir}.*the folder was removed behind this job's"):
        opt.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OSError, match="the folder was removed behind this job's back"):
        step(model, opt, 4)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
