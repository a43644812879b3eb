"""The distributed optimizer: gradients averaged during backward, the noise scale measured
before averaging, and the learning rate scaled for the batch size in use.

Which batches end an accumulation cycle, and which batch sizes the learning
rate is scaled between, it asks the controller of the loader it trains on;
the averaging itself happens in ``exchange.py``'s hooks. (Just over 300
lines: the class speaks both torch's Optimizer protocol and Horovod's
optimizer API, and splitting one class would scatter its step.)
"""
import contextlib
import logging

import horovod.torch as hvd
import torch
from horovod.torch.functions import broadcast_parameters

from .._runtime import collective, env
from .._runtime.context import CONTEXT
from ..autoscale.controller import MEASURE_EVERY, Controller
from ..elastic.participant import Participant
from .exchange import Cycle, GradientExchange
from .noise import GradientNoiseScale, adam_denominators
from .scaling_rules import ScalingRule, default_rule

log = logging.getLogger(__name__)


class DistributedOptimizer(torch.optim.Optimizer, Participant):
    """Wrap ``optimizer``: average gradients over replicas, accumulate, scale the lr.

    The loop is a plain PyTorch loop; call ``zero_grad()``, one
    ``backward()`` and ``step()`` for every batch (sum several losses before
    the one backward: each backward pass counts as a micro-step). Gradients are averaged over replicas by
    grouped Horovod allreduces of buckets of up to ``bucket_cap_mb`` (None:
    25 MB on GPUs, 4 MB on the CPU, see ``exchange.py``), each started
    from gradient hooks once backward has produced the whole bucket, on the
    last micro-step of an accumulation cycle only (earlier
    micro-steps accumulate into ``.grad``, and ``zero_grad()`` and ``step()``
    leave them alone), and they are averaged when ``backward()`` returns, so
    clipping and mixed precision work as in one process. As with any gradient
    accumulation, unscale, clip and step where a batch ends a cycle (one
    replica measuring the noise splits a step in four into two batches)::

        scaler.scale(loss).backward()     # averaged over replicas here
        if loader.is_optim_step():
            opt.synchronize()             # (a no-op then; kept for Horovod's recipes)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)          # every rank skips an overflowing step alike
            scaler.update()

    ``step()`` updates the gradient noise scale and steps the wrapped
    optimizer with its lr scaled by ``scaling_rule`` (default: AdaScale,
    AdamScale for Adam-like optimizers); a step that is skipped counts
    neither as progress nor as a noise sample. The noise scale is measured,
    on one optimizer step in four (each measurement standing for four), when
    ``measure_noise`` is True, or (the default, None) when the loader
    autoscales its batch size; for Adam-like optimizers in the space their
    second moment preconditions. Pass ``grad_scaler`` (a
    ``torch.amp.GradScaler``) so that the measurements are divided by its
    loss scale. ``compression``, ``op`` and ``gradient_predivide_factor``
    mean what they mean to ``hvd.DistributedOptimizer``.

    >>> import hvd_adapt, torch
    >>> hvd_adapt.init()
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> model(torch.ones(2, 3)).sum().backward(); opt.step(); opt.zero_grad()
    """

    sync_after_every_reset = False

    def __init__(self, optimizer, scaling_rule=None, smoothing=0.999, measure_noise=None,
                 compression=None, op=None, gradient_predivide_factor=1.0, grad_scaler=None,
                 bucket_cap_mb=None):
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
        op = hvd.Average if op is None else op
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 or None, got {bucket_cap_mb!r}")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got "
                             f"{gradient_predivide_factor!r}")
        # Optimizer.__init__ is skipped on purpose: groups and state are the
        # wrapped optimizer's own objects, so schedulers and checkpoints that
        # touch either see one truth.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.scaling_rule = scaling_rule or default_rule(optimizer)
        self.gns = GradientNoiseScale(len(optimizer.param_groups), smoothing=smoothing)
        self.measure_noise = measure_noise
        self.grad_scaler = grad_scaler
        self._controller = None
        self._skip_sync = False
        self._synced = False        # replicas were made alike (State.sync) before training
        self._op = op
        self._compression = compression or hvd.Compression.none
        self._predivide = gradient_predivide_factor
        self._bucket_cap_mb = bucket_cap_mb
        self._exchange = None
        self._hook_params()
        # Its step makes collectives: a State must carry it.
        CONTEXT.collective_objects.add(self)

    def _hook_params(self):
        if self._exchange is not None:
            self._exchange.remove()
        self._group_of = {p: group for group in self.optimizer.param_groups
                          for p in group["params"]}
        self._exchange = GradientExchange(self.optimizer.param_groups, self._plan_cycle,
                                          self._denominators, self._compression, self._op,
                                          self._predivide, self._bucket_cap_mb)

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
        """Add a group to the wrapped optimizer; its parameters get gradient hooks too."""
        self.optimizer.add_param_group(param_group)
        self.gns = GradientNoiseScale(len(self.optimizer.param_groups), self.gns.smoothing)
        if self._controller is not None:
            self._controller.attach_noise_scale(self.gns, self._measuring)
        self._hook_params()

    def zero_grad(self, set_to_none=True):
        """Clear the gradients, except between the micro-steps of an accumulation cycle."""
        if self._exchange.cycle_open:
            return
        # A step that was skipped (GradScaler found inf) leaves its cycle behind: drop it.
        self._exchange.take_finished()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- collaborators -----------------------------------------------------------------
    def attach(self, controller):
        """Train on the loader whose :class:`~hvd_adapt.autoscale.controller.Controller` this is:
        its cycles decide when to average and step, its batch sizes how to scale the lr."""
        if not isinstance(controller, Controller):
            raise ValueError(f"expected an hvd_adapt Controller, got {controller!r}")
        self._controller = controller
        controller.attach_noise_scale(self.gns, self._measuring)
        controller.on_cycle_abandoned(self.discard_accumulation)

    def join(self, peers):
        """Attach to the autoscaled loader among ``peers`` (the State's values), else the first."""
        controllers = [peer.controller for peer in peers
                       if isinstance(getattr(peer, "controller", None), Controller)]
        if controllers:
            self.attach(next((c for c in controllers if c.autoscaling), controllers[0]))

    def on_reset(self):
        self.discard_accumulation()

    def discard_accumulation(self):
        """Forget accumulated micro-steps and measurements (after a restore)."""
        self._exchange.discard()

    # -- what each backward pass does --------------------------------------------------
    def _measuring(self):
        # Measurements are weighed against the loader's batch sizes: none without one.
        if self._controller is None:
            return False
        if self.measure_noise is None:
            return self._controller.autoscaling
        return bool(self.measure_noise)

    def _plan_cycle(self):
        controller = self._controller
        last = controller is None or controller.is_optim_step()
        replicas = env.size()
        # One replica measures only cycles of several micro-steps (the loader
        # splits a step in MEASURE_EVERY when there is no accumulation).
        several = replicas > 1 or not last or self._exchange.cycle_open
        measure = self._measuring() and several
        if measure and not controller.splits_steps():
            # Every rank counts the same cycles since the last sync, so all
            # agree on which cycle carries the norms with its last bucket.
            measure = self._exchange.cycles_since_sync % MEASURE_EVERY == 0
        return Cycle(last, measure, replicas)

    def _denominators(self, params):
        by_group = {}
        for p in params:
            group = self._group_of[p]
            by_group.setdefault(id(group), (group, []))[1].append(p)
        out = {}
        for group, members in by_group.values():
            states = [self.optimizer.state.get(p, {}) for p in members]
            out.update(zip(members, adam_denominators(states, group)))
        return out

    # -- Horovod's names -----------------------------------------------------------------
    def synchronize(self):
        """Wait for the gradient allreduces; afterwards every rank holds the averaged
        gradients. They are waited for at the end of backward already, so this only
        matters for code that reads gradients from inside the backward pass."""
        self._exchange.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's context for ``step()`` after an explicit ``synchronize()``; here
        ``step()`` never waits again, so it only keeps Horovod's recipes working."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    # -- stepping ----------------------------------------------------------------------
    def step(self, closure=None):
        """On the last micro-step of a cycle: take the noise measurement, step the wrapped
        optimizer with the scaled lr and count the progress. Elsewhere nothing."""
        if self._exchange.cycle_open:
            return None
        if not self._skip_sync:
            self._exchange.synchronize()
        if not self._synced and env.size() > 1:
            self._sync_forgotten()
        finished = self._exchange.take_finished()
        if finished is not None:
            cycle, stats, sync_seconds = finished
            if self._controller is not None:
                if cycle.replicas > 1:
                    self._controller.record_sync(sync_seconds)
                self._take_measurement(cycle, stats)
        return self._scaled_step(closure)

    def _take_measurement(self, cycle, stats):
        if stats is None or not self._measuring():
            return
        scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
        local, total = torch.stack([stats.local, stats.total]).cpu().numpy() / scale ** 2
        if self._op == hvd.Sum:
            total = total / cycle.replicas ** 2
        controller = self._controller
        # Each measurement stands for the MEASURE_EVERY steps until the next.
        micro_bsz = controller.local_bsz
        samples = MEASURE_EVERY * stats.num_micro * micro_bsz
        if controller.split_micro_bsz is not None:
            # Two halves of one step on every replica.
            micro_bsz = controller.split_micro_bsz
            samples = MEASURE_EVERY * controller.local_bsz * cycle.replicas
        self.gns.update(local, total, micro_bsz, stats.num_micro, controller.init_batch_size,
                        samples=samples)

    def _scaled_step(self, closure):
        controller = self._controller
        if controller is None:
            self.gns.progress += 1.0
            return self.optimizer.step(closure)
        batch_size, init_batch_size = controller.batch_size, controller.init_batch_size
        groups = self.param_groups
        factors = self.scaling_rule.lr_factors(self.gns, batch_size, init_batch_size, len(groups))
        saved = []
        for index, (factor, group) in enumerate(zip(factors, groups)):
            original = self.scaling_rule.adjust_group(group, self.gns, batch_size,
                                                      init_batch_size, index)
            if factor != 1.0:
                original["lr"] = group["lr"]
                group["lr"] = group["lr"] * float(factor)
            saved.append(original)
        try:
            result = self.optimizer.step(closure)
        finally:
            for original, group in zip(saved, groups):
                group.update(original)
        if batch_size > init_batch_size:
            self.gns.progress += float(self.gns.gain(batch_size, init_batch_size))
        else:
            self.gns.progress += 1.0
        return result

    def _sync_forgotten(self):
        # Every replica takes its first step here at the same point, so this
        # collective is safe; without it replicas started from different
        # random weights would train apart without a word.
        if env.rank() == 0:
            log.warning("the first optimizer step of %d replicas came before any sync: "
                        "parameters and optimizer state are broadcast from rank 0 now. Wrap the "
                        "training function in @hvd_adapt.run (or call state.sync()) so that the "
                        "model's buffers and every other value are synced too", env.size())
        params = [p.data for group in self.param_groups for p in group["params"]]
        broadcast_parameters([(f"hvd_adapt.unsynced.{i}", p) for i, p in enumerate(params)],
                             root_rank=0)
        self.sync_from_root()

    # -- elastic state -----------------------------------------------------------------
    def sync_from_root(self):
        """Collective: adopt rank 0's optimizer state, noise scale and GradScaler state; drop
        accumulated gradients."""
        collective.broadcast_optimizer_state(self.optimizer)
        self._load_extra_state(collective.broadcast_object(self._extra_state(),
                                                           name="hvd_adapt.sync.optimizer"))
        self.discard_accumulation()
        self._synced = True

    def _extra_state(self):
        extra = {"gns": self.gns.state_dict()}
        if self.grad_scaler is not None:
            # Scale and growth tracker: replicas that unscaled by different
            # factors would apply different updates from one averaged gradient.
            extra["grad_scaler"] = self.grad_scaler.state_dict()
        return extra

    def _load_extra_state(self, extra):
        self.gns.load_state_dict(extra["gns"])
        if self.grad_scaler is not None and extra.get("grad_scaler"):
            self.grad_scaler.load_state_dict(extra["grad_scaler"])

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()`` (torch's format) with hvd_adapt's own state
        (noise scale, GradScaler) under the key ``"hvd_adapt"``."""
        return dict(self.optimizer.state_dict(), hvd_adapt=self._extra_state())

    def load_state_dict(self, state_dict):
        """Load a :meth:`state_dict`, or a plain torch optimizer's (the noise scale is kept)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvd_adapt", None)
        if "optimizer" in state_dict and "state" not in state_dict:
            # hvd_adapt 0.2's layout, in checkpoints it wrote.
            extra = {"gns": state_dict["gns"]}
            state_dict = state_dict["optimizer"]
        self.optimizer.load_state_dict(state_dict)
        if extra is not None:
            self._load_extra_state(extra)
        self.discard_accumulation()
