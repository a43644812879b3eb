"""Optimizer state on disk (hvd_adapt/swap/) in one process: bitwise the same training
as with the state in memory, commits, restores and checkpoints without loading it all, and
clear errors about where it goes."""
import os
import re
import stat
import tempfile

import pytest
import torch
from torch.utils.data import TensorDataset

import hvd_adapt
from hvd_adapt import AdaptiveDataLoader, DistributedOptimizer, State
from support.second_user import as_other_user
from support.swap_pairs import (assert_same, by_age, deep, fill, pair, state_tensors,
                                step_both, swap_folders)


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
    [name] = swap_folders(tmp_path)
    root = tmp_path / name
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    files = [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names]
    assert files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    # The live file and the spare only: older ones are gone.
    assert len(files) <= 2
    opt._state.release()
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


@pytest.mark.parametrize("size", [8, 4096 + 8])      # elements: less than, more than a piece
def test_a_buffer_too_small_for_one_parameter_says_how_large_it_must_be(tmp_path, size):
    def build(buffer_mb):
        return DistributedOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(size))]),
                                    swap_dir=str(tmp_path), swap_buffer_mb=buffer_mb)
    with pytest.raises(ValueError, match="pass swap_buffer_mb >=") as refused:
        build(0.001)
    # What it says is enough, and not more than the parameter whole takes (a small one's
    # smallest piece, each tensor block-aligned, is larger than all of it).
    said = float(re.search(r"takes ([0-9.]+) MiB.*>= ([0-9.]+)", str(refused.value))[2])
    whole = float(re.search(r"takes ([0-9.]+) MiB", str(refused.value))[1])
    assert said <= whole, str(refused.value)
    build(said)             # constructs: every parameter fits a buffer


# -- issue 33: the state on disk never corrupts ------------------------------------------

def mlp():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def add_layer(pairs):
    """A Linear(4, 4) appended to each model, its parameters a new group of its optimizer."""
    for model, opt in pairs:
        extra = torch.nn.Linear(4, 4)
        torch.nn.init.constant_(extra.weight, 0.5)
        torch.nn.init.zeros_(extra.bias)
        model.append(extra)
        opt.add_param_group({"params": list(extra.parameters()), "lr": 0.1})


def test_a_param_group_added_later_is_stepped_and_kept(tmp_path):
    pairs = pair(mlp, str(tmp_path))
    step_both(pairs, 2)
    add_layer(pairs)
    before = pairs[0][0][3].weight.detach().clone()
    step_both(pairs, 3)
    assert not torch.equal(before, pairs[0][0][3].weight), "the added layer moved"
    assert_same(pairs)


def test_a_restore_reads_the_commit_with_the_layout_it_was_written_with(tmp_path):
    runs = []
    for where in (str(tmp_path / "swap"), None):
        torch.manual_seed(0)
        model, inner = mlp()
        model[2].weight.requires_grad_(False)       # frozen: no state until unfrozen
        opt = DistributedOptimizer(inner, swap_dir=where, swap_buffer_mb=0.05 if where else None)
        state = State(model=model, optimizer=opt)
        pairs = [(model, opt)]
        step_both(pairs, 2)
        state.commit()
        model[2].weight.requires_grad_(True)        # unfrozen: the layout grows
        step_both(pairs, 2)
        state.restore()
        path = str(tmp_path / f"ckpt-{where is None}.pt")
        state.save_checkpoint(path)
        step_both(pairs, 1)
        runs.append((model, opt, path))
    assert_same([runs[0][:2], runs[1][:2]])
    steps = {float(v["step"]) for v in runs[0][1].state_dict()["state"].values()}
    assert steps == {3.0, 1.0}, "restored at step 2, then one more; the unfrozen weight once"
    # The commit's checkpoint (written after the layout grew) loads as the in-memory one.
    loaded = []
    for _, _, path in runs:
        torch.manual_seed(0)
        model, inner = mlp()
        opt = DistributedOptimizer(inner)
        assert State(model=model, optimizer=opt).load_checkpoint(path)
        loaded.append((model, opt))
    assert_same(loaded)


@pytest.mark.parametrize("options", [
    {"foreach": False}, {"foreach": True}, {"fused": True}, {"amsgrad": True}, "sgd"],
    ids=["adamw-for-loop", "adamw-foreach", "adamw-fused", "adamw-amsgrad", "sgd-momentum"])
def test_large_parameters_step_in_pieces_bitwise_as_whole(options, tmp_path):
    def build():
        model = torch.nn.Sequential(torch.nn.Linear(16, 3000), torch.nn.Tanh(),
                                    torch.nn.Linear(3000, 4))
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if options == "sgd" \
            else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **options)
        return model, inner

    # 48,000-element weights, buffers of 80 KiB: every weight's state is split in pieces.
    pairs = pair(build, str(tmp_path), buffer_mb=0.078125)
    largest = max(p.numel() * 4 for p in pairs[0][0].parameters())
    state_bytes = largest * (1 if options == "sgd" else 3 if options == {"amsgrad": True} else 2)
    assert pairs[0][1]._state.buffer_bytes < state_bytes / 2, "the pool does not grow with it"
    step_both(pairs, 3)
    assert_same(pairs)
    assert not pairs[0][1].optimizer.state


def test_optimizers_that_are_not_elementwise_are_kept_whole_or_refused(tmp_path):
    def build():
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 4))
        return model, torch.optim.Adafactor(model.parameters(), lr=1e-2)

    # Adafactor factors a matrix's second moment (rows and columns): kept whole, exact.
    pairs = pair(build, str(tmp_path), buffer_mb=0.05)
    step_both(pairs, 3)
    assert_same(pairs)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 30000)       # a bias of 120 kB, its second moment as large
    with pytest.raises(ValueError, match=r"does not update it elementwise.*swap_buffer_mb >="):
        DistributedOptimizer(torch.optim.Adafactor(model.parameters()), swap_dir=str(tmp_path),
                             swap_buffer_mb=0.0625)
    with pytest.raises(ValueError, match="cannot step a probe with LBFGS"):
        DistributedOptimizer(torch.optim.LBFGS(model.parameters()), swap_dir=str(tmp_path))


def test_two_optimizers_share_a_swap_dir_and_a_deleted_one_is_freed(tmp_path):
    import gc
    import weakref
    # A GAN: two swapped optimizers in one process, one swap_dir.
    first, second = pair(mlp, str(tmp_path)), pair(mlp, str(tmp_path))
    step_both(first, 2)
    step_both(second, 2)
    step_both(first, 1)
    assert_same(first)
    assert_same(second)
    assert len(swap_folders(tmp_path)) == 2
    inner = weakref.ref(second[0][1].optimizer)
    del second
    gc.collect()
    assert inner() is None, "a deleted optimizer (its inner optimizer, weights, pool) is freed"
    assert len(swap_folders(tmp_path)) == 1
    step_both(first, 1)
    assert_same(first)


_HOLDER = """
import os, sys, time, torch, hvd_adapt
hvd_adapt.init()
model = torch.nn.Linear(4, 4)
opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters()), swap_dir=sys.argv[1])
model(torch.ones(2, 4)).sum().backward(); opt.step()
print("ready", flush=True)
if sys.argv[2] == "crash":
    os._exit(9)     # no clean-up runs: as a SIGKILL (which PID 1 of a namespace ignores)
time.sleep(600)
"""


def test_folders_belong_to_their_owner_while_it_lives(tmp_path):
    import subprocess
    import sys
    swap_dir = str(tmp_path)

    # Each job in a PID namespace of its own, as in a container: both see the same PIDs.
    namespace = ["unshare", "--pid", "--fork", "--kill-child"]
    if subprocess.run(namespace + ["true"], capture_output=True).returncode != 0:
        namespace = []      # no namespaces here: the jobs differ in PID, the rest holds

    def start(how):
        proc = subprocess.Popen(namespace + [sys.executable, "-c", _HOLDER, swap_dir, how],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    live = start("live")
    try:
        [alive] = swap_folders(swap_dir)
        start("crash").wait()
        [crashed] = [name for name in swap_folders(swap_dir) if name != alive]
        # Another job (same host name, or a container with the same PIDs) starts here: the
        # crashed job's folder goes, the live job's stays, and both keep working.
        pairs = pair(mlp, swap_dir)
        step_both(pairs, 2)
        assert crashed not in swap_folders(swap_dir) and alive in swap_folders(swap_dir)
        assert live.poll() is None
        assert_same(pairs)
    finally:
        live.kill()
        live.wait()


def test_a_shared_swap_dir_keeps_other_users_folders_apart(shared_tmp):
    victim = tempfile.mkdtemp()                  # a folder of ours, outside swap_dir
    open(os.path.join(victim, "keep"), "w").close()

    def plant():
        os.mkdir(os.path.join(shared_tmp, "hvd_adapt-swap-planted"), 0o700)
        # A link that looks like a stale folder of ours: following it would empty victim.
        os.symlink(victim, os.path.join(shared_tmp, "hvd_adapt-swap-link"))
    as_other_user(plant)
    pairs = pair(mlp, shared_tmp)
    step_both(pairs, 2)
    assert_same(pairs)
    assert "hvd_adapt-swap-planted" in swap_folders(shared_tmp), "another user's folder is kept"
    assert os.path.exists(os.path.join(victim, "keep")), "a planted link is never followed"
    [mine] = [n for n in swap_folders(shared_tmp)
              if n not in ("hvd_adapt-swap-planted", "hvd_adapt-swap-link")]
    st = os.lstat(os.path.join(shared_tmp, mine))
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_a_full_disk_fails_the_step_cleanly_and_training_goes_on(mount):
    swap_dir = mount("tmpfs", "2m")
    pairs = pair(mlp, str(swap_dir))
    step_both(pairs, 1)     # one file, no spare yet: the next step needs new space
    (model, opt), reference = pairs
    params = [p.detach().clone() for p in model.parameters()]
    state = state_tensors(opt)
    filler = fill(swap_dir)
    for _ in range(2):          # each failure leaves a usable optimizer (no buffer lost)
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        with pytest.raises(OSError, match=r"cannot reserve \d+ bytes for .*state\d+\.bin: No "
                                            r"space left on device \(errno ENOSPC\)"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(state_tensors(opt), state))
    os.remove(filler)
    step_both(pairs, 2)
    assert_same(pairs)


def test_a_step_that_writes_over_the_spare_needs_no_new_space(mount):
    # No state dict is handed out between steps, so each step writes over the file the
    # step before it dropped (the spare): a disk that fills between steps fails no step. A step
    # that must grow the file (a param group added) fails cleanly and leaves the spare.
    swap_dir = mount("tmpfs", "2m")
    pairs = pair(mlp, str(swap_dir))
    batches = torch.Generator().manual_seed(3)

    def step(steps, which=pairs):
        for _ in range(steps):
            x = torch.randn(8, 16, generator=batches)
            for model, opt in which:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()

    step(2)
    filler = fill(swap_dir)
    step(2)
    add_layer(pairs)
    [folder] = swap_folders(str(swap_dir))
    files = sorted(os.listdir(swap_dir / folder))
    with pytest.raises(OSError, match=r"cannot reserve \d+ bytes for .*state\d+\.bin: No space"):
        step(1, pairs[:1])
    assert sorted(os.listdir(swap_dir / folder)) == files and len(files) == 2, files
    os.remove(filler)
    step(2)
    assert_same(pairs)


def _raise():
    raise RuntimeError("the inner optimizer failed")


def assert_broken_until_restored(pairs, states, opt):
    """Every step, state dict and commit says how to come back until a restore; after it,
    training goes on bitwise as in memory from the commit."""
    for action in (opt.step, opt.state_dict, states[0].commit):
        with pytest.raises(OSError, match=r"failed after parameters moved.*restore a commit"):
            action()
    for state in states:
        state.restore()
    step_both(pairs, 2)
    assert_same(pairs)


@pytest.mark.parametrize("fault", ["optimizer-error", "read-eio"])
def test_a_step_that_fails_part_way_leaves_the_state_broken_until_a_restore(fault, tmp_path):
    # Buffers of 24 KiB: 8 chunks of two parameters. The optimizer fails at chunk 6 (or a
    # read of chunks 4-7 fails, a real short read): parameters moved, their state did not,
    # so the state is broken until a restore returns both to the commit.
    pairs = pair(deep, str(tmp_path), buffer_mb=24 / 1024)
    states = [State(model=model, optimizer=opt, snapshot_budget=None) for model, opt in pairs]
    step_both(pairs, 2)
    for state in states:
        state.commit()
    (model, opt), _ = pairs
    saved = {}

    def truncate_live():
        # The live file loses its bytes: the read of a later chunk ends early, chunk 7's at
        # the latest (its buffer is chunk 3's, written after this), chunk 4's at the
        # earliest (reads run as far ahead as the buffers allow).
        saved["path"] = by_age(tmp_path / swap_folders(str(tmp_path))[0])[-2]
        saved["bytes"] = saved["path"].read_bytes()
        os.truncate(saved["path"], 0)

    opt.optimizer.calls = 0
    opt.optimizer.after = {6: _raise} if fault == "optimizer-error" else {3: truncate_live}
    opt.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    with pytest.raises(OSError if fault == "read-eio" else RuntimeError,
                       match=r"the file ends there \(errno EIO\)" if fault == "read-eio"
                       else "the inner optimizer failed"):
        opt.step()
    assert opt.optimizer.calls == 7 if fault == "optimizer-error" else opt.optimizer.calls >= 4
    if saved:       # the disk comes back
        saved["path"].write_bytes(saved["bytes"])
    assert not opt.optimizer.state
    assert_broken_until_restored(pairs, states, opt)


def test_a_write_that_fails_part_way_leaves_the_state_broken_until_a_restore(mount):
    # The disk fills after the reservation (the new file loses its blocks as the step
    # begins; a filler takes them): chunk 0's write fails with ENOSPC while later chunks
    # step.
    swap_dir = mount("tmpfs", "2m")
    pairs = pair(deep, str(swap_dir), buffer_mb=24 / 1024)
    states = [State(model=model, optimizer=opt, snapshot_budget=None) for model, opt in pairs]
    step_both(pairs, 2)
    for state in states:
        state.commit()
    (model, opt), _ = pairs
    filler = []

    def disk_full():
        newest = by_age(swap_dir / swap_folders(str(swap_dir))[0])[-1]
        os.truncate(newest, 0)
        filler.append(fill(swap_dir))

    opt.optimizer.calls = 0
    opt.optimizer.after = {0: disk_full}
    opt.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    with pytest.raises(OSError, match=r"cannot write .* of .*state\d+\.bin: .*\(errno ENOSPC\)"):
        opt.step()
    os.remove(filler[0])
    assert_broken_until_restored(pairs, states, opt)


def test_a_parameter_grown_since_its_state_was_written_is_refused_before_anything_moves(
        tmp_path):
    # p.data = a larger tensor (a vocabulary grown between steps): its state, planned with
    # the new size, would be read from the regions after its own. In memory AdamW fails on
    # the shapes; on disk the step must refuse before anything moves, naming the parameter.
    torch.manual_seed(0)
    scale = torch.nn.Parameter(torch.ones(64))
    model = torch.nn.Linear(16, 4)
    opt = DistributedOptimizer(torch.optim.AdamW([scale] + list(model.parameters()), lr=0.1),
                               swap_dir=str(tmp_path))

    def backward():
        opt.zero_grad()
        (model(torch.randn(8, 16)).pow(2).mean() * scale.mean()).backward()
    for _ in range(2):
        backward()
        opt.step()
    state = state_tensors(opt)
    kept = scale.data
    scale.data = torch.ones(128)
    backward()
    params = [p.detach().clone() for p in [scale] + list(model.parameters())]
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(128,\).* has 128 elements, its "
                                         r"optimizer state 'exp_avg' 64: nothing was stepped"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip([scale] + list(model.parameters()), params))
    scale.data = kept       # the state as it was, readable with the size it was written for
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(state_tensors(opt), state))


def test_a_hyper_parameter_that_adds_state_mid_run_is_stepped_as_in_memory(tmp_path):
    def sgd():
        model, _ = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0)

    pairs = pair(sgd, str(tmp_path / "sgd"))
    step_both(pairs, 2)
    for _, opt in pairs:
        opt.param_groups[0]["momentum"] = 0.9     # a momentum warm-up: state appears
    step_both(pairs, 2)
    assert_same(pairs)
    assert "momentum_buffer" in pairs[0][1].state_dict()["state"][0]

    def two_groups():
        model, _ = mlp()
        model[2].requires_grad_(False)            # no state yet
        return model, torch.optim.AdamW([{"params": list(model[0].parameters())},
                                         {"params": list(model[2].parameters())}], lr=1e-2)

    pairs = pair(two_groups, str(tmp_path / "adamw"))
    step_both(pairs, 2)
    for model, opt in pairs:
        model[2].requires_grad_(True)
        opt.param_groups[1]["amsgrad"] = True       # a third state tensor, for new state
    step_both(pairs, 2)
    assert_same(pairs)
    # Turned on where state exists, torch's own step raises: so does the swapped one,
    # before anything moves, and both go on once it is off again.
    for model, opt in pairs:
        opt.param_groups[0]["amsgrad"] = True
        params = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(KeyError, match="max_exp_avg_sq"):
            step_both([(model, opt)])
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        opt.param_groups[0]["amsgrad"] = False
    step_both(pairs, 1)
    assert_same(pairs)


def test_a_file_system_that_refuses_o_direct_gets_plain_io(mount):
    from hvd_adapt.swap import DiskState
    swap_dir = mount("ramfs")
    models = []
    for where in (swap_dir, None):
        torch.manual_seed(0)
        model, inner = mlp()
        swapped = DiskState(inner, str(swap_dir), buffer_mb=0.05, o_direct=True) \
            if where else None
        for i in range(3):
            inner.zero_grad()
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))) \
                .pow(2).mean().backward()
            swapped.step() if swapped else inner.step()
        models.append((model, swapped.tensors() if swapped else inner.state))
    (a, sa), (b, sb) = models
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(sa[p][key], sb[q][key]) for key in sb[q])


class _Slow(torch.optim.AdamW):
    """AdamW whose every step also sleeps: compute the swap's reads should overlap."""

    def step(self, closure=None):
        import time
        time.sleep(0.2)
        return super().step(closure)


def test_io_timers_count_the_io_not_the_compute_it_overlaps(tmp_path):
    def build():
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 4))
        return model, _Slow(model.parameters(), lr=1e-2)

    # Buffers of 56 KiB: three chunks; each chunk's step sleeps 0.2 s while the next
    # chunk's state is read. A read timed to the end of its wait would count the sleep.
    pairs = pair(build, str(tmp_path), buffer_mb=56 / 1024)
    step_both(pairs, 3)
    assert_same(pairs)
    m = pairs[0][1].swap_metrics()
    assert m["swap_steps"] == 3 and m["swap_step_s"] >= 3 * 3 * 0.2
    # The reads' own time is far below the sleeps they overlapped (a margin of 0.9 s).
    assert m["swap_read_s"] < m["swap_step_s"] / 2
    assert m["swap_read_bytes"] > 0 and m["swap_written_bytes"] > 0


def test_a_forked_child_that_exits_leaves_its_parents_folder(tmp_path):
    pairs = pair(mlp, str(tmp_path))
    step_both(pairs, 1)
    pid = os.fork()
    if pid == 0:
        import atexit
        try:
            atexit._run_exitfuncs()     # what a child exiting normally runs (finalizers)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    step_both(pairs, 1)
    assert_same(pairs)


def convnet():
    # channels_last (an everyday CNN recipe): the conv weights are not contiguous.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(64, 64, 3)).to(memory_format=torch.channels_last)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def test_channels_last_weights_with_fused_adamw_step_as_in_memory(tmp_path):
    # The fused kernel pairs state and parameter by address: state read back contiguous for
    # a channels_last weight updated the wrong elements (weights 0.02 apart in 3 steps).
    pairs = pair(convnet, str(tmp_path), buffer_mb=None)
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(3)) \
        .to(memory_format=torch.channels_last)
    for _ in range(3):
        for model, opt in pairs:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert_same(pairs)


def test_a_buffer_too_small_names_the_parameter_and_why_it_is_whole(tmp_path):
    # Parameter 2, not 0: naming it used to compare tensors with == and raise RuntimeError.
    torch.manual_seed(0)
    _, inner = convnet()
    with pytest.raises(ValueError, match=r"parameter 2 \(shape \(64, 64, 3, 3\), group 0\).*"
                                         r"not contiguous in memory.*swap_buffer_mb >= 0\.29"):
        DistributedOptimizer(inner, swap_dir=str(tmp_path), swap_buffer_mb=0.0625)


def test_an_fp32_state_loads_into_bf16_parameters_as_in_memory(tmp_path):
    # Resuming an fp32 run in bf16: torch casts the state (not the step) to the parameter's
    # dtype; kept fp32 on disk, the next swapped step raised after moving some parameters.
    def build():
        model = torch.nn.Sequential(torch.nn.Linear(16, 3000), torch.nn.Tanh(),
                                    torch.nn.Linear(3000, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    torch.manual_seed(0)
    model, inner = build()
    model(torch.ones(8, 16)).pow(2).mean().backward()
    inner.step()
    # Buffers of 64 KiB: each bf16 moment (96 KB) is cast a region at a time.
    pairs = pair(build, str(tmp_path), buffer_mb=0.0625)
    for resumed, opt in pairs:
        resumed.load_state_dict(model.state_dict())
        resumed.to(torch.bfloat16)
        opt.load_state_dict(inner.state_dict())
    for _ in range(2):
        for resumed, opt in pairs:
            opt.zero_grad()
            resumed(torch.ones(8, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
    assert_same(pairs)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")   # torch's Adagrad
def test_sparse_gradients_are_stepped_whole_or_refused_before_anything_moves(tmp_path):
    # Embedding(sparse=True) with Adagrad: a sparse gradient cannot be sliced into pieces
    # (slicing one raised in the middle of a step, some parameters already moved).
    def build():
        model = torch.nn.Sequential(torch.nn.Embedding(5000, 16, sparse=True))
        return model, torch.optim.Adagrad(model.parameters(), lr=0.1)

    def step(model, opt, i):
        opt.zero_grad()
        model(torch.tensor([1, 5, 4999, i])).pow(2).mean().backward()
        opt.step()

    torch.manual_seed(0)
    model, inner = build()
    small = DistributedOptimizer(inner, swap_dir=str(tmp_path / "small"), swap_buffer_mb=0.0625)
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"its gradient is sparse, so it is stepped whole: "
                                         r"pass swap_buffer_mb >= 0\.32"):
        step(model, small, 0)
    assert torch.equal(before, model[0].weight)
    pairs = pair(build, str(tmp_path / "large"), buffer_mb=0.75)
    for i in range(2):
        for model, opt in pairs:
            step(model, opt, i)
    assert_same(pairs)


def test_sgd_without_momentum_has_the_state_dict_of_memory(tmp_path):
    # No state kept: torch's state_dict has none; the swapped one listed {} per parameter.
    def build():
        model, _ = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.01)

    pairs = pair(build, str(tmp_path))
    step_both(pairs, 2)
    assert_same(pairs)
    assert pairs[0][1].state_dict()["state"] == {}


def test_an_agreement_that_fails_leaves_no_file_and_moves_nothing(tmp_path):
    # The collective that compares the reservation fails (a peer lost, an elastic reset):
    # the new file goes at once, and parameters and state stay as they were.
    from hvd_adapt.swap import DiskState
    torch.manual_seed(0)
    model, inner = mlp()
    swapped = DiskState(inner, str(tmp_path), buffer_mb=0.05)

    def step(agree=None):
        inner.zero_grad()
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(0))) \
            .pow(2).mean().backward()
        swapped.step(agree=agree)

    step()
    [folder] = swap_folders(str(tmp_path))
    files = sorted(os.listdir(tmp_path / folder))
    params = [p.detach().clone() for p in model.parameters()]

    def lost(outcome, what):
        raise RuntimeError(f"a peer was lost at {what}")

    with pytest.raises(RuntimeError, match="a peer was lost at reserved"):
        step(lost)
    assert sorted(os.listdir(tmp_path / folder)) == files
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    step()
    swapped.release()


def test_the_spare_is_written_over_and_a_state_dict_handed_out_never_changes(tmp_path):
    # A step writes over the file the step before it dropped (the spare) instead of
    # removing it and allocating a new one. A state dict's tensors are mapped from their
    # file: that file is removed when dropped, never written over, so the values handed
    # out stay those of their step while training goes on.
    model, opt, loader, _, scaler = make("adamw", str(tmp_path), buffer_mb=0.05)
    train(model, opt, loader, scaler, 2)
    [folder] = swap_folders(str(tmp_path))
    folder = tmp_path / folder

    def files():
        return {name: os.stat(folder / name).st_ino for name in os.listdir(folder)}

    before = files()
    assert len(before) == 2, before
    train(model, opt, loader, scaler, 1)
    after = files()
    assert len(after) == 2 and set(after.values()) == set(before.values()), (before, after)
    handed = opt.state_dict()["state"]
    kept = {i: {key: value.clone() for key, value in s.items() if torch.is_tensor(value)}
            for i, s in handed.items()}
    train(model, opt, loader, scaler, 3)
    for i, values in kept.items():
        for key, value in values.items():
            assert torch.equal(handed[i][key], value), (i, key)
    assert len(files()) == 2


def test_a_load_state_dict_that_fails_on_a_full_disk_changes_nothing(mount):
    # A load_state_dict that raises (the disk is full) leaves the optimizer as it was: the
    # param groups (learning rate, betas) are taken from the state dict before its state is
    # written, and without the fix stayed when the write failed: the job went on with the
    # hyper-parameters of one point and the state of another (found by an attacker).
    swap_dir = mount("tmpfs", "2m")
    pairs = pair(mlp, str(swap_dir))
    step_both(pairs, 2)
    (model, opt), _ = pairs
    handed = opt.state_dict()           # handed out: its file is removed when dropped
    handed["param_groups"][0]["lr"] = 0.5
    step_both(pairs, 1)                 # no spare now: a load must allocate a new file
    groups = [dict(g, params=None) for g in opt.param_groups]
    params = [p.detach().clone() for p in model.parameters()]
    filler = fill(swap_dir)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            opt.load_state_dict(handed)
    finally:
        os.remove(filler)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert [dict(g, params=None) for g in opt.param_groups] == groups, \
        "a failed load_state_dict changed the param groups"
    step_both(pairs, 2)
    assert_same(pairs)
