"""A job that leaves something out of its State, or syncs it with Horovod's own elastic run.

``--leave-out optimizer`` / ``--leave-out loader``: the distributed optimizer, or the
autoscaling loader, is not passed to hvd_adapt.State. ``--horovod-run``: the training
function is decorated with ``hvd.elastic.run`` instead of ``hvd_adapt.run``. Each must stop
every rank with an error naming the mistake (a joining worker would otherwise hang).
"""
import argparse

import horovod.torch as hvd
import torch

import hvd_adapt

parser = argparse.ArgumentParser()
parser.add_argument("--leave-out", choices=["optimizer", "loader"], default=None)
parser.add_argument("--horovod-run", action="store_true")
args = parser.parse_args()

hvd_adapt.init()
model = torch.nn.Linear(4, 1)
opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=8)
loader.autoscale_batch_size(32, local_bsz_bounds=(2, 16))
values = {"model": model, "optimizer": opt, "loader": loader}
values.pop(args.leave_out, None)
state = hvd_adapt.State(**values)
decorate = hvd.elastic.run if args.horovod_run else hvd_adapt.run


@decorate
def train(state):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        state.commit()


train(state)
