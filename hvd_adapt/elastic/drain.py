"""The SIGTERM drain: on preemption, every replica stops at the same commit, rank 0
writes the checkpoint, and all exit with 143 (128 + SIGTERM), as schedulers expect.
"""
import logging
import signal
import sys

import horovod.torch as hvd
import torch

from .._runtime import collective, env

log = logging.getLogger(__name__)

DRAIN_EXIT_CODE = 143


class Drain:
    """Stop every replica at the same commit when any of them gets SIGTERM.

    The signal handler only sets a flag. Each commit starts an asynchronous
    Horovod allreduce of the flag and reads the one started at the commit
    before, so agreement costs no waiting; when the sum is non-zero, every
    replica has just committed the same step, rank 0 writes the checkpoint,
    and all exit with code 143.
    """

    def __init__(self, checkpoint_path=None):
        self.checkpoint_path = checkpoint_path
        self.requested = False
        self._pending = None
        self._previous_handler = None

    def _on_signal(self, signum, frame):
        self.requested = True

    def install(self):
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def uninstall(self):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def discard_pending(self):
        """Forget the in-flight vote: its handle died with the old world."""
        self._pending = None

    def check(self, state):
        """Called by ``state.commit()`` after saving: vote, and exit if the last vote says stop."""
        stop = False
        if self._pending is not None:
            stop = hvd.synchronize(self._pending).item() > 0
        if env.size() == 1:
            stop = stop or self.requested
            self._pending = None
        else:
            flag = torch.tensor([int(self.requested)], dtype=torch.int32)
            self._pending = hvd.allreduce_async(flag, op=hvd.Sum, name="hvd_adapt.drain")
        if stop:
            if self._pending is not None:
                hvd.synchronize(self._pending)
                self._pending = None
            if self.checkpoint_path is not None:
                state.save_checkpoint(self.checkpoint_path)
            # The others exit only once rank 0's file is on disk: launchers
            # kill the remaining workers as soon as one exits non-zero.
            collective.barrier(name="hvd_adapt.drain_done")
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
