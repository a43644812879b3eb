"""Two autoscaling replicas training a linear model for two epochs, ``decide_every``
8 steps, with SGD (momentum, weight decay) or (``--amp``) AdamW under bf16 autocast with a
GradScaler. Reports every batch this rank was handed (its sample ids), the
parameters, and the local batch sizes rank 0's step-time profile holds for this world."""
import sys

import torch

import hvd_adapt
from _report import report

hvd_adapt.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
amp = "--amp" in sys.argv
scaler = torch.amp.GradScaler("cpu") if amp else None
base = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01) if amp else \
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
opt = hvd_adapt.DistributedOptimizer(base, grad_scaler=scaler)
gen = torch.Generator().manual_seed(1)
x = torch.randn(512, 4, generator=gen)
ids = torch.arange(512)
data = torch.utils.data.TensorDataset(x, x @ torch.arange(1.0, 5.0).unsqueeze(1), ids)
loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=32, shuffle=True)
# A global batch of at most 32: the halves, not a choice, make the second size.
loader.autoscale_batch_size(32, decide_every=8)
state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
batches = []


@hvd_adapt.run
def train(state):
    for epoch in hvd_adapt.remaining_epochs_until(2):
        for xb, yb, idb in loader:
            batches.append((epoch, idb.tolist()))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            if amp:
                scaler.scale(loss).backward()
                if loader.is_optim_step():      # a half batch is half a step
                    scaler.step(opt)
                    scaler.update()
            else:
                loss.backward()
                opt.step()


train(state)
timed = loader.controller.profile.arrays()
report({"batches": batches,
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "optim_state": [[v.flatten().tolist() for v in st.values() if torch.is_tensor(v)]
                        for st in base.state.values()],
        "sizes": sorted({int(b) for b, r in zip(timed["atomic_bsz"], timed["num_replicas"])
                         if r == hvd_adapt.env.size()})},
       hvd_adapt.env.rank())
