"""A distributed optimizer that measures gradients before averaging them.

Horovod's ``hvd.DistributedOptimizer`` averages gradients inside backward and
fixes the accumulation count at construction. Goodput scaling needs the
local gradient norms before averaging (for the noise scale) and an
accumulation count that changes while training, so this wrapper keeps
micro-batch gradients itself and averages all of them in one Horovod
``grouped_allreduce_`` per optimizer step.
"""
import functools
import time

import horovod.torch as hvd
import torch

from . import env
from .gns import GradientNoiseScale
from .scaling_rules import ScalingRule, default_rule


def _wide(dtype):
    # Half-precision sums over long vectors lose most of their digits.
    return torch.promote_types(dtype, torch.float32)


def _sqnorms(groups):
    """Squared L2 norm of each group's tensors together: a float64 tensor on their device, so
    that measuring costs no device sync until the step's results are read together."""
    device = next((g.device for grads in groups for g in grads), "cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([torch.stack([torch.linalg.vector_norm(g, dtype=_wide(g.dtype))
                                     for g in grads]).double().pow(2).sum() if grads else zero
                        for grads in groups])


def _stats_dtype(params):
    """The dtype to allreduce the local norms in: the gradients' own where it holds a squared
    norm, float64 otherwise. Horovod fuses one dtype into one buffer: a float64 tensor beside
    float32 gradients was a second allreduce every step (``benchmarks/overhead.py
    --measure-noise`` at two processes: 1.10-1.24 against 1.01-1.08)."""
    dtypes = {p.grad.dtype for p in params}
    if len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}:
        return dtypes.pop()
    return torch.float64


# With one replica and no accumulation, the noise is measured on one pair of
# consecutive steps in this many. On small models the measurement's cost is
# per-call overhead that also slows the next forward and backward (caches), up
# to a third of a step when done every step; the smoothed estimate spans
# hundreds of steps, so sampling it loses little.
_PAIR_EVERY = 4


class _GradientPair:
    """Two consecutive steps' gradients, flattened into the two rows of one buffer.

    Storing one is a copy; their squared norms and dot product for every
    parameter group come from one Gram matrix and one device sync.
    """

    def __init__(self):
        self._buffer = None
        self._sizes = None
        self._has_first = False

    def forget(self):
        self._has_first = False

    def _store(self, groups, row):
        flat = [g.reshape(-1) for grads in groups for g in grads]
        if not flat:
            return False
        sizes = [sum(g.numel() for g in grads) for grads in groups]
        dtype = _wide(functools.reduce(torch.promote_types, {g.dtype for g in flat}))
        buffer = self._buffer
        if buffer is None or self._sizes != sizes or buffer.dtype != dtype \
                or buffer.device != flat[0].device:
            if row == 1:
                return False
            buffer = self._buffer = torch.zeros((2, sum(sizes)), dtype=dtype, device=flat[0].device)
            self._sizes = sizes
        torch.cat(flat, out=buffer[row])
        return True

    def first(self, groups):
        """Store the first step's gradients (one list of tensors per group)."""
        self._has_first = self._store(groups, 0)

    def second(self, groups):
        """Store the second step's; returns ``(first_sqr, second_sqr, dots)`` per group as numpy
        arrays, or None when there is no first step to pair with."""
        if not (self._has_first and self._store(groups, 1)):
            return None
        self._has_first = False
        if len(self._sizes) == 1:
            gram = torch.mm(self._buffer, self._buffer.t()).unsqueeze(0)
        else:
            gram = torch.stack([torch.mm(part, part.t())
                                for part in self._buffer.split(self._sizes, dim=1)])
        gram = gram.cpu().numpy()
        return gram[:, 0, 0], gram[:, 1, 1], gram[:, 0, 1]


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer``: average gradients over replicas, accumulate, scale the lr.

    Call ``step()`` after every batch, as without accumulation: on the
    batches where the loader says ``is_optim_step()`` is False, ``step()``
    only stashes the gradient (and clears ``.grad``), so ``zero_grad()`` every
    batch is right. On optimizer steps the stashed and current gradients are
    averaged over micro-batches and replicas, the gradient noise scale is
    updated, and the wrapped optimizer steps with its lr scaled by
    ``scaling_rule`` (default: AdaScale, AdamScale for Adam-like optimizers)
    for batches above the loader's initial ``batch_size``.

    The noise scale costs a few passes over the gradients per step (with one
    replica and no accumulation, on two steps in every four); it is measured
    when ``measure_noise`` is True, or (the default, None) when the loader
    autoscales its batch size, the one use it has there.

    >>> opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, optimizer, scaling_rule=None, smoothing=0.999, measure_noise=None):
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("optimizer is already an hvd_adapt.DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scaling_rule is not None and not isinstance(scaling_rule, ScalingRule):
            raise ValueError(f"scaling_rule must be an hvd_adapt ScalingRule, got {scaling_rule!r}")
        # Optimizer.__init__ is skipped on purpose: groups and state are the
        # wrapped optimizer's own objects, so schedulers and checkpoints that
        # touch either see one truth.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.scaling_rule = scaling_rule or default_rule(optimizer)
        self.gns = GradientNoiseScale(len(optimizer.param_groups), smoothing=smoothing)
        self.measure_noise = measure_noise
        self._loader = None
        self._stash = None
        self._micro_sqr = None
        self._micro_count = 0
        self._pair = _GradientPair()
        self._single_steps = 0

    # torch.optim.Optimizer protocol, forwarded to the wrapped optimizer.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def __getstate__(self):
        raise TypeError("hvd_adapt.DistributedOptimizer is not picklable; save state_dict()")

    def __repr__(self):
        return f"hvd_adapt.DistributedOptimizer({self.optimizer!r})"

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)
        self.gns = GradientNoiseScale(len(self.optimizer.param_groups), self.gns.smoothing)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _bind(self, loader):
        self._loader = loader
        loader._optimizer = self

    def _grads(self):
        return [[p.grad for p in group["params"] if p.grad is not None]
                for group in self.param_groups]

    def _params_with_grad(self):
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def step(self, closure=None):
        """Stash the gradient on accumulation steps; average, measure and step otherwise."""
        loader = self._loader
        if loader is not None and not loader.is_optim_step():
            self._accumulate()
            return None
        return self._synchronized_step(closure)

    def _measuring(self):
        if self._loader is None:
            return False
        if self.measure_noise is None:
            return self._loader._autoscale is not None
        return self.measure_noise

    def _accumulate(self):
        if self._measuring():
            sqr = _sqnorms(self._grads())
            self._micro_sqr = sqr if self._micro_sqr is None else self._micro_sqr + sqr
        self._micro_count += 1
        params = self._params_with_grad()
        if self._stash is None:
            self._stash = [torch.zeros_like(p) for p in params]
        for buf, p in zip(self._stash, params):
            if p.grad is not None:
                buf.add_(p.grad)
                p.grad = None

    def discard_accumulation(self):
        """Drop stashed micro-batch gradients and the previous step's (after a restore)."""
        self._discard_stash()
        self._pair.forget()

    def _synchronized_step(self, closure):
        params = self._params_with_grad()
        for p in params:
            if p.grad is None:
                # Every replica must pass the same tensors to the allreduce.
                p.grad = torch.zeros_like(p)
        measuring = self._measuring()
        micro = self._micro_count + 1
        size = env.size()
        if measuring and micro * size == 1:
            self._measure_single()
            return self._scaled_step(closure)
        self._pair.forget()
        last_sqr = _sqnorms(self._grads()) if measuring else None
        if self._stash is not None:
            for buf, p in zip(self._stash, params):
                p.grad.add_(buf)
        if micro > 1:
            for p in params:
                p.grad.div_(micro)
        local_sqr = None
        if measuring:
            micro_sqr = last_sqr if self._micro_sqr is None else last_sqr + self._micro_sqr
            local_sqr = micro_sqr / micro
        if size > 1:
            started = time.perf_counter()
            tensors = [p.grad for p in params]
            if measuring:
                local_sqr = local_sqr.to(_stats_dtype(params))
                tensors.append(local_sqr)
            # A fixed name lets Horovod's response cache skip negotiation.
            hvd.grouped_allreduce_(tensors, op=hvd.Average, name="hvd_adapt.grads")
            if self._loader is not None:
                self._loader.profile.record_sync(env.num_nodes(), size,
                                                 self._loader.current_local_bsz,
                                                 time.perf_counter() - started)
        self._discard_stash()
        if measuring:
            local_sqr, total_sqr = torch.stack([local_sqr.double(),
                                                _sqnorms(self._grads())]).cpu().numpy()
            self.gns.update(local_sqr, total_sqr, self._loader.current_local_bsz, micro * size,
                            self._loader.batch_size)
        return self._scaled_step(closure)

    def _discard_stash(self):
        self._stash = None
        self._micro_sqr = None
        self._micro_count = 0

    def _measure_single(self):
        """One gradient per step: pair one step's gradient with the next one's, every
        ``_PAIR_EVERY`` steps, using |(a + b) / 2|^2 = (|a|^2 + |b|^2 + 2 a.b) / 4."""
        phase = self._single_steps % _PAIR_EVERY
        self._single_steps += 1
        if phase == 0:
            self._pair.first(self._grads())
        if phase != 1:
            return
        paired = self._pair.second(self._grads())
        if paired is None:
            return
        first_sqr, second_sqr, dots = paired
        local_bsz = self._loader.current_local_bsz
        self.gns.update((first_sqr + second_sqr) / 2, (first_sqr + second_sqr + 2 * dots) / 4,
                        local_bsz, 2, self._loader.batch_size, samples=_PAIR_EVERY * local_bsz)

    def _scaled_step(self, closure):
        loader = self._loader
        if loader is None or loader.current_batch_size <= loader.batch_size:
            self.gns.progress += 1.0
            return self.optimizer.step(closure)
        batch_size, init_batch_size = loader.current_batch_size, loader.batch_size
        groups = self.param_groups
        factors = self.scaling_rule.lr_factors(self.gns, batch_size, init_batch_size, len(groups))
        saved = []
        for factor, group in zip(factors, groups):
            original = self.scaling_rule.adjust_group(group, self.gns, batch_size, init_batch_size)
            original["lr"] = group["lr"]
            group["lr"] = group["lr"] * float(factor)
            saved.append(original)
        try:
            result = self.optimizer.step(closure)
        finally:
            for original, group in zip(saved, groups):
                group.update(original)
        self.gns.progress += float(self.gns.gain(batch_size, init_batch_size))
        return result

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "gns": self.gns.state_dict()}

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.gns.load_state_dict(state_dict["gns"])
        self.discard_accumulation()
