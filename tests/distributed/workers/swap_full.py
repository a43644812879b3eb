"""Two ranks with the optimizer state on disk; rank 1's swap_dir (argv[2]) is a small file
system it fills before a step: every rank must fail that step alike, leaving parameters and
state as they were, and train on once the space is back. Reports what each rank saw."""
import hashlib
import os
import sys

import torch

import hvd_adapt
from _report import report
from support.full_disk import fill  # the one disk filler

hvd_adapt.init()
rank = hvd_adapt.env.rank()
swap_dir = sys.argv[1 + rank]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     swap_dir=swap_dir, swap_buffer_mb=0.05)
state = hvd_adapt.State(model=model, optimizer=opt)
state.sync()
data = torch.Generator().manual_seed(100 + rank)


def digest():
    h = hashlib.sha256()
    saved = opt.state_dict()["state"]
    for t in list(model.parameters()) + [v for i in sorted(saved)
                                         for _, v in sorted(saved[i].items())]:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def step():
    opt.zero_grad()
    model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
    opt.step()


# A state dict handed out after each step: its generation's file is then removed when
# dropped, never kept as the spare (which would hold the next step's space), so the
# reservation of the step after the fill needs new space.
step()
digest()
step()
before = digest()
filler = os.path.join(swap_dir, "filler")
if rank == 1:
    fill(swap_dir)          # writes `filler` until the tmpfs is full
error = None
try:
    step()
except OSError as e:
    error = str(e)
unchanged = digest() == before
if rank == 1:
    os.remove(filler)
step()
report({"rank": rank, "error": error, "unchanged": unchanged, "after": digest()}, rank)
