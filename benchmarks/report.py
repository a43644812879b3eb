"""Render benchmarks/RESULTS.md from the benchmarks' JSON under benchmarks/results/.

Every table in RESULTS.md comes from a JSON file a benchmark wrote (with its
command, the machine and the commit: ``record.py``), and the words around
it from ``benchmarks/results/notes/<section>.md``, so a table never drifts
from its data. ``--check`` exits 1 where the committed RESULTS.md differs
from what the JSON gives (a test runs it).

    python benchmarks/report.py            # rewrite RESULTS.md
    python benchmarks/report.py --check
"""
import argparse
import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
OUTPUT = os.path.join(HERE, "RESULTS.md")


def load(pattern):
    return [json.load(open(path)) for path in sorted(glob.glob(os.path.join(RESULTS_DIR, pattern)))]


def notes(section):
    path = os.path.join(RESULTS_DIR, "notes", f"{section}.md")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read().strip() + "\n"


def provenance(records):
    """The commands, commits, dates and machine of ``records``, as lines."""
    commands = sorted({r["command"] for r in records})
    commits = ", ".join(sorted({r["commit"] for r in records}))
    dates = ", ".join(sorted({r["date"] for r in records}))
    m = records[0]["machine"]
    machine = (f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Python "
               f"{m.get('python')}, torch {m.get('torch')}, Horovod {m.get('horovod')}")
    lines = ["```"] + commands + ["```", "", f"Commit {commits}; {dates}; {machine}."]
    return "\n".join(lines) + "\n"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def spread(values, digits=3):
    values = sorted(values)
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({values[0]:.{digits}f}-{values[-1]:.{digits}f})"


# -- sections ------------------------------------------------------------------------------
def overhead_section():
    records = load("overhead/*.json")
    if not records:
        return None
    parts = ["## Cost against plain Horovod: `overhead.py`\n", notes("overhead")]
    # Records from before the snapshot budget (every commit a snapshot) have no
    # snapshot_budget; those after it get a table of their own (budget, mean ratio).
    budgeted = [r for r in records if "snapshot_budget" in r["data"]]
    records = [r for r in records if "snapshot_budget" not in r["data"]]
    for measuring in (False, True):
        group = [r for r in records if r["data"]["measure_noise"] == measuring
                 and r["data"]["device"] != "cuda"]
        if not group:
            continue
        rows, keys = [], []
        # Rows apart by how often the hvd_adapt loop commits (a record's commit_every).
        measured = [(r["data"]["commit_every"], row) for r in group for row in r["data"]["rows"]]
        for every, row in measured:
            key = (row["model"], row["procs"], every)
            if key not in keys:
                keys.append(key)
        for model, procs, every in keys:
            found = [row for each, row in measured
                     if (row["model"], row["procs"], each) == (model, procs, every)]
            rows.append([model, procs, every,
                         f"{statistics.median(x['plain_ms'] for x in found):.2f}",
                         f"{statistics.median(x['hvd_adapt_ms'] for x in found):.2f}",
                         spread([x["ratio"] for x in found]), len(found),
                         f"{statistics.median(x['plain_mib'] for x in found):.0f}",
                         f"{statistics.median(x['hvd_adapt_mib'] for x in found):.0f}",
                         ledger_cell(found)])
        title = "measuring the noise scale (`--measure-noise`, as when autoscaling)" if measuring \
            else "not measuring the noise scale"
        goal = 1.05 if measuring else 1.03
        parts += [f"### {title}: goal <= {goal} at 2 processes\n",
                  table(["model", "procs", "commits every (steps)", "plain ms", "hvd_adapt ms",
                         "ratio: median (range) over invocations", "invocations", "plain MiB",
                         "hvd_adapt MiB", "ledger at the step: ms (share of a step)"], rows),
                  provenance(group)]
    if budgeted:
        parts += budget_table(budgeted)
    return "\n".join(parts)


def budget_table(records):
    """``overhead.py`` rows with a snapshot budget (``State(snapshot_budget=...)``): apart
    by budget, with the mean ratio (the loops' mean step times, the snapshots' steps
    included), which is what the budget bounds."""
    measured = [(r["data"]["commit_every"], r["data"]["snapshot_budget"], row)
                for r in records for row in r["data"]["rows"]]
    keys = []
    for every, budget, row in measured:
        if (row["model"], row["procs"], every, budget) not in keys:
            keys.append((row["model"], row["procs"], every, budget))
    rows = []
    for model, procs, every, budget in keys:
        found = [row for each, kept, row in measured
                 if (row["model"], row["procs"], each, kept) == (model, procs, every, budget)]
        rows.append([model, procs, every,
                     "none (every commit)" if budget is None else budget,
                     f"{statistics.median(x['plain_ms'] for x in found):.2f}",
                     f"{statistics.median(x['hvd_adapt_ms'] for x in found):.2f}",
                     spread([x["ratio"] for x in found]),
                     spread([x["mean_ratio"] for x in found]), len(found),
                     f"{statistics.median(x['plain_mib'] for x in found):.0f}",
                     f"{statistics.median(x['hvd_adapt_mib'] for x in found):.0f}"])
    return ["### committing every step, with the State's snapshot budget and without: goal "
            "<= 1.03 (mean ratio) at 2 processes\n",
            notes("overhead_budget"),
            table(["model", "procs", "commits every (steps)", "snapshot budget", "plain ms",
                   "hvd_adapt ms", "ratio: median (range) over invocations",
                   "mean ratio: median (range)", "invocations", "plain MiB", "hvd_adapt MiB"],
                  rows),
            provenance(records)]


def ledger_cell(rows):
    """The optimizer's check at the step (median ms, share of the hvd_adapt step), where the
    invocations timed it (overhead.py since the ledger)."""
    if not all("ledger_ms" in row for row in rows):
        return "-"
    return (f"{statistics.median(x['ledger_ms'] for x in rows):.3f} "
            f"({statistics.median(x['ledger_share'] for x in rows):.2%})")


def swap_section():
    records = load("optimizer_swap.json")
    if not records:
        return None
    data = records[0]["data"]
    gbps = data["disk_gbps"]

    def spread(values):
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    old = any("hidden" in r for r in data["runs"])
    disk_rows = []
    for kind in ("write", "read"):
        ratios = [s / r for s, r in zip(gbps[f"swap_{kind}"], gbps[f"raw_{kind}"])]
        disk_rows.append([kind, spread(gbps[f"raw_{kind}"]), spread(gbps[f"swap_{kind}"]),
                          spread(ratios), ">= 0.85"])
    parts = ["## Optimizer state on disk: `optimizer_swap.py`\n", notes("optimizer_swap"),
             f"Disk: {data['disk_bytes'] / 1e9:.2f} GB of AdamW state, {data['workers']} I/O "
             f"threads and 8 MiB requests on both sides, O_DIRECT, {data['rounds']} rounds "
             "interleaved; GB/s, median (range).\n",
             table(["", "raw GB/s", "swapper GB/s", "swapper / raw", "goal"], disk_rows),
             table(["state GB", "embedding share", "in memory s/step (4 micro-steps)",
                    "on disk s/step", "bound s",
                    "on disk / bound, median (range over job rounds) (goal <= 1.15)",
                    "floor / bound",
                    # Records before issue 43 measured the I/O hidden, later ones the floor.
                    "swap I/O hidden" if old else "on disk / floor (goal <= 1.1)",
                    "peak RSS in memory GB", "on disk GB",
                    "saved / state bytes (goal >= 0.9)"],
                   [[f"{r['state_gb']:.2f}", f"{r['embedding_share']:.2f}",
                     f"{r['memory_step_s']:.2f}", f"{r['swap_step_s']:.2f}",
                     f"{r['bound_s']:.2f}", spread(r["swap_over_bound_rounds"])
                     if "swap_over_bound_rounds" in r else f"{r['swap_over_bound']:.2f}",
                     spread(r["floor_over_bound_rounds"]) if "floor_over_bound_rounds" in r
                     else "-",
                     f"{r['hidden']:.2f}" if old else spread(r["swap_over_floor_rounds"]),
                     f"{r['memory_peak_bytes'] / 1e9:.2f}", f"{r['swap_peak_bytes'] / 1e9:.2f}",
                     f"{r['saved_over_state']:.2f}"] for r in data["runs"]]),
             default_memory(data.get("default_memory")),
             provenance(records)]
    return "\n".join(part for part in parts if part)


def default_memory(row):
    """The peak RSS saved at default settings (24 x Linear(1024, 1024), no swap_buffer_mb)."""
    if not row:
        return None
    saved = row["saved_over_state_rounds"]
    return (f"Memory at default settings ({row['layers']} x Linear(1024, 1024), AdamW state "
            f"{row['state_bytes'] / 1e6:.0f} MB, no `swap_buffer_mb`): peak RSS saved "
            f"{statistics.median(saved):.2f} ({min(saved):.2f}-{max(saved):.2f}) x the state "
            "(goal >= 0.7).\n")


SOAK_KINDS = {"mixed": "random resizes and SIGKILLs (rank 0, mid-accumulation)",
              "kill_after_sync": "the old worker killed right after a joining worker's sync",
              "poll_race": "a removal and an addition within one discovery poll",
              "kill_in_checkpoint": "rank 0 killed while writing a checkpoint (a folder per host)",
              "slow_join": "joining workers start 8 s late",
              "drain": "SIGTERM to horovodrun, commits 3 s apart, then a restart"}


def soak_section():
    records = {r["data"]["kind"]: r for r in load("soak/*.json")}
    if not records:
        return None
    rows = []
    for kind, what in SOAK_KINDS.items():
        if kind not in records:
            continue
        d = records[kind]["data"]
        recoveries = d.get("recovery_after_kill") or []
        if kind == "drain":
            detail = (f"SIGTERM to exit {min(d['signal_to_exit']):.2f}-"
                      f"{max(d['signal_to_exit']):.2f} s (SIGKILL at 5 s)")
        elif recoveries:
            fast = sum(r < 5 for r in recoveries)
            detail = (f"{len(recoveries)} kills: {fast} noticed within 5 s, "
                      f"{len(recoveries) - fast} at the Gloo timeout (max "
                      f"{max(recoveries):.1f} s)")
        else:
            detail = f"longest pause {max(d['pauses']):.1f} s"
        checks = []
        if d.get("restore_points_checked"):
            checks.append(f"{d['restore_points_checked']} restore points")
        if d.get("checkpoint_ages_checked"):
            checks.append(f"{d['checkpoint_ages_checked']} checkpoint ages")
        rows.append([f"`{kind}`", what, d["events"], d.get("resets", "-"), d["epochs"],
                     "0 lost, 0 doubled; totals exact; replicas identical" +
                     (", " + ", ".join(checks) if checks else ""), detail, "0",
                     f"{d['seconds']:.0f}"])
    parts = ["## Elastic soaks: `tests/support/soak.py`\n", notes("soak"),
             table(["kind", "what", "events", "resets", "epochs", "checked, all passed",
                    "timing", "hangs", "seconds"], rows),
             provenance(list(records.values()))]
    return "\n".join(parts)


def resize_section():
    records = load("resize_latency.json")
    if not records:
        return None
    data = records[0]["data"]
    rows = [[mode, p["from"], p["to"], f"{p['seconds']:.2f}"]
            for mode, pauses in data["modes"].items() for p in pauses]
    parts = ["## Pause per resize: `resize_latency.py`\n", notes("resize_latency"),
             f"Every worker sleeps {data['join_delay_s']:g} s before `init()`.\n",
             table(["mode", "from", "to", "pause s"], rows), provenance(records)]
    return "\n".join(parts)


# fault_recovery.py's faults whose goal is not a pause of at most 10 s.
FAULT_GOALS = {"cold_joiner": "joins", "launcher_cut_12": "0 kills, no pause but the outage's",
               "launcher_cut_30": "0 kills, no pause but the outage's",
               "launcher_killed": "every worker ended within 12 s",
               "solo_crash": "0 kills (the pause is rank 0's work)",
               "relaunch_refused": "<= 5 s per failed relaunch",
               "hosts_replaced": "<= 30 s from the first new host answering"}


def fault_section():
    # One file per invocation (fault_recovery*.json): faults measured apart add rows.
    records = load("fault_recovery*.json")
    if not records:
        return None
    rows = []
    for row in (row for record in records for row in record["data"]["rows"]):
        pauses = sorted(run["pause_s"] for run in row["runs"] if run["pause_s"] is not None)
        pause = (f"{statistics.median(pauses):.1f} ({pauses[0]:.1f}-{pauses[-1]:.1f})"
                 if pauses else "-")
        outcomes = ", ".join(sorted({run["outcome"] for run in row["runs"]}))
        # A cold joiner's pause is its whole start-up (20 s slow on purpose): it must join.
        goal = FAULT_GOALS.get(row["fault"], "<= 10 s")
        rows.append([row["fault"], row["config"], len(row["runs"]), pause, outcomes, goal])
    return "\n".join(["## What a host's failure costs: `fault_recovery.py`\n",
                      notes("fault_recovery"),
                      table(["fault (h3 of 3)", "configuration", "runs",
                             "survivors' pause s, median (min-max)", "outcome", "goal"], rows),
                      provenance(records)])


def discover_section():
    records = load("discover_latency.json")
    if not records:
        return None
    rows = []
    for install, runs in records[0]["data"]["runs_ms"].items():
        runs = sorted(runs)
        p90 = runs[min(len(runs) - 1, int(0.9 * len(runs)))]
        rows.append([install, records[0]["data"]["hosts"], len(runs),
                     f"{statistics.median(runs):.1f}", f"{p90:.1f}", f"{runs[-1]:.1f}",
                     "<= 50 ms"])
    return "\n".join(["## One run of `hvd-adapt-discover`: `discover_latency.py`\n",
                      notes("discover_latency"),
                      table(["install", "hosts", "runs", "median ms", "p90 ms", "max ms",
                             "goal"], rows),
                      provenance(records)])


def cluster_section():
    records = load("cluster_sim.json")
    if not records:
        return None
    data = records[0]["data"]
    rows = [[r["seed"], r["policy"], f"{r['avg_jct_h']:.2f}", f"{r['p99_jct_h']:.2f}",
             f"{r['node_hours']:.0f}", f"{r['makespan_h']:.2f}"] for r in data["rows"]]
    means = {}
    for r in data["rows"]:
        means.setdefault(r["policy"], []).append(r["avg_jct_h"])
    mean = {policy: statistics.mean(v) for policy, v in means.items()}
    if "arbiter" not in mean:       # recorded before the arbiter: rendered as it was then
        summary = (f"Average JCT over the traces: fixed {mean['fixed']:.2f} h, greedy "
                   f"{mean['greedy']:.2f} h, discover {mean['discover']:.2f} h: discover "
                   f"{100 * (1 - mean['discover'] / mean['fixed']):.0f}% below fixed (goal "
                   f">= 30%) and {mean['discover'] / mean['greedy']:.2f} x greedy's (goal < 1).\n")
        return _cluster_table(records, data, rows, summary)
    summary = ("Average JCT over the traces: " + ", ".join(
        f"{policy} {value:.2f} h" for policy, value in mean.items()) + ".")
    for policy, goal in (("discover", 30), ("arbiter", 40)):
        if policy in mean:
            p99 = {name: statistics.mean(r["p99_jct_h"] for r in data["rows"]
                                         if r["policy"] == name) for name in (policy, "greedy")}
            summary += (f" {policy}: {100 * (1 - mean[policy] / mean['fixed']):.0f}% below "
                        f"fixed (goal >= {goal}%), p99 {p99[policy] / p99['greedy']:.2f} x "
                        "greedy's.")
    summary += "\n"
    return _cluster_table(records, data, rows, summary)


def _cluster_table(records, data, rows, summary):
    pauses = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in data["pauses"].items())
    # Traces replayed on curves cluster_jobs.py measured carry them; earlier ones were on
    # workloads set by hand, which their own notes describe.
    described = notes("cluster_sim_measured" if "curves" in data else "cluster_sim")
    return "\n".join(["## A simulated cluster: `cluster_sim.py`\n", described,
                      f"{data['jobs']} jobs on {data['nodes']} nodes, rounds of "
                      f"{data['round_s']:g} s; resize pauses: {pauses}.\n",
                      table(["trace seed", "policy", "average JCT h", "p99 JCT h", "node-hours",
                             "makespan h"], rows), summary, provenance(records)])


def cluster_jobs_section():
    records = load("cluster_jobs.json")
    if not records:
        return None
    data = records[0]["data"]
    summary = data["summary"]
    names = list(summary["static"]["jobs_s"])
    kinds = {name: job["kind"] for name, job in data["rounds"][0]["jobs"].items()}
    rows = []
    for policy in [p for p in ("static", "greedy", "arbiter") if p in summary]:
        s = summary[policy]
        worst = max(s["jobs_s"][n] / summary["static"]["jobs_s"][n] for n in names)
        rows.append([policy] + [f"{s['jobs_s'][n]:.0f}" for n in names]
                    + [f"{s['average_s']:.0f}", f"{s['makespan_s']:.0f}",
                       f"{s['average_s'] / summary['static']['average_s']:.2f}", f"{worst:.2f}"])
    header = (["policy"] + [f"{n} ({kinds[n]}) s" for n in names]
              + ["average s", "makespan s", "average / static", "worst job / static"])
    return "\n".join(["## Jobs sharing a pool: `cluster_jobs.py`\n", notes("cluster_jobs"),
                      f"Jobs {data['jobs']} arriving at {data['arrivals']} s on "
                      f"{data['hosts']} namespace hosts"
                      + "".join(f"; {kind}'s accelerator {seconds} s per sample"
                                for kind, seconds in data.get("sample_seconds", {}).items())
                      + "; goals: the arbiter's average <= 0.8 "
                      "x the static split's, no job over 1.1 x its static time.\n",
                      table(header, rows), provenance(records)])


def time_to_accuracy_section():
    records = load("time_to_accuracy/*.json")
    if not records:
        return None
    sys.path.insert(0, HERE)
    import numpy as np
    import time_to_accuracy
    parts = ["## Time to accuracy: `time_to_accuracy.py`\n", notes("time_to_accuracy")]
    for record in records:
        data = record["data"]
        workload = time_to_accuracy.resolve({"workload": data["workload"],
                                             "overrides": data.get("overrides", {})})
        # Fixed batches smallest first, the adaptive run last.
        names = sorted(data["runs"], key=lambda n: (n == "adaptive", len(n), n))
        rows = []
        for target, times, ratios in time_to_accuracy.rows(workload, data["runs"]):
            cells = [f"{np.median(times[n]):.1f} [{min(times[n]):.1f}-{max(times[n]):.1f}]"
                     for n in names]
            rows.append([target] + cells + [f"{r:.2f}" for r in ratios])
        better = "higher" if workload.higher_is_better else "lower"
        parts += [f"### {data['workload']}, {data['procs']} process(es): seconds of training "
                  f"to each {workload.metric} target ({better} is better), median [min-max] over "
                  f"{len(data['runs'][names[0]])} seeds\n",
                  table(["target"] + names + ["adaptive / best fixed", "adaptive / median fixed"],
                        rows), provenance([record])]
    return "\n".join(parts)


def goodput_section():
    records = load("goodput_optimize.json")
    if not records:
        return None
    rows = [[r["replicas"], r["nodes"], f"{r['latency_ms']:.3f}", r["batch"], r["accumulation"]]
            for r in records[0]["data"]["rows"]]
    return "\n".join(["## `GoodputFunction.optimize` latency: `goodput_optimize.py`\n",
                      notes("goodput_optimize"),
                      table(["replicas", "nodes", "latency ms (goal < 5)", "batch",
                             "accumulation"], rows), provenance(records)])


def gpu_section():
    records = load("gpu_check.json")
    if not records:
        return None
    data = records[0]["data"]
    rows = [[r["model"], r["procs"], f"{r['plain_ms']:.2f}", f"{r['hvd_adapt_ms']:.2f}",
             f"{r['ratio']:.3f}"] for r in data["rows"]]
    m = records[0]["machine"]
    return "\n".join([
        "## On a GPU: `scripts/gpu_check.sh`\n", notes("gpu_check"),
        f"Tests marked `gpu`: {data['tests']}.\n",
        table(["model", "procs", "plain ms", "hvd_adapt ms", "ratio"], rows),
        "```\n" + records[0]["command"] + "\n```\n",
        f"Commit {records[0]['commit']}; {records[0]['date']}; {data['device']}, "
        f"{m['cores']} cores, torch {m.get('torch')}, Horovod {m.get('horovod')} "
        f"(NCCL {data['nccl']}).\n"])


SECTIONS = [overhead_section, time_to_accuracy_section, swap_section, soak_section,
            resize_section, fault_section, discover_section, cluster_jobs_section,
            cluster_section, goodput_section, gpu_section]


def render():
    body = [section() for section in SECTIONS]
    head = notes("head") or "# Benchmark results\n"
    return "\n".join([head] + [b for b in body if b]).rstrip() + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 where RESULTS.md differs from what the JSON gives")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(OUTPUT) as f:
            current = f.read()
        if current != text:
            print("benchmarks/RESULTS.md differs from benchmarks/results/: run "
                  "python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    with open(OUTPUT, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
