"""A random-operation fuzz of the optimizer state on disk against the same operations with the
state in memory, compared bitwise after every operation: steps, steps that fail at a random
point (the optimizer raising after a random chunk, the live file cut under a read, the file
being written cut or the disk filling under its writes), steps on a full disk (a small
tmpfs), commits, restores, state dicts handed out, load_state_dict round trips, and
parameters changed between backward and step (through torch.no_grad() and through p.data).

After a failure the swapped optimizer must either have refused the step (parameters and
state as before, usable at once) or say it is broken on every step, state dict and commit
until a restore, which brings both runs back to their last commit. Fixed seeds; each
sequence a few seconds."""
import os
import pathlib
import random
import shutil
import subprocess

import pytest
import torch

import hvd_adapt
from hvd_adapt import DistributedOptimizer, State
from support.swap_pairs import by_age, deep, fill, swap_folders


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


OPERATIONS = ["step"] * 4 + ["fail_optimizer", "fail_read", "cut_write", "fail_write", "full_disk",
                             "commit", "commit", "restore", "state_dict", "load",
                             "no_grad_edit", "data_edit"]
CHUNKS = 8          # deep() at 24 KiB buffers: 8 chunks of two parameters


def build(where):
    torch.manual_seed(0)
    model, inner = deep()
    inner.after = {}
    opt = DistributedOptimizer(inner, swap_dir=where, swap_buffer_mb=24 / 1024 if where else None)
    return model, opt, State(model=model, optimizer=opt, snapshot_budget=None)


def difference(a, b):
    (model_a, opt_a, _), (model_b, opt_b, _) = a, b
    if not all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters())):
        return "parameters"
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    if sorted(sa) != sorted(sb):
        return "state keys"
    for i in sb:
        for key in sb[i]:
            if not torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])):
                return f"state {i}.{key}"
    return None


def fault(op, rng, folder, disk, undo):
    """The hook that makes a swapped step fail (``{chunk: action}``), and what it does to
    the disk: ``undo`` collects what gives the disk back after the step."""
    def raise_():
        raise RuntimeError("injected")

    def cut_live():
        files = by_age(folder)      # the newest is being written, the live one before
        if len(files) < 2:
            return                  # no state yet
        path = files[-2]
        data = path.read_bytes()
        os.truncate(path, 0)
        undo.append(lambda: path.write_bytes(data))

    def cut_written():
        os.truncate(by_age(folder)[-1], 0)      # later writes leave a hole: zeros if not seen

    def fill_under_write():
        cut_written()
        undo.append(lambda filler=fill(disk): os.remove(filler))

    chunk = rng.randrange(CHUNKS)
    return {chunk: {"fail_optimizer": raise_, "fail_read": cut_live, "cut_write": cut_written,
                    "fail_write": fill_under_write}[op]}


def run(seed, disk, full, n=60):
    """None, or (seed, the operations so far, what went wrong). ``full``: whether ``disk``
    may be filled (a file system of its own)."""
    rng = random.Random(seed)
    where = os.path.join(disk, f"seed{seed}")
    os.makedirs(where)
    swapped, memory = build(where), build(None)
    both = (swapped, memory)
    folder = pathlib.Path(where) / swap_folders(where)[0]
    operations = [op for op in OPERATIONS if full or op not in ("fail_write", "full_disk")]
    ops = []
    for t in range(n):
        op = rng.choice(operations)
        ops.append(op)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed * 1000 + t))
        if op in ("step", "no_grad_edit", "data_edit", "fail_optimizer", "fail_read",
                  "cut_write", "fail_write", "full_disk"):
            for model, opt, state in both:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                if op.endswith("_edit"):
                    # As the State's docs ask of a change by hand between a commit and the
                    # step (without it the step raises CommitCopyError).
                    state.wait_for_commit()
                if op == "no_grad_edit":
                    with torch.no_grad():
                        next(model.parameters()).mul_(0.5)
                elif op == "data_edit":
                    list(model.parameters())[3].data.add_(0.25)
            undo = []
            if op == "full_disk":
                undo.append(lambda filler=fill(disk): os.remove(filler))
            elif op in ("fail_optimizer", "fail_read", "cut_write", "fail_write"):
                swapped[1].optimizer.calls = 0
                swapped[1].optimizer.after = fault(op, rng, folder, disk, undo)
            before = [p.detach().clone() for p in swapped[0].parameters()]
            try:
                swapped[1].step()
                failed = None
            except (OSError, RuntimeError) as e:
                failed = e
            swapped[1].optimizer.after = {}
            for action in undo:
                action()
            if failed is None:
                memory[1].step()
            else:
                found = judge_failure(swapped, memory, before)
                if found:
                    return seed, ops, f"{found} ({failed})"
        elif op == "commit":
            for _, _, state in both:
                state.commit()
        elif op == "restore":
            for _, _, state in both:
                state.restore()
        elif op == "state_dict":
            swapped[1].state_dict()     # handed out: its file is never the spare
        elif op == "load":
            for _, opt, _ in both:
                opt.load_state_dict(opt.state_dict())
        found = difference(swapped, memory)
        if found:
            return seed, ops, found
    return None


def judge_failure(swapped, memory, before):
    """After a failed swapped step: refused (as before, usable), or broken everywhere until a
    restore, which brings both runs back to their commit. What went wrong, or None."""
    model, opt, state = swapped
    try:
        opt.state_dict()
    except OSError as e:
        if "restore a commit" not in str(e):
            return f"state_dict after a failed step: {e}"
        for action in (opt.step, state.commit):
            try:
                action()
                return f"{action.__name__} went through with a broken state"
            except OSError as refused:
                if "restore a commit" not in str(refused):
                    return f"{action.__name__} with a broken state: {refused}"
        for _, _, each in (swapped, memory):
            each.restore()
        return None
    if not all(torch.equal(p, q) for p, q in zip(model.parameters(), before)):
        return "a step that was refused moved parameters"
    return None


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs (the state's files fill a fourth of it), or tmp_path where this user may
    not mount one (then the full-disk operations only find a disk that is not full)."""
    point = tmp_path / "disk"
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(point)],
                             capture_output=True).returncode == 0
    yield str(point), mounted
    if mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
    else:
        shutil.rmtree(point, ignore_errors=True)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_stay_as_in_memory(seed, small_disk):
    assert run(seed, *small_disk) is None
