"""The optimizer's state on disk and the ranks' agreements on its steps and syncs: a failure
before parameters moved is every rank's error, nothing changed; one after is every rank's
too, and breaks the state on every rank until a restore (docs/optimizer-state-on-disk.md)."""
import concurrent.futures
import contextlib
import errno
import logging
import os
import shutil
import time
import weakref
from typing import NamedTuple

import torch

from .._runtime import collective, env
from .._runtime.private_files import remove_unlocked_folders
from .files import PREFIX, StateFiles
from .io import BufferPool, SwapError, aligned, windows
from .layout import Layout, Params, piece_bytes
from .step import BUFFERS, Stats, StepRun

log = logging.getLogger(__name__)

MIB = 2 ** 20
DEFAULT_BUFFER_MB = 16      # a default buffer: 1/SHARE of the state, 1 to 16 MiB (what a step
SHARE = 64                  # holds, the pool and chunk-sized temporaries, grows with it)
NOT_TAKEN = "the optimizer step was not taken (parameters and state unchanged)"
BROKEN = ("a swapped optimizer step failed after parameters moved, so parameters and "
          "optimizer state no longer match: restore a commit (State.restore()) or load a "
          "checkpoint (model and optimizer) before stepping again")
NOT_SYNCED = "the optimizer state was not synced (the state is as it was)"


class Outcome(NamedTuple):
    """A rank's part in an agreement: ``errno`` (0: done) and ``message``, whether it moved."""
    errno: int = 0
    message: str = ""
    moved: bool = False

    @classmethod
    def of(cls, error, moved=False):
        if isinstance(error, OSError) and error.errno and error.strerror:
            return cls(error.errno, error.strerror, moved)
        return cls(moved=moved) if error is None else \
            cls(errno.EIO, f"{type(error).__name__}: {error}", moved)


def agreement(outcome, what):
    """Collective: every rank's :class:`Outcome` at ``what``, by rank."""
    return collective.allgather_object(outcome, name=f"hvd_adapt.swap.{what}")


class DiskState:
    """``optim/optimizer_state.py``'s interface (not imported: optim is the layer above) for
    ``optimizer``'s state in files under ``directory``, stepped through four buffers of
    ``buffer_mb`` (None: 1/64 of the state, 1 to 16 MiB, or what a parameter stepped whole
    needs); ``o_direct`` where the file system takes it; ``workers`` I/O threads."""

    mapped = True

    def __init__(self, optimizer, directory, buffer_mb=None, o_direct=True, workers=4):
        if buffer_mb is not None and not buffer_mb > 0:
            raise ValueError(f"swap_buffer_mb must be > 0 or None, got {buffer_mb!r}")
        self.optimizer, self._params = optimizer, Params(optimizer)
        self._directory = directory = os.path.abspath(directory)
        sizes = {p: piece_bytes(self._params.makeup(p).tensors, p.numel())
                 for p in self._params.all()}
        state_bytes = sum(sizes.values())
        whole = max((n for p, n in sizes.items() if not self._params.splittable(p)), default=0)
        self.buffer_bytes = aligned(int(buffer_mb * MIB) if buffer_mb is not None else max(
            min(DEFAULT_BUFFER_MB * MIB, max(MIB, state_bytes // SHARE)), whole))
        # Every parameter must fit a buffer, whole or in pieces: said now, not at a step.
        self._params.chunks(Layout([(p, self._params.makeup(p).tensors, {}) for p in sizes]),
                            self.buffer_bytes)
        _check_room(directory, state_bytes)
        remove_unlocked_folders(directory, PREFIX)
        self._files = StateFiles(directory, o_direct)
        self._pool = BufferPool(BUFFERS, self.buffer_bytes, torch.cuda.is_available())
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                         thread_name_prefix="hvd_adapt-swap")
        self._broken = None         # (errno, why) once a failed step moved parameters
        self.stats = Stats()
        # Not atexit.register(self.release): that would keep a deleted optimizer, its
        # parameters and the pool alive until exit. The finalizer holds only what it frees.
        self._finalizer = weakref.finalize(self, _close, self._pool, self._io, self._files.root,
                                           self._files.fd, directory, os.getpid())
        if optimizer.state:
            # State it had already (a loaded checkpoint) goes to disk too.
            self._write(dict(optimizer.state))
            optimizer.state.clear()
        log.info("optimizer state on disk in %s: about %.2f GB, %d buffers of %.1f MiB",
                 self._files.root, state_bytes / 1e9, BUFFERS, self.buffer_bytes / MIB)

    def step(self, closure=None, agree=None):
        """Step every parameter, with the ranks' ``agree`` (:func:`agreement`)."""
        if closure is not None:
            raise ValueError("step(closure) cannot be used with swap_dir: the state is stepped "
                             "a chunk of parameters at a time, and a closure would run per chunk")
        self._check_not_broken()
        # Reading torch's defaultdict (``opt.state[p]`` in a logger) leaves an empty entry
        # behind: no state, nothing to keep.
        for p in [p for p, held in self.optimizer.state.items() if not held]:
            del self.optimizer.state[p]
        if self.optimizer.state:
            raise RuntimeError(f"hvd_adapt swap: the wrapped optimizer holds state in memory "
                               f"between steps ({len(self.optimizer.state)} parameter(s)); with "
                               "swap_dir load state through DistributedOptimizer.load_state_dict")
        agree, started = agree or agreement, time.perf_counter()
        live, run = self._files.live, None
        layout = self._params.step_layout(None if live is None else live.layout)
        chunks = self._params.chunks(layout, self.buffer_bytes)
        try:
            with contextlib.ExitStack() as stack:
                def reserve():
                    return stack.enter_context(self._files.new(layout)), None if live is None \
                        else stack.enter_context(contextlib.closing(self._files.open(live)))
                (_, writer), source = self._agreed(agree, "reserved", reserve, NOT_TAKEN)
                run = StepRun(self.optimizer, self._pool, self._io, self.stats, layout,
                              None if live is None else live.layout, source, writer)
                self._agreed(agree, "stepped", lambda: run.run(chunks), NOT_TAKEN,
                             moved=lambda: run.moved, own=True)
        except BaseException as e:
            if run is not None and run.moved and self._broken is None:
                # Not agreed (a peer lost, Ctrl-C): this rank's parameters moved.
                self._broken = (getattr(e, "errno", None) or errno.EIO,
                                f"{BROKEN} ({type(e).__name__}: {e})")
            raise
        self.stats["steps"] += 1
        self.stats["total"] += time.perf_counter() - started

    def tensors(self, params=None, keys=None):
        """Mapped from the live file; of ``params``, copies on the optimizer's device for
        them, so the file is not lent."""
        if params is None:
            self._check_not_broken()
            return self._tensors_of(self._files.live)
        live, out = self._files.live, {}
        mapped = self._files.map(live, lend=False) if live is not None else None
        for p in [p for p in params if live is not None and live.layout.get(p) is not None]:
            on_device = {e.key: e.on_device for e in live.layout.get(p).entries}
            out[p] = {key: value.to(p.device if on_device[key] else "cpu", copy=True)
                      if key in on_device else value
                      for key, value in live.layout.tensors_of(p, mapped).items() if key in keys}
        return out

    def commit(self):
        """Nothing to copy: the commit keeps the live file."""
        self._check_not_broken()
        return {}, self._files.commit()

    def committable(self):
        return self._check_not_broken() is None

    def committed(self, states, mark):
        """The commit's file, mapped: a checkpoint writes it without loading it first."""
        return self._tensors_of(self._files.kept(mark))

    def load(self, state_dict, mark=None):
        """The groups into the optimizer; the state onto disk (or, with a commit's mark, back
        to its file). Mends a broken state."""
        before = self.optimizer.param_groups, self.optimizer.state
        self.optimizer.load_state_dict(dict(state_dict, state={}))
        try:
            if mark is not None:
                self._files.make_live(self._files.kept(mark))
            else:
                params = [p for group in self.optimizer.param_groups for p in group["params"]]
                self._write({params[int(i)]: v for i, v in state_dict.get("state", {}).items()})
        except BaseException:
            # Nothing changes on a failed load (a full disk): the hyper-parameters stay
            # those of the state still on disk.
            self.optimizer.param_groups, self.optimizer.state = before
            raise
        self._broken = None

    def sync_from_root(self):
        """Collective: rank 0's groups, layout and file, a buffer at a time; a rank that fails
        takes part to the end, then every rank raises, its state as it was."""
        collective.broadcast_optimizer_state(self.optimizer)    # groups: no state in memory
        root, live = env.rank() == 0, self._files.live
        index = {p: i for i, p in enumerate(self._params.all())}
        broken, dump = collective.broadcast_object(
            (self._broken, None if live is None else live.layout.dump(index)) if root else None,
            name="hvd_adapt.sync.swap_layout")
        if broken is not None:
            self._broken = (broken[0], f"{NOT_SYNCED}: rank 0: {broken[1]}")
            raise SwapError(*self._broken)
        if dump is None:
            self._files.make_live(None)
        else:
            layout = live.layout if root else Layout.load(dump, self._params.all())
            with contextlib.ExitStack() as stack:
                def reserve():
                    if root:
                        return None, stack.enter_context(contextlib.closing(self._files.open(live)))
                    return stack.enter_context(self._files.new(layout))[1], None
                writer, source = self._agreed(agreement, "sync-reserved", reserve, NOT_SYNCED)
                self._agreed(agreement, "sync-written", lambda: _broadcast(
                    self._pool, self.buffer_bytes, layout.nbytes, source, writer), NOT_SYNCED)
        self._broken = None

    def metrics(self):
        return self.stats.as_dict()

    def on_reset(self):
        """Remove the folders whose owner is gone (a worker Horovod removed ends without its
        clean-up): never read again, they would fill the disk."""
        remove_unlocked_folders(self._directory, PREFIX)

    def release(self):
        """Remove the files, free the buffers (also once collected, and at exit)."""
        self._finalizer()

    def _agreed(self, agree, what, action, refused, moved=lambda: False, own=False):
        """``action()``, agreed: its result where every rank's went through, else a
        SwapError of the first failing rank's errno on every rank (``own``: its own error on
        a failing rank), the state broken first where any rank's parameters moved."""
        error = result = None
        try:
            result = action()
        except Exception as e:
            error = e
        began = time.perf_counter()
        outcomes = agree(Outcome.of(error, moved()), what)
        self.stats["agree"] += time.perf_counter() - began
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o.errno]
        if not failed:
            return result
        said = "; ".join(f"rank {rank}: {o.message}" for rank, o in failed)
        if any(o.moved for o in outcomes):
            refused = BROKEN
            self._broken = (failed[0][1].errno, f"{BROKEN} ({said})")
            log.error("%s", self._broken[1])
        if own and error is not None:
            raise error
        raise SwapError(failed[0][1].errno, f"{refused}: {said}") from error

    def _write(self, states):
        """A new live file of ``states`` (a checkpoint's, mapped), a window at a time, cast
        as it goes: a mapped checkpoint is never read whole."""
        layout = self._params.layout_of(states)
        entries = [(e, states[p.param][e.key]) for p in layout.params for e in p.entries]

        def fill(buffer, offset, size):
            for e, values in entries:
                lo, hi = max(e.offset, offset), min(e.offset + e.nbytes, offset + size)
                if lo < hi:     # window and entry start on blocks: on whole elements
                    part = values.detach().reshape(-1)[(lo - e.offset) // e.element_size:
                                                       (hi - e.offset) // e.element_size]
                    buffer.bytes[lo - offset:hi - offset].copy_(part.to(e.dtype).view(torch.uint8))

        with self._files.new(layout) as (_, writer):
            windows(self._io, self._pool, writer, layout.nbytes, True, fill)
            writer.check_whole(layout.nbytes)

    def _tensors_of(self, file):
        if file is None:
            return {}
        mapped = self._files.map(file)
        # A parameter stepped without state (SGD without momentum) has none in memory
        # either: torch's state_dict leaves it out.
        return {p.param: file.layout.tensors_of(p.param, mapped) for p in file.layout.params
                if p.entries or p.plain}

    def _check_not_broken(self):
        if self._broken is not None:
            raise SwapError(*self._broken)


def _broadcast(pool, buffer_bytes, nbytes, source, writer):
    """Collective: ``nbytes`` of rank 0's ``source`` into the others' ``writer``, a buffer at
    a time; a rank whose read or write failed takes part to the end."""
    error, buffer = None, pool.take()
    try:
        for start in range(0, nbytes, buffer_bytes):
            size = min(buffer_bytes, nbytes - start)
            for file in (source, "broadcast", writer):
                if file == "broadcast":
                    collective.broadcast_tensors([(f"hvd_adapt.swap.region{start // buffer_bytes}",
                                                   buffer.bytes[:size])], root_rank=0)
                elif file is not None and error is None:
                    try:
                        file.move(buffer.memory(0, size), start, write=file is writer)
                    except OSError as e:
                        error = e
        if writer is not None and error is None:
            writer.check_whole(nbytes)
    finally:
        pool.give_back(buffer)
    if error is not None:
        raise error


def _check_room(directory, state_bytes):
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        usage = shutil.disk_usage(directory)
    except OSError as e:
        raise ValueError(f"swap_dir {directory} cannot be created: {e}") from e
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"swap_dir {directory} is not a writable folder")
    # Live, committed and one being written: three files at most. A total of 0: a file
    # system with no size (ramfs), where the step's reservation checks.
    if usage.total and usage.free < 3 * state_bytes:
        raise ValueError(f"swap_dir {directory} has {usage.free / 1e9:.2f} GB free; the "
                         f"optimizer state needs about {3 * state_bytes / 1e9:.2f} GB there "
                         "(three files: live, committed, being written)")


def _close(pool, io, root, root_fd, directory, owner):
    if os.getpid() != owner:    # a forked child exiting runs finalizers too: not its folder
        return
    io.shutdown(wait=True)
    pool.release()
    shutil.rmtree(root, ignore_errors=True)
    os.close(root_fd)
    # A worker Horovod removed ends without its clean-up: the last to leave takes its folder.
    remove_unlocked_folders(directory, PREFIX)
