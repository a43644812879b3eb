"""Two ranks step the same model twice over, with the optimizer state on disk and in memory,
while one rank's step fails part-way (its inner optimizer raises at a later chunk; a read
of its live file ends early, a real short read; a read fails before that rank moved
anything while the other rank steps through): every rank must raise, refuse every step
until a restore (the state is broken on every rank alike, or one rank would step alone),
come back bitwise to the commit made just before the step, and then train on bitwise as
the state in memory. Reports per step for tests/distributed/test_swap_two_ranks.py."""
import argparse
import os

import torch

import hvd_adapt
from _report import report
from _swap_model import build

parser = argparse.ArgumentParser()
parser.add_argument("swap_dir")
args = parser.parse_args()

hvd_adapt.init()
rank = hvd_adapt.env.rank()
swap_dir = os.path.join(args.swap_dir, f"rank{rank}")


def fail():
    raise RuntimeError("the inner optimizer failed")


def by_age():
    [folder] = os.listdir(swap_dir)
    folder = os.path.join(swap_dir, folder)
    return sorted((os.path.join(folder, name) for name in os.listdir(folder)),
                  key=lambda path: os.stat(path).st_mtime_ns)


def cut(path):
    with open(path, "rb") as f:
        saved.append((path, f.read()))
    os.truncate(path, 0)


def snapshot(model, opt):
    state = opt.state_dict()["state"]
    return ([p.detach().clone() for p in model.parameters()],
            [v.clone() for i in sorted(state) for _, v in sorted(state[i].items())])


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])) \
        and len(a[1]) == len(b[1])


def backward(x):
    for model, opt in (memory, swapped):
        opt.zero_grad()
        model(x).pow(2).mean().backward()


swapped, memory = build(swap_dir), build(None)
state = hvd_adapt.State(model=swapped[0], optimizer=swapped[1], reference=memory[0],
                        reference_optimizer=memory[1], snapshot_budget=None)
state.sync()
data = torch.Generator().manual_seed(100 + rank)
saved = []
# (label, the rank whose step fails, its hooks, a fault made before the step)
plan = [("1", None, None, None), ("2", None, None, None),
        ("3 rank 0 optimizer error", 0, {6: fail}, None), ("4", None, None, None),
        # The newest file is the one being written, the live one before it.
        ("5 rank 1 read EIO", 1, {4: lambda: cut(by_age()[-2])}, None),
        ("6", None, None, None),
        ("7 rank 0 fails before it moved", 0, None, lambda: cut(by_age()[-1])),
        ("8", None, None, None)]
steps = []
for label, failing, hooks, before_step in plan:
    x = torch.randn(8, 32, generator=data)
    state.commit()
    before = snapshot(*swapped)
    backward(x)
    if before_step is not None and rank == failing:
        before_step()           # the live file cut: the first read fails
    error = broken = None
    swapped[1].optimizer.calls = 0
    swapped[1].optimizer.after = dict(hooks) if hooks and rank == failing else {}
    try:
        swapped[1].step()
    except Exception as e:       # noqa: BLE001 (reported, for the test to judge)
        error = f"{type(e).__name__}: {e}"
    swapped[1].optimizer.after = {}
    for path, content in saved:  # the disk comes back: the live file is intact
        with open(path, "wb") as f:
            f.write(content)
    saved.clear()
    unchanged = None
    if error is not None:
        try:
            swapped[1].step()
        except OSError as e:
            broken = str(e)
        state.restore()
        unchanged = same(before, snapshot(*swapped))
        backward(x)
        swapped[1].step()
    memory[1].step()
    after = snapshot(*swapped)
    steps.append({"label": label, "error": error, "broken": broken, "unchanged": unchanged,
                  "as_in_memory": same(after, snapshot(*memory)),
                  "in_memory": not swapped[1].optimizer.state})
report({"rank": rank, "steps": steps}, rank)
