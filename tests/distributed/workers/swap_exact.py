"""Two ranks train each recipe with the optimizer state in memory, then on disk; each
reports digests of its parameters and optimizer state after every
optimizer step, for tests/distributed/test_swap_two_ranks.py to compare."""
import argparse
import functools
import hashlib
import os

import torch

import hvd_adapt
from _report import run_cases


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def state_digest(opt):
    state = opt.state_dict()["state"]
    return digest(value for index in sorted(state) for key, value in sorted(state[index].items())
                  if torch.is_tensor(value))


parser = argparse.ArgumentParser()
parser.add_argument("--cases", nargs="+", default=["adamw"],
                    help="recipes: adamw, adamw+amp or sgd; each trains with the state in "
                         "memory, then with it on disk")
parser.add_argument("--swap-root", required=True,
                    help="each recipe's state on disk goes into a folder of its own here")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()


def train_recipe(kind, amp, swap_dir):
    """One job's training, from the same seeds every time: the digests after every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) \
        if kind == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp else None
    opt = hvd_adapt.DistributedOptimizer(inner, measure_noise=True, grad_scaler=scaler,
                                         swap_dir=swap_dir,
                                         swap_buffer_mb=0.05 if swap_dir else None)
    loader = hvd_adapt.AdaptiveDataLoader(
        torch.utils.data.TensorDataset(
            torch.randn(96, 16, generator=torch.Generator().manual_seed(1))),
        batch_size=16, shuffle=True, seed=5)
    # One plan only (global 16 = replicas x 4 x accumulation): no decision depends on timing.
    loader.autoscale_batch_size(16, local_bsz_bounds=(4, 4), gradient_accumulation=True)
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
    steps = []

    @hvd_adapt.run
    def train(state):
        for epoch in hvd_adapt.remaining_epochs_until(args.epochs):
            for (x,) in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = model(x).pow(2).mean()
                (scaler.scale(loss) if scaler else loss).backward()
                if not loader.is_optim_step():
                    continue
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                steps.append({"params": digest(model.parameters()), "state": state_digest(opt),
                              "accumulation": loader.accumulation_steps,
                              "noise": [opt.gns.num_updates, opt.gns.sqr.tolist(),
                                        opt.gns.trace.tolist()]})
                state.commit()

    train(state)
    # The evidence that the state was on disk: the steps the swap took.
    return {"steps": steps, "swap_steps": opt.swap_metrics().get("swap_steps", 0)}


def memory_then_disk(case):
    kind, amp = case.split("+")[0], case.endswith("+amp")
    return {"memory": train_recipe(kind, amp, None),
            "swapped": train_recipe(kind, amp, os.path.join(args.swap_root, case))}


# One job for every recipe (a job's start-up costs more than its 12 steps): each recipe
# trains afresh from the same seeds, in memory and then on disk.
hvd_adapt.init()
rank = hvd_adapt.env.rank()
run_cases({case: functools.partial(memory_then_disk, case) for case in args.cases}, rank)
