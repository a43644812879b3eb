"""What the replicas agree on before they act together, so that all of them take the same
path through the collectives that follow.

At a sync (:func:`at_sync`): whether the world needs a full sync, which rank
holds the job's state, and, where no rank holds it (a job starting or
restarting), which rank's checkpoint file is the newest. At a commit
(:func:`vote`; also where a script checks for host changes between
commits): whether any replica was asked to drain, whether rank 0's last
checkpoint write failed, whether the driver reported a host change, and
whether the commit snapshots.
Each is one small collective; the decision is then the same on every rank.
"""
import collections

from .._runtime import collective
from .checkpoint import CheckpointError

#: A rank's checkpoint generation when it has no file to offer, or one it cannot read.
NO_FILE, UNREADABLE = -1, -2

SyncPlan = collections.namedtuple("SyncPlan", "full source_rank generation")
SyncPlan.__doc__ = """How a world syncs: ``full`` (every value from rank 0, not only the light
ones) and, where the state comes from a checkpoint, the rank whose file is read
(``source_rank``, None otherwise) and its ``generation``."""

CommitVotes = collections.namedtuple("CommitVotes", "drain checkpoint_failed hosts_updated "
                                                    "removed_only snapshot")


def at_sync(wants_full, holds_state, generation, unreadable_message=None):
    """Collective: the :class:`SyncPlan` of every rank's contribution.

    ``holds_state``: this rank carries the running job's state (it passed a
    sync and is not asking for a checkpoint); ``generation``: that of the
    checkpoint file this rank offers, :data:`NO_FILE` or :data:`UNREADABLE`
    (then ``unreadable_message`` says why, and every rank raises it).

    Ranks that hold the job's state win over any file: a worker joining a
    running job, or restarting beside survivors, must not bring an old
    checkpoint back. Where none does, the newest file wins, the lowest rank
    among equals: with one directory per host, the host that wrote last.
    """
    rows = collective.gather_ints([int(wants_full), int(holds_state), generation],
                                  name="hvd_adapt.sync")
    bad = [rank for rank, row in enumerate(rows) if row[2] == UNREADABLE]
    if bad:
        message = collective.broadcast_object(unreadable_message, root_rank=bad[0],
                                              name="hvd_adapt.sync.unreadable")
        raise CheckpointError(f"rank {bad[0]}: {message}")
    holders = [rank for rank, row in enumerate(rows) if row[1]]
    if holders and holders[0] != 0:
        raise RuntimeError(
            f"rank 0 of this world has not run the job before while rank {holders[0]} has: "
            "hvd_adapt syncs every value from rank 0, as Horovod does. Horovod keeps rank 0 on "
            "a host of the previous world; a host list that breaks this is not supported")
    full = any(row[0] for row in rows) or not holders
    if holders:
        return SyncPlan(full, None, None)
    newest = max(row[2] for row in rows)
    if newest < 0:
        return SyncPlan(full, None, None)
    source = next(rank for rank, row in enumerate(rows) if row[2] == newest)
    return SyncPlan(full, source, newest)


def vote(drain_requested, checkpoint_failure, host_updates, wants_snapshot=True,
         needs_snapshot=False):
    """Collective: the :class:`CommitVotes` of every rank's ``drain_requested`` (bool),
    ``checkpoint_failure`` (a message, or None), ``host_updates`` (``(removed, added)``
    as this rank received them from the driver, or None: the driver tells rank 0 alone),
    ``wants_snapshot`` (its snapshots are within their budget) and ``needs_snapshot``.

    The commit snapshots where any rank needs it, where every rank wants it, or where
    the job is about to act (a drain, a checkpoint failure, a resize): what it acts on
    is then the restore point of every rank."""
    removed, added = host_updates or (False, False)
    votes = [int(bool(drain_requested)), int(checkpoint_failure is not None),
             int(host_updates is not None), int(removed), int(added), int(not wants_snapshot),
             int(bool(needs_snapshot))]
    drain, failed, updated, removed, added, declined, needed = collective.max_ints(
        votes, name="hvd_adapt.commit")
    snapshot = bool(needed or drain or failed or updated or not declined)
    return CommitVotes(bool(drain), bool(failed), bool(updated), bool(removed and not added),
                       snapshot)


def fail_together(error, name):
    """Collective: where ``error`` (an exception, or None) is set on some rank, raise on every
    rank: that exception where it was caught, elsewhere a :class:`CheckpointError` with the
    message of the lowest such rank. So a failure one rank meets (a checkpoint it cannot read
    or write) ends the job on all of them, at the same point, with its cause."""
    rows = collective.gather_ints([int(error is not None)], name=name)
    failed = [rank for rank, row in enumerate(rows) if row[0]]
    if not failed:
        return
    message = collective.broadcast_object(None if error is None else str(error),
                                          root_rank=failed[0], name=name + ".message")
    if error is not None:
        raise error
    raise CheckpointError(f"rank {failed[0]}: {message}")
