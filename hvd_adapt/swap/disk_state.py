"""The optimizer's state on disk (:class:`DiskState`), and the ranks' agreements on what its
steps and syncs did. What it promises (``docs/optimizer-state-on-disk.md``):

- A step writes a new file, live only once every rank stepped every chunk; a failure
  anywhere leaves every rank's live state the one before the step.
- A failure before any parameter moved (a full disk at the reservation, a file removed
  behind the job's back) is every rank's error, and nothing changed: step again.
- A failure after parameters moved (the optimizer raising part-way, an I/O error) is
  every rank's error too, and breaks the state on every rank: each later step, commit,
  state dict or sync raises until a restore (``State.restore()``, a loaded checkpoint)
  brings parameters and state back to a commit together.
- Never a silently wrong state, a hang, or a rank raising alone: errno, the failing rank
  and whether parameters moved travel through the agreements as data (:class:`Outcome`).
"""
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
from ..optim.optimizer_state import OptimizerState
from .files import PREFIX, StateFiles
from .io import IO_BYTES, BufferPool, SwapError, aligned, stream
from .layout import Layout, Makeups, check_added, layout_of, piece_bytes, plan_chunks
from .step import BUFFERS, Stats, StepRun

log = logging.getLogger(__name__)

MIB = 2 ** 20
DEFAULT_BUFFER_MB = 16      # a default buffer: 1/SHARE of the state (the pool of four, 1/8),
SHARE = 32                  # 1 to 16 MiB, or larger where a parameter stepped whole needs it
NOT_TAKEN = "the optimizer step was not taken (parameters and state unchanged)"
BROKEN = ("a swapped optimizer step failed after parameters moved, so parameters and "
          "optimizer state no longer match: restore a commit (State.restore()) or load a "
          "checkpoint (model and optimizer) before stepping again")
NOT_SYNCED = "the optimizer state was not synced (the state is as it was)"


class Outcome(NamedTuple):
    """One rank's part in an agreement: ``errno`` 0 where it did its part, else why not (and
    ``message``); ``moved``: whether its parameters moved."""
    errno: int = 0
    message: str = ""
    moved: bool = False

    @classmethod
    def of(cls, error, moved=False):
        if error is None:
            return cls(moved=moved)
        if isinstance(error, OSError) and error.errno and error.strerror:
            return cls(error.errno, error.strerror, moved)
        return cls(errno.EIO, f"{type(error).__name__}: {error}", moved)


def agreement(outcome, what):
    """Collective: every rank's :class:`Outcome` at ``what``, by rank."""
    return collective.allgather_object(outcome, name=f"hvd_adapt.swap.{what}")


class DiskState(OptimizerState):
    """The per-parameter state of ``optimizer`` in files under ``directory`` (``files.py``),
    stepped a chunk at a time through a pool of four buffers (``step.py``).

    ``buffer_mb`` sizes each buffer (None: 1/32 of the state, 1 to 16 MiB, or the largest
    state of a parameter that must be stepped whole); a parameter's state larger than a
    buffer is stepped in pieces. ``o_direct``: read and write around the page cache where
    the file system takes it. ``workers`` threads do the I/O.
    """

    mapped = True

    def __init__(self, optimizer, directory, buffer_mb=None, o_direct=True, workers=4):
        if buffer_mb is not None and not buffer_mb > 0:
            raise ValueError(f"swap_buffer_mb must be > 0 or None, got {buffer_mb!r}")
        self.optimizer, self._makeups = optimizer, Makeups(optimizer)
        self._directory = directory = os.path.abspath(directory)
        params = self._params()
        state_bytes = sum(self._state_bytes(p) for p in params)
        whole = max((self._state_bytes(p) for p in params if not self._splittable(p)), default=0)
        self.buffer_bytes = aligned(int(buffer_mb * MIB) if buffer_mb is not None else max(
            min(DEFAULT_BUFFER_MB * MIB, max(MIB, state_bytes // SHARE)), whole))
        # Every parameter must fit a buffer, whole or in pieces: said now, not at a step.
        self._chunks(Layout([(p, self._makeup(p).tensors, {}) for p in params]))
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

    # -- what the optimizer keeps ----------------------------------------------------------
    def _params(self):
        """The optimizer's parameters, live (``add_param_group`` adds to them)."""
        self._groups_of = {p: g for g, group in enumerate(self.optimizer.param_groups)
                           for p in group["params"]}
        return list(self._groups_of)

    def _makeup(self, param):
        return self._makeups.of(param, self._groups_of[param])

    def _splittable(self, param):
        # A sparse gradient (Embedding(sparse=True)) cannot be sliced into pieces.
        sparse = param.grad is not None and param.grad.is_sparse
        return param.is_contiguous() and not sparse and self._makeup(param).splittable

    def _state_bytes(self, param):
        return piece_bytes(self._makeup(param).tensors, param.numel())

    def _describe(self, param):
        # By identity: list.index compares tensors with ==, elementwise, and raises.
        index = next(i for i, p in enumerate(self._groups_of) if p is param)
        return f"parameter {index} (shape {tuple(param.shape)}, group {self._groups_of[param]})"

    def _chunks(self, layout):
        return plan_chunks(layout, self._groups_of, self._splittable, self.buffer_bytes,
                           self._describe)

    def _plan(self):
        """The step's layout: the live state's, the parameters with a gradient and no state
        yet, and the state tensors a hyper-parameter turned on since adds (where torch
        refuses that, a probe finds it: refused before anything moves)."""
        old = None if self._files.live is None else self._files.live.layout
        specs, probed = [], set()
        for p in self._params():
            kept = old.get(p) if old is not None else None
            if kept is None:
                if p.grad is not None:
                    specs.append((p, self._makeup(p).tensors, {}))
                continue
            for e in [e for e in kept.entries if e.elementwise and e.numel != p.numel()]:
                # Model surgery (p.data = a larger tensor): its state would be read from
                # the regions of others. In memory the optimizer fails too, on the shapes.
                raise ValueError(
                    f"hvd_adapt swap: {self._describe(p)} has {p.numel()} elements, its "
                    f"optimizer state {e.key!r} {e.numel}: nothing was stepped; load a state "
                    "dict that matches (load_state_dict) first")
            added = [t for t in self._makeup(p).tensors
                     if t.key not in {e.key for e in kept.entries}]
            group = self._groups_of[p]
            if added and (kept.entries or kept.plain) and (group, p.dim()) not in probed:
                probed.add((group, p.dim()))
                check_added(self.optimizer, self.optimizer.param_groups[group], p, kept)
            specs.append((p, [e.spec() for e in kept.entries] + added, kept.plain))
        return Layout(specs)

    # -- the interface -----------------------------------------------------------------------
    def step(self, closure=None, agree=None):
        """Step the optimizer over every parameter (read ahead, step, write behind), with
        the ranks' ``agree`` (:func:`agreement`): the new file is live where every rank
        went through; see the module's docstring for where one did not."""
        if closure is not None:
            raise ValueError("step(closure) cannot be used with swap_dir: the state is stepped "
                             "a chunk of parameters at a time, and a closure would run per chunk")
        self._check_not_broken()
        # Reading torch's defaultdict (``opt.state[p]`` in a logger) leaves an empty entry
        # behind: no state, nothing to keep.
        for p in [p for p, held in self.optimizer.state.items() if not held]:
            del self.optimizer.state[p]
        if self.optimizer.state:
            raise RuntimeError(
                "hvd_adapt swap: the wrapped optimizer holds state in memory between steps "
                f"({len(self.optimizer.state)} parameter(s)); with swap_dir its state lives on "
                "disk: load state through DistributedOptimizer.load_state_dict")
        agree, started = _timed(agree or agreement, self.stats), time.perf_counter()
        layout, live, run = self._plan(), self._files.live, None
        chunks = self._chunks(layout)
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
        self.stats.steps += 1
        self.stats.total += time.perf_counter() - started

    def tensors(self):
        self._check_not_broken()
        return self._tensors_of(self._files.live)

    def read(self, params, keys):
        """Copies, on the device the optimizer keeps them on: the file stays the spare's."""
        live = self._files.live
        if live is None:
            return {}
        mapped, out = self._files.map(live, lend=False), {}
        for p in [p for p in params if live.layout.get(p) is not None]:
            on_device = {e.key: e.on_device for e in live.layout.get(p).entries}
            out[p] = {key: value.to(p.device if on_device[key] else "cpu", copy=True)
                      if key in on_device else value
                      for key, value in live.layout.tensors_of(p, mapped).items() if key in keys}
        return out

    def commit(self):
        """Nothing to copy: the commit keeps the live file, its serial the mark."""
        self._check_not_broken()
        return {}, self._files.commit()

    def committable(self):
        self._check_not_broken()
        return True

    def committed(self, states, mark):
        """The commit's file, mapped: a checkpoint writes it without loading it first."""
        return self._tensors_of(self._files.kept(mark))

    def load(self, state_dict, mark=None):
        """The groups into the optimizer; the state onto disk a request at a time, or, with a
        commit's mark, back to its file. Mends a broken state."""
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
        """Collective: rank 0's groups, layout and file, a buffer at a time. A rank that
        cannot make its file, or read or write a region, says so and still takes part in
        every broadcast; then every rank raises, its state as it was. Rank 0's broken state
        is every rank's."""
        collective.broadcast_optimizer_state(self.optimizer)    # groups: no state in memory
        root, live = env.rank() == 0, self._files.live
        index = {p: i for i, p in enumerate(self._params())}
        broken, dump = collective.broadcast_object(
            (self._broken, None if live is None else live.layout.dump(index)) if root else None,
            name="hvd_adapt.sync.swap_layout")
        if broken is not None:
            self._broken = (broken[0], f"{NOT_SYNCED}: rank 0: {broken[1]}")
            raise SwapError(*self._broken)
        if dump is None:
            self._files.make_live(None)
        else:
            layout = live.layout if root else Layout.load(dump, self._params())
            agree = _timed(agreement, self.stats)
            with contextlib.ExitStack() as stack:
                def reserve():
                    if root:
                        return None, stack.enter_context(contextlib.closing(self._files.open(live)))
                    return stack.enter_context(self._files.new(layout))[1], None
                writer, source = self._agreed(agree, "sync-reserved", reserve, NOT_SYNCED)
                self._agreed(agree, "sync-written", lambda: _broadcast(
                    self._pool, self.buffer_bytes, layout.nbytes, source, writer), NOT_SYNCED)
        self._broken = None

    def metrics(self):
        return self.stats.as_dict()

    def on_reset(self):
        """Remove the swap folders whose owner is gone (a worker Horovod removed from the
        job ends without its clean-up): their files are never read, and would fill the disk."""
        remove_unlocked_folders(self._directory, PREFIX)

    def release(self):
        """Remove the files, free the buffers, and remove the folders of owners that are
        gone (also when the optimizer is collected, and at interpreter exit)."""
        self._finalizer()

    # -- helpers -----------------------------------------------------------------------------
    def _agreed(self, agree, what, action, refused, moved=lambda: False, own=False):
        """``action()``, agreed: its result where every rank's went through. Else every rank
        raises a SwapError with the first failing rank's errno naming every failure (with
        ``own``, the failing rank its own error); where any rank's parameters moved, the
        state is broken first, on every rank."""
        error = result = None
        try:
            result = action()
        except Exception as e:
            error = e
        outcomes = agree(Outcome.of(error, moved()), what)
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
        """A new live file of ``states`` (``{param: {key: tensor or value}}``, e.g. a
        checkpoint's, mapped), a request at a time, cast as it goes: a mapped checkpoint is
        never read whole."""
        layout = layout_of(states, self._params(), self._makeup)
        slot = min(IO_BYTES, self.buffer_bytes)

        def fill(values, entry, start, size):
            flat = values.detach().reshape(-1)
            if flat.dtype != entry.dtype:
                width = entry.element_size
                flat, start = flat[start // width:(start + size) // width].to(entry.dtype), 0
            return lambda target: target.copy_(flat.view(torch.uint8)[start:start + size])

        tasks = ((entry.offset + start, min(slot, entry.nbytes - start),
                  fill(states[p.param][entry.key], entry, start, min(slot, entry.nbytes - start)))
                 for p in layout.params for entry in p.entries
                 for start in range(0, entry.nbytes, slot))
        with self._files.new(layout) as (_, writer):
            stream(self._io, self._pool, BUFFERS, writer, tasks)
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


def _timed(agree, stats):
    def timed(outcome, what):
        began = time.perf_counter()
        try:
            return agree(outcome, what)
        finally:
            stats.agree += time.perf_counter() - began
    return timed


def _broadcast(pool, buffer_bytes, nbytes, source, writer):
    """Collective: ``nbytes`` of rank 0's ``source`` into every other rank's ``writer``, a
    buffer at a time; a rank whose read or write failed still takes part to the end."""
    error, buffer = None, pool.take()
    try:
        for start in range(0, nbytes, buffer_bytes):
            size = min(buffer_bytes, nbytes - start)
            try:
                if source is not None and error is None:
                    source.move(buffer.memory(0, size), start, write=False)
            except OSError as e:
                error = e
            collective.broadcast_tensors([(f"hvd_adapt.swap.region{start // buffer_bytes}",
                                           buffer.bytes[:size])], root_rank=0)
            try:
                if writer is not None and error is None:
                    writer.move(buffer.memory(0, size), start, write=True)
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
    except OSError as e:
        raise ValueError(f"swap_dir {directory} cannot be created: {e}") from e
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"swap_dir {directory} is not a writable folder")
    usage = shutil.disk_usage(directory)
    # Live, committed and one being written: three files at most. A total of 0: a file
    # system with no size (ramfs), where the step's reservation checks.
    if usage.total and usage.free < 3 * state_bytes:
        raise ValueError(f"swap_dir {directory} has {usage.free / 1e9:.2f} GB free; the "
                         f"optimizer state needs about {3 * state_bytes / 1e9:.2f} GB there "
                         "(three files: live, committed, being written)")


def _close(pool, io, root, root_fd, directory, owner):
    if os.getpid() != owner:
        # A forked child that exits normally runs finalizers too: the folder is its parent's.
        return
    io.shutdown(wait=True)
    pool.release()
    shutil.rmtree(root, ignore_errors=True)
    os.close(root_fd)
    # A worker Horovod removed from the job ends without its clean-up: the last to leave
    # takes its folder too.
    remove_unlocked_folders(directory, PREFIX)
