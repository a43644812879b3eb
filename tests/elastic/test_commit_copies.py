"""A commit's copies made during the next forward: a failure at any point restores the
commit bit for bit (in the next forward, while the copy runs, after the copy failed, after
the step), a write in that window fails loudly, and what did not change is not copied."""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from horovod.common.exceptions import HorovodInternalError

import hvd_adapt
from hvd_adapt import DistributedOptimizer, State
from hvd_adapt.elastic import commit_copies
from hvd_adapt.elastic.commit_copies import CommitCopyError


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


class Ema(torch.nn.Module):
    """As timm's ModelEmaV3: a frozen copy whose parameters lerp towards the model's."""

    def __init__(self, model):
        super().__init__()
        self.module = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        torch._foreach_lerp_(list(self.module.parameters()), list(model.parameters()), 0.1)
        for mine, theirs in zip(self.module.buffers(), model.buffers()):
            mine.copy_(theirs)


def make_job(frozen=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.BatchNorm2d(64),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64 * 36, 4))
    model[0].to(memory_format=torch.channels_last)
    if frozen:
        model[0].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DistributedOptimizer(torch.optim.AdamW(params, lr=0.1),
                               named_parameters=model.named_parameters())
    ema = Ema(model)
    state = State(model=model, optimizer=opt, ema=ema, snapshot_budget=None)
    return state, model, opt, ema


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def step(model, opt, ema, seed):
    x, y = batch(seed)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ema.update(model)


def everything(model, opt, ema):
    """Every value a commit keeps, as independent copies (the reference)."""
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                          "ema": ema.state_dict()})


def bitwise_view(t):
    """The bits of ``t`` as integers of its size (NaN equal to itself, -0.0 not to 0.0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) \
        if t.is_floating_point() else t


def assert_bitwise(a, b, where=""):
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(bitwise_view(a), bitwise_view(b)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


class Fails(Exception):
    pass


def fail_in_forward(model):
    """Make the next forward raise half-way (after BatchNorm changed its statistics), as a
    peer's death does in Horovod's collectives; returns the hook's handle."""
    def hook(*_):
        raise HorovodInternalError("a peer died")
    return model[3].register_forward_pre_hook(hook)


def test_a_failure_in_the_next_forward_restores_the_commit_bitwise():
    state, model, opt, ema = make_job()
    for seed in range(3):
        step(model, opt, ema, seed)
        state.commit()
    committed = everything(model, opt, ema)
    handle = fail_in_forward(model)
    with pytest.raises(HorovodInternalError):
        step(model, opt, ema, 3)
    handle.remove()
    assert not torch.equal(model[1].running_mean, committed["model"]["1.running_mean"])
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


def test_a_failure_after_the_step_restores_the_commit_not_the_step():
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    committed = everything(model, opt, ema)
    step(model, opt, ema, 1)        # the step and the EMA's update, then a failure
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


@pytest.fixture
def held_copies(monkeypatch):
    """The copying thread stops before its first copy until ``release`` is set."""
    release, started = threading.Event(), threading.Event()
    real = commit_copies._copy_on_cpu

    def held(copy):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            release.wait()
        real(copy)

    monkeypatch.setattr(commit_copies, "_copy_on_cpu", held)
    return release, started


def test_a_restore_while_the_copy_runs_waits_for_it(held_copies):
    release, started = held_copies
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    committed = everything(model, opt, ema)
    assert started.wait(30)          # the copy is under way, held before its first tensor
    handle = fail_in_forward(model)
    with pytest.raises(HorovodInternalError):
        step(model, opt, ema, 1)
    handle.remove()
    threading.Timer(0.2, release.set).start()
    state.restore()                  # waits for the copy, then restores it
    assert_bitwise(everything(model, opt, ema), committed)


def test_a_copy_that_failed_on_its_thread_is_made_again_at_the_wait(monkeypatch):
    real, calls = commit_copies._copy_on_cpu, []

    def fails_once(copy):
        if threading.current_thread() is not threading.main_thread():
            calls.append(1)
            if len(calls) == 3:
                raise MemoryError("no room for the copy")
        real(copy)

    monkeypatch.setattr(commit_copies, "_copy_on_cpu", fails_once)
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    committed = everything(model, opt, ema)
    step(model, opt, ema, 1)         # its step waited for the copies (made again there)
    state.restore()
    assert len(calls) >= 3
    assert_bitwise(everything(model, opt, ema), committed)


def test_a_parameter_changed_before_the_step_fails_loudly_naming_it():
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    with torch.no_grad():
        model[4].weight.mul_(0.5)    # after the commit, before the next forward's end
    with pytest.raises(CommitCopyError, match=r"model\['4.weight'\] changed after "
                                              r"state.commit\(\).*state.wait_for_commit"):
        step(model, opt, ema, 1)


def test_an_ema_updated_before_the_forward_ended_fails_loudly():
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    ema.update(model)                # before the next forward: the copy may be reading it
    with pytest.raises(CommitCopyError, match=r"ema\['module.0.weight'\]"):
        model(batch(1)[0])


def test_a_write_through_data_before_the_copy_is_caught_by_the_fingerprint(held_copies):
    release, started = held_copies
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    assert started.wait(30)
    model[4].weight.data.mul_(0.5)   # .data: the version counter does not see it
    release.set()
    with pytest.raises(CommitCopyError, match=r"model\['4.weight'\]"):
        state.wait_for_commit()


def test_wait_for_commit_makes_a_change_by_hand_safe():
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    committed = everything(model, opt, ema)
    state.wait_for_commit()
    with torch.no_grad():
        model[4].weight.mul_(0.5)
    step(model, opt, ema, 1)
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


def test_loading_the_optimizer_waits_for_the_commit_as_torch_optimizers_do():
    """The State's load_state_dict pre-hook runs for hvd_adapt's optimizer too (it overrides
    load_state_dict): after a load, a change by hand is safe as after wait_for_commit()."""
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    committed = everything(model, opt, ema)
    seen = []
    opt.register_load_state_dict_post_hook(lambda o: seen.append(o))
    opt.load_state_dict(opt.state_dict())
    assert seen == [opt]
    with torch.no_grad():
        model[4].weight.mul_(0.5)
    step(model, opt, ema, 1)
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


def test_a_frozen_weight_changed_through_data_between_commits_is_restored_as_committed():
    # One element of a frozen conv weight changed through .data (its version counter does not
    # move), away from the elements a fingerprint samples: the next commit must still copy it
    # (a commit that skipped it as unchanged restored the value of the commit before).
    state, model, opt, ema = make_job(frozen=True)
    step(model, opt, ema, 0)
    state.commit()
    state.wait_for_commit()
    flat = model[0].weight.data.permute(0, 2, 3, 1).view(-1)     # channels_last: dense so
    sampled = set(range(0, flat.numel(), max(flat.numel() // commit_copies.FINGERPRINT_ELEMENTS,
                                             1)))
    element = next(i for i in range(flat.numel()) if i not in sampled)
    flat[element] += 1
    step(model, opt, ema, 1)
    state.commit()
    committed = everything(model, opt, ema)
    step(model, opt, ema, 2)
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


def test_tied_weights_are_copied_once_and_restore_tied():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, head)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    state = State(model=model, optimizer=opt, snapshot_budget=None)
    saved = state._handlers["model"].saved_state()
    assert saved["0.weight"] is saved["1.weight"]
    committed = copy.deepcopy(model.state_dict())
    F.cross_entropy(model(torch.tensor([1, 2])), torch.tensor([3, 4])).backward()
    opt.step()
    state.restore()
    assert torch.equal(model[0].weight, committed["0.weight"]) and head.weight is embed.weight


def test_a_step_a_grad_scaler_skips_then_an_ema_update_keeps_the_commit():
    # The step pre-hook never runs when the scaler skips the step; the EMA's update after
    # it is safe because the forward's end waited for the EMA's copies.
    state, model, opt, ema = make_job()
    scaler = torch.amp.GradScaler("cpu")
    state2 = State(scaler=scaler)
    step(model, opt, ema, 0)
    state.commit()
    state2.commit()
    committed = everything(model, opt, ema)
    x, y = batch(1)
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y) * float("inf")).backward()
    scaler.step(opt)                 # skipped: the gradients are not finite
    scaler.update()
    ema.update(model)
    assert opt.state_dict()["state"][0]["step"] == committed["opt"]["state"][0]["step"]
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


def test_a_parameter_holding_nan_is_not_taken_for_a_changed_one():
    # Fingerprints compare bits: NaN != NaN as values, so a float16 model that overflowed
    # raised CommitCopyError at every step.
    state, model, opt, ema = make_job()
    with torch.no_grad():
        model[4].weight.fill_(float("nan"))
    for seed in range(3):
        step(model, opt, ema, seed)
        state.commit()
    state.wait_for_commit()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("to_host", [True, False], ids=["pinned-host", "on-device"])
def test_on_cuda_the_copies_run_on_a_side_stream_and_a_failure_restores_the_commit(to_host):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.Linear(64, 4)).cuda()
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    ema = Ema(model)
    state = State(model=model, optimizer=opt, ema=ema, snapshot_to_host=to_host,
                  snapshot_budget=None)

    def cuda_step(seed):
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 64, generator=gen).cuda(), torch.randint(0, 4, (8,)).cuda()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ema.update(model)

    for seed in range(3):
        cuda_step(seed)
        state.commit()
    committed = everything(model, opt, ema)
    cuda_step(3)                     # the step waited for the copies on the device only
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)


def test_a_process_that_exits_while_its_copies_run_exits_cleanly(tmp_path):
    # A daemon thread still copying while the interpreter finalised aborted the process
    # ("terminate called without an active exception"): the exit waits for the copies.
    import subprocess
    import sys
    script = tmp_path / "exits.py"
    script.write_text(
        "import torch, hvd_adapt\n"
        "hvd_adapt.init()\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(48)])\n"
        "opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, "
        "momentum=0.9))\n"
        "s = hvd_adapt.State(model=m, optimizer=opt)\n"
        "for _ in range(2):\n"
        "    m(torch.randn(2, 1024)).sum().backward(); opt.step(); s.commit()\n")
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and "terminate" not in proc.stderr, proc.stderr[-2000:]


def test_the_next_commit_copies_through_the_same_views_unless_a_tensor_was_replaced(
        monkeypatch):
    # Making a copy's numpy views is most of what a small tensor's copy costs on the copying
    # thread, so a commit reuses the last one's; a tensor given new memory between commits
    # (assigned through .data, as pruning or a resized embedding does) gets new ones, and the
    # commit holds its new values.
    made = []
    real = commit_copies._numpy_views

    def counted(dst, src):
        made.append(src.data_ptr())
        return real(dst, src)

    monkeypatch.setattr(commit_copies, "_numpy_views", counted)
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    state.wait_for_commit()
    first = len(made)
    assert first > 0
    step(model, opt, ema, 1)
    state.commit()
    state.wait_for_commit()
    assert len(made) == first                 # every copy through the views already made
    with torch.no_grad():
        model[4].weight.data = torch.full_like(model[4].weight, 0.25)
    replaced = model[4].weight.data_ptr()
    state.commit()
    committed = everything(model, opt, ema)
    state.wait_for_commit()
    assert made[first:] == [replaced]         # the replaced tensor alone got new views
    step(model, opt, ema, 2)
    state.restore()
    assert torch.equal(model[4].weight, torch.full_like(model[4].weight, 0.25))
    assert_bitwise(everything(model, opt, ema), committed)


def test_state_given_new_memory_while_the_copy_waits_is_still_copied_as_committed(
        held_copies):
    # The copy holds an alias of each source as it was at the commit: an optimizer's
    # moment given new memory through .data before the thread reached it (found by an
    # attacker: copied from the new memory, and restored as such, where no fingerprint
    # looked) is still restored as committed.
    release, started = held_copies
    state, model, opt, ema = make_job()
    step(model, opt, ema, 0)
    state.commit()
    committed = everything(model, opt, ema)
    assert started.wait(30)
    for per_param in opt.state.values():
        per_param["exp_avg"].data = torch.full_like(per_param["exp_avg"], 9.0)
    release.set()
    state.wait_for_commit()
    state.restore()
    assert_bitwise(everything(model, opt, ema), committed)
