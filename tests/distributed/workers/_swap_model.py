"""The two-rank swap workers' model: eight Linear(32, 32) + Tanh layers and an AdamW whose
step can be made to fail at a chosen chunk (tests/support/hooked_optimizer.py)."""
import torch

import hvd_adapt

from support.hooked_optimizer import HookedAdamW


def build(swap_dir):
    """``(model, optimizer)``, the state on disk under ``swap_dir`` or in memory (None).
    Buffers of 24 KiB: 8 chunks of two parameters, so a fault at chunk 6 comes after
    parameters moved, with reads and writes of other chunks in flight."""
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    inner = HookedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = hvd_adapt.DistributedOptimizer(inner, swap_dir=swap_dir,
                                         swap_buffer_mb=24 / 1024 if swap_dir else None)
    return model, opt
