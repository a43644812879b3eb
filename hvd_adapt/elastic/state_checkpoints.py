"""A State's whole-job checkpoints: what of the last commit goes into one, where rank 0
writes it (in the background, one write at a time, never back in time), and how a found
file is loaded into every value before the sync that gives it to every rank.

:class:`hvd_adapt.State`'s ``save_checkpoint``, ``refresh_checkpoint``,
``wait_for_checkpoint``, ``settle_checkpoint`` and ``load_checkpoint`` are this
collaborator's; the file itself (its format, atomic replace, the previous
generation kept) is ``checkpoint.py``'s. It reaches the State only through its
public face (its values, ``wait_for_commit``, ``save``, ``epochs``) and Horovod's
elastic attributes through ``_runtime/horovod_internals.py``.
"""
import io
import logging
import os

from .._runtime import collective, env
from .._runtime import horovod_internals as internals
from . import agreement, checkpoint
from .handlers import snapshot
from .participant import Participant

log = logging.getLogger(__name__)


class StateCheckpoints:
    """The checkpoints of one State (``participants``: its hvd_adapt objects, which say
    whether their saved state is mapped from files)."""

    def __init__(self, state, participants):
        self._state = state
        self._participants = participants
        self._writer = checkpoint.CheckpointWriter()
        self._written = None           # (path, generation) this process wrote last

    # -- writing (rank 0) ---------------------------------------------------------------
    def _payload(self, stable=False):
        # stable: a copy that the next commit does not overwrite (its buffers
        # are reused), so that a thread may serialise it while training goes on.
        # State mapped from files (optimizer state on disk) is stable as it is.
        self._state.wait_for_commit()
        handlers = {}
        for name, handler in internals.handlers(self._state).items():
            if hasattr(handler, "saved_state"):
                saved = handler.saved_state()
                mapped = isinstance(handler.value, Participant) \
                    and handler.value.checkpoint_is_mapped()
                handlers[name] = {"state_dict": snapshot(saved) if stable and not mapped
                                  else saved}
            elif hasattr(handler.value, "state_dict"):
                handlers[name] = {"state_dict": handler.value.state_dict()}
            else:
                handlers[name] = {"value": handler.value}
        objects = dict(internals.saved_values(self._state))
        return {"handlers": handlers, "objects": snapshot(objects) if stable else objects}

    def _committed_generation(self):
        return internals.handlers(self._state)["epochs"].saved_state()["commits"]

    def save(self, path, background):
        """``State.save_checkpoint``."""
        if env.rank() != 0:
            return
        target = (os.path.abspath(path), self._committed_generation())
        if self._written == target:
            # This commit is on its way to this file already (a drain right
            # after an epoch's checkpoint): wait for it instead.
            self._writer.wait()
            return
        self._written = None
        # With state mapped from files (too large to copy into memory), a
        # background write serialises a stable copy on its thread instead.
        stream = background and any(p.checkpoint_is_mapped() for p in self._participants)
        self._writer.write(self._payload(stable=stream), path, target[1], background,
                           stream=stream)
        self._written = target

    def refresh(self, path):
        """``State.refresh_checkpoint``."""
        boundary = self._state.epochs.epoch_end_commits
        if env.rank() != 0 or boundary == 0:
            return
        written = self._written
        if written is not None and written[0] == os.path.abspath(path) and written[1] >= boundary:
            return
        try:
            found = checkpoint.generation_of(path)
        except checkpoint.CheckpointError as e:
            log.warning("%s; writing the last commit over it", e)
            found = None
        if found is None or found < boundary:
            self.save(path, background=True)

    def wait(self):
        """Block until a background write is on disk (rank 0; a no-op elsewhere)."""
        self._writer.wait()

    def failure(self):
        """Rank 0: the last background write's error, or None (None on other ranks)."""
        return self._writer.failure() if env.rank() == 0 else None

    def fail_together(self, collective_name):
        """Collective: only rank 0 writes, so only it knows a write's error; every rank
        raises it."""
        error = None
        if env.rank() == 0:
            try:
                self._writer.wait()
            except checkpoint.CheckpointError as e:
                error = e
        agreement.fail_together(error, collective_name)

    def own_write_error(self):
        """This process's last write's error (waited for), or None: before a load, reported
        through the sync's agreement rather than raised alone."""
        try:
            self._writer.wait()
        except checkpoint.CheckpointError as e:
            return e
        return None

    # -- reading ------------------------------------------------------------------------
    @staticmethod
    def newest_generation(path):
        """``(generation, unreadable)`` of the newest good file at ``path`` as this rank sees
        it, for the sync's agreement."""
        try:
            found = checkpoint.newest_good(path)
        except checkpoint.CheckpointError as e:
            return agreement.UNREADABLE, str(e)
        return (agreement.NO_FILE if found is None else found[1]), None

    def load_from(self, source_rank, path, trusted):
        """Collective: rank 0 ends up holding the checkpoint ``source_rank`` found; the full
        sync that follows gives it to everyone. Rank 0's failure is every rank's."""
        rank = env.rank()
        names = list(internals.handlers(self._state)) + list(internals.saved_values(self._state))
        error = None
        if source_rank == 0:
            if rank == 0:
                error = self._apply(lambda: checkpoint.read_newest(path, names, trusted), path)
        else:
            data = None
            if rank == source_rank:
                try:
                    # The file the agreement saw: the newest good generation.
                    found = checkpoint.newest_good(path)
                    with open(path if found is None else found[0], "rb") as f:
                        data = f.read()
                except (OSError, checkpoint.CheckpointError) as e:
                    log.error("reading checkpoint %s failed: %s", path, e)
            data = collective.broadcast_bytes(data, root_rank=source_rank,
                                              name="hvd_adapt.checkpoint_file")
            where = f"{path} (rank {source_rank}'s)"
            if rank == 0:
                if data is None:
                    error = checkpoint.CheckpointError(f"checkpoint {where} could not be read")
                else:
                    error = self._apply(
                        lambda: checkpoint.read(io.BytesIO(data), names, trusted, name=where),
                        where)
        agreement.fail_together(error, "hvd_adapt.checkpoint_loaded")

    def _apply(self, read, where):
        """Load what ``read()`` returns into every value; returns the CheckpointError, or None."""
        state = self._state
        try:
            payload = read()
            for name, entry in payload["handlers"].items():
                handler = internals.handlers(state)[name]
                try:
                    if "state_dict" in entry:
                        handler.value.load_state_dict(entry["state_dict"])
                    else:
                        handler.value = entry["value"]
                        setattr(state, name, entry["value"])
                except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as e:
                    raise checkpoint.CheckpointError(
                        f"checkpoint {where}: cannot load {name!r}: {type(e).__name__}: {e}") from e
            for name, value in payload["objects"].items():
                setattr(state, name, value)
        except checkpoint.CheckpointError as e:
            return e
        state.epochs.resumed = True
        # The sync that follows sends the saved plain values (Horovod's ObjectState.sync).
        state.save()
        return None
