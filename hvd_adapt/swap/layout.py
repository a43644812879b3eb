"""Where the optimizer state on disk lies: what an optimizer keeps per parameter (learned by
a probe), a file's layout (a block-aligned region per state tensor), and the pieces (ranges
from multiples of 4096 elements, where the probe steps the optimizer elementwise: whole
and as two halves, bitwise alike) and chunks a step walks."""
import math
from typing import NamedTuple, Optional

import torch

from .io import aligned

PIECE_ELEMENTS = 4096       # piece boundaries: multiples of this many elements


class StateTensor(NamedTuple):
    """A tensor an optimizer keeps for a parameter (``shape`` None: the parameter's; elementwise)
    on a GPU parameter's device or not; in a :class:`Layout`, its file ``offset`` and ``numel``."""
    key: str
    dtype: torch.dtype
    shape: Optional[tuple]
    on_device: bool
    offset: int = 0
    numel: int = 0

    elementwise = property(lambda self: self.shape is None)
    element_size = property(lambda self: _size(self.dtype))
    nbytes = property(lambda self: self.numel * _size(self.dtype))

    def bytes_for(self, numel):
        """Its bytes for a piece of ``numel`` elements."""
        return (numel if self.shape is None else math.prod(self.shape)) * _size(self.dtype)


class Makeup(NamedTuple):
    """A parameter's :class:`StateTensor` s, and whether its pieces step as it does whole."""
    tensors: tuple
    splittable: bool


class Params:
    """``optimizer``'s parameters (:meth:`all`: as ``add_param_group`` left them) and their
    :class:`Makeup`, probed once per group, dtype, device, dimensions and :func:`features`
    on: a schedule's learning rate probes nothing, ``amsgrad`` turned on probes again."""

    def __init__(self, optimizer):
        self.optimizer, self._known, self.group_of = optimizer, {}, {}

    def all(self):
        self.group_of = {p: g for g, group in enumerate(self.optimizer.param_groups)
                         for p in group["params"]}
        return list(self.group_of)

    def makeup(self, param):
        hyper = self.optimizer.param_groups[self.group_of[param]]
        key = (self.group_of[param], param.dtype, str(param.device), param.dim(), features(hyper))
        if key not in self._known:
            self._known[key] = probe(self.optimizer, hyper, param)
        if not self._known[key].splittable and any(t.shape for t in self._known[key].tensors):
            # State shaped by the parameter's shape, not its elements (Adafactor's row and
            # column factors): its sizes come from a probe of that shape.
            key += (tuple(param.shape),)
            if key not in self._known:
                self._known[key] = probe(self.optimizer, hyper, param, exact=True)
        return self._known[key]

    def splittable(self, param):
        # A sparse gradient (Embedding(sparse=True)) cannot be sliced into pieces.
        sparse = param.grad is not None and param.grad.is_sparse
        return param.is_contiguous() and not sparse and self.makeup(param).splittable

    def describe(self, param):
        # By identity: list.index compares tensors with ==, elementwise, and raises.
        index = next(i for i, p in enumerate(self.group_of) if p is param)
        return f"parameter {index} (shape {tuple(param.shape)}, group {self.group_of[param]})"

    def step_layout(self, old):
        """A step's layout: ``old``, parameters with a gradient and no state yet, and state a
        hyper-parameter turned on since adds (what torch refuses, a probe raises first)."""
        specs, probed = [], set()
        for p in self.all():
            kept = old.get(p) if old is not None else None
            if kept is None:
                if p.grad is not None:
                    specs.append((p, self.makeup(p).tensors, {}))
                continue
            for e in [e for e in kept.entries if e.elementwise and e.numel != p.numel()]:
                # Model surgery (p.data = a larger tensor): its state would be read from
                # the regions of others. In memory the optimizer fails too, on the shapes.
                raise ValueError(
                    f"hvd_adapt swap: {self.describe(p)} has {p.numel()} elements, its "
                    f"optimizer state {e.key!r} {e.numel}: nothing was stepped; load a state "
                    "dict that matches (load_state_dict) first")
            added = [t for t in self.makeup(p).tensors
                     if t.key not in {e.key for e in kept.entries}]
            group = self.group_of[p]
            if added and (kept.entries or kept.plain) and (group, p.dim()) not in probed:
                probed.add((group, p.dim()))
                check_added(self.optimizer, self.optimizer.param_groups[group], p, kept)
            specs.append((p, kept.entries + added, kept.plain))
        return Layout(specs)

    def layout_of(self, states):
        """The :class:`Layout` of ``states`` (``{param: {key: value}}``), a tensor in its
        parameter's dtype as torch's ``load_state_dict`` casts (all but the step)."""
        specs = []
        for p in [p for p in self.all() if p in states]:
            on_device = {t.key: t.on_device for t in self.makeup(p).tensors}
            tensors = []
            for key, value in [(k, v) for k, v in states[p].items() if torch.is_tensor(v)]:
                elementwise = tuple(value.shape) == tuple(p.shape)
                dtype = p.dtype if key != "step" and p.is_floating_point() else value.dtype
                tensors.append(StateTensor(
                    key, dtype, None if elementwise else tuple(value.shape),
                    on_device.get(key, elementwise and p.device.type != "cpu")))
            specs.append((p, tensors, {k: v for k, v in states[p].items()
                                       if not torch.is_tensor(v)}))
        return Layout(specs)

    def chunks(self, layout, buffer_bytes):
        """Chunks of pieces covering ``layout``, each within ``buffer_bytes``;
        ``ValueError`` where a parameter fits none, whole or in pieces."""
        chunks, current, used = [], [], 0
        for param, entries, _ in layout.params:
            for i, (start, stop) in enumerate(_ranges(param, entries, self.splittable(param),
                                                      buffer_bytes, self.describe)):
                piece = Piece(param, self.group_of[param], start, stop, i == 0)
                numel = param.numel() if stop is None else stop - start
                if current and used + piece_bytes(entries, numel) > buffer_bytes:
                    chunks.append(current)
                    current, used = [], 0
                for e in entries:
                    piece.slots.append(
                        Slot(e, used, e.offset, e.nbytes, e.shape) if not e.elementwise
                        else Slot(e, used, e.offset + start * e.element_size,
                                  numel * e.element_size,
                                  tuple(param.shape) if stop is None else (numel,)))
                    used += aligned(piece.slots[-1].nbytes)
                current.append(piece)
        return chunks + ([current] if current else [])


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
    """The :class:`Makeup` learned by stepping a probe like ``param`` (dtype, device and
    dimensions; its shape where ``exact``) twice with ``optimizer``'s class and ``group``'s
    hyper-parameters, whole and as two halves; ``ValueError`` where it cannot be."""
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
    tensors, splittable = [], torch.equal(torch.cat(halves), whole.reshape(-1))
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
    """Raise what ``optimizer`` raises stepping a probe whose state is ``kept``'s (a
    :class:`ParamLayout`) only: new state torch may refuse (Adam's ``amsgrad``: KeyError)."""
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
    hyper = dict({key: value for key, value in group.items() if key != "params"}, params=params)
    try:
        return type(optimizer)([hyper])
    except TypeError:
        # A constructor with required arguments: give them the optimizer's defaults.
        return type(optimizer)([hyper], **optimizer.defaults)


class ParamLayout(NamedTuple):
    """One parameter's state in a file: its :class:`StateTensor` s and plain values."""
    param: torch.Tensor
    entries: list
    plain: dict


class Layout:
    """A file's layout, from ``specs`` (``[(param, [StateTensor], plain values)]``): where
    each tensor lies, the size. It travels with its file, read as it was written."""

    def __init__(self, specs):
        self.params, self.by_param, offset = [], {}, 0
        for param, tensors, plain in specs:
            entries = []
            for t in tensors:
                shape = None if t.shape is None else tuple(t.shape)
                numel = param.numel() if shape is None else math.prod(shape)
                entries.append(StateTensor(t.key, t.dtype, shape, t.on_device, offset, numel))
                offset += aligned(entries[-1].nbytes)
            self.params.append(ParamLayout(param, entries, dict(plain)))
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


class Slot(NamedTuple):
    """One state tensor of one piece, in the chunk's buffer and in the file."""
    entry: StateTensor
    buffer_offset: int
    file_offset: int
    nbytes: int
    shape: tuple


class Piece:
    """A parameter (``stop`` None) or an element range of it, stepped as a flat view, with
    its :class:`Slot` s; ``first``: the piece that writes the non-elementwise state."""

    def __init__(self, param, group, start, stop, first):
        self.param, self.group, self.start, self.stop, self.first = \
            param, group, start, stop, first
        self.slots, self.tensor = [], None     # tensor: what the optimizer steps, in a step
        self.whole = stop is None

    def label(self):
        where = "" if self.whole else f" elements [{self.start}, {self.stop})"
        return f"parameter of shape {tuple(self.param.shape)}{where}"


def piece_bytes(tensors, numel):
    """Buffer bytes of a piece of ``numel`` elements with state ``tensors``."""
    return sum(aligned(t.bytes_for(numel)) for t in tensors)


def _ranges(param, tensors, splittable, buffer_bytes, describe):
    """``[(start, stop)]`` ranges of ``param`` whose state fits a buffer (None: all)."""
    whole, per = piece_bytes(tensors, param.numel()), 0
    if whole <= buffer_bytes:
        return [(0, None)]
    if splittable:
        # No padding: PIECE_ELEMENTS elements of any dtype are a whole number of blocks.
        room = buffer_bytes - piece_bytes([t for t in tensors if t.shape is not None], 0)
        per_element = sum(t.bytes_for(1) for t in tensors if t.shape is None)
        per = max(room, 0) // max(per_element, 1) // PIECE_ELEMENTS * PIECE_ELEMENTS
    if per:
        return [(start, min(start + per, param.numel())) for start in range(0, param.numel(), per)]
    # The least buffer that takes it: whole, or its least piece (each tensor block-aligned:
    # for a small parameter more than whole); in MiB rounded up, so enough.
    need = min(whole, piece_bytes(tensors, PIECE_ELEMENTS)) if splittable else whole
    because = "the parameter is not contiguous in memory (channels_last, a transposed view)" \
        if not param.is_contiguous() else "its gradient is sparse" if param.grad is not None \
        and param.grad.is_sparse else "the optimizer does not update it elementwise (stepping " \
        "it in pieces would change the result)"
    raise ValueError(
        f"swap_dir: the optimizer state of {describe(param)} takes {_mib_up(whole)} MiB"
        + ("" if splittable else f", and {because}, so it is stepped whole")
        + f": pass swap_buffer_mb >= {_mib_up(need)}")


def _mib_up(nbytes):
    return f"{math.ceil(nbytes / 2 ** 20 * 100) / 100:.2f}"


def segments(pieces, file_offset_of):
    """A chunk's I/O, ``[(file offset, buffer offset, bytes)]``, adjacent runs merged, where
    ``file_offset_of(piece, slot)`` is not None."""
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
