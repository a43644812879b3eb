"""``hvd_adapt.init()``, then Horovod's own ``hvd.elastic.run`` (no hvd_adapt State or run):
every step averages a number and commits. A worker started after the job's first step (a
joiner) sleeps ``--slow-join`` seconds before ``init()``, as a cold start on a cluster.
Rank 0 reports the world sizes it trained in and the steps."""
import argparse
import os
import time

import horovod.torch as hvd
import torch

import hvd_adapt
from _report import out_path, report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--slow-join", type=float, default=12)
    args = parser.parse_args()
    if os.path.exists(out_path("progress")):
        time.sleep(args.slow_join)
    hvd_adapt.init()
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model=model, step=0, sizes=[])

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            hvd.allreduce(torch.ones(1), name="ones")
            state.step += 1
            if not state.sizes or state.sizes[-1] != hvd.size():
                state.sizes = state.sizes + [hvd.size()]
            if hvd.rank() == 0:
                with open(out_path("progress") + ".tmp", "w") as f:
                    f.write(str(state.step))
                os.replace(out_path("progress") + ".tmp", out_path("progress"))
            time.sleep(0.2)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        report({"sizes": state.sizes, "step": state.step}, 0)


if __name__ == "__main__":
    main()
