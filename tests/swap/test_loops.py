"""Everyday training loops with the optimizer state on disk, each against
the same loop with a plain torch AdamW in memory (same seeds, same data), bitwise. Where a
swapped run deviates, the same loop under DistributedOptimizer without swap_dir is run too,
so a failure says whether the swap or the wrapper deviates.

Each loop is also made to fail one step part-way (the inner optimizer raises after some
chunks moved): every later step must refuse until a restore, which must bring the
parameters back exactly as they were at the commit just before that step, and stepping
again must give the reference's training."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hvd_adapt
from hvd_adapt import DistributedOptimizer, State
from support.hooked_optimizer import HookedAdamW

STEPS = 6
FAIL_AT = 3             # the step made to fail part-way (swapped run only), then retried
BUFFER_MB = 24 / 1024   # chunks of a parameter or two: more chunks than buffers


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def _raise():
    raise RuntimeError("injected: the inner optimizer failed")


# -- models ------------------------------------------------------------------------------

class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.heads = torch.nn.ModuleList([torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)])
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x, head=0):
        return self.heads[head](self.norm(self.body(x)))


class TiedLM(torch.nn.Module):
    """An embedding tied to the LM head, blocks under activation checkpointing."""

    def __init__(self, reentrant):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(
            torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
            for _ in range(3)])
        self.reentrant = reentrant

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        # The tied head inside a checkpointed function too: the embedding's weight gets
        # gradient from two places, one recomputed in backward.
        return checkpoint(lambda t: F.linear(t, self.emb.weight), h,
                          use_reentrant=self.reentrant)


def hf_groups(model, weight_decay=0.1):
    """As the HF Trainer builds them: no weight decay for biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or ".norm" in name or "norm." in name
         or isinstance(p, torch.nn.Parameter) and p.dim() == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# -- loops: each (model, opt, inner, scaler, i, data) one optimizer step --------------------

def data_for(i):
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 32, generator=gen), torch.randint(64, (8, 6), generator=gen)


def loop_pcgrad(model, opt, i):
    # Two task losses, two backwards through one graph (retain_graph), the gradients
    # projected (PCGrad) and set by hand: p.grad = ...
    x, _ = data_for(i)
    out = model(x)
    opt.zero_grad()
    out[:, :2].pow(2).mean().backward(retain_graph=True)
    params = [p for p in model.parameters() if p.grad is not None]   # heads[1] is unused
    first = [p.grad.clone() for p in params]
    opt.zero_grad()
    (out[:, 2:] - 1).pow(2).mean().backward()
    second = [p.grad.clone() for p in params]
    for p, a, b in zip(params, first, second):
        dot = (a * b).sum()
        if dot < 0:
            a = a - dot / (b * b).sum().clamp_min(1e-12) * b
        p.grad = a + b


def loop_model_zero_grad(model, opt, i):
    x, _ = data_for(i)
    model.zero_grad()
    model(x).pow(2).mean().backward()


def loop_unused_branch(model, opt, i):
    # One head per step: the other gets no gradient (p.grad is None) on that step.
    x, _ = data_for(i)
    opt.zero_grad()
    model(x, head=i % 2).pow(2).mean().backward()


def loop_first_steps_without_gradient(model, opt, i):
    # A warm-up in which the optimizer's parameters get no gradient at all (a frozen
    # backbone), opt.step() called anyway as the loop always does.
    x, _ = data_for(i)
    opt.zero_grad()
    if i >= 2:
        model(x).pow(2).mean().backward()


def loop_tied(model, opt, i):
    _, tokens = data_for(i)
    opt.zero_grad()
    logits = model(tokens)
    F.cross_entropy(logits.reshape(-1, 64), tokens.roll(1, 1).reshape(-1)).backward()


def loop_hand_lr(model, opt, i):
    x, _ = data_for(i)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.param_groups[0]["lr"] = [1e-2, 0.0, 3e-2, 1e-3, 0.0, 5e-2][i]
    opt.param_groups[-1]["weight_decay"] = [0.0, 0.0, 0.2, 0.2, 0.0, 0.1][i]


# -- the harness ---------------------------------------------------------------------------

def build(kind):
    if kind == "tied-reentrant":
        model = TiedLM(reentrant=True)
    elif kind == "tied":
        model = TiedLM(reentrant=False)
    else:
        model = TwoHeads()
    return model


def run(kind, loop, variant, swap_dir, schedule=None, scaler=False, fail_at=None,
        no_decay_groups=True, steps=STEPS):
    """One run of ``loop``; ``variant``: "swap", "wrapper" (no swap_dir) or "plain" (torch's
    AdamW alone). Returns (model, state dict of the optimizer, failures seen)."""
    torch.manual_seed(0)
    model = build(kind)
    groups = hf_groups(model) if no_decay_groups else model.parameters()
    inner = HookedAdamW(groups, lr=1e-2, weight_decay=0.1)
    inner.after = {}
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    if variant == "plain":
        opt = inner
    else:
        opt = DistributedOptimizer(inner, grad_scaler=grad_scaler,
                                   swap_dir=swap_dir if variant == "swap" else None,
                                   swap_buffer_mb=(0.05 if kind.startswith("tied") else BUFFER_MB)
                                   if variant == "swap" else None)
    sched = schedule(opt) if schedule is not None else None
    state = State(model=model, optimizer=opt) if variant == "swap" else None
    problems = []
    for i in range(steps):
        if grad_scaler is None:
            loop(model, opt, i)
        else:
            # clip_grad_norm_ after scaler.unscale_, the documented AMP recipe.
            x, _ = data_for(i)
            opt.zero_grad()
            grad_scaler.scale(model(x).pow(2).mean()).backward()
            grad_scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if variant == "swap" and fail_at == i:
            state.commit()
            before = [p.detach().clone() for p in model.parameters()]
            inner.calls = 0
            inner.after = {3: _raise}
            try:
                opt.step()
                problems.append(f"step {i}: the injected failure did not fail the step")
            except RuntimeError as e:
                if "injected" not in str(e):
                    problems.append(f"step {i}: unexpected error {e!r}")
            inner.after = {}
            try:
                opt.step()
                problems.append(f"step {i}: a step after the failed one was taken")
            except OSError as e:
                if "restore a commit" not in str(e):
                    problems.append(f"step {i}: unexpected error {e!r}")
            state.restore()
            moved = [n for (n, p), q in zip(model.named_parameters(), before)
                     if not torch.equal(p, q)]
            if moved:
                problems.append(f"step {i}: a restore left {moved} changed")
        if grad_scaler is None:
            opt.step()
        else:
            grad_scaler.step(opt)
            grad_scaler.update()
        if sched is not None:
            sched.step()
    state = opt.state_dict()
    return model, state, problems


def differences(a, b):
    (model_a, state_a, _), (model_b, state_b, _) = a, b
    out = [f"parameter {name}" for (name, p), q in
           zip(model_a.named_parameters(), model_b.parameters()) if not torch.equal(p, q)]
    sa, sb = state_a["state"], state_b["state"]
    if sorted(sa) != sorted(sb):
        out.append(f"state indices {sorted(sa)} vs {sorted(sb)}")
    for k in sorted(set(sa) & set(sb)):
        for key in sorted(set(sa[k]) | set(sb[k])):
            if key not in sa[k] or key not in sb[k] or not torch.equal(
                    torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key])):
                out.append(f"state {k}.{key}")
    for ga, gb in zip(state_a["param_groups"], state_b["param_groups"]):
        for key in ("lr", "weight_decay", "betas"):
            if ga.get(key) != gb.get(key):
                out.append(f"group {key}: {ga.get(key)} vs {gb.get(key)}")
    return out


def check(tmp_path, kind, loop, **options):
    swapped = run(kind, loop, "swap", str(tmp_path), **options)
    plain = run(kind, loop, "plain", None, **options)
    found = swapped[2] + differences(swapped, plain)
    if found:
        wrapper = run(kind, loop, "wrapper", None, **options)
        found.append(f"(DistributedOptimizer without swap_dir vs plain: "
                     f"{differences(wrapper, plain) or 'the same'})")
    assert not found, "; ".join(found)


@pytest.mark.parametrize("kind,loop", [
    ("two-heads", loop_pcgrad),
    ("two-heads", loop_model_zero_grad),
    ("two-heads", loop_unused_branch),
    ("two-heads", loop_first_steps_without_gradient),
    ("tied", loop_tied),
    ("tied-reentrant", loop_tied),
    ("two-heads", loop_hand_lr),
], ids=["pcgrad-retain-graph", "model-zero-grad", "unused-branch", "no-gradient-warmup",
        "tied-checkpoint", "tied-checkpoint-reentrant", "lr-and-decay-set-by-hand"])
def test_everyday_loop_is_bitwise_plain_adamw_and_a_failed_step_is_restored(kind, loop,
                                                                            tmp_path):
    check(tmp_path, kind, loop, fail_at=FAIL_AT)


def one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS)


def cosine_to_zero(opt):
    # lr reaches exactly 0 at step 2 and rises again (T_max 2, eta_min 0).
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2, eta_min=0.0)


def linear_warmup_from_zero(opt):
    # HF's get_linear_schedule_with_warmup: the first step at lr 0.
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))


@pytest.mark.parametrize("schedule", [one_cycle, cosine_to_zero, linear_warmup_from_zero],
                         ids=["one-cycle-betas", "cosine-to-zero", "warmup-from-zero"])
def test_schedulers_with_hf_param_groups_are_bitwise_plain_adamw(schedule, tmp_path):
    check(tmp_path, "two-heads", loop_model_zero_grad, schedule=schedule, fail_at=FAIL_AT)


def test_clip_grad_norm_after_scaler_unscale_is_bitwise_plain_adamw(tmp_path):
    check(tmp_path, "two-heads", None, scaler=True)


def test_step_with_a_closure_is_refused_before_anything_counts(tmp_path):
    # Lightning and Accelerate's wrappers call optimizer.step(closure) always. Refused
    # (documented); the refusal must leave the optimizer as it was: the step then taken
    # without the closure is the reference's, and the progress counts one step.
    torch.manual_seed(0)
    model = TwoHeads()
    opt = DistributedOptimizer(HookedAdamW(model.parameters(), lr=1e-2), swap_dir=str(tmp_path),
                               swap_buffer_mb=BUFFER_MB)
    x, _ = data_for(0)
    opt.zero_grad()

    def closure():
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss
    closure()
    before = [p.detach().clone() for p in model.parameters()]
    progress = opt.gns.progress
    with pytest.raises(ValueError, match="closure"):
        opt.step(closure)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.step()
    torch.manual_seed(0)
    reference = TwoHeads()
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference(x).pow(2).mean().backward()
    plain.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    # Without a loader's controller the progress is counted before the inner step, so a
    # refused or failed step (SwapError on a full disk: "not taken") counts as one taken;
    # with a controller it is counted only after a step that returned.
    assert opt.gns.progress == progress + 1, \
        f"one step taken, progress {progress} -> {opt.gns.progress}"


class _Halve(torch.nn.Module):
    def forward(self, x):
        return x * 0.5

    def right_inverse(self, x):
        return x * 2


def between(event, pairs, states, folder):
    """Something an everyday loop does between the first backward and step(), done to both
    the swapped model and the in-memory reference."""
    import os
    for (model, opt), state in zip(pairs, states):
        if event == "state_dict":
            opt.state_dict()
        elif event == "load_state_dict":
            opt.load_state_dict(opt.state_dict())
        elif event == "commit":
            state.commit()
        elif event == "restore":
            state.restore()
        elif event == "checkpoint":
            path = os.path.join(folder, f"checkpoint-{id(opt)}.pt")
            state.save_checkpoint(path, background=True)
            state.wait_for_checkpoint()
        elif event == "load_checkpoint":
            path = os.path.join(folder, f"loaded-{id(opt)}.pt")
            state.save_checkpoint(path)
            state.load_checkpoint(path)
        elif event == "model_load_state_dict":
            model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        elif event == "parametrize":
            torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Halve())
        elif event == "skipped_step_and_more_backwards":
            # GradScaler found an inf: no step; the next micro-steps' backwards.
            opt.zero_grad(set_to_none=False)
            model(torch.randn(8, 32, generator=torch.Generator().manual_seed(3))).sum().backward()
        elif event == "sync_from_root":
            opt.sync_from_root()
        elif event == "add_param_group":
            extra = torch.nn.Parameter(torch.ones(4))
            model.register_parameter("extra", extra)
            opt.add_param_group({"params": [extra]})
            extra.grad = torch.full_like(extra, 0.5)


@pytest.mark.parametrize("event", ["state_dict", "load_state_dict", "commit", "restore",
                                   "checkpoint", "load_checkpoint", "model_load_state_dict",
                                   "parametrize",
                                   "skipped_step_and_more_backwards", "sync_from_root",
                                   "add_param_group"])
def test_what_a_loop_does_between_backward_and_step_keeps_training_bitwise(event, tmp_path):
    from support.swap_pairs import assert_same, deep, pair, step_both
    pairs = pair(deep, str(tmp_path / "swap"), buffer_mb=24 / 1024)
    (tmp_path / "checkpoints").mkdir()
    states = [State(model=model, optimizer=opt, snapshot_budget=None) for model, opt in pairs]
    step_both(pairs, 2)
    for state in states:
        state.commit()
    step_both(pairs, 2)         # a spare again after the commit
    for m, o in pairs:
        o.zero_grad()
        m(torch.randn(8, 32, generator=torch.Generator().manual_seed(5))).pow(2).mean().backward()
    between(event, pairs, states, str(tmp_path / "checkpoints"))
    for m, o in pairs:
        o.step()
    step_both(pairs, 2)
    assert_same(pairs)
