"""Real elastic jobs sharing a pool of hosts: a static equal split, greedy, and the arbiter.

The jobs of ``--jobs`` (``kind:epochs`` each, arriving ``--arrivals``
seconds after the first) run on a namespace cluster of this machine
(tests/support/bed.py: four pool hosts with real sshd, the launchers and the
arbiter on a fifth) under three policies, one after the other:

- ``static``: the pool split as evenly as it goes by hand (4 hosts, 3 jobs:
  2, 1, 1), each job on its share for its whole life (``-np`` and
  ``--initial-np`` its share under every policy);
- ``greedy``: every job offered every host (``hvd-adapt-discover`` without
  hints: every host that answers): the jobs overlap on hosts and take turns
  on their accelerators;
- ``arbiter``: ``hvd-adapt-discover --arbiter`` and ``hvd-adapt-arbiter``.

The hosts share this machine's cores, so each host's accelerator is a
per-sample sleep holding a lock of that host's own, beside a real small
model (tests/support/pool.py: ``scales`` nearly doubles its goodput with a
second worker; ``comm`` is bound by its allreduce). The figures measure
allocation, not the sharing of cores; a loaded machine slows every policy.
Each job's completion time is from its arrival to its launcher's exit; the
table gives every job's, their average and the makespan, and the ratios
against the static split run in the same invocation. Each job's speed-up
curve as its own model fitted it (the hints it published last, under the
arbiter: the most worlds timed) is recorded for ``cluster_sim.py``.

Needs root (network namespaces), as tests/cluster does.

    python benchmarks/cluster_jobs.py [--jobs scales:30,comm:8,scales:15] [--arrivals 0,10,20] \\
        [--sample-seconds scales=0.3] [--rounds 1] [--json cluster_jobs.json]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support import bed as cluster  # noqa: E402  (tests/support/: the namespace cluster)
from support import pool  # noqa: E402

POLICIES = ("static", "greedy", "arbiter")
SAMPLES = 96
# The arbiter at the time scale of these jobs (minutes, not hours): changes by choice at
# most every 20 s, a job gone after 15 s of silence.
ARBITER = ("--change-interval", "20", "--gone-after", "15")


def run_policy(bed, policy, specs, arrivals, top, timeout, sample_seconds=None):
    """Run the jobs under ``policy``; ``{job: completion seconds}`` and their curves.
    ``sample_seconds``: ``{kind: seconds}``, each sample's "accelerator" time for that kind
    where it is not the kind's own (tests/support/pool.py)."""
    sample_seconds = sample_seconds or {}
    folder = os.path.join(top, policy)
    os.makedirs(folder)
    shares = static_shares(len(specs))
    hostfile = pool.write_hostfile(os.path.join(folder, "pool"), pool.POOL)
    arbiter = None
    if policy == "arbiter":
        arbiter = pool.start_arbiter(bed, os.path.join(folder, "arbiter"), hostfile, *ARBITER)
    jobs = [pool.PoolJob(f"j{i}", kind, os.path.join(folder, f"j{i}"), SAMPLES, epochs)
            for i, (kind, epochs) in enumerate(specs)]
    start = time.time()
    submitted = {}
    try:
        def launch_due():
            for index, job in enumerate(jobs):
                if job.name not in submitted and time.time() - start >= arrivals[index]:
                    share = len(shares[index])
                    if policy == "static":
                        script = pool.static_discovery(job, shares[index])
                    elif policy == "greedy":
                        script = pool.greedy_discovery(job, hostfile, initial_np=share)
                    else:
                        script = pool.arbiter_discovery(job, os.path.join(folder, "arbiter"),
                                                        initial_np=share)
                    extra = (["--sample-seconds", str(sample_seconds[job.kind])]
                             if job.kind in sample_seconds else [])
                    job.start(bed, script, np=share, worker_args=extra)
                    submitted[job.name] = time.time()
        while len(submitted) < len(jobs):
            launch_due()
            time.sleep(0.5)
        finished = pool.wait_all(jobs, timeout)
    finally:
        pool.stop_all(bed, jobs, arbiter)
    failed = [job.name for job in jobs if job.returncode != 0]
    if not finished or failed:
        tails = "\n".join(f"--- {job.name}:\n{job.output()[-3000:]}" for job in jobs)
        raise RuntimeError(f"{policy}: jobs {failed or 'timed out'}\n{tails}")
    overlaps = pool.shared_hosts(jobs) if policy != "greedy" else []
    if overlaps:
        raise RuntimeError(f"{policy}: hosts ran two jobs' workers at once: {overlaps}")
    result = {}
    for job in jobs:
        with open(job.hints) as f:
            hints = json.load(f)
        result[job.name] = {"kind": job.kind, "epochs": job.epochs,
                            "seconds": job.ended - submitted[job.name],
                            "timed": hints["replica_counts_timed"],
                            "curve": [[e["replicas"], e["goodput"]] for e in hints["curve"]],
                            "sizes": sorted({c["size"] for c in pool.rank0_commits(job)})}
    return result


def static_shares(jobs):
    """The pool split as evenly as it goes, in arrival order (4 hosts, 3 jobs: 2, 1, 1); a
    job beyond the pool's size shares the last host."""
    base, extra = divmod(len(pool.POOL), jobs)
    shares, start = [], 0
    for index in range(jobs):
        size = max(1, base + (index < extra))
        shares.append(pool.POOL[start:start + size] or pool.POOL[-1:])
        start += size
    return shares


def summarize(rows):
    by_policy = {}
    for row in rows:
        by_policy.setdefault(row["policy"], []).append(row)
    summary = {}
    for policy, runs in by_policy.items():
        averages = [statistics.mean(j["seconds"] for j in r["jobs"].values()) for r in runs]
        makespans = [max(j["seconds"] + r["arrivals"][int(name[1:])]
                         for name, j in r["jobs"].items()) for r in runs]
        per_job = {name: statistics.median(r["jobs"][name]["seconds"] for r in runs)
                   for name in runs[0]["jobs"]}
        summary[policy] = {"average_s": statistics.median(averages),
                           "makespan_s": statistics.median(makespans), "jobs_s": per_job}
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="scales:30,comm:8,scales:15",
                        help="kind:epochs of each job, comma-separated (kinds: "
                             f"{', '.join(pool.KINDS)})")
    parser.add_argument("--sample-seconds", default="",
                        help="kind=seconds,...: each sample's accelerator time for a kind, "
                             "instead of the kind's own (e.g. scales=0.3: the model's CPU work "
                             "then weighs less beside the accelerator on this machine's cores)")
    parser.add_argument("--arrivals", default=None,
                        help="seconds after the first job each job arrives (default: all at 0)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every policy, in alternating order (medians reported)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a policy's jobs may take in all")
    parser.add_argument("--json", default=None,
                        help="also write the results here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    specs = []
    for item in args.jobs.split(","):
        kind, _, epochs = item.partition(":")
        if kind not in pool.KINDS or not epochs.isdigit() or int(epochs) < 1:
            parser.error(f"--jobs: each job is kind:epochs with a kind of "
                         f"{', '.join(pool.KINDS)} and epochs >= 1, got {item!r}")
        specs.append((kind, int(epochs)))
    sample_seconds = {}
    for item in filter(None, args.sample_seconds.split(",")):
        kind, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if kind not in pool.KINDS or not 0 < value <= 10:
            parser.error(f"--sample-seconds: each item is kind=seconds with a kind of "
                         f"{', '.join(pool.KINDS)} and 0 < seconds <= 10, got {item!r}")
        sample_seconds[kind] = value
    arrivals = [0.0] * len(specs) if args.arrivals is None else \
        [float(a) for a in args.arrivals.split(",")]
    if len(arrivals) != len(specs) or any(not 0 <= a < 1e6 for a in arrivals):
        parser.error(f"--arrivals must give {len(specs)} numbers >= 0, got {args.arrivals!r}")
    policies = args.policies.split(",")
    if not set(policies) <= set(POLICIES) or "static" not in policies:
        parser.error(f"--policies must be among {', '.join(POLICIES)} and include static "
                     f"(the baseline), got {args.policies!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    reason = cluster.missing()
    if reason:
        sys.exit(f"cluster_jobs.py: {reason}")
    top = tempfile.mkdtemp(prefix="hvd_adapt_cluster_jobs_")
    rows = []
    try:
        with cluster.Bed(5, ssh_options=cluster.KEEPALIVE, root=top) as bed:
            for round_index in range(args.rounds):
                order = policies if round_index % 2 == 0 else policies[::-1]
                for policy in order:
                    print(f"round {round_index + 1}: {policy} ...", flush=True)
                    jobs = run_policy(bed, policy, specs, arrivals,
                                      os.path.join(top, f"r{round_index}"), args.timeout,
                                      sample_seconds)
                    rows.append({"policy": policy, "round": round_index, "arrivals": arrivals,
                                 "jobs": jobs})
                    print("  " + ", ".join(f"{name} ({j['kind']}) {j['seconds']:.0f} s on "
                                           f"{j['sizes']}" for name, j in jobs.items()),
                          flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    summary = summarize(rows)
    static = summary["static"]
    names = list(static["jobs_s"])
    print(f"\n{len(specs)} jobs ({args.jobs}) on {len(pool.POOL)} hosts, arrivals "
          f"{arrivals}; medians of {args.rounds} round(s)")
    print(f"{'policy':>8} " + " ".join(f"{n + ' s':>9}" for n in names)
          + f" {'average s':>10} {'makespan s':>11} {'avg/static':>11} {'worst job/static':>17}")
    for policy in policies:
        s = summary[policy]
        worst = max(s["jobs_s"][n] / static["jobs_s"][n] for n in names)
        print(f"{policy:>8} " + " ".join(f"{s['jobs_s'][n]:>9.0f}" for n in names)
              + f" {s['average_s']:>10.0f} {s['makespan_s']:>11.0f}"
              f" {s['average_s'] / static['average_s']:>11.2f} {worst:>17.2f}")
    if "arbiter" in summary:
        s = summary["arbiter"]
        worst = max(s["jobs_s"][n] / static["jobs_s"][n] for n in names)
        print(f"arbiter: average JCT {s['average_s'] / static['average_s']:.2f} x the static "
              f"split's (goal <= 0.8), worst job {worst:.2f} x its static time (goal <= 1.1)")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import record
        record.write(args.json, {"jobs": args.jobs, "arrivals": arrivals, "hosts": len(pool.POOL),
                                 "sample_seconds": sample_seconds,
                                 "rounds": rows, "summary": summary, "arbiter_flags": ARBITER})
    return summary


if __name__ == "__main__":
    main()
