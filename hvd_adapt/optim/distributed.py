"""A distributed optimizer that measures gradients before averaging them.

Horovod's ``hvd.DistributedOptimizer`` averages gradients inside backward and
fixes the accumulation count at construction. Goodput scaling needs the
local gradient norms before averaging (for the noise scale) and an
accumulation count that changes while training, so this wrapper keeps
micro-batch gradients itself and averages all of them in one Horovod
``grouped_allreduce_`` per optimizer step. Which batches end a cycle, and
which batch sizes the learning rate is scaled between, it asks the
controller of the loader it trains on.
"""
import time

import horovod.torch as hvd
import torch

from .._runtime import collective, env
from ..autoscale.controller import Controller
from ..elastic.participant import Participant
from .noise import PAIR_EVERY, GradientNoiseScale, GradientPair, group_sqnorms, stats_dtype
from .scaling_rules import ScalingRule, default_rule


class DistributedOptimizer(torch.optim.Optimizer, Participant):
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

    >>> import hvd_adapt, torch
    >>> hvd_adapt.init()
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> model(torch.ones(2, 3)).sum().backward(); opt.step(); opt.zero_grad()
    """

    sync_after_every_reset = False

    def __init__(self, optimizer, scaling_rule=None, smoothing=0.999, measure_noise=None):
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("optimizer is already an hvd_adapt.DistributedOptimizer")
        if callable(getattr(optimizer, "synchronize", None)) \
                and callable(getattr(optimizer, "skip_synchronize", None)):
            raise ValueError(
                f"{type(optimizer).__name__} is a Horovod DistributedOptimizer: it averages "
                "gradients itself, so wrapping it would average them twice and measure a noise "
                "scale of about zero; pass the plain torch optimizer instead")
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
        self._controller = None
        self._stash = None
        self._micro_sqr = None
        self._micro_count = 0
        self._pair = GradientPair()
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
        if self._controller is not None:
            self._controller.attach_noise_scale(self.gns)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def attach(self, controller):
        """Train on the loader whose :class:`~hvd_adapt.autoscale.controller.Controller` this is:
        its cycles decide when to step, its batch sizes how to scale the lr."""
        if not isinstance(controller, Controller):
            raise ValueError(f"expected an hvd_adapt Controller, got {controller!r}")
        self._controller = controller
        controller.attach_noise_scale(self.gns)

    def join(self, peers):
        """Attach to the autoscaled loader among ``peers`` (the State's values), else the first."""
        controllers = [peer.controller for peer in peers
                       if isinstance(getattr(peer, "controller", None), Controller)]
        if controllers:
            self.attach(next((c for c in controllers if c.autoscaling), controllers[0]))

    def on_reset(self):
        self.discard_accumulation()

    def _grads(self):
        return [[p.grad for p in group["params"] if p.grad is not None]
                for group in self.param_groups]

    def _params_with_grad(self):
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def step(self, closure=None):
        """Stash the gradient on accumulation steps; average, measure and step otherwise."""
        controller = self._controller
        if controller is not None and not controller.is_optim_step():
            self._accumulate()
            return None
        return self._synchronized_step(closure)

    def _measuring(self):
        if self._controller is None:
            return False
        if self.measure_noise is None:
            return self._controller.autoscaling
        return self.measure_noise

    def _accumulate(self):
        if self._measuring():
            sqr = group_sqnorms(self._grads())
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
        last_sqr = group_sqnorms(self._grads()) if measuring else None
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
                local_sqr = local_sqr.to(stats_dtype(params))
                tensors.append(local_sqr)
            # A fixed name lets Horovod's response cache skip negotiation.
            hvd.grouped_allreduce_(tensors, op=hvd.Average, name="hvd_adapt.grads")
            if self._controller is not None:
                self._controller.record_sync(time.perf_counter() - started)
        self._discard_stash()
        if measuring:
            local_sqr, total_sqr = torch.stack([local_sqr.double(),
                                                group_sqnorms(self._grads())]).cpu().numpy()
            self.gns.update(local_sqr, total_sqr, self._controller.local_bsz, micro * size,
                            self._controller.init_batch_size)
        return self._scaled_step(closure)

    def _discard_stash(self):
        self._stash = None
        self._micro_sqr = None
        self._micro_count = 0

    def _measure_single(self):
        """One gradient per step: pair one step's gradient with the next one's, every
        ``PAIR_EVERY`` steps, using |(a + b) / 2|^2 = (|a|^2 + |b|^2 + 2 a.b) / 4."""
        phase = self._single_steps % PAIR_EVERY
        self._single_steps += 1
        if phase == 0:
            self._pair.first(self._grads())
        if phase != 1:
            return
        paired = self._pair.second(self._grads())
        if paired is None:
            return
        first_sqr, second_sqr, dots = paired
        local_bsz = self._controller.local_bsz
        self.gns.update((first_sqr + second_sqr) / 2, (first_sqr + second_sqr + 2 * dots) / 4,
                        local_bsz, 2, self._controller.init_batch_size,
                        samples=PAIR_EVERY * local_bsz)

    def _scaled_step(self, closure):
        controller = self._controller
        if controller is None or controller.batch_size <= controller.init_batch_size:
            self.gns.progress += 1.0
            return self.optimizer.step(closure)
        batch_size, init_batch_size = controller.batch_size, controller.init_batch_size
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

    def sync_from_root(self):
        """Collective: adopt rank 0's optimizer state and noise scale; drop accumulated gradients."""
        collective.broadcast_optimizer_state(self.optimizer)
        self.gns.load_state_dict(collective.broadcast_object(self.gns.state_dict(),
                                                             name="hvd_adapt.sync.gns"))
        self.discard_accumulation()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "gns": self.gns.state_dict()}

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.gns.load_state_dict(state_dict["gns"])
        self.discard_accumulation()
