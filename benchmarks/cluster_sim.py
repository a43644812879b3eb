"""A simulated cluster: how a pool split among jobs does on a job trace, on measured curves.

Replays a trace of jobs (Poisson arrivals; kind, requested workers and
length drawn from a seed) on a cluster of nodes with one worker slot each,
in scheduling rounds of ``--round`` seconds, under four policies:

- ``fixed``: each job waits until the workers it requested are free (first
  come, first served, with backfill) and trains on exactly those;
- ``greedy``: ``horovodrun --elastic`` with a discovery that offers every
  free host: a job starts on one worker and takes every worker it is
  offered up to ``--greedy-max`` x what it requested, first come first
  served, never giving one back;
- ``discover``: each job's ``hvd-adapt-discover`` rule alone
  (:class:`hvd_adapt.scheduling.rule.DiscoveryRule`: marginal speed-up per
  added worker >= 0.5, hysteresis, growth at most 2x the most workers it has
  run on) within a fair share of the cluster (nodes / active jobs; what jobs
  leave unused goes to those whose rule wants more);
- ``arbiter``: ``hvd-adapt-arbiter``'s split, the very function it runs
  (:func:`hvd_adapt.scheduling.allocation.split`: Pollux's power mean of the
  jobs' speed-ups with p = -1, minimums in arrival order, growth within 2x
  what was timed, hysteresis), one change by choice per round at most.

Each job is of a kind measured by ``cluster_jobs.py`` (``--curves``, its
JSON): the goodput at each replica count that the real job's own model
fitted from its measured step times and gradient noise (the hints it
published, from the run where it was timed at the most sizes), so every
policy runs the jobs at hvd_adapt's batch sizes and differs in allocation
alone. A job's progress is that goodput integrated over time; it ends when
it has made the progress its length asks for (``hours`` on one worker).
Each change of a job's workers stops it for the pause ``resize_latency.py``
measured (a cold start for fixed and greedy, a warm standby for discover
and the arbiter; a shrink's pause for all), read from
``benchmarks/results/resize_latency.json`` when present.

Assumptions (see RESULTS.md): the curves come from jobs on this machine's
namespace hosts, whose accelerators are per-sample sleeps (cluster_jobs.py
says why), scaled to hours; each job's curve is known from its start (the
real job first measures at its first sizes; the growth limit stands for
that); nodes are identical, and a pause costs the job only its own time.

    python benchmarks/cluster_jobs.py --json cluster_jobs.json     # first: the curves
    python benchmarks/cluster_sim.py [--jobs 120] [--nodes 64] [--seeds 0,1,2]
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

from hvd_adapt.scheduling.allocation import JobView, SplitSettings, split  # noqa: E402
from hvd_adapt.scheduling.rule import DiscoveryRule  # noqa: E402

POLICIES = ("fixed", "greedy", "discover", "arbiter")
REQUESTED = [(1, 0.4), (2, 0.2), (4, 0.2), (8, 0.15), (16, 0.05)]
DEFAULT_PAUSES = {"cold_grow": 14.0, "warm_grow": 1.0, "shrink": 0.4}
CURVES = os.path.join(ROOT, "benchmarks", "results", "cluster_jobs.json")


def load_curves(path):
    """``{kind: {replicas: goodput}}`` from cluster_jobs.py's JSON: for each kind, the curve
    of its job that was timed at the most replica counts (under the arbiter, where there)."""
    with open(path) as f:
        data = json.load(f)["data"]
    best = {}
    for run in data["rounds"]:
        for job in run["jobs"].values():
            rank = (len(job["timed"]), run["policy"] == "arbiter")
            if job["curve"] and (job["kind"] not in best or rank > best[job["kind"]][0]):
                best[job["kind"]] = (rank, {int(r): float(g) for r, g in job["curve"]})
    if not best:
        raise ValueError(f"{path} holds no curve")
    return {kind: curve for kind, (_, curve) in best.items()}


class Job:
    def __init__(self, index, arrival, kind, curve, requested, hours_alone, nodes):
        self.index, self.arrival, self.kind = index, arrival, kind
        self.requested = requested
        # Beyond the largest count the job can run at (its batch bounds: goodput 0 after)
        # or the curve's end, flat: the extra workers idle.
        top = max(r for r, g in curve.items() if g > 0)
        self.table = np.array([curve[min(r, top)] for r in range(1, nodes + 1)])
        # The work is what one worker does in hours_alone.
        self.work = float(self.table[0]) * hours_alone * 3600.0
        self.curve = [{"replicas": r, "speedup": float(g / self.table[0]), "goodput": float(g)}
                      for r, g in zip(range(1, nodes + 1), self.table)]
        self.goodput_at = {r: float(g) for r, g in zip(range(1, nodes + 1), self.table)}
        self.progress, self.workers, self.finish = 0.0, 0, None
        self.most_workers = 0
        self.hosts = ()

    def goodput(self, workers):
        return 0.0 if workers == 0 else float(self.table[workers - 1])


def make_trace(args, curves):
    rng = random.Random(args.seed)
    jobs, t = [], 0.0
    for index in range(args.jobs):
        t += rng.expovariate(args.jobs / (args.hours * 3600.0))
        kind = rng.choice(sorted(curves))
        requested = rng.choices([r for r, _ in REQUESTED], [w for _, w in REQUESTED])[0]
        hours = math.exp(rng.uniform(math.log(args.min_job_hours), math.log(args.max_job_hours)))
        jobs.append(Job(index, t, kind, curves[kind], min(requested, args.nodes), hours,
                        args.nodes))
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


def allocate_arbiter(active, nodes, args, settings, now, last_change):
    """The arbiter's split of nodes ``n0..``: each job's node count, and whether it changed
    the split by choice."""
    pool = [(f"n{i}", 1) for i in range(nodes)]
    views = [JobView(str(job.index), job.index, curve=job.goodput_at,
                     timed=max(1, job.most_workers), hosts=job.hosts) for job in active]
    result = split(views, pool, settings, now, last_change)
    for job in active:
        job.hosts = tuple(result.hosts[str(job.index)])
    return {job.index: len(job.hosts) for job in active}, result.by_choice


def simulate(policy, args, pauses, curves):
    jobs = make_trace(args, curves)
    rule = DiscoveryRule()
    settings = SplitSettings(interval=args.round)
    t, node_seconds, last_change = 0.0, 0.0, -math.inf
    while any(job.finish is None for job in jobs):
        active = [j for j in jobs if j.arrival <= t and j.finish is None]
        if policy == "fixed":
            want = allocate_fixed(active, args.nodes, args)
        elif policy == "greedy":
            want = allocate_greedy(active, args.nodes, args)
        elif policy == "discover":
            want = allocate_discover(active, args.nodes, args, rule)
        else:
            want, by_choice = allocate_arbiter(active, args.nodes, args, settings, t,
                                               last_change)
            last_change = t if by_choice else last_change
        assert sum(want.values()) <= args.nodes
        for job in active:
            new = want[job.index]
            pause = 0.0
            if job.workers and new != job.workers:
                grow = "warm_grow" if policy in ("discover", "arbiter") else "cold_grow"
                pause = pauses[grow] if new > job.workers else pauses["shrink"]
            job.workers = new
            job.most_workers = max(job.most_workers, new)
            rate = job.goodput(new)
            start = max(t, job.arrival) + pause
            if rate > 0 and job.progress + rate * (t + args.round - start) >= job.work:
                job.finish = start + (job.work - job.progress) / rate
                node_seconds += new * (job.finish - t)
                job.workers, job.hosts = 0, ()
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
                        help="shortest job, on one worker")
    parser.add_argument("--max-job-hours", type=float, default=16.0, help="longest job, alike")
    parser.add_argument("--round", type=float, default=60.0, help="seconds per scheduling round")
    parser.add_argument("--greedy-max", type=int, default=4,
                        help="greedy jobs' --max-np as a multiple of what they requested")
    parser.add_argument("--seeds", default="0,1,2", help="traces to replay (comma-separated)")
    parser.add_argument("--curves", default=CURVES,
                        help="cluster_jobs.py's JSON, whose jobs' measured curves the trace's "
                             "jobs follow (default: benchmarks/results/cluster_jobs.json)")
    parser.add_argument("--json", default=None,
                        help="also write the table here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    for name in ("jobs", "nodes", "greedy_max"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.min_job_hours <= args.max_job_hours:
        parser.error("need 0 < --min-job-hours <= --max-job-hours, got "
                     f"{args.min_job_hours} and {args.max_job_hours}")
    try:
        curves = load_curves(args.curves)
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--curves: cannot read measured curves from {args.curves} ({e}); "
                     "run benchmarks/cluster_jobs.py --json cluster_jobs.json first")
    pauses = measured_pauses()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        for policy in POLICIES:
            rows.append(dict(simulate(policy, args, pauses, curves), seed=seed))
    print(f"{args.jobs} jobs on {args.nodes} nodes; pauses (s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in pauses.items()))
    for kind, curve in sorted(curves.items()):
        job = Job(0, 0.0, kind, curve, 1, 1.0, args.nodes)
        print(f"{kind}: speed-up " + ", ".join(
            f"{r}: {job.goodput(r) / job.goodput(1):.2f}" for r in (1, 2, 4, 8, 16, 64)
            if r <= args.nodes))
    print(f"{'seed':>4} {'policy':>9} {'avg_jct_h':>10} {'p99_jct_h':>10} {'node_hours':>11} "
          f"{'makespan_h':>11}")
    for r in rows:
        print(f"{r['seed']:>4} {r['policy']:>9} {r['avg_jct_h']:>10.2f} {r['p99_jct_h']:>10.2f} "
              f"{r['node_hours']:>11.1f} {r['makespan_h']:>11.2f}")
    mean = {policy: {key: float(np.mean([r[key] for r in rows if r["policy"] == policy]))
                     for key in ("avg_jct_h", "p99_jct_h")} for policy in POLICIES}
    for policy in ("discover", "arbiter"):
        cut = 1 - mean[policy]["avg_jct_h"] / mean["fixed"]["avg_jct_h"]
        print(f"{policy}: average JCT {100 * cut:.0f}% below fixed (goal >= 40%), p99 "
              f"{mean[policy]['p99_jct_h'] / mean['greedy']['p99_jct_h']:.2f} x greedy's "
              "(goal <= 1)")
    if args.json:
        import record
        record.write(args.json, {"jobs": args.jobs, "nodes": args.nodes, "pauses": pauses,
                                 "rows": rows, "round_s": args.round,
                                 "curves": {k: sorted(v.items()) for k, v in curves.items()}})
    return rows


if __name__ == "__main__":
    main()
