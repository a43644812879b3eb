"""Where two ranks' restore points stand when commits skip their snapshots (a budget too small
for any but the first): a checkpoint written by every rank after a skipped commit, then a
restore by hand on both; a checkpoint written by rank 0 alone, then the next commit; ranks of
different speeds. Each case reports what each rank restored to, to be compared across ranks
(``run_cases``)."""
import hashlib
import time

import torch
from torch.utils.data import TensorDataset

import hvd_adapt
from _report import out_path, run_cases

hvd_adapt.init()
rank = hvd_adapt.env.rank()


def job(snapshot_budget=1e-9, width=8):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, width), torch.randn(64, 1))
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
    opt = hvd_adapt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=8, shuffle=True)
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader,
                            snapshot_budget=snapshot_budget)
    state.sync()
    return state, model, opt, loader


def held(state, model, loader):
    digest = hashlib.sha256(torch.cat([p.detach().flatten() for p in model.parameters()])
                            .numpy().tobytes()).hexdigest()
    return {"generation": state.generation, "snapshot": state.snapshot_generation,
            "position": loader.sampler.position, "params": digest}


def train(state, model, opt, loader, steps, slow=0.0, commit=True):
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if slow:
            time.sleep(slow)
        if commit:
            state.commit()


def every_rank_checkpoints_then_restores():
    state, model, opt, loader = job()
    train(state, model, opt, loader, 4)
    skipped = state.snapshot_generation < state.generation
    state.save_checkpoint(out_path("every_rank.pt"))
    saved = held(state, model, loader)
    train(state, model, opt, loader, 1, commit=False)
    state.restore()
    return {"skipped": skipped, "saved": saved, "restored": held(state, model, loader)}


def rank_zero_checkpoints_alone():
    state, model, opt, loader = job()
    train(state, model, opt, loader, 4)
    if rank == 0:
        state.save_checkpoint(out_path("rank_zero.pt"))
    train(state, model, opt, loader, 1)
    after_next_commit = held(state, model, loader)
    train(state, model, opt, loader, 1)
    state.restore()
    return {"after_next_commit": after_next_commit, "restored": held(state, model, loader)}


def ranks_of_different_speeds():
    # The State's default budget; rank 1 is slower at every step. Which commits snapshot is
    # each rank's own measure, but the vote makes it one answer.
    state, model, opt, loader = job(snapshot_budget=0.03, width=512)
    snapshots = []
    for _ in range(3):
        train(state, model, opt, loader, 8, slow=0.01 * rank)
        snapshots.append(state.snapshot_generation)
    return snapshots


run_cases({"every_rank_checkpoints_then_restores": every_rank_checkpoints_then_restores,
           "rank_zero_checkpoints_alone": rank_zero_checkpoints_alone,
           "ranks_of_different_speeds": ranks_of_different_speeds}, rank)
