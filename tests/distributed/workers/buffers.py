"""BatchNorm's running statistics at 2 ranks, each rank on its own shard: after every commit
every rank's buffers are rank 0's, which a plain-torch model trained on rank 0's shards alone
(whose buffers the broadcast carries forward) reproduces; ``--keep-local`` passes
``broadcast_buffers=False`` and reports the ranks' own."""
import sys

import torch

import hvd_adapt
from _report import report

hvd_adapt.init()
rank = hvd_adapt.env.rank()
keep_local = "--keep-local" in sys.argv


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 1))


model = net()
opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
state = hvd_adapt.State(model=model, optimizer=opt, broadcast_buffers=not keep_local)
# The reference: plain torch on rank 0's shard; its buffers are what every rank holds after a
# commit (the parameters are the averaged ones, taken from the distributed model each step).
reference = net()
gen = torch.Generator().manual_seed(1)
steps = []
for step in range(4):
    shards = [torch.randn(16, 4, generator=gen) * (1 + r) + r for r in range(2)]
    targets = [x.sum(1, keepdim=True) for x in shards]
    reference.load_state_dict({k: v for k, v in model.state_dict().items()
                               if "running" not in k and "num_batches" not in k}, strict=False)
    reference(shards[0])
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(shards[rank]), targets[rank]).backward()
    opt.step()
    state.commit()
    bn = model[1]
    steps.append({"mean": bn.running_mean.tolist(), "var": bn.running_var.tolist(),
                  "tracked": int(bn.num_batches_tracked),
                  "reference_mean": reference[1].running_mean.tolist(),
                  "reference_var": reference[1].running_var.tolist()})
report({"steps": steps}, rank)
