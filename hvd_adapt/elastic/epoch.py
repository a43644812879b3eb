"""Restart-safe epoch loops backed by the elastic state.

The epoch number lives in :class:`hvd_adapt.State`, so after a resize, a
failure or a full restart from a checkpoint the loop resumes in the epoch it
was in, and a loader in that loop resumes mid-epoch::

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(30):
            for x, y in loader:
                ...
                state.commit()
"""
from .._runtime.context import CONTEXT
from .participant import Participant


def check_epoch(value):
    """``value`` as an epoch (an int >= 0), or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"an epoch is an int >= 0, got {value!r}")
    return int(value)


class EpochCounter(Participant):
    """Where the job is: its epoch and its number of commits (the generation a checkpoint
    records), and whether it resumed from a checkpoint; saved, restored and synced as part
    of the State."""

    def __init__(self):
        self.epoch = 0
        self.commits = 0
        self.epoch_end_commits = 0   # commits at the last epoch's end (0: none yet)
        self.resumed = False
        self.in_loop = False
        self._left_early = False
        self._left_checkpoint = None

    def state_dict(self):
        return {"epoch": self.epoch, "commits": self.commits,
                "epoch_end_commits": self.epoch_end_commits, "resumed": self.resumed}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]
        # Checkpoints written before commits were counted hold none.
        self.commits = state.get("commits", 0)
        self.epoch_end_commits = state.get("epoch_end_commits", 0)
        self.resumed = state.get("resumed", False)
        self._left_early = False

    def leave_early(self, checkpoint=None):
        """The loop was left inside an epoch (a ``break``, a ``return``, or an exception on its
        way out); ``checkpoint``: the loop's checkpoint path."""
        self._left_early = True
        self._left_checkpoint = checkpoint

    def finish_left_epoch(self):
        """After the training function returned: the epoch its loop was left in counts as
        finished. Returns the loop's checkpoint path (None if it had none), or False when no
        loop was left early."""
        if not self._left_early:
            return False
        self.epoch += 1
        self._left_early = False
        self.in_loop = False
        return self._left_checkpoint

    def enter(self):
        """A loop starts. After a ``break`` it starts with the next epoch, as AdaptDL's does;
        the increment waits until here because an exception leaves a loop the same way
        (a drain's exit reports the epoch it stopped in, not the next)."""
        self.in_loop = True
        if self._left_early:
            self.epoch += 1
            self._left_early = False

    def on_reset(self):
        # A resize interrupt leaves the loop like a break, but the re-run
        # training function must go on in the epoch it was in.
        self._left_early = False


def remaining_epochs_until(epoch, checkpoint=None):
    """Yield the epochs from the current one up to ``epoch - 1``.

    The current epoch is taken from the state, so a job that restarts in
    epoch 7 of 30 yields 7..29. Between two epochs the loop commits the
    state with the counter already moved on (a collective, and a point where
    resizes take effect), and writes it to ``checkpoint`` if given (in the
    background while the next epoch trains), so a restart never repeats a
    finished epoch. Leaving the loop with ``break`` or ``return`` counts the
    epoch left as finished: a later loop starts with the next one (as
    AdaptDL's does), and when the training function of ``hvd_adapt.run``
    returns, that epoch is committed and checkpointed as a finished one; a
    loop left by a resize goes on in the same epoch.

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> state = hvd_adapt.State()
    >>> for epoch in remaining_epochs_until(3):
    ...     print(epoch)
    0
    1
    2
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"remaining_epochs_until expects an int >= 0, got {epoch!r}")
    state = CONTEXT.state
    if state is None:
        raise RuntimeError("remaining_epochs_until needs an hvd_adapt.State: create one before the loop")
    counter = state.epochs
    # in_loop is not reset in a finally: a loop left by a resize interrupt is
    # entered again right away by the re-run training function.
    counter.enter()
    if checkpoint is not None:
        state.refresh_checkpoint(checkpoint)
    while counter.epoch < epoch:
        try:
            yield counter.epoch
        except GeneratorExit:
            counter.leave_early(checkpoint)
            raise
        state.end_epoch()
        if checkpoint is not None:
            state.save_checkpoint(checkpoint, background=True)
    counter.in_loop = False
    if checkpoint is not None:
        # What follows the loop may read the file (or the job may end here);
        # a failed write stops every rank.
        state.settle_checkpoint()


def current_epoch():
    """The epoch of the running ``remaining_epochs_until`` loop, or None outside one."""
    state = CONTEXT.state
    if state is None or not state.epochs.in_loop:
        return None
    return state.epochs.epoch
