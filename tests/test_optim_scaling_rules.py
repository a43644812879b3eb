"""Learning-rate scaling rules: exact factors, and training with accumulation."""
import math

import pytest
import torch
from torch.utils.data import TensorDataset

import hvd_adapt
from hvd_adapt import (AdamScale, AdaScale, AdaptiveDataLoader, DistributedOptimizer,
                       GradientNoiseScale, LEGWScale, LinearScale, SqrtScale, State)


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def gns_with(sqr, trace):
    """A noise scale whose estimate is exactly (sqr, trace): one update, bias-corrected."""
    gns = GradientNoiseScale()
    # From sqr = 2*total - local and trace = (local - total) * b * 2 with b = 1, n = 2.
    total = sqr + trace / 2
    local = total + trace / 2
    gns.update([local], [total], micro_bsz=1, num_micro=2, init_batch_size=10)
    assert gns.sqr[0] == pytest.approx(sqr) and gns.trace[0] == pytest.approx(trace)
    return gns


@pytest.mark.parametrize("sqr,trace,scale", [(1.0, 30.0, 4.0), (2.0, 1.0, 8.0), (0.5, 500.0, 16)])
def test_exact_factors(sqr, trace, scale):
    b0 = 10
    gns = gns_with(sqr, trace)
    var = trace / b0
    gain = (var + sqr) / (var / scale + sqr)
    args = (gns, scale * b0, b0, 2)
    assert AdaScale().lr_factors(*args) == pytest.approx([gain, gain])
    assert AdamScale().lr_factors(*args) == pytest.approx([math.sqrt(gain)] * 2)
    assert LinearScale().lr_factors(*args) == pytest.approx([scale, scale])
    assert SqrtScale().lr_factors(*args) == pytest.approx([math.sqrt(scale)] * 2)
    group = {"betas": (0.9, 0.999)}
    original = AdamScale().adjust_group(group, gns, scale * b0, b0)
    assert original == {"betas": (0.9, 0.999)}
    assert group["betas"] == pytest.approx((0.9 ** gain, 0.999 ** gain))


def test_legw_warms_up_over_scaled_epochs():
    gns = gns_with(1.0, 1.0)
    rule = LEGWScale(base_warmup_epochs=2, data_size=1000)
    # scale 4 at B0 = 10: warm-up lasts 2 * 4 * 1000 / 10 = 800 B0-steps, up to sqrt(4) = 2.
    gns.progress = 200
    assert rule.lr_factors(gns, 40, 10, 1) == pytest.approx([0.5])
    gns.progress = 800
    assert rule.lr_factors(gns, 40, 10, 1) == pytest.approx([2.0])
    with pytest.raises(ValueError, match="data_size must be >= 1, got 0"):
        LEGWScale(1, 0)


def test_default_rule_follows_the_optimizer():
    w = [torch.nn.Parameter(torch.zeros(1))]
    assert type(DistributedOptimizer(torch.optim.Adam(w)).scaling_rule) is AdamScale
    assert type(DistributedOptimizer(torch.optim.AdamW(w)).scaling_rule) is AdamScale
    assert type(DistributedOptimizer(torch.optim.SGD(w, lr=0.1)).scaling_rule) is AdaScale
    with pytest.raises(ValueError, match="ScalingRule"):
        DistributedOptimizer(torch.optim.SGD(w, lr=0.1), scaling_rule="linear")
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        DistributedOptimizer(object())


def regression(samples=512, seed=0, noise=0.1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 5, generator=gen)
    y = x @ torch.arange(1.0, 6.0) + noise * torch.randn(samples, generator=gen)
    least_squares = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    return TensorDataset(x, y), least_squares


def fit(dataset, batch_size, bounds=None, epochs=1, rule=None, lr=0.05, max_batch_size=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1, bias=False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), scaling_rule=rule)
    loader = AdaptiveDataLoader(dataset, batch_size=batch_size, shuffle=True)
    if bounds:
        loader.autoscale_batch_size(max_batch_size or batch_size, local_bsz_bounds=bounds,
                                    gradient_accumulation=True, decide_every=5)
    state = State(model=model, optimizer=opt, loader=loader)
    for _ in hvd_adapt.remaining_epochs_until(epochs):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            state.commit()
    return model.weight.detach().squeeze(0), loader


def test_accumulation_equals_one_large_batch():
    data, _ = regression()
    big, _ = fit(data, 32)
    accumulated, loader = fit(data, 32, bounds=(1, 8))
    assert loader.accumulation_steps == 3 and loader.current_local_bsz == 8
    assert torch.allclose(big, accumulated, atol=1e-5)


@pytest.mark.parametrize("rule", [AdaScale(), LinearScale(), SqrtScale()], ids=type)
def test_converges_with_accumulation_above_the_initial_batch(rule):
    # B0 = 10 with atomic batches of at most 4: 3 micro-batches of 4, so B = 12 > B0
    # and the rule scales the lr on every step.
    data, w_best = regression(1024, noise=1.0)
    w, loader = fit(data, 10, bounds=(1, 4), epochs=8, rule=rule, lr=0.01)
    assert (loader.current_local_bsz, loader.accumulation_steps) == (4, 2)
    assert loader.current_batch_size == 12
    assert torch.allclose(w, w_best, atol=0.05), (w, w_best)


@pytest.mark.parametrize("rule", [AdaScale(), LinearScale(), SqrtScale()], ids=type)
def test_converges_when_goodput_grows_the_batch(rule):
    # Noisy labels make the gradient noise scale large, so goodput grows the batch.
    data, w_best = regression(2048, noise=10.0)
    w, loader = fit(data, 8, bounds=(1, 32), epochs=8, rule=rule, lr=0.005, max_batch_size=64)
    assert loader.current_batch_size > 8
    torch.manual_seed(0)
    w_start = torch.nn.Linear(5, 1, bias=False).weight.detach().squeeze(0)
    # Label noise keeps SGD jittering around the optimum; it must still close
    # nine tenths of the distance.
    assert (w - w_best).norm() < 0.1 * (w_start - w_best).norm(), (w, w_best)
