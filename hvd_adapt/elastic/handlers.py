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
from horovod.torch.elastic.state import StateHandler

from .._runtime import collective
from .._runtime.context import CONTEXT
from .participant import Participant

_IMMUTABLE = (int, float, bool, str, type(None))


def snapshot(value, previous=None, to_host=False):
    """A copy of ``value`` (nested dicts, lists and tuples of tensors and plain values).

    Tensors are copied into the buffers of ``previous`` (the last snapshot)
    where shape, dtype and device match, so a commit costs a memory copy
    rather than the allocations and bookkeeping of ``copy.deepcopy``. With
    ``to_host``, GPU tensors are copied into page-locked host memory instead
    (a commit then holds no second copy on the GPU), without waiting for the
    device: the copy is ordered before the next step's work on its stream.

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
            return previous.copy_(value.detach(), non_blocking=device != value.device)
        if device != value.device:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            return host.copy_(value.detach(), non_blocking=True)
        return value.detach().clone()
    if type(value) in (dict, collections.OrderedDict):
        before = previous if isinstance(previous, dict) else {}
        out = type(value)((k, snapshot(v, before.get(k), to_host)) for k, v in value.items())
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
        return type(value)(snapshot(v, p, to_host) for v, p in zip(value, before))
    return copy.deepcopy(value)


class StateDictHandler(StateHandler):
    """For objects with ``state_dict()``/``load_state_dict()``: snapshot, restore, rank-0 sync.

    ``light`` handlers hold little (positions, counters, choices) and are
    synced again after every reset; the others (models, optimizers) only
    when Horovod syncs.
    """

    light = True
    #: Snapshot GPU tensors into host memory (the State sets it; on by default with CUDA).
    to_host = False

    def __init__(self, value):
        super().__init__(value)
        self._saved = None
        self.save()

    def save(self):
        self._saved = snapshot(self.value.state_dict(), self._saved, self.to_host)

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        self.value.load_state_dict(collective.broadcast_object(self.value.state_dict()))

    def saved_state(self):
        """The state at the last save (commit): what a checkpoint holds."""
        return self._saved


class ParticipantHandler(StateDictHandler):
    """For hvd_adapt's own objects: each says how it syncs and whether it is light."""

    def __init__(self, value):
        super().__init__(value)
        self.light = value.sync_after_every_reset

    def save(self):
        self._saved = snapshot(self.value.commit_state(), self._saved, self.to_host)

    def saved_state(self):
        return self.value.checkpoint_state(self._saved)

    def sync(self):
        self.value.sync_from_root()


class ModelHandler(StateDictHandler):
    """A torch module: parameters and buffers broadcast from rank 0 as tensors; with
    ``buffers_name`` set (the State's ``broadcast_buffers``), its buffers also at every
    commit, as DDP's ``broadcast_buffers`` does at every forward: BatchNorm's running
    statistics, computed from each replica's own shard, would otherwise drift apart."""

    light = False
    #: The collective names' prefix of the buffers broadcast at each commit; None: none are.
    buffers_name = None

    def sync(self):
        collective.broadcast_tensors(
            [(f"hvd_adapt.model.{name}", t) for name, t in self.value.state_dict().items()
             if torch.is_tensor(t)], root_rank=0)

    def align(self):
        """Collective at a commit: take rank 0's buffers, where ``buffers_name`` says so."""
        if self.buffers_name is not None:
            collective.broadcast_tensors(
                [(f"{self.buffers_name}.{name}", t) for name, t in self.value.named_buffers()],
                root_rank=0)


class TorchOptimizerHandler(StateDictHandler):
    """A torch optimizer not wrapped by hvd_adapt: state broadcast without a step."""

    light = False

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

    ``handler_cls`` is a Horovod ``StateHandler`` subclass. Registered types
    are looked up before hvd_adapt's and Horovod's own, newest first.
    """
    if not (isinstance(handler_cls, type) and issubclass(handler_cls, StateHandler)):
        raise ValueError(f"handler_cls must be a horovod StateHandler subclass, got {handler_cls!r}")
    CONTEXT.handlers.insert(0, (value_type, handler_cls))


def handler_for(value):
    """A handler for ``value`` from the registry, or None to leave it to Horovod."""
    for value_type, handler_cls in CONTEXT.handlers + _BUILTIN:
        if isinstance(value, value_type):
            return handler_cls(value)
    return None
