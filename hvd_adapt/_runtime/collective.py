"""Collectives over Python objects, on Horovod's own operations.

Each function is a collective: every replica of the world must call it, in the
same order, or the job hangs. With a world of one they return their input
without a round trip through Horovod's background thread. Every wait for a
Horovod operation in hvd_adapt goes through :func:`wait`.
"""
import numbers
import os
import pickle
import time

import cloudpickle
import horovod.torch as hvd
import torch

#: A wait polls without sleeping (yielding the core in between, as Horovod's own wait does)
#: for this long, so an operation done within it is seen at once (a step's last gradient
#: bucket, a commit's vote) ...
WAIT_SPIN_SECONDS = 0.002
#: ... then sleeps a twentieth of the time waited so far (so the wait ends at most about 5%
#: later than the operation), at most this long at a time.
WAIT_MAX_SLEEP = 0.01


def wait(handle):
    """``hvd.synchronize(handle)`` without keeping a core busy while it waits.

    Horovod 0.28.1 waits for an operation by calling ``std::this_thread::yield`` in a loop
    (``WaitAndClear`` in horovod/torch/mpi_ops_v2.cc, since horovod/horovod#2101, for
    latency), holding the GIL. A rank that waits for a slow or lost peer (a slow data loader,
    rank 0 evaluating alone, a peer gone until Gloo's timeout) keeps a whole core busy for as
    long as it waits, taken from its loader's workers, the commit's copying thread (which
    also needs the GIL), and, where ranks share cores, from the very peer it waits for (a
    rank waiting 12 s for another used 13 CPU-s). Here the wait polls the handle, yielding
    the core between polls for :data:`WAIT_SPIN_SECONDS` (as Horovod does), then sleeping
    in steps that grow with the time waited (:data:`WAIT_MAX_SLEEP` at most), and takes the
    result from Horovod once it is done.

    >>> import hvd_adapt, horovod.torch as hvd, torch
    >>> hvd_adapt.init()
    >>> wait(hvd.allreduce_async(torch.ones(2), name="doc.wait")).tolist()
    [1.0, 1.0]
    """
    if not hvd.poll(handle):
        start = time.perf_counter()
        while not hvd.poll(handle):
            waited = time.perf_counter() - start
            if waited < WAIT_SPIN_SECONDS:
                # As Horovod's loop does: the background thread that finishes the operation
                # may need this core (polling without yielding made a small allreduce 2 ms
                # slower with two ranks on two cores).
                os.sched_yield()
            else:
                time.sleep(min(waited / 20, WAIT_MAX_SLEEP))
    return hvd.synchronize(handle)


def allreduce(value, name=None):
    """Sum a number, or a dict of numbers, over all replicas.

    Dicts may hold different keys on different replicas: a key missing on a
    replica counts as 0 there. Integers stay integers and are summed exactly,
    which is why dicts travel through one ``hvd.allgather_object`` rather than
    a float tensor.

    >>> import hvd_adapt
    >>> hvd_adapt.init()
    >>> allreduce({"loss": 0.5, "n": 2})   # a world of one; on two equal replicas: 1.0 and 4
    {'loss': 0.5, 'n': 2}
    """
    if isinstance(value, dict):
        for key, v in value.items():
            _check_number(v, key)
        if hvd.size() == 1:
            return dict(value)
        total = {}
        for part in allgather_object(value, name=name):
            for key, v in part.items():
                total[key] = total.get(key, 0) + v
        return total
    _check_number(value)
    if hvd.size() == 1:
        return value
    dtype = torch.int64 if isinstance(value, numbers.Integral) else torch.float64
    return wait(hvd.allreduce_async(torch.tensor([value], dtype=dtype), op=hvd.Sum,
                                    name=name)).item()


def broadcast_object(obj, root_rank=0, name=None):
    """Return ``obj`` as given on ``root_rank``, on every replica (pickled).

    Unlike ``hvd.broadcast_object``, the default name does not depend on the
    type of ``obj``, so ranks may pass placeholders of another type (None).
    """
    if hvd.size() == 1:
        return obj
    # Pickled as Horovod's broadcast_object pickles (cloudpickle: lambdas, local classes);
    # sent through broadcast_bytes, whose waits sleep (see wait()).
    root = hvd.rank() == root_rank
    data = broadcast_bytes(cloudpickle.dumps(obj) if root else None, root_rank,
                           name or "hvd_adapt.bcast")
    return obj if root else cloudpickle.loads(data)


def start_broadcast_flag(flag, name, root_rank=0):
    """Start broadcasting ``root_rank``'s bool; :func:`flag_of` waits for it. None in a
    world of one, where the flag is the answer."""
    if hvd.size() == 1:
        return None
    return hvd.broadcast_async(torch.tensor([int(bool(flag))], dtype=torch.int64),
                               root_rank=root_rank, name=name)


def flag_of(handle, flag=None):
    """The bool a :func:`start_broadcast_flag` handle carries (``flag`` where it is None)."""
    if handle is None:
        return bool(flag)
    return bool(wait(handle)[0])


def allgather_object(obj, name=None):
    """Return the list of every replica's ``obj``, indexed by rank (pickled).

    As with :func:`broadcast_object`, the default name is fixed, so objects
    may differ in type across ranks.
    """
    if hvd.size() == 1:
        return [obj]
    name = name or "hvd_adapt.allgather"
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    # Unlike hvd.allgather_object, the sizes and the bytes go out together,
    # so Horovod negotiates both in one cycle: half the latency per call.
    sizes = hvd.allgather_async(torch.tensor([data.numel()]), name=name + ".sz")
    data = hvd.allgather_async(data, name=name + ".t")
    sizes, data = wait(sizes).tolist(), wait(data).numpy().tobytes()
    objects, start = [], 0
    for size in sizes:
        objects.append(pickle.loads(data[start:start + size]))
        start += size
    return objects


def in_place_view(tensor):
    """``(view, copied)``: a contiguous tensor sharing ``tensor``'s memory (a permutation of
    its dimensions: a channels_last tensor is contiguous in NHWC order), so that a Horovod
    operation, which takes contiguous tensors only, can work in place; or, where no
    permutation is contiguous, a contiguous copy to be copied back (``copied`` True)."""
    if tensor.is_contiguous():
        return tensor, False
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d)))
    view = tensor.permute(order)
    if view.is_contiguous():
        return view, False
    return tensor.contiguous(), True


# What Horovod 0.28 carries (horovod/torch/adapter_v2.cc); tensors of any other dtype
# (bfloat16, bool, complex, float8, unsigned 16-64 bit) travel as the integers of their bits.
_HOROVOD_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                   torch.float16, torch.float32, torch.float64)
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Tensors smaller than this travel packed with others of their kind (one collective for a
#: model's BatchNorm statistics instead of one per buffer); larger ones alone.
PACK_BYTES = 4 << 20


def bitwise_view(tensor):
    """A view of ``tensor`` (sharing its memory) in a dtype Horovod carries, holding the same
    bits: ``tensor`` itself where Horovod takes its dtype, else integers of the same size
    (bfloat16 as int16, bool as uint8, complex64 as int64, complex128 as pairs of int64).
    The one place hvd_adapt converts dtypes for Horovod; only for copies (broadcasts,
    gathers), never for arithmetic.

    >>> bitwise_view(torch.tensor([1.5], dtype=torch.bfloat16)).dtype
    torch.int16
    """
    if tensor.dtype in _HOROVOD_DTYPES:
        return tensor
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
        if tensor.dtype in _HOROVOD_DTYPES:
            return tensor
    return tensor.view(_BITS_OF_SIZE[tensor.element_size()])


def broadcast_tensors(named_tensors, root_rank=0):
    """Collective: every ``(name, tensor)`` takes ``root_rank``'s values, in place and bit for
    bit, whatever its dtype (see :func:`bitwise_view`) or memory layout (Horovod's
    ``broadcast_parameters`` refuses a channels_last parameter and a bfloat16 one). Small
    tensors of one dtype and device travel packed together (:data:`PACK_BYTES`); every rank
    must pass the same names, shapes and dtypes in the same order, so every rank packs alike."""
    if hvd.size() == 1:
        return
    root = hvd.rank() == root_rank
    in_flight, packs = [], {}

    def send(name, wire, members):
        in_flight.append((hvd.broadcast_async_(wire, root_rank=root_rank, name=name), wire,
                          members))

    def send_pack(key):
        names, members, size = packs.pop(key)
        wires = [wire for _, wire, _ in members]
        flat = torch.cat([w.reshape(-1) for w in wires]) if root else \
            torch.empty(size, dtype=wires[0].dtype, device=wires[0].device)
        send(f"{names[0]}+{len(names)}", flat, members)

    for name, tensor in named_tensors:
        bits = bitwise_view(tensor.view(-1) if tensor.dim() == 0 else tensor)
        wire, copied = in_place_view(bits)
        member = (bits, wire, copied)
        if wire.numel() * wire.element_size() >= PACK_BYTES:
            send(name, wire, [member])
            continue
        key = (wire.dtype, wire.device)
        names, members, size = packs.setdefault(key, ([], [], 0))
        names.append(name)
        members.append(member)
        packs[key] = (names, members, size + wire.numel())
        if (size + wire.numel()) * wire.element_size() >= PACK_BYTES:
            send_pack(key)
    for key in list(packs):
        send_pack(key)
    for handle, flat, members in in_flight:
        wait(handle)
        start = 0
        for bits, wire, copied in members:
            if flat is not wire:
                wire.copy_(flat[start:start + wire.numel()].view_as(wire))
                start += wire.numel()
            if copied:
                bits.copy_(wire)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Collective: make ``optimizer``'s state and hyper-parameters those of ``root_rank``.

    Unlike Horovod's ``broadcast_optimizer_state`` this changes nothing else.
    Horovod's runs a zero-gradient ``step()`` on every rank whose optimizer
    state is empty (at a fresh start, all of them; when growing, the new
    worker), to create the tensors it then broadcasts into: with weight decay
    that step shrinks the parameters by (1 - lr * wd) and seeds momentum with
    wd * p, so a synced job did not train like a plain one, and a joining
    worker's weights differed from the others'. Here the root's state
    travels as a skeleton (an object broadcast, tensors replaced by their
    shape and dtype) and its tensors as Horovod broadcasts into tensors every
    rank allocates from that skeleton.
    """
    if hvd.size() == 1:
        return
    root = hvd.rank() == root_rank
    # Every rank walks the same structure in the same order, so slot i is tensor i everywhere.
    slots = []

    def to_slot(tensor):
        slots.append(tensor.detach())
        return _TensorSlot(tuple(tensor.shape), tensor.dtype, tensor.device.type)

    skeleton = broadcast_object(_map_leaves(optimizer.state_dict(), torch.Tensor, to_slot)
                                if root else None,
                                root_rank=root_rank, name="hvd_adapt.optimizer_skeleton")
    if not root:
        device = next((p.device for group in optimizer.param_groups for p in group["params"]),
                      torch.device("cpu"))

        def from_slot(slot):
            on = device if slot.device != "cpu" else torch.device("cpu")
            slots.append(torch.empty(slot.shape, dtype=slot.dtype, device=on))
            return slots[-1]

        received = _map_leaves(skeleton, _TensorSlot, from_slot)
    broadcast_tensors([(f"hvd_adapt.optimizer_state.{i}", t) for i, t in enumerate(slots)],
                      root_rank=root_rank)
    if not root:
        optimizer.load_state_dict(received)


def _map_leaves(value, leaf_type, fn):
    """``value`` (nested dicts, lists, tuples) with every ``leaf_type`` leaf replaced by fn(leaf)."""
    if isinstance(value, leaf_type):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf_type, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, leaf_type, fn) for v in value)
    return value


class _TensorSlot:
    """Where a tensor of the root's optimizer state goes, in the skeleton other ranks receive."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = shape, dtype, device


def gather_ints(values, name):
    """Collective: every replica's list of ints (all of one length), indexed by rank.

    >>> gather_ints([1, 2], name="doc")     # a world of one
    [[1, 2]]
    """
    if hvd.size() == 1:
        return [list(values)]
    handle = hvd.allgather_async(torch.tensor([list(values)], dtype=torch.int64), name=name)
    return wait(handle).tolist()


def max_ints(values, name):
    """Collective: the element-wise maximum of every replica's list of ints (one length):
    one small allreduce, so flags (0/1) are OR-ed and counters agree on the largest."""
    if hvd.size() == 1:
        return list(values)
    return wait(hvd.allreduce_async(torch.tensor(list(values), dtype=torch.int64), op=hvd.Max,
                                    name=name)).tolist()


def broadcast_bytes(data, root_rank, name, chunk_bytes=1 << 28):
    """Collective: ``data`` (bytes, or None, given on ``root_rank``; ignored elsewhere) on
    every replica, sent in pieces of at most ``chunk_bytes`` so that no rank holds a second
    whole copy as a tensor."""
    if hvd.size() == 1:
        return data
    root = hvd.rank() == root_rank
    length = torch.tensor([-1 if not root or data is None else len(data)], dtype=torch.int64)
    length = int(wait(hvd.broadcast_async(length, root_rank=root_rank, name=name + ".len"))[0])
    if length < 0:
        return None
    out = None if root else bytearray(length)
    for start in range(0, length, chunk_bytes):
        stop = min(start + chunk_bytes, length)
        piece = torch.frombuffer(bytearray(data[start:stop]), dtype=torch.uint8) if root \
            else torch.empty(stop - start, dtype=torch.uint8)
        wait(hvd.broadcast_async_(piece, root_rank=root_rank,
                                  name=f"{name}.{start // chunk_bytes}"))
        if not root:
            out[start:stop] = piece.numpy().tobytes()
    return bytes(data) if root else bytes(out)


def _check_number(value, key=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        where = f" at key {key!r}" if key is not None else ""
        raise TypeError(f"allreduce sums numbers; got {type(value).__name__} {value!r}{where}")
