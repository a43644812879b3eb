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
        loader.autoscale_batch_size(4 * args.batch_size, local_bsz_bounds=(2, 2 * args.batch_size),
                                    gradient_accumulation=True, decide_every=2)
    stats = hvd_adapt.Accumulator()
    log = CommitLog(out_path(f"commits.{os.getpid()}.jsonl"))
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=stats, log=log,
                            step=0, waited=[])
    host = os.environ.get("HOROVOD_HOSTNAME", "localhost")

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(args.epochs):
            for x, idx in loader:
                if state.step == args.kill_step and host == args.kill_host:
                    os.kill(os.getpid(), signal.SIGKILL)
                real = idx[:len(idx) - loader.num_padded]
                loss = model(x.to(device)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                stats["n"] += len(real)
                stats["idsum"] += int(real.sum())
                log.pending.append({"epoch": epoch, "indices": real.tolist(), "rank": hvd.rank(),
                                    "size": hvd.size(), "step": state.step,
                                    "params": params_digest(model),
                                    "local_bsz": loader.current_local_bsz,
                                    "accum": loader.accumulation_steps, "choice": loader.choice,
                                    "optim": loader.is_optim_step(), "time": time.time(),
                                    "threads": torch.get_num_threads(),
                                    "threads_before": threads_before,
                                    "cpus": len(os.sched_getaffinity(0))})
                if loader.is_optim_step():
                    state.step += 1
                state.commit()
                if hvd.rank() == 0:
                    write_progress(state.step)
                if state.step in args.wait_steps and state.step not in state.waited:
                    state.waited = state.waited + [state.step]
                    # Hold still at this step until the driver's resize reaches us.
                    deadline = time.time() + 30
                    while time.time() < deadline:
                        time.sleep(0.1)
                        state.commit()
            with stats.synchronized():
                if hvd.rank() == 0:
                    with open(out_path("epochs.jsonl"), "a") as f:
                        f.write(json.dumps({"epoch": epoch, "n": stats["n"],
                                            "idsum": stats["idsum"], "size": hvd.size()}) + "\n")
                stats.clear()

    train(state)


if __name__ == "__main__":
    main()
