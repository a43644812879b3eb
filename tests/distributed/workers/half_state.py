"""A model in bfloat16 or float16 (``--dtype``) through every collective path of a State at
2 ranks, each rank seeded differently: the sync at the start (parameters, BatchNorm buffers,
AdamW's state), the buffers' broadcast at every commit, accumulators fed half-precision
tensors, a checkpoint written and read back, a sync after a worker's restore. Each rank
reports bits (int16 views) of everything; rank 0 also what it built before the sync, which
every rank must hold after it."""
import argparse

import torch
import torch.nn.functional as F

import hvd_adapt
from _report import out_path, report

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", choices=["bfloat16", "float16"], required=True)
args = parser.parse_args()
dtype = getattr(torch, args.dtype)

hvd_adapt.init()
rank, size = hvd_adapt.env.rank(), hvd_adapt.env.size()


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 1)).to(dtype)


def bits(values):
    return {k: v.view(torch.int16).tolist() if v.dtype in (torch.bfloat16, torch.float16)
            else v.tolist() for k, v in values.items() if torch.is_tensor(v)}


def optimizer_bits(opt):
    state = opt.state_dict()["state"]
    return {f"{i}.{k}": v.view(torch.int16).tolist() if v.dtype == dtype else v.tolist()
            for i, per in state.items() for k, v in per.items()}


model = net(seed=rank)       # different on each rank until the sync
# Moments in the parameters' dtype, as a model kept in half precision has them.
opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4),
                                     named_parameters=model.named_parameters())
stats = hvd_adapt.Accumulator()
state = hvd_adapt.State(model=model, optimizer=opt, stats=stats)
# A step before the sync gives rank 1 optimizer state rank 0 does not have.
# (Gradients assigned, not from a backward: a backward would average them with a rank that
# runs none.)
if rank == 1:
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.optimizer.step()
    opt.optimizer.zero_grad()
built = {"params": bits(model.state_dict()), "opt": optimizer_bits(opt)}
state.sync()
synced = {"params": bits(model.state_dict()), "opt": optimizer_bits(opt)}

gen = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(8, 4, generator=gen).to(dtype)
    y = x.float().sum(1, keepdim=True).to(dtype)
    shard = slice(rank * 4, rank * 4 + 4)
    loss = F.mse_loss(model(x[shard]), y[shard])
    opt.zero_grad()
    loss.backward()
    opt.step()
    stats["loss"] += loss.detach()            # a half-precision tensor: summed as a number
    state.commit()
committed = {"params": bits(model.state_dict()), "opt": optimizer_bits(opt)}
with stats.synchronized():
    total = stats["loss"]
path = out_path("half.pt")
state.save_checkpoint(path)
state.wait_for_checkpoint()
# Train on, then read the checkpoint back: every rank holds the commit again, bit for bit.
model(torch.randn(4, 4, dtype=dtype)).sum().backward()
opt.step()
state.load_checkpoint(path)
loaded = {"params": bits(model.state_dict()), "opt": optimizer_bits(opt)}
report({"built": built, "synced": synced, "committed": committed, "loaded": loaded,
        "total": total, "dtypes": sorted({str(p.dtype) for p in model.parameters()})}, rank)
