"""Step-time profile: what the throughput model is fitted on.

Step times are bucketed by (nodes, replicas, atomic bsz). Each bucket keeps
the most recent step times of each kind, so the profile stays small, follows
the machine as it is now, and travels in the elastic state: the profile rank
0 has gathered survives resizes and restarts.
"""
import collections
import math

import numpy as np

_KINDS = ("accum", "optim", "sync")
# Recent steps kept per bucket and kind: a few commit periods' worth.
_WINDOW = 64
# A step this many times the bucket's median is a stall (a garbage collection,
# another process taking the core), not a cost of the batch size. Left in, one
# 40 ms stall among 1 ms steps made a batch size look slow for the rest of a
# run, and the run never tried it again.
_STALL_FACTOR = 4.0


def _typical(times):
    """Mean step time, leaving out stalls; NaN when nothing was recorded."""
    if not times:
        return math.nan
    values = np.fromiter(times, dtype=float, count=len(times))
    return float(values[values <= _STALL_FACTOR * np.median(values)].mean())


class StepProfile:
    """Recent step times per (num_nodes, num_replicas, atomic_bsz).

    ``accum`` steps only accumulate gradients; ``optim`` steps also average them
    over replicas and update the model; ``sync`` is the part of an optim step
    spent in the gradient allreduce. A bucket's step time is the mean of its
    last 64 steps of that kind, leaving out stalls (steps over 4x the median).

    >>> p = StepProfile()
    >>> p.record(1, 2, 32, 0.10, optim=True)
    >>> p.record_sync(1, 2, 32, 0.02)
    >>> p.arrays()["optim_step_time"]
    array([0.1])
    """

    def __init__(self):
        self._buckets = {}

    def _bucket(self, num_nodes, num_replicas, atomic_bsz):
        key = (int(num_nodes), int(num_replicas), int(atomic_bsz))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = {k: collections.deque(maxlen=_WINDOW) for k in _KINDS}
        return bucket

    def record(self, num_nodes, num_replicas, atomic_bsz, seconds, optim):
        """Add one step of ``seconds``; ``optim`` says whether it ended in an optimizer step."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        self._bucket(num_nodes, num_replicas, atomic_bsz)["optim" if optim else "accum"].append(
            seconds)

    def record_sync(self, num_nodes, num_replicas, atomic_bsz, seconds):
        """Add the gradient-synchronisation part of one optimizer step."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        self._bucket(num_nodes, num_replicas, atomic_bsz)["sync"].append(seconds)

    def sizes(self, num_nodes, num_replicas):
        """The atomic batch sizes with optimizer steps timed in this world."""
        return {key[2] for key, b in self._buckets.items()
                if key[:2] == (int(num_nodes), int(num_replicas)) and b["optim"]}

    def __len__(self):
        return sum(1 for b in self._buckets.values() if b["optim"])

    def arrays(self):
        """Per-bucket step times as numpy arrays, for :func:`hvd_adapt.goodput.fit_perf_params`.

        Buckets without optimizer steps are left out. Where a bucket saw no
        accumulation step, its accumulation time is estimated as the optimizer
        step time less its synchronisation time.
        """
        rows = [(k, b) for k, b in sorted(self._buckets.items()) if b["optim"]]
        keys = np.array([k for k, _ in rows], dtype=float).reshape(-1, 3)
        optim = np.array([_typical(b["optim"]) for _, b in rows])
        sync = np.nan_to_num(np.array([_typical(b["sync"]) for _, b in rows]))
        accum = np.array([_typical(b["accum"]) for _, b in rows])
        estimate = np.maximum(optim - sync, 0.5 * optim)
        accum = np.where(np.isnan(accum), estimate, accum)
        return {"num_nodes": keys[:, 0], "num_replicas": keys[:, 1], "atomic_bsz": keys[:, 2],
                "accum_step_time": accum, "optim_step_time": optim}

    def throughput(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Measured samples/s at this configuration, or None before any optimizer step."""
        bucket = self._buckets.get((int(num_nodes), int(num_replicas), int(atomic_bsz)))
        if not bucket or not bucket["optim"]:
            return None
        optim = _typical(bucket["optim"])
        accum = _typical(bucket["accum"]) if bucket["accum"] else optim
        seconds = accum_steps * accum + optim
        return num_replicas * atomic_bsz * (accum_steps + 1) / seconds

    def state_dict(self):
        return {key: {kind: tuple(times) for kind, times in bucket.items()}
                for key, bucket in self._buckets.items()}

    def load_state_dict(self, state):
        self._buckets = {tuple(key): {kind: collections.deque(bucket[kind], maxlen=_WINDOW)
                                      for kind in _KINDS}
                         for key, bucket in state.items()}
