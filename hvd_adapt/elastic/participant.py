"""The protocol by which hvd_adapt's own objects take part in a :class:`hvd_adapt.State`.

A loader, an accumulator, the distributed optimizer and the epoch counter
each say how they are saved, restored and synced, and what they do when the
world is re-formed. The State's one handler for them
(``elastic/handlers.py``) calls these methods, so the State never needs to
know the types, and the types never import the State.
"""
from .._runtime import collective


class Participant:
    """Base class for objects a State carries through commits, restores and resizes.

    Subclasses provide ``state_dict()`` and ``load_state_dict(state)`` and
    override the hooks below where the default is not right.
    """

    #: Synced from rank 0 after every reset, also those where Horovod skips
    #: its own sync (small state: positions, counters, choices). False for
    #: large state (optimizer moments), synced only when Horovod syncs.
    sync_after_every_reset = True

    def state_dict(self):
        raise NotImplementedError

    def load_state_dict(self, state):
        raise NotImplementedError

    def commit_state(self):
        """What a commit keeps of this object (default: ``state_dict()``); a restore gives it
        back to ``load_state_dict``."""
        return self.state_dict()

    def checkpoint_state(self, committed):
        """What a checkpoint writes of ``committed`` (a :meth:`commit_state`); default: it."""
        return committed

    def checkpoint_is_mapped(self):
        """True when :meth:`checkpoint_state` holds tensors mapped from files that stay as they
        are (optimizer state on disk): a background checkpoint then writes them as they are
        read, instead of copying them into memory first."""
        return False

    def sync_from_root(self):
        """Collective: adopt rank 0's state."""
        self.load_state_dict(collective.broadcast_object(
            self.state_dict(), name=f"hvd_adapt.sync.{type(self).__name__}"))

    @classmethod
    def settle(cls, participants):
        """Collective, before a commit saves and before a resize: bring pending work into the
        state of ``participants`` (every value of this class's kind that the State carries,
        in the same order on every rank), in one collective for all of them where one is
        needed. Default: nothing to settle."""

    def join(self, peers):
        """Called once by the State with every value it carries, to find collaborators."""

    def on_reset(self):
        """The world was re-formed (no collectives allowed: a new worker skips this)."""

    def at_commit_point(self):
        """False while a commit now would split what must stay together (an accumulation cycle)."""
        return True
