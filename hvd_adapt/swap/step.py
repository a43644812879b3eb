"""One swapped step, a pipeline over a plan's chunks: while one steps (its state views of a
pool buffer), the next are read and the last written on I/O threads (``os.preadv`` and
``os.pwritev`` release the GIL); what the optimizer holds is checked against the plan."""
import collections
import time

import torch

from .io import Transfer
from .layout import segments

BUFFERS = 4                 # stepping, and reads ahead and writes behind in the others


class Stats(collections.Counter):
    """Seconds and bytes over swapped steps: ``read``/``write`` each chunk's I/O from its
    submission to its last byte, ``wait`` the steps' waits for I/O (large: the disk is the
    bottleneck), ``step`` the optimizer's work, ``agree`` the ranks' agreements."""

    def as_dict(self):
        return dict({f"swap_{key}_s": float(self[key])
                     for key in ("read", "write", "wait", "step", "agree", "total")},
                    swap_read_bytes=self["read_bytes"], swap_written_bytes=self["written_bytes"],
                    swap_steps=self["steps"])


class StepRun:
    """A step over ``layout``'s chunks, from ``source`` (laid out as ``old``) to ``out``;
    ``moved`` turns True as the optimizer starts its first chunk (parameters may move)."""

    def __init__(self, optimizer, pool, io, stats, layout, old, source, out):
        self.optimizer, self.pool, self.io, self.stats = optimizer, pool, io, stats
        self.layout, self.old, self.source, self.out = layout, old, source, out
        self.moved = False
        self.first_state = {}       # param -> its first piece's non-elementwise state

    def run(self, chunks):
        """Step every chunk through a ring of the pool's buffers: chunk i in buffer i % 4, read
        three chunks ahead and written one behind; every buffer goes back to the pool on
        every path, after every request using it finished."""
        buffers, flight = [], {}    # chunk index -> its read, then its write, under way
        try:
            for _ in range(BUFFERS):
                buffers.append(self.pool.take())
            for j in range(min(BUFFERS - 1, len(chunks))):
                flight[j] = Transfer(self.io, self.source, buffers[j], self._reads(chunks[j]),
                                     False)
            for i, chunk in enumerate(chunks):
                self.stats["read"] += self._wait(flight.pop(i))
                self.stats["read_bytes"] += sum(n for _, _, n in self._reads(chunk))
                self._step(chunk, buffers[i % BUFFERS])
                runs = segments(chunk, lambda piece, slot: slot.file_offset
                                if piece.first or slot.entry.elementwise else None)
                self.stats["written_bytes"] += sum(n for _, _, n in runs)
                flight[i] = Transfer(self.io, self.out, buffers[i % BUFFERS], runs, True)
                if i:
                    self.stats["write"] += self._wait(flight.pop(i - 1))
                ahead = i + BUFFERS - 1     # into the buffer chunk i - 1 was in
                if ahead < len(chunks):
                    flight[ahead] = Transfer(self.io, self.source, buffers[ahead % BUFFERS],
                                             self._reads(chunks[ahead]), False)
            for i in sorted(flight):
                self.stats["write"] += self._wait(flight.pop(i))
            self.out.check_whole(self.layout.nbytes)
        finally:
            for transfer in flight.values():
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
            self.stats["wait"] += time.perf_counter() - began

    def _reads(self, chunk):
        def where(piece, slot):
            kept = self.old.get(piece.param) if self.old is not None else None
            entry = next((e for e in kept.entries if e.key == slot.entry.key), None) \
                if kept is not None else None
            # None: no state before (new to the layout, or its key is).
            return None if entry is None else entry.offset + slot.file_offset - slot.entry.offset
        return segments(chunk, where)

    def _step(self, chunk, buffer):
        """Step ``chunk`` with its state as views of ``buffer``, then put the state the
        optimizer holds back into ``buffer``, checked against the plan."""
        state, groups = self.optimizer.state, self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        flat_grads = {}
        for piece in chunk:
            p = piece.param
            piece.tensor = p if piece.whole else p.detach().view(-1)[piece.start:piece.stop]
            if not piece.whole and p.grad is not None:
                flat = flat_grads.setdefault(p, p.grad.reshape(-1))
                piece.tensor.grad = flat[piece.start:piece.stop]
            kept = self.old.get(p) if self.old is not None else None
            if kept is not None:
                state[piece.tensor] = self._state_of(piece, kept, buffer)
        try:
            for g, group in enumerate(groups):
                group["params"] = [piece.tensor for piece in chunk if piece.group == g]
            stepping = time.perf_counter()
            self.moved = True
            self.optimizer.step()
            self.stats["step"] += time.perf_counter() - stepping
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
            states = {id(piece): state.pop(piece.tensor, None) for piece in chunk}
        self._evict(chunk, buffer, states)

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
            values, planned = states[id(piece)] or {}, {s.entry.key: s for s in piece.slots}
            tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
            held = {k: (v.dtype, v.numel() * v.element_size()) for k, v in tensors.items()}
            if held != {k: (s.entry.dtype, s.nbytes) for k, s in planned.items()}:
                raise RuntimeError(
                    f"hvd_adapt swap: the optimizer keeps state {held} for {piece.label()}, "
                    f"not the {sorted(planned)} its layout was planned with")
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
        plain values) alike: the check that stepping it in pieces was stepping it whole."""
        elementwise = {slot.entry.key for slot in piece.slots if slot.entry.elementwise}
        small = {key: value.detach().to("cpu", copy=True) for key, value in tensors.items()
                 if key not in elementwise}
        if piece.first:
            self.first_state[piece.param] = (small, plain)
            self.layout.get(piece.param).plain.clear()
            self.layout.get(piece.param).plain.update(plain)
            return
        first_small, first_plain = self.first_state[piece.param]
        if plain != first_plain or any(not torch.equal(value, first_small[key])
                                       for key, value in small.items()):
            raise RuntimeError(
                f"hvd_adapt swap: the pieces of {piece.label()} disagree on their "
                "non-elementwise state: the optimizer does not step it elementwise")
