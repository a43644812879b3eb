"""The SIGTERM drain: on preemption, every replica stops at the first commit after the
signal, rank 0 writes the checkpoint, and all exit with 143 (128 + SIGTERM), as schedulers
expect.

How long it takes: from the signal to the next ``state.commit()`` (the
loop's commit interval), then one checkpoint write on rank 0. A launcher
kills what is still running after its grace period: ``horovodrun`` sends
SIGKILL 5 s after SIGTERM (``GRACEFUL_TERMINATION_TIME_S``), Kubernetes
after ``terminationGracePeriodSeconds`` (30 s by default). Commit at least
every couple of seconds under ``horovodrun``, and give Kubernetes a grace
period longer than the commit interval plus a checkpoint write.
"""
import logging
import signal
import sys

from .._runtime import env
from .agreement import fail_together
from .checkpoint import CheckpointError

log = logging.getLogger(__name__)

DRAIN_EXIT_CODE = 143


class Drain:
    """Stop every replica at the same commit when any of them gets SIGTERM.

    The signal handler only sets :attr:`requested`. Every commit votes on it
    (one small collective with the commit's other votes), so the first
    commit after the signal on any replica stops all of them there: rank 0
    writes the checkpoint of that commit, and all exit with code 143. If the
    write fails, every rank raises :class:`hvd_adapt.CheckpointError` instead.
    """

    def __init__(self, checkpoint_path=None):
        self.checkpoint_path = checkpoint_path
        self.requested = False
        self._previous_handler = None

    def _on_signal(self, signum, frame):
        self.requested = True

    def install(self):
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def uninstall(self):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def stop(self, state):
        """Collective, at a commit every replica voted to drain at: checkpoint and exit."""
        error = None
        if self.checkpoint_path is not None and env.rank() == 0:
            try:
                state.save_checkpoint(self.checkpoint_path)
            except Exception as e:
                # Whatever rank 0 meets here, every rank must hear of it: the
                # others wait for its word below, and were SIGKILLed before.
                cause = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
                error = CheckpointError(f"draining after SIGTERM: {cause}")
        # The others exit only once rank 0's file is on disk: launchers kill
        # the remaining workers as soon as one exits non-zero.
        fail_together(error, "hvd_adapt.drain_done")
        if env.rank() == 0:
            log.warning("SIGTERM received; stopped at epoch %d and exited with %d",
                        state.epoch, DRAIN_EXIT_CODE)
        sys.exit(DRAIN_EXIT_CODE)


def install_sigterm_drain(state, checkpoint_path=None):
    """Install a SIGTERM handler that drains the job at the next commit; returns the Drain.

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> state = hvd_adapt.State()
    >>> drain = hvd_adapt.install_sigterm_drain(state, checkpoint_path="ckpt/job.pt")
    >>> drain.requested
    False
    >>> drain.uninstall()
    """
    drain = Drain(checkpoint_path)
    drain.install()
    state.set_drain(drain)
    return drain
