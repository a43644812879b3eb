"""Digits: an MLP on scikit-learn's 8x8 digits, warped at random and drawn at 24x24 with noise.

The plain digits are learnt in a fraction of a second. Each training digit is
drawn 40 times at 24x24 under a random rotation, scale and shift, with pixel
noise; validation draws the held-out writers the same way. The MLP has no
translation invariance to lean on, so it takes a minute of training on two
cores to generalise.
"""
import math

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .base import Workload, classification_loss

SIDE = 24


def _warped(images, rng, copies):
    n = len(images) * copies
    angle = rng.uniform(-0.25, 0.25, n)
    scale = rng.uniform(0.8, 1.1, n)
    shift = rng.uniform(-0.2, 0.2, (n, 2))
    theta = np.zeros((n, 2, 3), dtype=np.float32)
    theta[:, 0, 0] = theta[:, 1, 1] = [math.cos(a) / s for a, s in zip(angle, scale)]
    theta[:, 0, 1] = -np.sin(angle) / scale
    theta[:, 1, 0] = np.sin(angle) / scale
    theta[:, :, 2] = shift
    source = torch.from_numpy(np.tile(images, (copies, 1, 1))[:, None])
    grid = torch.nn.functional.affine_grid(torch.from_numpy(theta), (n, 1, SIDE, SIDE),
                                           align_corners=False)
    out = torch.nn.functional.grid_sample(source, grid, align_corners=False).numpy()
    out += rng.normal(0, 0.3, size=out.shape).astype(np.float32)
    return out.reshape(n, -1)


def make_data(seed=0, size=1.0):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x, y = (x[order] / 16.0).reshape(-1, 8, 8).astype(np.float32), y[order]
    split = int(0.8 * len(x))
    copies = max(1, int(round(40 * size)))
    to_set = lambda a, b: TensorDataset(torch.from_numpy(a), torch.from_numpy(b).long())  # noqa: E731
    return (to_set(_warped(x[:split], rng, copies), np.tile(y[:split], copies)),
            to_set(_warped(x[split:], rng, 4), np.tile(y[split:], 4)))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(SIDE * SIDE, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def make_optimizer(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


WORKLOAD = Workload(
    name="digits", make_data=make_data, make_model=make_model, make_optimizer=make_optimizer,
    loss=classification_loss, metric="accuracy", higher_is_better=True,
    targets=(0.90, 0.93, 0.95), base_batch=32, base_lr=0.03, lr_scaling="linear",
    batches=(32, 64, 128, 512), max_local_bsz=512, read_every=4096)
