"""The benchmarks: smoke runs at tiny sizes, the digits workload's fresh draws, the table's ratios."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The last phase of scripts/test.sh, two at a time: the smoke runs check what they print, not
# how fast, but they are the suite's heaviest CPU users, and beside the other jobs they made
# the first phase longer than they take on their own.
pytestmark = pytest.mark.smoke


def bench(name, *args, timeout=120):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name)] + list(args),
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_goodput_optimize():
    out = bench("goodput_optimize.py", "--repeats", "3")
    assert re.search(r"^max_latency_ms=[0-9.]+", out, re.M)
    assert len(re.findall(r"^ +\d+ +\d+ +[0-9.]+", out, re.M)) == 11


@pytest.mark.distributed
def test_overhead():
    # One model: each model is 6 launches (both loops, and each loop's memory alone, at 1
    # and 2 processes), and a second model goes through the same code.
    out = bench("overhead.py", "--model", "mlp-small", "--steps", "10", "--warmup", "2",
                "--rounds", "1", timeout=300)
    assert re.search(r"^overhead_ratio=[0-9.]+", out, re.M)
    rows = re.findall(r"^ *(mlp-\S+) +(\d) +1 +[0-9.]+ +[0-9.]+ +([0-9.]+) +([0-9.]+)-([0-9.]+) +[0-9.]+ "
                      r"+\d+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$", out, re.M)  # ... ledger ms, share
    assert [row[:2] for row in rows] == [("mlp-small", "1"), ("mlp-small", "2")], out
    # The interval holds the median ratio.
    assert all(float(low) <= float(ratio) <= float(high) for *_, ratio, low, high in rows), out


def test_overhead_refuses_rounds_that_would_time_no_step():
    # With fewer steps than rounds each block timed nothing: a row of nan and
    # "overhead_ratio=0.000", exit 0 (found by an attacker).
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "overhead.py"),
                           "--model", "mlp-small", "--steps", "4", "--rounds", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nan" not in proc.stdout, proc.stdout + proc.stderr
    assert "--steps 4 must be at least 2 x --rounds (8)" in proc.stderr, proc.stderr


def test_optimizer_swap(tmp_path):
    out = bench("optimizer_swap.py", "--swap-dir", str(tmp_path), "--state-gb", "0.05",
                "--jobs-gb", "0.02", "--rounds", "2", "--job-rounds", "2", "--steps", "2",
                "--default-layers", "2",
                timeout=240)
    for kind in ("write", "read"):
        assert re.search(rf"^ +{kind}: raw [0-9.]+ \[.*\] +swapper [0-9.]+ \[.*\] +swapper/raw "
                         r"[0-9.]+ \[", out, re.M), out
    # The step's ratio and the design's floor over the same bound, and the step over the
    # floor, each a median in its range.
    spread = r"([0-9.]+) \[([0-9.]+)-([0-9.]+)\]"
    row = re.search(rf"^ +0\.0\d +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +{spread} +{spread} +{spread} ",
                    out, re.M)
    assert row, out
    values = list(map(float, row.groups()))
    for median, low, high in (values[0:3], values[3:6], values[6:9]):
        assert low <= median <= high, out
    assert re.search(r"^ +per step, MB: read \d+, written \d+$", out, re.M), out
    assert re.search(r"^memory at default settings: 2 x Linear\(1024, 1024\), AdamW state "
                     r"\d+ MB: .* saved/state -?[0-9.]+ \[-?[0-9.]+--?[0-9.]+\] \(goal >= 0\.7\)$",
                     out, re.M), out


@pytest.mark.parametrize("workload,batches,targets", [
    ("digits", "32,64", "0.2,0.3,0.4"), ("shapes", "32,64", "0.13,0.15,0.2"),
    ("markov_text", "16,32", "3.9,3.8,3.7")])
def test_time_to_accuracy(tmp_path, workload, batches, targets):
    out = bench("time_to_accuracy.py", "--workload", workload, "--seeds", "1", "--first-seed", "4",
                "--batches", batches, "--targets", targets, "--size", "0.05", "--max-seconds", "1",
                "--read-every", "256", "--out", str(tmp_path / "curves.json"), timeout=120)
    assert len(re.findall(r"^ +[0-9.]+ +[0-9.inf]+ \[", out, re.M)) == 3, out
    assert len(re.findall(r"^\[ *\d+s\] seed 4 ", out, re.M)) == 3, out
    assert re.search(r"^worst_adaptive_vs_best_fixed=\S+ final_adaptive_vs_best_fixed=\S+ "
                     r"final_adaptive_vs_median_fixed=\S+$", out, re.M), out
    assert (tmp_path / "curves.json").exists() and (tmp_path / "curves.png").exists()
    (tmp_path / "curves.png").unlink()
    again = bench("time_to_accuracy.py", "--from-json", str(tmp_path / "curves.json"))
    assert again.split("\n", 1)[1].strip() in out
    assert (tmp_path / "curves.png").exists()


@pytest.mark.distributed
def test_time_to_accuracy_at_two_processes(tmp_path):
    # Unreachable targets: every run stops on the clock, which each rank reads
    # for itself; they must stop together.
    out = bench("time_to_accuracy.py", "--workload", "digits", "--procs", "2", "--seeds", "1",
                "--batches", "32,64", "--targets", "0.99,0.995,0.999", "--size", "0.05",
                "--max-seconds", "1", "--read-every", "256", "--out", str(tmp_path / "c.json"),
                timeout=240)
    assert len(re.findall(r"^ +0\.99\d* +inf \[", out, re.M)) == 3, out


@pytest.mark.distributed
@pytest.mark.elastic
def test_resize_latency():
    out = bench("resize_latency.py", "--schedule", "1 2", "--samples", "256", "--join-delay",
                "2", timeout=300)
    for mode in ("cold", "warm"):
        assert re.search(rf"^ *{mode} +1 +2 +[0-9.]+", out, re.M), out
        assert re.search(rf"^{mode}: max pause on a grow [0-9.]+ s", out, re.M), out


def test_digits_are_drawn_afresh_at_every_fetch(monkeypatch):
    # A fixed set of warps is memorised in seconds; fresh ones keep the MLP
    # learning for minutes. A run's seed still fixes its draws.
    import torch
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from workloads import digits
    train, validation = digits.make_data(0, size=0.05)
    torch.manual_seed(0)
    first = torch.stack([x for x, _ in train.__getitems__([0, 1, 2])])
    again = torch.stack([x for x, _ in train.__getitems__([0, 1, 2])])
    torch.manual_seed(0)
    replayed = torch.stack([x for x, _ in train.__getitems__([0, 1, 2])])
    assert not torch.allclose(first, again)
    assert torch.equal(first, replayed)
    assert [int(y) for _, y in train.__getitems__([0, 1, 2])] == [int(train[i][1]) for i in range(3)]
    assert torch.equal(validation[0][0], digits.make_data(0, size=0.05)[1][0][0])


def test_a_target_no_fixed_run_reached_has_no_ratio(monkeypatch, capsys):
    # Digits at two processes: every fixed run missed the final target within
    # the cap and the adaptive run made it; "0.00" would read as a measurement.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import time_to_accuracy
    from workloads import digits
    reached = [(5.0, 0, 0.80, 32, 0, 1), (9.0, 0, 0.87, 32, 0, 1)]
    missed = [(5.0, 0, 0.80, 32, 0, 1), (150.0, 0, 0.84, 32, 0, 1)]
    ratios = time_to_accuracy.report(digits.WORKLOAD, {"fixed 32": [missed], "fixed 64": [missed],
                                                       "adaptive": [reached]})
    assert ratios[0.75] == (1.0, 1.0)
    assert all(np.isnan(r) for r in ratios[0.86])
    out = capsys.readouterr().out
    assert "worst_adaptive_vs_best_fixed=1.000 final_adaptive_vs_best_fixed=nan" in out


def test_discover_latency():
    out = bench("discover_latency.py", "--runs", "3", "--hosts", "8")
    for install in ("editable", "regular"):
        assert re.search(rf"^{install}: 3 runs over 8 hosts: median [0-9.]+ ms", out, re.M), out


def curves_file(path):
    """A cluster_jobs.py record holding two measured curves: one that scales, one that does
    not (its goodput 0 past the replicas its batch allows, as the hints say)."""
    import json
    scales = [[r, 100.0 * min(r, 8) ** 0.8] for r in range(1, 17)] + [[17, 0.0]]
    comm = [[r, 100.0 + 5.0 * min(r, 3)] for r in range(1, 17)]
    jobs = {"j0": {"kind": "scales", "timed": [1, 2, 4], "curve": scales},
            "j1": {"kind": "comm", "timed": [1, 2], "curve": comm}}
    path.write_text(json.dumps({"data": {"rounds": [{"policy": "arbiter", "jobs": jobs}]}}))
    return str(path)


def test_cluster_sim_finishes_every_job_under_each_policy(tmp_path):
    out = bench("cluster_sim.py", "--jobs", "12", "--nodes", "8", "--seeds", "0",
                "--max-job-hours", "1", "--curves", curves_file(tmp_path / "curves.json"))
    rows = re.findall(r"^ +0 +(fixed|greedy|discover|arbiter) +([0-9.]+) +([0-9.]+) +([0-9.]+)",
                      out, re.M)
    assert [r[0] for r in rows] == ["fixed", "greedy", "discover", "arbiter"], out
    assert all(float(r[1]) > 0 and float(r[2]) >= float(r[1]) for r in rows), out
    assert re.search(r"^arbiter: average JCT -?\d+% below fixed .* p99 [0-9.]+ x greedy's",
                     out, re.M), out


def test_cluster_sim_without_measured_curves_says_what_to_run(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cluster_sim.py"),
                           "--curves", str(tmp_path / "none.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "run benchmarks/cluster_jobs.py" in proc.stderr


def test_cluster_sim_jobs_wait_for_what_they_requested_under_fixed(monkeypatch, tmp_path):
    # Two jobs each asking for the whole cluster: the second starts when the first ends.
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import argparse
    import cluster_sim
    curves = cluster_sim.load_curves(curves_file(tmp_path / "curves.json"))
    args = argparse.Namespace(jobs=2, nodes=4, hours=0.001, min_job_hours=1.0,
                              max_job_hours=1.0, round=60.0, greedy_max=4, seed=0)
    jobs = cluster_sim.make_trace(args, curves)
    for job in jobs:
        job.requested = 4
    assert cluster_sim.allocate_fixed(jobs, 4, args) == {0: 4, 1: 0}
    jobs[0].workers = 4
    assert cluster_sim.allocate_greedy(jobs, 4, args) == {0: 4, 1: 0}
    jobs[0].workers = 0
    rule = cluster_sim.DiscoveryRule()
    fair = cluster_sim.allocate_discover(jobs, 4, args, rule)
    assert fair[0] >= 1 and fair[1] >= 1 and sum(fair.values()) <= 4
    split, _ = cluster_sim.allocate_arbiter(jobs, 4, args, cluster_sim.SplitSettings(), 0.0,
                                            -1e9)
    assert split[0] >= 1 and split[1] >= 1 and sum(split.values()) <= 4


@pytest.mark.parametrize("args,bad", [
    (["--jobs", "scales:3,fast:2"], "got 'fast:2'"),
    (["--sample-seconds", "scales=0"], "got 'scales=0'"),
    (["--sample-seconds", "scales=0.3,fast=1"], "got 'fast=1'"),
    (["--sample-seconds", "comm=x"], "got 'comm=x'"),
])
def test_cluster_jobs_names_a_bad_argument(args, bad):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cluster_jobs.py")]
                          + args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and bad in proc.stderr, proc.stderr


def test_cluster_jobs_times_each_job_to_its_own_end(tmp_path):
    # cluster_jobs.py's completion times are when the pool's wait first sees each launcher
    # gone. The wait polled with all() over a generator, which stops at the first job still
    # running: a job that ended before one listed ahead of it was timed to that job's end
    # (the 2026-12-07 record gave the comm job j0's end, 30 s after its arrival).
    from support import pool
    jobs = []
    for name, seconds in (("long", 6), ("short", 0)):
        job = pool.PoolJob(name, "scales", str(tmp_path / name), 8, 1)
        job.log = open(os.path.join(job.out_dir, "output.log"), "w")
        job.proc = subprocess.Popen(["sleep", str(seconds)])
        jobs.append(job)
    assert pool.wait_all(jobs, 60)
    long, short = jobs
    assert short.ended < long.ended - 3, (short.ended, long.ended)


def test_results_md_is_what_the_recorded_json_gives():
    # benchmarks/RESULTS.md is rendered from benchmarks/results/: a table edited by hand,
    # or JSON recorded without rendering again, fails here.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"),
                           "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
