"""What one host's failure, or the launcher's, costs an elastic job on the namespace cluster.

Builds three network-namespace hosts with an sshd each and a fourth for the
launcher (h0; root needed; ssh without keepalive, as ssh's defaults have it,
unless ``--ssh-keepalive``), runs tests/support/faults.py's 3-host job (elastic
horovodrun on h0 over real ssh to h1, h2, h3; AdamW, a GradScaler,
autoscaling) and injects a fault once the job has committed 6 steps. Per
fault and configuration, over ``--runs`` runs: the survivors' pause (the
longest time without a commit from the fault on: for a failure, until the
survivors commit again; for the cold joiner, the grow's), median and range,
and how the job ended, with the workers its watchdogs and discovery ended
("kills"). The faults of h3: ``crash_*`` (every process killed), ``partition_*``
(its link down, no reset), each with discovery dropping it or still listing
it, ``sigstop`` (its training process stopped for good), ``cold_joiner`` (h3
added with a worker 20 s slow to start). The launcher's and a busy rank's:

- ``launcher_cut_12``, ``launcher_cut_30``: h0's link down for 12 s or 30 s
  (the workers still reach each other); the pause is the longest from the cut
  to 5 s past the heal; goal: no kill, no pause beyond the outage's own
  (plain Horovod: none);
- ``launcher_killed``: horovodrun SIGKILLed; the outcome says when the last
  worker ended (goal: within 12 s; plain Horovod's train on as orphans);
- ``solo_crash``: rank 0 computes alone for 30 s (an evaluation) and the last
  rank's host crashes 5 s into it, discovery still listing it; goal: rank 0
  never killed (the pause is its work, as in plain Horovod);
- ``relaunch_refused``: h3 crashed and still listed by a plain discovery with
  the default timeouts: after each blacklist cooldown (7 s here) the driver
  relaunches there and ssh is refused; the pause is the longest one after the
  survivors first trained at 2 (each failed relaunch's), goal <= 5 s.

- ``hosts_replaced``: every host of a 2-host job crashes mid-epoch and a new
  one, h4, comes up (a bed of 4 hosts); ``hvd_adapt`` runs under
  ``hvd-adapt-run``, which launches the job again from its checkpoint (the
  anchors have no supervisor); the pause is from the first new host
  answering to the job's first commit on it.

Configurations, in the same invocation and on the same bed:

- ``hvd_adapt``: this tree, with ``hvd-adapt-discover`` wrapping the host
  list (workers meet before Gloo; Gloo timeout 5 s; the sshd probe ends a
  lost host's sessions);
- ``before``: hvd_adapt before the fault work (``--before-tree``, a checkout
  of 570b1ba~1; Gloo timeout 60 s, no meeting), with its own
  ``hvd-adapt-discover``;
- ``horovod``: the same with Horovod's default Gloo timeout (30 s) and a
  plain discovery script (the host list), as a plain ``hvd.elastic.run``
  job has it.

The anchors (``before``, ``horovod``) may run fewer times and for less
(``--anchor-runs``, ``--anchor-after-fault``): where they hang, the outcome
says "not done N s after the fault".

    python benchmarks/fault_recovery.py --before-tree /tmp/before-src [--runs 3]
        [--faults partition_dropped partition_listed] [--configs hvd_adapt before horovod]
        [--anchor-runs 1] [--anchor-after-fault 60] [--json fault_recovery.json]

The launcher's rows (hvd_adapt and plain Horovod)::

    python benchmarks/fault_recovery.py --before-tree /tmp/before-src --configs hvd_adapt horovod \
        --faults launcher_cut_12 launcher_cut_30 launcher_killed solo_crash relaunch_refused \
        --anchor-runs 1 --json fault_recovery_launcher.json

Each invocation's ``--json`` file (``fault_recovery*.json`` under
benchmarks/results) adds its rows to RESULTS.md's table.
"""
import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support import bed as cluster  # noqa: E402  (tests/support/: the namespace cluster)
from support import faults  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py, beside this script)


def cold_joiner(bed, job):
    job.set_hosts(faults.ALL)


def sigstop(bed, job):
    """h3's training process stopped for good (SIGSTOP), discovery still listing h3."""
    bed.stop(faults.worker_pid(bed, "h3"))


def launcher_cut(seconds):
    def inject(bed, job):
        faults.launcher_cut_off(bed, job, outages=(seconds,))
    return inject


def launcher_killed(bed, job):
    """horovodrun SIGKILLed once the job has trained a while."""
    faults.kill_launcher(bed, job)


# A lost host's blacklist outlasts hvd-adapt-discover's FREEZE_AFTER_END (docs/elastic.md).
COOLDOWN = ["--blacklist-cooldown-range", "7", "10"]
# One entry per fault: what is injected, and how the job differs from the default one.
FAULTS = {
    "crash_dropped": (faults.crash_dropped, {}),
    "crash_listed": (faults.crash_listed, {"env": {"HVD_ADAPT_START_TIMEOUT_SECONDS": "10"}}),
    "partition_dropped": (faults.partition_dropped, {"launcher_args": COOLDOWN}),
    "partition_listed": (faults.partition_listed, {"launcher_args": COOLDOWN}),
    "cold_joiner": (cold_joiner, {"hosts": ["h1:1", "h2:1"], "np": 2,
                                  "worker_args": ["--slow-join", "20"]}),
    "sigstop": (sigstop, {}),
    # Every host replaced mid-epoch: h2 and h3 crash, h4 (down until then) is offered; the
    # job resumes from its checkpoint under hvd-adapt-run (the anchors have no supervisor).
    "hosts_replaced": (faults.replace_all_hosts, {"hosts": ["h2:1", "h3:1"], "np": 2,
                                                  "replacement": True}),
    # The job trains on through the outage and beyond: it is stopped 40 s after the fault.
    "launcher_cut_12": (launcher_cut(12), {"epochs": 10 ** 6}),
    "launcher_cut_30": (launcher_cut(30), {"epochs": 10 ** 6}),
    "launcher_killed": (launcher_killed, {"epochs": 10 ** 6}),
    "solo_crash": (faults.solo_work_then_crash, {"epochs": 4,
                                                 "worker_args": ["--solo-work", "[8, 30]"]}),
    # Cooldowns of 7 s: the relaunches come apart, so that each pause is one relaunch's.
    "relaunch_refused": (faults.crash_listed, {"epochs": 6, "launcher_args":
                                               ["--blacklist-cooldown-range", "6", "7"]}),
}
# Faults whose job never ends by itself: the run ends this long after the fault.
ENDLESS = {"launcher_cut_12": 12 + 20, "launcher_cut_30": 30 + 20}
# Faults whose job runs with the plain host list in every configuration (what is measured is
# the workers' side of a relaunch the discovery lets happen).
PLAIN_DISCOVERY = {"solo_crash", "relaunch_refused"}


def config_env(name, before_tree):
    if name == "hvd_adapt":
        return {"PYTHONPATH": ROOT}
    if before_tree is None:
        raise SystemExit(f"configuration {name!r} needs --before-tree (a checkout of "
                         "570b1ba~1, before the fault work)")
    env = {"PYTHONPATH": os.path.abspath(before_tree)}
    if name == "horovod":
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = "30"
    return env


def resumed_after_answer(job):
    """Seconds from the first new host answering to the job's first commit after it (None
    where it never committed again)."""
    answered = getattr(job, "answered", None)
    after = sorted(e["time"] for e in job.commits if answered and e["time"] > answered)
    return after[0] - answered if after else None


def kills(output):
    """Workers ended by their watchdogs (this tree's words, and the tree before's) and hosts
    whose sessions hvd-adapt-discover ended, as the launcher's output tells."""
    return (output.count("ending the worker") + output.count("killing the worker")
            + output.count("ending the job's"))


def pause_after_first_world_of_two(job):
    """The longest time without a commit after the survivors first committed at 2 (the
    failed relaunches' pauses), or None."""
    times = sorted({entry["time"] for entry in job.commits if entry["time"] > job.fault_time})
    at_two = [entry["time"] for entry in job.commits
              if entry["time"] > job.fault_time and entry["size"] == 2]
    times = [t for t in times if at_two and t >= min(at_two)]
    return max((b - a for a, b in zip(times, times[1:])), default=None)


def pause_around_outage(job, after=5.0):
    """The longest time without a commit from the launcher's cut to ``after`` s past its
    heal (the outage's own cost; later pauses are the loaded machine's), or None."""
    cut, healed = job.outages[0]
    times = sorted({entry["time"] for entry in job.commits
                    if cut < entry["time"] <= healed + after})
    return max((b - a for a, b in zip([cut] + times, times + [healed + after])),
               default=None) if times else None


def one_run(bed, fault, config, env, folder, after_fault):
    inject, options = FAULTS[fault]
    options = dict(options)
    env = {**options.pop("env", {}), **env}
    out_dir = tempfile.mkdtemp(dir=folder)
    replacement = options.pop("replacement", False)
    if replacement:
        bed.crash("h4")
        options["worker_args"] = ["--checkpoint", os.path.join(out_dir, "job.pt")]
        if config == "hvd_adapt":
            options["prefix"] = [sys.executable, "-m", "hvd_adapt.scheduling.job_supervisor",
                                 "--lock", os.path.join(out_dir, "job.lock"), "--"]
    if fault in ENDLESS:
        after_fault = ENDLESS[fault]
    job = faults.run_fault(bed, out_dir, inject, env=env, after_fault=after_fault,
                           wrapped_discovery=config != "horovod" and fault not in PLAIN_DISCOVERY,
                           **options)
    try:
        if replacement:
            stall = resumed_after_answer(job)
        elif fault == "relaunch_refused":
            stall = pause_after_first_world_of_two(job)
        elif fault in ENDLESS:
            stall = pause_around_outage(job)
        else:
            stall = job.longest_pause()
        if fault == "launcher_killed":
            outcome = (f"{len(job.left)} worker(s) train on as orphans" if job.left else
                       f"every worker ended {job.ended_after:.1f} s after")
            stall = None
        elif job.returncode == 0 or (fault in ENDLESS and job.returncode == "timeout"):
            outcome = "trained"
        elif job.returncode == "timeout":
            outcome = f"not done {after_fault:g} s after the fault"
        else:
            outcome = f"died (exit {job.returncode})"
        return stall, f"{outcome}, {kills(job.output)} kill(s)"
    finally:
        for host in ("h2", "h3", "h4") if replacement else \
                (getattr(job, "crashed", None) or "h3",):
            bed.heal(host)
        bed.heal(bed.launcher)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", nargs="+", choices=sorted(FAULTS), default=sorted(FAULTS))
    parser.add_argument("--configs", nargs="+", choices=("hvd_adapt", "before", "horovod"),
                        default=["hvd_adapt", "before", "horovod"])
    parser.add_argument("--before-tree", default=None,
                        help="a checkout of 570b1ba~1 (hvd_adapt before the fault work), "
                             "for the 'before' and 'horovod' configurations")
    parser.add_argument("--after-fault", type=float, default=200,
                        help="seconds a job may take after its fault before it is stopped")
    parser.add_argument("--anchor-runs", type=int, default=None,
                        help="runs of the 'before' and 'horovod' configurations (default "
                             "--runs)")
    parser.add_argument("--anchor-after-fault", type=float, default=None,
                        help="--after-fault of the 'before' and 'horovod' configurations "
                             "(default --after-fault)")
    parser.add_argument("--ssh-keepalive", action="store_true",
                        help="ssh with ServerAliveInterval 2 and ServerAliveCountMax 3 "
                             "(docs/elastic.md), as the fallback without hvd-adapt-discover")
    parser.add_argument("--json", default=None,
                        help="also record the runs under benchmarks/results/ (RESULTS.md)")
    args = parser.parse_args()
    for name in ("runs", "anchor_runs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("after_fault", "anchor_after_fault"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, "
                         f"got {getattr(args, name)}")
    reason = cluster.missing()
    if reason:
        raise SystemExit(f"fault_recovery.py: {reason}")
    folder = tempfile.mkdtemp(prefix="hvd_adapt_fault_recovery_")
    rows = []
    print(f"{'fault':15} {'configuration':10} {'pause s: median (min-max)':28} outcomes")
    keepalive = cluster.KEEPALIVE if args.ssh_keepalive else None
    hosts = 4 if "hosts_replaced" in args.faults else 3
    with cluster.Bed(hosts, ssh_options=keepalive, root=folder, launcher=True) as bed:
        for fault in args.faults:
            for name in args.configs:
                env = config_env(name, args.before_tree)
                anchor = name != "hvd_adapt"
                runs = (args.anchor_runs or args.runs) if anchor else args.runs
                after_fault = ((args.anchor_after_fault or args.after_fault) if anchor
                               else args.after_fault)
                results = [one_run(bed, fault, name, env, folder, after_fault)
                           for _ in range(runs)]
                stalls = [s for s, _ in results if s is not None]
                pause = (f"{statistics.median(stalls):.1f} ({min(stalls):.1f}-{max(stalls):.1f})"
                         if stalls else "-")
                outcomes = ", ".join(sorted({o for _, o in results}))
                print(f"{fault:15} {name:10} {pause:28} {outcomes}", flush=True)
                rows.append({"fault": fault, "config": name,
                             "runs": [{"pause_s": s, "outcome": o} for s, o in results]})
                if args.json:    # after every row: a long invocation cut short keeps its rows
                    record.write(args.json, {"rows": rows, "after_fault_s": args.after_fault,
                                             "anchor_after_fault_s": args.anchor_after_fault,
                                             "ssh_keepalive": args.ssh_keepalive})


if __name__ == "__main__":
    main()
