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


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_legw_follows_the_papers_closed_form(k):
    # You et al. 2019: at k times the base batch, warm up linearly over k times the
    # base warm-up epochs to sqrt(k) times the base lr. In optimizer steps that is
    # E0 * N / B0 at every batch size (k * E0 epochs of N / (k * B0) steps).
    e0, n, b0 = 5, 1000, 10
    rule = LEGWScale(base_warmup_epochs=e0, data_size=n)
    warmup_steps = e0 * n / b0
    steps_per_epoch = n / (k * b0)
    assert warmup_steps / steps_per_epoch == k * e0
    for t in (0, 100, 250, 499, 500, 5000):
        gns = type("Steps", (), {"steps": t})()
        expected = math.sqrt(k) * min(1.0, t / warmup_steps)
        assert rule.lr_factors(gns, k * b0, b0, 1) == pytest.approx([expected])
    with pytest.raises(ValueError, match="data_size must be >= 1, got 0"):
        LEGWScale(1, 0)


def test_legw_gives_a_larger_batch_a_larger_lr_at_every_step():
    rule = LEGWScale(base_warmup_epochs=5, data_size=1000)
    gns = type("Steps", (), {"steps": 400})()
    factors = [float(rule.lr_factors(gns, k * 10, 10, 1)[0]) for k in (1, 2, 4, 8)]
    assert factors == sorted(factors) and factors[0] == pytest.approx(0.8)


def test_default_rule_follows_the_optimizer():
    def w():
        return [torch.nn.Parameter(torch.zeros(1))]
    assert type(DistributedOptimizer(torch.optim.Adam(w())).scaling_rule) is AdamScale
    assert type(DistributedOptimizer(torch.optim.AdamW(w())).scaling_rule) is AdamScale
    assert type(DistributedOptimizer(torch.optim.SGD(w(), lr=0.1)).scaling_rule) is AdaScale
    with pytest.raises(ValueError, match="ScalingRule"):
        DistributedOptimizer(torch.optim.SGD(w(), lr=0.1), scaling_rule="linear")
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
    w, loader = fit(data, 10, bounds=(1, 4), epochs=8, rule=rule, lr=0.01, max_batch_size=12)
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


class RecordingSGD(torch.optim.SGD):
    """SGD that records each group's lr and betas as the step sees them."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([(g["lr"], g.get("betas")) for g in self.param_groups])
        return super().step(closure)


def steps_seen(rule, batch_size, init_batch_size, steps=3, groups=1, gns=None):
    """What the wrapped optimizer's step saw, in a loader plan of ``batch_size`` at B0."""
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    inner = RecordingSGD([{"params": [p], "lr": 0.1 * (i + 1), "betas": (0.9, 0.99)}
                          for i, p in enumerate(params)], lr=0.1)
    opt = DistributedOptimizer(inner, scaling_rule=rule)
    if gns is not None:
        opt.gns.load_state_dict(gns.state_dict())
    data = TensorDataset(torch.ones(steps * batch_size, 2))
    loader = AdaptiveDataLoader(data, batch_size=init_batch_size)
    lo = batch_size
    loader.autoscale_batch_size(max(batch_size, init_batch_size), local_bsz_bounds=(lo, lo),
                                decide_every=1000)
    opt.measure_noise = False
    State(optimizer=opt, loader=loader)
    for (x,) in loader:
        opt.zero_grad()
        sum((x @ p).sum() for p in params).backward()
        opt.step()
    return inner.seen, opt


def test_legw_warms_up_inside_the_optimizer_by_its_steps():
    rule = LEGWScale(base_warmup_epochs=1, data_size=40)
    # 1 * 40 / 10 = 4 optimizer steps at any batch: lr x 0, 1/4, 2/4 at B0 ...
    seen, _ = steps_seen(rule, 10, 10)
    assert [s[0][0] for s in seen] == pytest.approx([0.0, 0.025, 0.05])
    # ... and x sqrt(2) as much at 2 x B0.
    seen, opt = steps_seen(rule, 20, 10)
    assert [s[0][0] for s in seen] == pytest.approx([0.1 * math.sqrt(2) * k / 4 for k in (0, 1, 2)])
    assert opt.gns.steps == 3 and opt.gns.progress == 3  # gain 1 without a noise estimate


@pytest.mark.parametrize("rule,factor", [
    (AdaScale(), lambda s, g: g), (AdamScale(), lambda s, g: math.sqrt(g)),
    (LinearScale(), lambda s, g: s), (SqrtScale(), lambda s, g: math.sqrt(s))],
    ids=["AdaScale", "AdamScale", "LinearScale", "SqrtScale"])
@pytest.mark.parametrize("scale", [1, 3])
def test_rules_inside_the_optimizer_match_their_closed_forms(rule, factor, scale):
    gns = gns_with(1.0, 30.0)
    seen, opt = steps_seen(rule, 10 * scale, 10, gns=gns)
    gain = float(gns.gain(10 * scale, 10))
    assert [s[0][0] for s in seen] == pytest.approx([0.1 * factor(scale, gain)] * 3)


def test_adamscale_raises_each_groups_betas_to_its_own_gain():
    gns = GradientNoiseScale(num_groups=2)
    # Group 0 noise-dominated (large gain), group 1 noise-free (gain 1).
    gns.update([31.0, 2.0], [16.0, 2.0], micro_bsz=1, num_micro=2, init_batch_size=10)
    gains = gns.gain(40, 10, per_group=True)
    assert gains[0] > 1.5 and gains[1] == pytest.approx(1.0)
    seen, _ = steps_seen(AdamScale(), 40, 10, groups=2, gns=gns)
    for (lr0, betas0), (lr1, betas1) in seen:
        assert betas0 == pytest.approx((0.9 ** gains[0], 0.99 ** gains[0]))
        assert betas1 == pytest.approx((0.9, 0.99))


def test_a_horovod_distributed_optimizer_is_refused():
    import horovod.torch as hvd
    model = torch.nn.Linear(2, 1)
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="Horovod DistributedOptimizer.*plain torch optimizer"):
        DistributedOptimizer(wrapped)
