"""A script ported from AdaptDL by changing imports: no State.sync() and no hvd_adapt.run.

Each rank starts from its own random weights (as torch.manual_seed(rank) or no
seed gives them); after training every rank reports a hash of its parameters.
"""
import hashlib

import torch

import hvd_adapt
from _report import report

hvd_adapt.init()
rank = hvd_adapt.env.rank()
torch.manual_seed(rank)
model = torch.nn.Linear(3, 1)
opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                     momentum=0.9, weight_decay=0.01))
x = torch.randn(64, 3, generator=torch.Generator().manual_seed(7))
loader = hvd_adapt.AdaptiveDataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                      batch_size=8, shuffle=True)
state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
for epoch in hvd_adapt.remaining_epochs_until(2):
    for xb, yb in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        state.commit()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
report({"rank": rank, "params": h.hexdigest()}, rank)
