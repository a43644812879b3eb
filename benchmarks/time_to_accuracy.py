"""Training time to early, middle and final targets: a sweep of fixed batch sizes against the adaptive run.

For one workload of ``benchmarks/workloads`` every fixed global batch of its
sweep (learning rate scaled from the base batch by the workload's rule) and
the adaptive run (hvd_adapt chooses batch size and accumulation steps,
starting at the sweep's smallest batch, bounded by its largest) train from
``--seeds`` seeds each, each run in its own process(es), at 1 or 2 replicas.
Validation is read every ``read_every`` training samples with the clock
stopped. Printed: the median seconds of every run to every target with its
spread over seeds, then ``adaptive / best fixed`` and ``adaptive / median
fixed`` (nan where no fixed run, or not the median one, reached the target);
written: a JSON of every curve and a PNG (with matplotlib).

    python benchmarks/time_to_accuracy.py --workload shapes [--procs 2] [--seeds 3]
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workloads  # noqa: E402


def train_one(config):
    """Train one run of ``config``; rank 0 returns its curve: rows of (seconds, samples,
    metric, global batch, accumulation steps, replicas)."""
    import horovod.torch as hvd
    import torch
    import hvd_adapt
    hvd_adapt.init()
    workload = resolve(config)
    train_set, val_set = workload.make_data(0, config["size"])
    torch.manual_seed(config["seed"])
    model = workload.make_model()
    batch = config["batch"]
    opt = hvd_adapt.DistributedOptimizer(
        workload.make_optimizer(model.parameters(), workload.lr_for(batch)))
    loader = hvd_adapt.AdaptiveDataLoader(train_set, batch_size=batch, shuffle=True,
                                          seed=config["seed"])
    if config["adaptive"]:
        loader.autoscale_batch_size(config["max_batch"],
                                    local_bsz_bounds=(1, workload.max_local_bsz),
                                    gradient_accumulation=True)
    state = hvd_adapt.State(model=model, optimizer=opt, loader=loader)
    state.sync()
    final = workload.targets[-1]
    curve, clock, samples, unread = [], 0.0, 0, 0
    for _ in hvd_adapt.remaining_epochs_until(10 ** 6):
        started = time.perf_counter()
        for x, y in loader:
            loss = workload.loss(model, (x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step_samples = len(y) * hvd_adapt.env.size()
            samples += step_samples
            unread += step_samples
            if unread < workload.read_every:
                continue
            clock += time.perf_counter() - started
            unread = 0
            value = workload.evaluate(model, val_set)
            curve.append((clock, samples, value, loader.current_batch_size,
                          loader.accumulation_steps, hvd_adapt.env.size()))
            stop = workload.reached(value, final) or clock > config["max_seconds"]
            if hvd_adapt.env.size() > 1:
                # Each rank has its own clock: all stop when rank 0 does.
                stop = bool(hvd.broadcast(torch.tensor([int(stop)]), 0, name="tta.stop")[0])
            if stop:
                return curve if hvd_adapt.env.rank() == 0 else None
            started = time.perf_counter()
        clock += time.perf_counter() - started


def resolve(config):
    """The workload of ``config`` with its command-line overrides applied."""
    overrides = {key: tuple(value) if isinstance(value, list) else value
                 for key, value in config.get("overrides", {}).items()}
    return dataclasses.replace(workloads.get(config["workload"]), **overrides)


def launch(config, procs, timeout):
    """Run ``config`` in fresh processes (``horovodrun --gloo`` for 2) and return its curve."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curve.json")
        command = [sys.executable, os.path.abspath(__file__), "--run-one", json.dumps(config),
                   "--out", out]
        if procs > 1:
            # The horovodrun of this interpreter's environment, on PATH or not.
            horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
            command = [horovodrun, "-np", str(procs), "-H", f"localhost:{procs}",
                       "--gloo", "--network-interface", "lo"] + command
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // procs)))
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"run {config} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def time_to(curve, workload, target):
    """Seconds of training until ``target`` is first read (inf if never)."""
    return next((row[0] for row in curve if workload.reached(row[2], target)), float("inf"))


def rows(workload, runs):
    """For each target: ``(target, {run: [seconds per seed]}, (adaptive / best fixed,
    adaptive / median fixed))``, the ratios nan where no fixed run (or not the median one)
    got there, or where the runs are not both kinds."""
    names = list(runs)
    out = []
    for target in workload.targets:
        times = {n: [time_to(c, workload, target) for c in runs[n]] for n in names}
        medians = {n: float(np.median(times[n])) for n in names}
        fixed = [medians[n] for n in names if n != "adaptive"]
        ratios = (np.nan, np.nan)
        if fixed and "adaptive" in medians:
            # A ratio of 0 where nothing got there would read as a measurement.
            ratios = tuple(medians["adaptive"] / base if np.isfinite(base) else np.nan
                           for base in (min(fixed), float(np.median(fixed))))
        out.append((target, times, ratios))
    return out


def report(workload, runs):
    """Print the table; return {target: (adaptive / best fixed, adaptive / median fixed)}."""
    names = list(runs)
    print(f"\n{workload.name}: median seconds to target over {len(runs[names[0]])} seeds "
          f"[min-max]; {workload.metric}, {'higher' if workload.higher_is_better else 'lower'}"
          " is better")
    print(f"{'target':>8} " + " ".join(f"{n:>22}" for n in names)
          + f" {'adaptive/best':>14} {'adaptive/median':>16}")
    ratios = {}
    both = any(n != "adaptive" for n in names) and "adaptive" in names
    for target, times, (ratio_best, ratio_median) in rows(workload, runs):
        cells = [f"{np.median(times[n]):7.1f} [{min(times[n]):5.1f}-{max(times[n]):5.1f}]"
                 for n in names]
        if not both:
            print(f"{target:>8} " + " ".join(f"{c:>22}" for c in cells))
            continue
        ratios[target] = (ratio_best, ratio_median)
        print(f"{target:>8} " + " ".join(f"{c:>22}" for c in cells)
              + f" {ratio_best:>14.2f} {ratio_median:>16.2f}")
    if not ratios:
        return ratios
    worst = max((r[0] for r in ratios.values() if not np.isnan(r[0])), default=np.nan)
    final_best, final_median = ratios[workload.targets[-1]]
    print(f"worst_adaptive_vs_best_fixed={worst:.3f} final_adaptive_vs_best_fixed={final_best:.3f}"
          f" final_adaptive_vs_median_fixed={final_median:.3f}")
    return ratios


def plot(workload, runs, path):
    """Metric against training time for every run; the adaptive runs' batch and replicas."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(runs)))
    for colour, (name, curves) in zip(colours, runs.items()):
        for i, curve in enumerate(curves):
            rows = np.array(curve)
            style = "-" if name == "adaptive" else "--"
            top.plot(rows[:, 0], rows[:, 2], style, color="red" if name == "adaptive" else colour,
                     alpha=0.8, label=name if i == 0 else None)
            if name == "adaptive":
                bottom.step(rows[:, 0], rows[:, 3], where="post", color="red", alpha=0.8,
                            label="global batch" if i == 0 else None)
                bottom.step(rows[:, 0], rows[:, 5], where="post", color="black", alpha=0.5,
                            label="replicas" if i == 0 else None)
    for target in workload.targets:
        top.axhline(target, color="grey", lw=0.5)
    # Runs that never get there would squeeze the others into a corner.
    finished = [time_to(curve, workload, workload.targets[-1])
                for curves in runs.values() for curve in curves]
    finished = [t for t in finished if np.isfinite(t)]
    if finished:
        top.set_xlim(0, 1.5 * max(finished))
    top.set_ylabel(workload.metric)
    top.set_title(f"{workload.name}: {workload.metric} against training time")
    top.legend(fontsize=8)
    bottom.set_yscale("log", base=2)
    bottom.set_ylabel("adaptive run")
    bottom.set_xlabel("training seconds (evaluation excluded)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot written to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="digits", choices=workloads.NAMES)
    parser.add_argument("--procs", type=int, default=1, choices=[1, 2])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds run are first-seed .. first-seed + seeds - 1 (more seeds "
                             "for an earlier invocation's, without repeating its runs)")
    parser.add_argument("--batches", default=None,
                        help="comma-separated fixed global batches (default: the workload's)")
    parser.add_argument("--size", type=float, default=1.0,
                        help="training-set size relative to the workload's (smoke tests: small)")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="a run stops here if it has not reached the final target")
    parser.add_argument("--targets", default=None, help="comma-separated, instead of the workload's")
    parser.add_argument("--read-every", type=int, default=None, help="training samples")
    parser.add_argument("--out", default=None,
                        help="JSON of every curve (with --run-one: of that run's curve); the PNG "
                             "goes next to it (default: time_to_accuracy_<workload>_<procs>p.json)")
    parser.add_argument("--only", default=None,
                        help="comma-separated run names to make, e.g. 'adaptive' or 'fixed 32' "
                             "(no ratios without both kinds)")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="print the table and draw the plot of an earlier invocation's --out")
    parser.add_argument("--json", default=None,
                        help="also write every curve with the command, machine and commit here "
                             "(relative: under benchmarks/results/)")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one is not None:
        curve = train_one(json.loads(args.run_one))
        if curve is not None:
            with open(args.out, "w") as f:
                json.dump(curve, f)
        return None
    if args.from_json is not None:
        with open(args.from_json) as f:
            saved = json.load(f)
        workload = resolve({"workload": saved["workload"], "overrides": saved.get("overrides", {})})
        report(workload, saved["runs"])
        plot(workload, saved["runs"], os.path.splitext(args.from_json)[0] + ".png")
        return saved["runs"]
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.first_seed < 0:
        parser.error(f"--first-seed must be >= 0, got {args.first_seed}")
    if not 0 < args.size <= 1:
        parser.error(f"--size must be in (0, 1], got {args.size}")
    overrides = {}
    if args.targets:
        overrides["targets"] = tuple(float(t) for t in args.targets.split(","))
    if args.read_every:
        overrides["read_every"] = args.read_every
    if args.batches:
        overrides["batches"] = tuple(int(b) for b in args.batches.split(","))
    workload = resolve({"workload": args.workload, "overrides": overrides})
    if len(workload.batches) < 2 or min(workload.batches) < args.procs:
        parser.error(f"--batches needs two or more sizes >= --procs, got {workload.batches}")
    base = {"workload": args.workload, "size": args.size, "max_seconds": args.max_seconds,
            "max_batch": max(workload.batches)}
    base["overrides"] = {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}
    configs = {f"fixed {b}": dict(base, batch=b, adaptive=False) for b in workload.batches}
    configs["adaptive"] = dict(base, batch=min(workload.batches), adaptive=True)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",")]
        unknown = [name for name in wanted if name not in configs]
        if unknown:
            parser.error(f"--only: unknown run(s) {unknown}; runs are {list(configs)}")
        configs = {name: configs[name] for name in wanted}
    runs = {name: [] for name in configs}
    started = time.time()
    # Seeds outermost, so a slow drift of the machine touches every configuration alike.
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name, config in configs.items():
            curve = launch(dict(config, seed=seed), args.procs, timeout=args.max_seconds * 4 + 300)
            runs[name].append(curve)
            print(f"[{time.time() - started:6.0f}s] seed {seed} {name:>10}: "
                  f"{curve[-1][2]:.4f} after {curve[-1][0]:.1f}s", flush=True)
    report(workload, runs)
    out = args.out or f"time_to_accuracy_{args.workload}_{args.procs}p.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    saved = {"workload": args.workload, "procs": args.procs, "runs": runs,
             "overrides": base["overrides"], "max_seconds": args.max_seconds}
    with open(out, "w") as f:
        json.dump(saved, f)
    if args.json:
        import record
        record.write(args.json, saved)
    try:
        plot(workload, runs, os.path.splitext(out)[0] + ".png")
    except ImportError:
        print("no plot: pip install matplotlib (the [benchmarks] extra)")
    return runs


if __name__ == "__main__":
    main()
