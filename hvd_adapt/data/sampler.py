"""The elastic sampler: deterministic per-epoch shuffles, partitioned over the current replicas.

The sampler knows only (seed, epoch, samples consumed so far) and the current
world, which is enough to resume exactly after a resize, a failure or a full
restart. Each step takes the next ``num_replicas * local_bsz`` samples of the
epoch's permutation and deals them out by rank, so what the world has consumed
is always a prefix of the permutation and the rest of the epoch can be
re-partitioned over any new world at any step.
"""
import math

import numpy as np
import torch

from .._checks import check_int
from .._runtime import env
from ..elastic.participant import Participant


class ElasticSampler(torch.utils.data.Sampler, Participant):
    """Deterministic per-epoch shuffles, partitioned over the current replicas.

    ``position`` counts the samples of the current epoch that the whole world
    has consumed; it is what the elastic state saves. Iterating the sampler
    directly yields this rank's share of the rest of the epoch (for a plain
    ``DataLoader``); call :meth:`advance` with the world's sample count as
    batches complete. :class:`AdaptiveDataLoader` does all of this itself.

    >>> s = ElasticSampler(range(10), shuffle=False)
    >>> [list(b) for b, _ in s.batches(local_bsz=2, num_replicas=2, rank=0)]
    [[0, 2], [4, 6], [8]]
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError(f"an elastic sampler needs a map-style dataset (with __len__ and "
                             f"__getitem__), got the IterableDataset {type(dataset).__name__}: "
                             "materialise it, or wrap its items in a map-style Dataset")
        num_samples = len(dataset)
        if num_samples == 0:
            raise ValueError("ElasticSampler needs a non-empty dataset")
        check_int("seed", seed, 0)
        self.num_samples = num_samples
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.pass_index = 0
        self.position = 0

    def set_epoch(self, epoch):
        """Move to ``epoch``; its position restarts at 0 unless it is already the current one."""
        check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self.pass_index = 0
            self.position = 0

    def next_pass(self):
        """Start another pass over the data within the same epoch, in a new order.

        Used when epochs are measured in training progress rather than in
        passes (see ``AdaptiveDataLoader.autoscale_batch_size``).
        """
        self.pass_index += 1
        self.position = 0

    def finish_pass(self):
        """Mark the rest of this pass as consumed (the epoch ended early)."""
        self.position = self.num_samples

    def permutation(self):
        """The order in which this epoch visits the dataset, the same on every replica."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, self.epoch, self.pass_index]).permutation(
            self.num_samples)

    @property
    def remaining(self):
        """Samples of this epoch not yet consumed by the world."""
        return self.num_samples - self.position

    def advance(self, count):
        """Record that the world consumed ``count`` more samples of this epoch."""
        check_int("count", count, 0, self.remaining)
        self.position += count

    def num_batches(self, local_bsz, num_replicas, drop_last=False, samples=None):
        """Batches each replica gets at ``local_bsz`` from ``samples`` (default: what is left
        of this epoch)."""
        rounding = math.floor if drop_last else math.ceil
        samples = self.remaining if samples is None else samples
        return rounding(samples / (num_replicas * local_bsz))

    def batches(self, local_bsz, num_replicas, rank, drop_last=False):
        """Yield ``(indices, world_count)`` for this rank's batches in the rest of the epoch.

        ``world_count`` is how many real samples the whole world consumes with
        that step. Only the last step can be short; there every rank gets the
        same number of indices, the shortfall filled (padded) with samples of
        that step, which :meth:`padding` reports. With ``drop_last`` a short
        last step is not yielded at all.
        """
        check_int("local_bsz", local_bsz, 1)
        check_int("num_replicas", num_replicas, 1)
        check_int("rank", rank, 0, num_replicas - 1)
        perm = self.permutation()
        step = num_replicas * local_bsz
        for start in range(self.position, self.num_samples, step):
            chunk = perm[start:start + step]
            if drop_last and len(chunk) < step:
                return
            mine = chunk[rank::num_replicas]
            want = math.ceil(len(chunk) / num_replicas)
            if len(mine) < want:
                # Pad with samples of this step, so that the duplicates stay
                # near in the permutation and every rank keeps in lock-step.
                extra = chunk[(rank + num_replicas * np.arange(len(mine), want)) % len(chunk)]
                mine = np.concatenate([mine, extra])
            yield mine.tolist(), len(chunk)

    @staticmethod
    def padding(world_count, num_replicas, rank):
        """How many trailing indices of a batch are padding, for a step of ``world_count`` samples."""
        want = math.ceil(world_count / num_replicas)
        real = len(range(rank, world_count, num_replicas))
        return want - real

    def __iter__(self):
        size, rank = env.size(), env.rank()
        for indices, _ in self.batches(1, size, rank):
            yield from indices

    def __len__(self):
        return math.ceil(self.remaining / env.size())

    def state_dict(self):
        return {"epoch": self.epoch, "pass_index": self.pass_index, "position": self.position,
                "seed": self.seed, "shuffle": self.shuffle, "num_samples": self.num_samples}

    def load_state_dict(self, state):
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"sampler state is for a dataset of {state['num_samples']} samples, "
                             f"this one has {self.num_samples}")
        self.epoch, self.position = state["epoch"], state["position"]
        self.pass_index = state["pass_index"]
        self.seed, self.shuffle = state["seed"], state["shuffle"]
