"""Where the optimizer state on disk lies: what state an optimizer keeps per parameter (found
by stepping a small probe, not assumed), each generation's layout in its file, and the
pieces and chunks a step walks.

A generation is one file; each state tensor of each parameter is one region of it,
aligned to the block. A parameter whose state is larger than a buffer is stepped in
pieces: element ranges whose bytes start at multiples of 4096 elements (so every
piece's file offset is block-aligned for any dtype, and fused kernels see the
alignment they vectorise on). That is exact only where the optimizer's update is
elementwise, which the probe checks by stepping a tensor whole and in two halves and
comparing the bits; an optimizer that fails the check keeps each parameter whole.
"""
import math

import torch

from .swap_io import BLOCK, aligned

PIECE_ELEMENTS = 4096       # piece boundaries: multiples of this many elements


class Makeup:
    """The state an optimizer keeps for one kind of parameter: ``tensors`` is a list of
    ``(key, dtype, shape or None, on_device)`` (shape None: shaped like the parameter, and
    elementwise), ``splittable`` whether stepping element ranges apart is bitwise the same
    as stepping the whole tensor."""

    def __init__(self, tensors, splittable):
        self.tensors, self.splittable = tensors, splittable


def probe_makeup(optimizer, group, param, exact=False):
    """Step a probe shaped like ``param`` (its dtype, device and number of dimensions) with
    ``optimizer``'s class and ``group``'s hyper-parameters, twice, whole and as two halves;
    returns the :class:`Makeup`. ``exact``: a probe of ``param``'s own shape, for the sizes
    of state that is not elementwise (a factored second moment). Raises ``ValueError``
    naming the optimizer where it cannot be probed."""
    # Two pieces' worth of elements, in the parameter's number of dimensions (factored
    # optimizers keep other state for a matrix than for a vector).
    shape = tuple(param.shape) if exact else \
        (4,) + (1,) * max(param.dim() - 2, 0) + (PIECE_ELEMENTS // 2,) \
        if param.dim() >= 2 else (2 * PIECE_ELEMENTS,)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=generator).to(param.dtype)
    grads = [torch.randn(shape, generator=generator).to(param.dtype) for _ in range(2)]
    whole = values.clone().to(param.device)
    half = max(whole.numel() // 2, 1)
    halves = [values.reshape(-1)[:half].clone().to(param.device),
              values.reshape(-1)[half:].clone().to(param.device)]
    try:
        whole_opt = _like(optimizer, group, [whole])
        halves_opt = _like(optimizer, group, halves)
        for grad in grads:
            grad = grad.to(param.device)
            whole.grad = grad
            halves[0].grad, halves[1].grad = grad.reshape(-1)[:half], grad.reshape(-1)[half:]
            whole_opt.step()
            halves_opt.step()
    except Exception as e:
        raise ValueError(
            f"swap_dir: cannot step a probe with {type(optimizer).__name__} to learn what state "
            f"it keeps ({type(e).__name__}: {e}); keep this optimizer's state in memory (no "
            "swap_dir)") from e
    state = whole_opt.state[whole]
    tensors = []
    splittable = torch.equal(torch.cat([h.reshape(-1) for h in halves]), whole.reshape(-1))
    for key, value in state.items():
        if not torch.is_tensor(value):
            splittable = splittable and all(halves_opt.state[h].get(key) == value
                                            for h in halves)
            continue
        elementwise = tuple(value.shape) == tuple(shape)
        tensors.append((key, value.dtype, None if elementwise else tuple(value.shape),
                        value.device == param.device and param.device.type != "cpu"))
        parts = [halves_opt.state[h].get(key) for h in halves]
        if elementwise:
            splittable = splittable and all(torch.is_tensor(p) for p in parts) and torch.equal(
                torch.cat([p.reshape(-1) for p in parts]), value.reshape(-1))
        else:
            splittable = splittable and all(torch.is_tensor(p) and torch.equal(p, value)
                                            for p in parts)
    return Makeup(tensors, splittable)


def _like(optimizer, group, params):
    hyper = {key: value for key, value in group.items() if key != "params"}
    try:
        return type(optimizer)([dict(hyper, params=params)])
    except TypeError:
        # A constructor with required arguments: give them the optimizer's defaults.
        return type(optimizer)([dict(hyper, params=params)], **optimizer.defaults)


class Entry:
    """One state tensor of one parameter in a generation's file: ``shape`` None means the
    parameter's shape (elementwise); ``offset`` is block-aligned."""

    def __init__(self, key, dtype, shape, on_device, offset, numel):
        self.key, self.dtype, self.shape, self.on_device = key, dtype, shape, on_device
        self.offset, self.numel = offset, numel
        self.element_size = torch.empty((), dtype=dtype).element_size()

    @property
    def elementwise(self):
        return self.shape is None

    @property
    def nbytes(self):
        return self.numel * self.element_size

    def spec(self):
        return (self.key, str(self.dtype).split(".")[-1],
                None if self.shape is None else list(self.shape), self.on_device)


class ParamLayout:
    """One parameter's state in a generation: its tensors' entries and plain values."""

    def __init__(self, param, entries, plain):
        self.param, self.entries, self.plain = param, entries, dict(plain)


class Layout:
    """A generation's layout: which parameters have state, where each tensor lies, and the
    file's size. It travels with its generation: a commit, restore, checkpoint or sync reads
    a generation with the layout it was written with."""

    def __init__(self, specs):
        """``specs``: ``[(param, [(key, dtype, shape or None, on_device)], plain)]``."""
        self.params, self.by_param, offset = [], {}, 0
        for param, tensors, plain in specs:
            entries = []
            for key, dtype, shape, on_device in tensors:
                numel = param.numel() if shape is None else _numel(shape)
                entry = Entry(key, dtype, None if shape is None else tuple(shape), on_device,
                              offset, numel)
                entries.append(entry)
                offset += aligned(entry.nbytes)
            layout = ParamLayout(param, entries, plain)
            self.params.append(layout)
            self.by_param[param] = layout
        self.nbytes = offset

    def get(self, param):
        return self.by_param.get(param)

    def dump(self, index):
        """Picklable and rank-neutral: parameters by ``index[param]``."""
        return [(index[layout.param], [entry.spec() for entry in layout.entries],
                 dict(layout.plain)) for layout in self.params]

    @classmethod
    def load(cls, dump, params):
        """The layout of ``dump`` with ``params[index]`` for each index."""
        return cls([(params[index], [(key, getattr(torch, dtype), shape, on_device)
                                     for key, dtype, shape, on_device in tensors], plain)
                    for index, tensors, plain in dump])

    def tensors_of(self, param, mapped):
        """``{key: tensor or value}`` of ``param`` as views of ``mapped`` (the file's bytes)."""
        layout = self.by_param[param]
        values = dict(layout.plain)
        for entry in layout.entries:
            view = mapped[entry.offset:entry.offset + entry.nbytes].view(entry.dtype)
            values[entry.key] = view.reshape(param.shape if entry.elementwise else entry.shape)
        return values


class Slot:
    """One state tensor of one piece: where it lies in the chunk's buffer and in the file."""

    def __init__(self, entry, buffer_offset, file_offset, nbytes, shape):
        self.entry, self.buffer_offset, self.file_offset = entry, buffer_offset, file_offset
        self.nbytes, self.shape = nbytes, shape


class Piece:
    """A parameter (``start`` 0, ``stop`` None: whole, stepped as itself) or an element range
    of it (stepped as a flat view) in a chunk. ``first``: the piece that writes the
    parameter's non-elementwise tensors (a step count), which every piece keeps a copy of.
    ``undo``: a :class:`Slot` for the piece's parameter values before the step (entry None),
    in the buffer after its state and in the generation's file after the layout's end."""

    def __init__(self, param, group, start, stop, first):
        self.param, self.group, self.start, self.stop, self.first = \
            param, group, start, stop, first
        self.slots = []
        self.undo = None
        self.tensor = None          # what the optimizer steps (set during a step)

    @property
    def whole(self):
        return self.stop is None

    def values(self):
        """The parameter's values this piece steps, as a tensor that shares its memory."""
        p = self.param.detach()
        return p if self.whole else p.view(-1)[self.start:self.stop]

    def label(self):
        where = "" if self.whole else f" elements [{self.start}, {self.stop})"
        return f"parameter of shape {tuple(self.param.shape)}{where}"


def _mib_up(nbytes):
    """``nbytes`` in MiB, two decimals, rounded up: a size said is a size that suffices."""
    return f"{math.ceil(nbytes / 2 ** 20 * 100) / 100:.2f}"


def piece_bytes(tensors, numel, param):
    """Buffer bytes of a piece of ``numel`` elements of ``param`` with state ``tensors``, and
    the piece's parameter values before the step (its undo copy)."""
    total = aligned(numel * param.element_size())
    for _, dtype, shape, _ in tensors:
        size = torch.empty((), dtype=dtype).element_size()
        total += aligned((numel if shape is None else _numel(shape)) * size)
    return total


def plan_pieces(layout, group_of, splittable, buffer_bytes, describe):
    """Chunks of pieces covering every parameter of ``layout``, each chunk's state and undo
    copy within ``buffer_bytes``: ``([[Piece]], end)``, ``end`` the file's size with the undo
    area (which follows ``layout.nbytes``). ``group_of[param]`` is its group index;
    ``splittable(param)`` whether it may be stepped in pieces. Raises ``ValueError`` where
    a parameter fits no buffer."""
    chunks, current, used, end = [], [], 0, layout.nbytes
    for param_layout in layout.params:
        param = param_layout.param
        tensors = [(e.key, e.dtype, e.shape, e.on_device) for e in param_layout.entries]
        whole = piece_bytes(tensors, param.numel(), param)
        if whole <= buffer_bytes:
            ranges = [(0, None)]
        else:
            per = _piece_elements(tensors, param, buffer_bytes) if splittable(param) else 0
            if per == 0:
                # The smallest buffer that takes it: whole, or its smallest piece (each
                # tensor block-aligned: for a small parameter more than whole).
                need = whole if not splittable(param) else \
                    min(whole, piece_bytes(tensors, PIECE_ELEMENTS, param))
                raise ValueError(
                    f"swap_dir: the optimizer state of {describe(param)}, with the undo copy "
                    f"of its values, takes {_mib_up(whole)} MiB"
                    + ("" if splittable(param) else f", and {_whole_because(param)}, so "
                       "it is stepped whole")
                    + f": pass swap_buffer_mb >= {_mib_up(need)}")
            ranges = [(start, min(start + per, param.numel()))
                      for start in range(0, param.numel(), per)]
        for i, (start, stop) in enumerate(ranges):
            piece = Piece(param, group_of[param], start, stop, i == 0)
            numel = param.numel() if stop is None else stop - start
            nbytes = piece_bytes(tensors, numel, param)
            if current and used + nbytes > buffer_bytes:
                chunks.append(current)
                current, used = [], 0
            offset = used
            for entry in param_layout.entries:
                if entry.elementwise:
                    count = numel
                    file_offset = entry.offset + start * entry.element_size
                    shape = tuple(param.shape) if stop is None else (count,)
                else:
                    count, file_offset, shape = entry.numel, entry.offset, entry.shape
                size = count * entry.element_size
                piece.slots.append(Slot(entry, offset, file_offset, size, shape))
                offset += aligned(size)
            size = numel * param.element_size()
            piece.undo = Slot(None, offset, end, size,
                              tuple(param.shape) if stop is None else (numel,))
            offset += aligned(size)
            end += aligned(size)
            current.append(piece)
            used = offset
    if current:
        chunks.append(current)
    return chunks, end


def plan_signature(chunks, end):
    """What a plan's undo area holds where: each piece's parameter (by identity), element
    range and place in the file, chunk by chunk. Two plans with one signature put the same
    values in the same bytes."""
    return end, tuple(tuple((id(piece.param), piece.start, piece.stop, piece.undo.file_offset,
                             piece.undo.nbytes) for piece in chunk) for chunk in chunks)


def _whole_because(param):
    if not param.is_contiguous():
        return "the parameter is not contiguous in memory (channels_last, a transposed view)"
    if param.grad is not None and param.grad.is_sparse:
        return "its gradient is sparse"
    return "the optimizer does not update it elementwise (stepping it in pieces would " \
        "change the result)"


def _piece_elements(tensors, param, buffer_bytes):
    """The most elements (a multiple of PIECE_ELEMENTS) of ``param`` whose state fits."""
    fixed = piece_bytes([t for t in tensors if t[2] is not None], 0, param)
    per_element = param.element_size() + sum(torch.empty((), dtype=dtype).element_size()
                                             for _, dtype, shape, _ in tensors if shape is None)
    # No padding: PIECE_ELEMENTS elements of any dtype are a whole number of blocks.
    room = buffer_bytes - fixed
    if room <= 0:
        return 0
    return (room // per_element) // PIECE_ELEMENTS * PIECE_ELEMENTS


def segments(pieces, file_offset_of, undo=None):
    """The I/O of a chunk: ``[(file offset, buffer offset, bytes)]``, block-aligned, adjacent
    runs merged. ``file_offset_of(piece, slot)`` is the slot's offset in the file read or
    written, None to skip it; ``undo(piece)`` the same for the piece's undo copy (None: no
    undo copies moved)."""
    out = []
    for piece in pieces:
        slots = [(slot, file_offset_of(piece, slot)) for slot in piece.slots]
        if undo is not None:
            slots.append((piece.undo, undo(piece)))
        for slot, where in slots:
            if where is None:
                continue
            size = aligned(slot.nbytes)
            if out and out[-1][0] + out[-1][2] == where \
                    and out[-1][1] + out[-1][2] == slot.buffer_offset:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + size)
            else:
                out.append((where, slot.buffer_offset, size))
    return out


def _numel(shape):
    count = 1
    for size in shape:
        count *= size
    return count
