"""What every benchmark writes beside its table: the data, the command, the machine and the
commit, as JSON under ``benchmarks/results/`` (``report.py`` renders RESULTS.md from it).
"""
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def commit():
    """The checked-out commit, with ``+changes`` when the tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine():
    """Cores, memory, CPU model, and the versions that the numbers depend on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    versions = {"python": platform.python_version()}
    for name in ("torch", "horovod"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    return {"cores": os.cpu_count(), "memory_gib": round(memory_gb, 1), "cpu": cpu, **versions}


def write(path, data, argv=None, at_commit=None):
    """Write ``data`` with the command that made it, the machine and the commit to ``path``
    (relative paths: under benchmarks/results/); ``at_commit`` records an earlier run's."""
    if not os.path.isabs(path):
        path = os.path.join(RESULTS, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    argv = sys.argv if argv is None else argv
    command = "python " + " ".join([os.path.relpath(os.path.abspath(argv[0]), ROOT)] + argv[1:])
    record = {"command": command, "commit": at_commit or commit(),
              "date": datetime.date.today().isoformat(), "machine": machine(), "data": data}
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    return path
