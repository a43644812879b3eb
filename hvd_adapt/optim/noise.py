"""Gradient noise scale: running estimates of |G|^2 and tr(Sigma).

From n gradients of micro-batches of b samples each, with mean squared norm
``local_sqr`` (each micro-batch alone) and ``total_sqr`` (their average),

    E[local_sqr] = |G|^2 + tr(Sigma) / b
    E[total_sqr] = |G|^2 + tr(Sigma) / (n b)

which solve to the unbiased estimates used here (McCandlish et al., "An
Empirical Model of Large-Batch Training", 2018; AdaptDL's estimator). The
micro-batches are the replicas' local gradients and, with accumulation, each
accumulation step; with one replica and no accumulation, the two halves of a
step the loader splits (one step in every few; see ``autoscale/controller.py``).
Two gradients of the same weights measure noise alone; consecutive steps'
gradients would also differ by the weights' drift between them. Estimates
are smoothed per parameter group by an exponential moving average with bias
correction, each measurement weighted by the training samples it stands for.

The estimator is numpy; the helpers below it take the measurements from
torch gradients on their own device.
"""
import numpy as np
import torch

from ..goodput import GradParams

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
        # Row 0: |G|^2, row 1: tr(Sigma), one column per group; one array so
        # that a step's update is a handful of numpy calls (it runs every step).
        self._biased = np.zeros((2, num_groups))
        self._unbias = 0.0
        self._gains = {}
        self.progress = 0.0
        #: Optimizer steps taken (progress counts each at its gain).
        self.steps = 0
        self.num_updates = 0

    def add_group(self):
        """A parameter group was added: estimates for it start empty; progress is kept."""
        self._biased = np.concatenate([self._biased, np.zeros((2, 1))], axis=1)
        self._gains.clear()

    def update(self, local_sqr, total_sqr, micro_bsz, num_micro, init_batch_size, samples=None):
        """Add one measurement; returns False (and changes nothing) for unusable input.

        ``samples``: the training samples this measurement stands for, which
        sets its weight in the average (default: the ``num_micro * micro_bsz``
        it was measured on; more when measurements skip steps)."""
        n = num_micro
        if n < 2 or micro_bsz < 1:
            return False
        solve = np.array([[n, -1.0], [-micro_bsz * n, micro_bsz * n]]) / (n - 1)
        estimate = solve @ np.array((total_sqr, local_sqr), dtype=float)
        if not np.isfinite(estimate).all():
            return False
        # Larger batches are worth more samples: weight the average accordingly.
        theta = self.smoothing ** ((n * micro_bsz if samples is None else samples) / init_batch_size)
        self._biased = theta * self._biased + (1 - theta) * estimate
        self._unbias = theta * self._unbias + (1 - theta)
        self._gains.clear()
        self.num_updates += 1
        return True

    def has_estimate(self):
        return self.num_updates > 0

    @property
    def sqr(self):
        """Estimated |G|^2 per parameter group."""
        return self._biased[0] / max(self._unbias, 1e-300)

    @property
    def trace(self):
        """Estimated tr(Sigma) per parameter group (per-sample gradient covariance)."""
        return self._biased[1] / max(self._unbias, 1e-300)

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
        # Asked for every step at a scaled batch, and the estimates change only
        # on updates: a dozen small numpy calls per step are worth saving.
        key = (batch_size, init_batch_size, per_group)
        if key not in self._gains:
            gain = self._gain(batch_size, init_batch_size, per_group)
            if per_group:
                gain.flags.writeable = False
            self._gains[key] = gain
        return self._gains[key]

    def _gain(self, batch_size, init_batch_size, per_group):
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
        return {"biased": {"sqr": self._biased[0].copy(), "trace": self._biased[1].copy()},
                "unbias": self._unbias,
                "progress": self.progress, "steps": self.steps,
                "num_updates": self.num_updates,
                "smoothing": self.smoothing}

    def load_state_dict(self, state):
        self._biased = np.array([state["biased"]["sqr"], state["biased"]["trace"]], dtype=float)
        self._unbias = state["unbias"]
        self._gains.clear()
        self.progress = state["progress"]
        self.steps = state.get("steps", 0)
        self.num_updates = state["num_updates"]
        self.smoothing = state["smoothing"]


def wide_dtype(dtype):
    # Half-precision sums over long vectors lose most of their digits.
    return torch.promote_types(dtype, torch.float32)


def sqnorm(tensor):
    """Squared L2 norm as a 0-d float64 tensor on the tensor's device (no host sync)."""
    flat = tensor.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat).double()
    return torch.linalg.vector_norm(flat, dtype=wide_dtype(flat.dtype)).double().pow(2)


def total_sqnorm(tensors, denominators=None):
    """The sum of ``|t / d|^2`` over ``tensors`` (``d`` the matching entry of
    ``denominators``; None or a None entry: 1), as a 0-d float64 tensor on their device.

    A few multi-tensor operations however many tensors there are: per-tensor
    ones cost a quarter of a step on a small transformer's 28 tensors.
    """
    tensors = list(tensors)
    if denominators is not None:
        divided = [i for i, d in enumerate(denominators) if d is not None]
        if divided:
            quotients = torch._foreach_div([tensors[i] for i in divided],
                                           [denominators[i] for i in divided])
            for i, quotient in zip(divided, quotients):
                tensors[i] = quotient
    by_dtype = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    norms = [norm for dtype, same in by_dtype.items()
             for norm in torch._foreach_norm(same, 2, dtype=wide_dtype(dtype))]
    return torch.stack(norms).double().square().sum()


def group_sqnorms(groups, denominators=None):
    """:func:`total_sqnorm` of each group's tensors: a float64 tensor on their device, so
    that measuring costs no device sync until the step's results are read together."""
    device = next((g.device for grads in groups for g in grads), "cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([
        total_sqnorm(grads, None if denominators is None else denominators[index])
        if grads else zero for index, grads in enumerate(groups)])


def stats_dtype(params):
    """The dtype to allreduce the local norms in: the gradients' own where it holds a squared
    norm, float64 otherwise. Horovod fuses one dtype into one buffer: a float64 tensor beside
    float32 gradients was a second allreduce every step (see ``benchmarks/RESULTS.md``)."""
    dtypes = {p.grad.dtype for p in params if p.grad is not None}
    if len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}:
        return dtypes.pop()
    return torch.float64


def adam_denominators(states, group):
    """Adam's ``sqrt(v_hat) + eps`` (what its update divides by) for each of one param
    group's parameter ``states``, so that the noise is measured in the space the update is
    taken in (AdaptDL's AdamGradientNoiseScale); None for a state without a second moment
    (other optimizers, and Adam before its first step). One multi-tensor operation a stage."""
    out = [None] * len(states)
    indices = [i for i, state in enumerate(states) if "exp_avg_sq" in state]
    if not indices:
        return out
    beta2 = group["betas"][1]
    steps = [states[i]["step"] for i in indices]
    if all(torch.is_tensor(step) and step.device.type != "cpu" for step in steps):
        # Fused and capturable Adam keep the step on the GPU, where float()
        # would wait for the device at every parameter.
        corrections = torch._foreach_pow(beta2, steps)
        torch._foreach_neg_(corrections)
        torch._foreach_add_(corrections, 1.0)
    else:
        corrections = [1.0 - beta2 ** float(step) for step in steps]
    denominators = torch._foreach_div([states[i]["exp_avg_sq"] for i in indices], corrections)
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, group["eps"])
    for i, denominator in zip(indices, denominators):
        out[i] = denominator
    return out
