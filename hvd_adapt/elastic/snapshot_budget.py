"""How often a commit snapshots: as often as the snapshots' measured cost allows within a share
of the training time.

A script may call ``state.commit()`` after every batch (the README's loop does). Each call
votes (drain, host changes, checkpoint failures) and settles the accumulators; the snapshot
(every parameter and optimizer tensor copied) is what costs, in memory bandwidth and in the
training thread's walk over thousands of tensors. Where copying at every call would cost
more than ``share`` of the time, a commit skips the copy and a failure restores the last
snapshot instead: still one step's consistent state (parameters, optimizer, data position,
accumulators, counters), only older. Lost work is then bounded by time, not by steps:
about ``cost / share`` seconds of training.

A token bucket: the time between two commits earns ``share`` of it as credit (never more
than what wipes out a debt: no credit is banked across a long evaluation), a snapshot's
measured cost is charged against it as it is measured, and a commit snapshots where the
credit is not negative. The first commit snapshots (nothing is charged yet). What is
charged: the training thread's time in the snapshot (the walk and the copies made before
``commit()`` returns), its time waiting for the deferred copies, and the copying thread's
CPU time. That thread's time is charged whole, as if it took a core from training (it does
where every core trains, as on a CPU node); on a machine with cores to spare this makes
snapshots somewhat rarer than they need be, never more costly than ``share``.

Every rank decides alone and the commit's vote takes the decision of the poorest, so all
ranks snapshot at the same commits (a restore then returns every rank to the same step).
"""
import numbers
import time

#: The default share of training time snapshots may take (``State(snapshot_budget=...)``).
DEFAULT_SHARE = 0.03


def check_share(share):
    """``share`` as a float in (0, 1], or None (every commit snapshots); a clear error
    otherwise."""
    if share is None:
        return None
    if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0 < share <= 1:
        raise ValueError(f"snapshot_budget must be a share of training time in (0, 1] "
                         f"(0.03: snapshots may take 3% of it), or None (every commit "
                         f"snapshots); got {share!r}")
    return float(share)


class SnapshotBudget:
    """The credit of one State's snapshots (``share``: see :func:`check_share`).

    >>> budget = SnapshotBudget(0.5, clock=iter([0.0, 1.0, 1.5, 3.0]).__next__)
    >>> budget.wants_snapshot()     # the first commit (t=0): nothing charged yet
    True
    >>> budget.charge(1.0)          # it cost 1 s
    >>> budget.wants_snapshot()     # t=1: 0.5 s earned back, 0.5 s owed
    False
    >>> budget.wants_snapshot()     # t=1.5: 0.25 s owed
    False
    >>> budget.wants_snapshot()     # t=3: repaid
    True
    """

    def __init__(self, share, clock=time.perf_counter):
        self.share = check_share(share)
        self._clock = clock
        self._credit = 0.0
        self._last = None

    def charge(self, seconds):
        """A snapshot's cost, measured (in parts, as each is measured)."""
        self._credit -= seconds

    def wants_snapshot(self):
        """At a commit: whether this rank's snapshots are within their share."""
        if self.share is None:
            return True
        now = self._clock()
        if self._last is not None:
            self._credit = min(0.0, self._credit + self.share * (now - self._last))
        self._last = now
        return self._credit >= 0.0
