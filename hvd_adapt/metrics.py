"""Step-time profile: what the throughput model is fitted on.

Step times are bucketed by (nodes, replicas, atomic bsz) and kept as sums and
counts, so the profile is small, merges by addition, and travels in the
elastic state: the profile rank 0 has gathered survives resizes and restarts.
"""
import math

import numpy as np

_FIELDS = ("accum_time", "accum_count", "optim_time", "optim_count", "sync_time", "sync_count")


class StepProfile:
    """Sums and counts of step times per (num_nodes, num_replicas, atomic_bsz).

    ``accum`` steps only accumulate gradients; ``optim`` steps also average them
    over replicas and update the model; ``sync`` is the part of an optim step
    spent in the gradient allreduce.

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
            bucket = self._buckets[key] = dict.fromkeys(_FIELDS, 0.0)
        return bucket

    def record(self, num_nodes, num_replicas, atomic_bsz, seconds, optim):
        """Add one step of ``seconds``; ``optim`` says whether it ended in an optimizer step."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        bucket = self._bucket(num_nodes, num_replicas, atomic_bsz)
        kind = "optim" if optim else "accum"
        bucket[kind + "_time"] += seconds
        bucket[kind + "_count"] += 1

    def record_sync(self, num_nodes, num_replicas, atomic_bsz, seconds):
        """Add the gradient-synchronisation part of one optimizer step."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        bucket = self._bucket(num_nodes, num_replicas, atomic_bsz)
        bucket["sync_time"] += seconds
        bucket["sync_count"] += 1

    def __len__(self):
        return sum(1 for b in self._buckets.values() if b["optim_count"] > 0)

    def arrays(self):
        """Per-bucket means as numpy arrays, for :func:`hvd_adapt.goodput.fit_perf_params`.

        Buckets without optimizer steps are left out. Where a bucket saw no
        accumulation step, its accumulation time is estimated as the optimizer
        step time less its synchronisation time.
        """
        rows = [(k, b) for k, b in sorted(self._buckets.items()) if b["optim_count"] > 0]
        keys = np.array([k for k, _ in rows], dtype=float).reshape(-1, 3)
        optim = np.array([b["optim_time"] / b["optim_count"] for _, b in rows])
        sync = np.array([b["sync_time"] / b["sync_count"] if b["sync_count"] else 0.0
                         for _, b in rows])
        accum = np.array([b["accum_time"] / b["accum_count"] if b["accum_count"]
                          else np.nan for _, b in rows])
        estimate = np.maximum(optim - sync, 0.5 * optim)
        accum = np.where(np.isnan(accum), estimate, accum)
        return {"num_nodes": keys[:, 0], "num_replicas": keys[:, 1], "atomic_bsz": keys[:, 2],
                "accum_step_time": accum, "optim_step_time": optim}

    def throughput(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Measured samples/s at this configuration, or None before any optimizer step."""
        bucket = self._buckets.get((int(num_nodes), int(num_replicas), int(atomic_bsz)))
        if not bucket or not bucket["optim_count"]:
            return None
        optim = bucket["optim_time"] / bucket["optim_count"]
        accum = bucket["accum_time"] / bucket["accum_count"] if bucket["accum_count"] else optim
        seconds = accum_steps * accum + optim
        return num_replicas * atomic_bsz * (accum_steps + 1) / seconds

    def state_dict(self):
        return {key: dict(bucket) for key, bucket in self._buckets.items()}

    def load_state_dict(self, state):
        self._buckets = {tuple(key): dict(bucket) for key, bucket in state.items()}
