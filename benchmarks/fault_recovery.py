"""What one host's failure costs a 3-host elastic job, on the namespace cluster of tests/cluster.

Builds three network-namespace hosts with an sshd each (root needed), runs
tests/cluster/faults.py's job (elastic horovodrun on h1 over real ssh to
h1, h2, h3; AdamW, a GradScaler, autoscaling) and injects a fault in h3 once
the job has committed 6 steps (``sigstop``: h3's training process is
stopped, as a hung worker). Per fault and configuration, over ``--runs``
runs: the survivors' pause (fault to their next commit), median and range,
and how the job ended. Configurations, in the same invocation and on the
same bed:

- ``hvd_adapt``: this tree (workers meet before Gloo; Gloo timeout 5 s);
- ``before``: the main branch's hvd_adapt (``--before-tree``, a checkout of
  it; Gloo timeout 60 s, no meeting);
- ``horovod``: the same with Horovod's default Gloo timeout (30 s), as a
  plain ``hvd.elastic.run`` job has it.

    python benchmarks/fault_recovery.py --before-tree /tmp/main-src [--runs 3]
        [--faults crash_dropped crash_listed sigstop] [--configs hvd_adapt before horovod]
        [--json fault_recovery.json]

Each invocation's ``--json`` file (``fault_recovery*.json`` under
benchmarks/results) adds its rows to RESULTS.md's table.
"""
import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))

import bed as cluster  # noqa: E402
import faults  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py, beside this script)


def crash_dropped(bed, job):
    job.set_hosts(["h1:1", "h2:1"])
    bed.crash("h3")


def crash_listed(bed, job):
    bed.crash("h3")


def sigstop(bed, job):
    """h3's training process stopped for good (SIGSTOP), discovery still listing h3."""
    bed.stop(faults.worker_pid(bed, "h3"))


FAULTS = {"crash_dropped": crash_dropped, "crash_listed": crash_listed, "sigstop": sigstop}


def config_env(name, before_tree):
    if name == "hvd_adapt":
        return {"PYTHONPATH": ROOT}
    if before_tree is None:
        raise SystemExit(f"configuration {name!r} needs --before-tree (a checkout of main)")
    env = {"PYTHONPATH": os.path.abspath(before_tree)}
    if name == "horovod":
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = "30"
    return env


def one_run(bed, fault, env, folder, after_fault):
    job = faults.run_fault(bed, tempfile.mkdtemp(dir=folder), FAULTS[fault], env=env,
                           after_fault=after_fault)
    try:
        stall = job.stall()
        if job.returncode == 0:
            outcome = "trained"
        elif job.returncode == "timeout":
            outcome = f"not done {after_fault} s after the fault"
        else:
            outcome = f"died (exit {job.returncode})"
        return stall, outcome
    finally:
        bed.heal("h3")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", nargs="+", choices=sorted(FAULTS), default=sorted(FAULTS))
    parser.add_argument("--configs", nargs="+", choices=("hvd_adapt", "before", "horovod"),
                        default=["hvd_adapt", "before", "horovod"])
    parser.add_argument("--before-tree", default=None,
                        help="a checkout of the main branch, for the 'before' and 'horovod' "
                             "configurations")
    parser.add_argument("--after-fault", type=float, default=200,
                        help="seconds a job may take after its fault before it is stopped")
    parser.add_argument("--json", default=None,
                        help="also record the runs under benchmarks/results/ (RESULTS.md)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    reason = cluster.missing()
    if reason:
        raise SystemExit(f"fault_recovery.py: {reason}")
    folder = tempfile.mkdtemp(prefix="hvd_adapt_fault_recovery_")
    rows = []
    print(f"{'fault':15} {'configuration':10} {'pause s: median (min-max)':28} outcomes")
    with cluster.Bed(3, ssh_options=cluster.KEEPALIVE, root=folder) as bed:
        for fault in args.faults:
            for name in args.configs:
                env = config_env(name, args.before_tree)
                results = [one_run(bed, fault, env, folder, args.after_fault)
                           for _ in range(args.runs)]
                stalls = [s for s, _ in results if s is not None]
                pause = (f"{statistics.median(stalls):.1f} ({min(stalls):.1f}-{max(stalls):.1f})"
                         if stalls else "-")
                outcomes = ", ".join(sorted({o for _, o in results}))
                print(f"{fault:15} {name:10} {pause:28} {outcomes}", flush=True)
                rows.append({"fault": fault, "config": name,
                             "runs": [{"pause_s": s, "outcome": o} for s, o in results]})
    if args.json:
        record.write(args.json, {"rows": rows, "after_fault_s": args.after_fault})


if __name__ == "__main__":
    main()
