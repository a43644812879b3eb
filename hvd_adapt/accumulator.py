"""Accumulator: dict-like metrics summed over all replicas.

Outside ``synchronized()`` the accumulator collects this replica's updates
(``acc["loss"] += x``); inside, it shows the totals over every replica and
every update so far, the same on all replicas::

    stats = hvd_adapt.Accumulator()
    for x, y in loader:
        stats["loss_sum"] += loss.item() * len(y)
        stats["n"] += len(y)
    with stats.synchronized():
        print(stats["loss_sum"] / stats["n"])
        stats.clear()

In an :class:`hvd_adapt.State`, every ``state.commit()`` also sums the
pending updates of all replicas into the totals. That is the rule that makes
the totals exact across failures: everything up to the last commit counts
exactly once, and updates after it are discarded by the restore and counted
when the steps are replayed.

Every replica must synchronise the same accumulators in the same order. Each
sync carries, from every replica, which accumulators it syncs (their names:
``Accumulator(name=...)``, by default the file and line that made them) and
their keys; where the replicas disagree (a sync under a rank-dependent
branch), every replica raises :class:`AccumulatorMismatchError` naming what
each one synced, and nothing is added. A replica waiting in a sync that
another replica never joins gets its error at that replica's next
accumulator sync or commit (they pair up and disagree), or, where that
replica ends or Horovod shuts down, Horovod's error naming the sync.
"""
import collections.abc
import contextlib
import copy
import inspect
import numbers
import os

from horovod.common.exceptions import HorovodInternalError

from ._runtime import collective
from .elastic.participant import Participant

# One name for every accumulator sync, standalone or at a commit: syncs that
# do not match still pair up, and then disagree loudly, instead of waiting
# for a collective of another name.
SYNC_NAME = "hvd_adapt.accumulators"


class AccumulatorMismatchError(RuntimeError):
    """Replicas synchronised different accumulators at the same time (raised on every one)."""


def _made_at():
    """``file:line`` of the code that made an accumulator (outside hvd_adapt): the same on
    every replica running the same script, also on a worker that joins later."""
    frame = inspect.currentframe().f_back.f_back
    while frame is not None and frame.f_globals.get("__name__", "").startswith("hvd_adapt."):
        frame = frame.f_back
    if frame is None:
        return "unknown place"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _as_number(value, key):
    if type(value) in (int, float):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise TypeError(f"Accumulator values must be numbers; got {type(value).__name__} "
                        f"for key {key!r}")
    return value


class Accumulator(collections.abc.MutableMapping, Participant):
    """Metrics summed over replicas with one Horovod collective per synchronisation.

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> stats = Accumulator()
    >>> stats["n"] += 3
    >>> with stats.synchronized():
    ...     stats["n"]
    3

    ``name`` tells replicas' syncs apart (every replica must sync the same
    accumulators in the same order); by default it is the file and line that
    made the accumulator, so accumulators made on one line (in a loop, by a
    helper) need names of their own. A key called "name" is given in a dict:
    ``Accumulator({"name": 0})``.
    """


    @classmethod
    def settle(cls, participants):
        """At a commit and before a resize: every replica's pending updates summed (:func:`flush`)."""
        flush(participants)

    def __init__(self, *args, name=None, **kwargs):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Accumulator name must be a str or None, got {name!r}")
        self.name = _made_at() if name is None else name
        self._totals = {k: _as_number(v, k) for k, v in dict(*args, **kwargs).items()}
        self._updates = {}
        self._synchronized = 0

    @contextlib.contextmanager
    def synchronized(self):
        """Collective: sum every replica's pending updates, then read and write the totals.

        Writes inside the block (``clear()``, say) change the totals and must
        be made alike on every replica.
        """
        flush([self])
        self._synchronized += 1
        try:
            yield self
        finally:
            self._synchronized -= 1

    def _view(self):
        return self._totals if self._synchronized else self._updates

    def __getitem__(self, key):
        if self._synchronized:
            return self._totals[key]
        return self._updates.get(key, 0)

    def __setitem__(self, key, value):
        self._view()[key] = _as_number(value, key)

    def __delitem__(self, key):
        del self._view()[key]

    def __contains__(self, key):
        return key in self._view()

    def get(self, key, default=None):
        return self._view().get(key, default)

    def __iter__(self):
        return iter(self._view())

    def __len__(self):
        return len(self._view())

    def update(self, *args, **kwargs):
        """Inside ``synchronized()`` like dict.update; outside, adds each value to its key."""
        if self._synchronized:
            return super().update(*args, **kwargs)
        for key, value in dict(*args, **kwargs).items():
            self[key] = self[key] + _as_number(value, key)

    def __repr__(self):
        return (f"Accumulator(name={self.name!r}, totals={self._totals!r}, "
                f"pending={self._updates!r})")

    def state_dict(self):
        return {"totals": copy.deepcopy(self._totals), "pending": copy.deepcopy(self._updates)}

    def load_state_dict(self, state):
        self._totals = copy.deepcopy(state["totals"])
        self._updates = copy.deepcopy(state["pending"])

    def pending(self):
        """This replica's updates since the last synchronisation (a copy)."""
        return dict(self._updates)

    def absorb(self, summed):
        """Add ``summed`` (every replica's pending updates, summed) to the totals; clear pending."""
        self._updates = {}
        for key, value in summed.items():
            self._totals[key] = self._totals.get(key, 0) + value

    def sync_from_root(self):
        """Collective: take rank 0's totals, keeping this replica's pending updates."""
        self._totals = collective.broadcast_object(self._totals, name="hvd_adapt.sync.totals")


def flush(accumulators):
    """Collective: add every replica's pending updates of ``accumulators`` into their totals.

    One allgather for all of them, carrying each accumulator's name and pending
    updates: where the replicas' lists of names differ, every replica raises
    :class:`AccumulatorMismatchError` naming them. Nothing changes if the
    collective fails.
    """
    ours = [(acc.name, acc.pending()) for acc in accumulators]
    try:
        everyone = collective.allgather_object(ours, name=SYNC_NAME)
    except HorovodInternalError as e:
        # Horovod's error (a rank left, Horovod shut down) keeps its type, so
        # an elastic job still recovers from it; the message says which sync.
        mine = [name for name, _ in ours]
        raise HorovodInternalError(f"{e} (in the sync of accumulators {mine}: did every "
                                   "replica reach it?)") from e
    names = [[name for name, _ in synced] for synced in everyone]
    if any(other != names[0] for other in names):
        lines = "; ".join(
            f"rank {rank}: " + (", ".join(f"{name!r} (keys {sorted(map(str, pending))})"
                                          for name, pending in synced) or "nothing")
            for rank, synced in enumerate(everyone))
        raise AccumulatorMismatchError(
            f"replicas synchronised different accumulators at the same time ({lines}); every "
            "replica must synchronise the same accumulators in the same order (a sync under a "
            "rank-dependent branch, or accumulators made on one line without a name=)")
    summed = [{} for _ in accumulators]
    for synced in everyone:
        for totals, (_, pending) in zip(summed, synced):
            for key, value in pending.items():
                totals[key] = totals.get(key, 0) + value
    for acc, totals in zip(accumulators, summed):
        acc.absorb(totals)
