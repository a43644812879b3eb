"""Gradient noise scale: running estimates of |G|^2 and tr(Sigma).

From n gradients of micro-batches of b samples each, with mean squared norm
``local_sqr`` (each micro-batch alone) and ``total_sqr`` (their average),

    E[local_sqr] = |G|^2 + tr(Sigma) / b
    E[total_sqr] = |G|^2 + tr(Sigma) / (n b)

which solve to the unbiased estimates used here (McCandlish et al., "An
Empirical Model of Large-Batch Training", 2018; AdaptDL's estimator). The
micro-batches are the replicas' local gradients and, with accumulation, each
accumulation step; with one replica and no accumulation, two consecutive
steps stand in for two replicas. Estimates are smoothed per parameter group
by an exponential moving average with bias correction.
"""
import numpy as np

from .goodput import GradParams

_MIN_TRACE = 1e-12


class GradientNoiseScale:
    """Smoothed |G|^2 and tr(Sigma) per parameter group, and the AdaScale gain.

    >>> gns = GradientNoiseScale(num_groups=1)
    >>> gns.update(local_sqr=[5.0], total_sqr=[3.0], micro_bsz=8, num_micro=2, init_batch_size=16)
    True
    >>> gns.sqr, gns.trace
    (array([1.]), array([32.]))
    """

    def __init__(self, num_groups=1, smoothing=0.999):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.smoothing = smoothing
        self._biased = {"sqr": np.zeros(num_groups), "trace": np.zeros(num_groups)}
        self._unbias = 0.0
        self.progress = 0.0
        self.num_updates = 0

    def update(self, local_sqr, total_sqr, micro_bsz, num_micro, init_batch_size):
        """Add one measurement; returns False (and changes nothing) for unusable input."""
        local_sqr = np.asarray(local_sqr, dtype=float)
        total_sqr = np.asarray(total_sqr, dtype=float)
        n = num_micro
        if n < 2 or micro_bsz < 1 or not (np.all(np.isfinite(local_sqr))
                                          and np.all(np.isfinite(total_sqr))):
            return False
        sqr = (n * total_sqr - local_sqr) / (n - 1)
        trace = (local_sqr - total_sqr) * micro_bsz * n / (n - 1)
        # Larger batches are worth more samples: weight the average accordingly.
        theta = self.smoothing ** (n * micro_bsz / init_batch_size)
        self._biased["sqr"] = theta * self._biased["sqr"] + (1 - theta) * sqr
        self._biased["trace"] = theta * self._biased["trace"] + (1 - theta) * trace
        self._unbias = theta * self._unbias + (1 - theta)
        self.num_updates += 1
        return True

    def has_estimate(self):
        return self.num_updates > 0

    @property
    def sqr(self):
        """Estimated |G|^2 per parameter group."""
        return self._biased["sqr"] / max(self._unbias, 1e-300)

    @property
    def trace(self):
        """Estimated tr(Sigma) per parameter group (per-sample gradient covariance)."""
        return self._biased["trace"] / max(self._unbias, 1e-300)

    def grad_params(self, init_batch_size):
        """Totals over all groups as :class:`GradParams` for the goodput model."""
        return GradParams(sqr=float(np.sum(np.maximum(self.sqr, 0.0))),
                          var=float(np.sum(np.maximum(self.trace, _MIN_TRACE))) / init_batch_size)

    def noise_scale(self):
        """B_noise = tr(Sigma) / |G|^2: the batch size where noise and signal balance."""
        params = self.grad_params(1)
        return params.var / params.sqr if params.sqr > 0 else float("inf")

    def gain(self, batch_size, init_batch_size, per_group=False):
        """AdaScale gain r = (var + sqr) / (var / scale + sqr), scale = batch_size / init_batch_size."""
        scale = batch_size / init_batch_size
        if per_group:
            sqr = np.maximum(self.sqr, 0.0)
            var = np.maximum(self.trace, _MIN_TRACE) / init_batch_size
        else:
            sqr, var = self.grad_params(init_batch_size)
        if not self.has_estimate():
            return np.ones_like(sqr) if per_group else 1.0
        return (var + sqr) / (var / scale + sqr)

    def state_dict(self):
        return {"biased": {k: v.copy() for k, v in self._biased.items()}, "unbias": self._unbias,
                "progress": self.progress, "num_updates": self.num_updates,
                "smoothing": self.smoothing}

    def load_state_dict(self, state):
        self._biased = {k: np.array(v, dtype=float) for k, v in state["biased"].items()}
        self._unbias = state["unbias"]
        self.progress = state["progress"]
        self.num_updates = state["num_updates"]
        self.smoothing = state["smoothing"]
