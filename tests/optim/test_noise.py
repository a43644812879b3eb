"""Gradient noise scale: the estimator alone, and through the optimizer in one process."""
import numpy as np
import pytest
import torch

from hvd_adapt import GradientNoiseScale
from hvd_adapt.autoscale.controller import MEASURE_EVERY
from hvd_adapt.optim import noise
from support.launch import run_ranks


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


@pytest.mark.parametrize("accumulate", [False, True], ids=["split-steps", "accumulation"])
def test_optimizer_estimates_on_one_replica(accumulate):
    job = run_ranks("gns_train.py", launcher="python",
                    args=["--accumulate"] if accumulate else []).check()
    rep = job.reports[0]
    assert rep["accum"] == (3 if accumulate else 0)
    # 24000 samples, 16 per optimizer step, one step in MEASURE_EVERY measured
    # (alone and without accumulation, on its two halves).
    assert rep["updates"] == 1500 // MEASURE_EVERY
    assert rep["sqr"] == pytest.approx(rep["true_sqr"], rel=0.10)
    assert rep["trace"] == pytest.approx(rep["true_trace"], rel=0.10)


@pytest.mark.parametrize("accumulate", [False, True], ids=["split-steps", "accumulation"])
def test_one_replica_stays_unbiased_while_the_parameters_move(accumulate):
    # On the quadratic with lr 0.3, consecutive steps' gradients differ by the
    # drift too: the old pair estimate of tr(Sigma) came out ~1.35x too high.
    args = ["--problem", "quadratic", "--lr", 0.3] + (["--accumulate"] if accumulate else [])
    rep = run_ranks("gns_train.py", launcher="python", args=args).check().reports[0]
    assert rep["trace"] == pytest.approx(rep["true_trace"], rel=0.10)
    assert rep["sqr"] < 1.0  # |G|^2 fell from 5 as w moved to mu


def test_adam_noise_on_one_replica_is_measured_in_its_preconditioned_space():
    args = ["--optimizer", "adam", "--lr", 0.01, "--samples", 16000]
    rep = run_ranks("gns_train.py", launcher="python", args=args).check().reports[0]
    # Raw gradients would give |G|^2 = 5 and tr = 20; preconditioned, about 16 and 64.
    assert rep["sqr"] == pytest.approx(rep["true_sqr"], rel=0.10)
    assert rep["trace"] == pytest.approx(rep["true_trace"], rel=0.10)


def test_noise_measurement_keeps_half_precision_gradients_exact():
    # A bfloat16 result keeps 3 significant digits; the noise scale is the
    # small difference of two such sums, which that rounding would swamp.
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(40000, generator=gen).to(torch.bfloat16)
    exact = float((grad.double() ** 2).sum())
    assert noise.group_sqnorms([[grad[:30000], grad[30000:]], []]).numpy() == pytest.approx(
        [exact, 0.0], rel=1e-5)


def test_total_sqnorm_divides_where_a_denominator_is_given():
    gen = torch.Generator().manual_seed(0)
    a, b, d = (torch.randn(*shape, generator=gen) for shape in [(30, 4), (7,), (30, 4)])
    d = d.abs() + 0.5
    expected = float(((a.double() / d.double()) ** 2).sum() + (b.double() ** 2).sum())
    got = noise.total_sqnorm([a, b], [d, None])
    assert got.dtype == torch.float64 and float(got) == pytest.approx(expected, rel=1e-6)
    assert float(noise.total_sqnorm([a, b])) == pytest.approx(
        float((a.double() ** 2).sum() + (b.double() ** 2).sum()), rel=1e-6)


@pytest.mark.parametrize("device,capturable", [
    ("cpu", False),
    pytest.param("cuda", True, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                        reason="needs a CUDA device"))])
def test_adam_denominators_are_what_its_update_divides_by(device, capturable):
    # capturable Adam keeps its step on the device: the denominators are then
    # taken there too, without reading the step on the host.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, device=device)),
              torch.nn.Parameter(torch.randn(5, device=device))]
    opt = torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.99), eps=1e-3, capturable=capturable)
    for _ in range(3):
        opt.zero_grad()
        sum((p ** 3).sum() for p in params).backward()
        opt.step()
    denominators = noise.adam_denominators([opt.state[p] for p in params] + [{}],
                                           opt.param_groups[0])
    assert denominators[-1] is None
    for p, denominator in zip(params, denominators):
        expected = (opt.state[p]["exp_avg_sq"] / (1 - 0.99 ** 3)).sqrt() + 1e-3
        torch.testing.assert_close(denominator, expected)


def test_gain_follows_updates_and_restores():
    gns = GradientNoiseScale()
    assert gns.gain(64, 32) == 1.0
    gns.update([5.0], [3.0], 8, 2, 32)
    first = gns.gain(64, 32)
    assert first > 1.0 and gns.gain(64, 32, per_group=True)[0] == pytest.approx(first)
    gns.update([5.0], [4.9], 8, 2, 32)
    assert gns.gain(64, 32) != first
    restored = GradientNoiseScale()
    restored.load_state_dict(gns.state_dict())
    assert restored.gain(64, 32) == pytest.approx(gns.gain(64, 32))
    gns.load_state_dict(GradientNoiseScale().state_dict())
    assert gns.gain(64, 32) == 1.0
    with pytest.raises(ValueError):
        gns.gain(64, 32, per_group=True)[0] = 2.0


def test_local_norms_travel_in_the_gradients_dtype_when_it_holds_them():
    def params(*dtypes):
        out = []
        for dtype in dtypes:
            p = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
            p.grad = torch.ones(2, dtype=dtype)
            out.append(p)
        return out
    assert noise.stats_dtype(params(torch.float32, torch.float32)) == torch.float32
    assert noise.stats_dtype(params(torch.float64)) == torch.float64
    assert noise.stats_dtype(params(torch.bfloat16)) == torch.float64
    assert noise.stats_dtype(params(torch.float32, torch.float16)) == torch.float64


def test_adams_denominators_exist_a_bucket_at_a_time(monkeypatch):
    # sqrt(v_hat)+eps is as large as the parameters: computed where each norm
    # is taken (a bucket's micro-batch norms, a tensor's in a later micro-step's
    # hook, a bucket's mean-gradient norm) and never kept across micro-steps,
    # so a measured cycle needs at most one bucket's worth more memory.
    import hvd_adapt
    import hvd_adapt.optim.distributed as distributed
    from support.small_jobs import linear_classifier
    hvd_adapt.init()
    calls = []

    def counted(states, group):
        calls.append(len([state for state in states if state]))
        return noise.adam_denominators(states, group)
    monkeypatch.setattr(distributed, "adam_denominators", counted)
    # Buckets of one tensor each.
    model, opt, loader = linear_classifier(lambda params: torch.optim.AdamW(params, lr=0.01),
                                           measure_noise=True, bucket_cap_mb=1e-9)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.gns.num_updates == 2
    # Steps 0 and 4 are measured on two half batches; at step 0 Adam has no
    # second moment yet. At step 4 each of the 2 tensors' denominators is
    # computed three times: first half, second half, mean.
    assert max(calls) == 1 and sum(calls) == 6, calls
