"""Gradient averaging from post-accumulate hooks, overlapped with the backward pass.

The layout (``buckets.py``) groups parameters into buckets of up to
``bucket_cap_mb``. By default buckets are 25 MB for GPU parameters (DDP's
default; NCCL runs beside the compute) and 4 MB for CPU ones: on the CPU,
where Gloo's reductions share the cores with backward, a bucket about a
layer's size reduced while the next layer's gradient is computed pipelines
best (``benchmarks/RESULTS.md``). A bucket's grouped Horovod allreduce starts
as soon as all its gradients are accumulated, but only on the last
micro-step of an accumulation cycle; the bucket holding the parameters
expected last goes at the end of the pass with the layout's extra slot
(norms, flags, used-flags). Earlier micro-steps accumulate into ``.grad``
with no communication and no extra copy. Unlike Horovod's, the averaged
gradients are waited for at the end of the pass (as DDP does), so when
``loss.backward()`` returns every rank holds the same gradients: clipping,
``GradScaler.unscale_`` and its skip decision see averaged values, and a
rank that then skips ``step()`` leaves no collective behind. A parameter
that no rank used in a cycle keeps ``grad=None`` (a weight-decayed optimizer
leaves it alone); one that some ranks used averages with zeros elsewhere.
"Used" is read from ``.grad`` at the pass's end: a gradient from an earlier
pass of the cycle, or a zeroed one (``set_to_none=False``), counts, as it
does for one process.

A bucket is ready when the pass that owns it says so: the first cycle of a
layout sends every bucket at the end of its pass and watches; a parameter
whose gradient came from a nested task (reentrant checkpointing) or twice in
one pass is then held to the end of the outermost pass, after its last
contribution. One that gets a gradient again after its bucket was sent
anyway makes every rank refuse the cycle, naming it.

Several backwards before a step add up as in one process. A pass into
gradients already averaged (a second loss, hand-written accumulation)
averages again: each rank holds the same average plus its own new share, so
the new average adds that share's average once; after a loader's cycle of
``k`` micro-batches, a pre-hook on each parameter's AccumulateGrad node
first scales a later pass's gradient by ``1/k``. The extra slot says whether
a pass is its step's first or a later one: ranks that run different numbers
of passes per step meet another step's pass, and every rank raises rather
than mix two steps. Between the micro-steps of a loader's cycle ``ledger.py``
keeps each local sum: ``model.zero_grad()`` is undone, a change in place
refused on every rank.

A pass is one ``.backward()`` (``backward_pass.py``): nested reentrant
backwards and ``torch.autograd.grad`` open nothing. A pass that raised is
found at the next pass, ``zero_grad()`` or ``step()``: its cycle is tainted,
its gradients dropped. At the cycle's end every rank learns from the flags
whether another rank abandoned a backward of it: if all did, every rank
skips that optimizer step; if only some did, every rank raises, since the
others' gradients cannot be averaged with nothing.

The squared norms the noise scale needs are taken on the device before
anything is averaged: a bucket's together, from ``.grad`` just before its
allreduce starts, on the first micro-step of a cycle (``.grad`` then holds
that micro-batch's gradient alone, whether it was None or zeroed); in later
micro-steps of a measured cycle each gradient's in a tensor hook before it is
accumulated (hooks that exist only while such a cycle runs). Adam's
denominators are computed where each norm is taken, a bucket or a tensor at
a time, never kept across micro-steps.
"""
import contextlib
import logging
import time
import weakref
import zlib
from typing import Any, NamedTuple

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from .backward_pass import PassTracker, current_task
from .._runtime.collective import in_place_view, wait
from .buckets import Control, Layout, cap_bytes_for, signature
from .ledger import Ledger
from .noise import sqnorm, total_sqnorm

log = logging.getLogger(__name__)


class Cycle:
    """What one backward pass must do; the optimizer answers it before each pass.

    ``last``: it ends an accumulation cycle, so the gradients are averaged.
    ``measure``: take the squared norms the noise scale needs (of every
    micro-batch's gradient, and of the cycle's mean). ``position``: how many
    batches of the cycle came before this one (the loader's count: a pass with
    fewer finished before it had one raise before any gradient came). ``extra``: a
    further backward after the cycle was averaged, before its step.
    """

    def __init__(self, last, measure, replicas, position=0, extra=False):
        self.last, self.measure, self.replicas = last, measure, replicas
        self.position = position
        self.extra = extra


class Measurement:
    """One cycle's squared norms per group (float64 device tensors): ``local`` is the mean
    over micro-batches of each one's, ``total`` the mean gradient's, over ``num_micro``
    micro-batches."""

    def __init__(self, local, total, num_micro):
        self.local, self.total, self.num_micro = local, total, num_micro


class Finished:
    """A cycle that ended: its :class:`Cycle`, :class:`Measurement` (or None), the seconds
    spent waiting for its allreduces, and whether its step must be skipped (a backward of
    it raised on every rank)."""

    def __init__(self, cycle, stats, sync_seconds, skip):
        self.cycle, self.stats, self.sync_seconds, self.skip = cycle, stats, sync_seconds, skip


class Sent(NamedTuple):
    """One gradient in a bucket's allreduce: its position, the ``.grad`` it averages,
    ``target`` (what the average is written to: ``.grad``, or its real view), ``tensor``
    (what was reduced: ``target`` itself, or a float32 copy where ``copied``) and the
    compression's output and context."""
    pos: int
    grad: torch.Tensor
    target: torch.Tensor
    tensor: torch.Tensor
    copied: bool
    compressed: torch.Tensor
    ctx: Any


class AbandonedBackwardError(RuntimeError):
    """A backward pass raised on some ranks and completed on others: their gradients cannot
    be averaged."""


class GradientExchange:
    """Post-accumulate hooks on every parameter of ``groups()`` (the optimizer's live
    parameter lists) that average gradients over replicas.

    ``plan()`` returns the :class:`Cycle` of the pass starting;
    ``denominators(params, group_indices)`` each parameter's divisor for its norm (or
    None). ``name`` prefixes the allreduces' names (each optimizer its own), ``names``
    maps parameters to the names errors use. After a cycle's last pass,
    :meth:`take_finished` returns its :class:`Finished`.
    """

    def __init__(self, groups, plan, denominators, compression, op, gradient_predivide_factor,
                 bucket_cap_mb, name, sparse_as_dense=False, names=None):
        self._groups = groups
        self._plan = plan
        self._compute_denominators = denominators
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._bucket_cap_mb = bucket_cap_mb
        self.name = name
        self._sparse_as_dense = sparse_as_dense
        self._names = names or {}
        self._tracker = PassTracker(self._end_pass)
        self._layout = None
        self._version = 0           # the layout's checksum: part of the allreduces' names
        self._rebuilt = False       # the layout follows an observed gradient order
        self._hooked = {}           # id(param) -> hook handle
        self._micro_hooks = []
        self._extra_hooks = []      # scale a finished cycle's later passes (see _open)
        self._deferred = set()      # positions whose hook fired nested or twice in a pass
        self._nodes = None
        self.ledger = Ledger()
        self._finalizer = weakref.finalize(self, _remove_all, self._hooked, self._micro_hooks,
                                           self._extra_hooks)
        self._reset_cycle()
        self.finished = None
        self.hook(p for group in groups() for p in group)

    # -- hooks -----------------------------------------------------------------------------
    def hook(self, params):
        """Put the post-accumulate hook on each trainable one of ``params`` not hooked yet;
        returns those newly hooked (frozen ones get theirs once they are trainable)."""
        ref = weakref.ref(self)
        hooked = []
        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._hooked[id(p)] = p.register_post_accumulate_grad_hook(
                    lambda param, ref=ref: _call(ref, "_on_accumulated", param))
                hooked.append(p)
        return hooked

    def remove(self):
        """Take every hook off the parameters (the optimizer is done with them)."""
        self._finalizer()

    def _reset_cycle(self):
        self._micro = 0             # passes finished in the open accumulation cycle
        self._tainted = False       # a pass of this cycle raised
        self._used = None           # bytearray per position: got a gradient this cycle
        self._micro_sqr = None      # per group, summed over the cycle's micro-batches
        self._stash = {}            # position -> (task, norm) from the tensor hooks
        self._pending = []          # positions whose first-micro-step norm is still to take
        self._handles = {}
        self._ready = None
        self._observed = None       # positions in the order their gradients came, if watched
        self._seen = None           # bytearray per position: its hook fired in this pass
        self._tampered = []         # positions whose earlier micro-steps were lost
        self._raced = []            # positions accumulated into after their bucket was sent
        self._remove_micro_hooks()

    @property
    def cycle_open(self):
        """True between the micro-steps of an accumulation cycle (gradients must be kept)."""
        return self._micro > 0 or self._tainted

    def discard(self):
        """Forget the cycle (after a reset: handles of the old world are dead)."""
        self._tracker.take_stale()
        self._reset_cycle()
        self.take_finished()

    def take_finished(self):
        """The :class:`Finished` of the last cycle, or None; cleared by the call, which also
        starts the ledger's next cycle."""
        finished, self.finished = self.finished, None
        self.ledger.forget()
        _remove(self._extra_hooks)
        return finished

    # -- the layout ------------------------------------------------------------------------
    def layout_state(self):
        """What a replica joining the job must adopt so that its buckets match: the order
        the layout follows, and whether it was observed."""
        layout = self._current_layout()
        return {"order": list(layout.order), "rebuilt": self._rebuilt}

    def adopt_layout(self, state):
        """Take rank 0's :meth:`layout_state` (or a checkpoint's, where its parameters match)."""
        layout = self._current_layout()
        if state is None or len(state["order"]) != len(layout.params):
            return
        if list(state["order"]) != layout.order:
            self._build(state["order"])
        self._rebuilt = bool(state["rebuilt"])

    def refresh(self):
        """Rebuild the layout if the set of trainable parameters changed (called between
        optimizer steps, by ``zero_grad()``, and at each cycle's first pass)."""
        self._current_layout()

    def _current_layout(self):
        if self._layout is None or self._layout.signature != signature(self._groups()):
            self._build(None)
        return self._layout

    def _build(self, order):
        groups = self._groups()
        params = [p for group in groups for p in group if p.requires_grad]
        self._layout = Layout(groups, cap_bytes_for(params, self._bucket_cap_mb), order)
        # Named after its buckets, not after how many were built before: two
        # ranks with the same buckets send the same names, whatever their history.
        self._version = zlib.crc32(repr(self._layout.buckets).encode())
        self._rebuilt = False
        self._deferred = set()
        self._nodes = None          # each parameter's AccumulateGrad node, once needed
        self.ledger.forget()
        # Parameters made trainable inside the pass under way may have had their
        # gradients before their hooks: their use is read from .grad at its end.
        self.hook(p for group in groups for p in group)

    # -- a pass ------------------------------------------------------------------------------
    def _on_accumulated(self, param):
        current, stale = self._tracker.enter()
        if stale is not None:
            self._abandon(stale)
        if current.plan is None:
            self._open(current, param)
        layout = self._layout
        pos = layout.position.get(id(param))
        if pos is None:
            return
        self._used[pos] = 1
        plan = current.plan
        if plan.measure:
            if self._micro == 0:
                self._pending.append(pos)
            else:
                self._add_stashed(pos)
        if self._seen[pos]:
            # A second contribution in one pass (a weight shared by reentrant
            # checkpointed blocks): only the pass's end knows the last one.
            self._deferred.add(pos)
            if layout.bucket_of[pos] in self._handles:
                self._raced.append(pos)
            return
        self._seen[pos] = 1
        if self._observed is not None:
            self._observed.append(pos)
        # Buckets go early only once the layout follows an observed order: the
        # first cycle watches which gradients come nested or twice.
        if plan.last and plan.replicas > 1 and self._rebuilt:
            if current_task() != current.root:
                self._deferred.add(pos)
            if pos in self._deferred:
                return
            index = layout.bucket_of[pos]
            self._ready[index] += 1
            if self._ready[index] == layout.bucket_size[index] \
                    and index != len(layout.buckets) - 1:
                self._submit(index, plan.position + 1)

    def _open(self, current, param):
        plan = self._plan()
        finished = self.finished
        if self._micro == 0 and not self._tainted:
            layout = self._current_layout()
            self._used = bytearray(len(layout.params))
            if finished is not None and not finished.skip and plan.last \
                    and plan.position == finished.cycle.position:
                # Another backward after the cycle was averaged, before step():
                # .grad holds the average (the same on every rank) plus this pass's
                # gradient (scaled by _scale_later_passes), so averaging it again
                # adds this pass's average exactly once.
                plan = Cycle(True, False, plan.replicas, 0, extra=True)
        elif self._layout.signature != signature(self._groups()):
            raise RuntimeError(
                "the set of trainable parameters (requires_grad) changed inside an "
                "accumulation cycle: change it between optimizer steps, on every rank alike")
        else:
            self._tampered += self.ledger.put_back(
                self._layout.params, self._layout.position.get(id(param)))
        current.plan = plan
        self._seen = bytearray(len(self._layout.params))
        if plan.last and plan.replicas > 1:
            self._ready = [0] * len(self._layout.buckets)
            if not self._rebuilt:
                self._observed = []

    def _end_pass(self, ended):
        if ended.plan is None:
            return
        plan = ended.plan
        if plan.measure and self._micro == 0:
            self._measure_pending()
        if not plan.last:
            if plan.position == self._micro:
                self._micro += 1
            elif plan.position != self._micro - 1:
                # A backward of this cycle raised before any gradient came (or was
                # never run): this rank's average would be over other micro-steps.
                # (Several passes over one batch are one micro-step.)
                self._tainted = True
            self.ledger.keep_local(self._layout.params)
            if plan.measure and self._micro == 1 and not self._tainted \
                    and not self._micro_hooks:
                self._install_micro_hooks()
            return
        if plan.position != self._micro:
            self._tainted = True
        self._finish_cycle(plan, completed=not self._tainted)

    def _finish_cycle(self, plan, completed):
        layout = self._layout
        # The loader's count, the same on every rank (allreduces with other
        # scale factors would not match), also where a pass of this rank raised.
        micro = plan.position + 1
        norms, self._micro_sqr = self._micro_sqr, None
        if norms is None and plan.measure and completed:
            norms = torch.zeros(layout.num_groups, dtype=torch.float64,
                                device=layout.extra_device)
        # Used: a gradient from any pass of the cycle (or the user's), as one
        # process would have it; a zeroed one (set_to_none=False) is used too.
        for pos, p in enumerate(layout.params):
            if p.grad is not None:
                self._used[pos] = 1
        refused = self._refused_here()
        started = time.perf_counter()
        skip, local = not completed, None
        if plan.replicas > 1:
            proposal = None
            if self._observed is not None and self._is_rank0():
                seen = set(self._observed)
                proposal = self._observed + [pos for pos in range(len(layout.params) - 1, -1, -1)
                                             if pos not in seen]
            extra = layout.encode(Control(
                norms=norms if completed else None, completed=completed, abandoned=not completed,
                refused=refused is not None, later=plan.extra, used=self._used, order=proposal))
            for index in range(len(layout.buckets)):
                if index not in self._handles:
                    self._submit(index, micro, extra if index == len(layout.buckets) - 1
                                 else None)
            carried = self._synchronize()
            scale = micro * (hvd.size() if self._op == hvd.Average else 1)
            agreed = layout.agreed(carried, scale)
            if agreed.passes_differ:
                self._reset_cycle()
                raise RuntimeError(
                    "ranks ran different numbers of backward passes before step(): this "
                    "rank's pass met another step's pass of another rank, so their gradients "
                    f"cannot be averaged ({self.name}). Run the same number of backward() "
                    "calls per optimizer step on every rank (split a batch into as many "
                    "micro-batches everywhere, or skip a batch on every rank alike)")
            if agreed.anyone_refused:
                self._reset_cycle()
                raise RuntimeError(refused or "another rank refused this accumulation cycle "
                                   "(its error names the parameter and the cause)")
            if agreed.anyone_abandoned and agreed.anyone_completed:
                self._reset_cycle()
                raise AbandonedBackwardError(
                    "a backward pass raised on some ranks (an exception inside backward, "
                    "caught) and completed on others: their gradients cannot be averaged. "
                    "Every rank must run (or skip) the same batches; with several replicas, "
                    "skip a failing batch on every rank alike")
            skip = agreed.anyone_abandoned
            for pos, anyone_used in enumerate(agreed.used):
                if not anyone_used:
                    # No rank used it: leave it as a single process would.
                    layout.params[pos].grad = None
            if norms is not None:
                local = agreed.norms / plan.replicas if self._op == hvd.Sum else agreed.norms
            if agreed.order is not None:
                self._rebuild_after(agreed.order)
            self._observed = None
        else:
            if refused is not None:
                self._reset_cycle()
                raise RuntimeError(refused)
            if micro > 1 and completed:
                grads = [p.grad for p in layout.params if p.grad is not None]
                if grads:
                    torch._foreach_div_(grads, micro)
        if plan.replicas == 1 and norms is not None:
            local = norms / micro
        sync_seconds = time.perf_counter() - started
        stats = None
        if local is not None and not skip:
            stats = Measurement(local, self._mean_sqnorms(), micro * plan.replicas)
        if skip:
            log.warning("a backward pass of this accumulation cycle raised on every rank: "
                        "the cycle's gradients are dropped and its optimizer step skipped")
            for p in layout.params:
                p.grad = None
        self._reset_cycle()
        previous = self.finished
        if plan.extra and previous is not None:
            # A later pass of a finished cycle: the cycle (and its measurement) is the
            # first pass's.
            self.finished = Finished(previous.cycle, previous.stats,
                                     previous.sync_seconds + sync_seconds, skip)
        else:
            self.finished = Finished(plan, stats, sync_seconds, skip)
            if micro > 1 and not skip:
                self._scale_later_passes(micro)

    def _refused_here(self):
        """The error this rank has for the cycle (the parameter and the cause), or None."""
        names = self._names
        params = self._layout.params
        if self._tampered:
            p = params[self._tampered[0]]
            return (f"the gradient of parameter {names.get(p, tuple(p.shape))} was changed in "
                    "place between the micro-steps of an accumulation cycle "
                    "(model.zero_grad(set_to_none=False)?), so the cycle's earlier "
                    "micro-batches are lost: clear gradients with the hvd_adapt optimizer's "
                    "zero_grad(), which keeps them until the cycle's step")
        if self._raced:
            p = params[self._raced[0]]
            return (f"parameter {names.get(p, tuple(p.shape))} got a gradient again in one "
                    "backward pass after its bucket was sent (a weight shared by reentrant "
                    "checkpointed blocks that the first cycle did not show): it is averaged at "
                    "the end of the pass from now on; this cycle is refused")
        return None

    def _scale_later_passes(self, micro):
        # A further backward into this cycle's averages (two losses on the batch
        # that ends a loader's cycle) must add 1/micro of its gradient, as each
        # micro-batch's was: a pre-hook on each parameter's AccumulateGrad node
        # (which runs for .backward() only, never for autograd.grad) scales it.
        # Removed when the cycle is stepped or dropped.
        if self._nodes is None:
            # Kept, as DDP keeps them: a parameter's node lives as long as someone
            # holds it, and a hook as long as its node. (Grad mode is off where a
            # pass ends.)
            with torch.enable_grad():
                self._nodes = [p.view_as(p).grad_fn.next_functions[0][0]
                               for p in self._layout.params]
        for node in self._nodes:
            self._extra_hooks.append((node, node.register_prehook(
                lambda grads, micro=micro: tuple(None if g is None else g / micro
                                                 for g in grads))))

    def _rebuild_after(self, order):
        # Every rank got rank 0's observed order through the same allreduce:
        # all rebuild alike, once, before the next cycle.
        if order != self._layout.order:
            # Positions stay (only the buckets change): what the cycle learned holds.
            deferred = self._deferred
            self._build(order)
            self._deferred = deferred
        self._rebuilt = True

    def _is_rank0(self):
        return hvd.rank() == 0

    # -- a pass that raised ------------------------------------------------------------------
    def settle(self, caller):
        """Called by ``zero_grad()`` and ``step()`` (``caller``): a pass still open here
        raised; its cycle is tainted (see the module's docstring)."""
        if self._tracker.current is None:
            return
        if current_task() != -1:
            raise RuntimeError(f"{caller}() was called inside a backward pass (from a hook): "
                               "hvd_adapt averages gradients only once backward is done")
        self._abandon(self._tracker.take_stale())

    def _abandon(self, stale):
        plan = stale.plan
        if plan is None:
            return
        log.warning("a backward pass raised (an exception inside backward, caught): its "
                    "accumulation cycle is dropped on this rank")
        self._tainted = True
        self._remove_micro_hooks()
        self._stash, self._pending, self._micro_sqr = {}, [], None
        if plan.last:
            # The cycle ends with this pass: the other ranks wait in its allreduces.
            self._finish_cycle(plan, completed=False)

    # -- allreduces ----------------------------------------------------------------------------
    def _submit(self, index, micro, extra=None):
        """Average bucket ``index`` over ``micro`` micro-steps and the replicas."""
        positions = self._layout.buckets[index]
        if self._pending:
            self._measure_pending(positions)
        self._start(index, positions, micro, extra, f"{self.name}.{self._version}.{index}")

    def _start(self, key, positions, micro, extra, name):
        layout = self._layout
        sent = []
        for pos in positions:
            p = layout.params[pos]
            if p.grad is None:
                # Every replica must pass the same tensors: one that got no gradient
                # this cycle sends zeros (and its used-flag says so).
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                self._densify(p)
            grad = p.grad
            target = torch.view_as_real(grad) if grad.is_complex() else grad
            if grad.dtype == torch.bfloat16:
                # Horovod's CPU operations take no bfloat16; float32 loses nothing.
                tensor, copied = grad.float(), True
            else:
                tensor, copied = in_place_view(target)
            compressed, ctx = self._compression.compress(tensor)
            sent.append(Sent(pos, grad, target, tensor, copied, compressed, ctx))
        prescale = 1.0 / micro
        postscale = 1.0
        if self._op == hvd.Average:
            # As Horovod splits the average: the backend divides by size() after this.
            prescale /= self._predivide
            postscale = self._predivide
        tensors = [entry.compressed for entry in sent] + ([] if extra is None else [extra])
        with self._naming_the_cause(key):
            handle = hvd.grouped_allreduce_async_(
                tensors, name=name, op=self._op, prescale_factor=prescale,
                postscale_factor=postscale)
        self._handles[key] = (handle, sent, extra is not None)

    def reconcile(self):
        """Call it at ``step()`` and ``synchronize()``, outside a cycle's micro-steps: average
        every ``.grad`` that no allreduce of this cycle averaged (a gradient the user
        assigned, one from a pass whose hooks never finished), as Horovod's
        ``synchronize()`` does. Which parameters go is agreed first by a bitmask over every
        rank, so the allreduce's members never depend on one rank's state; parameters no
        rank has a gradient for stay None.

        A collective, except where this cycle's hooks averaged every gradient this rank
        holds: every rank took part in that cycle's allreduces, so a rank that then skips
        ``step()`` for its own reason still leaves no one waiting. Ranks must agree on
        assigning gradients after backward (SPMD code does): one that assigns alone
        waits here for the others, and Horovod's stall inspector names this tensor."""
        if hvd.size() == 1:
            return
        layout = self._current_layout()
        pending = self.ledger.unaveraged(layout.params)
        if not pending and self.finished is not None:
            return
        flags = torch.zeros(len(layout.params), dtype=torch.int32)
        if pending:
            flags[pending] = 1
        # A host tensor: the decision reads it without waiting for the device.
        with self._naming_the_cause("ledger"):
            agreed = wait(hvd.allreduce_async(flags, op=hvd.Sum,
                                              name=f"{self.name}.{self._version}.ledger"))
        members = agreed.nonzero().flatten().tolist()
        if not members:
            return
        self._start("ledger", members, 1, None,
                    f"{self.name}.{self._version}.ledger.{zlib.crc32(repr(members).encode())}")
        self._synchronize()

    def _densify(self, p):
        if not self._sparse_as_dense:
            raise RuntimeError(
                f"parameter {self._names.get(p, tuple(p.shape))} has a sparse gradient "
                "(nn.Embedding(sparse=True)?), which hvd_adapt cannot average in place: "
                "pass sparse_as_dense=True to hvd_adapt.DistributedOptimizer (as to "
                "Horovod's), or use a dense embedding")
        p.grad = p.grad.to_dense()

    def synchronize(self):
        """Wait for every gradient allreduce under way; afterwards ``.grad`` holds averages."""
        self._synchronize()

    def _synchronize(self):
        carried = None
        handles, self._handles = self._handles, {}
        for index, (handle, sent, carries_extra) in handles.items():
            with self._naming_the_cause(index):
                outputs = wait(handle)
            if carries_extra:
                carried = outputs[-1]
            for entry, output in zip(sent, outputs):
                if output is not entry.tensor or entry.ctx is not None:
                    entry.tensor.copy_(self._compression.decompress(output, entry.ctx))
                if entry.copied:
                    entry.target.copy_(entry.tensor)
                self.ledger.record_averaged(entry.pos, entry.grad)
        return carried

    @contextlib.contextmanager
    def _naming_the_cause(self, index):
        """Add to Horovod's error what hvd_adapt was doing and its likely cause. A peer that is
        gone shows when the operation is started or when it is waited for."""
        try:
            yield
        except HorovodInternalError as e:
            # The same type, so that hvd.elastic.run still recovers from a lost peer.
            raise HorovodInternalError(
                f"{e} [hvd_adapt: while averaging gradients {self.name}.{self._version}."
                f"{index} in backward. If no replica failed, replicas ran different numbers "
                "of backward passes: every replica must run backward for every batch]") from e

    # -- measurements --------------------------------------------------------------------------
    def _add_micro_sqr(self, group_index, value):
        if self._micro_sqr is None:
            self._micro_sqr = torch.zeros(self._layout.num_groups, dtype=torch.float64,
                                          device=value.device)
        self._micro_sqr[group_index] += value

    def _denominators(self, positions):
        layout = self._layout
        return self._compute_denominators([layout.params[pos] for pos in positions],
                                          [layout.group_of[pos] for pos in positions])

    def _measure_pending(self, positions=None):
        """Add the micro-batch norms of the pending positions (of bucket ``positions``, or of
        every bucket in turn) from ``.grad``, a group at a time, with a few multi-tensor
        operations."""
        if positions is None:
            for bucket in self._layout.buckets:
                self._measure_pending(bucket)
            return
        wanted = set(positions)
        chosen = [pos for pos in self._pending if pos in wanted]
        self._pending = [pos for pos in self._pending if pos not in wanted]
        layout = self._layout
        by_group = {}
        for pos in chosen:
            by_group.setdefault(layout.group_of[pos], []).append(pos)
        for group_index, members in by_group.items():
            grads = [layout.params[pos].grad for pos in members]
            self._add_micro_sqr(group_index, total_sqnorm(grads, self._denominators(members)))

    def _install_micro_hooks(self):
        # Later micro-steps of a measured cycle: each gradient's norm before it
        # is accumulated, kept until its post-accumulate hook (autograd.grad
        # fires the tensor hook alone, so its norms are never counted).
        ref = weakref.ref(self)
        for pos, p in enumerate(self._layout.params):
            self._micro_hooks.append(p.register_hook(
                lambda grad, pos=pos, ref=ref: _call(ref, "_on_micro_grad", pos, grad)))

    def _remove_micro_hooks(self):
        for handle in self._micro_hooks:
            handle.remove()
        self._micro_hooks.clear()

    def _on_micro_grad(self, pos, grad):
        denominator = self._denominators([pos])[0]
        self._stash[pos] = (current_task(),
                            sqnorm(grad if denominator is None else grad / denominator))

    def _add_stashed(self, pos):
        entry = self._stash.pop(pos, None)
        if entry is not None and entry[0] == current_task():
            self._add_micro_sqr(self._layout.group_of[pos], entry[1])

    def _mean_sqnorms(self):
        # A bucket at a time, so that at most one bucket's denominators exist at once.
        layout = self._layout
        out = torch.zeros(layout.num_groups, dtype=torch.float64, device=layout.extra_device)
        for bucket in layout.buckets:
            members = [pos for pos in bucket if layout.params[pos].grad is not None]
            by_group = {}
            for pos in members:
                by_group.setdefault(layout.group_of[pos], []).append(pos)
            for group_index, positions in by_group.items():
                grads = [layout.params[pos].grad for pos in positions]
                out[group_index] += total_sqnorm(grads, self._denominators(positions)).to(
                    out.device)
        return out


def _call(ref, method, *args):
    exchange = ref()
    if exchange is not None:
        getattr(exchange, method)(*args)


def _remove(node_hooks):
    for _, handle in node_hooks:
        handle.remove()
    node_hooks.clear()


def _remove_all(hooked, micro_hooks, extra_hooks):
    for handle in list(hooked.values()) + list(micro_hooks):
        handle.remove()
    hooked.clear()
    micro_hooks.clear()
    _remove(extra_hooks)
