"""What an autoscaling job may choose from, and how one choice is made.

The policy is plain data and arithmetic (numpy, and scipy through the fit):
given a step-time profile and the gradient statistics it returns the local
batch size and accumulation steps to use. Who decides when, and how every
replica adopts the choice, is the controller's business
(:mod:`hvd_adapt.autoscale.controller`).

>>> policy = AutoscalePolicy.create(128, 1024, local_bsz_bounds=(16, 256))
>>> policy.default(num_replicas=3)      # B0 split over the replicas
(43, 0)
"""
import logging
import math

import numpy as np

from .._checks import check_bool, check_int, is_int
from ..goodput import GoodputFunction, fit_perf_params

log = logging.getLogger(__name__)


class AutoscalePolicy:
    """The bounds of the choice and the rule that picks within them.

    ``hysteresis``: the current choice is kept unless another is predicted
    to be more than this fraction better, so measurement noise does not make
    the job hop between two near-equal batch sizes.

    ``explore_factor``: a choice's local batch is at most this many times
    the largest one timed in the current world (in any world before this
    one timed a step), and its global batch at most this many times the
    current one or the replicas times that largest local batch. Step times
    beyond what was timed, and accumulation steps never run, are the
    throughput model's extrapolation, which a fit to one or two sizes gets
    wrong both ways; a bounded step costs at most one ``decide_every``
    interval at a batch that turns out too large, and the next decision,
    having timed it, goes on.
    """

    def __init__(self, init_batch_size, max_batch_size, local_bsz_bounds, gradient_accumulation,
                 decide_every, hysteresis=0.05, explore_factor=2.0):
        self.init_batch_size = init_batch_size
        self.max_batch_size = max_batch_size
        self.local_bsz_bounds = local_bsz_bounds
        self.gradient_accumulation = gradient_accumulation
        self.decide_every = decide_every
        self.hysteresis = hysteresis
        self.explore_factor = explore_factor

    @classmethod
    def create(cls, init_batch_size, max_batch_size, local_bsz_bounds=None,
               gradient_accumulation=False, decide_every=50, num_replicas=None):
        """Validate the arguments of ``AdaptiveDataLoader.autoscale_batch_size``; with
        ``num_replicas``, also refuse bounds that cannot all hold in that world
        (:meth:`conflict`), naming the numbers."""
        if not is_int(max_batch_size) or max_batch_size < init_batch_size:
            raise ValueError(f"max_batch_size must be an int >= the loader's batch_size "
                             f"({init_batch_size}), got {max_batch_size!r}")
        if local_bsz_bounds is None:
            local_bsz_bounds = (None, None)
        if not isinstance(local_bsz_bounds, (tuple, list)) or len(local_bsz_bounds) != 2:
            raise ValueError(f"local_bsz_bounds must be a pair (lo, hi), got {local_bsz_bounds!r}")
        lo, hi = local_bsz_bounds
        lo = 1 if lo is None else lo
        hi = max_batch_size if hi is None else hi
        for name, value in (("lower", lo), ("upper", hi)):
            if not is_int(value) or value < 1:
                raise ValueError(f"local_bsz_bounds {name} bound must be an int >= 1 or None, "
                                 f"got {value!r}")
        if lo > max_batch_size:
            raise ValueError(f"local_bsz_bounds lower bound {lo} exceeds max_batch_size "
                             f"{max_batch_size}")
        if lo > hi:
            raise ValueError(f"local_bsz_bounds must have lo <= hi, got ({lo}, {hi})")
        check_bool("gradient_accumulation", gradient_accumulation)
        check_int("decide_every", decide_every, 1)
        policy = cls(init_batch_size, max_batch_size, (lo, hi), gradient_accumulation,
                     decide_every)
        conflict = None if num_replicas is None else policy.conflict(num_replicas)
        if conflict is not None:
            raise ValueError(conflict)
        return policy

    # -- the bounds ----------------------------------------------------------------------
    # Every choice at R replicas, (atomic, accum) with batch B = R * atomic * (accum + 1),
    # keeps atomic <= hi (the memory bound), B <= max_batch_size, B0 less rounding <= B
    # (atomic >= B0 // (R * (accum + 1)): the split of B0 rounded down), and lo <= atomic.
    # Where a world cannot keep them all, they give way in the reverse order: first lo,
    # then B0 (only without accumulation), then max_batch_size (more replicas than it);
    # hi never. _limits finds which hold, allows() checks every choice against them.

    def _first_plan(self, num_replicas, lo, keep_b0, max_batch):
        """The default plan within ``lo``, hi, ``max_batch`` (and B0 less rounding when
        ``keep_b0``): the batch nearest above B0 with the fewest accumulation steps; or None."""
        b0, hi = self.init_batch_size, self.local_bsz_bounds[1]
        accums = [0]
        if self.gradient_accumulation:
            # First the fewest accumulation steps whose atomic batch reaches B0 within hi;
            # then fewer, down to the fewest whose split of B0 (rounded down) is within hi:
            # max_batch_size or lo may allow only those. More would not help: a batch
            # that already reaches B0 fails only by lo x replicas x micro-steps > max.
            reach = math.ceil(math.ceil(b0 / num_replicas) / hi) - 1
            fewest = max(0, math.ceil((b0 // (hi + 1) + 1) / num_replicas) - 1) if keep_b0 \
                else 0
            accums = range(reach, min(fewest, reach) - 1, -1)
        for accum in accums:
            micro = num_replicas * (accum + 1)
            least = max(lo, b0 // micro if keep_b0 else 1)
            most = min(hi, max_batch // micro)
            if least <= most:
                return max(least, min(most, math.ceil(b0 / micro))), accum
        return None

    def _limits(self, num_replicas):
        """``(lo, keep_b0, max_batch, default plan)`` that hold at ``num_replicas``."""
        lo = self.local_bsz_bounds[0]
        for lo_kept, keep_b0 in ((lo, True), (1, True), (1, False)):
            plan = self._first_plan(num_replicas, lo_kept, keep_b0, self.max_batch_size)
            if plan is not None:
                return lo_kept, keep_b0, self.max_batch_size, plan
        return 1, False, num_replicas, (1, 0)

    def conflict(self, num_replicas):
        """None where every bound holds at ``num_replicas``; else what gives way, with the
        numbers (a resize logs it; ``autoscale_batch_size`` refuses it).

        >>> print(AutoscalePolicy.create(8, 8, local_bsz_bounds=(4, 8)).conflict(3))
        at 3 replica(s) the local batch cannot stay within local_bsz_bounds (4, 8) and \
max_batch_size 8: 4 x 3 replica(s) = 12 > 8; the local batch goes below 4, to 2 (batch 6)
        """
        lo_kept, keep_b0, max_batch, (atomic, accum) = self._limits(num_replicas)
        lo, hi = self.local_bsz_bounds
        batch = num_replicas * atomic * (accum + 1)
        where = f"at {num_replicas} replica(s)"
        if max_batch < num_replicas:
            return (f"{where} max_batch_size {self.max_batch_size} cannot hold: every replica "
                    f"loads at least 1 sample, a batch of {num_replicas}")
        if not keep_b0:
            return (f"{where} the batch cannot reach batch_size {self.init_batch_size} (less "
                    f"rounding) without gradient accumulation: local_bsz_bounds upper bound "
                    f"{hi} x {num_replicas} replica(s) = {hi * num_replicas}; the batch stays "
                    f"at {batch} (enable gradient_accumulation or raise the upper bound)")
        if lo_kept != lo:
            return (f"{where} the local batch cannot stay within local_bsz_bounds ({lo}, {hi}) "
                    f"and max_batch_size {self.max_batch_size}: {lo} x {num_replicas} "
                    f"replica(s)" + (f" x {accum + 1} micro-steps" if accum else "")
                    + f" = {lo * num_replicas * (accum + 1)} > {self.max_batch_size}; the "
                    f"local batch goes below {lo}, to {atomic} (batch {batch})")
        return None

    def allows(self, choice, num_replicas):
        """True when ``choice`` = (atomic, accum) keeps every bound that holds at
        ``num_replicas`` (see :meth:`conflict`)."""
        atomic, accum = choice
        lo, keep_b0, max_batch, _ = self._limits(num_replicas)
        micro = num_replicas * (accum + 1)
        return (accum >= 0 and (accum == 0 or self.gradient_accumulation)
                and lo <= atomic <= self.local_bsz_bounds[1]
                and micro * atomic <= max_batch
                and (not keep_b0 or atomic >= self.init_batch_size // micro))

    def default(self, num_replicas):
        """The choice before anything is measured: B0 split over the replicas, within bounds
        (rounded down where rounding up would exceed max_batch_size; see :meth:`conflict`
        where not every bound can hold)."""
        return self._limits(num_replicas)[3]

    def choose(self, profile, grad_params, num_nodes, num_replicas, current, forced):
        """``(atomic_bsz, accum_steps)`` for the next steps.

        ``profile`` is a :class:`~hvd_adapt.autoscale.profile.StepProfile`,
        ``grad_params`` the noise scale's :class:`~hvd_adapt.goodput.GradParams`
        (None before any measurement: then the default is kept). ``current``
        is kept unless beaten by more than ``hysteresis``, or ``forced`` (after
        a resize). The throughput model is fitted to every world's steps, or to
        this world's alone once it has measured two batch sizes of its own;
        the global batch grows at most ``explore_factor`` times per decision,
        and the local batch goes at most as far past the largest one timed.
        """
        return self.decide(profile, grad_params, num_nodes, num_replicas, current, forced)[0]

    def decide(self, profile, grad_params, num_nodes, num_replicas, current, forced):
        """:meth:`choose`, and why: ``(choice, (speedup, gain))``, where speedup is the
        predicted goodput of the choice over that of ``current`` and gain the
        AdaScale gain of its batch; the second item is None when nothing was fitted."""
        if grad_params is None or len(profile) == 0:
            return self.default(num_replicas), None
        if not (math.isfinite(grad_params.sqr) and math.isfinite(grad_params.var)):
            # A NaN or infinite gradient (a loss that overflowed) must not steer the batch.
            log.warning("batch size decision skipped: the gradient noise statistics are not "
                        "finite (sqr %r, var %r)", grad_params.sqr, grad_params.var)
            return self._kept(current, num_replicas, forced), None
        data = profile.arrays()
        here = (data["num_nodes"] == num_nodes) & (data["num_replicas"] == num_replicas)
        timed = data["atomic_bsz"][here] if here.any() else data["atomic_bsz"]
        lo, hi = self._limits(num_replicas)[0], self.local_bsz_bounds[1]
        bounds = (lo, max(lo, min(hi, math.floor(self.explore_factor * timed.max()))))
        batch_now = num_replicas * max(current[0] * (current[1] + 1), timed.max())
        max_batch = min(self.max_batch_size,
                        max(self.init_batch_size, math.floor(self.explore_factor * batch_now)))
        fn = self.goodput_function(profile, grad_params, num_nodes, num_replicas)
        goodput, atomic, accum = fn.optimize(num_nodes, num_replicas, max_batch,
                                             bounds, self.gradient_accumulation)
        current_goodput = float(fn.evaluate(num_nodes, num_replicas, current[0], current[1]))
        if not (math.isfinite(goodput) and math.isfinite(current_goodput)):
            log.warning("batch size decision skipped: the fitted goodput is not finite "
                        "(%r for the best choice, %r for the current one)", goodput,
                        current_goodput)
            return self._kept(current, num_replicas, forced), None
        if goodput <= 0 or not self.allows((atomic, accum), num_replicas):
            # Nothing within the bounds the exploration allows: the default split of B0.
            return self.default(num_replicas), None
        choice = (atomic, accum)
        if not forced and goodput <= (1 + self.hysteresis) * current_goodput \
                and self.allows(tuple(current), num_replicas):
            choice = tuple(current)
        batch = num_replicas * choice[0] * (choice[1] + 1)
        gain = float(fn.efficiency(batch)) * max(batch / self.init_batch_size, 1.0)
        speedup = float(fn.evaluate(num_nodes, num_replicas, *choice)) / current_goodput
        return choice, (speedup, gain)

    def _kept(self, current, num_replicas, forced):
        """``current`` where a decision is skipped, or the default where it cannot stand."""
        if forced or not self.allows(tuple(current), num_replicas):
            return self.default(num_replicas)
        return tuple(current)

    def goodput_function(self, profile, grad_params, num_nodes=None, num_replicas=None):
        """The :class:`~hvd_adapt.goodput.GoodputFunction` of ``profile`` and ``grad_params``:
        the throughput model fitted to every world's steps, or, where the world
        (``num_nodes``, ``num_replicas``) has measured two batch sizes of its own, to
        that world's alone."""
        data = profile.arrays()
        if num_replicas is not None and len(profile.sizes(num_nodes, num_replicas)) >= 2:
            # The model's compute time is the same in every world, which
            # replicas sharing cores or memory bandwidth break. The choice is
            # for this world: once it has measured two sizes, fit to it alone.
            here = (data["num_nodes"] == num_nodes) & (data["num_replicas"] == num_replicas)
            data = {key: values[here] for key, values in data.items()}
        perf = fit_perf_params(data["num_nodes"], data["num_replicas"], data["atomic_bsz"],
                               data["accum_step_time"], data["optim_step_time"])
        return GoodputFunction(perf, grad_params, self.init_batch_size)

    def speedup_curve(self, profile, grad_params, max_replicas, slots_per_node):
        """What 1..``max_replicas`` replicas would give, for a launcher or scheduler:
        ``[{"replicas", "nodes", "goodput", "speedup", "local_bsz",
        "accumulation_steps", "batch_size"}]``, from the model fitted to every world's
        steps, each count at its best batch plan within this policy's bounds, its nodes
        counted as ``slots_per_node`` replicas a node (as a launcher fills them). Empty
        before anything is measured."""
        if grad_params is None or len(profile) == 0:
            return []
        fn = self.goodput_function(profile, grad_params)
        replicas = np.arange(1, max_replicas + 1)
        nodes = np.ceil(replicas / max(1, slots_per_node))
        goodput, atomic, accum = fn.optimize(nodes, replicas, self.max_batch_size,
                                             self.local_bsz_bounds, self.gradient_accumulation)
        single = float(goodput[0]) if goodput[0] > 0 else float("nan")
        return [{"replicas": int(r), "nodes": int(n), "goodput": float(g),
                 "speedup": float(g) / single, "local_bsz": int(b), "accumulation_steps": int(s),
                 "batch_size": int(r * b * (s + 1))}
                for r, n, g, b, s in zip(replicas, nodes, goodput, atomic, accum)]
