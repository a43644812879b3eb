"""Gradient noise scale: the estimator alone, and through the optimizer in one process."""
import numpy as np
import pytest
import torch

from hvd_adapt import GradientNoiseScale, optimizer
from launch import run_ranks


def feed(gns, rng, mu, sigma, micro_bsz, num_micro, steps, init_batch_size):
    for _ in range(steps):
        micro = mu + sigma * rng.standard_normal((num_micro, micro_bsz, mu.size)).mean(axis=1) * 1
        local_sqr = np.mean(np.sum(micro ** 2, axis=1))
        total_sqr = np.sum(micro.mean(axis=0) ** 2)
        gns.update([local_sqr], [total_sqr], micro_bsz, num_micro, init_batch_size)


@pytest.mark.parametrize("micro_bsz,num_micro", [(8, 2), (4, 8), (32, 3)])
def test_estimator_converges_to_known_statistics(micro_bsz, num_micro):
    rng = np.random.default_rng(0)
    mu, sigma = np.full(30, 0.4), np.linspace(0.5, 1.5, 30)
    gns = GradientNoiseScale(smoothing=0.999)
    feed(gns, rng, mu, sigma, micro_bsz, num_micro, 6000, init_batch_size=micro_bsz)
    assert gns.sqr[0] == pytest.approx(np.sum(mu ** 2), rel=0.10)
    assert gns.trace[0] == pytest.approx(np.sum(sigma ** 2), rel=0.10)
    assert gns.noise_scale() == pytest.approx(np.sum(sigma ** 2) / np.sum(mu ** 2), rel=0.2)


def test_estimator_skips_unusable_measurements():
    gns = GradientNoiseScale()
    assert not gns.update([np.nan], [1.0], 8, 2, 8)
    assert not gns.update([1.0], [np.inf], 8, 2, 8)
    assert not gns.update([1.0], [1.0], 8, 1, 8)
    assert not gns.has_estimate() and gns.gain(64, 8) == 1.0


def test_estimator_state_round_trip_and_bad_smoothing():
    gns = GradientNoiseScale(num_groups=2)
    gns.update([3.0, 2.0], [2.0, 1.5], 4, 2, 8)
    copy = GradientNoiseScale(num_groups=2)
    copy.load_state_dict(gns.state_dict())
    assert np.allclose(copy.sqr, gns.sqr) and np.allclose(copy.trace, gns.trace)
    with pytest.raises(ValueError, match="smoothing must be in"):
        GradientNoiseScale(smoothing=1.0)


@pytest.mark.parametrize("accumulate", [False, True], ids=["consecutive-steps", "accumulation"])
def test_optimizer_estimates_on_one_replica(accumulate):
    job = run_ranks("gns_train.py", launcher="python",
                    args=["--accumulate"] if accumulate else []).check()
    rep = job.reports[0]
    assert rep["accum"] == (3 if accumulate else 0)
    assert rep["sqr"] == pytest.approx(rep["true_sqr"], rel=0.10)
    assert rep["trace"] == pytest.approx(rep["true_trace"], rel=0.10)


def test_noise_measurement_keeps_half_precision_gradients_exact():
    # A bfloat16 result keeps 3 significant digits; the noise scale is the
    # small difference of two such sums, which that rounding would swamp.
    grad = torch.randn(40000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = float((grad.double() ** 2).sum())
    grads = [[grad[:30000], grad[30000:]], []]
    flats = optimizer._flatten(grads)
    sqr, dots = optimizer._flat_stats(flats, flats)
    assert sqr == pytest.approx([exact, 0.0], rel=1e-5)
    assert dots == pytest.approx([exact, 0.0], rel=1e-5)
    assert optimizer._sqnorms(grads) == pytest.approx([exact, 0.0], rel=1e-5)
