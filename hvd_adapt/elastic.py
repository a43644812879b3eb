"""``run``: Horovod's elastic loop with hvd_adapt's resets; and the SIGTERM drain.

Under ``horovodrun`` in elastic mode, ``run`` is ``hvd.elastic.run``: a
failed collective restores the last commit, a host change raises at
``commit()``, and either way Horovod re-forms the world and calls the
training function again. hvd_adapt adds that after every reset the rest of
the epoch is re-partitioned over the new world and the batch size is
decided again, whether or not Horovod skipped its sync. Anywhere else (plain
``python``, ``mpirun``, non-elastic ``horovodrun``) it syncs once from rank 0
and calls the function.
"""
import functools
import signal
import sys

import horovod.torch as hvd
import torch

from . import _context, env

DRAIN_EXIT_CODE = 143


def run(func):
    """Decorate ``train(state, ...)`` so it survives resizes and failures.

    >>> @hvd_adapt.run
    ... def train(state):
    ...     for epoch in hvd_adapt.remaining_epochs_until(10):
    ...         for x, y in loader:
    ...             ...
    ...             state.commit()
    >>> train(state)
    """
    @functools.wraps(func)
    def attempt(state, *args, **kwargs):
        _context.set_state(state)
        if state._needs_resync:
            state._resync_light()
        return func(state, *args, **kwargs)

    elastic = hvd.elastic.run(attempt)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        env.init()
        if env.is_elastic():
            return elastic(state, *args, **kwargs)
        state.sync()
        return attempt(state, *args, **kwargs)

    return wrapper


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
            if env.rank() == 0:
                print(f"hvd_adapt: SIGTERM received; stopped at epoch {state.epoch} "
                      f"and exited with {DRAIN_EXIT_CODE}", file=sys.stderr, flush=True)
            sys.exit(DRAIN_EXIT_CODE)


def install_sigterm_drain(state, checkpoint_path=None):
    """Install a SIGTERM handler that drains the job at the next commit; returns the Drain.

    >>> hvd_adapt.install_sigterm_drain(state, checkpoint_path="ckpt/job.pt")
    """
    drain = Drain(checkpoint_path)
    drain.install()
    state._drain = drain
    return drain
