"""A commit's tensor copies: which are made at once, which after the commit returns (a thread
on the CPU, a side stream on CUDA), and the check that each one holds the committed value
before anything may write its source.

What writes the tensors of a State between a commit and the next one decides when each
is copied:

- an optimizer's parameters and state: only its step, so their copies run during the
  next forward and backward, and the step waits for them (a step pre-hook on every
  optimizer the State carries);
- other parameters (an EMA's copy of the model, frozen layers): an EMA's update after
  the step, also after a step a GradScaler skipped, so their copies run during the next
  forward, copied first, and the forward's end waits for them (a forward hook on every
  module the State carries);
- everything else (BatchNorm's statistics change in the next forward; a GradScaler's, a
  scheduler's, a loader's state is small) before ``commit()`` returns.

A ``load_state_dict`` of a carried module or optimizer waits for all of them, as does
whatever reads the snapshot or writes the live state (the next commit, a restore, a
sync, a checkpoint, ``State.wait_for_commit()``).

What may still write a copied tensor in its window (a parameter changed by hand before
the step, an EMA updated before the forward) is found at the wait, not trusted: each
deferred source must still carry the version counter it had at the commit (torch's count
of in-place writes; the source is held, so its address is its own), and on the CPU a
fingerprint of its values taken at the commit (elements spread over it, bit for bit; a
rotating share of the tensors each commit) must be what the copy holds. Writes through
``.data`` (which has a version counter of its own) are seen only by the fingerprint, so
only on the CPU, and only for the tensors fingerprinted that commit (every tensor within
a few commits: a script that does it at every step is caught within a few steps).
Either failure raises :class:`CommitCopyError` naming the value and the tensor: the
snapshot is never silently a mix of two steps. A copy that itself failed (out of memory
on the thread) is made again at the wait, from sources the same check shows unchanged.

Every tensor is copied at every commit, frozen ones too: nothing short of reading all of
it shows a tensor unchanged since the last commit (a write through ``.data`` leaves its
version counter as it was, and a fingerprint is a sample), and a copy skipped on a wrong
guess would restore a stale value without a word. The copies run while the next forward
does, so what they cost is memory bandwidth, not the step. Tied weights (one tensor under two names) are copied
once. On the CPU the copying thread copies between numpy views of each source and its
buffer, and the next commit reuses them wherever its copy is into the same buffer from the
same memory (a tensor given new memory gets new ones): making them was most of what a small
tensor's copy cost, and a transformer's commit has thousands.
"""
import atexit
import queue
import threading
import time
import weakref

import numpy as np
import torch


#: Elements compared by a fingerprint (evenly spread over the tensor).
FINGERPRINT_ELEMENTS = 16
#: Deferred copies whose fingerprint a commit checks, in turn (a fingerprint costs a few
#: microseconds; a transformer's parameters and optimizer state are hundreds of tensors):
#: a script that writes a tensor through ``.data`` in that window at every step is caught
#: within a few steps.
FINGERPRINTS_PER_COMMIT = 32


class CommitCopyError(RuntimeError):
    """A tensor a commit copied after returning was written before its copy was made."""


_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _integers(tensor):
    """``tensor``'s bits as integers of its element size (NaN equal to itself, -0.0 not to
    0.0: a fingerprint compares bits, not values)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor if not tensor.dtype.is_floating_point and tensor.dtype != torch.bool \
        else tensor.view(_INTEGERS[tensor.element_size()])


def _dense_flat(tensor):
    """``tensor``'s memory as a 1-D integer view, where it is dense in some order of its
    dimensions (contiguous, channels_last); None where it is not."""
    bits = _integers(tensor.detach())
    if bits.is_contiguous():
        return bits.view(-1)
    order = sorted(range(bits.dim()), key=lambda d: (-bits.stride(d), -bits.size(d)))
    dense = bits.permute(order)
    return dense.view(-1) if dense.is_contiguous() else None


def fingerprint(tensor):
    """Up to :data:`FINGERPRINT_ELEMENTS` of ``tensor``'s elements spread over it, as bits (a
    numpy array). CPU tensors only: on a device, reading them would wait for it."""
    flat = _dense_flat(tensor)
    if flat is None:
        flat = _integers(tensor.detach()).reshape(-1)
    flat = flat.numpy()
    return flat[::max(flat.size // FINGERPRINT_ELEMENTS, 1)].copy()


def _copy_now(dst, src):
    # On the training thread torch's copy is the one (its thread pool is that thread's).
    dst.copy_(src, non_blocking=dst.is_cuda != src.is_cuda)


def _numpy_views(dst, src):
    """``(dst, src)`` as numpy arrays of raw integers that one ``np.copyto`` copies: numpy,
    not torch, because torch's copy on another thread starts an OpenMP team of its own that
    spins on the cores the training thread uses (and numpy's is the faster memcpy); raw
    integers because numpy has no bfloat16."""
    flat_dst, flat_src = _dense_flat(dst), _dense_flat(src)
    if flat_dst is not None and flat_src is not None and dst.stride() == src.stride():
        return flat_dst.numpy(), flat_src.numpy()
    return _integers(dst).numpy(), _integers(src.detach()).numpy()


def _copy_on_cpu(copy):
    """A deferred copy, on the copying thread: through the numpy views of the last commit's
    copy into the same buffer where both the buffer and the source are still at the
    addresses the views show, with the same layout (views show addresses, so that is all a
    view needs to show the same bytes)."""
    last, copy.last = copy.last, None
    where = (copy.dst.data_ptr(), copy.src.data_ptr())
    if last is not None and last.views is not None and last.dst is copy.dst \
            and last.where == where and last.src.shape == copy.src.shape \
            and last.src.stride() == copy.src.stride() and last.src.dtype == copy.src.dtype:
        copy.views = last.views
    else:
        copy.views = _numpy_views(copy.dst, copy.src)
    copy.where = where
    np.copyto(*copy.views)


def label_text(label):
    """A value's name in errors from its label: a string, or a ``(parent label, key)`` pair
    for an item of a dict (``name['key']``) or a list (``name[0]``)."""
    keys = []
    while isinstance(label, tuple):
        label, key = label
        keys.append(f"[{key!r}]")
    return label + "".join(reversed(keys))


class _Copy:
    """One tensor of a commit: its buffer, its source, what the source was at the commit."""

    __slots__ = ("dst", "src", "version", "print", "label", "on_cpu", "views", "where",
                 "last")

    def __init__(self, dst, src, label, check=False, last=None):
        self.dst, self.src, self.label = dst, src, label
        self.version = src._version
        self.on_cpu = not (dst.is_cuda or src.is_cuda)
        self.print = fingerprint(src) if check and self.on_cpu else None
        self.views = None      # CPU: the numpy arrays the copying thread copied between,
        self.where = None      # and the addresses of dst and src they show
        self.last = last       # the last commit's copy into the same buffer, if any

    def holds_commit(self):
        """The buffer holds the source's commit-time fingerprint (where one was taken)."""
        return self.print is None or np.array_equal(fingerprint(self.dst), self.print)


#: The phases of a commit's deferred copies, in the order they are made and waited for.
FORWARD, STEP = 0, 1


class _Phase:
    """The copies a commit left for after it returned that one wait point needs."""

    def __init__(self, copies):
        self.copies = copies
        self.cpu = [c for c in copies if c.on_cpu]
        self.device = [c for c in copies if not c.on_cpu]
        self.done = threading.Event()
        self.failure = None
        self.checked = False   # waited for (the device's copies: ordered) and checked
        self.event = None      # CUDA: recorded on the side stream after its device copies
        self.thread_seconds = 0.0   # the copying thread's CPU time on these copies


class CommitCopies:
    """The copies of one State's commits (see the module's docstring).

    ``copy(dst, src, label, deferred)`` during a save, between :meth:`begin` and
    :meth:`launch`; :meth:`wait` before the live state is written or the snapshot read.
    """

    def __init__(self):
        self._sources = {}        # this save's sources by storage -> the buffer they fill
        self._later = None        # this save's deferred copies, by phase
        self._step_written = ()
        self._turn = 0            # which deferred copies' fingerprints this commit checks
        self._stride = 1
        self._phases = []         # the last commit's phases not yet waited for
        self._device_now = False  # this save copied from or to a device before returning
        self._host_events = []    # CUDA: what a host read of the snapshot must wait for
        self._queue = None
        self._stream = None
        # The last checked commit's CPU copies by their buffer (id: each holds its buffer):
        # a model's tensors are the same from one commit to the next, and making the numpy
        # views is most of a small tensor's copy (a transformer's commit has thousands).
        self._last = {}
        self._made = []           # CPU copies checked since the last commit began
        self._seconds = 0.0       # what the deferred copies cost since take_seconds()

    # -- a commit --------------------------------------------------------------------
    def begin(self, step_written=(), defer=True):
        """A save starts: the previous one's copies are finished and checked first.
        ``step_written``: storage addresses that only an optimizer step writes (its
        parameters and state); ``defer=False``: this save makes every copy before it
        returns."""
        # Copies made since are ordered after these (the thread's are done and checked; on a
        # device, its streams wait for them): no wait for the device.
        self.wait(host=False)
        self._phases = []
        self._device_now = False
        self._step_written = step_written
        self._later = ([], []) if defer else None
        self._sources = {}
        self._last = {id(c.dst): c for c in self._made}
        self._made = []

    def copy(self, dst, src, label, deferred):
        """Fill ``dst`` from ``src`` for this commit: now, or after the commit returns where
        ``deferred`` (a parameter or an optimizer's state). ``label`` names the value in
        errors: a string, or ``(parent label, key)`` pairs (see :func:`label_text`), which
        are formatted only when an error needs them.

        This runs for every tensor of the State at every commit, on the training thread:
        it does only what each tensor needs (a model has hundreds, and with its
        optimizer's moments and step counts a transformer's commit passes here thousands
        of times)."""
        # An alias of the source as it is now: a tensor given new memory before its copy
        # is made (``.data =``, ``set_()``) is still copied from what it held at the commit.
        src = src.detach()
        ptr = src.data_ptr()
        if ptr:
            seen = self._sources.get(ptr)
            if seen is None:
                self._sources[ptr] = [(src, dst)]
            else:
                for other, other_dst in seen:
                    if other.shape == src.shape and other.stride() == src.stride() \
                            and other.dtype == src.dtype and other.device == src.device:
                        # Tied weights (one tensor under two names): one copy, shared.
                        return other_dst
                seen.append((src, dst))
        if deferred and self._later is not None:
            phase = self._later[STEP if ptr in self._step_written else FORWARD]
            check = (len(phase) + self._turn) % self._stride == 0
            phase.append(_Copy(dst, src, label, check, self._last.get(id(dst))))
        else:
            _copy_now(dst, src)
            self._device_now = self._device_now or dst.is_cuda or src.is_cuda
        return dst

    def launch(self):
        """The save is done: start the deferred copies (the forward's first)."""
        later, self._later = self._later or ([], []), None
        self._sources, self._step_written = {}, ()
        self._turn += 1
        self._stride = max(1, -(-sum(map(len, later)) // FINGERPRINTS_PER_COMMIT))
        phases = [_Phase(copies) for copies in later]
        if self._device_now or any(phase.device for phase in phases):
            self._host_events = [torch.cuda.Event()]
            self._host_events[0].record()      # the copies made on the current stream
        if any(phase.device for phase in phases):
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for phase in phases:
                    for c in phase.device:
                        c.dst.copy_(c.src, non_blocking=True)
                    phase.event = torch.cuda.Event()
                    phase.event.record(stream)
            self._host_events.append(phases[-1].event)
        if any(phase.cpu for phase in phases):
            self._worker().put(phases)
        else:
            for phase in phases:
                phase.done.set()
        self._phases = phases if any(phase.copies for phase in phases) else []

    # -- waits -----------------------------------------------------------------------
    @property
    def pending(self):
        return bool(self._phases or self._host_events)

    def take_seconds(self):
        """What the deferred copies checked since the last call cost: the training thread's
        time waiting for them and the copying thread's CPU time (a snapshot budget's
        charge, see snapshot_budget.py)."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def wait(self, until=STEP, host=True):
        """Finish the last commit's deferred copies up to phase ``until`` (:data:`FORWARD`:
        those of parameters no optimizer steps) and check them. ``host=False`` (at a
        forward's end, before a step) orders the device's later work after its copies
        without waiting for the device; a wait with ``host=True`` (before the snapshot is
        read) waits for it. Raises :class:`CommitCopyError` if a source was written before
        its copy was made."""
        for phase in self._phases[:until + 1]:
            if not phase.checked:
                self._finish(phase)
        if not host or until < STEP:
            return
        start = time.perf_counter()
        for event in self._host_events:
            event.synchronize()
        self._seconds += time.perf_counter() - start
        self._host_events = []
        self._phases = []

    def _finish(self, phase):
        start = time.perf_counter()
        phase.done.wait()
        self._seconds += time.perf_counter() - start + phase.thread_seconds
        changed = [c for c in phase.copies if c.src._version != c.version]
        if phase.failure is not None and not changed:
            # The thread failed part-way, and no source was written since the commit
            # (checked): the copies are made again here.
            for c in phase.cpu:
                _copy_now(c.dst, c.src)
        if not changed:
            changed = [c for c in phase.cpu if not c.holds_commit()]
        if changed:
            self._phases = []
            names = ", ".join(label_text(c.label) for c in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise CommitCopyError(
                f"{names}{more} changed after state.commit() while the commit was copying it "
                "(until the next forward's end, or an optimizer's step for what it steps): "
                "the commit's copy would mix two steps. Change it after the step (as an "
                "EMA's update does), or before the commit, or call state.wait_for_commit() "
                "first")
        phase.checked = True
        self._made.extend(c for c in phase.cpu if c.views is not None)
        if phase.event is not None:
            torch.cuda.current_stream().wait_event(phase.event)

    # -- where the copies run --------------------------------------------------------
    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _worker(self):
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            thread = threading.Thread(target=_copy_phases, args=(self._queue,), daemon=True,
                                      name="hvd_adapt-commit-copies")
            thread.start()
            # The thread holds only its queue: it ends when these copies are collected, or
            # at the interpreter's exit after its last copy (a daemon thread still copying
            # while the interpreter finalises aborts the process: "terminate called without
            # an active exception").
            weakref.finalize(self, self._queue.put, None)
            atexit.register(_stop, self._queue, thread)
        return self._queue


def _stop(jobs, thread):
    jobs.put(None)
    thread.join()


def _copy_phases(jobs):
    while True:
        phases = jobs.get()
        if phases is None:
            return
        for phase in phases:
            start = time.thread_time()
            try:
                for c in phase.cpu:
                    _copy_on_cpu(c)
            except BaseException as e:     # made again, checked, at the wait
                phase.failure = e
            finally:
                phase.thread_seconds = time.thread_time() - start
                phase.done.set()
