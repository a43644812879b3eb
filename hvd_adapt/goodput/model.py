"""Goodput: throughput x statistical efficiency, and the batch size that maximises it.

The models are those of Pollux (Qiao et al., "Pollux: Co-adaptive Cluster
Scheduling for Goodput-Optimized Deep Learning", OSDI 2021), as AdaptDL uses
them. Plain numpy, so a scheduler can ask "what would 16 replicas give this
job?" without torch or Horovod:

>>> perf = PerfParams(0.02, 0.001, 0.1, 0.01, 0.05, 0.005, 1.5)
>>> grad = GradParams(sqr=1.0, var=4.0)
>>> fn = GoodputFunction(perf, grad, init_batch_size=128)
>>> goodput, atomic_bsz, accum_steps = fn.optimize(num_nodes=4, num_replicas=16,
...                                                max_batch_size=4096,
...                                                atomic_bsz_range=(32, 512))
>>> goodput > 0 and 32 <= atomic_bsz <= 512
True
"""
import collections

import numpy as np


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

EPS = 1e-8


def accum_time(params, atomic_bsz):
    # Forward and backward passes scale linearly with the atomic batch size.
    return params.alpha_c + params.beta_c * atomic_bsz


def network_time(params, num_nodes, num_replicas):
    # The slowest link in use bounds the allreduce: between nodes if there are
    # several, else between replicas of one node; with one replica there is
    # no communication. A ring allreduce takes a number of rounds growing with
    # the replicas, which beta models beyond the first two.
    conds = [np.greater(num_nodes, 1), np.greater(num_replicas, 1)]
    alpha = np.select(conds, [params.alpha_n, params.alpha_r], EPS)
    beta = np.select(conds, [params.beta_n, params.beta_r], EPS)
    return alpha + beta * np.maximum(np.subtract(num_replicas, 2), EPS)


def log_optim_time(params, accum, network):
    # (T_acc^g + T_net^g)^(1/g): gamma interpolates between compute and
    # communication adding up (g=1) and overlapping completely (g -> inf).
    g = params.gamma
    return np.logaddexp(g * np.log(accum), g * np.log(network)) / g


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
        accum = accum_time(self.perf_params, atomic_bsz)
        network = network_time(self.perf_params, num_nodes, num_replicas)
        optim = np.exp(log_optim_time(self.perf_params, accum, network))
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
        sqr, var = max(self.grad_params.sqr, 0.0), max(self.grad_params.var, EPS)
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
