"""Epochs by progress on two replicas where rank 1's own reckoning of the epoch's end
differs from rank 0's (``--rank1-early N``: it believes every epoch over N optimizer
steps early, as a last-bit difference in its progress would make it at a boundary).
Every rank reports how many optimizer steps each epoch took and a hash of its
parameters: the epochs must end at the same step everywhere."""
import argparse
import hashlib

import torch

import hvd_adapt
from _report import report

parser = argparse.ArgumentParser()
parser.add_argument("--rank1-early", type=int, default=0)
args = parser.parse_args()
hvd_adapt.init()
rank = hvd_adapt.env.rank()
torch.manual_seed(0)
model = torch.nn.Linear(6, 1)
opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
gen = torch.Generator().manual_seed(1)
x = torch.randn(240, 6, generator=gen)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) + torch.randn(240, 1, generator=gen))
loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=16, shuffle=True)
loader.autoscale_batch_size(64, epochs_by_progress=True, decide_every=5)
state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
controller = loader.controller
if rank == 1 and args.rank1_early:
    # Stand in for another libm: this rank's own reckoning runs ahead.
    own = controller.epoch_progress_made

    def early(num_samples):
        return own(num_samples) or \
            controller.progress + args.rank1_early >= num_samples / 16 + controller_start[0]

    controller_start = [0.0]
    controller.epoch_progress_made = early


@hvd_adapt.run
def train(state):
    steps_per_epoch = []
    for epoch in hvd_adapt.remaining_epochs_until(3):
        if rank == 1 and args.rank1_early:
            controller_start[0] = controller.progress
        steps = 0
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            steps += loader.is_optim_step()
        steps_per_epoch.append(steps)
    return steps_per_epoch


steps = train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
report({"steps": steps, "params": digest.hexdigest()}, rank)
