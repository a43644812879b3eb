"""Goodput model, fit and optimiser: pure numpy, no Horovod."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hvd_adapt.goodput import GoodputFunction, GradParams, PerfParams, fit_loss, fit_perf_params


def random_functions(seed, count=25):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        perf = PerfParams(*rng.uniform(1e-3, 0.2, 6), rng.uniform(1, 10))
        grad = GradParams(sqr=rng.uniform(1e-3, 10), var=rng.uniform(1e-3, 10))
        yield GoodputFunction(perf, grad, init_batch_size=int(rng.integers(16, 256)))


@pytest.mark.parametrize("seed", range(4))
def test_invariants_on_random_parameters(seed):
    replicas = np.arange(1, 65)
    nodes = np.ceil(replicas / 4)
    for fn in random_functions(seed):
        for b in (1, 16, 128):
            for s in (0, 3):
                tput = fn.throughput(nodes, replicas, b, s)
                assert np.all(tput >= 0)
                per_replica = tput / replicas
                # Beyond the first node, adding replicas never helps each replica.
                assert np.all(np.diff(per_replica[4:]) <= 1e-9 * per_replica[4:-1])
        batch = np.geomspace(fn.init_batch_size, 100 * fn.init_batch_size, 200)
        eff = fn.efficiency(batch)
        assert np.all((eff > 0) & (eff <= 1 + 1e-12))
        assert np.all(np.diff(eff) <= 1e-12)
        assert fn.efficiency(fn.init_batch_size) == pytest.approx(1.0)


@pytest.mark.parametrize("accumulation", [False, True])
def test_optimize_respects_bounds(accumulation):
    for fn in random_functions(7):
        max_batch = 8 * fn.init_batch_size
        lo, hi = 4, 64
        for replicas in (1, 2, 5, 16):
            nodes = max(1, replicas // 4)
            goodput, b, s = fn.optimize(nodes, replicas, max_batch, (lo, hi), accumulation)
            if goodput == 0:
                continue
            assert lo <= b <= hi
            assert replicas * b * (s + 1) <= max_batch
            assert accumulation or s == 0
            assert goodput == pytest.approx(fn.evaluate(nodes, replicas, b, s))


def exhaustive_best(fn, nodes, replicas, max_batch, lo, hi, accumulation):
    """The best goodput over every allowed (atomic batch, accumulation steps): within the
    bounds, at most max_batch, and at least B0 split over replicas and steps, rounded down."""
    atomic = np.arange(lo, hi + 1)
    most = max_batch // (replicas * lo) if accumulation else 1
    accum = np.arange(0, max(most, 1))[:, None]
    goodput = fn.evaluate(nodes, replicas, atomic, accum)
    feasible = (replicas * atomic * (accum + 1) <= max_batch) & \
        (atomic >= fn.init_batch_size // (replicas * (accum + 1)))
    return float(np.where(feasible, goodput, 0.0).max())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("accumulation", [False, True])
def test_optimize_reaches_the_exhaustive_best(seed, accumulation):
    rng = np.random.default_rng(100 + seed)
    worst = 1.0
    for fn in random_functions(seed, count=20):
        replicas = int(rng.choice([1, 2, 3, 5, 6, 7, 8, 12, 16]))
        nodes = int(rng.integers(1, replicas + 1))
        lo = int(rng.integers(1, 33))
        hi = int(rng.integers(lo, 513))
        cap = int(fn.init_batch_size * rng.choice([1, 2, 8, 32]))
        best = exhaustive_best(fn, nodes, replicas, cap, lo, hi, accumulation)
        goodput, b, s = fn.optimize(nodes, replicas, cap, (lo, hi), accumulation)
        if best == 0:
            assert goodput == 0
            continue
        assert lo <= b <= hi and replicas * b * (s + 1) <= cap and (accumulation or s == 0)
        assert goodput == pytest.approx(float(fn.evaluate(nodes, replicas, b, s)))
        worst = min(worst, goodput / best)
    assert worst >= 0.999


def test_optimize_when_the_replicas_do_not_divide_the_initial_batch():
    # The default max_batch_size is B0: 3 replicas of B0=128 train 3 x 42.
    fn = GoodputFunction(PerfParams(0.02, 0.001, 0.1, 0.01, 0.05, 0.005, 1.5),
                         GradParams(sqr=1.0, var=4.0), init_batch_size=128)
    for replicas in (3, 5, 6, 7):
        goodput, b, s = fn.optimize(1, replicas)
        assert (b, s) == (128 // replicas, 0)
        assert goodput == pytest.approx(float(fn.evaluate(1, replicas, b, 0)))


def test_optimize_reaches_a_cap_the_replicas_do_not_divide():
    # Bigger is better here: without accumulation the answer fills
    # max_batch_size as closely as whole atomic batches allow.
    fn = GoodputFunction(PerfParams(0.01, 1e-4, 1e-3, 1e-3, 1e-3, 1e-4, 1.0),
                         GradParams(sqr=1e-6, var=1.0), 128)
    for replicas in (3, 5, 6, 7):
        for accumulation, hi in ((False, 4096), (True, 100)):
            goodput, b, s = fn.optimize(1, replicas, 4096, (1, hi), accumulation)
            best = exhaustive_best(fn, 1, replicas, 4096, 1, hi, accumulation)
            assert goodput >= 0.999 * best
            if not accumulation:
                assert 4096 - replicas * b < replicas


def test_optimize_reaches_the_atomic_bound_exactly_where_bigger_is_better():
    # Noise-dominated gradients and a step time all intercept: goodput grows
    # with the batch, so the answer is the largest batch without accumulation.
    fn = GoodputFunction(PerfParams(0.01, 1e-9, 1e-8, 1e-8, 1e-8, 1e-8, 1.0),
                         GradParams(sqr=1e-6, var=1.0), 32)
    for replicas in (1, 3):
        assert fn.optimize(1, replicas, 512, (8, 128), accumulation=True)[1:] == (128, 0)


def test_optimize_vectorised_and_for_worlds_not_yet_had():
    fn = next(random_functions(3))
    replicas = np.array([1, 2, 4, 8, 1024])
    goodput, b, s = fn.optimize(np.ones(5), replicas, 1 << 20, (1, 512))
    assert goodput.shape == b.shape == s.shape == (5,)
    single = fn.optimize(1, 1024, 1 << 20, (1, 512))
    assert single == (pytest.approx(goodput[-1]), b[-1], s[-1])


def test_optimize_when_nothing_fits_returns_zero():
    fn = next(random_functions(1))
    goodput, b, s = fn.optimize(1, 4, max_batch_size=fn.init_batch_size, atomic_bsz_range=(1000, 2000))
    assert goodput == 0 and b == 1000 and s == 0


def test_optimize_rejects_impossible_worlds():
    fn = next(random_functions(2))
    with pytest.raises(ValueError, match="num_nodes=3, num_replicas=2"):
        fn.optimize(3, 2)


def synthetic_profile(params, seed, noise=0.02):
    rng = np.random.default_rng(seed)
    rows = []
    for nodes, replicas in [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16)]:
        for b in (8, 32, 128):
            fn = GoodputFunction(params, GradParams(1, 1), 8)
            accum = fn.step_time(nodes, replicas, b, 1) - fn.step_time(nodes, replicas, b, 0)
            optim = fn.step_time(nodes, replicas, b, 0)
            rows.append((nodes, replicas, b, accum * rng.lognormal(0, noise),
                         optim * rng.lognormal(0, noise)))
    return [np.array(col, dtype=float) for col in zip(*rows)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_known_parameters(seed):
    true = PerfParams(0.02, 0.004, 0.15, 0.01, 0.05, 0.004, 2.0)
    data = synthetic_profile(true, seed)
    fitted = fit_perf_params(*data)
    assert 1.0 <= fitted.gamma <= 10.0
    assert fit_loss(fitted, *data) <= 1.1 * fit_loss(true, *data)
    truth_fn = GoodputFunction(true, GradParams(1, 1), 8)
    fitted_fn = GoodputFunction(fitted, GradParams(1, 1), 8)
    nodes, replicas, bsz = data[0], data[1], data[2]
    for s in (0, 2):
        predicted = fitted_fn.step_time(nodes, replicas, bsz, s)
        actual = truth_fn.step_time(nodes, replicas, bsz, s)
        assert np.all(np.abs(predicted / actual - 1) < 0.10)


def test_fit_pins_what_the_data_cannot_identify():
    # One node, at most two replicas, one batch size.
    fitted = fit_perf_params([1, 1], [1, 2], [32, 32], [0.1, 0.1], [0.12, 0.2])
    assert fitted.alpha_c == pytest.approx(0.09)
    assert fitted.beta_r == pytest.approx(1e-8)
    # Prior: crossing nodes costs at least as much as staying on one.
    assert fitted.alpha_n >= 1.1 * fitted.alpha_r - 1e-12
    assert fitted.beta_n >= 1.1 * fitted.beta_r - 1e-12


def test_fit_leaves_no_blas_threads_spinning():
    # OpenBLAS threads spin for about 0.1 s when started, taking a core from
    # the training steps around them. A fork (MPI_Init of a single process
    # forks one) shuts the pool down; unless scipy's BLAS was loaded with one
    # thread, the first fit after it started a thread anew (0.1 s of CPU
    # measured while idle).
    # A fresh interpreter: other tests may have left threads of their own.
    script = textwrap.dedent("""
        import os, time
        from hvd_adapt._runtime.blas import import_scipy_optimize
        from hvd_adapt.goodput import fit_perf_params
        import_scipy_optimize()
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        worst = 0.0
        for n in range(1, 7):
            bsz = [16 * 2 ** i for i in range(n)]
            step = [1e-3 + 2e-6 * b for b in bsz]
            fit_perf_params([1] * n, [1] * n, bsz, step, [1.1 * t for t in step])
            cpu = time.process_time()
            time.sleep(0.2)
            worst = max(worst, time.process_time() - cpu)
        print(worst)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    idle_cpu = float(out.stdout.strip().splitlines()[-1])
    assert idle_cpu < 0.03, f"{idle_cpu:.3f} s of CPU while idle after a fit"


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        fit_perf_params([], [], [], [], [])
    with pytest.raises(ValueError, match="> 0"):
        fit_perf_params([1], [1], [8], [0.0], [0.1])
