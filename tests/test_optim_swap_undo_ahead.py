"""The undo copies written ahead (hvd_adapt/optim/swap_undo.py) against what loops do between
a backward and the step: parameters replaced, edited through ``p.data``, grown; a spare cut
before the step; lifetimes (deleted, exiting, collected on the undo thread, forked
DataLoader workers); everyday events (state dicts, commits, restores, GradScaler skips,
GANs). A failed step must put back exactly the values from just before it, and training
must stay bitwise that of AdamW in memory."""
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import hvd_adapt
from hvd_adapt import DistributedOptimizer
from hooked_optimizer import HookedAdamW
from test_optim_swap import UNDO_BYTES, _raise, deep, fill, mount, written_ahead  # noqa: F401 (mount: a fixture)


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def pair(swap_dir, buffer_mb=36 / 1024):
    out = []
    for where in (swap_dir, None):
        torch.manual_seed(0)
        model, inner = deep()
        out.append((model, DistributedOptimizer(inner, swap_dir=where,
                                                 swap_buffer_mb=buffer_mb if where else None)))
    return out


def step_both(pairs, steps=1):
    for _ in range(steps):
        for model, opt in pairs:
            gen = torch.Generator().manual_seed(7)
            opt.zero_grad()
            model(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
            opt.step()


def backward_and_wait(model, opt):
    since = opt.swap_metrics()
    opt.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    written_ahead(opt, since, UNDO_BYTES)


def fail_step_at(opt, chunk):
    opt.optimizer.calls = 0
    opt.optimizer.after = {chunk: _raise}
    with pytest.raises(RuntimeError, match="the inner optimizer failed"):
        opt.step()
    opt.optimizer.after = {}


def test_a_parameter_replaced_twice_after_the_backward_is_put_back_as_it_was_before_the_step(
        tmp_path):
    # p.data replaced twice between the first backward and step() (an EMA/SWA swap written
    # as `p.data = p.data.clone()` ... `p.data = new values`): `p.data = x` keeps the
    # parameter's version counter, and a large tensor's memory (mmap'd by malloc) is handed
    # to the next tensor of its size at the address just freed. data_ptr and _version are
    # both as when the undo copy was written ahead, the values are not: the step trusts the
    # stale copy, and a failed step puts back values the parameter no longer had.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False))
    opt = DistributedOptimizer(HookedAdamW(model.parameters(), lr=1e-2), swap_dir=str(tmp_path))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4096)).pow(2).mean().backward()
        opt.step()
    weight = model[0].weight
    since = opt.swap_metrics()
    opt.zero_grad()
    model(torch.ones(2, 4096)).pow(2).mean().backward()
    written_ahead(opt, since, weight.numel() * 4)
    ptr, version = weight.data_ptr(), weight._version
    weight.data = weight.data.clone()
    weight.data = torch.full_like(weight.data, 0.25)
    same = (weight.data_ptr(), weight._version) == (ptr, version)
    fail_step_at(opt, 8)
    assert torch.equal(weight, torch.full_like(weight, 0.25)), \
        f"put back to its values before the replacement (same address and version: {same})"


def test_weight_clipping_through_p_data_after_the_backward_is_put_back_clipped(tmp_path):
    # Known (the module docstring): p.data.clamp_() does not move the version counter.
    # WGAN clips after opt.step() (safe: the copies are taken at the next backward); a
    # loop that clips between backward and step (clip, then step) loses the clip on a
    # failed step.
    pairs = pair(str(tmp_path))
    step_both(pairs, 2)
    (model, opt), _ = pairs
    backward_and_wait(model, opt)
    for p in model.parameters():
        p.data.clamp_(-0.01, 0.01)
    params = [p.detach().clone() for p in model.parameters()]
    fail_step_at(opt, 6)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params)), \
        "a failed step put back the values from before the clip"


def undo_threads():
    return [t for t in threading.enumerate() if t.name == "hvd_adapt-swap-undo" and t.is_alive()]


def test_an_optimizer_deleted_while_its_copies_are_written_leaves_nothing(tmp_path):
    # A model large enough that the thread is still writing when the optimizer goes.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                               swap_dir=str(tmp_path), swap_buffer_mb=4)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 512)).pow(2).mean().backward()
        if _ < 2:
            opt.step()
    del opt
    gc.collect()
    assert not undo_threads(), "the undo thread outlived its optimizer"
    assert not [f for f in os.listdir(tmp_path) if f.startswith("hvd_adapt-swap-")], \
        "the swap folder was left behind"


EXITING = textwrap.dedent("""
    import os, sys, torch, hvd_adapt
    from hvd_adapt import DistributedOptimizer
    hvd_adapt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                               swap_dir=sys.argv[1], swap_buffer_mb=4)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 512)).pow(2).mean().backward()
        if i < 2:
            opt.step()
    if sys.argv[2] == "exit":
        sys.exit(3)
    raise KeyboardInterrupt
""")


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_a_process_that_exits_while_its_copies_are_written_leaves_nothing(how, tmp_path):
    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path), how],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode in (3, 1, -2, 130), done.stderr
    assert "Traceback" not in done.stderr.replace("KeyboardInterrupt", "") or how == "interrupt", \
        done.stderr
    assert not os.listdir(tmp_path), os.listdir(tmp_path)


class _Halve(torch.nn.Module):
    def forward(self, x):
        return x * 0.5

    def right_inverse(self, x):
        return x * 2


def between(event, pairs, states, folder):
    """Something an everyday loop does between the first backward and step(), done to both
    the swapped model and the in-memory reference."""
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
    from hvd_adapt import State
    pairs = pair(str(tmp_path / "swap"))
    (tmp_path / "checkpoints").mkdir()
    states = [State(model=model, optimizer=opt) for model, opt in pairs]
    step_both(pairs, 2)
    for state in states:
        state.commit()
    step_both(pairs, 2)         # a spare again after the commit
    (model, opt), (reference, ref_opt) = pairs
    since = opt.swap_metrics()
    for m, o in pairs:
        o.zero_grad()
        m(torch.randn(8, 32, generator=torch.Generator().manual_seed(5))).pow(2).mean().backward()
    written_ahead(opt, since, UNDO_BYTES)
    between(event, pairs, states, str(tmp_path / "checkpoints"))
    params = [p.detach().clone() for p in model.parameters()]
    fail_step_at(opt, 6)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params)), \
        f"{event}: a failed step did not put the parameters back"
    for m, o in pairs:
        o.step()
    step_both(pairs, 2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q), event
    sa, sb = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for i in sa:
        for key in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)


def test_a_spare_cut_by_a_commit_on_a_full_disk_fails_cleanly_and_training_goes_on(mount):
    # Commits cut their generation's undo area; released, that generation is the spare,
    # short of its undo area. The copies written ahead must then grow it, on a full disk.
    from hvd_adapt import State
    tmpfs = mount("tmpfs", "2m")
    pairs = pair(str(tmpfs))
    states = [State(model=model, optimizer=opt) for model, opt in pairs]
    step_both(pairs, 2)
    for state in states:
        state.commit()
    step_both(pairs, 1)
    for state in states:
        state.commit()          # the first commit's generation (cut) is the spare now
    (model, opt), _ = pairs
    filler = fill(tmpfs)
    params = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        time.sleep(0.5)         # the thread runs into the full disk
        with pytest.raises(OSError):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    os.remove(filler)
    step_both(pairs, 3)
    (a, _), (b, _) = pairs
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # And a failed step after the disk was freed puts the copies written ahead back.
    since = opt.swap_metrics()
    backward_and_wait(model, opt)
    params = [p.detach().clone() for p in model.parameters()]
    fail_step_at(opt, 6)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert opt.swap_metrics()["swap_undo_ahead_used_bytes"] > since["swap_undo_ahead_used_bytes"]


def test_dataloader_workers_forked_while_copies_are_written(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    opt = DistributedOptimizer(HookedAdamW(model.parameters(), lr=1e-3),
                               swap_dir=str(tmp_path), swap_buffer_mb=4)
    data = torch.utils.data.TensorDataset(torch.randn(64, 512))
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 512)).pow(2).mean().backward()
        if i < 2:
            opt.step()
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2,
                                         multiprocessing_context="fork")
    assert sum(len(x) for x, in loader) == 64
    params = [p.detach().clone() for p in model.parameters()]
    fail_step_at(opt, 8)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    opt.step()
    [folder] = os.listdir(tmp_path)


GROWN = textwrap.dedent("""
    import sys, torch, hvd_adapt
    from hvd_adapt import DistributedOptimizer
    hvd_adapt.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    scale = torch.nn.Parameter(torch.ones(512))
    opt = DistributedOptimizer(torch.optim.AdamW(list(model.parameters()) + [scale], lr=1e-3),
                               swap_dir=sys.argv[1], swap_buffer_mb=4)

    def backward():
        opt.zero_grad()
        (model(torch.randn(4, 512)).pow(2).mean() * scale.mean()).backward()

    for i in range(2):
        backward()
        opt.step()
    scale.data = torch.ones(1 << 24)
    backward()
    try:
        opt.step()
    except Exception as e:
        print("step raised", type(e).__name__, e)
""")


def test_a_parameter_grown_between_steps_is_not_copied_past_its_slot(tmp_path):
    # Model surgery between steps (p.data = a larger tensor, as a resized embedding): the
    # next backward starts the copies with the last step's plan, whose slot holds 512
    # elements; swap_undo._copy memmoves the parameter's current byte count (64 MiB) into
    # it, past the pool's buffer: a segmentation fault (smaller growths write silently
    # past the slot). A step without the copies ahead raises or steps, in Python.
    done = subprocess.run([sys.executable, "-c", GROWN, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-600:]}"


def test_a_gan_whose_generator_backward_runs_through_the_discriminator(tmp_path):
    # G's backward goes through D: D's first backward of its next step is G's, and D's
    # copies are written ahead then. D's step fails part way once; both nets train on
    # bitwise as in memory.
    def build(where, sub):
        torch.manual_seed(0)
        g = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        d = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)],
                                torch.nn.Linear(32, 1))
        opts = []
        for net, name in ((g, "g"), (d, "d")):
            folder = os.path.join(where, sub + name) if where else None
            if folder:
                os.makedirs(folder)
            opts.append(DistributedOptimizer(HookedAdamW(net.parameters(), lr=1e-2),
                                             swap_dir=folder,
                                             swap_buffer_mb=20 / 1024 if folder else None))
        return g, d, opts[0], opts[1]

    runs = [build(str(tmp_path), "s"), build(None, "m")]
    data = torch.Generator().manual_seed(1)
    for it in range(8):
        z, real = torch.randn(8, 8, generator=data), torch.randn(8, 32, generator=data)
        for k, (g, d, og, od) in enumerate(runs):
            od.zero_grad()
            (d(real).mean() - d(g(z).detach()).mean()).backward()
            if it == 5 and k == 0:
                since = od.swap_metrics()
                params = [p.detach().clone() for p in d.parameters()]
                fail_step_at(od, 4)
                assert all(torch.equal(p, q) for p, q in zip(d.parameters(), params))
                assert od.swap_metrics()["swap_undo_ahead_used_bytes"] > \
                    since["swap_undo_ahead_used_bytes"], "D's copies written ahead were used"
            if it != 5:
                od.step()
            og.zero_grad()
            d(g(z)).mean().neg().backward()
            og.step()
    for a, b in zip(runs[0][:2], runs[1][:2]):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_wgan_clipping_at_the_start_of_the_critic_step_is_kept_by_a_failed_step(tmp_path):
    # A WGAN whose critic is not frozen while the generator trains, and which clips the
    # critic at the start of each critic iteration (p.data.clamp_): the generator's
    # backward runs through the critic and starts the critic's copies; the clip comes after
    # them and is invisible to the version counter. A critic step that fails then puts
    # back the unclipped weights.
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
    d = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)], torch.nn.Linear(32, 1))
    os.makedirs(tmp_path / "g")
    os.makedirs(tmp_path / "d")
    og = DistributedOptimizer(HookedAdamW(g.parameters(), lr=1e-2), swap_dir=str(tmp_path / "g"),
                              swap_buffer_mb=20 / 1024)
    od = DistributedOptimizer(HookedAdamW(d.parameters(), lr=1e-2), swap_dir=str(tmp_path / "d"),
                              swap_buffer_mb=20 / 1024)
    data = torch.Generator().manual_seed(1)
    for it in range(4):
        z, real = torch.randn(8, 8, generator=data), torch.randn(8, 32, generator=data)
        for p in d.parameters():
            p.data.clamp_(-0.05, 0.05)
        od.zero_grad()
        (d(real).mean() - d(g(z).detach()).mean()).backward()
        if it == 3:
            clipped = [p.detach().clone() for p in d.parameters()]
            fail_step_at(od, 4)
            assert all(torch.equal(p, q) for p, q in zip(d.parameters(), clipped)), \
                "the failed critic step put back the weights from before the clip"
        else:
            od.step()
        og.zero_grad()
        since = od.swap_metrics()
        d(g(z)).mean().neg().backward()
        if it == 2:
            written_ahead(od, since, 14 * 4096)     # the critic's copies, from G's backward
        og.step()


@pytest.mark.parametrize("where", ["tmp", "tmpfs"])
def test_copies_written_ahead_that_were_cut_off_do_not_break_a_failed_step(where, tmp_path,
                                                                          request):
    # The spare is cut (its undo area lost: truncated by hand, a file system that drops a
    # file's tail) after the copies were written ahead, before the step. The file is the
    # same (inode), the parameters too, so the step trusts the copies and skips its own
    # undo writes. A step failing part way then cannot read them back: the optimizer is
    # broken and the parameters half-stepped ("restore a commit"), where a step that wrote
    # its own undo copies (the copies checked with SEEK_HOLE before they are trusted, or
    # not written ahead) puts them back bitwise and training goes on.
    if where == "tmpfs":
        tmp_path = request.getfixturevalue("mount")("tmpfs", "2m")
    pairs = pair(str(tmp_path))
    step_both(pairs, 2)
    (model, opt), _ = pairs
    backward_and_wait(model, opt)
    [folder] = [f for f in os.listdir(tmp_path) if f.startswith("hvd_adapt-swap-")]
    os.truncate(os.path.join(tmp_path, folder, "spare.bin"), 0)
    params = [p.detach().clone() for p in model.parameters()]
    fail_step_at(opt, 6)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_steps_a_grad_scaler_skips_keep_the_copies_written_ahead_valid(tmp_path):
    # An inf gradient: scaler.step skips opt.step, the copies written ahead at that
    # backward wait for the next step (more backwards first); it fails part way once.
    runs = []
    for where in (str(tmp_path), None):
        torch.manual_seed(0)
        model, inner = deep()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        opt = DistributedOptimizer(inner, grad_scaler=scaler, swap_dir=where,
                                   swap_buffer_mb=36 / 1024 if where else None)
        runs.append((model, opt, scaler))
    data = torch.Generator().manual_seed(2)
    for it in range(9):
        x = torch.randn(8, 32, generator=data)
        for k, (model, opt, scaler) in enumerate(runs):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if it in (3, 4):
                model[0].weight.grad[0, 0] = float("inf")
            if it == 6 and k == 0:
                since = opt.swap_metrics()
                params = [p.detach().clone() for p in model.parameters()]
                fail_step_at(opt, 6)
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
                assert opt.swap_metrics()["swap_undo_ahead_used_bytes"] > \
                    since["swap_undo_ahead_used_bytes"]
                continue
            if it == 6:
                continue
            scaler.step(opt)
            scaler.update()
    (a, _, sa), (b, _, sb) = runs
    assert sa.get_scale() == sb.get_scale()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


COLLECTED_ON_THE_THREAD = textwrap.dedent("""
    import gc, os, sys, time, torch, hvd_adapt
    from hvd_adapt import DistributedOptimizer
    hvd_adapt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    gc.collect()
    gc.disable()    # the optimizer's objects stay young: the next collection frees them
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                               swap_dir=sys.argv[1], swap_buffer_mb=0.1)
    for i in range(2):
        opt.zero_grad()
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
    # The undo thread waits at its first take() until the optimizer is dropped: what a slow
    # disk does to its timing, made certain.
    lock = opt._swap._pool._lock
    lock.acquire()
    opt.zero_grad()
    model(torch.randn(4, 64)).pow(2).mean().backward()
    del opt         # in reference cycles: freed by the next collection, in any thread
    enable, release, sleep = gc.enable, lock.release, time.sleep
    gc.set_threshold(1, 1, 1)
    enable()
    release()       # the undo thread allocates first: the collection runs there
    sleep(2)
    gc.set_threshold(700, 10, 10)
    gc.collect()
""")


def test_an_optimizer_collected_on_its_own_undo_thread_is_closed(tmp_path):
    # Garbage collection runs in whichever thread allocates: an optimizer dropped while
    # its copies are written can be collected on the undo thread itself. Its finalizer
    # (swap._close) then joins that thread from itself: "RuntimeError: cannot join current
    # thread", and the rest of the clean-up (I/O threads, the folder, its fd) never runs.
    done = subprocess.run([sys.executable, "-c", COLLECTED_ON_THE_THREAD, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot join current thread" not in done.stderr, done.stderr[-2000:]
    assert not os.listdir(tmp_path), "the swap folder was left behind"


def test_the_fingerprint_sees_one_changed_value_at_any_width():
    from hvd_adapt.optim.swap_undo import fingerprint
    data = torch.arange(4103, dtype=torch.uint8)        # sums of 8-, 4-, 2- and 1-byte words
    for nbytes in (4096, 4100, 4102, 4103):
        before = fingerprint(data, 0, nbytes)
        assert fingerprint(data.clone(), 0, nbytes) == before
        edited = data.clone()
        edited[nbytes - 1] += 1
        assert fingerprint(edited, 0, nbytes) != before, nbytes


def threads_started_by(work):
    """How many threads more than before the process has while ``work`` has run on a thread
    of its own that still lives (1: that thread alone)."""
    done, release = threading.Event(), threading.Event()

    def run():
        work()
        done.set()
        release.wait()

    before = len(os.listdir("/proc/self/task"))
    thread = threading.Thread(target=run)
    thread.start()
    done.wait()
    during = len(os.listdir("/proc/self/task"))
    release.set()
    thread.join()
    return during - before


def test_the_fingerprint_runs_on_the_calling_thread_alone():
    # The undo thread takes a fingerprint of every copy while the micro-steps use every
    # core: torch's sum would start an OpenMP team of its own on that thread, workers that
    # spin on the cores the backward uses.
    from hvd_adapt.optim.swap_undo import fingerprint
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no team to start")
    data = torch.ones(64 << 20, dtype=torch.uint8)
    assert threads_started_by(lambda: fingerprint(data, 0, data.numel())) == 1


def test_a_strided_parameter_is_copied_ahead_on_the_undo_thread_alone(tmp_path):
    # A channels_last convolution's weight is not contiguous: its copy must not start an
    # OpenMP team on the undo thread either (torch's copy_ would), and must be exact.
    from hvd_adapt.optim import swap_undo
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no team to start")
    weight = torch.randn(64, 64, 3, 3).to(memory_format=torch.channels_last)
    target = torch.empty(weight.shape, dtype=torch.bfloat16)
    values = weight.to(torch.bfloat16)             # numpy has no bfloat16: copied as bits
    assert not values.is_contiguous()
    assert threads_started_by(lambda: swap_undo._copy(target, values)) == 1
    assert torch.equal(target, values)
