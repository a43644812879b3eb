"""Digits: an MLP on scikit-learn's 8x8 digits, warped at random and drawn at 24x24 with noise.

The plain digits are learnt in a fraction of a second. Every time a training
digit is fetched it is drawn afresh at 24x24 under a random rotation, scale
and shift, with pixel noise, as an augmenting input pipeline would; an epoch
visits each digit ``copies`` times. Validation draws the held-out writers the
same way, once, into a fixed set. The MLP has no translation invariance to
lean on and never sees the same input twice, so it keeps learning for
minutes on two cores instead of memorising a fixed set of warps.
"""
import numpy as np
import torch
from torch.utils.data import TensorDataset

from .base import Workload, classification_loss

SIDE = 24
# How far a digit is warped: rotation (radians either way), scale, shift (a
# fraction of the image either way) and pixel noise (std). Strong enough that
# the MLP is still learning after a minute.
ANGLE, SCALE, SHIFT, NOISE = 0.45, (0.7, 1.15), 0.3, 0.5
# Held-out digits are each drawn this many times: the validation set is large
# enough that its accuracy moves by less than the steps between targets.
VALIDATION_DRAWS = 20


def _warped(images, rng, copies=1):
    n = len(images) * copies
    angle = rng.uniform(-ANGLE, ANGLE, n)
    scale = rng.uniform(*SCALE, n)
    shift = rng.uniform(-SHIFT, SHIFT, (n, 2))
    theta = np.zeros((n, 2, 3), dtype=np.float32)
    theta[:, 0, 0] = theta[:, 1, 1] = np.cos(angle) / scale
    theta[:, 0, 1] = -np.sin(angle) / scale
    theta[:, 1, 0] = np.sin(angle) / scale
    theta[:, :, 2] = shift
    source = torch.from_numpy(np.tile(images, (copies, 1, 1))[:, None])
    grid = torch.nn.functional.affine_grid(torch.from_numpy(theta), (n, 1, SIDE, SIDE),
                                           align_corners=False)
    out = torch.nn.functional.grid_sample(source, grid, align_corners=False).numpy()
    out += rng.normal(0, NOISE, size=out.shape).astype(np.float32)
    return out.reshape(n, -1)


class FreshlyWarpedDigits(torch.utils.data.Dataset):
    """``copies`` x the digits ``images`` (N, 8, 8) with ``labels``; each fetch warps anew,
    from a generator seeded by torch's, so a run's seed fixes its draws. Batches are
    warped together (``__getitems__``, which torch's DataLoader calls with a batch)."""

    def __init__(self, images, labels, copies):
        self.images, self.labels, self.copies = images, torch.from_numpy(labels).long(), copies

    def __len__(self):
        return len(self.images) * self.copies

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        digits = np.asarray(indices) % len(self.images)
        rng = np.random.default_rng(int(torch.randint(2 ** 62, ())))
        x = torch.from_numpy(_warped(self.images[digits], rng))
        y = self.labels[digits]
        return [(x[i], y[i]) for i in range(len(digits))]


def make_data(seed=0, size=1.0):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x, y = (x[order] / 16.0).reshape(-1, 8, 8).astype(np.float32), y[order]
    split = int(0.8 * len(x))
    copies = max(1, int(round(40 * size)))
    validation = TensorDataset(torch.from_numpy(_warped(x[split:], rng, VALIDATION_DRAWS)),
                               torch.from_numpy(np.tile(y[split:], VALIDATION_DRAWS)).long())
    return FreshlyWarpedDigits(x[:split], y[:split], copies), validation


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(SIDE * SIDE, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def make_optimizer(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


WORKLOAD = Workload(
    name="digits", make_data=make_data, make_model=make_model, make_optimizer=make_optimizer,
    loss=classification_loss, metric="accuracy", higher_is_better=True,
    targets=(0.75, 0.83, 0.86), base_batch=32, base_lr=0.03, lr_scaling="linear",
    batches=(32, 64, 128, 512), max_local_bsz=512, read_every=8192)
