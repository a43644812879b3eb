"""A simulated cluster: what offering each job only the workers that pay does to a job trace.

Replays a trace of jobs (Poisson arrivals; workload, requested workers and
length drawn from a seed) on a cluster of nodes with one worker slot each,
in scheduling rounds of ``--round`` seconds, under three policies:

- ``fixed``: each job waits until the workers it requested are free (first
  come, first served, with backfill) and trains on exactly those, at the
  batch its recipe fixes (the initial batch per worker: linear scaling);
- ``greedy``: today's ``horovodrun --elastic`` with a discovery that offers
  every free host: a job starts on one worker and takes every worker it is
  offered up to ``--greedy-max`` x what it requested, first come first
  served, never giving one back; hvd_adapt picks its batch size;
- ``discover``: each job's ``hvd-adapt-discover`` rule
  (:class:`hvd_adapt.scheduling.rule.DiscoveryRule`: marginal speed-up per
  added worker >= 0.5, hysteresis, growth at most 2x the most workers it has
  run on) within a fair share of the cluster (nodes / active jobs; what jobs
  leave unused goes to those whose rule wants more); hvd_adapt picks its
  batch size.

A job's progress is goodput (useful samples per second: throughput x
statistical efficiency, from :class:`hvd_adapt.goodput.GoodputFunction`,
the model the library fits at run time) integrated over time; it ends when
it has made the progress its length asks for. Each change of a job's
workers stops it for the pause ``resize_latency.py`` measured (a cold
start for greedy, a warm standby for discover; a shrink's pause for both),
read from ``benchmarks/results/resize_latency.json`` when present.

Assumptions (see RESULTS.md): the three workloads' step-time and gradient
parameters below are set by hand to the ratios measured on this project's
workloads (compute per sample, the allreduce's share of a step at two
workers, the noise scales the runs reached), scaled to a GPU's speed; they
are not fitted per job from a stored profile. Each job's goodput function is
known from its start (the real rule first runs at 1-2 workers to measure
it; the growth limit stands for that). Nodes are identical, and a pause
costs the job only its own time.

    python benchmarks/cluster_sim.py [--jobs 120] [--nodes 64] [--seed 0]
"""
import argparse
import json
import math
import os
import random
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from hvd_adapt.goodput import GoodputFunction, GradParams, PerfParams  # noqa: E402
from hvd_adapt.scheduling.rule import DiscoveryRule  # noqa: E402

POLICIES = ("fixed", "greedy", "discover")

# (PerfParams, noise scale at B0, B0, largest batch, atomic batch range): see the docstring.
WORKLOADS = {
    # A small MLP: little compute per sample, a small allreduce.
    "digits": (PerfParams(0.004, 0.00005, 0.010, 0.002, 0.002, 0.0005, 1.5),
               1000.0, 32, 4096, (8, 1024)),
    # A CNN: compute-bound, large noise scale late in training.
    "shapes": (PerfParams(0.010, 0.0015, 0.020, 0.004, 0.005, 0.001, 2.0),
               3000.0, 32, 4096, (8, 512)),
    # A transformer: a large allreduce, a small noise scale.
    "markov_text": (PerfParams(0.020, 0.003, 0.080, 0.010, 0.020, 0.004, 1.2),
                    256.0, 32, 1024, (8, 256)),
}
REQUESTED = [(1, 0.4), (2, 0.2), (4, 0.2), (8, 0.15), (16, 0.05)]
DEFAULT_PAUSES = {"cold_grow": 14.0, "warm_grow": 1.0, "shrink": 0.4}


class Job:
    def __init__(self, index, arrival, workload, requested, hours_alone, nodes):
        self.index, self.arrival, self.workload = index, arrival, workload
        self.requested = requested
        perf, noise, b0, max_batch, bsz_range = WORKLOADS[workload]
        # noise scale = var * B0 / sqr, with sqr = 1
        self.fn = GoodputFunction(perf, GradParams(1.0, noise / b0), b0)
        replicas = np.arange(1, nodes + 1)
        self.adaptive = np.asarray(self.fn.optimize(replicas, replicas, max_batch, bsz_range,
                                                    accumulation=True)[0])
        self.fixed = np.asarray(self.fn.evaluate(replicas, replicas, b0, 0))
        # The work is what one worker at the fixed recipe does in hours_alone.
        self.work = float(self.fixed[0]) * hours_alone * 3600.0
        self.curve = [{"replicas": int(r), "speedup": float(g / self.adaptive[0]),
                       "goodput": float(g)} for r, g in zip(replicas, self.adaptive)]
        self.progress, self.workers, self.finish = 0.0, 0, None
        self.most_workers = 0

    def goodput(self, policy, workers):
        if workers == 0:
            return 0.0
        table = self.fixed if policy == "fixed" else self.adaptive
        return float(table[workers - 1])


def make_trace(args):
    rng = random.Random(args.seed)
    jobs, t = [], 0.0
    for index in range(args.jobs):
        t += rng.expovariate(args.jobs / (args.hours * 3600.0))
        workload = rng.choice(sorted(WORKLOADS))
        requested = rng.choices([r for r, _ in REQUESTED], [w for _, w in REQUESTED])[0]
        hours = math.exp(rng.uniform(math.log(args.min_job_hours), math.log(args.max_job_hours)))
        jobs.append(Job(index, t, workload, min(requested, args.nodes), hours, args.nodes))
    return jobs


def allocate_fixed(active, nodes, args):
    free = nodes - sum(j.workers for j in active)
    for job in active:                      # running jobs keep theirs; queued ones backfill
        if job.workers == 0 and job.requested <= free:
            job.workers, free = job.requested, free - job.requested
    return {job.index: job.workers for job in active}


def allocate_greedy(active, nodes, args):
    free = nodes - sum(j.workers for j in active)
    want = {job.index: job.workers for job in active}
    for job in active:                      # a queued job starts on one worker
        if want[job.index] == 0 and free > 0:
            want[job.index], free = 1, free - 1
    for job in active:                      # then takes all it is offered
        more = min(free, args.greedy_max * job.requested - want[job.index])
        if more > 0 and want[job.index] > 0:
            want[job.index], free = want[job.index] + more, free - more
    return want


def allocate_discover(active, nodes, args, rule):
    share = max(1, nodes // max(1, len(active)))
    want, free = {}, nodes
    for job in active:                      # first come first served for the first worker
        current = job.workers
        limit = max(1, min(share, rule.growth_cap([job.most_workers], max(current, 1))))
        target = rule.target(job.curve, 1, limit, 1)
        if current and not rule.worth_changing(job.curve, current, target) and current <= share:
            target = current
        target = min(target, free)
        want[job.index], free = target, free - target
    for job in active:                      # what others left unused, to jobs that want more
        if free <= 0:
            break
        current = want[job.index]
        if current == 0:
            continue
        limit = min(current + free, rule.growth_cap([job.most_workers], max(current, 1)))
        target = rule.target(job.curve, current, limit, 1)
        if target > current and rule.worth_changing(job.curve, current, target):
            want[job.index], free = target, free - (target - current)
    return want


def simulate(policy, args, pauses):
    jobs = make_trace(args)
    rule = DiscoveryRule()
    t, node_seconds = 0.0, 0.0
    while any(job.finish is None for job in jobs):
        active = [j for j in jobs if j.arrival <= t and j.finish is None]
        if policy == "fixed":
            want = allocate_fixed(active, args.nodes, args)
        elif policy == "greedy":
            want = allocate_greedy(active, args.nodes, args)
        else:
            want = allocate_discover(active, args.nodes, args, rule)
        assert sum(want.values()) <= args.nodes
        for job in active:
            new = want[job.index]
            pause = 0.0
            if job.workers and new != job.workers:
                grow = "warm_grow" if policy == "discover" else "cold_grow"
                pause = pauses[grow] if new > job.workers else pauses["shrink"]
            job.workers = new
            job.most_workers = max(job.most_workers, new)
            rate = job.goodput(policy, new)
            start = max(t, job.arrival) + pause
            if rate > 0 and job.progress + rate * (t + args.round - start) >= job.work:
                job.finish = start + (job.work - job.progress) / rate
                node_seconds += new * (job.finish - t)
                job.workers = 0
            else:
                job.progress += rate * max(0.0, t + args.round - start)
                node_seconds += new * args.round
        t += args.round
    jct = np.array([job.finish - job.arrival for job in jobs]) / 3600.0
    return {"policy": policy, "avg_jct_h": float(jct.mean()),
            "p99_jct_h": float(np.percentile(jct, 99)),
            "node_hours": node_seconds / 3600.0,
            "makespan_h": max(job.finish for job in jobs) / 3600.0}


def measured_pauses():
    path = os.path.join(ROOT, "benchmarks", "results", "resize_latency.json")
    pauses = dict(DEFAULT_PAUSES)
    if os.path.exists(path):
        with open(path) as f:
            modes = json.load(f)["data"]["modes"]
        for mode, key in (("cold", "cold_grow"), ("warm", "warm_grow")):
            grows = [p["seconds"] for p in modes.get(mode, []) if p["to"] > p["from"]]
            if grows:
                pauses[key] = max(grows)
        shrinks = [p["seconds"] for rows in modes.values() for p in rows if p["to"] < p["from"]]
        if shrinks:
            pauses["shrink"] = max(shrinks)
    return pauses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=120)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--hours", type=float, default=8.0, help="arrivals span (default 8 h)")
    parser.add_argument("--min-job-hours", type=float, default=0.25,
                        help="shortest job, on one worker at its fixed recipe")
    parser.add_argument("--max-job-hours", type=float, default=16.0, help="longest job, alike")
    parser.add_argument("--round", type=float, default=60.0, help="seconds per scheduling round")
    parser.add_argument("--greedy-max", type=int, default=4,
                        help="greedy jobs' --max-np as a multiple of what they requested")
    parser.add_argument("--seeds", default="0,1,2", help="traces to replay (comma-separated)")
    parser.add_argument("--json", default=None,
                        help="also write the table here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    for name in ("jobs", "nodes", "greedy_max"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.min_job_hours <= args.max_job_hours:
        parser.error("need 0 < --min-job-hours <= --max-job-hours, got "
                     f"{args.min_job_hours} and {args.max_job_hours}")
    pauses = measured_pauses()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        for policy in POLICIES:
            rows.append(dict(simulate(policy, args, pauses), seed=seed))
    print(f"{args.jobs} jobs on {args.nodes} nodes; pauses (s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in pauses.items()))
    print(f"{'seed':>4} {'policy':>9} {'avg_jct_h':>10} {'p99_jct_h':>10} {'node_hours':>11} "
          f"{'makespan_h':>11}")
    for r in rows:
        print(f"{r['seed']:>4} {r['policy']:>9} {r['avg_jct_h']:>10.2f} {r['p99_jct_h']:>10.2f} "
              f"{r['node_hours']:>11.1f} {r['makespan_h']:>11.2f}")
    summary = {}
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        summary[policy] = float(np.mean([r["avg_jct_h"] for r in mine]))
    cut = 1 - summary["discover"] / summary["fixed"]
    print(f"discover: average JCT {100 * cut:.0f}% below fixed (goal >= 30%), "
          f"{summary['discover'] / summary['greedy']:.2f} x greedy's (goal < 1)")
    if args.json:
        import record
        record.write(args.json, {"jobs": args.jobs, "nodes": args.nodes, "pauses": pauses,
                                 "rows": rows, "round_s": args.round})
    return rows


if __name__ == "__main__":
    main()
