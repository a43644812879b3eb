"""A commit's tensor copies: which are made at once, which after the commit returns (a thread
on the CPU, a side stream on CUDA), which are skipped as unchanged, and the check that each
one holds the committed value before anything may write its source.

Between a commit and the next optimizer step, the parameters and the optimizer's state
are only read (forward and backward read the parameters; nothing reads the state), so
they are copied while the next forward and backward run; every other tensor (BatchNorm's
statistics change in the next forward, a GradScaler's scale, a scheduler's) is copied
before ``commit()`` returns. The step waits for the copies (a step pre-hook on every
optimizer the State carries, also a load_state_dict pre-hook on them and on every module),
and so does anything that reads the snapshot or writes the live state (the next commit,
a restore, a sync, a checkpoint).

What may still write a copied tensor in that window (a parameter changed by hand before
the step, an EMA updated before the step instead of after it) is found at the wait, not
trusted: each deferred source must still be the same tensor at the same address with the
same version counter (torch's count of in-place writes), and on the CPU a fingerprint of
its values taken at the commit (a few elements spread over it, bit for bit) must be what
the copy holds. Writes through ``.data`` (which has a version counter of its own) are
seen only by the fingerprint, so only on the CPU. Either failure raises
:class:`CommitCopyError` naming the value and the tensor: the snapshot is never silently
a mix of two steps. A copy that itself failed (out of memory on the thread) is made again
at the wait, from sources that the same check shows unchanged.

A tensor is skipped when its source is the one copied last time (same storage, shape and
strides, held since, so its address cannot be another tensor's) with the same version
counter and fingerprint: frozen parameters, an EMA updated every k steps, constant
buffers. A write through ``.data`` that changes none of the fingerprint's elements is
missed there; the fingerprint spreads over the whole tensor so that an update of every
element (an optimizer's, an EMA's) cannot be.
"""
import queue
import threading
import weakref

import numpy as np
import torch

from .._runtime.collective import bitwise_view

#: Elements compared by a fingerprint (evenly spread over the tensor).
FINGERPRINT_ELEMENTS = 16
#: Deferred copies whose fingerprint a commit checks, in turn (a fingerprint costs a few
#: microseconds; a transformer's parameters and optimizer state are hundreds of tensors):
#: a script that writes a tensor through ``.data`` in that window at every step is caught
#: within a few steps.
FINGERPRINTS_PER_COMMIT = 32


class CommitCopyError(RuntimeError):
    """A tensor a commit copied after returning was written before its copy was made."""


def _dense_flat(tensor):
    """``tensor``'s memory as a 1-D integer view, where it is dense in some order of its
    dimensions (contiguous, channels_last); None where it is not."""
    bits = bitwise_view(tensor.detach())
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
        flat = bitwise_view(tensor.detach()).reshape(-1)
    flat = flat.numpy()
    return flat[::max(flat.size // FINGERPRINT_ELEMENTS, 1)].copy()


def _same_storage(a, b):
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _copy_now(dst, src):
    if dst.device.type == "cpu" and src.device.type == "cpu":
        _copy_on_cpu(dst, src)
    else:
        dst.copy_(src, non_blocking=dst.device != src.device)


def _copy_on_cpu(dst, src):
    # numpy, not torch: torch's copy on another thread starts an OpenMP team of its own
    # that spins on the cores the training thread uses (and numpy's is the faster memcpy).
    # Both as raw integers: numpy has no bfloat16.
    flat_dst, flat_src = _dense_flat(dst), _dense_flat(src)
    if flat_dst is not None and flat_src is not None and dst.stride() == src.stride():
        np.copyto(flat_dst.numpy(), flat_src.numpy())
    else:
        np.copyto(bitwise_view(dst).numpy(), bitwise_view(src.detach()).numpy())


class _Copy:
    """One tensor of a commit: its buffer, its source, what the source was at the commit."""

    __slots__ = ("dst", "src", "version", "print", "label")

    def __init__(self, dst, src, label, check=False):
        self.dst, self.src, self.label = dst, src, label
        self.version = src._version
        self.print = fingerprint(src) if check else None

    def holds_commit(self):
        """The buffer holds the source's commit-time fingerprint (where one was taken)."""
        return self.print is None or np.array_equal(fingerprint(self.dst), self.print)


class _Job:
    """The copies one commit left for after it returned."""

    def __init__(self, copies):
        self.copies = copies
        self.cpu = [c for c in copies if c.dst.device.type == "cpu" and c.src.device.type == "cpu"]
        self.device = [c for c in copies if not (c.dst.device.type == "cpu"
                                                 and c.src.device.type == "cpu")]
        self.done = threading.Event()
        self.failure = None
        self.checked = False   # waited for (the device's copies: ordered) and checked
        self.event = None      # CUDA: recorded on the side stream after the device copies


class CommitCopies:
    """The copies of one State's commits (see the module's docstring).

    ``copy(dst, src, label, deferred)`` during a save, between :meth:`begin` and
    :meth:`launch`; :meth:`wait` before the live state is written or the snapshot read.
    """

    def __init__(self):
        self._records = {}        # id(dst) -> the _Copy that last filled dst
        self._filled = {}
        self._sources = {}        # this save's sources by storage -> the buffer they fill
        self._later = None
        self._turn = 0            # which deferred copies' fingerprints this commit checks
        self._stride = 1
        self._job = None
        self._queue = None
        self._stream = None

    # -- a commit --------------------------------------------------------------------
    def begin(self, defer=True):
        """A save starts: the previous one's copies are finished and checked first.
        ``defer=False``: this save makes every copy before it returns."""
        self.wait()
        self._later, self._filled, self._sources = ([] if defer else None), {}, {}

    def copy(self, dst, src, label, deferred):
        """Fill ``dst`` from ``src`` for this commit: skipped where unchanged since ``dst``
        was filled from it, else now, or after the commit returns where ``deferred`` (the
        source is written only by an optimizer step)."""
        src = src.detach()
        where = (src.data_ptr(), src.shape, src.stride(), src.dtype, src.device)
        if where in self._sources and src.data_ptr():
            # Tied weights (one tensor under two names): one copy, shared by both names.
            return self._sources[where]
        self._sources[where] = dst
        last = self._records.get(id(dst))
        if last is not None and self._unchanged(last, dst, src):
            self._filled[id(dst)] = last
            return dst
        if deferred and self._later is not None:
            check = src.device.type == "cpu" and \
                (len(self._later) + self._turn) % self._stride == 0
            record = _Copy(dst, src, label, check)
            self._later.append(record)
        else:
            record = _Copy(dst, src, label)
            _copy_now(dst, src)
        self._filled[id(dst)] = record
        return dst

    @staticmethod
    def _unchanged(last, dst, src):
        # Where reading values would wait for a device, nothing is skipped: copies there
        # run on a side stream anyway.
        return (last.dst is dst and src.device.type == "cpu" and _same_storage(last.src, src)
                and src._version == last.version
                and np.array_equal(fingerprint(src), fingerprint(dst)))

    def launch(self):
        """The save is done: start the deferred copies; forget buffers no longer in use."""
        self._records, later, self._later = self._filled, self._later or [], None
        self._sources = {}
        self._turn += 1
        self._stride = max(1, -(-len(later) // FINGERPRINTS_PER_COMMIT))
        if not later:
            return
        job = _Job(later)
        if job.device:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for c in job.device:
                    c.dst.copy_(c.src, non_blocking=True)
            job.event = torch.cuda.Event()
            job.event.record(stream)
        if job.cpu:
            self._worker().put(job)
        else:
            job.done.set()
        self._job = job

    # -- waits -----------------------------------------------------------------------
    @property
    def pending(self):
        return self._job is not None

    def wait(self, host=True):
        """Finish the last commit's deferred copies and check them. ``host=False`` (where
        only the device's later work must come after them: before a step, after a forward)
        orders that work after the device's copies without waiting for the device; a later
        wait with ``host=True`` (before the snapshot is read) waits for it. Raises
        :class:`CommitCopyError` if a source was written before its copy was made."""
        job = self._job
        if job is None:
            return
        if not job.checked:
            self._finish(job)
        if job.event is not None:
            if not host:
                return
            job.event.synchronize()
        self._job = None

    def _finish(self, job):
        job.done.wait()
        changed = [c for c in job.copies if c.src._version != c.version]
        if job.failure is not None and not changed:
            # The thread failed part-way, and no source was written since the commit
            # (checked): the copies are made again here.
            for c in job.cpu:
                _copy_now(c.dst, c.src)
        if not changed:
            changed = [c for c in job.cpu if not c.holds_commit()]
        if changed:
            self._job = None
            self._records = {}
            names = ", ".join(c.label for c in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise CommitCopyError(
                f"{names}{more} changed after state.commit() while the commit was copying it "
                "(before the next forward ended or the optimizer stepped): the commit's copy "
                "would mix two steps. Change it after the step (as an EMA's update does), or "
                "before the commit, or call state.wait_for_commit() first")
        job.checked = True
        if job.event is not None:
            torch.cuda.current_stream().wait_event(job.event)

    # -- where the copies run --------------------------------------------------------
    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _worker(self):
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=_copy_jobs, args=(self._queue,), daemon=True,
                             name="hvd_adapt-commit-copies").start()
            # The thread holds only its queue: it ends when these copies are collected.
            weakref.finalize(self, self._queue.put, None)
        return self._queue


def _copy_jobs(jobs):
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            for c in job.cpu:
                _copy_on_cpu(c.dst, c.src)
        except BaseException as e:     # made again, checked, at the wait
            job.failure = e
        finally:
            job.done.set()
