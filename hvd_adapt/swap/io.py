"""Checked file I/O: aligned buffers in a bounded pool, and transfers that move every byte
asked (``preadv``/``pwritev`` may move fewer: a signal, a full disk, the end of a file) or
raise :class:`SwapError` naming the file and the bytes, its ``errno`` a number."""
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
    """The optimizer state on disk could not be read, written or used (``errno``: why)."""


def failure(code, what):
    """A :class:`SwapError` of errno ``code``: ``what: <strerror> (errno ENAME)``."""
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

    def memory(self, offset, nbytes):     # for preadv/pwritev
        return memoryview(self.bytes.numpy())[offset:offset + nbytes]


class BufferPool:
    """``count`` :class:`AlignedBuffer` s. ``take()`` never waits: every path gives back
    what it takes (in ``finally``), so an empty pool is a bug, said as one."""

    def __init__(self, count, nbytes, pin):
        self.buffers = [AlignedBuffer(nbytes, pin) for _ in range(count)]
        self._free, self._lock = list(self.buffers), threading.Lock()

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
    """One open file of the state; ``O_DIRECT`` where ``direct`` and the file system takes it
    (at ``fcntl`` and at the first transfer), else plain I/O on this file."""

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
        """Write all of ``memory`` at ``offset``, or read all of it; returns when it finished."""
        done, total, verb = 0, len(memory), "write" if write else "read"
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
        """Raise :class:`SwapError` where the first ``nbytes``, all written, now have a hole or
        end: the file was cut behind the job's back (a hole would read back as zeros)."""
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
    """Requests of at most IO_BYTES moving ``runs`` ``[(file offset, buffer offset, n)]``."""

    def __init__(self, io, file, buffer, runs, write):
        self.submitted = time.perf_counter()
        self.futures = [io.submit(file.move, buffer.memory(at + start, min(IO_BYTES, n - start)),
                                  where + start, write)
                        for where, at, n in runs for start in range(0, n, IO_BYTES)]

    def wait(self):
        """Seconds from submission to the last byte (the first error, once all finished)."""
        concurrent.futures.wait(self.futures)
        return max([f.result() for f in self.futures], default=self.submitted) - self.submitted

    def settle(self):     # wait for every request, ignoring errors (a failed step's cleanup)
        concurrent.futures.wait(self.futures)


def windows(io, pool, file, nbytes, write, fill=None):
    """Move ``nbytes`` of ``file`` a buffer-sized window at a time, every buffer in flight;
    ``fill(buffer, offset, size)`` puts a window's bytes in before it is written. Every
    buffer goes back to the pool after every request using it finished."""
    buffers, flight = [], []
    try:
        for _ in range(len(pool.buffers)):
            buffers.append(pool.take())
        for i, offset in enumerate(range(0, nbytes, buffers[0].nbytes)):
            if len(flight) == len(buffers):
                flight.pop(0).wait()
            buffer, size = buffers[i % len(buffers)], min(buffers[0].nbytes, nbytes - offset)
            if fill is not None:
                fill(buffer, offset, size)
            flight.append(Transfer(io, file, buffer, [(offset, 0, size)], write))
        while flight:
            flight.pop(0).wait()
    finally:
        for transfer in flight:
            transfer.settle()
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
