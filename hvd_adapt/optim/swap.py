"""Optimizer state on disk: generations of files, and the step that walks them a chunk at a
time, as DeepSpeed's optimizer swapper, under torch optimizers.

The wrapped optimizer's per-parameter state (Adam's moments and step, a
momentum buffer, whatever tensors an optimizer keeps: found by stepping a
probe, see ``swap_layout``) lives in files, one per generation, in a folder of
this optimizer's own (``<swap_dir>/hvd_adapt-swap-<random>``, created 0700,
``flock``-ed while it lives: a folder whose lock is free is a dead process's and
is removed). A step walks chunks of parameters (or of pieces of a large one):
while chunk i steps (its state made of views into a pool buffer), the chunks
after it are read ahead and the ones before it written behind in the pool's other
buffers, by a thread pool doing checked ``os.preadv``/``os.pwritev`` (they
release the GIL). Only the pool's four buffers are in memory, whatever the
largest parameter.

A step never writes over a generation anyone holds: it reserves the next
generation's file (the spare, a dropped generation's file, where there is one; a
full disk fails here, before anything changes), writes all of it, and only then
makes it live. A generation carries its layout, so a commit is O(1) (it keeps
the generation), a restore switches back to it, and a checkpoint maps its file.
"""
import concurrent.futures
import errno
import functools
import logging
import os
import re
import shutil
import time
import weakref

import torch

from .._runtime.private_files import create_exclusive, new_locked_folder, \
    remove_unlocked_folders
from .swap_io import IO_BYTES, BufferPool, SwapError, SwapFile, aligned, failure, submit
from .swap_layout import Layout, plan_pieces, plan_signature, probe_makeup, segments
from .swap_undo import UndoAhead, UndoAheadSlot, fingerprint

log = logging.getLogger(__name__)

PREFIX = "hvd_adapt-swap-"
SPARE = "spare.bin"         # a dropped generation's file, the next one's
DEFAULT_BUFFER_MB = 16
BUFFERS = 4                 # stepping, and reads ahead and writes behind in the others


class SwapStats:
    """Seconds and bytes over swapped steps. ``read``/``write``: each chunk's I/O from its
    submission to its last byte; ``io``: time any I/O was in flight; ``hidden``: the part
    of it that overlapped compute (the step was not waiting for it); ``wait``: time the
    step waited for I/O; ``step``: time in the optimizer's own step; ``copy``: copying the
    undo copy into a buffer and the new state into place; ``agree``: the agreements between
    ranks; ``total``: the whole swapped steps. ``bytes_written`` are the steps' own writes;
    ``ahead_written`` the undo copies written ahead, while the micro-steps ran (see
    ``swap_undo``), and ``ahead_used`` those a step found valid and did not write again."""

    def __init__(self):
        self.read = self.wait = self.write = self.step = self.io = self.hidden = 0.0
        self.copy = self.agree = self.total = 0.0
        self.bytes_read = self.bytes_written = self.ahead_written = self.ahead_used = 0
        self.steps = 0

    def as_dict(self):
        return {"swap_read_s": self.read, "swap_wait_s": self.wait,
                "swap_write_s": self.write, "swap_step_s": self.step,
                "swap_copy_s": self.copy, "swap_agree_s": self.agree,
                "swap_total_s": self.total,
                "swap_io_s": self.io, "swap_hidden_s": self.hidden,
                "swap_read_bytes": self.bytes_read, "swap_written_bytes": self.bytes_written,
                "swap_undo_ahead_bytes": self.ahead_written,
                "swap_undo_ahead_used_bytes": self.ahead_used,
                "swap_steps": self.steps}


class SwappedState:
    """The per-parameter state of ``optimizer``, kept in files under ``directory``.

    ``buffer_mb`` sizes each of the pool's four buffers (None: 16 MiB, or the largest
    state of a parameter that must be stepped whole); a parameter's state larger than a
    buffer is stepped in pieces. ``o_direct`` (None: where the file system takes it)
    reads and writes around the page cache. ``workers`` threads do the I/O.
    """

    def __init__(self, optimizer, directory, buffer_mb=None, o_direct=None, workers=4):
        if buffer_mb is not None and not buffer_mb > 0:
            raise ValueError(f"swap_buffer_mb must be > 0 or None, got {buffer_mb!r}")
        self.optimizer = optimizer
        self._makeups = {}
        self._groups_of = {}
        directory = os.path.abspath(directory)
        self._directory = directory
        params = self._params()
        largest_whole = max((self._whole_bytes(p) + aligned(p.numel() * p.element_size())
                             for p in params if not self._splittable(p)), default=0)
        wanted = buffer_mb * 2 ** 20 if buffer_mb is not None \
            else max(DEFAULT_BUFFER_MB * 2 ** 20, largest_whole)
        self.buffer_bytes = aligned(int(wanted))
        # Every parameter must fit a buffer, whole or in pieces: said now, not at a step.
        plan_pieces(Layout([(p, self._makeup(p).tensors, {}) for p in params]),
                    self._groups_of, self._splittable, self.buffer_bytes, self._describe)
        self._check_room(directory, params)
        self.remove_stale()
        self.root, self._root_fd = new_locked_folder(directory, PREFIX)
        self._o_direct = self._probe_o_direct() if o_direct is None else bool(o_direct)
        self._pool = BufferPool(BUFFERS, self.buffer_bytes, torch.cuda.is_available())
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                         thread_name_prefix="hvd_adapt-swap")
        self.live = None            # generation holding the current state (None: no state yet)
        self._generation = 0
        self._layouts = {}          # generation -> its Layout
        self._referenced = {}       # generation -> count of references (live, commits)
        # generation -> a read descriptor held while it is referenced: its state stays
        # readable (a state dict, a checkpoint) if a cleaner removes the folder's files.
        self._held = _HeldFiles()
        # Not in forked children (DataLoader workers): there they would keep generations
        # this process removes allocated on disk for as long as the children live.
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child,
                                                             weakref.ref(self._held)))
        self._incoming = None       # a sync's layout, adopted before its broadcast
        self._broken = None         # why the parameters are half-stepped (until a restore)
        self._spare = False         # whether SPARE is in the folder
        self._lent = set()          # generations whose mapped tensors were handed out
        self._recycled = set()      # generations written over the spare
        self._behind = set()        # generations no one uses that could not be removed yet
        self._next_plan = None      # (chunks, signature): the last step's, the next one's too
        self._ahead = UndoAheadSlot()   # the next step's undo copies being written
        self.stats = SwapStats()
        # Not atexit.register(self.close): that would keep a deleted optimizer, its
        # parameters and the pool alive until exit. The finalizer holds only what it frees.
        self._finalizer = weakref.finalize(self, _close, self._ahead, self._pool, self._io,
                                           self._held, self.root, self._root_fd, directory,
                                           os.getpid())
        state_bytes = sum(self._whole_bytes(p) for p in params)
        log.info("optimizer state on disk in %s: about %.2f GB, %d buffers of %.1f MiB%s",
                 self.root, state_bytes / 1e9, BUFFERS, self.buffer_bytes / 2 ** 20,
                 ", O_DIRECT" if self._o_direct else "")

    # -- what the optimizer keeps ----------------------------------------------------------
    def _params(self):
        """The optimizer's parameters, live (``add_param_group`` adds to them)."""
        self._groups_of = {p: g for g, group in enumerate(self.optimizer.param_groups)
                           for p in group["params"]}
        return list(self._groups_of)

    def _makeup(self, param):
        group = self._groups_of[param]
        # What an optimizer keeps depends on which of its features are on (momentum from 0,
        # amsgrad), not on their magnitudes (a learning rate a scheduler moves each step):
        # a group whose features changed since its probe is probed again.
        key = (group, param.dtype, str(param.device), param.dim(),
               _features(self.optimizer.param_groups[group]))
        if key not in self._makeups:
            self._makeups[key] = probe_makeup(self.optimizer,
                                              self.optimizer.param_groups[group], param)
        makeup = self._makeups[key]
        if makeup.splittable or all(shape is None for _, _, shape, _ in makeup.tensors):
            return makeup
        # State shaped by the parameter's shape, not its elements (Adafactor's row and
        # column factors): its sizes come from a probe of that shape.
        key += (tuple(param.shape),)
        if key not in self._makeups:
            self._makeups[key] = probe_makeup(self.optimizer,
                                              self.optimizer.param_groups[group], param,
                                              exact=True)
        return self._makeups[key]

    def _splittable(self, param):
        # A sparse gradient (Embedding(sparse=True)) cannot be sliced into pieces.
        sparse = param.grad is not None and param.grad.is_sparse
        return param.is_contiguous() and not sparse and self._makeup(param).splittable

    def _whole_bytes(self, param):
        size = 0
        for _, dtype, shape, _ in self._makeup(param).tensors:
            count = param.numel() if shape is None else _numel(shape)
            size += aligned(count * torch.empty((), dtype=dtype).element_size())
        return size

    def _describe(self, param):
        # By identity: list.index compares tensors with ==, elementwise, and raises.
        index = next(i for i, p in enumerate(self._groups_of) if p is param)
        return f"parameter {index} (shape {tuple(param.shape)}, group {self._groups_of[param]})"

    def _check_room(self, directory, params):
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"swap_dir {directory} cannot be created: {e}") from e
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"swap_dir {directory} is not a writable folder")
        # Live, committed and one being written: up to three generations at once, the live
        # one and the one being written each with its undo area (the parameters' bytes).
        needed = sum(3 * self._whole_bytes(p) + 2 * p.numel() * p.element_size()
                     for p in params)
        usage = shutil.disk_usage(directory)
        free = usage.free
        # A total of 0: a file system with no size (ramfs); the step's reservation checks.
        if usage.total and free < needed:
            raise ValueError(f"swap_dir {directory} has {free / 1e9:.2f} GB free; the optimizer "
                             f"state needs about {needed / 1e9:.2f} GB there (three "
                             "generations: live, committed, being written)")

    def _probe_o_direct(self):
        name = ".probe"
        fd = create_exclusive(name, dir_fd=self._root_fd)
        try:
            return SwapFile(fd, name, direct=True).direct
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=self._root_fd)

    # -- generations ---------------------------------------------------------------------
    def _name(self, generation):
        return f"gen{generation}.bin"

    def _create(self, nbytes):
        """A new generation's file, ``nbytes`` of space reserved: ``(generation, SwapFile)``.
        It is the spare where there is one: writing over blocks written before is faster
        than writing new ones, and no generation's blocks are freed at each step."""
        self._generation += 1
        generation = self._generation
        name = self._name(generation)
        fd, spare = None, self._spare
        try:
            if self._spare:
                self._spare = False
                try:
                    os.rename(SPARE, name, src_dir_fd=self._root_fd, dst_dir_fd=self._root_fd)
                    fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 dir_fd=self._root_fd)
                except FileNotFoundError:
                    spare = False   # removed by hand: a new file, then
            if fd is None:
                fd = create_exclusive(name, flags=os.O_RDWR, dir_fd=self._root_fd)
        except OSError as e:
            gone = " (the folder was removed; the live state is still readable: save a " \
                "checkpoint and go on with a swap_dir that is there)" \
                if os.fstat(self._root_fd).st_nlink == 0 else ""
            raise failure(e.errno, f"cannot create {os.path.join(self.root, name)}{gone}") from e
        out = SwapFile(fd, os.path.join(self.root, name), self._o_direct)
        if spare:
            self._recycled.add(generation)
        try:
            out.reserve(nbytes)
        except BaseException:
            self._discard(generation, out)
            raise
        return generation, out

    def _discard(self, generation, out):
        """A generation never made live (a failed step or load, a scratch file): its file
        is the spare again if it was the spare, else it goes (the folder is as before)."""
        out.close()
        if generation in self._recycled:
            self._retire(generation)
        else:
            self._unlink(generation)

    def _open(self, generation):
        """``generation``'s file for reading, through the descriptor held on it where there
        is one (a file description of its own: its O_DIRECT flag is its own)."""
        name = self._name(generation)
        path = os.path.join(self.root, name)
        held = self._held.get(generation)
        try:
            if held is not None:
                fd = os.open(f"/proc/self/fd/{held}", os.O_RDONLY | os.O_CLOEXEC)
            else:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self._root_fd)
        except OSError as e:
            raise failure(e.errno, f"cannot open {path}") from e
        return SwapFile(fd, path, self._o_direct)

    def _unlink(self, generation):
        try:
            os.unlink(self._name(generation), dir_fd=self._root_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            # After the generation that replaces it is live: only disk space is at stake.
            if generation not in self._behind:
                log.warning("hvd_adapt swap: cannot remove %s, no longer used: %s; it stays "
                            "there until it can be removed",
                            os.path.join(self.root, self._name(generation)),
                            os.strerror(e.errno))
            self._behind.add(generation)
            return
        self._behind.discard(generation)

    def _remove_behind(self):
        """Remove the generations kept behind (see :meth:`_unlink`), now that the folder may
        take it again: a folder read-only for a while leaves nothing for good."""
        for generation in sorted(self._behind):
            self._unlink(generation)

    def _retire(self, generation):
        """``generation``'s file is no one's: it becomes the spare (the next generation's
        file), or goes where there is a spare already or where tensors mapped from it were
        handed out (a state dict): an unlinked file stays as it is while mapped, one written
        over would change them."""
        self._recycled.discard(generation)
        if self._spare or generation in self._lent:
            self._lent.discard(generation)
            self._unlink(generation)
            return
        try:
            os.rename(self._name(generation), SPARE, src_dir_fd=self._root_fd,
                      dst_dir_fd=self._root_fd)
            self._spare = True
        except FileNotFoundError:
            pass
        except OSError:
            # The spare's name refused (an immutable spare.bin): no spare, then.
            self._unlink(generation)

    def _hold(self, generation, file=None):
        """One more reference to ``generation``; the first holds a read descriptor on it:
        reopened through ``file``, the one it was written through (also where its name is
        gone already; read-only, so a file system can still be remounted read-only), else
        opened by name."""
        if generation is None:
            return
        if generation not in self._referenced:
            try:
                self._held[generation] = os.open(
                    f"/proc/self/fd/{file.fd}", os.O_RDONLY | os.O_CLOEXEC) \
                    if file is not None else os.open(
                        self._name(generation), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=self._root_fd)
            except OSError as e:
                # Read by name then: a file gone fails where it is read, with its name.
                log.warning("hvd_adapt swap: cannot hold %s open: %s", self._name(generation),
                            os.strerror(e.errno))
        self._referenced[generation] = self._referenced.get(generation, 0) + 1

    def _drop(self, generation):
        if generation is None:
            return
        self._referenced[generation] -= 1
        if self._referenced[generation] == 0:
            del self._referenced[generation]
            del self._layouts[generation]
            held = self._held.pop(generation, None)
            if held is not None:
                os.close(held)
            self._retire(generation)

    def _set_live(self, generation, layout=None, file=None):
        """Make ``generation`` live (``file``: the new one's, still open)."""
        if layout is not None:
            self._layouts[generation] = layout
        self._hold(generation, file)
        old, self.live = self.live, generation
        self._broken = None
        self._next_plan = None
        self._drop(old)
        self._remove_behind()

    def layout(self, generation=None):
        """The :class:`Layout` of ``generation`` (default: live); None without state."""
        generation = self.live if generation is None else generation
        return None if generation is None else self._layouts[generation]

    # -- I/O -------------------------------------------------------------------------------
    def _submit(self, file, buffer, runs, write, intervals):
        return submit(self._io, file, buffer, runs, write, intervals)

    # -- stepping ------------------------------------------------------------------------
    def step(self, agree=None):
        """Step the optimizer over every parameter: read ahead, step, write behind. Either
        every parameter's step is applied and its state is in a new live generation, or
        none is: ``SwapError``/the optimizer's error is raised, the parameters hold their
        values from before the step (put back from the undo area of the new generation) and
        the live generation is the one before. ``agree(message or None, what)`` (a
        collective: every rank's message) makes one rank's failure every rank's, at the
        reservation (before anything moves) and at the end (before the new state is live)."""
        ahead = self._ahead.take()
        if self._broken is not None:
            raise SwapError(errno.EIO, self._broken)
        # Reading torch's defaultdict (``opt.state[p]`` in a logger) leaves an empty entry
        # behind: no state, nothing to keep.
        for p in [p for p, held in self.optimizer.state.items() if not held]:
            del self.optimizer.state[p]
        if self.optimizer.state:
            raise RuntimeError(
                "hvd_adapt swap: the wrapped optimizer holds state in memory between steps "
                f"({len(self.optimizer.state)} parameter(s)); with swap_dir its state lives on "
                "disk: load state through DistributedOptimizer.load_state_dict")
        agreement = agree or _alone

        def agree(message, what):
            began = time.perf_counter()
            try:
                return agreement(message, what)
            finally:
                self.stats.agree += time.perf_counter() - began
        started = time.perf_counter()
        params = self._params()
        old = self.layout()
        specs = []
        for p in params:
            kept = old.get(p) if old is not None else None
            if kept is not None:
                for e in kept.entries:
                    # Model surgery (p.data = a larger tensor): its state would be read from
                    # the regions of others. In memory the optimizer fails too, on the shapes.
                    if e.elementwise and e.numel != p.numel():
                        raise ValueError(
                            f"hvd_adapt swap: {self._describe(p)} has {p.numel()} elements, "
                            f"its optimizer state {e.key!r} {e.numel}: nothing was stepped; "
                            "load a state dict that matches (load_state_dict) first")
                tensors = [(e.key, e.dtype, e.shape, e.on_device) for e in kept.entries]
                # A hyper-parameter turned on since (momentum from 0) adds state: planned now,
                # before anything moves, and made by the optimizer at this step.
                known = {key for key, _, _, _ in tensors}
                tensors += [t for t in self._makeup(p).tensors if t[0] not in known]
                specs.append((p, tensors, kept.plain))
            elif p.grad is not None:
                specs.append((p, self._makeup(p).tensors, {}))
        layout = Layout(specs)
        chunks, end = plan_pieces(layout, self._groups_of, self._splittable, self.buffer_bytes,
                                  self._describe)
        message, out, code = None, None, None   # code: this rank's errno, where it failed
        try:
            generation, out = self._create(end)
        except OSError as e:
            # Any (a SwapError, or the spare replaced by a symlink: ELOOP): said in the
            # agreement, or the other ranks would wait in it.
            message, code = str(e), e.errno or errno.EIO
        try:
            failures = agree(message, "reserved")
        except BaseException:
            # A collective that failed (a peer lost, an elastic reset): nothing moved, and
            # the new file is the spare again.
            if out is not None:
                self._discard(generation, out)
            raise
        if failures:
            if out is not None:
                self._discard(generation, out)
            raise SwapError(code or _first_errno(failures),
                            "the optimizer step was not taken (parameters and state "
                            "unchanged): " + "; ".join(failures))
        intervals, waits = [], []
        source = runner = None
        signature = plan_signature(chunks, end)
        written = ahead.usable(chunks, signature, out) if ahead is not None else {}
        try:
            error = None
            try:
                source = self._open(self.live) if old is not None else None
                runner = _StepRun(self.optimizer, self._pool, self._submit, self.stats, layout,
                                  old, source, out, intervals, waits, written)
                runner.run(chunks)
            except Exception as e:      # put back already (or _UndoFailed): agreed on below
                error = e
            # Every rank takes part, whatever happened here: a rank that raised without
            # it would leave the others waiting in this collective.
            try:
                failures = agree(None if error is None else f"{type(error).__name__}: {error}",
                                 "stepped")
            except BaseException:
                # The agreement itself failed (a peer lost, Ctrl-C while waiting in it):
                # the new state is never made live, so neither are the parameters' steps.
                if error is None:
                    runner.undo(chunks)
                raise
            if error is None and failures:
                # Another rank failed: this one's step, complete on disk, is undone too.
                error = SwapError(errno.EIO, "the optimizer step was not taken on any rank "
                                  "(parameters and state unchanged): " + "; ".join(failures))
                runner.undo(chunks)
            if error is not None:
                raise error
        except BaseException as e:
            self._discard(generation, out)
            if isinstance(e, _UndoFailed):
                self._broken = str(e)
                log.error("%s", self._broken)
                raise SwapError(errno.EIO, self._broken) from e.__cause__
            if runner is not None and runner.putting_back:
                # Interrupted (a second Ctrl-C) while the parameters were put back.
                self._broken = (f"a swapped optimizer step was interrupted ({type(e).__name__}) "
                                "while its parameters were put back: the state of the last "
                                "good generation is kept, but parameters moved: restore a "
                                "commit (State.restore()) or load a checkpoint before "
                                "stepping again")
                log.error("%s", self._broken)
            raise
        finally:
            if runner is not None:
                runner.release()
            if source is not None:
                source.close()
        try:
            self._set_live(generation, layout, out)
        finally:
            out.close()
        for chunk in chunks:
            for piece in chunk:
                piece.tensor = None     # the step's views (and gradients) are not kept
        self._next_plan = chunks, signature
        busy = _length(intervals)
        waited = _length(waits)
        self.stats.io += busy
        self.stats.hidden += max(busy - _overlap(intervals, waits), 0.0)
        self.stats.wait += waited
        self.stats.steps += 1
        self.stats.total += time.perf_counter() - started
        log.debug("swapped step in %.3f s: %s", time.perf_counter() - started,
                  self.stats.as_dict())

    def write_undo_ahead(self):
        """The micro-steps of a step have begun (its first backward): write that step's undo
        copies into the spare meanwhile, on a thread (``swap_undo``). Once per step, and only
        where its plan is known (the last step's) and there is a spare."""
        if self._ahead.started or self._next_plan is None or not self._spare \
                or self._broken is not None:
            return
        chunks, signature = self._next_plan
        self._next_plan = None
        file = None
        try:
            fd = os.open(SPARE, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=self._root_fd)
            file = SwapFile(fd, os.path.join(self.root, SPARE), self._o_direct)
            ready = None
            device = next((piece.param.device for chunk in chunks for piece in chunk
                           if piece.param.is_cuda), None)
            if device is not None:
                # The last step's updates on this stream come before the copies.
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
            self._ahead.start(UndoAhead(chunks, signature, file, self._pool, self._io,
                                        self.stats, ready))
        except Exception as e:
            # Called from a backward hook: only speed is at stake (the step writes its undo
            # copies itself), never the backward (the spare removed by hand, no thread).
            if file is not None:
                file.close()
            log.debug("no undo copies written ahead: %s", e)

    def read(self, params, keys):
        """The live state of ``params`` (only ``keys`` of it), read now: {param: {key: tensor}}.
        For the noise measurement's Adam denominators, a bucket at a time."""
        layout = self.layout()
        if layout is None:
            return {}
        mapped = self._map(self.live)
        out = {}
        for p in params:
            if layout.get(p) is not None:
                out[p] = {key: value.clone() if torch.is_tensor(value) else value
                          for key, value in layout.tensors_of(p, mapped).items() if key in keys}
        return out

    def _map(self, generation):
        """``generation``'s file mapped (read lazily, private copy-on-write); an unlinked file
        stays readable while mapped."""
        layout = self._layouts[generation]
        if layout.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        file = self._open(generation)
        try:
            return torch.from_file(f"/proc/self/fd/{file.fd}", shared=False, size=layout.nbytes,
                                   dtype=torch.uint8)
        except RuntimeError as e:
            # torch names the /proc path it opened, and the errno at the end: "... in
            # read-only mode: Too many open files (24)".
            found = re.search(r"\((\d+)\)\s*$", str(e))
            code = int(found[1]) if found else errno.EIO
            raise failure(code, f"cannot map {file.name}") from e
        finally:
            file.close()

    # -- commits, restores, checkpoints, syncs ---------------------------------------------
    def commit(self):
        """Keep the live generation (as the commit's); returns its number, to restore to.
        Its undo area is cut off its file: a commit may be kept for long."""
        self._hold(self.live)
        if self.live is not None:
            # Only disk space is at stake: a file that cannot be cut is said, not raised
            # (a file gone fails where it is read, with its name).
            name = self._name(self.live)
            try:
                fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self._root_fd)
                file = SwapFile(fd, os.path.join(self.root, name), direct=False)
                try:
                    file.truncate(self._layouts[self.live].nbytes)
                finally:
                    file.close()
            except OSError as e:
                log.warning("%s; its undo area stays until this generation is dropped", e)
        return self.live

    def release(self, generation):
        """A commit of ``generation`` is superseded."""
        self._drop(generation)

    def restore(self, generation):
        """Make ``generation`` (a commit's) live again, with the layout it was written with."""
        self._set_live(generation)

    def state_tensors(self, generation=None):
        """``{param: {key: tensor}}`` of ``generation`` (default: live), the tensors mapped
        from its file, laid out as it was written: a checkpoint writes them without loading
        them first."""
        layout = self.layout(generation)
        if layout is None:
            return {}
        generation = self.live if generation is None else generation
        mapped = self._map(generation)
        self._lent.add(generation)
        # A parameter stepped without state (SGD without momentum) has none in memory
        # either: torch's state_dict leaves it out.
        return {entry.param: layout.tensors_of(entry.param, mapped) for entry in layout.params
                if entry.entries or entry.plain}

    def load(self, states):
        """Write ``states`` ({param: {key: tensor or value}}, e.g. a checkpoint's, mapped)
        into a new live generation, a buffer at a time."""
        specs = []
        for p in self._params():
            if p not in states:
                continue
            known = {key: on_device for key, _, _, on_device in self._makeup(p).tensors}
            tensors, plain = [], {}
            for key, value in states[p].items():
                if torch.is_tensor(value):
                    elementwise = tuple(value.shape) == tuple(p.shape)
                    # As torch's load_state_dict: state but the step takes the parameter's
                    # dtype (an fp32 checkpoint resumed in bf16), or the step would raise.
                    dtype = p.dtype if key != "step" and p.is_floating_point() \
                        else value.dtype
                    tensors.append((key, dtype, None if elementwise else value.shape,
                                    known.get(key, elementwise and p.device.type != "cpu")))
                else:
                    plain[key] = value
            specs.append((p, tensors, plain))
        layout = Layout(specs)

        def fill(entry, param, target, start, size):
            flat = states[param][entry.key].detach().reshape(-1)
            if flat.dtype != entry.dtype:
                # Cast a request's worth at a time: a mapped checkpoint is never read whole.
                width = entry.element_size
                flat = flat[start // width:(start + size) // width].to(entry.dtype)
                start = 0
            target.copy_(flat.view(torch.uint8)[start:start + size])

        self._write_all(layout, fill)

    def layout_dump(self):
        """The live layout, picklable and rank-neutral (None without state)."""
        layout = self.layout()
        if layout is None:
            return None
        return layout.dump({p: i for i, p in enumerate(self._params())})

    def adopt_layout(self, dump):
        """Take root's live layout (from :meth:`layout_dump`) before a broadcast."""
        self._incoming = None if dump is None else Layout.load(dump, self._params())

    def broadcast_chunks(self, root, broadcast_bytes, agree=None):
        """Collective: every rank's live state becomes ``root``'s, a buffer at a time
        (``broadcast_bytes(data, name)`` sends bytes from the root). ``agree`` as for
        :meth:`step`: a rank that cannot make its new file, or read or write a region, says
        so and still takes part in every broadcast, so no rank waits for one that left;
        then every rank raises and keeps its state as it was."""
        agree = agree or _alone
        self._ahead.take()
        layout = self.layout() if root else self._incoming
        self._incoming = None
        if layout is None:
            if self.live is not None:
                self._drop(self.live)
                self.live = None
            self._broken = None
            return
        generation = out = source = error = None
        try:
            generation, out = self._create(layout.nbytes)
            source = self._open(self.live) if root else None
        except OSError as e:
            error = e
        buffer = None
        try:
            failures = agree(None if error is None else str(error), "sync-reserved")
            if not failures:
                buffer = self._pool.take()
                # The layouts are alike: so are the files, region by region.
                for start in range(0, layout.nbytes, self.buffer_bytes):
                    size = min(self.buffer_bytes, layout.nbytes - start)
                    data = None
                    if root:
                        if error is None:
                            try:
                                source.read(buffer.memory(0, size), start)
                            except OSError as e:
                                error = e
                        data = bytes(buffer.memory(0, size))
                    data = broadcast_bytes(data,
                                           f"hvd_adapt.swap.region{start // self.buffer_bytes}")
                    if error is None:
                        if not root:
                            buffer.bytes[:size].copy_(torch.frombuffer(bytearray(data),
                                                                       dtype=torch.uint8))
                        try:
                            out.write(buffer.memory(0, size), start)
                        except OSError as e:
                            error = e
                failures = agree(None if error is None else str(error), "sync-written")
            if failures:
                code = getattr(error, "errno", None) or _first_errno(failures)
                raise SwapError(code, "the optimizer state was not synced (the state is as "
                                "it was): " + "; ".join(failures))
        except BaseException:
            if out is not None:
                self._discard(generation, out)
            raise
        finally:
            if buffer is not None:
                self._pool.give_back(buffer)
            if source is not None:
                source.close()
        try:
            self._set_live(generation, layout, out)
        finally:
            out.close()

    def _write_all(self, layout, fill):
        """A new live generation of ``layout``, each entry written a request at a time with
        what ``fill(entry, param, target, start, size)`` puts in ``target`` (``size`` bytes of
        the entry from ``start``), through :meth:`_stream`."""
        self._ahead.take()
        generation, out = self._create(layout.nbytes)
        slot = self._slot_bytes()

        def tasks():
            for param_layout in layout.params:
                for entry in param_layout.entries:
                    for start in range(0, entry.nbytes, slot):
                        size = min(slot, entry.nbytes - start)
                        yield entry.offset + start, size, \
                            lambda target, e=entry, p=param_layout.param, s=start, n=size: \
                            fill(e, p, target, s, n)
        try:
            self._stream(out, tasks(), write=True)
        except BaseException:
            self._discard(generation, out)
            raise
        try:
            self._set_live(generation, layout, out)
        finally:
            out.close()

    def move_bytes(self, write):
        """Move the live generation's size through the pool as :meth:`load` moves it: read
        the live file, or write a scratch file that is then removed. Returns the bytes
        moved. For benchmarks/optimizer_swap.py: the swapper's own disk speed, without the
        optimizer."""
        self._ahead.take()
        layout = self.layout()
        if layout is None:
            return 0
        if write:
            generation, file = self._create(layout.nbytes)
        else:
            generation, file = None, self._open(self.live)
        slot = self._slot_bytes()
        try:
            self._stream(file, ((start, min(slot, layout.nbytes - start), None)
                                for start in range(0, layout.nbytes, slot)), write)
        finally:
            if generation is not None:
                self._discard(generation, file)
            else:
                file.close()
        return layout.nbytes

    def _slot_bytes(self):
        return min(IO_BYTES, self.buffer_bytes)

    def _stream(self, file, tasks, write):
        """The one pipeline of whole-file transfers: ``tasks`` (``[(file offset, bytes,
        fill or None)]``, each at most a slot) move between ``file`` and the pool's buffers,
        cut into request-sized slots. A slot is given its next request as soon as its own
        request completes (not when a whole buffer's do), so the I/O threads always have
        requests queued, as raw I/O at the same concurrency has. ``fill(target)`` puts a
        write's bytes in its slot first; what a read brings is not kept. Every buffer goes
        back to the pool after every request that uses it has finished."""
        slot = self._slot_bytes()
        buffers = [self._pool.take() for _ in range(BUFFERS)]
        idle = [(buffer, start) for buffer in buffers
                for start in range(0, buffer.nbytes - slot + 1, slot)]
        busy = {}
        call = file.write if write else file.read
        try:
            for offset, nbytes, fill in tasks:
                if not idle:
                    done, _ = concurrent.futures.wait(
                        busy, return_when=concurrent.futures.FIRST_COMPLETED)
                    for future in done:
                        future.result()
                        idle.append(busy.pop(future))
                buffer, start = idle.pop()
                if fill is not None:
                    fill(buffer.bytes[start:start + nbytes])
                busy[self._io.submit(call, buffer.memory(start, aligned(nbytes)), offset)] = \
                    (buffer, start)
            for future in concurrent.futures.as_completed(list(busy)):
                future.result()
        finally:
            concurrent.futures.wait(busy)
            for buffer in buffers:
                self._pool.give_back(buffer)

    def remove_stale(self):
        """Remove the swap folders in swap_dir whose owner is gone (their lock is free): a
        crash, or a worker Horovod removed from an elastic job. Their files are never read,
        and would fill the disk. Folders in use, by any process or container, are kept."""
        remove_unlocked_folders(self._directory, PREFIX)

    def close(self):
        """Remove the files, free the buffers, and remove the folders of owners that are
        gone (also when the optimizer is collected, and at interpreter exit)."""
        self._finalizer()


class _UndoFailed(Exception):
    """A failed step's parameters could not all be put back (a second failure)."""


class _StepRun:
    """One swapped step's pipeline over its chunks; every buffer it takes goes back to the
    pool on every path, after every request that uses it has finished."""

    def __init__(self, optimizer, pool, submit, stats, layout, old, source, out, intervals,
                 waits, written):
        self.optimizer, self.pool, self.submit, self.stats = optimizer, pool, submit, stats
        self.layout, self.old = layout, old
        self.source, self.out = source, out
        self.written = written      # chunk index -> fingerprints of its copies written ahead
        self.intervals, self.waits = intervals, waits
        self.applied = 0
        self.first_state = {}       # param -> its first piece's non-elementwise state
        self.buffers = []           # taken by run(), given back by release()
        self.held = {}              # chunk index -> the buffer still holding its undo copy
        self.putting_back = False   # undo() under way, or interrupted part-way

    def run(self, chunks):
        """Step every chunk. On an error, the parameters of the chunks already stepped get
        their values from before the step back (:meth:`undo`) before it is raised.

        Reads run as far ahead as the pool allows: every buffer that is neither being
        stepped nor written holds a read of a chunk to come, and a buffer whose write has
        finished takes the next read at once, so reads and writes stay in flight together
        while the optimizer computes. The buffers stay taken until :meth:`release`: the
        last chunks' undo copies are only in them until the ranks agree."""
        for _ in range(BUFFERS):
            self.buffers.append(self.pool.take())
        idle = list(self.buffers)
        reading, writing = {}, []   # chunk index -> (buffer, transfer); [(buffer, transfer)]
        held = self.held
        following = 0               # the next chunk to read
        try:
            for i, chunk in enumerate(chunks):
                while following < len(chunks):
                    # Finished writes give their buffers back first, in order, without
                    # waiting; only the read of the chunk about to step waits for one.
                    while writing and (writing[0][1].done() or not idle and following == i):
                        done, written = writing.pop(0)
                        self.stats.write += self._wait(written)
                        idle.append(done)
                    if not idle:
                        break
                    buffer = idle.pop()
                    # The read overwrites the undo copy a chunk stepped in this buffer held.
                    for k in [k for k, b in held.items() if b is buffer]:
                        del held[k]
                    reading[following] = (buffer, self._read(chunks[following], buffer))
                    following += 1
                buffer, transfer = reading.pop(i)
                self.stats.read += self._wait(transfer)
                self.stats.bytes_read += sum(n for _, _, n in self._reads(chunk))
                held[i] = buffer
                self._step(chunk, buffer)
                # Every chunk is read already: no read will take this buffer, so its undo
                # copy stays in memory until the step ends and need not go to disk; nor
                # where it went to disk ahead, of the values the step moved.
                runs = self._writes(chunk, undo=following < len(chunks)
                                    and not self._written_ahead(i, chunk, buffer))
                self.stats.bytes_written += sum(n for _, _, n in runs)
                writing.append((buffer, self.submit(self.out, buffer, runs, True,
                                                    self.intervals)))
            while writing:
                done, written = writing.pop(0)
                self.stats.write += self._wait(written)
        except BaseException:
            # Every request finished before a buffer is read again or given back.
            self._settle(reading, writing)
            reading, writing = {}, []
            self.undo(chunks)
            raise
        finally:
            self._settle(reading, writing)

    def _written_ahead(self, i, chunk, buffer):
        """Whether chunk ``i``'s undo copy was written ahead (``swap_undo``) of the values its
        undo copy in ``buffer`` holds: their fingerprints agree."""
        expected = self.written.get(i)
        if expected is None:
            return False
        began = time.perf_counter()
        now = [fingerprint(buffer.bytes, piece.undo.buffer_offset, piece.undo.nbytes)
               for piece in chunk]
        self.stats.copy += time.perf_counter() - began
        if now != expected:
            return False
        self.stats.ahead_used += sum(aligned(piece.undo.nbytes) for piece in chunk)
        return True

    def release(self):
        """Give the buffers back to the pool (every request using them has finished)."""
        for buffer in self.buffers:
            self.pool.give_back(buffer)
        self.buffers, self.held = [], {}

    @staticmethod
    def _settle(reading, writing):
        for _, transfer in list(reading.values()) + writing:
            transfer.settle()

    def undo(self, chunks):
        """Give the parameters of the chunks stepped their values from before the step: from
        the buffer that still holds a chunk's undo copy, else read back from the new
        generation's undo area, where its write (or the copies written ahead) put it.
        Raises :class:`_UndoFailed` where that read fails (the parameters are then
        half-stepped)."""
        self.putting_back = True    # until every chunk is back: an interrupt leaves it set
        held = self.held
        for i, buffer in held.items():
            if i < self.applied:
                self._put_back(chunks[i], buffer)
        # Put back from memory first: then every buffer is free to read into.
        for i in range(self.applied):
            if i in held:
                continue
            scratch = self.buffers[0]
            runs = segments(chunks[i], lambda piece, slot: None,
                            undo=lambda piece: piece.undo.file_offset)
            try:
                for file_offset, _, nbytes in runs:
                    self.out.check_written(file_offset, nbytes)
                self.submit(self.out, scratch, runs, False, []).wait()
            except BaseException as e:
                raise _UndoFailed(
                    f"a swapped optimizer step failed, and the values of the parameters of "
                    f"chunk {i + 1} of {len(chunks)} could not be read back ({e}): the "
                    "state of the last good generation is kept, but parameters moved: "
                    "restore a commit (State.restore()) or load a checkpoint before "
                    "stepping again") from e
            self._put_back(chunks[i], scratch)
        self.putting_back = False

    @staticmethod
    def _put_back(chunk, buffer):
        for piece in chunk:
            slot = piece.undo
            piece.values().copy_(buffer.view(slot.buffer_offset, piece.param.dtype, slot.shape))

    def _wait(self, transfer):
        began = time.perf_counter()
        try:
            return transfer.wait()
        finally:
            self.waits.append((began, time.perf_counter()))

    def _reads(self, chunk):
        if self.old is None:
            return []

        def where(piece, slot):
            kept = self.old.get(piece.param)
            entry = None if kept is None else \
                next((e for e in kept.entries if e.key == slot.entry.key), None)
            if entry is None:
                return None     # no state before (new to the layout, or its key is)
            return entry.offset + (slot.file_offset - slot.entry.offset)

        return segments(chunk, where)

    def _writes(self, chunk, undo):
        return segments(chunk, lambda piece, slot: slot.file_offset
                        if piece.first or slot.entry.elementwise else None,
                        undo=(lambda piece: piece.undo.file_offset) if undo else None)

    def _read(self, chunk, buffer):
        return self.submit(self.source, buffer, self._reads(chunk), False, self.intervals)

    def _step(self, chunk, buffer):
        """Step ``chunk``'s pieces with their state as views of ``buffer``; then put the state
        the optimizer holds for them back into ``buffer``, checked against the layout."""
        optimizer = self.optimizer
        state = optimizer.state
        groups = optimizer.param_groups
        saved = [group["params"] for group in groups]
        flat_grads = {}
        copying = time.perf_counter()
        for piece in chunk:
            p = piece.param
            # The undo copy: the values this step may move, put back if any chunk fails.
            buffer.view(piece.undo.buffer_offset, p.dtype, piece.undo.shape) \
                .copy_(piece.values())
            if piece.whole:
                piece.tensor = p
            else:
                piece.tensor = p.detach().view(-1)[piece.start:piece.stop]
                if p.grad is not None:
                    if p not in flat_grads:
                        flat_grads[p] = p.grad.reshape(-1)
                    piece.tensor.grad = flat_grads[p][piece.start:piece.stop]
            kept = self.old.get(p) if self.old is not None else None
            if kept is not None:
                values = dict(kept.plain)
                known = {entry.key for entry in kept.entries}
                for slot in piece.slots:
                    if slot.entry.key not in known:
                        continue        # state the optimizer makes at this step
                    view = buffer.view(slot.buffer_offset, slot.entry.dtype, slot.shape)
                    device = p.device if slot.entry.on_device else view.device
                    if slot.entry.elementwise and not p.is_contiguous():
                        # The file keeps the state in the parameter's element order; a fused
                        # kernel walks memory and pairs state and parameter by address, so
                        # the state gets the parameter's strides (channels_last) as in memory.
                        view = torch.empty_like(p, dtype=slot.entry.dtype, device=device) \
                            .copy_(view, non_blocking=True)
                    values[slot.entry.key] = view.to(device, non_blocking=True)
                state[piece.tensor] = values
        self.stats.copy += time.perf_counter() - copying
        try:
            for g, group in enumerate(groups):
                group["params"] = [piece.tensor for piece in chunk if piece.group == g]
            stepping = time.perf_counter()
            # Counted before: a step that raises may have moved some parameters already.
            self.applied += 1
            optimizer.step()
            self.stats.step += time.perf_counter() - stepping
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
            states = {id(piece): state.pop(piece.tensor, None) for piece in chunk}
        evicting = time.perf_counter()
        self._evict(chunk, buffer, states)
        self.stats.copy += time.perf_counter() - evicting

    def _evict(self, chunk, buffer, states):
        moves, cuda = [], False
        base = buffer.bytes.data_ptr()
        for piece in chunk:
            values = states[id(piece)]
            planned = {slot.entry.key: slot for slot in piece.slots}
            if values is None:
                if planned:
                    raise RuntimeError(f"hvd_adapt swap: the optimizer dropped the state of "
                                       f"{piece.label()}")
                continue
            tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
            plain = {k: v for k, v in values.items() if not torch.is_tensor(v)}
            if set(tensors) != set(planned):
                raise RuntimeError(
                    f"hvd_adapt swap: the optimizer keeps state {sorted(tensors)} for "
                    f"{piece.label()}, not the {sorted(planned)} its layout was planned with")
            for key, value in tensors.items():
                slot = planned[key]
                if value.dtype != slot.entry.dtype or value.numel() * slot.entry.element_size \
                        != slot.nbytes:
                    raise RuntimeError(
                        f"hvd_adapt swap: the optimizer's state {key!r} of {piece.label()} is "
                        f"{value.dtype} x {value.numel()}, not the planned {slot.entry.dtype} "
                        f"of {slot.nbytes} bytes")
            self._check_pieces_agree(piece, tensors, plain)
            for key, value in tensors.items():
                slot = planned[key]
                target = buffer.view(slot.buffer_offset, slot.entry.dtype, slot.shape)
                if value.data_ptr() == target.data_ptr():
                    continue
                if not value.is_cuda and base <= value.data_ptr() < base + buffer.nbytes:
                    value = value.clone()   # it lies in the buffer where another goes
                moves.append((target, value.reshape(slot.shape)))
        for target, value in moves:
            cuda = cuda or value.is_cuda
            target.copy_(value, non_blocking=value.is_cuda)
        if cuda:
            torch.cuda.synchronize()        # the buffer is written to disk next

    def _check_pieces_agree(self, piece, tensors, plain):
        """The pieces of a parameter must leave its non-elementwise state (a step count,
        plain values) alike: the one check that stepping it in pieces was the same as
        stepping it whole."""
        small = {key: value.detach().to("cpu", copy=True) for key, value in tensors.items()
                 if not next(s for s in piece.slots if s.entry.key == key).entry.elementwise}
        if piece.first:
            self.first_state[piece.param] = (small, plain)
            self.layout.get(piece.param).plain = dict(plain)
            return
        first_small, first_plain = self.first_state[piece.param]
        if plain != first_plain or any(not torch.equal(value, first_small[key])
                                       for key, value in small.items()):
            raise RuntimeError(
                f"hvd_adapt swap: the pieces of {piece.label()} disagree on their "
                "non-elementwise state: the optimizer does not step it elementwise")


class _HeldFiles(dict):
    """generation -> descriptor (a dict that a fork handler can refer to weakly)."""

    def close_all(self):
        for fd in self.values():
            os.close(fd)
        self.clear()


def _forget_in_child(held):
    """After a fork, in the child: close the descriptors the parent holds on its
    generations (``held``: a weak reference to its :class:`_HeldFiles`)."""
    held = held()
    if held is not None:
        held.close_all()


def _alone(message, what):
    """The agreement of a single process: its own failure, if any."""
    return [message] if message else []


def _first_errno(failures):
    """The errno the first of the ranks' ``failures`` names (``(errno ENAME)``, as
    :func:`swap_io.failure` says it), so that every rank raises alike; EIO where none does."""
    for failure in failures:
        found = re.search(r"\(errno (E[A-Z0-9]+)\)", failure)
        if found and hasattr(errno, found[1]):
            return getattr(errno, found[1])
    return errno.EIO


def _close(ahead, pool, io, held, root, root_fd, directory, owner):
    if os.getpid() != owner:
        # A forked child that exits normally runs finalizers too: the folder is its parent's.
        return
    ahead.take()        # its thread uses the pool and the I/O threads
    io.shutdown(wait=True)
    pool.release()
    held.close_all()
    shutil.rmtree(root, ignore_errors=True)
    os.close(root_fd)
    # A worker Horovod removed from the job ends without its clean-up: the last to leave
    # takes its folder too.
    remove_unlocked_folders(directory, PREFIX)


def _features(group):
    """Which of a param group's hyper-parameters are on: a number by whether it is 0, any
    other value as itself (hashable)."""
    def on(value):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, (int, float)) or torch.is_tensor(value) and value.numel() == 1:
            return float(value) != 0.0
        if isinstance(value, (tuple, list)):
            return tuple(on(v) for v in value)
        return repr(value)
    return tuple(sorted((key, on(value)) for key, value in group.items() if key != "params"))


def _merged(intervals):
    out = []
    for begin, end in sorted(intervals):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def _length(intervals):
    return sum(end - begin for begin, end in _merged(intervals))


def _overlap(a, b):
    """Seconds covered by both sets of intervals."""
    total, b = 0.0, _merged(b)
    for begin, end in _merged(a):
        for other_begin, other_end in b:
            total += max(0.0, min(end, other_end) - max(begin, other_begin))
    return total


def _numel(shape):
    count = 1
    for size in shape:
        count *= size
    return count

