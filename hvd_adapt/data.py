"""Elastic data: a resumable sampler and the loader that drives it.

The sampler knows only (seed, epoch, samples consumed so far) and the current
world, which is enough to resume exactly after a resize, a failure or a full
restart. Each step takes the next ``num_replicas * local_bsz`` samples of the
epoch's permutation and deals them out by rank, so what the world has consumed
is always a prefix of the permutation and the rest of the epoch can be
re-partitioned over any new world at any step.
"""
import math
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from . import collective, env
from .epoch import current_epoch
from ._blas import import_scipy_optimize
from .goodput import AutoscaleConfig
from .metrics import StepProfile


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low \
            or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")


class ElasticSampler(torch.utils.data.Sampler):
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
        num_samples = len(dataset)
        if num_samples == 0:
            raise ValueError("ElasticSampler needs a non-empty dataset")
        _check_int("seed", seed, 0)
        self.num_samples = num_samples
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.pass_index = 0
        self.position = 0

    def set_epoch(self, epoch):
        """Move to ``epoch``; its position restarts at 0 unless it is already the current one."""
        _check_int("epoch", epoch, 0)
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
        _check_int("count", count, 0, self.remaining)
        self.position += count

    def num_batches(self, local_bsz, num_replicas):
        """Batches each replica still gets this epoch at ``local_bsz``."""
        return math.ceil(self.remaining / (num_replicas * local_bsz))

    def batches(self, local_bsz, num_replicas, rank):
        """Yield ``(indices, world_count)`` for this rank's batches in the rest of the epoch.

        ``world_count`` is how many real samples the whole world consumes with
        that step. Only the last step can be short; there every rank gets the
        same number of indices, the shortfall filled (padded) with samples of
        that step, which :meth:`padding` reports.
        """
        _check_int("local_bsz", local_bsz, 1)
        _check_int("num_replicas", num_replicas, 1)
        _check_int("rank", rank, 0, num_replicas - 1)
        perm = self.permutation()
        step = num_replicas * local_bsz
        for start in range(self.position, self.num_samples, step):
            chunk = perm[start:start + step]
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


class _Plan(torch.utils.data.Sampler):
    """A fixed list of index batches, handed to torch's DataLoader as its batch_sampler."""

    def __init__(self, batches):
        self._batches = batches

    def __iter__(self):
        return iter(self._batches)

    def __len__(self):
        return len(self._batches)


class AdaptiveDataLoader:
    """A DataLoader whose ``batch_size`` is the global batch of the whole world.

    Each replica loads ``ceil(batch_size / size)`` samples per step until
    :meth:`autoscale_batch_size` lets hvd_adapt choose the local batch and the
    gradient accumulation steps for goodput. Iteration resumes mid-epoch after
    a restore, and the rest of an epoch is re-partitioned after a resize.

    >>> loader = AdaptiveDataLoader(dataset, batch_size=128, shuffle=True, num_workers=2)
    >>> for x, y in loader:
    ...     real = len(x) - loader.num_padded   # padding only in an epoch's last batch

    Every other keyword goes to ``torch.utils.data.DataLoader``; ``sampler`` and
    ``batch_sampler`` are rejected since the elastic sampler decides the order.
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, seed=0, **kwargs):
        _check_int("batch_size", batch_size, 1)
        for key in ("sampler", "batch_sampler", "drop_last"):
            if key in kwargs:
                raise ValueError(f"AdaptiveDataLoader does not take {key}={kwargs[key]!r}: "
                                 "the elastic sampler decides which samples each replica loads")
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = ElasticSampler(dataset, shuffle=shuffle, seed=seed)
        self._kwargs = kwargs
        self.profile = StepProfile()
        self.num_padded = 0
        self._autoscale = None
        self._choice = None
        self._micro = 0
        self._optimizer = None
        self._needs_decision = True
        self._steps_since_decision = 0
        self._epochs_by_progress = False
        self._epoch_progress_start = 0.0

    # -- what the current choice is ------------------------------------------------
    def _default_choice(self, num_replicas):
        if self._autoscale is None:
            return math.ceil(self.batch_size / num_replicas), 0
        return self._autoscale.default(num_replicas)

    @property
    def current_local_bsz(self):
        """Samples each replica loads per step (the atomic batch size)."""
        return self._current()[0]

    @property
    def accumulation_steps(self):
        """Steps that only accumulate gradients before each optimizer step."""
        return self._current()[1]

    @property
    def current_batch_size(self):
        """Global samples per optimizer step: size * local bsz * (accumulation steps + 1)."""
        local, accum = self._current()
        return env.size() * local * (accum + 1)

    def _current(self):
        if self._choice is None or self._choice[2] != env.size():
            return self._default_choice(env.size())
        return self._choice[:2]

    @property
    def choice(self):
        """``(local_bsz, accumulation_steps, num_replicas)`` last decided, or None before autoscaling
        decided anything; ``num_replicas`` is the world size the choice was made for."""
        return self._choice

    def is_optim_step(self):
        """True when the batch just handed out ends an accumulation cycle."""
        return self._micro == 0

    # -- autoscaling -----------------------------------------------------------------
    def autoscale_batch_size(self, max_batch_size, local_bsz_bounds=None,
                             gradient_accumulation=False, decide_every=50,
                             epochs_by_progress=False):
        """Let hvd_adapt choose the batch size for goodput, up to ``max_batch_size``.

        ``local_bsz_bounds=(lo, hi)`` bounds the per-replica atomic batch; a
        ``hi`` that fits in device memory is the guard against out-of-memory
        errors (see :func:`hvd_adapt.probe_max_local_bsz`). With
        ``gradient_accumulation`` a replica may accumulate several atomic
        batches per optimizer step. The choice is made on rank 0 and
        broadcast: before the first batch, after every resize and restore, and
        every ``decide_every`` optimizer steps (counted across epochs).

        With ``epochs_by_progress`` an epoch lasts as much training progress
        as one pass at the initial batch size: len(dataset) / batch_size
        steps at B0, where a step at a larger batch counts its AdaScale gain
        (Pollux's rule). An epoch then ends mid-pass, or goes on into further
        passes over the data (each its own shuffle, each sample once per
        pass), until the progress is made. Without it (the default) an epoch
        is one pass and every sample is seen exactly once per epoch.
        """
        self._autoscale = AutoscaleConfig.create(self.batch_size, max_batch_size,
                                                 local_bsz_bounds, gradient_accumulation,
                                                 decide_every)
        if not isinstance(epochs_by_progress, bool):
            raise ValueError(f"epochs_by_progress must be True or False, got {epochs_by_progress!r}")
        self._epochs_by_progress = epochs_by_progress
        self._needs_decision = True
        if env.initialized() and env.rank() == 0:
            # The rank that fits loads scipy now rather than mid-training.
            import_scipy_optimize()

    def _decide(self):
        """Collective: all ranks adopt rank 0's choice of (local bsz, accumulation steps)."""
        self._needs_decision = False
        self._steps_since_decision = 0
        if self._autoscale is None:
            return
        size = env.size()
        choice = None
        if env.rank() == 0:
            current = self._current()
            grad_params = None
            if self._optimizer is not None and self._optimizer.gns.has_estimate():
                grad_params = self._optimizer.gns.grad_params(self.batch_size)
            choice = self._autoscale.choose(self.profile, grad_params, env.num_nodes(), size, current,
                                            forced=self._choice is None or self._choice[2] != size)
        if size > 1:
            # Rank 0 may have spent a while fitting the throughput model.
            collective.barrier()
            choice = collective.broadcast_object(choice)
        self._choice = (choice[0], choice[1], size)

    def request_decision(self):
        """Re-decide the batch size before the next batch (after a resize, say)."""
        self._needs_decision = True

    # -- iteration -------------------------------------------------------------------
    def _next_pass_epoch(self):
        """The epoch that iterating now would visit: the loop's, or the next once one is done."""
        epoch = current_epoch()
        if epoch is not None:
            return epoch
        return self.sampler.epoch + 1 if self.sampler.remaining == 0 else self.sampler.epoch

    def _start_pass(self):
        epoch = self._next_pass_epoch()
        if epoch != self.sampler.epoch:
            self._epoch_progress_start = self._progress()
        self.sampler.set_epoch(epoch)

    def _progress(self):
        return self._optimizer.gns.progress if self._optimizer is not None else 0.0

    def _epoch_progress_made(self):
        """With epochs_by_progress: has this epoch made one B0-pass of progress?"""
        needed = self.sampler.num_samples / self.batch_size
        return self._progress() - self._epoch_progress_start >= needed - 1e-9

    def _torch_loader(self, plan):
        generator = torch.Generator()
        generator.manual_seed(hash((self.sampler.seed, self.sampler.epoch,
                                    self.sampler.position, env.rank())) & 0x7FFFFFFF)
        return DataLoader(self.dataset, batch_sampler=_Plan(plan), generator=generator,
                          **self._kwargs)

    def __iter__(self):
        by_progress = self._epochs_by_progress and self._autoscale is not None
        if by_progress and self._optimizer is None:
            raise RuntimeError("epochs_by_progress needs an hvd_adapt.DistributedOptimizer "
                               "in the same hvd_adapt.State as this loader")
        self._start_pass()
        self._micro = 0
        while True:
            yield from self._iterate_pass(by_progress)
            if not by_progress or self._epoch_progress_made():
                break
            self.sampler.next_pass()
        self.num_padded = 0

    def _iterate_pass(self, by_progress):
        while self.sampler.remaining > 0:
            if self._needs_decision:
                self._decide()
            local, accum = self._current()
            size, rank, nodes = env.size(), env.rank(), env.num_nodes()
            plan = list(self.sampler.batches(local, size, rank))
            last = None
            for i, batch in enumerate(self._torch_loader([idx for idx, _ in plan])):
                now = time.perf_counter()
                if last is not None and i > 1:
                    # The first step of a plan pays for warm-up; leave it out.
                    self.profile.record(nodes, size, local, now - last[0], optim=last[1])
                world_count = plan[i][1]
                final = i == len(plan) - 1
                self._micro = 0 if (self._micro == accum or final) else self._micro + 1
                # Only an epoch's last step can be short, and so padded.
                self.num_padded = ElasticSampler.padding(world_count, size, rank) if final else 0
                self.sampler.advance(world_count)
                last = (now, self.is_optim_step())
                yield batch
                if not self.is_optim_step():
                    continue
                if by_progress and self._epoch_progress_made():
                    self.sampler.finish_pass()
                    return
                if final:
                    continue
                self._steps_since_decision += 1
                if self._autoscale is not None \
                        and self._steps_since_decision >= self._autoscale.decide_every:
                    self._needs_decision = True
                if self._needs_decision:
                    started = time.perf_counter()
                    self._decide()
                    if self._current() != (local, accum):
                        break
                    # Deciding is not part of the step the profile times.
                    last = (last[0] + time.perf_counter() - started, last[1])

    def __len__(self):
        """Batches this replica gets from here to the end of the pass that iterating would make."""
        local, _ = self._current()
        if self._next_pass_epoch() != self.sampler.epoch:
            return math.ceil(self.sampler.num_samples / (env.size() * local))
        return self.sampler.num_batches(local, env.size())

    # -- elastic state ---------------------------------------------------------------
    def state_dict(self):
        return {"sampler": self.sampler.state_dict(), "profile": self.profile.state_dict(),
                "choice": self._choice, "epoch_progress_start": self._epoch_progress_start}

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state["sampler"])
        self.profile.load_state_dict(state["profile"])
        self._choice = state["choice"]
        self._epoch_progress_start = state["epoch_progress_start"]
        self._micro = 0
        self._needs_decision = True

    def to_tensorboard(self, writer, step, tag_prefix="hvd_adapt"):
        """Write batch size, accumulation, gain and throughput to a TensorBoard writer."""
        from .tensorboard import write_loader_metrics
        write_loader_metrics(self, writer, step, tag_prefix)

    def progress_line(self):
        """One line of text: global batch, local batch, accumulation, gain, samples/s."""
        local, accum = self._current()
        gain = ""
        if self._optimizer is not None and self._optimizer.gns.has_estimate():
            gain = f" gain={self._optimizer.gns.gain(self.current_batch_size, self.batch_size):.2f}"
        rate = self.profile.throughput(env.num_nodes(), env.size(), local, accum)
        rate_text = f" samples/s={rate:.1f}" if rate else ""
        return (f"bsz={self.current_batch_size} local_bsz={local} accum={accum}"
                f"{gain}{rate_text} replicas={env.size()}")
