"""The optimizer in one process with the recipes users run on it."""
import pytest
import torch

import hvd_adapt
from small_jobs import linear_classifier


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
    # Unscaling every batch instead divides the first half's gradient twice
    # by the loss scale (it lies unscaled in .grad when the second adds to it).
    ungated, _ = amp_run(measure_noise=True, gated=False)
    assert (ungated - whole).abs().max() > 0.05
