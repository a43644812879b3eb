"""Checked file I/O for the optimizer state on disk: aligned buffers in a bounded pool,
transfers that move every byte they are asked to or raise :class:`SwapError`, and the
pipeline that writes a whole file.

``os.preadv``/``os.pwritev`` may move fewer bytes than asked (a signal, a full disk
part-way, the end of a file): each transfer loops until it is complete, and a short
read at the end of a file or an ``OSError`` becomes a ``SwapError`` that names the
file and the bytes, its ``errno`` a number (what the ranks' agreements carry).
"""
import concurrent.futures
import errno
import fcntl
import os
import threading
import time

import torch

BLOCK = 4096            # the file system's block: O_DIRECT's alignment of offsets, sizes, memory
IO_BYTES = 8 << 20      # one pread/pwrite request: 8 MiB


class SwapError(OSError):
    """Reading or writing the optimizer state on disk failed; ``errno`` says why, the message
    names the file and the bytes."""


def failure(code, what):
    """A :class:`SwapError` of errno ``code`` for ``what`` ("cannot open F"), said as every
    swap error says it: ``what: <strerror> (errno ENAME)``."""
    return SwapError(code, f"{what}: {os.strerror(code)} (errno {errno.errorcode.get(code, code)})")


def aligned(nbytes):
    """``nbytes`` rounded up to a whole number of blocks."""
    return -(-nbytes // BLOCK) * BLOCK


class AlignedBuffer:
    """``nbytes`` of host memory aligned to the block, page-locked where CUDA is present
    (copies to the GPU need no staging); views of it are the state's tensors."""

    def __init__(self, nbytes, pin):
        self.nbytes = aligned(nbytes)
        raw = torch.empty(self.nbytes + BLOCK, dtype=torch.uint8)
        start = (-raw.data_ptr()) % BLOCK
        self.bytes = raw[start:start + self.nbytes]
        self.pinned = bool(pin) and torch.cuda.cudart().cudaHostRegister(
            self.bytes.data_ptr(), self.nbytes, 0) == 0

    def release(self):
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False

    def view(self, offset, dtype, shape):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset:offset + nbytes].view(dtype).reshape(shape)

    def memory(self, offset, nbytes):
        """A writable memoryview of ``nbytes`` at ``offset``, for ``preadv``/``pwritev``."""
        return memoryview(self.bytes.numpy())[offset:offset + nbytes]


class BufferPool:
    """A fixed number of :class:`AlignedBuffer`. ``take()`` never waits: every path that
    takes a buffer gives it back (in ``finally``), so an empty pool is a bug, reported as
    one rather than a hang."""

    def __init__(self, count, nbytes, pin):
        self.buffers = [AlignedBuffer(nbytes, pin) for _ in range(count)]
        self._free = list(self.buffers)
        self._lock = threading.Lock()

    def take(self):
        with self._lock:
            if not self._free:
                raise RuntimeError("hvd_adapt swap: every buffer of the pool is in use (a buffer "
                                   "was not given back)")
            return self._free.pop()

    def give_back(self, buffer):
        with self._lock:
            if buffer in self._free:
                raise RuntimeError("hvd_adapt swap: a buffer was given back twice")
            self._free.append(buffer)

    def release(self):
        for buffer in self.buffers:
            buffer.release()


class CheckedFile:
    """One open file of the state: :meth:`move` transfers exactly the bytes asked, at
    block-aligned offsets, or raises :class:`SwapError`. ``O_DIRECT`` where ``direct``; a
    file system that refuses it (at ``fcntl`` or at the first transfer) gets plain I/O on
    this file instead."""

    def __init__(self, fd, name, direct):
        self.fd, self.name = fd, name
        self.direct = direct and _set_direct(fd, True)

    def reserve(self, nbytes):
        """Allocate ``nbytes`` of disk for the file now: a disk (or quota) that is full
        fails here, before anything is stepped, not half-way through writing."""
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            raise failure(e.errno, f"cannot reserve {nbytes} bytes for {self.name}") from e

    def move(self, memory, offset, write):
        """Write ``memory`` at ``offset``, or read into all of it; returns when it finished."""
        done, total = 0, len(memory)
        verb = "write" if write else "read"
        while done < total:
            try:
                moved = (os.pwritev if write else os.preadv)(self.fd, [memory[done:]],
                                                              offset + done)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct:
                    # Accepted at open, refused at I/O: plain I/O for this file.
                    self.direct = _set_direct(self.fd, False)
                    continue
                raise failure(e.errno, f"cannot {verb} {total - done} of {total} bytes at "
                              f"offset {offset + done} of {self.name}") from e
            if moved == 0:
                # pwrite of 0 bytes is a full device on some file systems; pread of 0 the end.
                code = errno.ENOSPC if write else errno.EIO
                raise SwapError(code, f"cannot {verb} {total - done} of {total} bytes at offset "
                                f"{offset + done} of {self.name}: "
                                + ("no progress (disk full)" if write else "the file ends there")
                                + f" (errno {errno.errorcode[code]})")
            done += moved
        return time.perf_counter()

    def check_whole(self, nbytes):
        """Raise :class:`SwapError` (EIO) where the file's first ``nbytes``, all written, have a
        hole or end early: it was cut behind the job's back, and would read back as zeros."""
        try:
            hole = os.lseek(self.fd, 0, os.SEEK_HOLE)
        except OSError as e:
            hole = 0 if e.errno == errno.ENXIO else nbytes     # ENXIO: an empty file
        if hole < nbytes:
            raise SwapError(errno.EIO, f"{self.name} lost its bytes from offset {hole} while "
                            "they were written (cut behind this job's back) (errno EIO)")

    def close(self):
        os.close(self.fd)


class Transfer:
    """The requests that move ``runs`` (``[(file offset, buffer offset, bytes)]``) between
    ``file`` and ``buffer`` on the executor ``io``, at most IO_BYTES each."""

    def __init__(self, io, file, buffer, runs, write):
        self.submitted = time.perf_counter()
        self.futures = [io.submit(file.move, buffer.memory(at + start, min(IO_BYTES, n - start)),
                                  where + start, write)
                        for where, at, n in runs for start in range(0, n, IO_BYTES)]

    def wait(self):
        """Seconds from submission to the last byte; raises the first request's error after
        every request has finished."""
        concurrent.futures.wait(self.futures)
        for future in self.futures:
            future.result()
        return max((f.result() for f in self.futures), default=self.submitted) - self.submitted

    def done(self):
        """Whether every request has finished (never waits)."""
        return all(future.done() for future in self.futures)

    def settle(self):
        """Wait for every request, ignoring errors (a failed step's cleanup)."""
        concurrent.futures.wait(self.futures)


def stream(io, pool, count, file, tasks):
    """Write a whole file: ``tasks`` (``[(file offset, bytes, fill)]``, each at most a
    request) go to ``file`` through ``count`` of ``pool``'s buffers cut into request-sized
    slots. A slot is given its next request as soon as its own completes (not when a whole
    buffer's do), so the I/O threads always have requests queued, as raw I/O at the same
    concurrency has; ``fill(target)`` puts a request's bytes in its slot first. Every
    buffer goes back to the pool after every request that uses it has finished."""
    buffers, busy = [], {}
    try:
        for _ in range(count):
            buffers.append(pool.take())
        slot = min(IO_BYTES, buffers[0].nbytes)
        idle = [(buffer, start) for buffer in buffers
                for start in range(0, buffer.nbytes - slot + 1, slot)]
        for offset, nbytes, fill in tasks:
            if not idle:
                done, _ = concurrent.futures.wait(busy,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    future.result()
                    idle.append(busy.pop(future))
            buffer, start = idle.pop()
            fill(buffer.bytes[start:start + nbytes])
            busy[io.submit(file.move, buffer.memory(start, aligned(nbytes)), offset, True)] = \
                (buffer, start)
        for future in concurrent.futures.as_completed(list(busy)):
            future.result()
    finally:
        concurrent.futures.wait(busy)
        for buffer in buffers:
            pool.give_back(buffer)


def _set_direct(fd, on):
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the file system refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:
        return False
    return on
