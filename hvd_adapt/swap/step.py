"""One swapped optimizer step: the pipeline over the chunks of a plan, and the counters of
the time and bytes steps take.

While chunk i steps (its state made of views into a pool buffer), later chunks are
read ahead and earlier ones written behind in the pool's other buffers, by a thread pool
doing checked ``os.preadv``/``os.pwritev`` (they release the GIL), so reads and writes
are in flight together while the optimizer computes. The state the optimizer holds after
each chunk is checked against the plan before it is written.
"""
import time

import torch

from .io import Transfer
from .layout import segments

BUFFERS = 4                 # stepping, and reads ahead and writes behind in the others


class Stats:
    """Seconds and bytes over swapped steps: ``read``/``write`` each chunk's I/O from its
    submission to its last byte, ``wait`` the time the step waited for I/O (a large one:
    the disk is the bottleneck), ``step`` the optimizer's own work, ``copy`` the state put
    in place in the buffers, ``agree`` the agreements between ranks, ``total`` the steps."""

    KEYS = ("read", "write", "wait", "step", "copy", "agree", "total")

    def __init__(self):
        for key in self.KEYS:
            setattr(self, key, 0.0)
        self.read_bytes = self.written_bytes = self.steps = 0

    def as_dict(self):
        return dict({f"swap_{key}_s": getattr(self, key) for key in self.KEYS},
                    swap_read_bytes=self.read_bytes, swap_written_bytes=self.written_bytes,
                    swap_steps=self.steps)


class StepRun:
    """One step of ``optimizer`` over ``chunks`` (:func:`~hvd_adapt.swap.layout.plan_chunks`
    of ``layout``), reading the state from ``source`` (laid out as ``old``; None: no state
    yet) and writing it to ``out``. ``moved`` turns True as the optimizer starts its first
    chunk: from then on parameters may have moved."""

    def __init__(self, optimizer, pool, io, stats, layout, old, source, out):
        self.optimizer, self.pool, self.io, self.stats = optimizer, pool, io, stats
        self.layout, self.old, self.source, self.out = layout, old, source, out
        self.moved = False
        self.first_state = {}       # param -> its first piece's non-elementwise state

    def run(self, chunks):
        """Step every chunk. Reads run as far ahead as the pool allows: every buffer that is
        neither stepping nor being written holds a read of a chunk to come, and a buffer
        whose write has finished takes the next read at once. Every buffer goes back to the
        pool on every path, after every request that uses it has finished."""
        buffers, reading, writing = [], {}, []  # chunk index -> (buffer, transfer); [(b, t)]
        try:
            for _ in range(BUFFERS):
                buffers.append(self.pool.take())
            idle, following = list(buffers), 0  # following: the next chunk to read
            for i, chunk in enumerate(chunks):
                while following < len(chunks):
                    # Finished writes give their buffers back first, in order, without
                    # waiting; only the read of the chunk about to step waits for one.
                    while writing and (writing[0][1].done() or not idle and following == i):
                        done, transfer = writing.pop(0)
                        self.stats.write += self._wait(transfer)
                        idle.append(done)
                    if not idle:
                        break
                    buffer = idle.pop()
                    reading[following] = (buffer, Transfer(
                        self.io, self.source, buffer, self._reads(chunks[following]), False))
                    following += 1
                buffer, transfer = reading.pop(i)
                self.stats.read += self._wait(transfer)
                self.stats.read_bytes += sum(n for _, _, n in self._reads(chunk))
                self._step(chunk, buffer)
                runs = segments(chunk, lambda piece, slot: slot.file_offset
                                if piece.first or slot.entry.elementwise else None)
                self.stats.written_bytes += sum(n for _, _, n in runs)
                writing.append((buffer, Transfer(self.io, self.out, buffer, runs, True)))
            while writing:
                self.stats.write += self._wait(writing.pop(0)[1])
            self.out.check_whole(self.layout.nbytes)
        finally:
            for _, transfer in list(reading.values()) + writing:
                transfer.settle()
            for buffer in buffers:
                self.pool.give_back(buffer)
            for piece in (piece for chunk in chunks for piece in chunk):
                piece.tensor = None     # the step's views (and gradients) are not kept

    def _wait(self, transfer):
        began = time.perf_counter()
        try:
            return transfer.wait()
        finally:
            self.stats.wait += time.perf_counter() - began

    def _reads(self, chunk):
        def where(piece, slot):
            kept = self.old.get(piece.param) if self.old is not None else None
            entry = next((e for e in kept.entries if e.key == slot.entry.key), None) \
                if kept is not None else None
            # None: no state before (new to the layout, or its key is).
            return None if entry is None else entry.offset + slot.file_offset - slot.entry.offset
        return segments(chunk, where)

    def _step(self, chunk, buffer):
        """Step ``chunk``'s pieces with their state as views of ``buffer``; then put the state
        the optimizer holds for them back into ``buffer``, checked against the layout."""
        state, groups = self.optimizer.state, self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        flat_grads = {}
        copying = time.perf_counter()
        for piece in chunk:
            p = piece.param
            piece.tensor = p if piece.whole else p.detach().view(-1)[piece.start:piece.stop]
            if not piece.whole and p.grad is not None:
                flat = flat_grads.setdefault(p, p.grad.reshape(-1))
                piece.tensor.grad = flat[piece.start:piece.stop]
            kept = self.old.get(p) if self.old is not None else None
            if kept is not None:
                state[piece.tensor] = self._state_of(piece, kept, buffer)
        self.stats.copy += time.perf_counter() - copying
        try:
            for g, group in enumerate(groups):
                group["params"] = [piece.tensor for piece in chunk if piece.group == g]
            stepping = time.perf_counter()
            self.moved = True
            self.optimizer.step()
            self.stats.step += time.perf_counter() - stepping
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
            states = {id(piece): state.pop(piece.tensor, None) for piece in chunk}
        evicting = time.perf_counter()
        self._evict(chunk, buffer, states)
        self.stats.copy += time.perf_counter() - evicting

    @staticmethod
    def _state_of(piece, kept, buffer):
        p, values = piece.param, dict(kept.plain)
        known = {entry.key for entry in kept.entries}
        for slot in [slot for slot in piece.slots if slot.entry.key in known]:
            # (Others: state the optimizer makes at this step.)
            view = buffer.view(slot.buffer_offset, slot.entry.dtype, slot.shape)
            device = p.device if slot.entry.on_device else view.device
            if slot.entry.elementwise and not p.is_contiguous():
                # The file keeps the state in the parameter's element order; a fused kernel
                # walks memory and pairs state and parameter by address, so the state gets
                # the parameter's strides (channels_last) as in memory.
                view = torch.empty_like(p, dtype=slot.entry.dtype, device=device) \
                    .copy_(view, non_blocking=True)
            values[slot.entry.key] = view.to(device, non_blocking=True)
        return values

    def _evict(self, chunk, buffer, states):
        moves, base = [], buffer.bytes.data_ptr()
        for piece in chunk:
            values, planned = states[id(piece)], {slot.entry.key: slot for slot in piece.slots}
            if values is None:
                if planned:
                    raise RuntimeError(f"hvd_adapt swap: the optimizer dropped the state of "
                                       f"{piece.label()}")
                continue
            tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
            if set(tensors) != set(planned):
                raise RuntimeError(
                    f"hvd_adapt swap: the optimizer keeps state {sorted(tensors)} for "
                    f"{piece.label()}, not the {sorted(planned)} its layout was planned with")
            for key, value in tensors.items():
                slot = planned[key]
                if value.dtype != slot.entry.dtype or \
                        value.numel() * slot.entry.element_size != slot.nbytes:
                    raise RuntimeError(
                        f"hvd_adapt swap: the optimizer's state {key!r} of {piece.label()} is "
                        f"{value.dtype} x {value.numel()}, not the planned {slot.entry.dtype} "
                        f"of {slot.nbytes} bytes")
            self._check_pieces_agree(piece, tensors, {k: v for k, v in values.items()
                                                      if k not in tensors})
            for key, value in tensors.items():
                target = buffer.view(planned[key].buffer_offset, value.dtype, planned[key].shape)
                if value.data_ptr() == target.data_ptr():
                    continue
                if not value.is_cuda and base <= value.data_ptr() < base + buffer.nbytes:
                    value = value.clone()   # it lies in the buffer where another goes
                moves.append((target, value.reshape(target.shape)))
        for target, value in moves:
            target.copy_(value, non_blocking=value.is_cuda)
        if any(value.is_cuda for _, value in moves):
            torch.cuda.synchronize()        # the buffer is written to disk next

    def _check_pieces_agree(self, piece, tensors, plain):
        """The pieces of a parameter must leave its non-elementwise state (a step count,
        plain values) alike: the one check that stepping it in pieces was the same as
        stepping it whole."""
        elementwise = {slot.entry.key for slot in piece.slots if slot.entry.elementwise}
        small = {key: value.detach().to("cpu", copy=True) for key, value in tensors.items()
                 if key not in elementwise}
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
