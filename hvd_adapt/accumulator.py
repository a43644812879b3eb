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
"""
import collections.abc
import contextlib
import copy
import numbers

from ._runtime import collective
from .elastic.participant import Participant


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
    """

    def __init__(self, *args, **kwargs):
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
        return f"Accumulator(totals={self._totals!r}, pending={self._updates!r})"

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

    One allgather for all of them; nothing changes if the collective fails.
    """
    pending = {(i, key): value for i, acc in enumerate(accumulators)
               for key, value in acc.pending().items()}
    summed = collective.allreduce(pending)
    by_accumulator = [{} for _ in accumulators]
    for (i, key), value in summed.items():
        by_accumulator[i][key] = value
    for acc, totals in zip(accumulators, by_accumulator):
        acc.absorb(totals)
