"""hvd_adapt.State in one process: commit/restore, epochs, checkpoints, the drain."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

import hvd_adapt
from hvd_adapt import Accumulator, AdaptiveDataLoader, CheckpointError, DistributedOptimizer, State
from support.full_disk import fill


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def make_job(samples=20, batch_size=4, accumulate=False):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(samples, 3), torch.randn(samples, 1))
    model = torch.nn.Linear(3, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = AdaptiveDataLoader(data, batch_size=batch_size, shuffle=True)
    if accumulate:
        loader.autoscale_batch_size(4 * batch_size, local_bsz_bounds=(1, batch_size // 2),
                                    gradient_accumulation=True)
    stats = Accumulator()
    state = State(model=model, optimizer=opt, loader=loader, stats=stats, best=0.0,
                  snapshot_budget=None)    # every commit a restore point
    return state, model, opt, loader, stats


def train_steps(state, model, opt, loader, stats, steps):
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats["n"] += len(x)
        state.commit()


def test_restore_returns_to_last_commit():
    state, model, opt, loader, stats = make_job()
    train_steps(state, model, opt, loader, stats, 2)
    weights = model.weight.detach().clone()
    position = loader.sampler.position
    with stats.synchronized():
        committed = dict(stats)
    state.best = 0.5
    train_steps_without_commit = iter(loader)
    x, y = next(train_steps_without_commit)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    stats["n"] += 100
    state.restore()
    assert torch.equal(model.weight, weights)
    assert loader.sampler.position == position
    assert state.best == 0.0
    with stats.synchronized():
        assert dict(stats) == committed == {"n": 8}


def test_commit_mid_accumulation_is_deferred():
    state, model, opt, loader, stats = make_job(accumulate=True)
    assert loader.accumulation_steps == 1
    it = iter(loader)
    x, y = next(it)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert not loader.is_optim_step()
    state.commit()
    state.restore()
    assert loader.sampler.position == 0, "a commit mid-cycle must not save"
    it = iter(loader)
    for _ in range(2):
        x, y = next(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert loader.is_optim_step()
    state.commit()
    state.restore()
    assert loader.sampler.position == 4


def test_epoch_loop_resumes_in_the_committed_epoch():
    state, model, opt, loader, stats = make_job()
    epochs = []
    for epoch in hvd_adapt.remaining_epochs_until(3):
        epochs.append((epoch, hvd_adapt.current_epoch()))
        for _ in loader:
            pass
        state.commit()
        if epoch == 1:
            break
    assert epochs == [(0, 0), (1, 1)]
    # As in AdaptDL: the epoch left with break counts as finished.
    assert [e for e in hvd_adapt.remaining_epochs_until(3)] == [2]
    assert state.epoch == 3 and hvd_adapt.current_epoch() is None


def test_epoch_loop_left_by_a_resize_goes_on_in_the_same_epoch():
    from horovod.common.exceptions import HostsUpdatedInterrupt
    state = make_job()[0]
    seen = []
    try:
        for epoch in hvd_adapt.remaining_epochs_until(4):
            seen.append(epoch)
            if epoch == 1:
                raise HostsUpdatedInterrupt(skip_sync=True)
    except HostsUpdatedInterrupt:
        state.on_reset()  # what hvd.elastic.run does before calling the function again
    seen += list(hvd_adapt.remaining_epochs_until(4))
    assert seen == [0, 1, 1, 2, 3]


def test_remaining_epochs_until_rejects_bad_values():
    make_job()
    with pytest.raises(ValueError, match="got -1"):
        next(hvd_adapt.remaining_epochs_until(-1))


def test_checkpoint_round_trip(tmp_path):
    path = str(tmp_path / "ckpt" / "job.pt")
    state, model, opt, loader, stats = make_job()
    train_steps(state, model, opt, loader, stats, 3)
    state.best = 0.75
    state.commit()
    state.save_checkpoint(path)
    # No temporary file is left behind; the lock file writers take turns on stays.
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".hvd_adapt-checkpoint.lock", "job.pt"]

    fresh, model2, opt2, loader2, stats2 = make_job()
    assert fresh.load_checkpoint(path)
    assert torch.equal(model2.weight, model.weight)
    assert loader2.sampler.position == loader.sampler.position == 12
    assert fresh.best == 0.75
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    with stats2.synchronized():
        assert dict(stats2) == {"n": 12}
    fresh.restore()
    assert loader2.sampler.position == 12, "a loaded checkpoint is the committed state"


def test_missing_checkpoint_is_a_fresh_start(tmp_path):
    state = make_job()[0]
    assert state.load_checkpoint(str(tmp_path / "none.pt")) is False


def test_corrupt_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "bad.pt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=str(path)):
        make_job()[0].load_checkpoint(str(path))


def test_truncated_checkpoint_names_the_file(tmp_path):
    path = str(tmp_path / "job.pt")
    state = make_job()[0]
    state.save_checkpoint(path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        make_job()[0].load_checkpoint(path)


def test_mismatched_checkpoint_names_what_differs(tmp_path):
    path = str(tmp_path / "job.pt")
    make_job()[0].save_checkpoint(path)
    other = State(model=torch.nn.Linear(3, 1), extra=1)
    with pytest.raises(CheckpointError, match=r"missing \['extra'\]"):
        other.load_checkpoint(path)
    wrong_shape, *_ = make_job()
    wrong_shape.model = torch.nn.Linear(5, 1)
    with pytest.raises(CheckpointError, match="cannot load 'model'"):
        wrong_shape.load_checkpoint(path)


DRAIN_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    import hvd_adapt
    from torch.utils.data import TensorDataset
    hvd_adapt.init()
    model = torch.nn.Linear(2, 1)
    loader = hvd_adapt.AdaptiveDataLoader(TensorDataset(torch.randn(40, 2)), batch_size=4)
    state = hvd_adapt.State(model=model, loader=loader, steps=0)
    hvd_adapt.install_sigterm_drain(state, checkpoint_path=sys.argv[1])
    state.load_checkpoint(sys.argv[1])
    print("start", state.steps, flush=True)

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(2):
            for (x,) in loader:
                state.steps += 1
                if state.steps == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                state.commit()
        print("finished", state.steps, flush=True)

    train(state)
""")


def test_sigterm_drains_checkpoints_and_resumes(tmp_path):
    script = tmp_path / "drain.py"
    script.write_text(DRAIN_SCRIPT)
    ckpt = str(tmp_path / "job.pt")
    first = subprocess.run([sys.executable, str(script), ckpt], capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 143, first.stderr
    assert "start 0" in first.stdout and "SIGTERM received" in first.stderr
    second = subprocess.run([sys.executable, str(script), ckpt], capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr
    # Stopped after committing step 3 of 20; the rerun trains the other 17.
    assert "start 3" in second.stdout and "finished 20" in second.stdout


def test_epochs_is_a_reserved_name():
    with pytest.raises(ValueError, match="reserves the name 'epochs'"):
        State(epochs=3)


def test_commits_reuse_snapshot_buffers_and_restore_copies_them():
    state, model, opt, loader, stats = make_job()
    train_steps(state, model, opt, loader, stats, 1)
    saved = state._handlers["model"]._saved["weight"]
    momentum = state._handlers["optimizer"]._saved["state"][0]["momentum_buffer"]
    pointers = (saved.data_ptr(), momentum.data_ptr())
    train_steps(state, model, opt, loader, stats, 1)
    state.wait_for_commit()          # its copies run during the next forward
    assert torch.equal(saved, model.weight) and saved.data_ptr() == pointers[0]
    assert torch.equal(momentum, opt.state[model.weight]["momentum_buffer"])
    assert momentum.data_ptr() == pointers[1]
    committed = saved.clone()
    state.restore()
    # Training after a restore must not write through to the snapshot.
    with torch.no_grad():
        model.weight.add_(1.0)
        opt.state[model.weight]["momentum_buffer"].add_(1.0)
    assert torch.equal(saved, committed)
    state.restore()
    assert torch.equal(model.weight, committed)


def test_flat_sequences_are_snapshotted_without_copying_each_item():
    from hvd_adapt.elastic.handlers import snapshot as _snapshot
    times = tuple(0.001 * i for i in range(64))
    flat = [1, 2.5, "x", None]
    snap = _snapshot({"times": times, "flat": flat, "nested": [flat, (torch.ones(2),)]})
    assert snap["times"] is times
    assert snap["flat"] == flat and snap["flat"] is not flat
    flat.append(3)
    assert snap["flat"] == [1, 2.5, "x", None] and snap["nested"][0] == [1, 2.5, "x", None]
    assert torch.equal(snap["nested"][1][0], torch.ones(2))


def test_plain_torch_optimizer_is_carried_too():
    model = torch.nn.Linear(3, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=sgd)
    model(torch.randn(4, 3)).sum().backward()
    sgd.step()
    state.commit()
    buffer = sgd.state[model.weight]["momentum_buffer"].clone()
    model(torch.randn(4, 3)).sum().backward()
    sgd.step()
    state.restore()
    assert torch.equal(sgd.state[model.weight]["momentum_buffer"], buffer)


def test_checkpoint_holds_the_last_commit_not_the_live_state(tmp_path):
    state, model, opt, loader, stats = make_job()
    train_steps(state, model, opt, loader, stats, 1)
    committed_position = loader.sampler.position
    committed_weight = model.weight.detach().clone()
    it = iter(loader)
    x, y = next(it)                      # trained on, never committed
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    state.best = 0.75
    assert loader.sampler.position > committed_position
    state.save_checkpoint(str(tmp_path / "c.pt"))
    fresh, fresh_model, _, fresh_loader, _ = make_job()
    assert fresh.load_checkpoint(str(tmp_path / "c.pt"))
    assert fresh_loader.sampler.position == committed_position
    assert torch.equal(fresh_model.weight, committed_weight) and fresh.best == 0.0


@pytest.mark.parametrize("name", ["commit", "sync", "generation", "_handlers"])
def test_names_that_would_hide_the_states_own_are_refused_with_the_name(name):
    # Horovod's ObjectState would set the value over the method: state.commit() then calls 0.
    with pytest.raises(ValueError, match=f"State value '{name}' would hide State.{name}"):
        State(**{name: 0})


class Counter:
    """A value with a handler of its own and no state_dict()."""

    def __init__(self, count):
        self.count = count


def test_values_of_registered_handlers_load_back_from_a_checkpoint(tmp_path):
    from horovod.torch.elastic.state import StateHandler

    class CounterHandler(StateHandler):
        def save(self):
            pass

        def restore(self):
            pass

        def sync(self):
            pass

    hvd_adapt.register_handler(Counter, CounterHandler)
    state = State(counter=Counter(7))
    state.commit()
    state.save_checkpoint(str(tmp_path / "c.pt"))
    fresh = State(counter=Counter(0))
    # A value of the user's own class is arbitrary pickled code: refused
    # unless the caller vouches for the file.
    with pytest.raises(CheckpointError, match="trusted=True"):
        fresh.load_checkpoint(str(tmp_path / "c.pt"))
    assert fresh.load_checkpoint(str(tmp_path / "c.pt"), trusted=True)
    assert fresh.counter.count == 7


class Planted:
    """Unpickling this runs code, as a planted checkpoint would."""

    def __reduce__(self):
        return (os.system, ("touch planted-ran",))


def test_a_planted_checkpoint_does_not_run_code_on_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "job.pt")
    make_job()[0].save_checkpoint(path)
    payload = torch.load(path, weights_only=False)
    payload["objects"]["evil"] = Planted()
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="trusted=True"):
        make_job()[0].load_checkpoint(path)
    assert not os.path.exists(tmp_path / "planted-ran")


def test_plain_values_are_snapshotted_so_in_place_changes_do_not_survive_a_restore():
    state = State(history=[1, 2], best={"acc": 0.5})
    state.commit()
    state.history.append(3)
    state.best["acc"] = 0.9
    state.restore()
    assert state.history == [1, 2] and state.best == {"acc": 0.5}
    state.history.append(4)          # a change after the restore is not the snapshot's
    state.restore()
    assert state.history == [1, 2]


def test_background_checkpoint_write_returns_before_the_file_is_on_disk(tmp_path, monkeypatch):
    import threading
    from hvd_adapt.elastic import checkpoint as checkpoint_file
    released = threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd):  # a slow shared file system
        released.wait(timeout=30)
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_file.os, "fsync", slow_fsync)
    path = str(tmp_path / "job.pt")
    state, model, opt, loader, stats = make_job()
    train_steps(state, model, opt, loader, stats, 2)
    state.commit()
    state.save_checkpoint(path, background=True)
    assert not os.path.exists(path)
    committed = model.weight.detach().clone()
    train_steps(state, model, opt, loader, stats, 2)   # training goes on meanwhile
    state.commit()                                      # and reuses the commit's buffers
    released.set()
    state.wait_for_checkpoint()
    fresh, model2 = make_job()[:2]
    assert fresh.load_checkpoint(path)
    assert torch.equal(model2.weight, committed), "the file holds the commit it was asked for"


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")
    state = make_job()[0]
    state.save_checkpoint(str(tmp_path / "file" / "job.pt"), background=True)
    with pytest.raises(CheckpointError, match="job.pt failed"):
        state.wait_for_checkpoint()
    state.wait_for_checkpoint()  # reported once


def test_break_mid_accumulation_closes_the_cycle_and_drops_its_micro_steps():
    import copy
    state, model, opt, loader, stats = make_job(samples=32, accumulate=True)
    assert loader.accumulation_steps == 1
    mse = torch.nn.functional.mse_loss
    for x, y in loader:
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        break                       # the first of a cycle's two micro-steps
    assert state.at_optim_boundary()
    generation = state.generation
    state.commit()
    assert state.generation == generation + 1, "commits work again at once"
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()), "the micro-step was dropped"
    # The next cycle is averaged over its own two micro-steps alone.
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(opt.optimizer.state_dict())
    losses = []
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        losses.append(mse(reference(x), y))
        if i == 1:
            break
    assert loader.is_optim_step()
    ref_opt.zero_grad()
    (sum(losses) / 2).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_return_mid_accumulation_commits_and_checkpoints_the_finished_epoch(tmp_path):
    path = str(tmp_path / "job.pt")
    state, model, opt, loader, stats = make_job(accumulate=True)

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(5, checkpoint=path):
            for i, (x, y) in enumerate(loader):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if epoch == 1 and i == 2:       # the first micro-step of a cycle
                    return epoch

    assert train(state) == 1
    assert state.epoch == 2 and state.at_optim_boundary()
    fresh = make_job(accumulate=True)[0]
    assert fresh.load_checkpoint(path)
    assert fresh.epoch == 2 and fresh.generation == state.generation


@pytest.mark.parametrize("where", ["optimizer", "state"])
def test_a_grad_scaler_is_committed_restored_and_checkpointed(where, tmp_path):
    def job():
        model = torch.nn.Linear(3, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                                   grad_scaler=scaler if where == "optimizer" else None)
        values = {"scaler": scaler} if where == "state" else {}
        state = State(model=model, optimizer=opt, **values)
        scaler.scale(torch.ones(()))            # the scale tensor exists from here
        return state, scaler

    state, scaler = job()
    scaler.update(256.0)                        # backed off after overflows
    state.commit()
    scaler.update(64.0)
    state.restore()
    assert scaler.get_scale() == 256.0
    path = str(tmp_path / "job.pt")
    state.save_checkpoint(path)
    fresh, fresh_scaler = job()
    assert fresh.load_checkpoint(path)          # weights_only: plain numbers
    assert fresh_scaler.get_scale() == 256.0


@pytest.mark.parametrize("room,cause", [(12288, r"RuntimeError: .*unexpected pos"),
                                        (0, r"OSError: .*No space left")])
def test_a_full_disk_raises_checkpoint_error_with_its_cause_and_loses_nothing(full_disk, room,
                                                                               cause):
    # torch.save on a disk that fills while it writes raises RuntimeError ("[enforce fail
    # at inline_container.cc] ... unexpected pos"; OSError where nothing fits at all),
    # which went through raw: only OSError became a CheckpointError.
    from hvd_adapt.elastic import checkpoint
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state = State(model=model, optimizer=opt)
    path = str(full_disk / "job.pt")

    def step():
        opt.zero_grad()
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        state.commit()

    for _ in range(2):
        step()
        state.save_checkpoint(path)
    kept = (checkpoint.generation_of(path), checkpoint.generation_of(path + ".previous"))
    assert kept == (state.generation, state.generation - 1)
    fill(full_disk, leave=room)
    step()
    with pytest.raises(CheckpointError, match=r"writing checkpoint .*job.pt failed: " + cause):
        state.save_checkpoint(path)
    state.save_checkpoint(path, background=True)
    # In the background the serialised bytes go out in one write: OSError.
    with pytest.raises(CheckpointError, match=r"job.pt failed: (RuntimeError|OSError)"):
        state.settle_checkpoint()
    # Nothing lost: both good generations, no temporary file.
    assert sorted(os.listdir(full_disk)) == sorted(
        [checkpoint.LOCK_NAME, "job.pt", "job.pt.previous", "filler"])
    assert (checkpoint.generation_of(path),
            checkpoint.generation_of(path + ".previous")) == kept
    assert checkpoint.read_newest(path, ["model", "optimizer", "epochs"])["generation"] \
        == kept[0]
