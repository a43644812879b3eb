"""Gradient noise scale on a problem whose answer is known.

loss = mean over the batch of <w, x>, so the per-sample gradient is x itself:
with x ~ N(mu, diag(sigma^2)), |G|^2 = |mu|^2 and tr(Sigma) = sum(sigma^2).
lr = 0 keeps w still; only the estimator moves.
"""
import argparse

import torch
from torch.utils.data import TensorDataset

import hvd_adapt
from _report import report

DIM, MU, SIGMA = 20, 0.5, 1.0
TRUE_SQR, TRUE_TRACE = DIM * MU ** 2, DIM * SIGMA ** 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulate", action="store_true")
    parser.add_argument("--samples", type=int, default=24000)
    args = parser.parse_args()
    hvd_adapt.init()
    gen = torch.Generator().manual_seed(1)
    x = MU + SIGMA * torch.randn(args.samples, DIM, generator=gen)
    w = torch.nn.Parameter(torch.zeros(DIM))
    opt = hvd_adapt.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), measure_noise=True)
    loader = hvd_adapt.AdaptiveDataLoader(TensorDataset(x), batch_size=16, shuffle=True)
    if args.accumulate:
        # Bounds force 4 micro-batches of 4 per replica-step.
        loader.autoscale_batch_size(16, local_bsz_bounds=(1, 4), gradient_accumulation=True)
    hvd_adapt.State(model=None, optimizer=opt, loader=loader)
    for (xb,) in loader:
        opt.zero_grad()
        (xb @ w).mean().backward()
        opt.step()
    report({"sqr": float(opt.gns.sqr.sum()), "trace": float(opt.gns.trace.sum()),
            "updates": opt.gns.num_updates, "local_bsz": loader.current_local_bsz,
            "accum": loader.accumulation_steps, "true_sqr": TRUE_SQR,
            "true_trace": TRUE_TRACE}, hvd_adapt.env.rank())


if __name__ == "__main__":
    main()
