"""Optimizer state on disk: a bounded pool of aligned buffers and asynchronous file I/O, as
DeepSpeed's optimizer swapper, under any torch optimizer.

The wrapped optimizer's per-parameter state (Adam's moments and step, a
momentum buffer, whatever tensors an optimizer keeps) lives in files: one
file per chunk of parameters per generation, ``<swap_dir>/hvd_adapt-swap-<host>-<pid>/
gen<g>/chunk<c>.bin`` (a crashed process's folder is removed by the next one on its host),
every tensor at an offset aligned to the file
system's 4096-byte block (so ``O_DIRECT`` can bypass the page cache, where
the file system takes it), mode 0600. A step walks the chunks: chunk i+1 is
read while chunk i steps (the optimizer stepping only that chunk's
parameters, its state made of views into a pool buffer), and chunk i-1 is
written behind, by a thread pool doing ``os.preadv``/``os.pwritev`` in pieces
(they release the GIL). Only the pool's buffers (three, each the size of the
largest chunk's state) are in memory; a parameter frozen never has state to
read.

A step never overwrites a file: it writes a new generation, and a
generation is deleted only once nothing refers to it. So a commit is O(1)
(it remembers the live generation), a restore switches back to it, and a
checkpoint maps the committed generation's files (``torch.from_file``: read
as it is written, not loaded first; an unlinked file stays readable while
mapped). Chunked steps are bitwise identical to one step over every
parameter: the optimizers' updates are elementwise per tensor.
"""
import atexit
import concurrent.futures
import logging
import os
import shutil
import socket
import threading
import time

import torch

log = logging.getLogger(__name__)

BLOCK = 4096
PIECE_BYTES = 8 << 20       # one pread/pwrite: 8 MiB
DEFAULT_BUFFER_MB = 64
BUFFERS = 3                 # read-ahead, stepping, write-behind


def _aligned(nbytes):
    return -(-nbytes // BLOCK) * BLOCK


class AlignedBuffer:
    """``nbytes`` of host memory aligned to the file-system block, page-locked where CUDA is
    present (so copies to the GPU need no staging); views of it are the state's tensors."""

    def __init__(self, nbytes, pin):
        self.nbytes = _aligned(nbytes)
        raw = torch.empty(self.nbytes + BLOCK, dtype=torch.uint8)
        start = (-raw.data_ptr()) % BLOCK
        self.bytes = raw[start:start + self.nbytes]
        self._raw = raw
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            if cudart.cudaHostRegister(self.bytes.data_ptr(), self.nbytes, 0) == 0:
                self.pinned = True

    def release(self):
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False

    def view(self, offset, dtype, shape):
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset:offset + nbytes].view(dtype).reshape(shape)


class Entry:
    """Where one state tensor of one parameter lies in its chunk's file."""

    def __init__(self, key, dtype, shape, offset):
        self.key, self.dtype, self.shape, self.offset = key, dtype, tuple(shape), offset

    @property
    def nbytes(self):
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


class Chunk:
    """Parameters stepped together, and the layout of their state in one file."""

    def __init__(self, index, params):
        self.index = index
        self.params = params          # [(group index, parameter)]
        self.entries = {}             # id(param) -> [Entry]
        self.plain = {}               # id(param) -> {key: non-tensor value}
        self.nbytes = 0

    def lay_out(self, states):
        """Record where each of ``states`` (id(param) -> state dict) goes; returns the bytes."""
        self.entries, self.plain, offset = {}, {}, 0
        for _, p in self.params:
            state = states.get(id(p), {})
            entries, plain = [], {}
            for key, value in state.items():
                if torch.is_tensor(value):
                    entries.append(Entry(key, value.dtype, value.shape, offset))
                    offset += _aligned(entries[-1].nbytes)
                else:
                    plain[key] = value
            self.entries[id(p)], self.plain[id(p)] = entries, plain
        self.nbytes = offset
        return offset


class SwapStats:
    """Seconds spent reading, waiting for reads, writing, and stepping, over swapped steps."""

    def __init__(self):
        self.read = self.wait = self.write = self.step = 0.0
        self.bytes_read = self.bytes_written = 0
        self.steps = 0

    def as_dict(self):
        return {"swap_read_s": self.read, "swap_wait_s": self.wait,
                "swap_write_s": self.write, "swap_step_s": self.step,
                "swap_read_bytes": self.bytes_read, "swap_written_bytes": self.bytes_written,
                "swap_steps": self.steps}


class SwappedState:
    """The per-parameter state of ``optimizer``, kept in files under ``directory``.

    ``buffer_mb`` sizes each of the pool's buffers (None: the largest
    parameter's expected state, at least 64 MiB); chunks hold up to a buffer
    of state. ``o_direct`` (None: where the file system takes it) reads and
    writes around the page cache. ``workers`` threads do the I/O.
    """

    def __init__(self, optimizer, directory, buffer_mb=None, o_direct=None, workers=4):
        self.optimizer = optimizer
        # One folder per process: ranks change at resizes, processes do not.
        host = socket.gethostname()
        self.root = os.path.join(os.path.abspath(directory),
                                 f"hvd_adapt-swap-{host}-{os.getpid()}")
        params = [(g, p) for g, group in enumerate(optimizer.param_groups)
                  for p in group["params"]]
        largest = max((p.numel() * p.element_size() for _, p in params), default=0)
        # Adam-like optimizers keep twice a parameter's bytes (and a step).
        wanted = buffer_mb * 2 ** 20 if buffer_mb is not None \
            else max(DEFAULT_BUFFER_MB * 2 ** 20, 2 * largest + 2 * BLOCK)
        self.buffer_bytes = _aligned(int(wanted))
        if 2 * largest + 2 * BLOCK > self.buffer_bytes:
            raise ValueError(
                f"swap buffers of {self.buffer_bytes / 2 ** 20:.2f} MiB cannot hold the state of "
                f"the largest parameter ({largest / 2 ** 20:.2f} MiB, twice that in state): "
                f"pass swap_buffer_mb >= {(2 * largest + 2 * BLOCK) / 2 ** 20:.2f}")
        self._check_room(directory, params)
        self._directory, self._host = os.path.abspath(directory), host
        self.remove_stale()
        os.makedirs(self.root, mode=0o700)
        self.chunks = self._chunk(params)
        self._o_direct = self._probe_o_direct() if o_direct is None else bool(o_direct)
        pin = torch.cuda.is_available()
        self._pool = [AlignedBuffer(self.buffer_bytes, pin) for _ in range(BUFFERS)]
        self._free = list(self._pool)
        self._free_lock = threading.Condition()
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                         thread_name_prefix="hvd_adapt-swap")
        self.live = None            # generation holding the current state (None: no state yet)
        self._generation = 0
        self._referenced = {}       # generation -> count of references (live, commit, maps)
        self.stats = SwapStats()
        self._closed = False
        atexit.register(self.close)
        state_bytes = sum(2 * p.numel() * p.element_size() for _, p in params)
        log.info("optimizer state on disk in %s: about %.2f GB in %d chunk file(s), %d buffers "
                 "of %.0f MiB%s", self.root, state_bytes / 1e9, len(self.chunks), BUFFERS,
                 self.buffer_bytes / 2 ** 20, ", O_DIRECT" if self._o_direct else "")

    # -- where the state goes ------------------------------------------------------------
    def _check_room(self, directory, params):
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"swap_dir {directory} is not writable")
        # Live, committed and one being written: up to three generations at once.
        needed = 3 * sum(2 * p.numel() * p.element_size() + BLOCK for _, p in params)
        free = shutil.disk_usage(directory).free
        if free < needed:
            raise ValueError(f"swap_dir {directory} has {free / 1e9:.2f} GB free; the optimizer "
                             f"state needs about {needed / 1e9:.2f} GB there (three "
                             "generations: live, committed, being written)")

    def _chunk(self, params):
        chunks, current, size = [], [], 0
        for g, p in params:
            nbytes = 2 * _aligned(p.numel() * p.element_size()) + BLOCK
            if current and size + nbytes > self.buffer_bytes:
                chunks.append(Chunk(len(chunks), current))
                current, size = [], 0
            current.append((g, p))
            size += nbytes
        if current:
            chunks.append(Chunk(len(chunks), current))
        return chunks

    def _probe_o_direct(self):
        probe = os.path.join(self.root, ".probe")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            os.close(fd)
            return True
        except (OSError, AttributeError):
            return False
        finally:
            if os.path.exists(probe):
                os.remove(probe)

    def _path(self, generation, chunk):
        return os.path.join(self.root, f"gen{generation}", f"chunk{chunk.index}.bin")

    def _open(self, path, write):
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
        if self._o_direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:
                self._o_direct = False      # this file system refuses it after all
        return os.open(path, flags, 0o600)

    # -- generations ---------------------------------------------------------------------
    def _new_generation(self):
        self._generation += 1
        os.makedirs(os.path.join(self.root, f"gen{self._generation}"), mode=0o700)
        return self._generation

    def _hold(self, generation):
        if generation is not None:
            self._referenced[generation] = self._referenced.get(generation, 0) + 1

    def _drop(self, generation):
        if generation is None:
            return
        self._referenced[generation] -= 1
        if self._referenced[generation] == 0:
            del self._referenced[generation]
            shutil.rmtree(os.path.join(self.root, f"gen{generation}"), ignore_errors=True)

    def _set_live(self, generation):
        self._hold(generation)
        self._drop(self.live)
        self.live = generation

    # -- I/O -------------------------------------------------------------------------------
    def _acquire(self):
        with self._free_lock:
            while not self._free:
                self._free_lock.wait()
            return self._free.pop()

    def give_back(self, buffer):
        """Return ``buffer`` to the pool (a write of it is on disk)."""
        with self._free_lock:
            self._free.append(buffer)
            self._free_lock.notify()

    def _transfer(self, fd, buffer, nbytes, write):
        """Read or write ``nbytes`` (block-aligned) of ``buffer`` at the file's start, in
        pieces on the thread pool; returns the futures."""
        view = memoryview(buffer.bytes.numpy())
        futures = []
        for start in range(0, nbytes, PIECE_BYTES):
            piece = view[start:min(start + PIECE_BYTES, nbytes)]
            call = os.pwritev if write else os.preadv
            futures.append(self._io.submit(call, fd, [piece], start))
        return futures

    def _read(self, chunk, generation):
        """Start reading ``chunk`` of ``generation`` into a pool buffer: ``(buffer, futures,
        fd, started)``."""
        buffer = self._acquire()
        if generation is None or chunk.nbytes == 0:
            return buffer, [], None, time.perf_counter()
        fd = self._open(self._path(generation, chunk), write=False)
        return buffer, self._transfer(fd, buffer, chunk.nbytes, write=False), fd, \
            time.perf_counter()

    def _write(self, chunk, generation, buffer):
        """Write ``chunk``'s state from ``buffer`` into ``generation`` in the background; the
        buffer returns to the pool once it is on disk. Returns the futures to wait for."""
        fd = self._open(self._path(generation, chunk), write=True)
        job = _WriteJob(fd, buffer, self)
        futures = self._transfer(fd, buffer, chunk.nbytes, write=True) if chunk.nbytes else []
        job.expect(futures)
        return futures

    @staticmethod
    def _wait(futures):
        for future in futures:
            future.result()

    # -- the state as the optimizer sees it ----------------------------------------------
    def _materialise(self, chunk, buffer):
        """Put ``chunk``'s state into the optimizer as views of ``buffer`` (copies on the GPU
        for a parameter there, made without waiting: the buffer is page-locked)."""
        state = self.optimizer.state
        for _, p in chunk.params:
            entries = chunk.entries.get(id(p), [])
            plain = chunk.plain.get(id(p), {})
            if entries or plain:
                values = dict(plain)
                for entry in entries:
                    view = buffer.view(entry.offset, entry.dtype, entry.shape)
                    values[entry.key] = view.to(p.device, non_blocking=True) \
                        if p.is_cuda and entry.shape != () else view
                state[p] = values

    def _evict(self, chunk, buffer):
        """Take ``chunk``'s state out of the optimizer into ``buffer`` (laid out afresh:
        a first step creates state, some optimizers replace their tensors)."""
        state = self.optimizer.state
        states = {id(p): state.pop(p) for _, p in chunk.params if p in state}
        nbytes = chunk.lay_out(states)
        if nbytes > buffer.nbytes:
            raise RuntimeError(
                f"the optimizer's state for a chunk of parameters takes {nbytes / 2 ** 20:.1f} "
                f"MiB, more than a swap buffer ({buffer.nbytes / 2 ** 20:.1f} MiB): pass a "
                "larger swap_buffer_mb")
        moves = []
        base = buffer.bytes.data_ptr()
        for _, p in chunk.params:
            for entry in chunk.entries.get(id(p), []):
                target = buffer.view(entry.offset, entry.dtype, entry.shape)
                value = states[id(p)][entry.key]
                if value.data_ptr() == target.data_ptr():
                    continue
                if not value.is_cuda and base <= value.data_ptr() < base + buffer.nbytes:
                    value = value.clone()   # it lies in the buffer where another goes
                moves.append((target, value))
        cuda = False
        for target, value in moves:
            cuda = cuda or value.is_cuda
            target.copy_(value, non_blocking=value.is_cuda)
        if cuda:
            torch.cuda.synchronize()        # the buffer is written to disk next

    # -- stepping ------------------------------------------------------------------------
    def step(self):
        """Step the optimizer over every chunk: read ahead, step, write behind."""
        started = time.perf_counter()
        generation = self._new_generation()
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        pending_writes = []
        reading = self._read(self.chunks[0], self.live) if self.chunks else None
        try:
            for i, chunk in enumerate(self.chunks):
                buffer, futures, fd, read_started = reading
                waited = time.perf_counter()
                self._wait(futures)
                now = time.perf_counter()
                self.stats.wait += now - waited
                self.stats.read += now - read_started
                self.stats.bytes_read += chunk.nbytes if futures else 0
                if fd is not None:
                    os.close(fd)
                if i + 1 < len(self.chunks):
                    reading = self._read(self.chunks[i + 1], self.live)
                self._materialise(chunk, buffer)
                for g, group in enumerate(groups):
                    group["params"] = [p for pg, p in chunk.params if pg == g]
                stepping = time.perf_counter()
                self.optimizer.step()
                self.stats.step += time.perf_counter() - stepping
                for group, params in zip(groups, saved):
                    group["params"] = params
                self._evict(chunk, buffer)
                self.stats.bytes_written += chunk.nbytes
                pending_writes += self._write(chunk, generation, buffer)
            self._wait(pending_writes)
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        self._set_live(generation)
        self.stats.steps += 1
        log.debug("swapped step in %.3f s: %s", time.perf_counter() - started,
                  self.stats.as_dict())

    def read_back(self):
        """Read every chunk of the live generation through the pool, as a step reads it, and
        drop it; returns the bytes read (to measure the disk the way steps use it)."""
        total, pending = 0, None
        for i, chunk in enumerate(self.chunks):
            reading = pending or self._read(chunk, self.live)
            pending = self._read(self.chunks[i + 1], self.live) if i + 1 < len(self.chunks) \
                else None
            buffer, futures, fd, _ = reading
            self._wait(futures)
            if fd is not None:
                os.close(fd)
            total += chunk.nbytes if futures else 0
            self.give_back(buffer)
        return total

    def read(self, params, keys):
        """The live state of ``params`` (only ``keys`` of it), read now: {param: {key: tensor}}.
        For the noise measurement's Adam denominators, a bucket at a time."""
        wanted = {id(p) for p in params}
        out = {}
        if self.live is None:
            return out
        for chunk in self.chunks:
            members = [p for _, p in chunk.params if id(p) in wanted]
            if not members:
                continue
            mapped = self._map(chunk, self.live)
            for p in members:
                values = {key: value for key, value in chunk.plain.get(id(p), {}).items()
                          if key in keys}
                for entry in chunk.entries.get(id(p), []):
                    if entry.key in keys:
                        values[entry.key] = _view(mapped, entry).clone()
                out[p] = values
        return out

    def _map(self, chunk, generation):
        """``chunk``'s file of ``generation`` mapped (read lazily, private copy-on-write)."""
        if chunk.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(self._path(generation, chunk), shared=False, size=chunk.nbytes,
                               dtype=torch.uint8)

    # -- commits, restores, checkpoints, syncs ---------------------------------------------
    def commit(self):
        """Keep the live generation (as the commit's); returns its number, to restore to."""
        self._hold(self.live)
        return self.live

    def release(self, generation):
        """A commit of ``generation`` is superseded."""
        self._drop(generation)

    def restore(self, generation):
        """Make ``generation`` (a commit's) live again."""
        self._set_live(generation)

    def state_tensors(self, generation=None):
        """``{param: {key: tensor}}`` of ``generation`` (default: live), the tensors mapped
        from its files: a checkpoint writes them without loading them first."""
        generation = self.live if generation is None else generation
        out = {}
        if generation is None:
            return out
        for chunk in self.chunks:
            mapped = self._map(chunk, generation)
            for _, p in chunk.params:
                values = dict(chunk.plain.get(id(p), {}))
                for entry in chunk.entries.get(id(p), []):
                    values[entry.key] = _view(mapped, entry)
                if values:
                    out[p] = values
        return out

    def load(self, states):
        """Write ``states`` ({param: {key: tensor or value}}, e.g. a checkpoint's, mapped)
        into a new live generation, a chunk at a time."""
        generation = self._new_generation()
        writes = []
        for chunk in self.chunks:
            buffer = self._acquire()
            chunk_states = {id(p): states[p] for _, p in chunk.params if p in states}
            chunk.lay_out(chunk_states)
            for _, p in chunk.params:
                for entry in chunk.entries.get(id(p), []):
                    value = chunk_states[id(p)][entry.key]
                    buffer.view(entry.offset, entry.dtype, entry.shape).copy_(value)
            writes += self._write(chunk, generation, buffer)
        self._wait(writes)
        self._set_live(generation)

    def broadcast_chunks(self, root, broadcast_bytes):
        """Collective: every rank's live state becomes ``root``'s, one chunk at a time
        (``broadcast_bytes(data, root, name)`` sends a chunk file's bytes)."""
        generation = self._new_generation()
        writes = []
        for chunk in self.chunks:
            data = None
            if root:
                data = bytes(self._map(chunk, self.live).numpy()) if self.live is not None \
                    and chunk.nbytes else b""
            data = broadcast_bytes(data, f"hvd_adapt.swap.chunk{chunk.index}")
            buffer = self._acquire()
            if data:
                buffer.bytes[:len(data)].copy_(torch.frombuffer(bytearray(data),
                                                                dtype=torch.uint8))
            writes += self._write(chunk, generation, buffer)
        self._wait(writes)
        self._set_live(generation)

    def adopt_layout(self, layouts):
        """Take root's chunk layouts (from :meth:`layout_dump`) before a broadcast."""
        for chunk, layout in zip(self.chunks, layouts):
            chunk.entries, chunk.plain = {}, {}
            offset = 0
            for (_, p), (entries, plain) in zip(chunk.params, layout):
                chunk.entries[id(p)] = []
                for key, dtype, shape in entries:
                    entry = Entry(key, getattr(torch, dtype.split(".")[-1]), shape, offset)
                    chunk.entries[id(p)].append(entry)
                    offset += _aligned(entry.nbytes)
                chunk.plain[id(p)] = dict(plain)
            chunk.nbytes = offset

    def layout_dump(self):
        """Each chunk's per-parameter ``(entries, plain values)``: picklable, rank-neutral."""
        return [[([(e.key, str(e.dtype), e.shape) for e in chunk.entries.get(id(p), [])],
                  dict(chunk.plain.get(id(p), {}))) for _, p in chunk.params]
                for chunk in self.chunks]

    def remove_stale(self):
        """Remove the folders of this host's processes that ended without removing theirs: a
        crash, or a worker Horovod removed from an elastic job (it aborts). Their files are
        never read, and would fill the disk."""
        _remove_stale(self._directory, self._host)

    def close(self):
        """Remove the files and free the buffers (also at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=True)
        for buffer in self._pool:
            buffer.release()
        shutil.rmtree(self.root, ignore_errors=True)
        self.remove_stale()


class _WriteJob:
    """One chunk being written: closes its file and frees its buffer after the last piece."""

    def __init__(self, fd, buffer, swapped):
        self.fd, self.buffer, self.swapped = fd, buffer, swapped
        self.started = time.perf_counter()
        self.remaining = 0
        self.lock = threading.Lock()

    def expect(self, futures):
        self.remaining = len(futures)
        if not futures:
            self.done()
        for future in futures:
            future.add_done_callback(self.piece_done)

    def piece_done(self, _future):
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.done()

    def done(self):
        try:
            os.close(self.fd)
        finally:
            self.swapped.stats.write += time.perf_counter() - self.started
            self.swapped.give_back(self.buffer)


def _remove_stale(directory, host):
    prefix = f"hvd_adapt-swap-{host}-"
    for name in os.listdir(directory):
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        except PermissionError:
            pass


def _view(mapped, entry):
    return mapped[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).reshape(entry.shape)
