"""A small classification job for optimizer tests in one process."""
import torch
from torch.utils.data import TensorDataset

import hvd_adapt


def linear_classifier(make_optimizer, device="cpu", **optimizer_kwargs):
    """Linear(6, 3) on ``device`` and 64 seeded samples of 3 classes (on the CPU), batch 8, in
    a State: returns ``(model, opt, loader)``, ``opt`` the hvd_adapt optimizer wrapping
    ``make_optimizer(model.parameters())`` with ``optimizer_kwargs``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(device)
    opt = hvd_adapt.DistributedOptimizer(make_optimizer(model.parameters()), **optimizer_kwargs)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 6, generator=gen), torch.randint(3, (64,), generator=gen))
    loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=8)
    hvd_adapt.State(model=model, optimizer=opt, loader=loader)
    return model, opt, loader
