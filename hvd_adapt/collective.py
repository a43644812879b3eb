"""Collectives over Python objects, on Horovod's own operations.

Each function is a collective: every replica of the world must call it, in the
same order, or the job hangs. With a world of one they return their input
without a round trip through Horovod's background thread.
"""
import numbers
import pickle
import time

import horovod.torch as hvd
import torch


def allreduce(value, name=None):
    """Sum a number, or a dict of numbers, over all replicas.

    Dicts may hold different keys on different replicas: a key missing on a
    replica counts as 0 there. Integers stay integers and are summed exactly,
    which is why dicts travel through one ``hvd.allgather_object`` rather than
    a float tensor.

    >>> allreduce({"loss": 0.5, "n": 2})   # on 2 replicas with equal inputs
    {'loss': 1.0, 'n': 4}
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
    summed = hvd.allreduce(torch.tensor([value], dtype=dtype), op=hvd.Sum, name=name)
    return summed.item()


def broadcast_object(obj, root_rank=0, name=None):
    """Return ``obj`` as given on ``root_rank``, on every replica (pickled).

    Unlike ``hvd.broadcast_object``, the default name does not depend on the
    type of ``obj``, so ranks may pass placeholders of another type (None).
    """
    if hvd.size() == 1:
        return obj
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name or "hvd_adapt.bcast")


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
    sizes, data = hvd.synchronize(sizes).tolist(), hvd.synchronize(data).numpy().tobytes()
    objects, start = [], 0
    for size in sizes:
        objects.append(pickle.loads(data[start:start + size]))
        start += size
    return objects


def barrier(name="hvd_adapt.barrier"):
    """Collective: return once every replica has called it, sleeping while it waits.

    Horovod's blocking operations wait in a loop of ``std::this_thread::yield``
    that keeps a core busy. Where a replica may wait long for another (rank 0
    fitting the goodput model, a new worker still starting up) and replicas
    share cores, the waiting ones slow down the very one they wait for. Call
    this before such a collective: it polls Horovod's handle with a sleep that
    grows to 10 ms, and the collective after it starts with everyone present.
    """
    if hvd.size() == 1:
        return
    handle = hvd.allreduce_async(torch.zeros(1), op=hvd.Sum, name=name)
    delay = 1e-4
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, 0.01)
    hvd.synchronize(handle)


def _check_number(value, key=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        where = f" at key {key!r}" if key is not None else ""
        raise TypeError(f"allreduce sums numbers; got {type(value).__name__} {value!r}{where}")
