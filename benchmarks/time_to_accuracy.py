"""Wall time to a target validation accuracy on digits: fixed small, fixed large, adaptive.

Runs examples/digits/train.py three ways in one process: a fixed small batch,
a fixed large batch with the learning rate scaled linearly, and hvd_adapt's
adaptive batch starting from the small one.

    python benchmarks/time_to_accuracy.py [--target 0.97] [--max-epochs 60]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "digits"))
import train as digits  # noqa: E402


def run(name, argv, repeats):
    """Median wall time of ``repeats`` runs, with the last run's epochs and best accuracy (fixed
    runs are deterministic; the adaptive run's choices depend on measured step times)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        best, epochs = digits.main(argv + ["--quiet"])
        times.append(time.perf_counter() - started)
    return name, sorted(times)[len(times) // 2], epochs, best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--max-epochs", type=int, default=60)
    parser.add_argument("--small", type=int, default=32)
    parser.add_argument("--large", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate at the small batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    common = ["--target-accuracy", str(args.target), "--epochs", str(args.max_epochs)]
    # Warm-up: imports, the data set and allocator caches, paid once, by nobody.
    digits.main(common[:2] + ["--epochs", "1", "--quiet"])
    large_lr = args.lr * args.large / args.small
    results = [
        run(f"fixed bsz={args.small}", common + ["--batch-size", str(args.small), "--lr",
                                                 str(args.lr), "--no-autoscale"], args.repeats),
        run(f"fixed bsz={args.large} (linear lr)", common + [
            "--batch-size", str(args.large), "--lr", str(large_lr), "--no-autoscale",
            "--max-batch-size", str(args.large), "--max-local-bsz", str(args.large)], args.repeats),
        # The same memory bound as the fixed large run, which shows it fits.
        run(f"adaptive {args.small}..{args.large}", common + [
            "--batch-size", str(args.small), "--lr", str(args.lr),
            "--max-batch-size", str(args.large), "--max-local-bsz", str(args.large)],
            args.repeats),
    ]
    print(f"\n{'run':<28} {'seconds':>8} {'epochs':>7} {'best_acc':>9} {'reached':>8}")
    for name, seconds, epochs, best in results:
        print(f"{name:<28} {seconds:>8.2f} {epochs:>7} {best:>9.4f} {str(best >= args.target):>8}")
    fixed = [r for r in results[:2] if r[3] >= args.target]
    adaptive = results[2]
    if not fixed or adaptive[3] < args.target:
        print("adaptive_vs_best_fixed=nan (a run missed the target)")
        return float("nan")
    ratio = adaptive[1] / min(r[1] for r in fixed)
    print(f"adaptive_vs_best_fixed={ratio:.3f} (goal <= 0.8, never > 1.05)")
    return ratio


if __name__ == "__main__":
    main()
