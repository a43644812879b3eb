"""Gradient noise scale on a problem whose answer is known.

``--problem linear``: loss = mean over the batch of <w, x>, so the per-sample
gradient is x itself: with x ~ N(mu, diag(sigma^2)), |G|^2 = |mu|^2 and
tr(Sigma) = sum(sigma^2), wherever w is. ``--problem quadratic``: loss =
mean of |w - x|^2 / 2, per-sample gradient w - x: tr(Sigma) = sum(sigma^2)
while |G|^2 = |w - mu|^2 shrinks as a learning rate ``--lr`` moves w.
With ``--optimizer adam`` the statistics are those of the gradient
preconditioned by Adam's second moment, P = 1 / (sqrt(v_hat) + eps): the
true values are computed from the final v.
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
    parser.add_argument("--problem", choices=["linear", "quadratic"], default="linear")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.0)
    parser.add_argument("--pieces", type=int, default=1,
                        help="w as this many parameters, each a bucket of its own")
    args = parser.parse_args()
    hvd_adapt.init()
    gen = torch.Generator().manual_seed(1)
    x = MU + SIGMA * torch.randn(args.samples, DIM, generator=gen)
    pieces = [torch.nn.Parameter(torch.zeros(DIM // args.pieces)) for _ in range(args.pieces)]
    if args.optimizer == "sgd":
        inner = torch.optim.SGD(pieces, lr=args.lr)
    else:
        inner = torch.optim.Adam(pieces, lr=args.lr)
    # Buckets of one piece: the earlier ones' allreduces start mid-backward,
    # after their norms are taken; the last carries the norms.
    opt = hvd_adapt.DistributedOptimizer(inner, measure_noise=True,
                                         bucket_cap_mb=1e-6 if args.pieces > 1 else None)
    loader = hvd_adapt.AdaptiveDataLoader(TensorDataset(x), batch_size=16, shuffle=True)
    if args.accumulate:
        # Bounds force 4 micro-batches of 4 per replica-step.
        loader.autoscale_batch_size(16, local_bsz_bounds=(1, 4), gradient_accumulation=True)
    hvd_adapt.State(model=None, optimizer=opt, loader=loader)
    for (xb,) in loader:
        w = torch.cat(pieces)
        opt.zero_grad()
        if args.problem == "linear":
            (xb @ w).mean().backward()
        else:
            (0.5 * (w - xb).pow(2).sum(1)).mean().backward()
        opt.step()
    true_sqr, true_trace = TRUE_SQR, TRUE_TRACE
    if args.problem == "quadratic":
        true_sqr = float((torch.cat(pieces).detach() - MU).pow(2).sum())
    if args.optimizer == "adam":
        states = [inner.state[p] for p in pieces]
        pre = torch.cat([1 / ((s["exp_avg_sq"] / (1 - 0.999 ** float(s["step"]))).sqrt() + 1e-8)
                         for s in states])
        true_sqr = float((pre ** 2 * MU ** 2).sum())
        true_trace = float((pre ** 2 * SIGMA ** 2).sum())
    report({"sqr": float(opt.gns.sqr.sum()), "trace": float(opt.gns.trace.sum()),
            "updates": opt.gns.num_updates, "local_bsz": loader.current_local_bsz,
            "accum": loader.accumulation_steps, "true_sqr": true_sqr,
            "true_trace": true_trace}, hvd_adapt.env.rank())


if __name__ == "__main__":
    main()
