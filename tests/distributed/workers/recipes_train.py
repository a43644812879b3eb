"""The training recipes users run, under several replicas: AdamW with weight decay, bf16
autocast with a GradScaler, gradient clipping after synchronize(), and a rank that skips
a step on its own.

``--inf-at N``: rank 1's loss is multiplied by inf at step N, so its gradients
overflow; the GradScaler must skip that step on every rank alike.
``--skip-at N``: rank 1 does not call step() at step N (a per-rank guard);
``--skip-backward-at N``: rank 1 skips the whole batch N, backward included.
Every rank reports, per step, the hash of its parameters and of its gradients
as clipping saw them, and whether the step was taken. ``--cases`` trains several
cases in one job.
"""
import argparse
import functools
import hashlib
import json

import horovod.torch as hvd
import torch

import hvd_adapt
from _report import report, run_cases


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


parser = argparse.ArgumentParser()
parser.add_argument("--cases", type=json.loads, default=None,
                    help='{"NAME": [ARGS...]}: one job trains each case afresh, with these '
                         "options, and reports each by name")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--inf-at", type=int, default=-1)
parser.add_argument("--skip-at", type=int, default=-1)
parser.add_argument("--skip-backward-at", type=int, default=-1)
parser.add_argument("--amp", action="store_true")
parser.add_argument("--fp16-compression", action="store_true")
parser.add_argument("--bucket-cap-mb", type=float, default=None)


def train_case(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if args.amp else None
    compression = hvd.Compression.fp16 if args.fp16_compression else None
    opt = hvd_adapt.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), grad_scaler=scaler,
        compression=compression, bucket_cap_mb=args.bucket_cap_mb)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=16, shuffle=True)
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
    steps = []

    @hvd_adapt.run
    def train(state):
        for step, (x, y) in enumerate(loader):
            if step == args.steps:
                break
            if step == args.skip_backward_at and rank == 1:
                continue
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            if step == args.inf_at and rank == 1:
                loss = loss * float("inf")
            if scaler is not None:
                scaler.scale(loss).backward()
                opt.synchronize()
                scaler.unscale_(opt)
            else:
                loss.backward()
            grads = digest(p.grad for p in model.parameters())
            grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = opt.gns.progress
            if scaler is not None:
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update()
            elif not (step == args.skip_at and rank == 1):
                opt.step()
            steps.append({"grads": grads, "grad_dtypes": grad_dtypes,
                          "params": digest(model.parameters()),
                          "stepped": opt.gns.progress > before,
                          "scale": scaler.get_scale() if scaler is not None else None})

    train(state)
    return {"rank": rank, "steps": steps, "progress": opt.gns.progress}


arguments = parser.parse_args()
hvd_adapt.init()
rank = hvd_adapt.env.rank()
if arguments.cases is None:
    report(train_case(arguments), rank)
else:
    # A job's start-up costs more than a case's few steps: one job trains every case.
    run_cases({name: functools.partial(train_case, parser.parse_args([str(a) for a in case_args]))
               for name, case_args in arguments.cases.items()}, rank)
