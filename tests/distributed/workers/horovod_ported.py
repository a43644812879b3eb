"""The loops of Horovod's elastic examples, run with Horovod (``--library horovod``) or
ported to hvd_adapt by changing imports (``--library hvd_adapt``), as
docs/porting-from-horovod.md says. ``--shape``:

- ``integration``: horovod/test/integration/data/elastic_torch_main.py's loop:
  ``State(model, opt, batch=0, epoch=0, commits=0, rendezvous=0)``, ``while state.epoch <
  epochs`` and ``while state.batch < batches``, a commit every batch and one per epoch;
  rank 0 logs one line per epoch (``--logfile``) and writes its commit count where an
  elastic test's discovery reads it;
- ``mnist``: examples/elastic/pytorch/pytorch_mnist_elastic.py's: ``State(model, opt,
  epoch=1, batch=0)``, ``for state.epoch in range(state.epoch, epochs + 1)``, ``for
  state.batch, (x, y) in enumerate(loader)`` over a DistributedSampler;
- ``synthetic``: pytorch_synthetic_benchmark_elastic.py's: ``State(model, opt, img_secs=[],
  iter=0, batch=0, warm=False)``, a warm-up, then ``for x in range(state.iter, iters)``
  committing every ``--batches-per-commit`` batches.

Each rank reports its parameters and the State's values at the end.
"""
import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from _report import out_path, report

parser = argparse.ArgumentParser()
parser.add_argument("--library", choices=["horovod", "hvd_adapt"], required=True)
parser.add_argument("--shape", choices=["integration", "mnist", "synthetic"], required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches-per-epoch", type=int, default=4)
parser.add_argument("--batches-per-commit", type=int, default=1)
parser.add_argument("--logfile", default=None)
parser.add_argument("--epoch-wait", type=float, default=0.0,
                    help="seconds each epoch's end takes (as Horovod's script has)")
parser.add_argument("--checkpoint", default=None,
                    help="hvd_adapt only: resume from and save to this file between epochs")
parser.add_argument("--epoch-loop", choices=["for", "remaining"], default="for",
                    help="mnist: Horovod's `for state.epoch in range(...)`, or hvd_adapt's "
                         "remaining_epochs_until (which checkpoints between epochs)")
args = parser.parse_args()

# -- the only lines a port changes -----------------------------------------------------------
if args.library == "horovod":
    hvd.init()
    State, run, DistributedOptimizer = hvd.elastic.TorchState, hvd.elastic.run, \
        hvd.DistributedOptimizer
else:
    import hvd_adapt
    hvd_adapt.init()
    State, run, DistributedOptimizer = hvd_adapt.State, hvd_adapt.run, \
        hvd_adapt.DistributedOptimizer
# ------------------------------------------------------------------------------------------

torch.manual_seed(42)
lr = 0.01
data = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
target = (data[:, 0] > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.5)
optimizer = DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * hvd.size()


def batch_of(i):
    # Each rank its own slice of a fixed set, as a DistributedSampler gives.
    rows = torch.arange(8) + 8 * ((i * hvd.size() + hvd.rank()) % 8)
    return data[rows], target[rows]


def train_one(x, y):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def progress(state):
    if hvd.rank() == 0:
        with open(out_path("progress") + ".tmp", "w") as f:
            f.write(str(state.commits))
        os.replace(out_path("progress") + ".tmp", out_path("progress"))


if args.shape == "integration":
    @run
    def train(state):
        state.rendezvous += 1
        while state.epoch < args.epochs:
            while state.batch < args.batches_per_epoch:
                train_one(*batch_of(state.batch))
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commits += 1
                    state.commit()
                    progress(state)
            if hvd.rank() == 0 and args.logfile:
                with open(args.logfile, "a") as f:
                    f.write(json.dumps({"epoch": state.epoch, "batch": state.batch,
                                        "commits": state.commits, "size": hvd.size(),
                                        "rendezvous": state.rendezvous}) + os.linesep)
            if args.epoch_wait > 0:
                time.sleep(args.epoch_wait)
            state.epoch += 1
            state.batch = 0
            state.commits += 1
            state.commit()
            progress(state)

    state = State(model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0)

elif args.shape == "mnist":
    dataset = torch.utils.data.TensorDataset(data, target)
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)

    def epochs(state):
        if args.epoch_loop == "remaining":
            yield from hvd_adapt.remaining_epochs_until(args.epochs + 1, checkpoint=args.checkpoint)
            return
        for state.epoch in range(state.epoch, args.epochs + 1):
            yield state.epoch
            if args.checkpoint:
                state.save_checkpoint(args.checkpoint)

    @run
    def train(state):
        for epoch in epochs(state):
            trained.append(epoch)
            state.model.train()
            sampler.set_epoch(state.epoch)
            steps_remaining = len(loader) - state.batch
            for state.batch, (x, y) in enumerate(loader):
                if state.batch >= steps_remaining:
                    break
                state.optimizer.zero_grad()
                F.cross_entropy(state.model(x), y).backward()
                state.optimizer.step()
                state.commit()
            state.batch = 0

    state = State(model, optimizer, epoch=1, batch=0)

else:
    def benchmark_step(state):
        train_one(*batch_of(state.batch))
        state.batch += 1
        if state.batch == args.batches_per_commit:
            state.batch = 0
            state.commit()

    @run
    def train(state):
        if not state.warm:
            for _ in range(2):
                benchmark_step(state)
            state.warm = True
            state.commit()
        for x in range(state.iter, args.epochs):
            for _ in range(args.batches_per_epoch):
                benchmark_step(state)
            state.img_secs.append(float(x))
            state.iter = x
            state.commit()

    state = State(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)

trained = []
state.register_reset_callbacks([on_state_reset])
if args.checkpoint and args.library == "hvd_adapt":
    state.load_checkpoint(args.checkpoint)
train(state)
values = {name: getattr(state, name) for name in
          {"integration": ("epoch", "batch", "commits", "rendezvous"),
           "mnist": ("epoch", "batch"),
           "synthetic": ("batch", "img_secs", "iter", "warm")}[args.shape]}
report({"params": [p.tolist() for p in model.parameters()], "values": values,
        "size": hvd.size(), "trained": trained}, hvd.rank())
