"""State.sync() with the optimizers users run: it must copy rank 0's values and change nothing.

Each rank starts from its own random weights. ``--root-trained N``: rank 0
alone takes N steps first, so its optimizer has state and the others' have
none (a worker joining a running job); 0: every optimizer is fresh (a
job's start). Every rank reports hashes of its parameters and optimizer
state after the sync, and rank 0 those of its values before it. ``--cases``
runs several cases in one job (one launch and one import of torch for all),
each on its own model, optimizer and State.
"""
import argparse
import functools
import hashlib
import os

import torch

import hvd_adapt
from _report import report, run_cases


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(opt):
    state = opt.state_dict()["state"]
    return [v for key in sorted(state) for _, v in sorted(state[key].items())
            if isinstance(v, torch.Tensor)]


OPTIMIZERS = ("sgd", "adamw")
WRAPPERS = {"torch": False, "hvd_adapt": True}


def run_case(optimizer, root_trained, wrapped, survivor_skips_sync=False):
    """One case on its own model, optimizer, loader and State; its report."""
    rank = hvd_adapt.env.rank()
    torch.manual_seed(100 + rank)
    device = hvd_adapt.env.device(os.environ.get("HVD_ADAPT_TEST_DEVICE", "cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2)).to(device)
    if optimizer == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if rank == 0:
        for _ in range(root_trained):
            inner.zero_grad()
            model(torch.randn(4, 8, device=device)).pow(2).sum().backward()
            inner.step()
    opt = hvd_adapt.DistributedOptimizer(inner) if wrapped else inner
    # A loader and an accumulator: light values, synced on every path.
    loader = hvd_adapt.AdaptiveDataLoader(list(range(40)), batch_size=4)
    stats = hvd_adapt.Accumulator()
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader, stats=stats)
    before = {"params": digest(model.parameters()), "opt": digest(optimizer_tensors(inner)),
              "opt_lr": inner.param_groups[0]["lr"]}
    if survivor_skips_sync and rank == 0:
        state.on_reset()              # what hvd.elastic.run does after the interrupt
        state.resync_after_reset()    # what hvd_adapt.run does when Horovod skipped its sync
    else:
        state.sync()
    return {"rank": rank, "before": before, "params": digest(model.parameters()),
            "opt": digest(optimizer_tensors(inner)), "opt_count": len(optimizer_tensors(inner))}


parser = argparse.ArgumentParser()
parser.add_argument("--cases", default=None,
                    help="optimizer:root_trained:torch|hvd_adapt,... run one after the other in "
                         "this job, each reported under its own name (instead of the flags)")
parser.add_argument("--optimizer", choices=OPTIMIZERS)
parser.add_argument("--root-trained", type=int, default=0)
parser.add_argument("--wrapped", action="store_true", help="hvd_adapt.DistributedOptimizer")
parser.add_argument("--survivor-skips-sync", action="store_true")
args = parser.parse_args()
if (args.cases is None) == (args.optimizer is None):
    parser.error("give either --cases or --optimizer (exactly one of them)")

hvd_adapt.init()
if args.cases is None:
    report(run_case(args.optimizer, args.root_trained, args.wrapped, args.survivor_skips_sync),
           hvd_adapt.env.rank())
else:
    cases = {}
    for case in args.cases.split(","):
        optimizer, root_trained, wrapped = case.split(":")
        if optimizer not in OPTIMIZERS or wrapped not in WRAPPERS:
            parser.error(f"--cases: {case!r} is not optimizer:steps:torch|hvd_adapt")
        cases[case] = functools.partial(run_case, optimizer, int(root_trained), WRAPPERS[wrapped])
    run_cases(cases, hvd_adapt.env.rank())
