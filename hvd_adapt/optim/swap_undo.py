"""The next swapped step's undo copies, written to disk while the micro-steps run.

A swapped step keeps the values it moves (each parameter's bytes before the step) in
the new generation's undo area, so that a step that fails part way can put them back.
Written by the step, they are a quarter more I/O on the step's critical path than the
state's own read and write (Adam's two moments are twice the parameters). The
parameters do not change between the first backward of a step's micro-steps and the
step, as a rule, so their bytes can go to disk before the step, while the micro-steps
compute and the disk is idle: into the spare, the file the next generation is written
over. The step then writes only the state.

Nothing is taken on trust. Before the step uses any copy written ahead: its plan must be
the one they were written for (:func:`plan_signature`), its file the one they went to
(device and inode) with every copied byte still there (no hole: the file was not cut),
and each parameter the tensor it was when copied (the same memory and version counter,
which every in-place change through autograd's view of it moves: ``torch.no_grad()``
updates, ``copy_``, ``load_state_dict``, an elastic restore). And as each chunk steps,
the step, which copies the chunk's values into its buffer anyway, compares their
:func:`fingerprint` with the one taken ahead: a change the counter does not see (``p.data``
written in place, as weight clipping does, a numpy view, a tensor at a freed one's
address) makes the step write that chunk's copies itself. A chunk that fails any of this
is written as without this module.
"""
import contextlib
import ctypes
import logging
import os
import threading

import numpy
import torch

from .swap_io import SwapError, aligned, submit

log = logging.getLogger(__name__)


class UndoAhead:
    """Write the undo copies of ``chunks`` (a step's plan, ``signature`` its
    :func:`plan_signature`) into ``file`` on a thread of its own, two of ``pool``'s buffers
    in turn (one filled while the other is written by the I/O executor ``io``), counting
    the bytes written in ``stats.ahead_written``. ``ready``: a CUDA event the copies of
    CUDA parameters wait for (the last step's updates), or None. The thread closes
    ``file`` when it ends.
    """

    def __init__(self, chunks, signature, file, pool, io, stats, ready=None):
        self.chunks, self.signature, self.file = chunks, signature, file
        self.identity = _identity(file.fd)
        self.pool, self.io, self.stats, self.ready = pool, io, stats, ready
        self.copied = {}            # chunk index -> [(address, version, fingerprint)] per piece
        self.written = set()        # chunk indices whose copies are on disk
        self.error = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvd_adapt-swap-undo",
                                        daemon=True)
        self._thread.start()

    def stop(self):
        """Start nothing more and wait for what is under way (not on the thread itself: a
        garbage collection there may finalize the optimizer). Idempotent."""
        self._cancelled.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        if self.error is not None:
            # Only speed is at stake: the step writes these copies itself.
            log.debug("undo copies written ahead stopped: %s", self.error)

    def usable(self, chunks, signature, file):
        """``{chunk index: [fingerprint per piece]}`` for the chunks of ``chunks`` (the
        step's plan) whose undo copies are in ``file`` already, from parameters that are,
        as far as their memory and version counters tell, as they were when copied."""
        if signature != self.signature or _identity(file.fd) != self.identity:
            return {}
        out = {}
        for i in sorted(self.written):
            chunk = chunks[i]
            start = chunk[0].undo.file_offset
            end = chunk[-1].undo.file_offset + chunk[-1].undo.nbytes
            try:
                file.check_written(start, end - start)
            except SwapError:
                continue            # cut since (and perhaps grown again): gone
            if _unchanged(chunk, self.copied[i]):
                out[i] = [fingerprint for _, _, fingerprint in self.copied[i]]
        return out

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
                last = self.chunks[batch[-1]][-1].undo
                end = last.file_offset + aligned(last.nbytes)
                for i in batch:
                    self._copy_chunk(i, buffer, region, stream)
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
            # Here, not in stop(): a file closed under a running thread would have its
            # descriptor's number reused by another file, which the thread then writes.
            self.file.close()

    def _copy_chunk(self, i, buffer, region, stream):
        chunk = self.chunks[i]
        copies = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for piece in chunk:
                copies.append(_copy_piece(buffer, piece.undo.file_offset - region, piece))
        if stream is not None:
            stream.synchronize()
        # Changed while copied, or no longer as planned: the step writes this chunk's
        # copies itself.
        if all(copy is not None for copy in copies) and _unchanged(chunk, copies):
            self.copied[i] = [
                (address, version, fingerprint(buffer.bytes, piece.undo.file_offset - region,
                                               piece.undo.nbytes))
                for piece, (address, version) in zip(chunk, copies)]

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
        """Stop the current one and return it (None if there is none). Interrupted while it
        stops (Ctrl-C), it stays current, to be stopped by the next call."""
        ahead = self.current
        if ahead is not None:
            ahead.stop()
            self.current = None
        return ahead


def fingerprint(data, offset, nbytes):
    """A sum of ``nbytes`` of ``data`` (a uint8 tensor) from ``offset`` (8-aligned), taken
    as the widest integers that divide them, wrapping at 64 bits: any edit of the values
    changes it but a permutation of equal words (or an edit that sums to 0 mod 2**64). A
    pass over the bytes at memory speed, no copy."""
    # numpy's sum runs on the calling thread alone: torch's would start an OpenMP team of
    # its own on the undo thread, whose spinning workers take the cores the micro-steps use.
    data = data[offset:offset + nbytes].numpy()
    for dtype in (numpy.uint64, numpy.uint32, numpy.uint16, numpy.uint8):
        width = numpy.dtype(dtype).itemsize
        if nbytes % width == 0:
            return int(data.view(dtype).sum(dtype=numpy.uint64))


# Integers as wide as a dtype: numpy copies any dtype's bits through them (it has no bfloat16).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(target, values):
    """Copy ``values`` into ``target`` (contiguous) on this thread alone, without the GIL:
    torch's ``copy_`` would start an OpenMP team of its own on the undo thread, as many
    threads as the micro-steps' on the same cores."""
    bits = _BITS.get(values.element_size())
    if values.is_cuda or bits is None:
        target.copy_(values, non_blocking=True)
    elif values.is_contiguous():
        ctypes.memmove(target.data_ptr(), values.data_ptr(),
                       values.numel() * values.element_size())
    else:
        # A strided parameter (a channels_last convolution's weight): numpy's strided copy.
        numpy.copyto(target.view(bits).numpy(), values.view(bits).numpy())


def _copy_piece(buffer, offset, piece):
    """Copy ``piece``'s values into ``buffer`` at ``offset``: ``(address, version)`` as
    copied, or None where the parameter is no longer as planned (model surgery: a new
    shape or dtype), whose copy would not fit its slot."""
    version = piece.param._version
    values = _values(piece)
    if values is None:
        return None
    _copy(buffer.view(offset, values.dtype, piece.undo.shape), values)
    return values.data_ptr(), version


def _values(piece):
    """The piece's values now, or None where they no longer fit its planned undo slot."""
    try:
        values = piece.values()
    except RuntimeError:        # no longer contiguous: it cannot be viewed flat
        return None
    undo = piece.undo
    if tuple(values.shape) != tuple(undo.shape) \
            or values.numel() * values.element_size() != undo.nbytes:
        return None
    return values


def _unchanged(chunk, copies):
    """Whether each piece of ``chunk`` has the memory and version counter it was copied
    with (``copies``: ``(address, version, ...)`` per piece)."""
    for piece, copy in zip(chunk, copies):
        values = _values(piece)
        if values is None or values.data_ptr() != copy[0] or piece.param._version != copy[1]:
            return False
    return True


def _identity(fd):
    info = os.fstat(fd)
    return info.st_dev, info.st_ino
