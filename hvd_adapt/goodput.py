"""Goodput: throughput x statistical efficiency, and the batch size that maximises it.

The models are those of Pollux (Qiao et al., "Pollux: Co-adaptive Cluster
Scheduling for Goodput-Optimized Deep Learning", OSDI 2021), as AdaptDL uses
them. This module is plain numpy/scipy, so a scheduler can ask "what would 16
replicas give this job?" without torch or Horovod:

>>> perf = PerfParams(0.02, 0.001, 0.1, 0.01, 0.05, 0.005, 1.5)
>>> grad = GradParams(sqr=1.0, var=4.0)
>>> fn = GoodputFunction(perf, grad, init_batch_size=128)
>>> goodput, atomic_bsz, accum_steps = fn.optimize(num_nodes=4, num_replicas=16,
...                                                max_batch_size=4096,
...                                                atomic_bsz_range=(32, 512))
"""
import collections
import math

import numpy as np

from ._blas import import_scipy_optimize

PerfParams = collections.namedtuple(
    "PerfParams", ["alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r", "gamma"])
PerfParams.__doc__ = """Step-time model parameters (seconds, seconds per sample, 1 <= gamma <= 10).

alpha_c + beta_c * b is the compute time of an atomic batch b; alpha_n/beta_n
(between nodes) and alpha_r/beta_r (between replicas of one node) model the
gradient allreduce; gamma models how much compute and allreduce overlap
(1: not at all, large: fully)."""

GradParams = collections.namedtuple("GradParams", ["sqr", "var"])
GradParams.__doc__ = """Gradient statistics: sqr = |G|^2 (squared norm of the true gradient),
var = tr(Sigma) / B0 (gradient variance at the initial batch size B0)."""

_EPS = 1e-8
_GAMMA_BOUNDS = (1.0, 10.0)
# While one atomic batch size is all that was measured, the fit cannot tell
# the per-step intercept from the per-sample slope and gives the intercept
# this share of the step time. Erring towards a small slope is the error
# that corrects itself: the job tries a larger batch and measures the slope;
# a slope guessed too steep makes larger batches look slow, so they are never
# tried. AdaptDL's equal shares were that second error on the digits example
# (measured intercept share 0.84 at batch 32 on CPU): the job crept from 32 to
# 57 and stayed there, where 0.9 went to 171.
_ONE_BSZ_INTERCEPT_SHARE = 0.9


def _accum_time(params, atomic_bsz):
    # Forward and backward passes scale linearly with the atomic batch size.
    return params.alpha_c + params.beta_c * atomic_bsz


def _network_time(params, num_nodes, num_replicas):
    # The slowest link in use bounds the allreduce: between nodes if there are
    # several, else between replicas of one node; with one replica there is
    # no communication. A ring allreduce takes a number of rounds growing with
    # the replicas, which beta models beyond the first two.
    conds = [np.greater(num_nodes, 1), np.greater(num_replicas, 1)]
    alpha = np.select(conds, [params.alpha_n, params.alpha_r], _EPS)
    beta = np.select(conds, [params.beta_n, params.beta_r], _EPS)
    return alpha + beta * np.maximum(np.subtract(num_replicas, 2), _EPS)


def _log_optim_time(params, accum_time, network_time):
    # (T_acc^g + T_net^g)^(1/g): gamma interpolates between compute and
    # communication adding up (g=1) and overlapping completely (g -> inf).
    g = params.gamma
    return np.logaddexp(g * np.log(accum_time), g * np.log(network_time)) / g


class GoodputFunction:
    """Goodput of a job for any (nodes, replicas, atomic bsz, accumulation steps).

    Arguments broadcast like numpy arrays, so many configurations (and
    replica counts the job does not have yet) evaluate in one call.
    """

    def __init__(self, perf_params, grad_params, init_batch_size):
        self.perf_params = PerfParams(*perf_params)
        self.grad_params = GradParams(*grad_params)
        if init_batch_size <= 0:
            raise ValueError(f"init_batch_size must be > 0, got {init_batch_size!r}")
        self.init_batch_size = init_batch_size

    def __call__(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        return self.evaluate(num_nodes, num_replicas, atomic_bsz, accum_steps)

    def evaluate(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Useful samples per second: throughput x efficiency."""
        batch_size = np.multiply(np.multiply(num_replicas, atomic_bsz), np.add(accum_steps, 1))
        return (self.throughput(num_nodes, num_replicas, atomic_bsz, accum_steps)
                * self.efficiency(batch_size))

    def step_time(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Predicted seconds per optimizer step: s accumulation steps plus one synchronised step."""
        accum = _accum_time(self.perf_params, atomic_bsz)
        network = _network_time(self.perf_params, num_nodes, num_replicas)
        optim = np.exp(_log_optim_time(self.perf_params, accum, network))
        return np.multiply(accum_steps, accum) + optim

    def throughput(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Samples per second: R * b * (s + 1) / (s * T_acc + T_opt)."""
        batch_size = np.multiply(np.multiply(num_replicas, atomic_bsz), np.add(accum_steps, 1))
        return batch_size / self.step_time(num_nodes, num_replicas, atomic_bsz, accum_steps)

    def efficiency(self, batch_size):
        """Progress per sample at ``batch_size`` relative to B0: gain / scale, in (0, 1].

        With scale = B / B0 the gain is r = (var + sqr) / (var / scale + sqr),
        the AdaScale gain: a step at B makes as much progress as r steps at B0.
        Batches below B0 count as B0 (efficiency 1).
        """
        scale = np.maximum(np.divide(batch_size, self.init_batch_size), 1.0)
        sqr, var = max(self.grad_params.sqr, 0.0), max(self.grad_params.var, _EPS)
        gain = (var + sqr) / (var / scale + sqr)
        return gain / scale

    def optimize(self, num_nodes, num_replicas, max_batch_size=None, atomic_bsz_range=None,
                 accumulation=False):
        """Best (goodput, atomic_bsz, accum_steps) for each (num_nodes, num_replicas).

        Candidate global batches are spaced geometrically from B0 (or the
        smallest the bounds allow) to ``max_batch_size``; each is split into
        an atomic batch within ``atomic_bsz_range`` and, with
        ``accumulation``, the fewest accumulation steps that fit. Scalars in,
        scalars out; arrays in, arrays out. Where no configuration fits the
        bounds, goodput is 0 and the smallest atomic batch is returned.
        """
        scalar = np.isscalar(num_nodes) and np.isscalar(num_replicas)
        shape = np.broadcast(num_nodes, num_replicas).shape
        nodes = np.broadcast_to(num_nodes, shape).reshape(-1).astype(float)
        replicas = np.broadcast_to(num_replicas, shape).reshape(-1).astype(float)
        if np.any(replicas < 1) or np.any(nodes < 1) or np.any(nodes > replicas):
            raise ValueError("need 1 <= num_nodes <= num_replicas, got "
                             f"num_nodes={num_nodes!r}, num_replicas={num_replicas!r}")
        max_batch_size = self.init_batch_size if max_batch_size is None else max_batch_size
        lo, hi = atomic_bsz_range or (None, None)
        lo = 1 if lo is None else lo
        hi = max_batch_size if hi is None else hi

        min_batch = np.maximum(self.init_batch_size, lo * replicas)
        top = np.maximum(max_batch_size, min_batch)
        # 64 geometric steps keep the search under a millisecond and within
        # about 1% of the best batch size; the largest batch a step holds
        # without accumulating is a candidate too, since where bigger is
        # better that bound is the answer, and a user who set it expects it.
        batch = np.concatenate([np.geomspace(min_batch, top, num=64),
                                np.clip(hi * replicas, min_batch, top)[None]])
        local = batch / replicas
        if accumulation:
            accum = np.maximum(np.ceil(local / hi - 1e-8) - 1, 0)
        else:
            accum = np.zeros_like(local)
        atomic = np.ceil(local / (accum + 1) - 1e-8)
        goodput = self.evaluate(nodes, replicas, atomic, accum)
        valid = (atomic >= lo) & (atomic <= hi) & (replicas * atomic * (accum + 1) <= max_batch_size)
        goodput = np.where(valid, goodput, 0.0)
        best = np.argmax(goodput, axis=0)
        cols = np.arange(goodput.shape[1])
        best_goodput = goodput[best, cols]
        best_atomic = np.where(best_goodput > 0, atomic[best, cols], lo).astype(int)
        best_accum = np.where(best_goodput > 0, accum[best, cols], 0).astype(int)
        if scalar:
            return float(best_goodput[0]), int(best_atomic[0]), int(best_accum[0])
        return best_goodput.reshape(shape), best_atomic.reshape(shape), best_accum.reshape(shape)


def _objective(params, num_nodes, num_replicas, atomic_bsz, accum_time, optim_time):
    pred_accum = _accum_time(params, atomic_bsz)
    pred_log_optim = _log_optim_time(params, pred_accum,
                                     _network_time(params, num_nodes, num_replicas))
    err_accum = np.sqrt(np.mean((np.log(pred_accum) - np.log(accum_time)) ** 2))
    err_optim = np.sqrt(np.mean((pred_log_optim - np.log(optim_time)) ** 2))
    # A small pull towards gamma = 1 keeps alpha/beta identifiable, and
    # penalising the per-replica (retrogression) terms prefers the more
    # optimistic model when the data cannot tell them apart.
    reg_gamma = 1e-3 * (params.gamma - 1) ** 2
    reg_beta = 1e-2 * ((params.beta_n / params.alpha_n) ** 2 + (params.beta_r / params.alpha_r) ** 2)
    return err_accum + err_optim + reg_gamma + reg_beta


def fit_perf_params(num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time):
    """Fit :class:`PerfParams` to measured mean step times, one entry per profiled bucket.

    Minimises the RMS error of log step times with SLSQP over the log of
    the time parameters. Parameters the data cannot identify are pinned: the
    compute intercept when one atomic batch size was seen, the inter-node
    terms without multi-node data, the intra-node terms without single-node
    multi-replica data, and the per-replica terms without more than two
    replicas. Without multi-node data, inter-node costs are set to at least
    1.1x the intra-node ones (a network hop is never cheaper).
    """
    nodes = np.asarray(num_nodes, dtype=float)
    replicas = np.asarray(num_replicas, dtype=float)
    bsz = np.asarray(atomic_bsz, dtype=float)
    accum = np.asarray(accum_step_time, dtype=float)
    optim = np.asarray(optim_step_time, dtype=float)
    if not (nodes.shape == replicas.shape == bsz.shape == accum.shape == optim.shape) or nodes.size == 0:
        raise ValueError("fit_perf_params needs equally long, non-empty arrays")
    if np.any(accum <= 0) or np.any(optim <= 0):
        raise ValueError("step times must be > 0")

    mean_accum = float(np.mean(accum))
    comm = max(float(np.mean(np.maximum(optim - accum, 0.0))), 1e-4)
    share = _ONE_BSZ_INTERCEPT_SHARE
    init = np.array([mean_accum * share, mean_accum * (1 - share) / float(np.mean(bsz)),
                     comm, comm / 10, comm, comm / 10, 1.0 + 1e-3])
    free = np.ones(7, dtype=bool)
    if len(np.unique(bsz)) == 1:
        # One atomic batch size cannot separate intercept from slope.
        free[0] = False
    else:
        # Start from the straight line through the compute times (least
        # relative error, as the objective measures it): SLSQP then needs a
        # few iterations instead of twenty.
        (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / accum, bsz / accum], axis=1),
                                            np.ones_like(accum), rcond=None)
        init[:2] = max(alpha, mean_accum * 1e-3), max(beta, mean_accum * 1e-3 / np.max(bsz))
    fixed = init.copy()
    if not np.any(nodes > 1):
        free[2:4] = False
        fixed[2:4] = _EPS
    if not np.any((nodes == 1) & (replicas > 1)):
        free[4:6] = False
        fixed[4:6] = _EPS
    if not np.any(replicas > 2):
        free[[3, 5]] = False
        fixed[[3, 5]] = _EPS

    def unpack(x):
        values = fixed.copy()
        theta = values.copy()
        theta[:6] = np.log(values[:6])
        theta[free] = x
        out = np.exp(theta)
        out[6] = theta[6]
        return PerfParams(*out)

    x0 = np.log(init)
    x0[6] = init[6]
    x0 = x0[free]
    bounds = [(math.log(_EPS), math.log(1e4))] * 6 + [_GAMMA_BOUNDS]
    bounds = [b for b, f in zip(bounds, free) if f]
    args = (nodes, replicas, bsz, accum, optim)
    if len(x0):
        # SLSQP, not L-BFGS-B: the same fits in half the time, and L-BFGS-B's
        # LAPACK calls woke BLAS threads that then spun for 0.1 s each fit.
        result = import_scipy_optimize().minimize(lambda x: _objective(unpack(x), *args),
                                                  x0, method="SLSQP", bounds=bounds)
        params = list(unpack(result.x))
    else:
        params = list(unpack(x0))
    if not np.any(nodes > 1):
        params[2] = max(params[2], params[4] * 1.1)
        params[3] = max(params[3], params[5] * 1.1)
    return PerfParams(*params)


def fit_loss(params, num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time):
    """The fitting objective of :func:`fit_perf_params` at ``params`` (for checking fits)."""
    return float(_objective(PerfParams(*params), *(np.asarray(a, dtype=float) for a in (
        num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time))))


class AutoscaleConfig:
    """What a loader may choose from, and how rank 0 makes the choice."""

    def __init__(self, init_batch_size, max_batch_size, local_bsz_bounds, gradient_accumulation,
                 decide_every, hysteresis=0.05):
        self.init_batch_size = init_batch_size
        self.max_batch_size = max_batch_size
        self.local_bsz_bounds = local_bsz_bounds
        self.gradient_accumulation = gradient_accumulation
        self.decide_every = decide_every
        self.hysteresis = hysteresis

    @classmethod
    def create(cls, init_batch_size, max_batch_size, local_bsz_bounds=None,
               gradient_accumulation=False, decide_every=50):
        """Validate the arguments of ``AdaptiveDataLoader.autoscale_batch_size``."""
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
                or max_batch_size < init_batch_size:
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
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"local_bsz_bounds {name} bound must be an int >= 1 or None, "
                                 f"got {value!r}")
        if lo > max_batch_size:
            raise ValueError(f"local_bsz_bounds lower bound {lo} exceeds max_batch_size "
                             f"{max_batch_size}")
        if lo > hi:
            raise ValueError(f"local_bsz_bounds must have lo <= hi, got ({lo}, {hi})")
        if not isinstance(gradient_accumulation, bool):
            raise ValueError(f"gradient_accumulation must be True or False, "
                             f"got {gradient_accumulation!r}")
        if isinstance(decide_every, bool) or not isinstance(decide_every, int) or decide_every < 1:
            raise ValueError(f"decide_every must be an int >= 1, got {decide_every!r}")
        return cls(init_batch_size, max_batch_size, (lo, hi), gradient_accumulation, decide_every)

    def default(self, num_replicas):
        """The choice before anything is measured: B0 split over the replicas, within bounds."""
        lo, hi = self.local_bsz_bounds
        local = math.ceil(self.init_batch_size / num_replicas)
        if local > hi and self.gradient_accumulation:
            accum = math.ceil(local / hi) - 1
            return max(lo, math.ceil(local / (accum + 1))), accum
        return min(max(local, lo), hi), 0

    def choose(self, profile, grad_params, num_nodes, num_replicas, current, forced):
        """(atomic_bsz, accum_steps) for the next steps; ``current`` is kept unless beaten by
        more than ``hysteresis`` (or ``forced``, after a resize). The throughput model is fitted
        to every world's steps, or to this world's alone once it has two batch sizes of its own."""
        if grad_params is None or len(profile) == 0:
            return self.default(num_replicas)
        data = profile.arrays()
        here = (data["num_nodes"] == num_nodes) & (data["num_replicas"] == num_replicas)
        if len(np.unique(data["atomic_bsz"][here])) >= 2:
            # The model's compute time is the same in every world, which
            # replicas sharing cores or memory bandwidth break (2-3 replicas
            # on 2 cores measured 4-30x one replica's steps). The choice is
            # for this world: once it has measured two sizes, fit to it alone.
            data = {key: values[here] for key, values in data.items()}
        perf = fit_perf_params(data["num_nodes"], data["num_replicas"], data["atomic_bsz"],
                               data["accum_step_time"], data["optim_step_time"])
        fn = GoodputFunction(perf, grad_params, self.init_batch_size)
        goodput, atomic, accum = fn.optimize(num_nodes, num_replicas, self.max_batch_size,
                                             self.local_bsz_bounds, self.gradient_accumulation)
        if goodput <= 0:
            return self.default(num_replicas)
        if not forced:
            current_goodput = fn.evaluate(num_nodes, num_replicas, current[0], current[1])
            if goodput <= (1 + self.hysteresis) * current_goodput:
                return tuple(current)
        return atomic, accum
