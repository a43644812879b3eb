"""State handlers: how each kind of value in a :class:`hvd_adapt.State` is saved,
restored and synced, following Horovod's ``StateHandler`` registry.

hvd_adapt's own objects (loaders, samplers, accumulators, the distributed
optimizer, the epoch counter) share one handler that calls their
:class:`~hvd_adapt.elastic.participant.Participant` methods; torch modules,
torch optimizers, GradScalers and learning-rate schedulers have handlers here. Saving
copies into the buffers of the previous save, so a commit allocates nothing.
"""
import collections
import copy

import torch
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import StateHandler

from .._runtime import collective
from .._runtime.context import CONTEXT
from .participant import Participant

_IMMUTABLE = (int, float, bool, str, type(None))


def snapshot(value, previous=None, to_host=False, copies=None, deferred=(), label=""):
    """A copy of ``value`` (nested dicts, lists and tuples of tensors and plain values).

    Tensors are copied into the buffers of ``previous`` (the last snapshot)
    where shape, dtype and device match, so a commit costs a memory copy
    rather than the allocations and bookkeeping of ``copy.deepcopy``. With
    ``to_host``, GPU tensors are copied into page-locked host memory instead
    (a commit then holds no second copy on the GPU). With ``copies`` (a
    :class:`~hvd_adapt.elastic.commit_copies.CommitCopies`, during a commit)
    the copies go through it, made after the commit returns for tensors whose
    storage address is in ``deferred`` (what only an optimizer step writes);
    ``label`` names the value in errors (items get ``(label, key)`` pairs, formatted
    only where an error names them: a commit passes here for every tensor).

    >>> import torch
    >>> first = snapshot({"w": torch.zeros(2), "step": 1})
    >>> again = snapshot({"w": torch.ones(2), "step": 2}, previous=first)
    >>> again["w"] is first["w"], again["w"].tolist(), again["step"]
    (True, [1.0, 1.0], 2)
    """
    if type(value) in _IMMUTABLE:
        return value
    if isinstance(value, torch.Tensor):
        device = torch.device("cpu") if to_host and value.is_cuda else value.device
        if isinstance(previous, torch.Tensor) and previous.shape == value.shape \
                and previous.dtype == value.dtype and previous.device == device:
            dst = previous
        elif device != value.device:
            dst = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        else:
            dst = torch.empty_like(value.detach())     # the source's strides (channels_last)
        if copies is None:
            return dst.copy_(value.detach(), non_blocking=device != value.device)
        return copies.copy(dst, value, label, value.data_ptr() in deferred)
    if type(value) in (dict, collections.OrderedDict):
        before = previous if isinstance(previous, dict) else {}
        out = type(value)((k, snapshot(v, before.get(k), to_host, copies, deferred,
                                       (label, k)))
                          for k, v in value.items())
        if hasattr(value, "_metadata"):
            # Module.state_dict() keeps per-module versions here for load_state_dict.
            kept = getattr(previous, "_metadata", None)
            out._metadata = kept if kept == value._metadata else copy.deepcopy(value._metadata)
        return out
    if type(value) in (list, tuple):
        if all(type(v) in _IMMUTABLE for v in value):
            # Flat sequences (a step-time profile is hundreds of floats) need
            # no per-item copy; a tuple of them is immutable itself.
            return value if type(value) is tuple else list(value)
        before = previous if type(previous) is type(value) and len(previous) == len(value) \
            else [None] * len(value)
        return type(value)(snapshot(v, p, to_host, copies, deferred, (label, i))
                           for i, (v, p) in enumerate(zip(value, before)))
    return copy.deepcopy(value)


class StateDictHandler(StateHandler):
    """For any object with ``state_dict()``/``load_state_dict()`` (schedulers of torch, timm
    and transformers, EMA helpers, samplers, GradScalers): snapshot, restore, rank-0 sync.

    ``light`` handlers hold little (positions, counters, choices) and are
    synced again after every reset; the others (models, optimizers) only
    when Horovod syncs. The State sets ``name`` (the value's name in it, for
    errors), ``to_host`` and ``copies`` (its commits' copies, see
    ``commit_copies.py``).
    """

    light = True
    #: Snapshot GPU tensors into host memory (the State sets it; on by default with CUDA).
    to_host = False
    #: The State's :class:`~hvd_adapt.elastic.commit_copies.CommitCopies` (None: copy at once).
    copies = None
    name = "value"

    def __init__(self, value):
        super().__init__(value)
        self._saved = None
        self.save()

    def save(self):
        self._saved = snapshot(self.value.state_dict(), self._saved, self.to_host, self.copies,
                               self.deferred(), self.name)

    def deferred(self):
        """Storage addresses of the tensors of this value that only an optimizer step writes
        (their copies may finish after the commit returns)."""
        return ()

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        self.value.load_state_dict(collective.broadcast_object(self.value.state_dict()))

    def saved_state(self):
        """The state at the last save (commit): what a checkpoint holds."""
        return self._saved


def _optimizer_state(optimizer):
    """Storage addresses of a torch optimizer's state tensors (moments, step counts)."""
    return {t.data_ptr() for per_param in optimizer.state.values() for t in per_param.values()
            if torch.is_tensor(t)}


class ParticipantHandler(StateDictHandler):
    """For hvd_adapt's own objects: each says how it syncs and whether it is light."""

    def __init__(self, value):
        super().__init__(value)
        self.light = value.sync_after_every_reset

    def save(self):
        self._saved = snapshot(self.value.commit_state(), self._saved, self.to_host, self.copies,
                               self.deferred(), self.name)

    def deferred(self):
        if isinstance(self.value, torch.optim.Optimizer):
            return _optimizer_state(self.value)
        return ()

    def saved_state(self):
        return self.value.checkpoint_state(self._saved)

    def sync(self):
        self.value.sync_from_root()


class ModelHandler(StateDictHandler):
    """A torch module: parameters and buffers broadcast from rank 0 as tensors; with
    ``buffers_name`` set (the State's ``broadcast_buffers``), its buffers also at every
    commit, as DDP's ``broadcast_buffers`` does at every forward: BatchNorm's running
    statistics, computed from each replica's own shard, would otherwise drift apart.
    Its parameters' copies may finish after a commit returns (an optimizer's step or an
    EMA's update writes them, after the next forward); its buffers' are made at once
    (BatchNorm's change in the next forward)."""

    light = False
    #: The collective names' prefix of the buffers broadcast at each commit; None: none are.
    buffers_name = None

    def deferred(self):
        return {p.data_ptr() for p in self.value.parameters()}

    def sync(self):
        collective.broadcast_tensors(
            [(f"hvd_adapt.model.{name}", t) for name, t in self.value.state_dict().items()
             if torch.is_tensor(t)], root_rank=0)

    def buffers_to_align(self):
        """``(collective name, buffer)`` pairs that take rank 0's values at a commit, where
        ``buffers_name`` says so (the State broadcasts every model's in one call)."""
        if self.buffers_name is None:
            return []
        return [(f"{self.buffers_name}.{name}", t) for name, t in self.value.named_buffers()]


class TorchOptimizerHandler(StateDictHandler):
    """A torch optimizer not wrapped by hvd_adapt: state broadcast without a step."""

    light = False

    def deferred(self):
        return _optimizer_state(self.value)

    def sync(self):
        collective.broadcast_optimizer_state(self.value)


_BUILTIN = [
    (Participant, ParticipantHandler),
    (torch.optim.lr_scheduler.LRScheduler, StateDictHandler),
    # Its scale and growth tracker: a joining worker at the initial scale
    # would unscale the averaged gradients by another factor than the others.
    (torch.amp.GradScaler, StateDictHandler),
    (torch.nn.Module, ModelHandler),
    (torch.optim.Optimizer, TorchOptimizerHandler),
]


def register_handler(value_type, handler_cls):
    """Let :class:`hvd_adapt.State` carry values of ``value_type`` with ``handler_cls``.

    Objects with ``state_dict()`` and ``load_state_dict()`` need no handler:
    the State saves, restores, syncs and checkpoints them through those. A
    handler is for a type that has neither and cannot be pickled, or that
    must sync otherwise. ``handler_cls`` is a Horovod ``StateHandler``
    subclass (``save()``, ``restore()``, ``sync()``; ``self.value`` is the
    object); registered types are looked up before hvd_adapt's and Horovod's
    own, newest first. A checkpoint holds what ``value.state_dict()`` returns
    where the object has it, else the object itself.

    >>> import threading, hvd_adapt, horovod.torch as hvd
    >>> from horovod.torch.elastic.state import StateHandler
    >>> class Counter:                       # a lock: neither picklable nor a state_dict
    ...     def __init__(self):
    ...         self.lock, self.count = threading.Lock(), 0
    >>> class CounterHandler(StateHandler):
    ...     def save(self):
    ...         self.saved = self.value.count
    ...     def restore(self):
    ...         self.value.count = self.saved
    ...     def sync(self):
    ...         self.value.count = hvd.broadcast_object(self.value.count, root_rank=0)
    >>> hvd_adapt.register_handler(Counter, CounterHandler)
    >>> hvd_adapt.init()
    >>> counter = Counter()
    >>> state = hvd_adapt.State(counter=counter)
    >>> counter.count = 3; state.commit(); counter.count = 7; state.restore(); counter.count
    3
    """
    if not (isinstance(handler_cls, type) and issubclass(handler_cls, StateHandler)):
        raise ValueError(f"handler_cls must be a horovod StateHandler subclass, got {handler_cls!r}")
    CONTEXT.handlers.insert(0, (value_type, handler_cls))


def _has_state_dict(value):
    return callable(getattr(value, "state_dict", None)) \
        and callable(getattr(value, "load_state_dict", None))


def handler_for(value):
    """A handler for ``value``: from the registry, else for its
    ``state_dict()``/``load_state_dict()``, else None (a plain value, or one of Horovod's
    own types, such as its ElasticSampler, which Horovod's registry carries)."""
    for value_type, handler_cls in CONTEXT.handlers + _BUILTIN:
        if isinstance(value, value_type):
            return handler_cls(value)
    if isinstance(value, ElasticSampler) or isinstance(value, type) or not _has_state_dict(value):
        return None
    return StateDictHandler(value)
