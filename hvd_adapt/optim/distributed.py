"""The distributed optimizer: gradients averaged during backward, the noise scale measured
before averaging, and the learning rate scaled for the batch size in use.

Which batches end an accumulation cycle, and which batch sizes the learning
rate is scaled between, it asks the controller of the loader it trains on;
the averaging itself happens in ``exchange.py``'s hooks, and the wrapped
optimizer's per-parameter state is kept by an ``optimizer_state.py``
implementation (in memory, or on disk with ``swap_dir``), which this class
never tells apart. (The class speaks both torch's Optimizer protocol and
Horovod's optimizer API, and splitting one class would scatter its step.)
"""
import contextlib
import gc
import hashlib
import logging
import weakref

import horovod.torch as hvd
import torch

from .._checks import check_bool
from .._runtime import collective, env
from .._runtime.context import CONTEXT
from ..autoscale.controller import MEASURE_EVERY, Controller
from ..elastic.participant import Participant
from ..swap import DiskState
from .backward_pass import current_task
from .exchange import Cycle, GradientExchange
from .matching import Matching, check_unique
from .noise import GradientNoiseScale, adam_denominators
from .optimizer_state import MemoryState
from .scaling_rules import ScalingRule, default_rule

log = logging.getLogger(__name__)


class DistributedOptimizer(torch.optim.Optimizer, Participant):
    """Wrap ``optimizer``: average gradients over replicas, accumulate, scale the lr.

    The loop is a plain PyTorch loop; call ``zero_grad()``, ``backward()``
    and ``step()`` for every batch (several backwards before a step add up as
    in one process). Gradients are averaged over replicas by
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
    loss scale and its scale is saved, synced and checkpointed with this
    optimizer's state. ``compression``, ``op``, ``gradient_predivide_factor``
    and ``sparse_as_dense`` mean what they mean to ``hvd.DistributedOptimizer``;
    ``named_parameters`` (``model.named_parameters()``) names the parameters:
    ranks match theirs by name (a group's order may differ per rank, see
    ``matching.py``), and errors name them. Construction is a collective
    outside elastic jobs: it checks that every rank has the same parameters
    and gives every rank rank 0's values (as DDP does). At ``step()`` every
    ``.grad`` no hook averaged (assigned by the user) is averaged, see
    ``ledger.py``. A backward pass that raises (caught) drops its
    accumulation cycle on every rank, or, where it raised on some ranks only,
    makes every rank raise :class:`hvd_adapt.AbandonedBackwardError` (see
    ``exchange.py``).

    >>> import hvd_adapt, torch
    >>> hvd_adapt.init()
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> model(torch.ones(2, 3)).sum().backward(); opt.step(); opt.zero_grad()
    """

    sync_after_every_reset = False

    def __init__(self, optimizer, scaling_rule=None, smoothing=0.999, measure_noise=None,
                 compression=None, op=None, gradient_predivide_factor=1.0, grad_scaler=None,
                 bucket_cap_mb=None, sparse_as_dense=False, named_parameters=None,
                 swap_dir=None, swap_buffer_mb=None):
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
        check_bool("sparse_as_dense", sparse_as_dense)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names = {p: name for name, p in (named_parameters or [])}
        check_unique([group["params"] for group in optimizer.param_groups], names)
        _check_not_hooked(params, names)
        # Before any hook: a swap_dir or buffer size it refuses leaves nothing behind.
        self._state = MemoryState(optimizer) if swap_dir is None \
            else DiskState(optimizer, swap_dir, swap_buffer_mb)
        self.optimizer = optimizer
        self._names = names
        self._matching = Matching()
        if env.size() > 1 and not env.is_elastic():
            # An elastic job matches at its first sync instead: a worker that joins
            # builds its optimizer while the others train.
            self._match_ranks(broadcast=True)
        # torch's Optimizer.__init__ sets up what step hooks, profiling and
        # state_dict hooks need. The groups and the state stay the wrapped
        # optimizer's, looked up live (a load_state_dict replaces its group
        # dicts): while adopting, the setters below keep nothing and
        # add_param_group adds nothing.
        self._adopting = True
        try:
            torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        finally:
            self._adopting = False
        self.scaling_rule = scaling_rule or default_rule(optimizer)
        self.gns = GradientNoiseScale(len(optimizer.param_groups), smoothing=smoothing)
        self.measure_noise = measure_noise
        self.grad_scaler = grad_scaler
        self._controller = None
        self._skip_sync = False
        self._synced = False        # replicas were made alike (State.sync) before training
        self._op = op
        self._predivide = gradient_predivide_factor
        #: Prefix of this optimizer's allreduce names: one per structure of
        #: parameters, numbered among live optimizers of that structure, so the
        #: same on every rank and never another optimizer's.
        self.exchange_name = _exchange_name([p for group in self._matched_groups()
                                             for p in group])
        self._exchange = GradientExchange(
            self._matched_groups,
            self._plan_cycle, self._denominators, compression or hvd.Compression.none, op,
            gradient_predivide_factor, bucket_cap_mb, self.exchange_name,
            sparse_as_dense=sparse_as_dense, names=names)
        for p in params:
            CONTEXT.hooked_params[p] = weakref.ref(self)
        weakref.finalize(self, self._state.release)
        # Its step makes collectives: a State must carry it.
        CONTEXT.collective_objects.add(self)

    def _matched_groups(self):
        # The groups' parameters in rank 0's order: buckets match across ranks.
        return [self._matching.order(group["params"]) for group in self.optimizer.param_groups]

    def _match_ranks(self, broadcast):
        groups = [group["params"] for group in self.optimizer.param_groups]
        self._matching.agree(groups, self._names)
        if broadcast:
            # As DDP does: step 0 starts from rank 0's weights, however ranks were seeded.
            params = [p for group in self._matched_groups() for p in group]
            collective.broadcast_tensors([(f"hvd_adapt.init.{i}", p.data)
                                          for i, p in enumerate(params)], root_rank=0)

    # torch.optim.Optimizer protocol, forwarded to the wrapped optimizer.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        if not self._adopting:
            raise AttributeError("the groups are the wrapped optimizer's: use add_param_group")

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        if not self._adopting:
            raise AttributeError("the state is the wrapped optimizer's: use load_state_dict")

    def __getstate__(self):
        raise TypeError("hvd_adapt.DistributedOptimizer is not picklable; save state_dict()")

    def __repr__(self):
        return f"hvd_adapt.DistributedOptimizer({self.optimizer!r})"

    def add_param_group(self, param_group):
        """Add a group to the wrapped optimizer; its parameters are averaged too, the noise
        scale gains a group and keeps its progress."""
        if self._adopting:
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_unique([group["params"] for group in self.param_groups] + [params], self._names)
        _check_not_hooked(params, {})
        self.optimizer.add_param_group(param_group)
        self.gns.add_group()
        self._exchange.hook(params)
        for p in params:
            CONTEXT.hooked_params[p] = weakref.ref(self)

    def zero_grad(self, set_to_none=True):
        """Clear the gradients, except between the micro-steps of an accumulation cycle."""
        self._exchange.settle("zero_grad")
        if self._exchange.cycle_open:
            return
        # A step that was skipped (GradScaler found inf) leaves its cycle behind: drop it.
        self._exchange.take_finished()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        # Parameters frozen or unfrozen since the last step get their buckets now.
        self._exchange.refresh()

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
        self._state.on_reset()

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
            # Optimizer steps since the last batch-size decision: every rank
            # counts the same (decisions are collective, and follow every
            # reset), so all agree on which cycles carry norms.
            measure = controller.measure_due()
        position = controller.cycle_position() if controller is not None else 0
        return Cycle(last, measure, replicas, position)

    def _denominators(self, params, group_indices):
        # Groups looked up now: load_state_dict replaces the group dicts.
        groups = self.param_groups
        out = [None] * len(params)
        by_group = {}
        for i, index in enumerate(group_indices):
            by_group.setdefault(index, []).append(i)
        source = self._state.tensors(params, {"exp_avg_sq", "step"})
        for index, members in by_group.items():
            states = [source.get(params[i], {}) for i in members]
            for i, denominator in zip(members, adam_denominators(states, groups[index])):
                out[i] = denominator
        return out

    # -- Horovod's names -----------------------------------------------------------------
    def synchronize(self):
        """Wait for the gradient allreduces; afterwards every rank holds the averaged
        gradients. They are waited for at the end of backward already, so this only
        matters for code that reads gradients from inside the backward pass, and where
        ``.grad`` was assigned since (PCGrad, gradient surgery): those are averaged here
        (see ``ledger.py``), as ``step()`` does when not in :meth:`skip_synchronize`.
        Outside backward it is a collective, like ``step()``."""
        self._exchange.synchronize()
        if current_task() == -1 and not self._exchange.cycle_open:
            self._exchange.reconcile()

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
        optimizer with the scaled lr and count the progress. Elsewhere nothing; a cycle in
        which a backward raised on every rank is not stepped either."""
        self._exchange.settle("step")
        mid_cycle = self._controller is not None and not self._controller.is_optim_step()
        if self._exchange.cycle_open or mid_cycle:
            if self.grad_scaler is not None:
                raise RuntimeError(
                    "scaler.step() (or step()) on a batch that does not end the accumulation "
                    "cycle: the GradScaler would unscale part of the cycle's gradient twice. "
                    "Unscale, clip and step only where loader.is_optim_step() is True (the "
                    "loader splits a step in four into two batches while one replica measures "
                    "the noise, and autoscaling may choose accumulation)")
            return None
        if not self._skip_sync:
            self._exchange.synchronize()
            self._exchange.reconcile()
        if not self._synced and env.size() > 1:
            self._sync_forgotten()
        finished = self._exchange.take_finished()
        if finished is not None:
            if finished.skip:
                return None
            if self._controller is not None:
                if finished.cycle.replicas > 1:
                    self._controller.record_sync(finished.sync_seconds)
                self._take_measurement(finished.cycle, finished.stats)
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
            # Counted once the step is taken: a refused or failed one (a full disk) is not.
            result = self._inner_step(closure)
            self.gns.progress += 1.0
            self.gns.steps += 1
            return result
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
            result = self._inner_step(closure)
        finally:
            for original, group in zip(saved, groups):
                group.update(original)
        if batch_size > init_batch_size:
            self.gns.progress += float(self.gns.gain(batch_size, init_batch_size))
        else:
            self.gns.progress += 1.0
        self.gns.steps += 1
        return result

    def _inner_step(self, closure):
        # With the state on disk, a failure on any rank is every rank's (see swap/).
        return self._state.step(closure)

    def swap_metrics(self):
        """Seconds reading, waiting for reads, writing and stepping, and bytes moved, over the
        steps taken with the state on disk (an empty dict without ``swap_dir``)."""
        return self._state.metrics()

    def _sync_forgotten(self):
        # Every replica takes its first step here at the same point, so this
        # collective is safe; without it replicas started from different
        # random weights would train apart without a word.
        if env.rank() == 0:
            log.warning("the first optimizer step of %d replicas came before any sync: "
                        "parameters and optimizer state are broadcast from rank 0 now. Wrap the "
                        "training function in @hvd_adapt.run (or call state.sync()) so that the "
                        "model's buffers and every other value are synced too", env.size())
        params = [p.data for group in self._matched_groups() for p in group]
        collective.broadcast_tensors([(f"hvd_adapt.unsynced.{i}", p)
                                      for i, p in enumerate(params)], root_rank=0)
        self.sync_from_root()

    # -- elastic state -----------------------------------------------------------------
    def sync_from_root(self):
        """Collective: adopt rank 0's optimizer state, noise scale, GradScaler state and
        bucket layout; drop accumulated gradients. State on disk travels a chunk at a time.
        Parameters are matched to rank 0's by name first (see ``matching.py``)."""
        self._match_ranks(broadcast=False)
        self._state.sync_from_root()
        self._load_extra_state(collective.broadcast_object(self._extra_state(),
                                                           name="hvd_adapt.sync.optimizer"))
        self.discard_accumulation()
        self._synced = True

    def _extra_state(self):
        extra = {"gns": self.gns.state_dict(), "layout": self._exchange.layout_state()}
        if self.grad_scaler is not None:
            # Scale and growth tracker: replicas that unscaled by different
            # factors would apply different updates from one averaged gradient.
            extra["grad_scaler"] = self.grad_scaler.state_dict()
        return extra

    def _load_extra_state(self, extra):
        self.gns.load_state_dict(extra["gns"])
        if self.grad_scaler is not None and extra.get("grad_scaler"):
            self.grad_scaler.load_state_dict(extra["grad_scaler"])
        self._exchange.adopt_layout(extra.get("layout"))

    def state_dict(self):
        """torch's ``state_dict()`` of the wrapped groups and state (with this optimizer's
        state_dict hooks), plus hvd_adapt's own state (noise scale, GradScaler, bucket
        layout) under the key ``"hvd_adapt"``. State on disk comes as tensors mapped from
        its files: read as they are used, not loaded first."""
        return self._state_dict(self._state.tensors())

    def _state_dict(self, states, **extra):
        return dict(torch.optim.Optimizer.state_dict(self), state=self._indexed(states),
                    hvd_adapt=dict(self._extra_state(), **extra))

    def _indexed(self, states):
        # torch's state_dict numbers parameters in the order of its groups.
        index = {id(p): i for i, p in enumerate(self._all_params())}
        return {index[id(p)]: values for p, values in states.items()}

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def commit_state(self):
        """A commit's copy: the state the optimizer state gives to copy (in memory, all of it;
        on disk, none: the commit keeps its file) and the mark it is restored by."""
        states, mark = self._state.commit()
        return self._state_dict(states, committed=mark)

    def checkpoint_state(self, committed):
        extra = dict(committed["hvd_adapt"])
        mark = extra.pop("committed", None)
        params = self._all_params()
        states = self._state.committed({params[int(i)]: values for i, values
                                        in committed["state"].items()}, mark)
        return dict(committed, state=self._indexed(states), hvd_adapt=extra)

    def at_commit_point(self):
        # A state on disk broken by a failed step raises here, before a commit saves anything.
        return self._state.committable()

    def checkpoint_is_mapped(self):
        return self._state.mapped

    def load_state_dict(self, state_dict):
        """Load a :meth:`state_dict`, or a plain torch optimizer's (the noise scale is kept).
        The hooks of ``register_load_state_dict_pre_hook``/``post_hook`` run as torch's own
        ``load_state_dict`` runs them (a State's waits for its commit's copies there)."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvd_adapt", None)
        if "optimizer" in state_dict and "state" not in state_dict:
            # hvd_adapt 0.2's layout, in checkpoints it wrote.
            extra = {"gns": state_dict["gns"]}
            state_dict = state_dict["optimizer"]
        self._state.load(state_dict, (extra or {}).get("committed"))
        if extra is not None:
            self._load_extra_state(extra)
        self.discard_accumulation()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _exchange_name(params):
    """``hvd_adapt.grad.<digest of the parameters' shapes and dtypes>.<n>``: n counts live
    optimizers of the same structure (identical on every rank for the same script)."""
    structure = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
    base = "hvd_adapt.grad." + hashlib.sha1(structure).hexdigest()[:10]

    def taken():
        return {opt.exchange_name for opt in CONTEXT.collective_objects
                if isinstance(opt, DistributedOptimizer)
                and opt.exchange_name.startswith(base + ".")}

    names = taken()
    if names:
        gc.collect()    # optimizers a script dropped may only await collection
        names = taken()
    index = 0
    while f"{base}.{index}" in names:
        index += 1
    return f"{base}.{index}"


def _check_not_hooked(params, names):
    owners = [(p, CONTEXT.hooked_params[p]()) for p in params if p in CONTEXT.hooked_params]
    if any(owner is not None for _, owner in owners):
        gc.collect()
        owners = [(p, CONTEXT.hooked_params[p]()) for p in params if p in CONTEXT.hooked_params]
    for p, owner in owners:
        if owner is not None:
            raise ValueError(
                f"parameter {names.get(p, tuple(p.shape))} is averaged by another live "
                f"{owner!r} already: its gradients would be averaged twice. Delete that "
                "optimizer first (del opt), or give each optimizer its own parameters")
