"""Where the optimizer state on disk lies: what an optimizer keeps per parameter (learned by
stepping a small probe, not assumed), a state file's layout, and the pieces and chunks a
step walks.

Each state tensor of each parameter is one block-aligned region of a file. A parameter
whose state is larger than a buffer is stepped in pieces: element ranges starting at
multiples of 4096 elements (block-aligned for any dtype, and aligned as fused kernels
vectorise). That is exact only where the optimizer's update is elementwise, which the
probe checks by stepping a tensor whole and in two halves and comparing the bits; an
optimizer that fails the check keeps each parameter whole.
"""
import math
from typing import NamedTuple, Optional

import torch

from .io import aligned

PIECE_ELEMENTS = 4096       # piece boundaries: multiples of this many elements


class StateTensor(NamedTuple):
    """One tensor an optimizer keeps for a parameter: ``shape`` None where it is shaped like
    the parameter (elementwise); ``on_device`` where it lives on a GPU parameter's device."""
    key: str
    dtype: torch.dtype
    shape: Optional[tuple]
    on_device: bool

    def nbytes(self, numel):
        """Its bytes for a piece of ``numel`` elements (all of it where not elementwise)."""
        return (numel if self.shape is None else math.prod(self.shape)) * _size(self.dtype)


class Makeup(NamedTuple):
    """What an optimizer keeps for one kind of parameter (:class:`StateTensor` s), and
    whether stepping element ranges apart is bitwise the same as stepping the whole."""
    tensors: tuple
    splittable: bool


class Makeups:
    """The :class:`Makeup` of ``optimizer``'s parameters, probed once per group, dtype,
    device, number of dimensions and set of features that are on (:func:`features`): a
    learning rate a schedule moves probes nothing; ``amsgrad`` turned on probes again."""

    def __init__(self, optimizer):
        self.optimizer, self._known = optimizer, {}

    def of(self, param, group):
        hyper = self.optimizer.param_groups[group]
        key = (group, param.dtype, str(param.device), param.dim(), features(hyper))
        if key not in self._known:
            self._known[key] = probe(self.optimizer, hyper, param)
        if self._known[key].splittable or all(t.shape is None for t in self._known[key].tensors):
            return self._known[key]
        # State shaped by the parameter's shape, not its elements (Adafactor's row and
        # column factors): its sizes come from a probe of that shape.
        key += (tuple(param.shape),)
        if key not in self._known:
            self._known[key] = probe(self.optimizer, hyper, param, exact=True)
        return self._known[key]


def features(group):
    """Which of a param group's hyper-parameters are on: a number by whether it is 0, any
    other value as itself (hashable)."""
    def on(value):
        if isinstance(value, (bool, str)) or value is None:
            return value
        if isinstance(value, (int, float)) or torch.is_tensor(value) and value.numel() == 1:
            return float(value) != 0.0
        return tuple(on(v) for v in value) if isinstance(value, (tuple, list)) else repr(value)
    return tuple(sorted((key, on(value)) for key, value in group.items() if key != "params"))


def _probe_shape(param):
    # Two pieces' worth of elements, in the parameter's number of dimensions (factored
    # optimizers keep other state for a matrix than for a vector).
    return (4,) + (1,) * (param.dim() - 2) + (PIECE_ELEMENTS // 2,) if param.dim() >= 2 \
        else (2 * PIECE_ELEMENTS,)


def probe(optimizer, group, param, exact=False):
    """The :class:`Makeup` learned by stepping a probe shaped like ``param`` (its dtype,
    device and number of dimensions; its own shape where ``exact``) twice with
    ``optimizer``'s class and ``group``'s hyper-parameters, whole and as two halves.
    Raises ``ValueError`` naming the optimizer where it cannot be probed."""
    shape = tuple(param.shape) if exact else _probe_shape(param)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=generator).to(param.dtype)
    whole, half = values.clone().to(param.device), max(values.numel() // 2, 1)
    halves = [part.clone().to(param.device) for part in values.reshape(-1).tensor_split([half])]
    try:
        whole_opt, halves_opt = _like(optimizer, group, [whole]), _like(optimizer, group, halves)
        for _ in range(2):
            whole.grad = torch.randn(shape, generator=generator).to(param.dtype).to(param.device)
            halves[0].grad, halves[1].grad = whole.grad.reshape(-1).tensor_split([half])
            whole_opt.step()
            halves_opt.step()
    except Exception as e:
        raise ValueError(
            f"swap_dir: cannot step a probe with {type(optimizer).__name__} to learn what state "
            f"it keeps ({type(e).__name__}: {e}); keep this optimizer's state in memory (no "
            "swap_dir)") from e
    tensors = []
    splittable = torch.equal(torch.cat(halves), whole.reshape(-1))
    for key, value in whole_opt.state[whole].items():
        parts = [halves_opt.state[h].get(key) for h in halves]
        if not torch.is_tensor(value):
            splittable = splittable and all(part == value for part in parts)
            continue
        elementwise = tuple(value.shape) == tuple(shape)
        tensors.append(StateTensor(key, value.dtype, None if elementwise else tuple(value.shape),
                                   value.device == param.device and param.device.type != "cpu"))
        splittable = splittable and all(torch.is_tensor(p) for p in parts) and (
            torch.equal(torch.cat([p.reshape(-1) for p in parts]), value.reshape(-1))
            if elementwise else all(torch.equal(p, value) for p in parts))
    return Makeup(tuple(tensors), splittable)


def check_added(optimizer, group, param, kept):
    """Raise, before anything moves, what ``optimizer`` raises stepping a probe whose state
    holds only ``kept``'s (a :class:`ParamLayout`): a hyper-parameter turned on since adds a
    state tensor torch may refuse (Adam's ``amsgrad``: ``KeyError``). Factored state: not
    probed."""
    if any(entry.shape not in (None, ()) for entry in kept.entries):
        return
    shape = _probe_shape(param)
    tensor = torch.zeros(shape, dtype=param.dtype, device=param.device)
    tensor.grad = torch.zeros_like(tensor)
    opt = _like(optimizer, group, [tensor])
    opt.state[tensor] = dict(kept.plain, **{
        e.key: torch.zeros(shape if e.shape is None else (), dtype=e.dtype,
                           device=param.device if e.on_device else "cpu") for e in kept.entries})
    opt.step()


def _like(optimizer, group, params):
    hyper = {key: value for key, value in group.items() if key != "params"}
    try:
        return type(optimizer)([dict(hyper, params=params)])
    except TypeError:
        # A constructor with required arguments: give them the optimizer's defaults.
        return type(optimizer)([dict(hyper, params=params)], **optimizer.defaults)


class Entry(NamedTuple):
    """One state tensor of one parameter in a state file, at a block-aligned ``offset``."""
    key: str
    dtype: torch.dtype
    shape: Optional[tuple]
    on_device: bool
    offset: int
    numel: int

    elementwise = property(lambda self: self.shape is None)
    element_size = property(lambda self: _size(self.dtype))
    nbytes = property(lambda self: self.numel * _size(self.dtype))

    def spec(self):
        return StateTensor(self.key, self.dtype, self.shape, self.on_device)


class ParamLayout:
    """One parameter's state in a file: its tensors' :class:`Entry` s and plain values."""

    def __init__(self, param, entries, plain):
        self.param, self.entries, self.plain = param, entries, dict(plain)


class Layout:
    """A state file's layout, from ``specs`` (``[(param, [StateTensor], plain values)]``):
    which parameters have state, where each tensor lies, and the file's size. It travels
    with its file: a commit, restore, checkpoint or sync reads a file as it was written."""

    def __init__(self, specs):
        self.params, self.by_param, offset = [], {}, 0
        for param, tensors, plain in specs:
            entries = []
            for t in tensors:
                shape = None if t.shape is None else tuple(t.shape)
                numel = param.numel() if shape is None else math.prod(shape)
                entries.append(Entry(t.key, t.dtype, shape, t.on_device, offset, numel))
                offset += aligned(entries[-1].nbytes)
            self.params.append(ParamLayout(param, entries, plain))
            self.by_param[param] = self.params[-1]
        self.nbytes = offset

    def get(self, param):
        return self.by_param.get(param)

    def dump(self, index):
        """Picklable and rank-neutral: parameters by ``index[param]``."""
        return [(index[p.param], [(e.key, str(e.dtype).split(".")[-1], e.shape, e.on_device)
                                  for e in p.entries], dict(p.plain)) for p in self.params]

    @classmethod
    def load(cls, dump, params):
        """The layout of ``dump`` with ``params[index]`` for each index."""
        return cls([(params[index], [StateTensor(key, getattr(torch, dtype), shape, on_device)
                                     for key, dtype, shape, on_device in tensors], plain)
                    for index, tensors, plain in dump])

    def tensors_of(self, param, mapped):
        """``{key: tensor or value}`` of ``param`` as views of ``mapped`` (the file's bytes)."""
        values = dict(self.by_param[param].plain)
        for e in self.by_param[param].entries:
            values[e.key] = mapped[e.offset:e.offset + e.nbytes].view(e.dtype) \
                .reshape(param.shape if e.elementwise else e.shape)
        return values


def layout_of(states, params, makeup):
    """The :class:`Layout` of ``states`` (``{param: {key: tensor or value}}``, a state dict's)
    for those of ``params`` in it, ``makeup(param)`` their :class:`Makeup`. A state tensor
    takes its parameter's dtype, as torch's ``load_state_dict`` casts it (all but the step)."""
    specs = []
    for p in [p for p in params if p in states]:
        on_device = {t.key: t.on_device for t in makeup(p).tensors}
        tensors = []
        for key, value in [(k, v) for k, v in states[p].items() if torch.is_tensor(v)]:
            elementwise = tuple(value.shape) == tuple(p.shape)
            dtype = p.dtype if key != "step" and p.is_floating_point() else value.dtype
            tensors.append(StateTensor(key, dtype, None if elementwise else tuple(value.shape),
                                       on_device.get(key, elementwise and p.device.type != "cpu")))
        specs.append((p, tensors, {k: v for k, v in states[p].items() if not torch.is_tensor(v)}))
    return Layout(specs)


class Slot(NamedTuple):
    """One state tensor of one piece: where it lies in the chunk's buffer and in the file."""
    entry: Entry
    buffer_offset: int
    file_offset: int
    nbytes: int
    shape: tuple


class Piece:
    """A parameter (``stop`` None: whole, stepped as itself) or an element range of it
    (stepped as a flat view) in a chunk, with its state's :class:`Slot` s. ``first``: the
    piece that writes the parameter's non-elementwise tensors (a step count), which every
    piece keeps a copy of."""

    def __init__(self, param, group, start, stop, first):
        self.param, self.group, self.start, self.stop, self.first = \
            param, group, start, stop, first
        self.slots, self.tensor = [], None     # tensor: what the optimizer steps, in a step

    @property
    def whole(self):
        return self.stop is None

    def label(self):
        where = "" if self.whole else f" elements [{self.start}, {self.stop})"
        return f"parameter of shape {tuple(self.param.shape)}{where}"


def piece_bytes(tensors, numel):
    """Buffer bytes of a piece of ``numel`` elements with state ``tensors``."""
    return sum(aligned(t.nbytes(numel)) for t in tensors)


def plan_chunks(layout, group_of, splittable, buffer_bytes, describe):
    """Chunks of pieces covering every parameter of ``layout``, each chunk's state within
    ``buffer_bytes``. ``group_of[param]`` is its group index; ``splittable(param)`` whether
    it may be stepped in pieces. Raises ``ValueError`` where a parameter fits no buffer."""
    chunks, current, used = [], [], 0
    for param_layout in layout.params:
        param = param_layout.param
        tensors = [entry.spec() for entry in param_layout.entries]
        for i, (start, stop) in enumerate(_ranges(param, tensors, splittable(param),
                                                  buffer_bytes, describe)):
            piece = Piece(param, group_of[param], start, stop, i == 0)
            numel = param.numel() if stop is None else stop - start
            if current and used + piece_bytes(tensors, numel) > buffer_bytes:
                chunks.append(current)
                current, used = [], 0
            for e in param_layout.entries:
                if e.elementwise:
                    shape = tuple(param.shape) if stop is None else (numel,)
                    slot = Slot(e, used, e.offset + start * e.element_size,
                                numel * e.element_size, shape)
                else:
                    slot = Slot(e, used, e.offset, e.nbytes, e.shape)
                piece.slots.append(slot)
                used += aligned(slot.nbytes)
            current.append(piece)
    return chunks + ([current] if current else [])


def _ranges(param, tensors, splittable, buffer_bytes, describe):
    """``[(start, stop)]`` element ranges of ``param`` whose state fits a buffer:
    ``[(0, None)]`` where all of it does."""
    whole, per = piece_bytes(tensors, param.numel()), 0
    if whole <= buffer_bytes:
        return [(0, None)]
    if splittable:
        # No padding: PIECE_ELEMENTS elements of any dtype are a whole number of blocks.
        room = buffer_bytes - piece_bytes([t for t in tensors if t.shape is not None], 0)
        per_element = sum(t.nbytes(1) for t in tensors if t.shape is None)
        per = max(room, 0) // max(per_element, 1) // PIECE_ELEMENTS * PIECE_ELEMENTS
    if per == 0:
        # The smallest buffer that takes it: whole, or its smallest piece (each tensor
        # block-aligned: for a small parameter more than whole).
        need = min(whole, piece_bytes(tensors, PIECE_ELEMENTS)) if splittable else whole
        raise ValueError(
            f"swap_dir: the optimizer state of {describe(param)} takes {_mib_up(whole)} MiB"
            + ("" if splittable else f", and {_whole_because(param)}, so it is stepped whole")
            + f": pass swap_buffer_mb >= {_mib_up(need)}")
    return [(start, min(start + per, param.numel())) for start in range(0, param.numel(), per)]


def _mib_up(nbytes):
    """``nbytes`` in MiB, two decimals, rounded up: a size said is a size that suffices."""
    return f"{math.ceil(nbytes / 2 ** 20 * 100) / 100:.2f}"


def _whole_because(param):
    if not param.is_contiguous():
        return "the parameter is not contiguous in memory (channels_last, a transposed view)"
    if param.grad is not None and param.grad.is_sparse:
        return "its gradient is sparse"
    return "the optimizer does not update it elementwise (stepping it in pieces would " \
        "change the result)"


def segments(pieces, file_offset_of):
    """The I/O of a chunk: ``[(file offset, buffer offset, bytes)]``, block-aligned, adjacent
    runs merged. ``file_offset_of(piece, slot)`` is the slot's offset in the file read or
    written, None to skip it."""
    out = []
    for piece in pieces:
        for slot in piece.slots:
            where = file_offset_of(piece, slot)
            if where is None:
                continue
            if out and out[-1][0] + out[-1][2] == where \
                    and out[-1][1] + out[-1][2] == slot.buffer_offset:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + aligned(slot.nbytes))
            else:
                out.append((where, slot.buffer_offset, aligned(slot.nbytes)))
    return out


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size()
