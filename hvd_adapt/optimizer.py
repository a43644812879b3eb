"""A distributed optimizer that measures gradients before averaging them.

Horovod's ``hvd.DistributedOptimizer`` averages gradients inside backward and
fixes the accumulation count at construction. Goodput scaling needs the
local gradient norms before averaging (for the noise scale) and an
accumulation count that changes while training, so this wrapper keeps
micro-batch gradients itself and averages all of them in one Horovod
``grouped_allreduce_`` per optimizer step.
"""
import time

import horovod.torch as hvd
import numpy as np
import torch

from . import env
from .gns import GradientNoiseScale
from .scaling_rules import ScalingRule, default_rule


def _wide(dtype):
    # Half-precision sums over long vectors lose most of their digits.
    return torch.promote_types(dtype, torch.float32)


def _sqnorms(groups):
    """Squared L2 norm of each group's tensors together, with one device sync."""
    if not groups:
        return np.zeros(0)
    zero = torch.zeros((), dtype=torch.float64)
    sqrs = [torch.stack([torch.linalg.vector_norm(g, dtype=_wide(g.dtype)) for g in grads])
            .double().pow(2).sum() if grads else zero for grads in groups]
    return torch.stack(sqrs).cpu().numpy()


def _flatten(groups):
    """Each group's gradients as one new flat tensor, in float32 at least (a copy: the next
    backward overwrites .grad)."""
    flats = [torch.cat([g.reshape(-1) for g in grads]) if grads else None for grads in groups]
    return [None if f is None else f.to(_wide(f.dtype)) for f in flats]


def _flat_stats(flats, previous=None):
    """|f|^2 per group and, given the previous step's flats, f.previous per group: one sync."""
    zero = torch.zeros((), dtype=torch.float64)
    values = [torch.dot(f, f).double() if f is not None else zero for f in flats]
    if previous is not None:
        values += [torch.dot(f, q).double() if f is not None else zero
                   for f, q in zip(flats, previous)]
    out = torch.stack(values).cpu().numpy() if values else np.zeros(0)
    n = len(flats)
    return out[:n], (out[n:] if previous is not None else None)


def _shapes(flats):
    return [None if f is None else f.shape for f in flats]


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

    The noise scale costs a few passes over the gradients per step; it is
    measured when ``measure_noise`` is True, or (the default, None) when the
    loader autoscales its batch size, the one use it has there.

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
        self._previous = None

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
        self._previous = None

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
        self._previous = None
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
                # On the gradients' device: Horovod fuses a group on one device.
                device = params[0].device if params else "cpu"
                stats = torch.tensor(local_sqr, dtype=torch.float64, device=device)
                tensors.append(stats)
            # A fixed name lets Horovod's response cache skip negotiation.
            hvd.grouped_allreduce_(tensors, op=hvd.Average, name="hvd_adapt.grads")
            if measuring:
                local_sqr = stats.cpu().numpy()
            if self._loader is not None:
                self._loader.profile.record_sync(env.num_nodes(), size,
                                                 self._loader.current_local_bsz,
                                                 time.perf_counter() - started)
        self._discard_stash()
        if measuring:
            self.gns.update(local_sqr, _sqnorms(self._grads()), self._loader.current_local_bsz,
                            micro * size, self._loader.batch_size)
        return self._scaled_step(closure)

    def _discard_stash(self):
        self._stash = None
        self._micro_sqr = None
        self._micro_count = 0

    def _measure_single(self):
        """One gradient per step: pair it with the previous step's, using
        |(a + b) / 2|^2 = (|a|^2 + |b|^2 + 2 a.b) / 4."""
        flats = _flatten(self._grads())
        previous = self._previous
        paired = previous is not None and _shapes(previous[0]) == _shapes(flats)
        sqr, dots = _flat_stats(flats, previous[0] if paired else None)
        self._previous = (flats, sqr)
        if not paired:
            return
        previous_sqr = previous[1]
        local_sqr = (previous_sqr + sqr) / 2
        total_sqr = (previous_sqr + sqr + 2 * dots) / 4
        self.gns.update(local_sqr, total_sqr, self._loader.current_local_bsz, 2,
                        self._loader.batch_size)

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
