"""Elastic demo: a job that grows from 1 to 3 workers on one machine and shrinks again.

Run it with run_elastic.sh beside this file. discover.sh reports as many
slots as the schedule asks for at the epoch the job has reached; at each
epoch boundary the job holds (committing) until Horovod has resized it, so
every size of the schedule is seen, and prints the batch size hvd_adapt chose
for it. ``--step-log`` writes rank 0's step times and the moments resizes
were signalled, for benchmarks/resize_latency.py; ``--startup-delay`` makes
each worker as slow to start as on a cluster.
"""
import argparse
import logging
import json
import os
import time

import torch
import torch.nn.functional as F
from horovod.common.exceptions import HostsUpdatedInterrupt
from torch.utils.data import TensorDataset

import hvd_adapt


def schedule_size(epoch):
    schedule = [int(s) for s in os.environ.get("HVD_ADAPT_DEMO_SCHEDULE", "1 2 3 2 1").split()]
    per = int(os.environ.get("HVD_ADAPT_DEMO_EPOCHS_PER_SIZE", "2"))
    return schedule[min(epoch // per, len(schedule) - 1)]


def write_progress(directory, epoch):
    path = os.path.join(directory, "progress")
    with open(path + ".tmp", "w") as f:
        f.write(str(epoch))
    os.replace(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--step-log", default=None)
    parser.add_argument("--startup-delay", type=float, default=0.0,
                        help="seconds to sleep before init(), as a worker on a cluster "
                             "takes to start (container, imports, data)")
    args = parser.parse_args()
    directory = os.environ.get("HVD_ADAPT_DEMO_DIR", "/tmp/hvd_adapt_demo")
    schedule = os.environ.get("HVD_ADAPT_DEMO_SCHEDULE", "1 2 3 2 1").split()
    epochs = len(schedule) * int(os.environ.get("HVD_ADAPT_DEMO_EPOCHS_PER_SIZE", "2"))

    # hvd_adapt logs its batch-size decisions at INFO on rank 0.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("hvd_adapt").setLevel(logging.INFO)
    time.sleep(args.startup_delay)
    hvd_adapt.init()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 32, generator=gen)
    y = (x[:, :4].sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    loader = hvd_adapt.AdaptiveDataLoader(TensorDataset(x, y), batch_size=args.batch_size,
                                          shuffle=True)
    loader.autoscale_batch_size(1024, local_bsz_bounds=(16, 256), gradient_accumulation=True)
    stats = hvd_adapt.Accumulator()
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=stats)

    def log(event):
        if args.step_log and hvd_adapt.env.rank() == 0:
            with open(args.step_log, "a") as f:
                f.write(json.dumps(dict(event, time=time.time(), size=hvd_adapt.env.size())) + "\n")

    def commit():
        try:
            state.commit()
        except HostsUpdatedInterrupt:
            log({"event": "resize"})
            raise

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(epochs):
            if hvd_adapt.env.rank() == 0:
                write_progress(directory, epoch)
            # Demo only: hold at the boundary until Horovod has resized the job.
            deadline = time.time() + 120
            while hvd_adapt.env.size() != schedule_size(epoch) and time.time() < deadline:
                time.sleep(0.05)
                commit()
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                stats["loss"] += loss.item() * len(yb)
                stats["n"] += len(yb)
                log({"event": "step"})
                commit()
            with stats.synchronized():
                if hvd_adapt.env.rank() == 0:
                    print(f"epoch {epoch}: replicas={hvd_adapt.env.size()} "
                          f"loss={stats['loss'] / stats['n']:.4f} {loader.progress_line()}",
                          flush=True)
                stats.clear()

    train(state)


if __name__ == "__main__":
    main()
