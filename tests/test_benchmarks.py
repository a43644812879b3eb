"""Smoke tests of the benchmarks at tiny sizes: they run and print their ratio lines."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    out = bench("overhead.py", "--model", "mlp-small,mlp-8m", "--steps", "10", "--warmup", "2",
                "--rounds", "1", timeout=240)
    assert re.search(r"^overhead_ratio=[0-9.]+", out, re.M)
    rows = re.findall(r"^ *(mlp-\S+) +(\d) +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +\d+ +[0-9.]+ +[0-9.]+$",
                      out, re.M)
    assert rows == [("mlp-small", "1"), ("mlp-small", "2"), ("mlp-8m", "1"), ("mlp-8m", "2")], out


def test_time_to_accuracy():
    out = bench("time_to_accuracy.py", "--repeats", "1", "--max-epochs", "6", "--target", "0.9")
    assert re.search(r"^adaptive_vs_best_fixed=[0-9.]+", out, re.M), out


@pytest.mark.distributed
@pytest.mark.elastic
def test_resize_latency():
    out = bench("resize_latency.py", "--schedule", "1 2", "--samples", "256", timeout=180)
    assert re.search(r"^ +1 +2 +[0-9.]+", out, re.M) and re.search(r"^max_pause_s=", out, re.M)


def test_time_to_accuracy_fine():
    out = bench("time_to_accuracy_fine.py", "--repeats", "1", "--max-epochs", "3", "--targets",
                "0.8,0.9")
    assert len(re.findall(r"^ +0\.[89] +[0-9.inf]+ +[0-9.inf]+ +[0-9.inf]+ +[0-9.inf]+$", out,
                          re.M)) == 2, out
    assert re.search(r"^worst_adaptive_vs_best_fixed=[0-9.]+", out, re.M), out
