"""The next swapped step's undo copies, written to disk while the micro-steps run.

A swapped step keeps the values it moves (each parameter's bytes before the step) in
the new generation's undo area, so that a step that fails part way can put them back.
Written by the step, they are a quarter more I/O on the step's critical path than the
state's own read and write (Adam's two moments are twice the parameters). The parameters do not
change between the first backward of a step's micro-steps and the step, so their bytes
can go to disk before the step, while the micro-steps compute and the disk is idle:
into the spare, the file the next generation is written over. The step then writes
only the state.

Nothing is taken on trust: the step skips a chunk's undo write only where its plan is
the one the copies were written for (:func:`plan_signature`), its file is the one they
went to (device and inode), and each of the chunk's parameters is the tensor it was
when copied (the same memory and the same version counter, which every in-place change
through autograd's view of it moves: ``torch.no_grad()`` updates, ``copy_``,
``load_state_dict``, an elastic restore). The copied tensors are held until the step,
so their memory cannot go to another tensor meanwhile and an address identifies them (a
parameter replaced with ``p.data = ...`` keeps its old memory until the step). Changes that bypass the counter (``p.data``
written in place, numpy views) are not seen: made between the first backward and
``step()``, a failed step would put back the values from before them.
"""
import contextlib
import ctypes
import logging
import os
import threading

import torch

from .swap_io import aligned, submit

log = logging.getLogger(__name__)


class UndoAhead:
    """Write the undo copies of ``chunks`` (a step's plan, ``signature`` its
    :func:`plan_signature`) into ``file`` on a thread of its own, two of ``pool``'s buffers
    in turn (one filled while the other is written by the I/O executor ``io``), counting
    the bytes written in ``stats.ahead_written``. ``ready``: a CUDA event the copies of
    CUDA parameters wait for (the last step's updates), or None.
    """

    def __init__(self, chunks, signature, file, pool, io, stats, ready=None):
        self.chunks, self.signature, self.file = chunks, signature, file
        self.identity = _identity(file.fd)
        self.pool, self.io, self.stats, self.ready = pool, io, stats, ready
        self.copied = {}            # chunk index -> its pieces' (values, version) as copied
        self.written = set()        # chunk indices whose copies are on disk
        self.error = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvd_adapt-swap-undo",
                                        daemon=True)
        self._thread.start()

    def stop(self):
        """Start nothing more, wait for what is under way, close the file. Idempotent."""
        self._cancelled.set()
        self._thread.join()
        if self.file is not None:
            self.file.close()
            self.file = None
            if self.error is not None:
                # Only speed is at stake: the step writes these copies itself.
                log.debug("undo copies written ahead stopped: %s", self.error)

    def usable(self, chunks, signature, file):
        """The indices of ``chunks`` (the step's plan) whose undo copies are in ``file``
        already, and are the values their parameters hold now."""
        if signature != self.signature or _identity(file.fd) != self.identity:
            return set()
        return {i for i in self.written if _unchanged(chunks[i], self.copied[i])}

    def _batches(self, room):
        """Runs of whole chunks whose undo copies (consecutive in the file) fit ``room``."""
        batch, first = [], None
        for i, chunk in enumerate(self.chunks):
            start = chunk[0].undo.file_offset
            end = chunk[-1].undo.file_offset + aligned(chunk[-1].undo.nbytes)
            if batch and end - first > room:
                yield batch
                batch = []
            if not batch:
                first = start
            batch.append(i)
        if batch:
            yield batch

    def _run(self):
        buffers, flight = [], None      # flight: (buffer, transfer, chunk indices)
        try:
            for _ in range(2):
                buffers.append(self.pool.take())
            stream = None
            if self.ready is not None:
                # A stream of its own: the copies overlap the micro-steps' kernels, after
                # the last step's updates.
                stream = torch.cuda.Stream(self.ready.device)
                stream.wait_event(self.ready)
            for batch in self._batches(buffers[0].nbytes):
                if self._cancelled.is_set():
                    break
                buffer = buffers[1] if flight is not None and flight[0] is buffers[0] \
                    else buffers[0]
                region = self.chunks[batch[0]][0].undo.file_offset
                end = region
                last = self.chunks[batch[-1]][-1].undo
                end = last.file_offset + aligned(last.nbytes)
                for i in batch:
                    with torch.cuda.stream(stream) if stream is not None \
                            else contextlib.nullcontext():
                        held = [_copy_piece(buffer, piece.undo.file_offset - region, piece)
                                for piece in self.chunks[i]]
                    if stream is not None:
                        stream.synchronize()
                    # Changed while copied, or no longer as planned: the step writes this
                    # chunk's copies itself.
                    if all(h is not None for h in held) and _unchanged(self.chunks[i], held):
                        self.copied[i] = held
                transfer = submit(self.io, self.file, buffer, [(region, 0, end - region)], True,
                                  [])
                if flight is not None:
                    self._finish(flight)
                flight = (buffer, transfer, batch)
            if flight is not None:
                done, flight = flight, None
                self._finish(done)
        except BaseException as e:      # the step writes what is not written here
            self.error = e
        finally:
            if flight is not None:
                flight[1].settle()
            for buffer in buffers:
                self.pool.give_back(buffer)

    def _finish(self, flight):
        _, transfer, batch = flight
        transfer.wait()
        self.written.update(i for i in batch if i in self.copied)
        self.stats.ahead_written += sum(aligned(piece.undo.nbytes) for i in batch
                                        for piece in self.chunks[i])


class UndoAheadSlot:
    """The one :class:`UndoAhead` of a swapped state, from the micro-steps' first backward
    to the next step (or anything else that uses the spare or the pool's buffers)."""

    def __init__(self):
        self.current = None

    @property
    def started(self):
        return self.current is not None

    def start(self, ahead):
        self.current = ahead

    def take(self):
        """Stop the current one and return it (None if there is none)."""
        ahead, self.current = self.current, None
        if ahead is not None:
            ahead.stop()
        return ahead


def _copy(target, values):
    if values.is_cuda or not values.is_contiguous():
        target.copy_(values, non_blocking=True)
    else:
        # One thread, without the GIL: torch's copy_ would start an OpenMP team of its own
        # in this thread, as many threads as the micro-steps' on the same cores.
        ctypes.memmove(target.data_ptr(), values.data_ptr(),
                       values.numel() * values.element_size())


def _copy_piece(buffer, offset, piece):
    """Copy ``piece``'s values into ``buffer`` at ``offset``: ``(values, version)``, the values
    held (so that no other tensor can take their memory, and its address identifies them),
    or None where the parameter is no longer as planned (model surgery: a new shape or
    dtype), whose copy would not fit its slot."""
    version = piece.param._version
    try:
        values = piece.values()
    except RuntimeError:        # no longer contiguous: it cannot be viewed flat
        return None
    undo = piece.undo
    if tuple(values.shape) != tuple(undo.shape) \
            or values.numel() * values.element_size() != undo.nbytes:
        return None
    _copy(buffer.view(offset, values.dtype, undo.shape), values)
    return values, version


def _unchanged(chunk, held):
    """Whether each piece of ``chunk`` is the tensor ``held`` copied: the same memory (held,
    so not another tensor's) and the same version counter."""
    for piece, (values, version) in zip(chunk, held):
        try:
            now = piece.values()
        except RuntimeError:
            return False
        if piece.param._version != version or now.data_ptr() != values.data_ptr() \
                or now.dtype != values.dtype or tuple(now.shape) != tuple(values.shape):
            return False
    return True


def _identity(fd):
    info = os.fstat(fd)
    return info.st_dev, info.st_ino
