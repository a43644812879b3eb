"""What the wrapped optimizer keeps per parameter, behind one interface: in memory
(:class:`MemoryState`: torch's own ``optimizer.state``) or on disk
(:class:`hvd_adapt.swap.DiskState`). The distributed optimizer holds one and never asks
which.

States are ``{param: {key: tensor or value}}``; a state dict is torch's
(``param_groups`` and ``state`` by parameter index). A commit keeps the live state in
two parts: ``states`` for the State's snapshot to copy (in memory: the live tensors; on
disk: none) and a ``mark`` to restore it by (on disk: the file it keeps; in memory:
None), so that in memory a commit is the State's snapshot, whatever makes that cheap.
"""
from .._runtime import collective


class OptimizerState:
    """The interface: :class:`MemoryState` (the reference) and
    :class:`hvd_adapt.swap.DiskState` implement it (the swap package, a layer below, by its
    methods: it imports nothing of optim)."""

    #: True where :meth:`committed` gives tensors mapped from files that stay as they are
    #: (a background checkpoint then writes them as they are read).
    mapped = False

    def step(self, closure=None, agree=None):
        """Step the wrapped optimizer over every parameter (its result); ``agree`` (a
        collective, where the implementation agrees between ranks at all) makes one rank's
        failure every rank's."""
        raise NotImplementedError

    def tensors(self, params=None, keys=None):
        """The live state, as a state dict holds it; or, for the noise scale's Adam
        denominators, the ``keys`` of ``params``' state, read now and not kept."""
        raise NotImplementedError

    def commit(self):
        """``(states, mark)``: keep the live state as the commit's (the one before it is
        released)."""
        raise NotImplementedError

    def committable(self):
        """True where a commit may keep the live state; raises, before anything of a commit
        is saved, where it never may (a state broken by a failed step)."""
        return True

    def committed(self, states, mark):
        """The state a commit's ``states`` and ``mark`` hold: what a checkpoint writes."""
        raise NotImplementedError

    def load(self, state_dict, mark=None):
        """Make ``state_dict`` the optimizer's (groups and state), or, with a commit's
        ``mark``, its groups and that commit's state; a load that fails changes nothing."""
        raise NotImplementedError

    def sync_from_root(self):
        """Collective: take rank 0's state and hyper-parameters."""
        raise NotImplementedError

    def metrics(self):
        """Counters over the steps taken (seconds, bytes), by name."""
        return {}

    def on_reset(self):
        """The world was re-formed (no collectives allowed)."""

    def release(self):
        """Free what the state holds besides the optimizer (files, buffers)."""


class MemoryState(OptimizerState):
    """``optimizer``'s state where torch keeps it: its ``state``, in memory."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None, agree=None):
        return self.optimizer.step(closure)

    def tensors(self, params=None, keys=None):
        state = self.optimizer.state
        return state if params is None else {p: state[p] for p in params if p in state}

    def commit(self):
        return self.optimizer.state, None

    def committed(self, states, mark):
        return states

    def load(self, state_dict, mark=None):
        self.optimizer.load_state_dict(state_dict)

    def sync_from_root(self):
        collective.broadcast_optimizer_state(self.optimizer)
