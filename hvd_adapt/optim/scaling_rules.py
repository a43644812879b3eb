"""Learning-rate scaling rules for batches larger than the initial one.

A rule maps the current scale (B / B0) and the gradient statistics to one
learning-rate factor per parameter group; :class:`hvd_adapt.DistributedOptimizer`
multiplies each group's lr by it for the step, then restores the lr, so an lr
scheduler keeps working on the base lr.

>>> rule = LinearScale()          # needs no gradient statistics, so gns=None here
>>> rule.lr_factors(None, batch_size=512, init_batch_size=128, num_groups=1)
array([4.])
"""
import math

import numpy as np


class ScalingRule:
    """Base class: ``lr_factors`` returns one factor per parameter group."""

    def lr_factors(self, gns, batch_size, init_batch_size, num_groups):
        raise NotImplementedError

    def adjust_group(self, group, gns, batch_size, init_batch_size, index=None):
        """Hyper-parameters other than lr of group ``index`` to change for one step; returns
        the originals (restored after the step)."""
        return {}


class AdaScale(ScalingRule):
    """lr x gain, the AdaScale rule (Johnson et al., "AdaScale SGD", ICML 2020), per group.

    The gain r = (var + sqr) / (var / scale + sqr) is how many B0-steps one
    step at B is worth: 1 when gradients are noise-free, up to ``scale`` when
    noise dominates.
    """

    def lr_factors(self, gns, batch_size, init_batch_size, num_groups):
        return np.broadcast_to(gns.gain(batch_size, init_batch_size, per_group=True),
                               (num_groups,)).astype(float)


class AdamScale(AdaScale):
    """For Adam/AdamW: lr x sqrt(gain), and each beta raised to the gain.

    Adam normalises its update by the second moment, so an update's size
    grows with the square root of the variance reduction rather than
    linearly. Raising the betas to the gain makes the moment averages forget
    as fast per unit of progress as they do at B0.
    """

    def lr_factors(self, gns, batch_size, init_batch_size, num_groups):
        return np.sqrt(super().lr_factors(gns, batch_size, init_batch_size, num_groups))

    def adjust_group(self, group, gns, batch_size, init_batch_size, index=None):
        if "betas" not in group:
            return {}
        gains = np.atleast_1d(gns.gain(batch_size, init_batch_size, per_group=True))
        # Each group's moments forget at the pace of its own gain.
        gain = float(np.mean(gains) if index is None else gains[min(index, len(gains) - 1)])
        original = {"betas": group["betas"]}
        group["betas"] = tuple(beta ** gain for beta in group["betas"])
        return original


class LinearScale(ScalingRule):
    """lr x scale (Goyal et al., 2017)."""

    def lr_factors(self, gns, batch_size, init_batch_size, num_groups):
        return np.full(num_groups, batch_size / init_batch_size)


class SqrtScale(ScalingRule):
    """lr x sqrt(scale) (Krizhevsky, 2014)."""

    def lr_factors(self, gns, batch_size, init_batch_size, num_groups):
        return np.full(num_groups, math.sqrt(batch_size / init_batch_size))


class LEGWScale(ScalingRule):
    """Linear-epoch gradual warm-up (You et al., "Large-Batch Training for LSTM and Beyond",
    2019): the warm-up lasts ``base_warmup_epochs`` times the batch scale in epochs, which
    is ``base_warmup_epochs * data_size / init_batch_size`` optimizer steps at any batch
    size; the lr rises linearly to lr x sqrt(scale).

    The factor at an optimizer step ``t`` (the optimizer's ``gns.steps``) is
    ``sqrt(B / B0) * min(1, t / warmup_steps)``: a larger batch warms up over as
    many steps, so over more epochs, to a higher lr.

    >>> from types import SimpleNamespace
    >>> rule = LEGWScale(base_warmup_epochs=2, data_size=1000)
    >>> float(rule.lr_factors(SimpleNamespace(steps=5), 400, 100, 1)[0])   # 2*1000/100 = 20
    0.5
    """

    def __init__(self, base_warmup_epochs, data_size):
        if base_warmup_epochs < 0:
            raise ValueError(f"base_warmup_epochs must be >= 0, got {base_warmup_epochs!r}")
        if data_size < 1:
            raise ValueError(f"data_size must be >= 1, got {data_size!r}")
        self.base_warmup_epochs = base_warmup_epochs
        self.data_size = data_size

    def warmup_steps(self, init_batch_size):
        """Optimizer steps the warm-up lasts: the same at every batch size."""
        return self.base_warmup_epochs * self.data_size / init_batch_size

    def lr_factors(self, gns, batch_size, init_batch_size, num_groups):
        factor = math.sqrt(batch_size / init_batch_size)
        warmup_steps = self.warmup_steps(init_batch_size)
        if warmup_steps > 0:
            factor *= min(1.0, gns.steps / warmup_steps)
        return np.full(num_groups, factor)


def default_rule(optimizer):
    """AdamScale for Adam-like optimizers (those with betas), AdaScale otherwise."""
    if all("betas" in group for group in optimizer.param_groups):
        return AdamScale()
    return AdaScale()
