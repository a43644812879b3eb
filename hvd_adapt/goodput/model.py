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

        The choice is over integer atomic batches within ``atomic_bsz_range``
        and, with ``accumulation``, integer accumulation steps, such that the
        global batch ``num_replicas * atomic_bsz * (accum_steps + 1)`` is at
        most ``max_batch_size`` (default: the initial batch B0) and not below
        B0 by more than rounding: the atomic batch is at least B0 split over
        replicas and steps, rounded down (B0=128 on 3 replicas: 3 x 42). The
        recipe was tuned at B0, and the efficiency model gives smaller
        batches no credit, so going below it is never the better choice
        the model could show. Scalars in,
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

        nodes, replicas = nodes[:, None, None], replicas[:, None, None]
        if accumulation:
            accum = self._accumulation_candidates(nodes, replicas, max_batch_size, lo, hi)
        else:
            accum = np.zeros((len(replicas), 1, 1))
        # For a fixed accumulation count goodput is smooth in the atomic
        # batch: a coarse geometric grid finds the peak, a fine one between
        # its neighbours pins it, and the integers either side of every fine
        # point and both ends of the range are the candidates.
        top = np.minimum(hi, np.floor(max_batch_size / (replicas * (accum + 1)) + 1e-9))
        least = np.maximum(lo, np.floor(self.init_batch_size / (replicas * (accum + 1)) + 1e-9))
        top = np.maximum(top, least)  # where least > top nothing fits; valid says so below
        coarse = np.geomspace(least[..., 0], top[..., 0], num=48, axis=-1)
        peak = np.argmax(self.evaluate(nodes, replicas, coarse, accum), axis=-1)[..., None]
        left = np.take_along_axis(coarse, np.maximum(peak - 1, 0), axis=-1)
        right = np.take_along_axis(coarse, np.minimum(peak + 1, coarse.shape[-1] - 1), axis=-1)
        fine = left + (right - left) * np.linspace(0.0, 1.0, 33)
        atomic = np.concatenate([np.floor(fine), np.ceil(fine), least, top], axis=-1)
        atomic = np.clip(atomic, least, top)
        accum = np.broadcast_to(accum, atomic.shape)
        valid = (replicas * atomic * (accum + 1) <= max_batch_size) & (atomic <= hi)
        goodput = np.where(valid, self.evaluate(nodes, replicas, atomic, accum), 0.0)

        flat = goodput.reshape(len(goodput), -1)
        best = np.argmax(flat, axis=1)
        rows = np.arange(len(flat))
        best_goodput = flat[rows, best]
        found = best_goodput > 0
        best_atomic = np.where(found, atomic.reshape(len(flat), -1)[rows, best], lo).astype(int)
        best_accum = np.where(found, accum.reshape(len(flat), -1)[rows, best], 0).astype(int)
        if scalar:
            return float(best_goodput[0]), int(best_atomic[0]), int(best_accum[0])
        return best_goodput.reshape(shape), best_atomic.reshape(shape), best_accum.reshape(shape)

    def _accumulation_candidates(self, nodes, replicas, max_batch_size, lo, hi):
        # For a given local batch, fewer and larger micro-batches are never
        # slower (each micro-step pays alpha_c, the last one's compute hides
        # part of the allreduce), so the continuous optimum takes the fewest
        # steps the atomic bound allows. Its step count, and the one that
        # reaches max_batch_size, are where the integer optimum lies; two on
        # either side of each absorb rounding to whole samples.
        most = np.floor(max_batch_size / (replicas * lo) + 1e-9) - 1
        least = np.maximum(lo, np.floor(self.init_batch_size / replicas + 1e-9))
        local = np.geomspace(least[..., 0], np.maximum(max_batch_size / replicas, least)[..., 0],
                             num=256, axis=-1)
        steps = np.ceil(local / hi - 1e-9) - 1
        relaxed = self.evaluate(nodes, replicas, local / (steps + 1), steps)
        peak = np.take_along_axis(steps, np.argmax(relaxed, axis=-1)[..., None], axis=-1)
        at_cap = np.ceil(max_batch_size / (replicas * hi) - 1e-9) - 1
        window = np.arange(-2, 3)
        candidates = np.concatenate([np.zeros_like(peak), peak + window, at_cap + window], axis=-1)
        return np.swapaxes(np.clip(candidates, 0, np.maximum(most, 0)), 1, 2)
