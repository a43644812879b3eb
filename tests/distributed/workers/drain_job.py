"""A job that one rank asks to stop with SIGTERM; rank 0's checkpoint write is slow.

``--term-step N``: the last rank sends itself SIGTERM after step N. Every rank
reports what it holds when the drain exits it (``drained``), or, on a run
that resumed from the checkpoint, what it holds after the first sync
(``resumed``). ``--batch-seconds S --commit-every N``: batches take S seconds
and every N-th is committed (commits far apart); rank 0 appends each
commit's step count and time to ``commits.txt`` in the output folder.
``--ballast N`` makes the checkpoint N floats larger.
"""
import argparse
import hashlib
import os
import signal
import time

import torch
from horovod.torch.elastic.state import StateHandler

import hvd_adapt
from _report import out_path, report


class SlowToSave:
    """Its state_dict() (read when a checkpoint is written) takes a while on rank 0."""

    def __init__(self, seconds):
        self.seconds = seconds

    def state_dict(self):
        if hvd_adapt.env.rank() == 0:
            time.sleep(self.seconds)
        return {"seconds": self.seconds}

    def load_state_dict(self, state):
        self.seconds = state["seconds"]


class SlowHandler(StateHandler):
    def save(self):
        pass

    def restore(self):
        pass

    def sync(self):
        pass


def holding(state, model, loader):
    with state.stats.synchronized():
        totals = dict(state.stats)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return {"rank": hvd_adapt.env.rank(), "params": h.hexdigest(), "totals": totals,
            "epoch": state.epoch, "position": loader.sampler.position, "steps": state.steps}


parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--term-step", type=int, default=-1)
parser.add_argument("--slow-save", type=float, default=2.0)
parser.add_argument("--batch-seconds", type=float, default=0.0)
parser.add_argument("--commit-every", type=int, default=1)
parser.add_argument("--ballast", type=int, default=0, help="floats of extra checkpointed state")
args = parser.parse_args()

hvd_adapt.register_handler(SlowToSave, SlowHandler)
hvd_adapt.init()
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(400, 4), torch.randn(400, 1))
model = torch.nn.Linear(4, 1)
opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                     momentum=0.9, weight_decay=0.01))
loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=8, shuffle=True)
state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=hvd_adapt.Accumulator(),
                        slow=SlowToSave(args.slow_save), steps=0,
                        **({"ballast": torch.zeros(args.ballast)} if args.ballast else {}))
hvd_adapt.install_sigterm_drain(state, checkpoint_path=args.checkpoint)
resumed = state.load_checkpoint(args.checkpoint)


@hvd_adapt.run
def train(state):
    if resumed:
        report({"resumed": holding(state, model, loader)}, hvd_adapt.env.rank())
        return
    for epoch in hvd_adapt.remaining_epochs_until(3):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.stats["n"] += len(x) - loader.num_padded
            state.steps += 1
            if state.steps == args.term_step and \
                    hvd_adapt.env.rank() == hvd_adapt.env.size() - 1:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(args.batch_seconds)
            if state.steps % args.commit_every == 0:
                state.commit()
                if hvd_adapt.env.rank() == 0:
                    with open(out_path("commits.txt"), "a") as f:
                        f.write(f"{state.steps} {time.time()}\n")


try:
    train(state)
except hvd_adapt.CheckpointError as e:
    report({"error": str(e)}, hvd_adapt.env.rank())
    raise
except SystemExit as stop:
    report({"drained": holding(state, model, loader), "code": stop.code, "time": time.time()},
           hvd_adapt.env.rank())
    raise
