"""The optimizer in one process with the recipes users run on it."""
import warnings

import pytest
import torch

import hvd_adapt
from support.small_jobs import linear_classifier


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def amp_run(measure_noise, gated):
    """bf16 autocast, GradScaler, clipping, SGD with weight decay, 8 steps of 8 samples;
    ``gated``: unscale, clip, step and update only when a batch ends an optimizer step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    model, opt, loader = linear_classifier(
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
        measure_noise=measure_noise, grad_scaler=scaler)
    for x, y in loader:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if gated and not loader.is_optim_step():
            continue
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt


def test_amp_recipe_gated_on_optimizer_steps_trains_split_steps_as_whole_ones():
    # Measuring the noise alone splits steps 0 and 4 into two half batches. The
    # recipe unscales, clips and steps at the cycle's end only, as with any
    # accumulation: the weights then end where the unsplit run's do.
    split, opt = amp_run(measure_noise=True, gated=True)
    whole, _ = amp_run(measure_noise=False, gated=True)
    assert opt.gns.num_updates == 2
    assert torch.allclose(split, whole, rtol=0, atol=5e-3), (split - whole).abs().max()
    # Unscaling every batch instead would divide the first half's gradient twice
    # by the loss scale (it lies unscaled in .grad when the second adds to it):
    # refused, at the first split step, with what to do.
    with pytest.raises(RuntimeError, match="does not end the accumulation cycle.*is_optim_step"):
        amp_run(measure_noise=True, gated=False)


def adamw_on(model):
    return hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01,
                                                            weight_decay=0.1))


def test_a_second_live_optimizer_over_the_same_parameters_is_refused():
    import gc
    model = torch.nn.Linear(3, 2)
    first = adamw_on(model)
    with pytest.raises(ValueError, match=r"parameter \(2, 3\) is averaged by another live"):
        adamw_on(model)
    del first
    gc.collect()
    second = adamw_on(model)        # staged fine-tuning, an LR finder: a new one is fine
    model(torch.ones(4, 3)).sum().backward()
    second.step()


def test_torchs_optimizer_api_works_on_it():
    import horovod.torch as hvd
    model = torch.nn.Linear(3, 2)
    opt = adamw_on(model)
    posts = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: posts.append(optimizer))
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert posts == [opt]
    state = opt.state_dict()
    assert set(state) == {"state", "param_groups", "hvd_adapt"}
    assert state["param_groups"] == opt.optimizer.state_dict()["param_groups"]
    # A plain torch optimizer's checkpoint loads (the noise scale is kept) ...
    plain = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    opt.gns.progress = 7.0
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["lr"] == 0.5 and opt.gns.progress == 7.0
    # ... the groups are the wrapped optimizer's, looked up live after the load ...
    assert opt.param_groups is opt.optimizer.param_groups
    # ... and Horovod's own helper reads it as a torch optimizer.
    hvd.broadcast_optimizer_state(opt, root_rank=0)


def test_add_param_group_keeps_progress_and_gives_the_group_a_noise_estimate():
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Parameter(torch.zeros(2))
    opt = adamw_on(model)
    opt.gns.progress = 123.0
    opt.add_param_group({"params": [extra], "lr": 0.1})
    assert opt.gns.progress == 123.0 and opt.gns.sqr.shape == (2,)
    (model(torch.ones(4, 3)).sum() + extra.sum()).backward()
    opt.step()
    assert extra.grad is not None and not torch.equal(extra, torch.zeros(2))


def test_a_caught_exception_in_backward_skips_its_cycle(caplog):
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("out of memory (simulated)")

    model, opt, loader = linear_classifier(
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01))
    loader.autoscale_batch_size(8, local_bsz_bounds=(4, 4), gradient_accumulation=True,
                                decide_every=10 ** 6)
    before = [p.detach().clone() for p in model.parameters()]
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        out = model(x)
        try:
            torch.nn.functional.cross_entropy(Boom.apply(out) if i == 0 else out, y).backward()
        except RuntimeError:
            pass                        # skip the batch, as on a CUDA out-of-memory
        opt.step()
        if i == 1:
            break
    # The cycle holding the failed backward was dropped: no step, no progress, no
    # half-accumulated gradient carried into the next cycle.
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.gns.steps == 0 and "raised" in caplog.text
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_autograd_grad_and_nested_backwards_count_no_cycle(device):
    # On CUDA the backward runs on the device's autograd thread, and a reentrant
    # checkpoint's nested backward on that thread too.
    from torch.utils.checkpoint import checkpoint
    model, opt, loader = linear_classifier(lambda params: torch.optim.SGD(params, lr=0.1),
                                           device=device)
    loader.autoscale_batch_size(8, local_bsz_bounds=(4, 4), gradient_accumulation=True,
                                decide_every=10 ** 6)
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    batches = []
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        # A gradient for a log line, then a checkpointed forward whose backward runs a
        # nested one: still one micro-step each.
        torch.autograd.grad(model(x).sum(), list(model.parameters()))
        out = checkpoint(model, x.requires_grad_(), use_reentrant=True)
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
        batches.append((x.detach(), y))
        if i == 1:
            break
    # One step of SGD on the mean of the two micro-batches' gradients.
    w, b = reference
    loss = sum(torch.nn.functional.cross_entropy(x @ w.T + b, y) for x, y in batches) / 2
    loss.backward()
    with torch.no_grad():
        expected = [w - 0.1 * w.grad, b - 0.1 * b.grad]
    for p, q in zip(model.parameters(), expected):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_parameter_listed_twice_is_refused_naming_it():
    # torch.optim only warns; stepped twice and hooked twice, it never trained as one.
    hvd_adapt.init()
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner = torch.optim.SGD([model.weight, model.bias, model.weight], lr=0.1)
    with pytest.raises(ValueError, match=r"parameter weight appears twice"):
        hvd_adapt.DistributedOptimizer(inner, named_parameters=model.named_parameters())
