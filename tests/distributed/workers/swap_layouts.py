"""Two ranks step a model whose optimizer state changes its layout (a layer unfrozen after a
commit, then a restore; a param group added; a rank that joins afresh and syncs, as a resize
brings one), with the state in memory or on disk (--swap-dir); each rank reports digests
of its parameters and optimizer state after every step, for
tests/distributed/test_swap_two_ranks.py to compare."""
import argparse
import hashlib

import torch

import hvd_adapt
from _report import report

parser = argparse.ArgumentParser()
parser.add_argument("--swap-dir", default=None)
args = parser.parse_args()

hvd_adapt.init()
rank = hvd_adapt.env.rank()


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def build(seed, with_head):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 3000), torch.nn.Tanh(),
                                torch.nn.Linear(3000, 4))
    model[2].weight.requires_grad_(False)        # frozen at first: no state
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # Buffers of 64 KiB: the 48,000-element weights are stepped in pieces.
    opt = hvd_adapt.DistributedOptimizer(inner, swap_dir=args.swap_dir,
                                         swap_buffer_mb=0.0625 if args.swap_dir else None)
    head = None
    if with_head:
        head = add_head(model, opt)
    return model, opt, head, hvd_adapt.State(model=model, optimizer=opt, snapshot_budget=None)


def add_head(model, opt):
    head = torch.nn.Linear(4, 4)
    model.append(head)
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    return head


model, opt, head, state = build(0, False)
state.sync()
steps = []
data = torch.Generator().manual_seed(100 + rank)


def step(label):
    opt.zero_grad()
    model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
    opt.step()
    saved = opt.state_dict()["state"]
    steps.append({"label": label, "params": digest(model.parameters()),
                  "state": digest(v for i in sorted(saved) for k, v in sorted(saved[i].items())
                                  if torch.is_tensor(v)),
                  "steps": sorted({float(v["step"]) for v in saved.values()})})


step("1")
step("2")
state.commit()
model[2].weight.requires_grad_(True)            # unfrozen after the commit
step("3 unfrozen")
step("4 unfrozen")
state.restore()                                 # back to the frozen layer's layout
step("5 restored")
state.commit()
head = add_head(model, opt)                     # a param group added
step("6 group added")
step("7 group added")
state.commit()
# A resize: rank 1 joins afresh (new weights, no optimizer state); rank 0 carries its
# model and optimizer over through state_dict(), the state on disk through load_state_dict.
# (Both build new objects: the allreduce names number the live optimizers of a structure.)
old_model, old_opt = model, opt
model, opt, head, state = build(1 + rank, True)
model[2].weight.requires_grad_(True)
if rank == 0:
    model.load_state_dict(old_model.state_dict())
    opt.load_state_dict(old_opt.state_dict())
# The old optimizer lives on (its State keeps it): a State must carry every one.
state = hvd_adapt.State(model=model, optimizer=opt, retired=old_opt,
                        snapshot_budget=None)
state.sync()
step("8 after a joiner's sync")
step("9 after a joiner's sync")
report({"rank": rank, "steps": steps}, rank)
