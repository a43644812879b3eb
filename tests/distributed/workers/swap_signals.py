"""Two ranks with the optimizer state on disk while one rank is stopped
(SIGSTOP ... SIGCONT) or killed (SIGKILL) by the other. For
tests/distributed/test_swap_signals.py.

Modes:
- ``stop``: 10 steps, swapped and, on the same ranks, the same job in memory; before step 3
  rank 0 stops rank 1 right after the backward, and before step 6 from inside rank 0's own
  swapped step (after its chunk 2); a timer on rank 0 continues rank 1 ``--stop-s`` later.
  Every step is compared with the state in memory.
- ``straight``: 10 swapped steps, a checkpoint after step 4 (committed); reports digests.
- ``kill``: as straight, but at step 7 rank 1 is SIGKILLed inside its swapped step (after
  its chunk 2: reads and writes in flight), and the job dies.
- ``resume``: loads the checkpoint and takes steps 5-10; reports digests (they must be
  straight's)."""
import argparse
import hashlib
import os
import signal
import sys
import threading
import time

import horovod.torch as hvd
import torch

import hvd_adapt
from _report import report
from support.hooked_optimizer import HookedAdamW

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["stop", "straight", "kill", "resume"])
parser.add_argument("swap_dir")
parser.add_argument("--checkpoint")
parser.add_argument("--stop-s", type=float, default=20.0)
args = parser.parse_args()

hvd_adapt.init()
rank = hvd_adapt.env.rank()
STEPS = 10
WIDTH = 768     # 6 x 768 x 768 weights: 28 MB of AdamW state per rank, stepped in 1 MiB


def build(where):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    inner = HookedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    inner.after = {}
    opt = hvd_adapt.DistributedOptimizer(
        inner, swap_dir=os.path.join(where, f"rank{rank}") if where else None,
        swap_buffer_mb=1 if where else None)
    return model, opt


def batch(i):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1000 * i + rank))


def digest(model, opt):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    state = opt.state_dict()["state"]
    for i in sorted(state):
        for key in sorted(state[i]):
            h.update(torch.as_tensor(state[i][key]).numpy().tobytes())
    return h.hexdigest()


pids = hvd.allgather_object(os.getpid(), name="hvd_adapt_test.pids")


def stop_rank_1():
    os.kill(pids[1], signal.SIGSTOP)
    timer = threading.Timer(args.stop_s, os.kill, (pids[1], signal.SIGCONT))
    timer.start()
    return timer


continued = []     # SIGCONTs received: the stops happened
signal.signal(signal.SIGCONT, lambda *_: continued.append(time.monotonic()))
swapped = build(args.swap_dir)
if args.mode == "stop":
    memory = build(None)
    state = hvd_adapt.State(model=swapped[0], optimizer=swapped[1], reference=memory[0],
                            reference_optimizer=memory[1])
    state.sync()
    steps = []
    for i in range(1, STEPS + 1):
        for model, opt in (memory, swapped):
            opt.zero_grad()
            model(batch(i)).pow(2).mean().backward()
        memory[1].step()
        timers = []
        if rank == 0 and i == 3:
            timers.append(stop_rank_1())
        if rank == 0 and i == 6:
            swapped[1].optimizer.calls = 0
            swapped[1].optimizer.after = {2: lambda: timers.append(stop_rank_1())}
        if i == 8:
            # Rank 1 stops itself inside its own swapped step (its I/O threads with it);
            # rank 0 continues it later.
            if rank == 1:
                swapped[1].optimizer.calls = 0
                swapped[1].optimizer.after = {4: lambda: os.kill(os.getpid(), signal.SIGSTOP)}
            else:
                timers.append(threading.Timer(args.stop_s, os.kill, (pids[1], signal.SIGCONT)))
                timers[-1].start()
        error = None
        try:
            swapped[1].step()
        except Exception as e:      # noqa: BLE001 (reported, for the test to judge)
            error = f"{type(e).__name__}: {e}"
        swapped[1].optimizer.after = {}
        for timer in timers:
            timer.join()
        steps.append({"step": i, "error": error, "as_in_memory": all(
            torch.equal(a, b) for a, b in zip(swapped[0].parameters(), memory[0].parameters()))})
    final = swapped[1].state_dict()["state"], memory[1].state_dict()["state"]
    report({"steps": steps, "state_as_in_memory": all(
        torch.equal(torch.as_tensor(final[0][i][k]), torch.as_tensor(final[1][i][k]))
        for i in final[1] for k in final[1][i]),
        "continued": len(continued)}, rank)
    sys.exit(0)

state = hvd_adapt.State(model=swapped[0], optimizer=swapped[1])
first = 1
if args.mode == "resume":
    assert state.load_checkpoint(args.checkpoint), "no checkpoint to resume from"
    first = 5
else:
    state.sync()
for i in range(first, STEPS + 1):
    model, opt = swapped
    opt.zero_grad()
    model(batch(i)).pow(2).mean().backward()
    if args.mode == "kill" and i == 7 and rank == 1:
        opt.optimizer.calls = 0
        opt.optimizer.after = {2: lambda: os.kill(os.getpid(), signal.SIGKILL)}
    opt.step()
    if i == 4 and args.mode != "resume":
        state.commit()
        state.save_checkpoint(args.checkpoint)
report({"digest": digest(*swapped), "read": swapped[1].swap_metrics()["swap_read_bytes"]},
       rank)
