"""Latency of GoodputFunction.optimize for 1..1024 replicas (target < 5 ms).

    python benchmarks/goodput_optimize.py [--repeats 200]
"""
import argparse
import timeit

import numpy as np

from hvd_adapt.goodput import GoodputFunction, GradParams, PerfParams


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None,
                        help="also write the rows here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    fn = GoodputFunction(PerfParams(0.02, 0.001, 0.1, 0.01, 0.05, 0.005, 1.5),
                         GradParams(sqr=1.0, var=4.0), init_batch_size=128)
    print(f"{'replicas':>8} {'nodes':>6} {'latency_ms':>11} {'bsz':>6} {'accum':>6}")
    worst = 0.0
    rows = []
    for replicas in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]:
        nodes = max(1, replicas // 4)
        call = lambda: fn.optimize(nodes, replicas, max_batch_size=1 << 16,  # noqa: E731
                                   atomic_bsz_range=(32, 512), accumulation=True)
        seconds = np.median(timeit.repeat(call, number=1, repeat=args.repeats))
        _, b, s = call()
        worst = max(worst, seconds * 1e3)
        rows.append({"replicas": replicas, "nodes": nodes, "latency_ms": seconds * 1e3,
                     "batch": int(b), "accumulation": int(s)})
        print(f"{replicas:>8} {nodes:>6} {seconds * 1e3:>11.3f} {b:>6} {s:>6}")
    print(f"max_latency_ms={worst:.3f} (target < 5)")
    if args.json:
        import record
        record.write(args.json, {"rows": rows})
    return worst


if __name__ == "__main__":
    main()
