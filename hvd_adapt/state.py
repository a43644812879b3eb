"""hvd_adapt.State: one Horovod elastic state for everything a resize must carry.

It is a ``horovod.torch.elastic.TorchState`` (plain attributes work as in
Horovod) with handlers for models and torch optimizers (synced as Horovod
syncs them, but saved into reused buffers, so a commit allocates nothing)
and for hvd_adapt's own objects: loaders and samplers (data position, step
profile, batch-size choice), accumulators, the distributed optimizer (with
its noise scale), the epoch counter, and torch learning-rate schedulers.
Handlers follow Horovod's StateHandler registry: a type, and a class that
saves, restores and syncs values of that type.
"""
import collections
import copy
import os
import pickle

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult
from horovod.torch.elastic.state import StateHandler, TorchState
from horovod.torch.functions import broadcast_optimizer_state, broadcast_parameters

from . import _context, collective, env
from ._threads import share_cpu_threads
from .accumulator import Accumulator, flush
from .data import AdaptiveDataLoader, ElasticSampler
from .epoch import EpochCounter
from .optimizer import DistributedOptimizer

CHECKPOINT_FORMAT = "hvd_adapt-checkpoint-v1"


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read or does not fit this job's State."""


_IMMUTABLE = (int, float, bool, str, type(None))


def _snapshot(value, previous=None):
    """A copy of ``value`` (nested dicts, lists and tuples of tensors and plain values).

    Tensors are copied into the buffers of ``previous`` (the last snapshot)
    where shape, dtype and device match, so a commit costs a memory copy
    rather than the allocations and bookkeeping of ``copy.deepcopy``.
    """
    if type(value) in _IMMUTABLE:
        return value
    if isinstance(value, torch.Tensor):
        if isinstance(previous, torch.Tensor) and previous.shape == value.shape \
                and previous.dtype == value.dtype and previous.device == value.device:
            return previous.copy_(value.detach())
        return value.detach().clone()
    if type(value) in (dict, collections.OrderedDict):
        before = previous if isinstance(previous, dict) else {}
        out = type(value)((k, _snapshot(v, before.get(k))) for k, v in value.items())
        if hasattr(value, "_metadata"):
            # Module.state_dict() keeps per-module versions here for load_state_dict.
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if type(value) in (list, tuple):
        if all(type(v) in _IMMUTABLE for v in value):
            # Flat sequences (a step-time profile is hundreds of floats) need
            # no per-item copy; a tuple of them is immutable itself.
            return value if type(value) is tuple else list(value)
        before = previous if type(previous) is type(value) and len(previous) == len(value) \
            else [None] * len(value)
        return type(value)(_snapshot(v, p) for v, p in zip(value, before))
    return copy.deepcopy(value)


class StateDictHandler(StateHandler):
    """For objects with ``state_dict()``/``load_state_dict()``: snapshot, restore, rank-0 sync.

    ``light`` handlers hold little (positions, counters, choices) and are
    synced again after every reset; the others (models, optimizers) only
    when Horovod syncs.
    """

    light = True

    def __init__(self, value):
        super().__init__(value)
        self._saved = None
        self.save()

    def save(self):
        self._saved = _snapshot(self.value.state_dict(), self._saved)

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        self.value.load_state_dict(collective.broadcast_object(self.value.state_dict()))


class ModelHandler(StateDictHandler):
    """A torch module: parameters and buffers broadcast from rank 0 as tensors."""

    light = False

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class TorchOptimizerHandler(StateDictHandler):
    """A torch optimizer not wrapped by hvd_adapt (a plain one, or Horovod's own)."""

    light = False

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class AccumulatorHandler(StateDictHandler):
    """Totals come from rank 0 on sync; each replica keeps its own pending updates."""

    def sync(self):
        self.value.load_totals(collective.broadcast_object(self.value.state_dict()["totals"]))


class OptimizerHandler(StateDictHandler):
    """The wrapped optimizer syncs through Horovod's broadcast_optimizer_state."""

    light = False

    def sync(self):
        broadcast_optimizer_state(self.value.optimizer, root_rank=0)
        self.value.gns.load_state_dict(collective.broadcast_object(self.value.gns.state_dict()))
        self.value.discard_accumulation()


_registry = [
    (AdaptiveDataLoader, StateDictHandler),
    (ElasticSampler, StateDictHandler),
    (Accumulator, AccumulatorHandler),
    (DistributedOptimizer, OptimizerHandler),
    (EpochCounter, StateDictHandler),
    (torch.optim.lr_scheduler.LRScheduler, StateDictHandler),
    (torch.nn.Module, ModelHandler),
    (torch.optim.Optimizer, TorchOptimizerHandler),
]


def register_handler(value_type, handler_cls):
    """Let :class:`State` carry values of ``value_type`` with ``handler_cls`` (a StateHandler).

    Registered types are looked up before hvd_adapt's and Horovod's own.
    """
    if not (isinstance(handler_cls, type) and issubclass(handler_cls, StateHandler)):
        raise ValueError(f"handler_cls must be a horovod StateHandler subclass, got {handler_cls!r}")
    _registry.insert(0, (value_type, handler_cls))


def _handler_for(value):
    for value_type, handler_cls in _registry:
        if isinstance(value, value_type):
            return handler_cls(value)
    return None


class State(TorchState):
    """Everything training must carry across resizes, failures and restarts.

    >>> state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=stats,
    ...                         best_accuracy=0.0)
    >>> state.commit()                 # where resizes take effect
    >>> state.save_checkpoint("ckpt/job.pt")

    ``commit()`` is a no-op in the middle of a gradient-accumulation cycle:
    accumulated gradients are not part of the state, so commits take effect
    at optimizer steps. A :class:`hvd_adapt.DistributedOptimizer` is bound to
    the loader it accumulates for: the autoscaled loader if there is one,
    else the first loader given.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        if "epochs" in kwargs:
            raise ValueError("State reserves the name 'epochs' for its epoch counter; "
                             "call that value something else")
        kwargs.update(model=model, optimizer=optimizer)
        kwargs["epochs"] = EpochCounter()
        ours = {}
        for name in list(kwargs):
            handler = _handler_for(kwargs[name])
            if handler is not None:
                ours[name] = handler
                del kwargs[name]
        model, optimizer = kwargs.pop("model", None), kwargs.pop("optimizer", None)
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        # Horovod's own object broadcast costs a background-thread round trip
        # even in a world of one; ours returns at once there.
        self._bcast_object = collective.broadcast_object
        for name, handler in ours.items():
            # TorchState always files model/optimizer; ours supersede them.
            self._saved_state.pop(name, None)
            setattr(self, name, handler.value)
        self._handlers.update(ours)
        self._accumulators = [h.value for h in ours.values() if isinstance(h.value, Accumulator)]
        self._loaders = [h.value for h in ours.values() if isinstance(h.value, AdaptiveDataLoader)]
        self._optimizers = [h.value for h in ours.values()
                            if isinstance(h.value, DistributedOptimizer)]
        if self._loaders:
            train = next((l for l in self._loaders if l._autoscale is not None), self._loaders[0])
            for opt in self._optimizers:
                opt._bind(train)
        self._needs_resync = False
        self._drain = None
        self.register_reset_callbacks([self._after_reset])
        _context.set_state(self)
        if env.initialized():
            # For scripts that called hvd.init() rather than hvd_adapt.init().
            share_cpu_threads(env.local_size(), env.local_rank())

    @property
    def epoch(self):
        """The current epoch of ``remaining_epochs_until``."""
        return self.epochs.epoch

    def at_optim_boundary(self):
        """False while any bound loader is between the steps of an accumulation cycle."""
        return all(loader.is_optim_step() for loader in self._loaders)

    def commit(self):
        """Collective: save the state and raise ``HostsUpdatedInterrupt`` if hosts changed.

        Also sums pending accumulator updates over replicas (one collective)
        and, with a SIGTERM drain installed, stops the job when any replica
        was asked to stop.
        """
        if not self.at_optim_boundary():
            return
        if self._accumulators:
            flush(self._accumulators)
        self.save()
        if self._drain is not None:
            self._drain.check(self)
        self.check_host_updates()

    def check_host_updates(self):
        """Collective: raise ``HostsUpdatedInterrupt`` if the driver reported a host change.

        Horovod stamps host updates in whole seconds and ignores one that
        shares the second of the update before it, so of two resizes within
        a second the second was lost. Each update is delivered once and the
        queue is emptied at every reset, so here an update stamped in the
        same second as the last one counts as new. Outside elastic mode no
        driver sends updates and it returns at once, so a script can call it
        after every batch and commit less often (as Horovod's examples do).
        Like a commit, it does nothing between the steps of an accumulation
        cycle: a resize takes effect at an optimizer step.
        """
        if not env.is_elastic() or not self.at_optim_boundary():
            return
        last = self._last_updated_timestamp
        received, newest, update = False, last, HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp >= last:
                received, newest, update = True, max(newest, timestamp), update | result
        if env.size() > 1:
            # Three integers: a fixed-size tensor broadcast is one Horovod
            # cycle, an object broadcast two (its size, then its bytes).
            received, newest, update = hvd.broadcast(
                torch.tensor([int(received), newest, int(update)], dtype=torch.int64),
                root_rank=0, name="hvd_adapt.host_updates").tolist()
        self._last_updated_timestamp = newest
        if received:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def sync(self):
        # A new worker arrives here only after its whole start-up; the others
        # wait for it without spinning, so they do not slow that start-up down.
        collective.barrier()
        super().sync()
        self._needs_resync = False

    def _after_reset(self):
        # After a HostsUpdatedInterrupt with skip_sync, Horovod does not sync;
        # run() still re-syncs hvd_adapt's parts (cheap) so that positions,
        # totals and batch-size choices come from one rank. Collectives are
        # not allowed here: a new worker does not pass through this callback.
        self._needs_resync = True
        share_cpu_threads(env.local_size(), env.local_rank())
        for loader in self._loaders:
            loader.request_decision()
        for opt in self._optimizers:
            opt.discard_accumulation()
        if self._drain is not None:
            self._drain.discard_pending()

    def _resync_light(self):
        for handler in self._handlers.values():
            if getattr(handler, "light", False):
                handler.sync()
        self._needs_resync = False

    # -- whole-job checkpoints -------------------------------------------------------
    def _checkpoint_payload(self):
        values = {}
        for name, handler in self._handlers.items():
            value = handler.value
            values[name] = value.state_dict() if hasattr(value, "state_dict") else value
        return {"format": CHECKPOINT_FORMAT, "handlers": values,
                "objects": {k: getattr(self, k) for k in self._saved_state}}

    def save_checkpoint(self, path):
        """Write the committed state to ``path`` on rank 0 (others do nothing), atomically.

        Call it right after ``commit()``. The file is written beside ``path``
        and renamed over it, so a job killed while writing leaves the old
        checkpoint intact.
        """
        if env.rank() != 0:
            return
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(self._checkpoint_payload(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load_checkpoint(self, path):
        """Load ``path`` on rank 0 if it exists; returns whether it did.

        The other ranks receive the state at the next sync (``run`` syncs
        first). Raises :class:`CheckpointError`, naming the file, if it is
        corrupt or was written for a State with other contents.
        """
        if env.rank() != 0 or not os.path.exists(path):
            return False
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} is unreadable ({e}); "
                                  "delete it to start afresh") from e
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not an hvd_adapt checkpoint ({CHECKPOINT_FORMAT})")
        expected = set(self._handlers) | set(self._saved_state)
        found = set(payload["handlers"]) | set(payload["objects"])
        if expected != found:
            raise CheckpointError(
                f"checkpoint {path} does not fit this State: missing {sorted(expected - found)}, "
                f"unexpected {sorted(found - expected)}")
        for name, value in payload["handlers"].items():
            target = self._handlers[name].value
            try:
                target.load_state_dict(value)
            except (KeyError, ValueError, RuntimeError, TypeError) as e:
                raise CheckpointError(f"checkpoint {path}: cannot load {name!r}: {e}") from e
        for name, value in payload["objects"].items():
            setattr(self, name, value)
        self.save()
        return True
