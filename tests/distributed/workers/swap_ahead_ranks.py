"""Two ranks, the optimizer state on disk and in memory, with the next step's undo copies
written ahead (no state dict is handed out between steps, so every generation's file is
the next one's spare). Before some steps one rank's copies stay valid and the other's not
(a value-preserving in-place update moves its version counters), and then one of them
fails part way: every rank must raise, keep its parameters bitwise as just before the
step, and train on as the state in memory that skipped it. For
tests/distributed/test_swap_undo_ahead_ranks.py."""
import argparse
import os
import time

import torch

import hvd_adapt
from _report import report
from _swap_model import build

parser = argparse.ArgumentParser()
parser.add_argument("swap_dir")
args = parser.parse_args()

hvd_adapt.init()
rank = hvd_adapt.env.rank()


def fail():
    raise RuntimeError("the inner optimizer failed")


swapped, memory = build(os.path.join(args.swap_dir, f"rank{rank}")), build(None)
state = hvd_adapt.State(model=swapped[0], optimizer=swapped[1], reference=memory[0],
                        reference_optimizer=memory[1])
state.sync()
data = torch.Generator().manual_seed(100 + rank)
# (label, the rank whose copies are made stale, the rank whose step fails)
plan = [("1", None, None), ("2", None, None), ("3", None, None),
        ("4 stale at 1, fails at 0", 1, 0), ("5", None, None), ("6", None, None),
        ("7 stale at 0, fails at 0", 0, 0), ("8", None, None), ("9", None, None),
        ("10 stale at 1, fails at 1", 1, 1), ("11", None, None), ("12", None, None)]
steps = []
for label, stale, failing in plan:
    x = torch.randn(8, 32, generator=data)
    since = swapped[1].swap_metrics()
    for model, opt in (memory, swapped):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
    deadline = time.monotonic() + 60
    while failing is not None and time.monotonic() < deadline and swapped[1].swap_metrics()[
            "swap_undo_ahead_bytes"] - since["swap_undo_ahead_bytes"] < 16 * 4096:
        time.sleep(0.01)
    ahead = swapped[1].swap_metrics()["swap_undo_ahead_bytes"] - since["swap_undo_ahead_bytes"]
    if stale == rank:
        with torch.no_grad():
            for p in swapped[0].parameters():
                p.add_(0.0)
    before = [p.detach().clone() for p in swapped[0].parameters()]
    if failing is None:
        memory[1].step()
    error = None
    swapped[1].optimizer.calls = 0
    swapped[1].optimizer.after = {6: fail} if rank == failing else {}
    try:
        swapped[1].step()
    except Exception as e:       # noqa: BLE001 (reported, for the test to judge)
        error = f"{type(e).__name__}: {e}"
    after = [p.detach().clone() for p in swapped[0].parameters()]
    steps.append({"label": label, "error": error, "ahead": ahead,
                  "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
                  "as_in_memory": all(torch.equal(a, b) for a, b in
                                      zip(after, memory[0].parameters()))})
final = swapped[1].state_dict()["state"], memory[1].state_dict()["state"]
report({"rank": rank, "steps": steps, "used": swapped[1].swap_metrics()[
    "swap_undo_ahead_used_bytes"], "state_as_in_memory": all(
        torch.equal(torch.as_tensor(final[0][i][k]), torch.as_tensor(final[1][i][k]))
        for i in final[1] for k in final[1][i])}, rank)
