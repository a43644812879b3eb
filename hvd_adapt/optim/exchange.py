"""Gradient averaging from per-parameter hooks, overlapped with the backward pass.

Parameters are grouped into buckets, as DDP groups them: in reverse order of
registration (roughly the order backward produces their gradients), up to
``bucket_cap_mb`` each, one dtype and device per bucket. A bucket's grouped
Horovod allreduce starts as soon as all its gradients are accumulated, so
communication overlaps the rest of backward, but only on the last micro-step
of an accumulation cycle. By default buckets are 25 MB for GPU parameters
(DDP's default; NCCL runs beside the compute) and 4 MB for CPU ones: on the
CPU, where Gloo's reductions share the cores with backward, a bucket about
a layer's size reduced while the next layer's gradient is computed
pipelines best: one bucket after backward, or 25 MB ones, cost more a step
at two processes (``benchmarks/RESULTS.md``).
Earlier micro-steps accumulate into ``.grad`` with no communication and no
extra copy. Unlike Horovod's, the averaged gradients are waited for at the
end of that backward pass (as DDP does), so when ``loss.backward()`` returns
every rank holds the same gradients: clipping, ``GradScaler.unscale_`` and its skip
decision see averaged values, and a rank that then skips ``step()`` leaves
no collective behind.

The squared norms the noise scale needs are taken on the device before
anything is averaged: a bucket's together, just before its allreduce starts,
where ``.grad`` holds one micro-batch's gradient (the first micro-step of a
cycle), else each gradient in its hook before it is accumulated.
"""
import contextlib
import functools
import time

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from torch.autograd import Variable

from .noise import group_sqnorms, sqnorm, stats_dtype, total_sqnorm

# Default bucket caps when bucket_cap_mb is None (see the module's docstring).
GPU_BUCKET_MB = 25
CPU_BUCKET_MB = 4


class Cycle:
    """What one backward pass must do; the optimizer answers it before each backward.

    ``last``: it ends an accumulation cycle, so the gradients are averaged.
    ``measure``: take the squared norms the noise scale needs (of every
    micro-batch's gradient, and of the cycle's mean).
    """

    def __init__(self, last, measure, replicas):
        self.last, self.measure, self.replicas = last, measure, replicas


class Measurement:
    """One cycle's squared norms per group (float64 device tensors): ``local`` is the mean
    over micro-batches of each one's, ``total`` the mean gradient's, over ``num_micro``
    micro-batches."""

    def __init__(self, local, total, num_micro):
        self.local, self.total, self.num_micro = local, total, num_micro


class GradientExchange:
    """Hooks on every trainable parameter of ``param_groups`` that average gradients.

    ``plan()`` returns the :class:`Cycle` for the backward pass starting;
    ``denominators(params)`` a dict from each of ``params`` to the tensor its
    gradient is divided by before its norm is taken, or None. After the last
    micro-step's backward, :attr:`stats` holds its :class:`Measurement` when
    one was taken (else None), :attr:`finished` its :class:`Cycle`, and
    :attr:`sync_seconds` the time spent waiting for the allreduces; the
    optimizer takes them with :meth:`take_finished`.
    """

    def __init__(self, param_groups, plan, denominators, compression, op,
                 gradient_predivide_factor, bucket_cap_mb=None):
        self._groups = [[p for p in group["params"] if p.requires_grad] for group in param_groups]
        self._group_index = {p: index for index, group in enumerate(self._groups) for p in group}
        # One grouped allreduce per bucket: on small models per-tensor
        # operations cost more than they overlap (benchmarks/RESULTS.md).
        # Made at the first backward, when the parameters are on their device.
        self._bucket_cap_mb = bucket_cap_mb
        self._buckets = self._bucket_of = self._ready = None
        self._plan = plan
        self._compute_denominators = denominators
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._cycle = None        # the plan of the backward pass under way
        self._micro_steps = 0     # backward passes so far in this accumulation cycle
        self._cycles = 0          # cycles finished since the replicas were last synced
        self._micro_sqr = None    # per group, summed over this cycle's micro-batches
        self._handles = {}
        # Parameters whose .grad will hold this micro-batch's gradient alone
        # once accumulated: their norms are taken a bucket at a time. A dict
        # keeps backward's order, so the sums are the same from run to run.
        self._pending = {}
        # Each parameter's denominator while a measured cycle is under way:
        # optimizer state changes only at step(), so the one taken for a
        # micro-batch's norm serves the cycle's other micro-batches and the
        # mean gradient's norm (Adam's costs several passes over the tensor).
        self._denominators = {}
        self.stats = None
        self.finished = None
        self.sync_seconds = 0.0
        self._hooks = []
        for group_index, group in enumerate(self._groups):
            for p in group:
                self._hooks.append(p.register_hook(
                    functools.partial(self._on_grad, group_index, p)))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_accumulated))

    def remove(self):
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def cycle_open(self):
        """True between the micro-steps of an accumulation cycle (gradients must be kept)."""
        return self._micro_steps > 0

    @property
    def cycles_since_sync(self):
        """Accumulation cycles finished since the last :meth:`discard` (every sync and reset
        discards): the same count on every replica."""
        return self._cycles

    def discard(self):
        """Forget the cycle (after a reset: handles of the old world are dead)."""
        self._cycle, self._micro_steps, self._micro_sqr = None, 0, None
        self._cycles = 0
        self._handles = {}
        self._pending = {}
        self._denominators = {}
        if self._buckets is not None:
            self._ready = [0] * len(self._buckets)
        self.take_finished()

    def take_finished(self):
        """``(cycle, measurement, sync_seconds)`` of the last finished cycle, or
        None; cleared by the call (a skipped step's are dropped by the next ``zero_grad``)."""
        if self.finished is None:
            return None
        taken = (self.finished, self.stats, self.sync_seconds)
        self.finished, self.stats, self.sync_seconds = None, None, 0.0
        return taken

    # -- hooks -------------------------------------------------------------------------
    def _make_buckets(self):
        params = [p for group in self._groups for p in group]
        cap = self._bucket_cap_mb
        if cap is None:
            cap = GPU_BUCKET_MB if any(p.is_cuda for p in params) else CPU_BUCKET_MB
        self._buckets = _buckets(params, cap * 2 ** 20)
        self._bucket_of = {p: index for index, bucket in enumerate(self._buckets) for p in bucket}
        self._ready = [0] * len(self._buckets)

    def _start_backward(self):
        if self._buckets is None:
            self._make_buckets()
        self._cycle = self._plan()
        # Runs once the whole backward pass is done, on the thread that ran it.
        Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, group_index, p, grad):
        # The gradient of this micro-batch alone, before it is added to .grad.
        if self._cycle is None:
            self._start_backward()
        if self._cycle.measure:
            if self._micro_steps == 0 and p.grad is None:
                self._pending[p] = None
            else:
                denominator = self._denominators_of([p])[0]
                self._add_micro_sqr(group_index,
                                    sqnorm(grad if denominator is None else grad / denominator))
        return None

    def _add_micro_sqr(self, group_index, value):
        if self._micro_sqr is None:
            self._micro_sqr = torch.zeros(len(self._groups), dtype=torch.float64,
                                          device=value.device)
        self._micro_sqr[group_index] += value

    def _measure_pending(self, params):
        """Add the micro-batch norms of those of ``params`` whose ``.grad`` is this
        micro-batch's gradient alone, with a few multi-tensor operations per group."""
        by_group = {}
        for p in params:
            if p in self._pending:
                del self._pending[p]
                by_group.setdefault(self._group_index[p], []).append(p)
        for group_index, members in by_group.items():
            self._add_micro_sqr(group_index, total_sqnorm(
                [p.grad for p in members], self._denominators_of(members)))

    def _on_accumulated(self, p):
        if self._cycle is None:
            self._start_backward()
        if self._cycle.last and self._cycle.replicas > 1:
            index = self._bucket_of[p]
            self._ready[index] += 1
            # When measuring, the last bucket waits for the end of backward and
            # carries the local norms: one Horovod operation fewer a step.
            deferred = self._cycle.measure and index == len(self._buckets) - 1
            if self._ready[index] == len(self._buckets[index]) and not deferred:
                self._measure_pending(self._buckets[index])
                self._start_allreduce(index, self._micro_steps + 1)

    def _start_allreduce(self, index, micro, extra=None):
        """Average bucket ``index`` over ``micro`` micro-steps and the replicas."""
        prescale = 1.0 / micro
        postscale = 1.0
        if self._op == hvd.Average:
            # As Horovod splits the average: the backend divides by size() after this.
            prescale /= self._predivide
            postscale = self._predivide
        bucket = self._buckets[index]
        compressed = [self._compression.compress(p.grad) for p in bucket]
        tensors = [tensor for tensor, _ in compressed] + ([] if extra is None else [extra])
        with _naming_the_cause(index):
            handle = hvd.grouped_allreduce_async_(
                tensors, name=f"hvd_adapt.grad.{index}", op=self._op,
                prescale_factor=prescale, postscale_factor=postscale)
        self._handles[index] = (handle, compressed, extra is not None)

    def _end_backward(self):
        cycle, self._cycle = self._cycle, None
        self._measure_pending(list(self._pending))
        if not cycle.last:
            self._micro_steps += 1
            return
        micro = self._micro_steps + 1
        self._micro_steps = 0
        self._cycles += 1
        params = [p for group in self._groups for p in group]
        local, micro_sqr, self._micro_sqr = None, self._micro_sqr, None
        extra = stats_handle = None
        if cycle.replicas > 1:
            last = len(self._buckets) - 1
            # Summed norms ride with the last bucket (its prescale averages them
            # over micro-steps, its op over replicas) where the dtypes match.
            if micro_sqr is not None and stats_dtype(params) == self._buckets[last][0].dtype:
                extra = micro_sqr.to(self._buckets[last][0].dtype)
            for index, bucket in enumerate(self._buckets):
                if index not in self._handles:
                    # Every replica must pass the same tensors: one that got no
                    # gradient this cycle sends zeros.
                    for p in bucket:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                    self._start_allreduce(index, micro, extra if index == last else None)
            self._ready = [0] * len(self._buckets)
            if micro_sqr is not None and extra is None:
                stats_handle = hvd.allreduce_async_(micro_sqr / micro, name="hvd_adapt.grad_stats",
                                                    op=hvd.Average)
        elif micro > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(micro)
        if micro_sqr is not None and cycle.replicas == 1:
            local = micro_sqr / micro
        started = time.perf_counter()
        carried = self.synchronize()
        if stats_handle is not None:
            local = hvd.synchronize(stats_handle).double()
        self.sync_seconds = time.perf_counter() - started
        if carried is not None:
            local = carried / cycle.replicas if self._op == hvd.Sum else carried
        self.finished = cycle
        self.stats = None
        if local is not None:
            self.stats = Measurement(local, self._mean_sqnorms(), micro * cycle.replicas)
        self._denominators = {}

    def synchronize(self):
        """Wait for every gradient allreduce under way; afterwards ``.grad`` holds averages.
        Returns the local norms a bucket carried (float64), or None."""
        carried = None
        handles, self._handles = self._handles, {}
        for index, (handle, compressed, carries_norms) in handles.items():
            with _naming_the_cause(index):
                outputs = hvd.synchronize(handle)
            if carries_norms:
                carried = outputs[-1].double()
            for p, output, (_, ctx) in zip(self._buckets[index], outputs, compressed):
                if output is not p.grad:
                    p.grad.copy_(self._compression.decompress(output, ctx))
        return carried

    def _denominators_of(self, params):
        missing = [p for p in params if p not in self._denominators]
        if missing:
            self._denominators.update(self._compute_denominators(missing))
        return [self._denominators[p] for p in params]

    def _mean_sqnorms(self):
        # Only at a measured cycle's end: its denominators are cached until then.
        groups = [[p for p in group if p.grad is not None] for group in self._groups]
        return group_sqnorms([[p.grad for p in group] for group in groups],
                             [self._denominators_of(group) for group in groups])


@contextlib.contextmanager
def _naming_the_cause(index):
    """Add to Horovod's error what hvd_adapt was doing and its likely cause. A peer that is
    gone shows when the operation is started or when it is waited for, whichever comes first."""
    try:
        yield
    except HorovodInternalError as e:
        # The same type, so that hvd.elastic.run still recovers from a lost peer.
        raise HorovodInternalError(
            f"{e} [hvd_adapt: while averaging gradients hvd_adapt.grad.{index} in backward. "
            "If no replica failed, replicas ran different numbers of backward passes: every "
            "replica must run backward for every batch]") from e


def _buckets(params, cap_bytes):
    """Parameters in reverse order, cut into runs of at most ``cap_bytes`` of one dtype and
    device (a parameter larger than the cap is a bucket alone)."""
    buckets, size = [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > cap_bytes or last[0].dtype != p.dtype \
                or last[0].device != p.device:
            buckets.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return buckets
