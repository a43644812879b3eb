"""AdaptiveDataLoader: plans each replica's batches from the elastic sampler and iterates them.

What a plan holds (local batch, accumulation steps) comes from the loader's
:class:`~hvd_adapt.autoscale.controller.Controller`; the loader times the
steps it hands out and tells the controller, and re-plans the rest of the
pass when the controller decides on another batch size.
"""
import os
import time

import torch
from torch.utils.data import DataLoader

from .._checks import check_bool, check_int
from .._runtime import env
from .._runtime.blas import import_scipy_optimize
from .._runtime.context import CONTEXT
from ..autoscale.controller import MIN_SPLIT_BSZ, Controller
from ..autoscale.policy import AutoscalePolicy
from ..elastic.epoch import current_epoch
from ..elastic.participant import Participant
from .sampler import ElasticSampler


class _Plan(torch.utils.data.Sampler):
    """The index batches of the current plan, handed to torch's DataLoader as its
    batch_sampler; :meth:`set` gives it the next plan (torch takes an iterator of the
    list at each pass, so a pass under way keeps its own)."""

    def __init__(self, batches):
        self._batches = batches

    def set(self, batches):
        """Plan ``batches`` for the next pass of torch's loader."""
        self._batches = batches

    def __iter__(self):
        return iter(self._batches)

    def __len__(self):
        return len(self._batches)


def _split_in_halves(plan, steps_to_split, num_replicas):
    """``(indices, world_count, half)`` for each batch of ``plan``; the steps
    ``steps_to_split(len(plan))`` names become two batches of half the indices each.
    Only full steps are split (a short last one holds padding): each replica's
    indices are interleaved with the others' in the world's order, so the world's
    first half is ``num_replicas`` times a replica's."""
    split = set(steps_to_split(len(plan)))
    out = []
    for step, (indices, world_count) in enumerate(plan):
        if step in split and len(indices) >= MIN_SPLIT_BSZ \
                and world_count == num_replicas * len(indices):
            middle = len(indices) // 2
            out += [(indices[:middle], num_replicas * middle, True),
                    (indices[middle:], world_count - num_replicas * middle, True)]
        else:
            out.append((indices, world_count, False))
    return out


class AdaptiveDataLoader(Participant):
    """A DataLoader whose ``batch_size`` is the global batch of the whole world.

    Each replica loads ``ceil(batch_size / size)`` samples per step until
    :meth:`autoscale_batch_size` lets hvd_adapt choose the local batch and the
    gradient accumulation steps for goodput. Iteration resumes mid-epoch after
    a restore, and the rest of an epoch is re-partitioned after a resize.
    Iterated again in the same epoch (a validation loader read mid-epoch and
    at its end), it makes another full pass; a pass found finished in
    restored state is not repeated.
    While the noise scale is measured with one replica and no accumulation,
    one optimizer step in four comes as two batches of half the local batch
    (an accumulation cycle of two; the optimizer steps on the second), so
    that two gradients of the same weights measure the noise. Several
    replicas split steps so while an autoscaling world has timed one local
    batch size only (its first ``decide_every`` steps), so that the first
    decision knows how step time grows with the batch.
    Only an epoch's last batch can be padded (so every rank takes the same
    number of steps); ``num_padded`` says how many of its trailing samples
    repeat others.

    >>> import hvd_adapt, torch
    >>> from torch.utils.data import TensorDataset
    >>> hvd_adapt.init()
    >>> loader = AdaptiveDataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    >>> [len(x) - loader.num_padded for (x,) in loader]
    [4, 4, 2]

    ``drop_last=True`` leaves out an epoch's last step when it is shorter
    than a full one (``size * local_bsz`` samples), on every rank alike, so
    no replica trains on a tiny batch (BatchNorm refuses a batch of one).
    The samples it leaves out are not trained in that epoch; each epoch's
    shuffle differs, so they differ from epoch to epoch. Without it every
    sample is trained exactly once per epoch. With accumulation the last
    cycle of an epoch may still have fewer steps than the others.

    ``len(loader)`` is the number of batches of the pass being iterated (or
    the next one): those handed out so far plus the rest at the current
    batch size, so it changes when the batch size does. A progress bar made
    before the pass can follow it with ``bar.total = len(loader)``.

    Every other keyword goes to ``torch.utils.data.DataLoader`` (``num_workers``,
    ``collate_fn``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
    ``multiprocessing_context``, ``prefetch_factor``, ``persistent_workers``,
    ``pin_memory_device``, ``in_order``), with torch's meaning: one torch loader
    serves every pass and re-plan, so ``persistent_workers=True`` keeps its
    worker processes across epochs and batch-size changes. ``sampler``,
    ``batch_sampler`` and ``generator`` are rejected since the elastic sampler
    decides the order and the loader seeds the workers from ``seed``, the
    epoch and the position (so a resumed pass loads alike).
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, seed=0, drop_last=False, **kwargs):
        check_int("batch_size", batch_size, 1)
        check_bool("drop_last", drop_last)
        for key in ("sampler", "batch_sampler", "generator"):
            if key in kwargs:
                raise ValueError(f"AdaptiveDataLoader does not take {key}={kwargs[key]!r}: "
                                 "the elastic sampler decides which samples each replica "
                                 "loads, and seed= seeds the workers")
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = ElasticSampler(dataset, shuffle=shuffle, seed=seed)
        self.controller = Controller(batch_size)
        self.drop_last = drop_last
        self.num_padded = 0
        self._plan = _Plan([])
        # One torch loader for every pass and re-plan (persistent workers stay);
        # made now, so torch checks the keywords here rather than at the first batch.
        self._torch = DataLoader(dataset, batch_sampler=self._plan,
                                 generator=torch.Generator(), **kwargs)
        self._handed_out = None  # batches of the pass being iterated so far; None between passes
        self._plan_left = 0      # batches of the current plan not yet handed out
        # True once this process iterated a pass to its end since the last
        # restore: iterating again in the same epoch is then a new pass (a
        # validation loader read twice), while a pass found finished in
        # restored state is skipped (the re-run after a reset resumes).
        self._finished_pass_here = False

    # -- what the current plan is ----------------------------------------------------
    @property
    def current_local_bsz(self):
        """Samples each replica loads per step (the atomic batch size)."""
        return self.controller.local_bsz

    @property
    def accumulation_steps(self):
        """Steps that only accumulate gradients before each optimizer step."""
        return self.controller.accumulation_steps

    @property
    def current_batch_size(self):
        """Global samples per optimizer step: size * local bsz * (accumulation steps + 1)."""
        return self.controller.batch_size

    @property
    def choice(self):
        """``(local_bsz, accumulation_steps, num_replicas)`` last decided, or None before
        autoscaling decided anything."""
        return self.controller.choice

    def is_optim_step(self):
        """True when the batch just handed out ends an accumulation cycle."""
        return self.controller.is_optim_step()

    def autoscale_batch_size(self, max_batch_size, local_bsz_bounds=None,
                             gradient_accumulation=False, decide_every=50,
                             epochs_by_progress=False, hints_path=None, hints_max_replicas=64):
        """Let hvd_adapt choose the batch size for goodput, up to ``max_batch_size``.

        ``local_bsz_bounds=(lo, hi)`` bounds the per-replica atomic batch; a
        ``hi`` that fits in device memory is the guard against out-of-memory
        errors (see :func:`hvd_adapt.probe_max_local_bsz`). With
        ``gradient_accumulation`` a replica may accumulate several atomic
        batches per optimizer step. The choice is made on rank 0 and
        adopted by every rank: before the first batch, after every resize and
        restore, and every ``decide_every`` optimizer steps (counted across
        epochs). A choice at most doubles the global batch, and its atomic
        batch is at most twice the largest one timed, so a job grows its
        batch a doubling at a time, timing each size before it goes further.
        The batch stays within [``batch_size`` less rounding, ``max_batch_size``]
        and the local batch within ``local_bsz_bounds``; bounds the current
        world cannot keep raise ``ValueError`` naming the numbers (in an
        elastic job, and after a resize, a warning says what gives way:
        docs/autoscaling.md).

        With ``epochs_by_progress`` an epoch lasts as much training progress
        as one pass at the initial batch size: len(dataset) / batch_size
        steps at B0, where a step at a larger batch counts its AdaScale gain
        (Pollux's rule). An epoch then ends mid-pass, or goes on into further
        passes over the data (each its own shuffle, each sample once per
        pass), until the progress is made. Without it (the default) an epoch
        is one pass and every sample is seen exactly once per epoch.

        ``hints_path`` (default: the ``HVD_ADAPT_HINTS`` environment variable,
        none when unset): after every decision rank 0 writes there what
        1..``hints_max_replicas`` replicas would give (the format of
        :mod:`hvd_adapt.scheduling.hints`), for ``hvd-adapt-discover`` or a
        cluster scheduler to offer the job only the workers that pay.
        """
        # Settings the world cannot keep are refused here, in a job whose size the
        # user chose; an elastic job's size is the launcher's (a worker joining
        # a grown world runs this too), so there a decision logs what gives way.
        fixed_world = env.initialized() and not env.is_elastic()
        policy = AutoscalePolicy.create(self.batch_size, max_batch_size, local_bsz_bounds,
                                        gradient_accumulation, decide_every,
                                        env.size() if fixed_world else None)
        check_bool("epochs_by_progress", epochs_by_progress)
        check_int("hints_max_replicas", hints_max_replicas, 1)
        hints_path = hints_path or os.environ.get("HVD_ADAPT_HINTS") or None
        self.controller.configure(policy, epochs_by_progress, hints_path, hints_max_replicas)
        # Its decisions are collectives: a State must carry it.
        CONTEXT.collective_objects.add(self)
        if env.initialized() and env.rank() == 0:
            # The rank that fits loads scipy now rather than mid-training.
            import_scipy_optimize()

    # -- iteration -------------------------------------------------------------------
    def _next_pass_epoch(self):
        """The epoch that iterating now would visit: the loop's, or the next once one is done."""
        epoch = current_epoch()
        if epoch is not None:
            return epoch
        return self.sampler.epoch + 1 if self.sampler.remaining == 0 else self.sampler.epoch

    def _repeats_pass(self, epoch):
        return (epoch == self.sampler.epoch and self.sampler.remaining == 0
                and self._finished_pass_here)

    def _torch_loader(self, plan):
        self._plan.set(plan)
        # Workers' seeds (and a persistent loader's shared seed) come from the position.
        self._torch.generator.manual_seed(hash((self.sampler.seed, self.sampler.epoch,
                                                self.sampler.position, env.rank()))
                                          & 0x7FFFFFFF)
        return self._torch

    def __iter__(self):
        controller = self.controller
        by_progress = controller.epochs_by_progress and controller.autoscaling
        if by_progress and not controller.has_noise_scale:
            raise RuntimeError("epochs_by_progress needs an hvd_adapt.DistributedOptimizer "
                               "in the same hvd_adapt.State as this loader")
        epoch = self._next_pass_epoch()
        if epoch != self.sampler.epoch:
            controller.start_epoch()
        if self._repeats_pass(epoch):
            self.sampler.next_pass()
        self.sampler.set_epoch(epoch)
        self._finished_pass_here = False
        controller.start_cycles()
        try:
            while True:
                yield from self._iterate_pass(by_progress)
                if not by_progress or controller.epoch_ends(self.sampler.num_samples,
                                                            pass_ended=True):
                    break
                self.sampler.next_pass()
        finally:
            self._handed_out = None
            if not controller.is_optim_step():
                # Left inside an accumulation cycle (a break, a return): its
                # micro-steps are dropped, so commits and the next pass see a
                # closed cycle instead of waiting for one that never ends.
                controller.abandon_cycle()
        self.num_padded = 0
        self._finished_pass_here = True

    def _iterate_pass(self, by_progress):
        controller = self.controller
        self._handed_out = self._plan_left = 0
        while self.sampler.remaining > 0:
            if controller.decision_due:
                controller.decide()
            local, accum = controller.local_bsz, controller.accumulation_steps
            size, rank = env.size(), env.rank()
            plan = _split_in_halves(list(self.sampler.batches(local, size, rank, self.drop_last)),
                                    controller.steps_to_split, size)
            if not plan:
                # drop_last: what is left is less than one full step.
                self.sampler.finish_pass()
                return
            self._plan_left = len(plan)
            last = None
            # On CUDA the host runs ahead of the device: a step's time means the
            # same as on the CPU only once the device has finished it. One
            # synchronize per step, and only while the profile is used.
            device_sync = controller.autoscaling and torch.cuda.is_available() \
                and torch.cuda.is_initialized()
            for i, batch in enumerate(self._torch_loader([idx for idx, _, _ in plan])):
                if device_sync:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if last is not None and i > 1:
                    # The first step of a plan pays for warm-up; leave it out.
                    controller.record_step(now - last[0], last[2], optim=last[1])
                indices, world_count, half = plan[i]
                final = i == len(plan) - 1
                controller.next_micro_step(final, split_half=len(indices) if half else None)
                # Only an epoch's last step can be short, and so padded.
                self.num_padded = ElasticSampler.padding(world_count, size, rank) if final else 0
                self.sampler.advance(world_count)
                last = (now, controller.is_optim_step(), len(indices) if half else local)
                self._handed_out += 1
                self._plan_left -= 1
                yield batch
                if not controller.is_optim_step():
                    continue
                # A decision due after a pass's last step is made before the next pass's first.
                controller.optim_step_done()
                if by_progress and controller.epoch_ends(self.sampler.num_samples,
                                                         pass_ended=False):
                    self.sampler.finish_pass()
                    return
                if final:
                    continue
                if controller.decision_due:
                    # Deciding is not part of the step the profile times.
                    spent = controller.timed_decision()
                    if (controller.local_bsz, controller.accumulation_steps) != (local, accum):
                        break
                    last = (last[0] + spent,) + last[1:]

    def __len__(self):
        """Batches of the pass being iterated, or of the one iterating would start."""
        if self._handed_out is not None:
            return self._handed_out + self._plan_left
        local, size = self.controller.local_bsz, env.size()
        samples = None
        epoch = self._next_pass_epoch()
        if epoch != self.sampler.epoch or self._repeats_pass(epoch):
            samples = self.sampler.num_samples
        steps = self.sampler.num_batches(local, size, self.drop_last, samples=samples)
        return steps + len(self.controller.steps_to_split(steps))

    # -- elastic state ---------------------------------------------------------------
    def state_dict(self):
        return {"sampler": self.sampler.state_dict(), "controller": self.controller.state_dict()}

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state["sampler"])
        self.controller.load_state_dict(state["controller"])
        self._finished_pass_here = False

    def on_reset(self):
        self.controller.request_decision()
        self.controller.forget_epoch_verdict()
        self._finished_pass_here = False

    def at_commit_point(self):
        return self.controller.is_optim_step()

    def to_tensorboard(self, writer, step, tag_prefix="hvd_adapt"):
        """Write batch size, accumulation, gain and throughput to a TensorBoard writer."""
        from .tensorboard import write_metrics
        write_metrics(self.controller.metrics(), writer, step, tag_prefix)

    def progress_line(self):
        """One line of text: global batch, local batch, accumulation, gain, samples/s."""
        return self.controller.progress_line()
