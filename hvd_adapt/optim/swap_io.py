"""Checked file I/O for the optimizer state on disk: aligned buffers in a bounded pool, and
reads and writes that move every byte they are asked to or raise :class:`SwapError`.

``os.preadv``/``os.pwritev`` may move fewer bytes than asked (a signal, a full disk
part-way, the end of a file): each transfer loops until it is complete, and a
short read at the end of a file or an ``OSError`` becomes a ``SwapError`` that
names the file, the bytes and the errno.
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
    """Reading or writing the optimizer state on disk failed; the message names the file,
    the bytes and the errno. The last good generation of the state is kept."""


def aligned(nbytes):
    """``nbytes`` rounded up to a whole number of blocks."""
    return -(-nbytes // BLOCK) * BLOCK


class AlignedBuffer:
    """``nbytes`` of host memory aligned to the file-system block, page-locked where CUDA is
    present (copies to the GPU need no staging); views of it are the state's tensors."""

    def __init__(self, nbytes, pin):
        self.nbytes = aligned(nbytes)
        raw = torch.empty(self.nbytes + BLOCK, dtype=torch.uint8)
        start = (-raw.data_ptr()) % BLOCK
        self.bytes = raw[start:start + self.nbytes]
        self.pinned = False
        if pin and torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.nbytes,
                                                        0) == 0:
            self.pinned = True

    def release(self):
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False

    def view(self, offset, dtype, shape):
        nbytes = _numel(shape) * _element_size(dtype)
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

    def free_count(self):
        with self._lock:
            return len(self._free)

    def release(self):
        for buffer in self.buffers:
            buffer.release()


class SwapFile:
    """One open file of the state: ``read``/``write`` move exactly the bytes asked, at
    block-aligned offsets, or raise :class:`SwapError`. ``O_DIRECT`` is asked for where
    ``direct``; a file system that refuses it (at ``fcntl`` or at the first transfer) gets
    plain I/O on this file instead."""

    def __init__(self, fd, name, direct):
        self.fd, self.name = fd, name
        self.direct = direct and _set_direct(fd, True)

    def reserve(self, nbytes):
        """Allocate ``nbytes`` of disk for the file now: a disk (or quota) that is full
        fails here, before anything is stepped, not half-way through writing."""
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            raise failure(e.errno, f"cannot reserve {nbytes} bytes for {self.name}") from e

    def truncate(self, nbytes):
        """Cut the file to ``nbytes``; the blocks past it go back to the file system."""
        try:
            os.ftruncate(self.fd, nbytes)
        except OSError as e:
            raise failure(e.errno, f"cannot cut {self.name} to {nbytes} bytes") from e

    def read(self, memory, offset):
        return self._transfer(memory, offset, write=False)

    def write(self, memory, offset):
        return self._transfer(memory, offset, write=True)

    def _transfer(self, memory, offset, write):
        """Move all of ``memory`` at ``offset``; returns ``(started, finished)`` times."""
        started = time.perf_counter()
        done, total = 0, len(memory)
        verb = "write" if write else "read"
        while done < total:
            piece = memory[done:]
            try:
                moved = os.pwritev(self.fd, [piece], offset + done) if write \
                    else os.preadv(self.fd, [piece], offset + done)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct:
                    # Accepted at open, refused at I/O: plain I/O for this file.
                    _set_direct(self.fd, False)
                    self.direct = False
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
        return started, time.perf_counter()

    def check_written(self, offset, nbytes):
        """Raise :class:`SwapError` (EIO) where ``nbytes`` at ``offset``, bytes this process
        wrote, are now past the file's end or a hole (the file was cut, then a write still
        in flight extended it again): such bytes would read back as zeros. A file system
        that does not track holes reports none."""
        try:
            hole = os.lseek(self.fd, offset, os.SEEK_HOLE)
        except OSError as e:
            hole = offset if e.errno == errno.ENXIO else offset + nbytes  # ENXIO: past the end
        if hole < offset + nbytes:
            raise SwapError(errno.EIO, f"cannot read {nbytes} bytes at offset {offset} of "
                            f"{self.name}: they were written and are gone (a hole at {hole}) "
                            f"(errno EIO)")

    def close(self):
        os.close(self.fd)


def submit(io, file, buffer, runs, write, intervals):
    """Start moving ``runs`` (``[(file offset, buffer offset, bytes)]``) between ``file`` and
    ``buffer`` on the executor ``io``, in requests of at most IO_BYTES: a :class:`Transfer`
    (each request's ``(started, finished)`` goes to ``intervals`` when waited for)."""
    futures = []
    for file_offset, buffer_offset, nbytes in runs:
        call = file.write if write else file.read      # no file where there are no runs
        for start in range(0, nbytes, IO_BYTES):
            size = min(IO_BYTES, nbytes - start)
            futures.append(io.submit(call, buffer.memory(buffer_offset + start, size),
                                     file_offset + start))
    return Transfer(futures, intervals)


class Transfer:
    """The requests of one run of I/O: ``wait()`` returns when all are done and raises the
    first one's error (a ``SwapError``) after all have finished."""

    def __init__(self, futures, intervals):
        self.futures, self.intervals = futures, intervals
        self.submitted = time.perf_counter()

    def wait(self):
        """Seconds from submission to the last byte."""
        error, finished = None, self.submitted
        for future in self.futures:
            try:
                begin, end = future.result()
                self.intervals.append((begin, end))
                finished = max(finished, end)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error
        return finished - self.submitted

    def done(self):
        """Whether every request has finished (never waits)."""
        return all(future.done() for future in self.futures)

    def settle(self):
        """Wait for every request, ignoring errors (a failed step's cleanup)."""
        concurrent.futures.wait(self.futures)


def failure(code, what):
    """A :class:`SwapError` of errno ``code`` for ``what`` ("cannot open F"), said as every
    swap error says it: ``what: <strerror> (errno ENAME)``."""
    return SwapError(code, f"{what}: {os.strerror(code)} (errno {errno.errorcode.get(code, code)})")


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


def _numel(shape):
    count = 1
    for size in shape:
        count *= size
    return count


def _element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()
