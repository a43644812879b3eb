"""Shapes: a small ResNet on generated 32x32 colour images of eight kinds of shape.

Every image is one shape (disk, ring, square, frame, triangle, cross,
diamond, bar) at a random position, size, rotation and colour on a random
background, with pixel noise, drawn with numpy from a seed.
"""
import numpy as np
import torch
from torch.utils.data import TensorDataset

from .base import Workload, classification_loss

SIDE = 32
KINDS = 8


def _masks(kind, u, v, r):
    a, b = np.abs(u), np.abs(v)
    rho2 = u ** 2 + v ** 2
    square = np.maximum(a, b)
    shapes = [rho2 <= r ** 2,
              (rho2 <= r ** 2) & (rho2 >= (0.6 * r) ** 2),
              square <= 0.8 * r,
              (square <= 0.8 * r) & (square >= 0.5 * r),
              (v >= -0.6 * r) & (v <= 0.8 * r) & (a <= 0.55 * (0.8 * r - v)),
              ((a <= 0.25 * r) & (b <= r)) | ((b <= 0.25 * r) & (a <= r)),
              a + b <= r,
              (a <= r) & (b <= 0.3 * r)]
    return np.select([kind == k for k in range(KINDS)], shapes, False)


def draw(labels, rng):
    """Images (N, 3, 32, 32) in [0, 1] plus noise, one shape of kind ``labels[i]`` each."""
    n = len(labels)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    centre = rng.uniform(9, SIDE - 9, (n, 2, 1, 1)).astype(np.float32)
    radius = rng.uniform(5, 9, (n, 1, 1)).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi, (n, 1, 1)).astype(np.float32)
    dx, dy = x - centre[:, 0], y - centre[:, 1]
    u = np.cos(angle) * dx + np.sin(angle) * dy
    v = -np.sin(angle) * dx + np.cos(angle) * dy
    mask = _masks(labels[:, None, None], u, v, radius)[:, None]
    fg = rng.uniform(0, 1, (n, 3, 1, 1)).astype(np.float32)
    bg = rng.uniform(0, 1, (n, 3, 1, 1)).astype(np.float32)
    # Keep the shape visible: push the foreground away from the background.
    fg = np.where(np.abs(fg - bg) < 0.3, (bg + 0.5) % 1.0, fg)
    image = np.where(mask, fg, bg) + rng.normal(0, 0.2, (n, 3, SIDE, SIDE)).astype(np.float32)
    return image.astype(np.float32)


def make_data(seed=0, size=1.0):
    rng = np.random.default_rng(seed)
    sets = []
    for count in (max(KINDS, int(40000 * size)), 1000):
        labels = rng.integers(0, KINDS, count)
        images = np.concatenate([draw(labels[i:i + 4096], rng) for i in range(0, count, 4096)])
        sets.append(TensorDataset(torch.from_numpy(images), torch.from_numpy(labels).long()))
    return tuple(sets)


class Block(torch.nn.Module):
    """Two 3x3 convolutions with GroupNorm (independent of the batch size) and a shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.GroupNorm(8, cout),
            torch.nn.ReLU(), torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            torch.nn.GroupNorm(8, cout))
        self.shortcut = (torch.nn.Identity() if stride == 1 and cin == cout else
                         torch.nn.Conv2d(cin, cout, 1, stride, bias=False))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def make_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False), torch.nn.GroupNorm(8, 16), torch.nn.ReLU(),
        Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2), Block(64, 64, 1),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, KINDS))


def make_optimizer(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)


WORKLOAD = Workload(
    name="shapes", make_data=make_data, make_model=make_model, make_optimizer=make_optimizer,
    loss=classification_loss, metric="accuracy", higher_is_better=True,
    targets=(0.6, 0.8, 0.88), base_batch=32, base_lr=0.02, lr_scaling="linear",
    batches=(32, 64, 128, 512), max_local_bsz=256, read_every=2048)
