"""hvd_adapt.State: one Horovod elastic state for everything a resize must carry.

It is a ``horovod.torch.elastic.TorchState`` (plain attributes work as in
Horovod) whose values are carried by the handlers of ``handlers.py``: models
and torch optimizers, learning-rate schedulers, and hvd_adapt's own objects,
which say themselves how they sync and what a reset means to them. The State
adds what Horovod's lacks: accumulator totals summed at every commit, commits
that wait for the end of an accumulation cycle, host updates that are not
lost within one second, and whole-job checkpoints of the last commit.
"""
import os

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult
from horovod.torch.elastic.state import TorchState

from .._runtime import collective, env
from .._runtime.context import CONTEXT
from .._runtime.threads import share_cpu_threads
from ..accumulator import Accumulator, flush
from . import checkpoint
from .epoch import EpochCounter
from .handlers import handler_for, snapshot
from .participant import Participant

_RESERVED = ("epochs", "epoch")


class State(TorchState):
    """Everything training must carry across resizes, failures and restarts.

    Pass the model, the optimizer, loaders, accumulators, schedulers and any
    plain values by name; read them back as attributes.

    >>> import hvd_adapt, torch
    >>> hvd_adapt.init()
    >>> model = torch.nn.Linear(2, 1)
    >>> state = hvd_adapt.State(model=model, best_accuracy=0.0)
    >>> state.best_accuracy = 0.5
    >>> state.commit()                 # where resizes take effect
    >>> state.best_accuracy = 0.9
    >>> state.restore()
    >>> state.best_accuracy
    0.5

    ``commit()`` is a no-op in the middle of a gradient-accumulation cycle:
    accumulated gradients are not part of the state, so commits take effect
    at optimizer steps. A :class:`hvd_adapt.DistributedOptimizer` trains on
    the loader it accumulates for: the autoscaled loader if there is one,
    else the first loader given.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        for name in _RESERVED:
            if name in kwargs:
                raise ValueError(f"State reserves the name {name!r} for its epoch counter; "
                                 "call that value something else")
        kwargs.update(model=model, optimizer=optimizer)
        kwargs["epochs"] = EpochCounter()
        ours = {}
        for name in list(kwargs):
            handler = handler_for(kwargs[name])
            if handler is not None:
                ours[name] = handler
                del kwargs[name]
        model, optimizer = kwargs.pop("model", None), kwargs.pop("optimizer", None)
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        self._saved_state = {name: snapshot(value) for name, value in self._saved_state.items()}
        # Horovod's own object broadcast costs a background-thread round trip
        # even in a world of one; ours returns at once there.
        self._bcast_object = collective.broadcast_object
        for name, handler in ours.items():
            # TorchState always files model/optimizer; ours supersede them.
            self._saved_state.pop(name, None)
            setattr(self, name, handler.value)
        self._handlers.update(ours)
        values = [h.value for h in ours.values()]
        # Checked at every commit; participants are never replaced (they load in place).
        self._participants = [v for v in values if isinstance(v, Participant)]
        for value in self._participants:
            value.join(values)
        self._accumulators = [v for v in values if isinstance(v, Accumulator)]
        self._resync_pending = False
        self._drain = None
        self._checkpoint_writer = checkpoint.CheckpointWriter()
        self.register_reset_callbacks([self._after_reset])
        CONTEXT.state = self
        if env.initialized():
            # For scripts that called hvd.init() rather than hvd_adapt.init().
            share_cpu_threads(env.local_size(), env.local_rank())

    @property
    def epoch(self):
        """The current epoch of ``remaining_epochs_until``."""
        return self.epochs.epoch

    def at_optim_boundary(self):
        """False while any loader is between the steps of an accumulation cycle."""
        return all(value.at_commit_point() for value in self._participants)

    def set_drain(self, drain):
        """Check ``drain`` (a :class:`hvd_adapt.Drain`) at every commit."""
        self._drain = drain

    def commit(self):
        """Collective: save the state and raise ``HostsUpdatedInterrupt`` if hosts changed.

        Also sums pending accumulator updates over replicas (one collective)
        and, with a SIGTERM drain installed, stops the job when any replica
        was asked to stop.
        """
        if not self.at_optim_boundary():
            return
        if self._accumulators:
            flush(self._accumulators)
        self.save()
        if self._drain is not None:
            self._drain.check(self)
        self.check_host_updates()

    def check_host_updates(self):
        """Collective: raise ``HostsUpdatedInterrupt`` if the driver reported a host change.

        Horovod stamps host updates in whole seconds and ignores one that
        shares the second of the update before it, so of two resizes within
        a second the second was lost. Each update is delivered once and the
        queue is emptied at every reset, so here an update stamped in the
        same second as the last one counts as new. Outside elastic mode no
        driver sends updates and it returns at once, so a script can call it
        after every batch and commit less often (as Horovod's examples do).
        Like a commit, it does nothing between the steps of an accumulation
        cycle: a resize takes effect at an optimizer step.
        """
        if not env.is_elastic() or not self.at_optim_boundary():
            return
        last = self._last_updated_timestamp
        received, newest, update = False, last, HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp >= last:
                received, newest, update = True, max(newest, timestamp), update | result
        if env.size() > 1:
            # Three integers: a fixed-size tensor broadcast is one Horovod
            # cycle, an object broadcast two (its size, then its bytes).
            received, newest, update = hvd.broadcast(
                torch.tensor([int(received), newest, int(update)], dtype=torch.int64),
                root_rank=0, name="hvd_adapt.host_updates").tolist()
        self._last_updated_timestamp = newest
        if received:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def save(self):
        """Snapshot every value: handlers' into their buffers, plain values as copies (Horovod
        keeps plain values by reference, so an in-place change survived a restore)."""
        super().save()
        self._saved_state = {name: snapshot(value) for name, value in self._saved_state.items()}

    def restore(self):
        """Return every value to the last commit; plain values get copies of the snapshot."""
        super().restore()
        self._detach_plain_values()

    def _detach_plain_values(self):
        for name, value in self._saved_state.items():
            setattr(self, name, snapshot(value))

    def sync(self):
        """Collective: every value becomes rank 0's (parameters bitwise, optimizer state without
        a step), then every loader decides its batch size again."""
        self._sync_world(full=True)

    def _sync_world(self, full):
        # Every rank of a new world passes here once: through sync() where
        # Horovod syncs (a start, a joining worker, after a failure), through
        # resync_after_reset() where Horovod let a survivor skip its sync
        # (hosts only removed). A removal and an addition close together
        # give both at once: survivors that saw only the removal and a new
        # worker that must be synced in full. They first agree, in one
        # collective, whether anyone needs the full sync, so all of them
        # run the same collectives after it (two paths hung before).
        # A new worker arrives only after its whole start-up; the others
        # wait for it without spinning, so they do not slow it down.
        wanted = collective.barrier(name="hvd_adapt.sync", contribution=int(full))
        if wanted:
            super().sync()
            self._detach_plain_values()
        else:
            for handler in self._handlers.values():
                if getattr(handler, "light", False):
                    handler.sync()
        self._resync_pending = False

    def _after_reset(self):
        # After a HostsUpdatedInterrupt with skip_sync, Horovod does not sync;
        # resync_after_reset() still re-syncs the light values (cheap) so that
        # positions, totals and batch-size choices come from one rank.
        # Collectives are not allowed here: a new worker does not pass
        # through this callback.
        self._resync_pending = True
        share_cpu_threads(env.local_size(), env.local_rank())
        for value in self._participants:
            value.on_reset()
        if self._drain is not None:
            self._drain.discard_pending()

    def resync_after_reset(self):
        """Collective, called by ``run`` at each attempt: after a reset that Horovod did not
        sync, make the light values (positions, totals, choices) rank 0's, or all values
        where a worker that joined the new world needs a full sync."""
        if self._resync_pending:
            self._sync_world(full=False)

    # -- whole-job checkpoints -------------------------------------------------------
    def _checkpoint_payload(self):
        handlers = {}
        for name, handler in self._handlers.items():
            if hasattr(handler, "saved_state"):
                handlers[name] = {"state_dict": handler.saved_state()}
            elif hasattr(handler.value, "state_dict"):
                handlers[name] = {"state_dict": handler.value.state_dict()}
            else:
                handlers[name] = {"value": handler.value}
        return {"handlers": handlers, "objects": dict(self._saved_state)}

    def save_checkpoint(self, path, background=False):
        """Write the state of the last commit to ``path`` on rank 0 (others do nothing).

        Call it after ``commit()``. The file is written beside ``path`` and
        renamed over it, so a job killed while writing leaves the old
        checkpoint intact. With ``background=True`` it returns once the
        state is serialised to memory (one copy of it) and the file is
        written and fsynced on a thread while training goes on; the next
        save, :meth:`wait_for_checkpoint` and the interpreter's exit wait for
        it, and a failed write raises :class:`hvd_adapt.CheckpointError`
        there (and is logged at once).
        """
        if env.rank() == 0:
            self._checkpoint_writer.write(self._checkpoint_payload(), path, background)

    def wait_for_checkpoint(self):
        """Block until a background checkpoint write is on disk (rank 0; a no-op elsewhere)."""
        self._checkpoint_writer.wait()

    def load_checkpoint(self, path, trusted=False):
        """Load ``path`` on rank 0 if it exists; returns whether the file exists.

        The file is read with ``torch.load(weights_only=True)``: tensors,
        numpy arrays and plain values (what the State itself writes) load;
        a file holding other pickled objects is refused, since unpickling
        them runs code. ``trusted=True`` loads any file: only for files you
        wrote (a State carrying values of your own classes needs it).

        The other ranks receive the state at the next sync (``run`` syncs
        first), so on them it only reports whether ``path`` exists (the same
        answer on a shared file system). Raises
        :class:`hvd_adapt.CheckpointError`, naming the file, if it is corrupt
        or was written for a State with other contents.
        """
        self._checkpoint_writer.wait()
        if not os.path.exists(path):
            return False
        if env.rank() != 0:
            return True
        payload = checkpoint.read(path, list(self._handlers) + list(self._saved_state), trusted)
        for name, entry in payload["handlers"].items():
            handler = self._handlers[name]
            try:
                if "state_dict" in entry:
                    handler.value.load_state_dict(entry["state_dict"])
                else:
                    handler.value = entry["value"]
                    setattr(self, name, entry["value"])
            except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as e:
                raise checkpoint.CheckpointError(
                    f"checkpoint {path}: cannot load {name!r}: {type(e).__name__}: {e}") from e
        for name, value in payload["objects"].items():
            setattr(self, name, value)
        self.save()
        return True
