"""Two ranks step the same model twice over, with the optimizer state on disk and in memory,
while one rank's step fails part-way (its inner optimizer raises at a later chunk; a read
of its live generation ends early, a real short read): every rank must raise, keep its
parameters and state bitwise as before the step, and then train on bitwise as the state in
memory that never took that step. Reports per step for tests/distributed/test_swap_two_ranks.py."""
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


def truncate_live():
    [folder] = os.listdir(swap_dir)
    names = sorted(os.listdir(os.path.join(swap_dir, folder)), key=lambda n: int(n[3:-4]))
    path = os.path.join(swap_dir, folder, names[-2])     # the newest is being written
    with open(path, "rb") as f:
        saved.append((path, f.read()))
    os.truncate(path, 0)


def lose_undo_and_fail():
    # A second fault: the new generation's undo area is gone when the optimizer fails.
    [folder] = os.listdir(swap_dir)
    newest = max(os.listdir(os.path.join(swap_dir, folder)), key=lambda n: int(n[3:-4]))
    os.truncate(os.path.join(swap_dir, folder, newest), 0)
    fail()


def snapshot(model, opt):
    state = opt.state_dict()["state"]
    return ([p.detach().clone() for p in model.parameters()],
            [v.clone() for i in sorted(state) for _, v in sorted(state[i].items())])


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])) \
        and len(a[1]) == len(b[1])


swapped, memory = build(swap_dir), build(None)
state = hvd_adapt.State(model=swapped[0], optimizer=swapped[1], reference=memory[0],
                        reference_optimizer=memory[1])
state.sync()
data = torch.Generator().manual_seed(100 + rank)
saved = []
# (label, the rank whose step fails, how); the reference in memory skips those steps.
plan = [("1", None, None), ("2", None, None), ("3 rank 0 optimizer error", 0, {6: fail}),
        ("4", None, None), ("5 rank 1 read EIO", 1, {4: truncate_live}), ("6", None, None),
        ("7", None, None), ("8 rank 0 loses its undo area", 0, {6: lose_undo_and_fail}),
        ("9 after a restore", None, None)]
steps = []
for label, failing, hooks in plan:
    x = torch.randn(8, 32, generator=data)
    if label.startswith("8"):
        state.commit()
    if label.startswith("9"):
        state.restore()     # rank 0's parameters were half-stepped: back to the commit
    before = snapshot(*swapped)
    for model, opt in (memory, swapped):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
    if failing is None:
        memory[1].step()
    error = None
    swapped[1].optimizer.calls = 0
    swapped[1].optimizer.after = dict(hooks) if hooks and rank == failing else {}
    try:
        swapped[1].step()
    except Exception as e:       # noqa: BLE001 (reported, for the test to judge)
        error = f"{type(e).__name__}: {e}"
    for path, content in saved:  # the disk comes back: the live generation is intact
        with open(path, "wb") as f:
            f.write(content)
    saved.clear()
    after = snapshot(*swapped)
    steps.append({"label": label, "error": error, "unchanged": same(before, after),
                  "as_in_memory": same(after, snapshot(*memory)),
                  "in_memory": not swapped[1].optimizer.state})
report({"rank": rank, "steps": steps}, rank)
