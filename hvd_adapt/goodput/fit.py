"""Fitting the step-time model (:class:`PerfParams`) to measured step times.

numpy and scipy only. scipy is loaded through ``hvd_adapt._runtime.blas`` so
that its BLAS starts no thread pool beside training (see that module).
"""
import math

import numpy as np

from .._runtime.blas import import_scipy_optimize
from .model import EPS, PerfParams, accum_time, log_optim_time, network_time

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


def _objective(params, num_nodes, num_replicas, atomic_bsz, measured_accum, measured_optim):
    pred_accum = accum_time(params, atomic_bsz)
    pred_log_optim = log_optim_time(params, pred_accum,
                                     network_time(params, num_nodes, num_replicas))
    err_accum = np.sqrt(np.mean((np.log(pred_accum) - np.log(measured_accum)) ** 2))
    err_optim = np.sqrt(np.mean((pred_log_optim - np.log(measured_optim)) ** 2))
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
        fixed[2:4] = EPS
    if not np.any((nodes == 1) & (replicas > 1)):
        free[4:6] = False
        fixed[4:6] = EPS
    if not np.any(replicas > 2):
        free[[3, 5]] = False
        fixed[[3, 5]] = EPS

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
    bounds = [(math.log(EPS), math.log(1e4))] * 6 + [_GAMMA_BOUNDS]
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
