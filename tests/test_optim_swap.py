"""Optimizer state on disk (hvd_adapt/optim/swap.py) in one process: bitwise the same training
as with the state in memory, commits, restores and checkpoints without loading it all, and
clear errors about where it goes."""
import os
import stat

import pytest
import torch
from torch.utils.data import TensorDataset

import hvd_adapt
from hvd_adapt import AdaptiveDataLoader, DistributedOptimizer, State


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def make(kind, swap_dir=None, buffer_mb=None, amp=False, accumulate=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 4))
    if kind == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if amp else None
    opt = DistributedOptimizer(inner, grad_scaler=scaler, measure_noise=True, swap_dir=swap_dir,
                               swap_buffer_mb=buffer_mb)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 16, generator=gen), torch.randint(4, (256,), generator=gen))
    loader = AdaptiveDataLoader(data, batch_size=32, shuffle=True)
    if accumulate:
        loader.autoscale_batch_size(32, local_bsz_bounds=(8, 8), gradient_accumulation=True,
                                    decide_every=10 ** 6)
    state = State(model=model, optimizer=opt, loader=loader)
    return model, opt, loader, state, scaler


def train(model, opt, loader, scaler, steps):
    done = 0
    for x, y in loader:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if loader.is_optim_step():
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
        else:
            loss.backward()
            opt.step()
        if loader.is_optim_step():
            done += 1
            if done == steps:
                return


def state_tensors(opt):
    state = opt.state_dict()["state"]
    return [(i, key, value.clone()) for i in sorted(state) for key, value in sorted(state[i].items())
            if torch.is_tensor(value)]


@pytest.mark.parametrize("kind,amp,accumulate", [
    ("adamw", False, False), ("adamw", True, True), ("sgd", False, True)],
    ids=["adamw", "adamw-bf16-scaler-accumulation", "sgd-momentum-accumulation"])
def test_training_is_bitwise_the_same_as_with_the_state_in_memory(kind, amp, accumulate, tmp_path):
    # Buffers of 51 KiB: chunks of one to a few tensors, every step a pipeline.
    swapped = make(kind, str(tmp_path), buffer_mb=0.05, amp=amp, accumulate=accumulate)
    plain = make(kind, amp=amp, accumulate=accumulate)
    train(*swapped[:3], swapped[4], 6)
    train(*plain[:3], plain[4], 6)
    for p, q in zip(swapped[0].parameters(), plain[0].parameters()):
        assert torch.equal(p, q)
    assert [(i, k) for i, k, _ in state_tensors(swapped[1])] == \
        [(i, k) for i, k, _ in state_tensors(plain[1])]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b)
               in zip(state_tensors(swapped[1]), state_tensors(plain[1])))
    assert swapped[1].gns.num_updates == plain[1].gns.num_updates > 0
    assert swapped[1].gns.sqr.tolist() == plain[1].gns.sqr.tolist()
    assert not swapped[1].optimizer.state, "between steps no state is in memory"
    metrics = swapped[1].swap_metrics()
    assert metrics["swap_steps"] == 6 and metrics["swap_written_bytes"] > 0


def test_commit_restore_and_checkpoint_with_the_state_on_disk(tmp_path):
    model, opt, loader, state, _ = make("adamw", str(tmp_path / "swap"), buffer_mb=0.05)
    train(model, opt, loader, None, 2)
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    committed_state = state_tensors(opt)
    train(model, opt, loader, None, 2)
    assert not torch.equal(committed_state[0][2], state_tensors(opt)[0][2])
    state.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), committed))
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b)
               in zip(state_tensors(opt), committed_state))
    # The checkpoint holds the commit; it loads with weights_only, into an optimizer
    # with its state in memory too.
    path = str(tmp_path / "job.pt")
    state.save_checkpoint(path, background=True)
    state.wait_for_checkpoint()
    fresh_model, fresh_opt, _, fresh_state, _ = make("adamw")
    assert fresh_state.load_checkpoint(path)
    assert all(torch.equal(p, q) for p, q in zip(fresh_model.parameters(), committed))
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b)
               in zip(state_tensors(fresh_opt), committed_state))


def test_files_are_private_and_removed_when_done(tmp_path):
    model, opt, loader, state, _ = make("adamw", str(tmp_path), buffer_mb=0.05)
    train(model, opt, loader, None, 2)
    import socket
    root = tmp_path / f"hvd_adapt-swap-{socket.gethostname()}-{os.getpid()}"
    files = [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names]
    assert files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    # Live and committed generations only: older ones are gone.
    assert len(os.listdir(root)) <= 2
    opt._swap.close()
    assert not root.exists()


def test_where_the_state_cannot_go_is_named(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where a folder should be")
    with pytest.raises((ValueError, OSError), match="file"):
        make("adamw", str(blocked))
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9, 1000))
    with pytest.raises(ValueError, match=r"has 0.00 GB free; the optimizer state needs"):
        make("adamw", str(tmp_path / "swap"))


def test_a_buffer_too_small_for_one_parameter_says_how_large_it_must_be(tmp_path):
    with pytest.raises(ValueError, match="pass swap_buffer_mb >="):
        make("adamw", str(tmp_path), buffer_mb=0.001)
