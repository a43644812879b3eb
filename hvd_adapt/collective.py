"""Collectives over Python objects, on Horovod's own operations.

Each function is a collective: every replica of the world must call it, in the
same order, or the job hangs. With a world of one they return their input
without a round trip through Horovod's background thread.
"""
import numbers

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
    return hvd.allgather_object(obj, name=name or "hvd_adapt.allgather")


def _check_number(value, key=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        where = f" at key {key!r}" if key is not None else ""
        raise TypeError(f"allreduce sums numbers; got {type(value).__name__} {value!r}{where}")
