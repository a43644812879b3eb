"""An elastic training job that logs, at every commit, the samples it trained on.

Run by tests/distributed/test_elastic.py under horovodrun with a host-discovery
script that follows the progress file this job writes. Every rank appends its
committed batches to commits.<pid>.jsonl (a StateHandler flushes them on save
and drops them on restore), and rank 0 appends each epoch's accumulator totals
to epochs.jsonl.
"""
import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import time

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.torch.elastic.state import StateHandler
from torch.utils.data import Dataset

import hvd_adapt
from _report import out_path


class IndexDataset(Dataset):
    def __init__(self, n):
        self.x = torch.linspace(-1, 1, n * 4).reshape(n, 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i


class CommitLog:
    def __init__(self, path):
        self.path = path
        self.pending = []

    # Nothing of it belongs in a checkpoint: each process logs to its own file.
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class CommitLogHandler(StateHandler):
    def save(self):
        # Every save, even one with nothing trained since the last (an epoch's
        # end), is a commit: its time bounds the restore points the soak checks.
        append_line(f"saves.{os.getpid()}.jsonl", {"time": time.time()})
        if self.value.pending:
            with open(self.value.path, "a") as f:
                for entry in self.value.pending:
                    f.write(json.dumps(entry) + "\n")
            self.value.pending = []

    def restore(self):
        self.value.pending = []

    def sync(self):
        pass


def tensor_digest(h, tensor):
    data = tensor.detach().cpu().float()
    if data.numel() > 1 << 16:
        # Hashing every byte of a large model each step would dwarf its step
        # time; its sum and a strided sample tell replicas apart as well.
        h.update(data.double().sum().numpy().tobytes())
        data = data.flatten()[::97]
    h.update(data.numpy().tobytes())


def params_digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        tensor_digest(h, p)
    return h.hexdigest()


class Tokens(torch.nn.Module):
    """Compute-bound: each sample as ``tokens`` tokens (1024: ~3 GFLOP a sample) through 8
    layers of width 256 (0.5M parameters)."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens = tokens
        self.embed = torch.nn.Linear(4, 256)
        self.body = torch.nn.Sequential(*[m for _ in range(8)
                                          for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])
        self.head = torch.nn.Linear(256, 1)

    def forward(self, x):
        tokens = x.unsqueeze(1) * torch.linspace(0.5, 1.5, self.tokens,
                                                 device=x.device).view(1, self.tokens, 1)
        return self.head(self.body(self.embed(tokens))).mean(dim=1)


def build_model(kind, tokens):
    if kind == "deep":
        return Tokens(tokens)
    if kind == "wide":
        # Communication-bound: 8.4M parameters and almost no compute per sample.
        return torch.nn.Sequential(torch.nn.Linear(4, 2048), torch.nn.Linear(2048, 4096),
                                   torch.nn.Linear(4096, 1))
    return torch.nn.Linear(4, 1)


def optimizer_digest(opt):
    """A hash of every tensor and number of the optimizer's state (moments, steps; read from
    its files where it is on disk)."""
    h = hashlib.sha256()
    for index, entry in sorted(opt.state_dict()["state"].items()):
        for key in sorted(entry):
            value = entry[key]
            h.update(f"{index}.{key}".encode())
            if torch.is_tensor(value):
                tensor_digest(h, value)
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def append_line(name, entry):
    with open(out_path(name), "a") as f:
        f.write(json.dumps(entry) + "\n")


def write_progress(step):
    path = out_path("progress")
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--model", choices=("linear", "deep", "wide"), default="linear",
                        help="deep: compute-bound; wide: communication-bound")
    parser.add_argument("--decide-every", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--wait-steps", type=json.loads, default=[],
                        help="steps to hold still at until a resize interrupts (in the first "
                             "launch of hvd-adapt-run only)")
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-host", default="127.0.0.1")
    parser.add_argument("--autoscale", action="store_true")
    parser.add_argument("--max-local-bsz", type=int, default=None)
    # The soak's schedule: [{"id", "step", "rank", "mid_cycle"}...]; each fires once.
    parser.add_argument("--kill-plan", type=json.loads, default=[])
    parser.add_argument("--until-step", type=int, default=None,
                        help="end after the first epoch that reaches this step")
    parser.add_argument("--hold-seconds", type=float, default=30.0)
    parser.add_argument("--pause-on-interrupt", type=float, default=0.0,
                        help="rank 0 writes the file 'interrupted' at the first host-update "
                             "interrupt and waits this long before resetting")
    parser.add_argument("--adamw", action="store_true", help="AdamW with weight decay")
    parser.add_argument("--amp", action="store_true",
                        help="bf16 autocast with a GradScaler (in the optimizer and the State)")
    parser.add_argument("--inf-steps", type=json.loads, default=[],
                        help="steps at which the last rank's loss overflows (the scale backs off)")
    parser.add_argument("--slow-batches", default=None,
                        help="HOST:LOCAL_RANK:SECONDS: the worker started in that slot waits "
                             "this long at the start of every batch, before any collective "
                             "(a slow data loader): slow, but healthy")
    parser.add_argument("--solo-work", type=json.loads, default=None,
                        help="[STEP, SECONDS]: once, at that step, rank 0 computes alone for "
                             "that long before its next collective (an evaluation on rank 0), "
                             "writing the files solo_started and solo_done")
    parser.add_argument("--slow-join", type=float, default=0.0,
                        help="a worker started after the job committed once sleeps this long "
                             "before init(), as on a cluster (ssh, container, imports)")
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint path, '{host}' replaced by this worker's host: "
                             "resumed from at the start, written at every epoch's end")
    parser.add_argument("--kill-after-join", default=None,
                        help="the worker on this host kills itself right after the first sync "
                             "of a world of two, before any commit")
    parser.add_argument("--commit-sleep", type=float, default=0.0,
                        help="seconds each commit waits first (commits far apart)")
    parser.add_argument("--break-checkpoint-at-epoch", type=int, default=-1,
                        help="rank 0 puts a file where the checkpoint's folder was when this "
                             "epoch starts, so that the epoch's checkpoint write fails")
    parser.add_argument("--kill-old-after-grow", type=int, default=0,
                        help="up to this many times, right after the sync of a world that "
                             "grew, the lowest rank that held the state before dies")
    parser.add_argument("--kill-in-checkpoint", type=int, default=0,
                        help="up to this many times, rank 0 dies at an epoch's first batch "
                             "while its checkpoint write (slowed down) is under way")
    parser.add_argument("--slow-checkpoint-fsync", type=float, default=0.0,
                        help="seconds each fsync of a checkpoint write takes on rank 0")
    parser.add_argument("--drain", action="store_true",
                        help="a SIGTERM drains the job into --checkpoint")
    parser.add_argument("--batch-seconds", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sample of --model deep")
    parser.add_argument("--sample-seconds", type=float, default=0.0,
                        help="seconds each sample's forward and backward sleep: the compute of "
                             "a host's own accelerator, which workers sharing this machine's "
                             "cores do not have")
    parser.add_argument("--stop-file", default=None,
                        help="end after the first epoch that ends once rank 0 sees this file "
                             "(every rank follows rank 0's word)")
    parser.add_argument("--device-lock", default=None,
                        help="a file each host has its own of (on its local disk): the "
                             "--sample-seconds sleep holds an exclusive lock on it, as a "
                             "worker holds its host's accelerator, so two jobs' workers on one "
                             "host take turns")
    parser.add_argument("--swap-dir", default=None,
                        help="the optimizer's state on disk in this folder")
    parser.add_argument("--raise-at-step", type=int, default=-1,
                        help="every rank raises ValueError when it reaches this step (a bug of "
                             "the script's own)")
    parser.add_argument("--kill-all-at-step", type=int, default=-1,
                        help="every rank SIGKILLs itself when it reaches this step, in the "
                             "first run of hvd-adapt-run only (HVD_ADAPT_RESTARTS 0)")
    parser.add_argument("--snapshot-budget", type=float, default=None,
                        help="State(snapshot_budget=...) (default: the State's)")
    parser.add_argument("--commit-every", type=int, default=1,
                        help="commit at every N-th optimizer step; check for host changes "
                             "after the other batches (the digits example's pattern)")
    args = parser.parse_args()

    if args.slow_join and os.path.exists(out_path("committed")):
        time.sleep(args.slow_join)
    hvd_adapt.register_handler(CommitLog, CommitLogHandler)
    threads_before = torch.get_num_threads()
    hvd_adapt.init()
    # After init(): a standby worker gets its slot's environment there.
    host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
    slow_seconds = 0.0
    if args.slow_batches:
        slow_host, slow_rank, seconds = args.slow_batches.split(":")
        if (host, os.environ.get("HOROVOD_LOCAL_RANK")) == (slow_host, slow_rank):
            slow_seconds = float(seconds)
            open(out_path(f"slow.{os.getpid()}"), "w").close()
    torch.manual_seed(0)
    # HVD_ADAPT_TEST_DEVICE=cuda: the GPU tests run the same job on the replicas' GPUs.
    device = hvd_adapt.env.device(os.environ.get("HVD_ADAPT_TEST_DEVICE", "cpu"))
    model = build_model(args.model, args.tokens).to(device)
    # Weight decay with momentum or AdamW: a sync that stepped the optimizer (as
    # Horovod's broadcast_optimizer_state does) would show as replicas that differ.
    if args.adamw:
        inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.01)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12, growth_interval=3) \
        if args.amp else None
    opt = hvd_adapt.DistributedOptimizer(inner, grad_scaler=scaler, swap_dir=args.swap_dir,
                                         swap_buffer_mb=0.05 if args.swap_dir else None)
    loader = hvd_adapt.AdaptiveDataLoader(IndexDataset(args.samples), batch_size=args.batch_size,
                                          shuffle=True, seed=3)
    if args.autoscale:
        loader.autoscale_batch_size(4 * args.batch_size,
                                    local_bsz_bounds=(2, args.max_local_bsz or 2 * args.batch_size),
                                    gradient_accumulation=True,
                                    decide_every=args.decide_every)
    stats = hvd_adapt.Accumulator()
    log = CommitLog(out_path(f"commits.{os.getpid()}.jsonl"))
    values = dict(model=model, optimizer=opt, loader=loader, stats=stats, log=log, step=0,
                  waited=[])
    if scaler is not None:
        values["scaler"] = scaler
    if args.snapshot_budget is not None:
        values["snapshot_budget"] = args.snapshot_budget
    state = hvd_adapt.State(**values)
    checkpoint = args.checkpoint.replace("{host}", host) if args.checkpoint else None
    if args.slow_checkpoint_fsync:
        slow_down_checkpoint_fsyncs(args.slow_checkpoint_fsync)
    if args.drain:
        hvd_adapt.install_sigterm_drain(state, checkpoint_path=checkpoint)
    if checkpoint is not None:
        state.load_checkpoint(checkpoint)

    def holding():
        """What this rank holds now, for comparing ranks and restore points."""
        return {"rank": hvd.rank(), "size": hvd.size(), "host": host, "ppid": os.getppid(),
                "step": state.step,
                "epoch": state.epoch, "position": loader.sampler.position,
                "params": params_digest(model), "optimizer": optimizer_digest(opt),
                "scale": None if scaler is None else scaler.get_scale(),
                "generation": getattr(state, "generation", None), "time": time.time(),
                "restarts": RESTARTS}

    def commit():
        if args.commit_sleep:
            time.sleep(args.commit_sleep)
        try:
            state.commit()
        except HostsUpdatedInterrupt:
            # The discovery script can change the hosts again between this
            # interrupt and the reset's rendezvous, which is when Horovod
            # builds the new world.
            marker = out_path("interrupted")
            if args.pause_on_interrupt and hvd.rank() == 0 and not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(args.pause_on_interrupt)
            raise

    def check_hosts():
        try:
            state.check_host_updates()
        except HostsUpdatedInterrupt:
            # No restore follows an interrupt: what this rank trained since the
            # last commit stays trained, so it is logged now (a removed worker
            # exits at the reset).
            CommitLogHandler(log).save()
            raise

    def commit_or_check():
        if args.commit_every == 1 or (loader.is_optim_step()
                                      and state.step % args.commit_every == 0):
            commit()
        else:
            check_hosts()

    @hvd_adapt.run
    def train(state):
        # Horovod blacklists a dead worker's host and ends the job when that leaves
        # no slot, or no host that stepped in the world before: kills need two
        # hosts that have stepped together.
        hosts = len(set(hvd.allgather_object(host))) if args.kill_plan else 0
        world_start, world_started = state.step, time.time()
        append_line(f"attempts.{os.getpid()}.jsonl", holding())
        size_before = worlds_seen[-1] if worlds_seen else None
        worlds_seen.append(hvd.size())
        if args.kill_old_after_grow:
            kill_an_old_rank_after_a_grow(args.kill_old_after_grow, size_before)
        if args.kill_after_join == host and hvd.size() == 2:
            try:
                fd = os.open(out_path("killed_after_join"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        for epoch in hvd_adapt.remaining_epochs_until(args.epochs, checkpoint=checkpoint):
            if args.kill_in_checkpoint and hvd.rank() == 0 and hvd.size() > 1 and epoch > 0:
                kill_once(args.kill_in_checkpoint, "in_checkpoint")
            if args.kill_in_checkpoint and hvd.rank() == 0 and epoch > 0:
                record_checkpoint_age(state, checkpoint)
            if epoch == args.break_checkpoint_at_epoch and hvd.rank() == 0:
                state.wait_for_checkpoint()      # the last epoch's file is in the folder
                folder = os.path.dirname(checkpoint)
                if os.path.isdir(folder):
                    os.rename(folder, folder + ".moved")
                    open(folder, "w").close()
            for x, idx in loader:
                time.sleep(slow_seconds)
                if args.solo_work and hvd.rank() == 0 and state.step == args.solo_work[0]:
                    work_alone(args.solo_work[1])
                if state.step == args.kill_step and host == args.kill_host:
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.step == args.kill_all_at_step and RESTARTS == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.step == args.raise_at_step:
                    raise ValueError(f"a bug of the script's own at step {state.step}")
                if hosts > 1 and state.step >= world_start + 2:
                    planned_kill(args.kill_plan, state.step, loader.is_optim_step(),
                                 world_started)
                real = idx[:len(idx) - loader.num_padded]
                opt.zero_grad()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                    loss = model(x.to(device)).pow(2).mean()
                with accelerator(args.device_lock):
                    time.sleep(args.sample_seconds * len(x))
                if state.step in args.inf_steps and hvd.rank() == hvd.size() - 1:
                    loss = loss * float("inf")
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
                stats["n"] += len(real)
                stats["idsum"] += int(real.sum())
                log.pending.append({"epoch": epoch, "indices": real.tolist(), "rank": hvd.rank(),
                                    "size": hvd.size(), "step": state.step, "host": host,
                                    "params": params_digest(model),
                                    "noise": [opt.gns.num_updates, opt.gns.sqr.tolist(),
                                              opt.gns.trace.tolist()],
                                    "local_bsz": loader.current_local_bsz,
                                    "accum": loader.accumulation_steps, "choice": loader.choice,
                                    "optim": loader.is_optim_step(), "time": time.time(),
                                    "optimizer": optimizer_digest(opt),
                                    "scale": None if scaler is None else scaler.get_scale(),
                                    "threads": torch.get_num_threads(),
                                    "threads_before": threads_before,
                                    "cpus": len(os.sched_getaffinity(0)),
                                    "restarts": RESTARTS})
                if loader.is_optim_step():
                    state.step += 1
                time.sleep(args.batch_seconds)
                commit_or_check()
                if hvd.rank() == 0:
                    write_progress(state.step)
                    if not os.path.exists(out_path("committed")):
                        open(out_path("committed"), "w").close()
                if state.step in args.wait_steps and state.step not in state.waited \
                        and RESTARTS == 0:
                    state.waited = state.waited + [state.step]
                    # Hold still at this step until the driver's resize reaches us. A count,
                    # not a deadline: each pass is a collective, and ranks that read their
                    # own clocks could leave after different numbers of passes, one waiting
                    # in a vote the others never join (a job hung so where no resize came).
                    for _ in range(round(args.hold_seconds / 0.1)):
                        time.sleep(0.1)
                        commit() if args.commit_every == 1 else check_hosts()
            with stats.synchronized():
                if hvd.rank() == 0:
                    with open(out_path("epochs.jsonl"), "a") as f:
                        f.write(json.dumps({"epoch": epoch, "n": stats["n"],
                                            "idsum": stats["idsum"], "size": hvd.size()}) + "\n")
                stats.clear()
            if args.until_step is not None and state.step >= args.until_step:
                break
            if args.stop_file and hvd.broadcast_object(os.path.exists(args.stop_file),
                                                       name="stop_file"):
                break
            if (args.kill_old_after_grow or args.kill_in_checkpoint) and kills_fired() >= max(
                    args.kill_old_after_grow, args.kill_in_checkpoint):
                break

    try:
        train(state)
    except SystemExit as stop:
        # A drain: what every rank held when it stopped.
        append_line(f"drained.{os.getpid()}.jsonl", dict(holding(), code=stop.code))
        raise


worlds_seen = []   # this process's world sizes, one per attempt of the training function
# Under hvd-adapt-run: which launch of the job this process belongs to (0: the first).
RESTARTS = int(os.environ.get("HVD_ADAPT_RESTARTS", "0"))


@contextlib.contextmanager
def accelerator(lock_path):
    """The host's one accelerator, held while a sample's compute sleeps (None: no lock)."""
    if lock_path is None:
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def kills_fired():
    return len([name for name in os.listdir(os.path.dirname(out_path("x")))
                if name.startswith("killed.")])


def work_alone(seconds):
    """Compute for ``seconds`` with no collective (rank 0's evaluation), once per job."""
    try:
        os.close(os.open(out_path("solo_started"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    a = torch.randn(256, 256)
    deadline = time.time() + seconds
    while time.time() < deadline:
        a = torch.tanh(a @ a.T / 256)
    append_line("solo_done", {"pid": os.getpid(), "time": time.time()})


def kill_once(limit, kind):
    """SIGKILL this worker, recording the kill, unless ``limit`` kills fired already."""
    if kills_fired() >= limit:
        return
    marker = out_path(f"killed.{kind}.{kills_fired()}")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, json.dumps({"rank": hvd.rank(), "size": hvd.size(), "kind": kind,
                             "time": time.time()}).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_an_old_rank_after_a_grow(limit, size_before):
    """Right after the sync of a world larger than this process's last one, before any
    commit: the lowest rank that held the job's state before dies, so a joining worker is
    left alone with what it was synced to as its restore point."""
    before = hvd.allgather_object(size_before, name="size_before")
    old = [rank for rank, size in enumerate(before) if size is not None]
    grew = old and hvd.size() > max(before[rank] for rank in old)
    if grew and hvd.rank() == old[0]:
        kill_once(limit, "after_grow")


def slow_down_checkpoint_fsyncs(seconds):
    """Make rank 0's checkpoint writes slow (a busy shared file system), so a kill lands
    while one is under way."""
    from hvd_adapt.elastic import checkpoint as checkpoint_file
    real_fsync = os.fsync

    class SlowOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def fsync(fd):
            if hvd.rank() == 0:
                time.sleep(seconds)
            real_fsync(fd)

    checkpoint_file.os = SlowOs()


def record_checkpoint_age(state, path):
    """Rank 0 at an epoch's start: the generation its checkpoint holds (after its writes
    ended) against that of the last epoch's end committed."""
    from hvd_adapt.elastic import checkpoint as checkpoint_file
    state.wait_for_checkpoint()
    append_line("checkpoint_ages.jsonl", {
        "epoch": state.epoch, "file": checkpoint_file.generation_of(path),
        "epoch_end": state.epochs.epoch_end_commits, "host": os.environ.get("HOROVOD_HOSTNAME")})


def planned_kill(plan, step, optim_step, world_started):
    """SIGKILL this worker if the first kill of the plan not yet fired is for its rank
    (modulo the world's size) now: from ``step`` on, or for a ``mid_cycle`` kill at the
    first batch from ``step`` on that leaves a cycle open (two steps later at the latest,
    in case nothing accumulates). One kill per world (Horovod ends a job whose every
    worker failed at once): none fires in a world that started before the last kill.
    Its marker file says which rank died."""
    fired = [out_path(f"killed.{kill['id']}") for kill in plan]
    pending = [kill for kill, path in zip(plan, fired) if not os.path.exists(path)]
    if not pending or any(os.path.getmtime(p) >= world_started
                          for p in fired if os.path.exists(p)):
        return
    kill = pending[0]
    if hvd.rank() != kill["rank"] % hvd.size() or step < kill["step"]:
        return
    if kill["mid_cycle"] and optim_step and step < kill["step"] + 2:
        return
    try:
        fd = os.open(out_path(f"killed.{kill['id']}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, json.dumps({"rank": hvd.rank(), "size": hvd.size(), "step": step,
                             "mid_cycle": not optim_step}).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
