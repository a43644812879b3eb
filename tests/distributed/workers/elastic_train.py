"""An elastic training job that logs, at every commit, the samples it trained on.

Run by tests/distributed/test_elastic.py under horovodrun with a host-discovery
script that follows the progress file this job writes. Every rank appends its
committed batches to commits.<pid>.jsonl (a StateHandler flushes them on save
and drops them on restore), and rank 0 appends each epoch's accumulator totals
to epochs.jsonl.
"""
import argparse
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


class CommitLogHandler(StateHandler):
    def save(self):
        if self.value.pending:
            with open(self.value.path, "a") as f:
                for entry in self.value.pending:
                    f.write(json.dumps(entry) + "\n")
            self.value.pending = []

    def restore(self):
        self.value.pending = []

    def sync(self):
        pass


def params_digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def write_progress(step):
    path = out_path("progress")
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--wait-steps", type=json.loads, default=[])
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
    args = parser.parse_args()

    hvd_adapt.register_handler(CommitLog, CommitLogHandler)
    threads_before = torch.get_num_threads()
    hvd_adapt.init()
    torch.manual_seed(0)
    # HVD_ADAPT_TEST_DEVICE=cuda: the GPU tests run the same job on the replicas' GPUs.
    device = hvd_adapt.env.device(os.environ.get("HVD_ADAPT_TEST_DEVICE", "cpu"))
    model = torch.nn.Linear(4, 1).to(device)
    # Weight decay and momentum: a sync that stepped the optimizer (as Horovod's
    # broadcast_optimizer_state does) would show as replicas that differ.
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                         momentum=0.9, weight_decay=0.01))
    loader = hvd_adapt.AdaptiveDataLoader(IndexDataset(args.samples), batch_size=args.batch_size,
                                          shuffle=True, seed=3)
    if args.autoscale:
        loader.autoscale_batch_size(4 * args.batch_size,
                                    local_bsz_bounds=(2, args.max_local_bsz or 2 * args.batch_size),
                                    gradient_accumulation=True, decide_every=2)
    stats = hvd_adapt.Accumulator()
    log = CommitLog(out_path(f"commits.{os.getpid()}.jsonl"))
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=stats, log=log,
                            step=0, waited=[])
    host = os.environ.get("HOROVOD_HOSTNAME", "localhost")

    def commit():
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

    @hvd_adapt.run
    def train(state):
        # Horovod blacklists a dead worker's host and ends the job when that leaves
        # no slot, or no host that stepped in the world before: kills need two
        # hosts that have stepped together.
        hosts = len(set(hvd.allgather_object(host))) if args.kill_plan else 0
        world_start, world_started = state.step, time.time()
        for epoch in hvd_adapt.remaining_epochs_until(args.epochs):
            for x, idx in loader:
                if state.step == args.kill_step and host == args.kill_host:
                    os.kill(os.getpid(), signal.SIGKILL)
                if hosts > 1 and state.step >= world_start + 2:
                    planned_kill(args.kill_plan, state.step, loader.is_optim_step(),
                                 world_started)
                real = idx[:len(idx) - loader.num_padded]
                loss = model(x.to(device)).pow(2).mean()
                opt.zero_grad()
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
                                    "threads": torch.get_num_threads(),
                                    "threads_before": threads_before,
                                    "cpus": len(os.sched_getaffinity(0))})
                if loader.is_optim_step():
                    state.step += 1
                commit()
                if hvd.rank() == 0:
                    write_progress(state.step)
                if state.step in args.wait_steps and state.step not in state.waited:
                    state.waited = state.waited + [state.step]
                    # Hold still at this step until the driver's resize reaches us.
                    deadline = time.time() + args.hold_seconds
                    while time.time() < deadline:
                        time.sleep(0.1)
                        commit()
            with stats.synchronized():
                if hvd.rank() == 0:
                    with open(out_path("epochs.jsonl"), "a") as f:
                        f.write(json.dumps({"epoch": epoch, "n": stats["n"],
                                            "idsum": stats["idsum"], "size": hvd.size()}) + "\n")
                stats.clear()
            if args.until_step is not None and state.step >= args.until_step:
                break

    train(state)


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
