"""How long one run of ``hvd-adapt-discover`` takes, as horovodrun runs it every second.

A base list of ``--hosts`` hosts (this machine's aliases are not needed: no
probe, ``--ssh-port 0``), the job's hints with a curve for as many replicas,
a standby folder, and the state file of a job already running on half the
hosts: the work of a steady-state run. Each run is a fresh interpreter, as
Horovod starts it; the wall time includes the interpreter's start.

Two installs, their runs interleaved: ``editable``, the console script of
this interpreter's environment (``pip install -e .``: every interpreter
start there loads setuptools' editable-import hook); ``regular``, the
package copied and byte-compiled into a fresh virtual environment of its own
(what ``pip install .`` or a Docker image gives), run through the entry
point pip writes.

    python benchmarks/discover_latency.py [--runs 30] [--hosts 64]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from hvd_adapt.scheduling.hints import make_hints, write_hints  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--json", default=None,
                        help="also write the timings here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.hosts < 2:
        parser.error(f"need --runs >= 1 and --hosts >= 2, got {args.runs} and {args.hosts}")
    with tempfile.TemporaryDirectory(prefix="hvd_adapt_discover_") as work:
        hostfile = os.path.join(work, "hosts")
        with open(hostfile, "w") as f:
            f.write("".join(f"node{i}:1\n" for i in range(args.hosts)))
        half = args.hosts // 2
        curve = [{"replicas": r, "nodes": r, "goodput": 100.0 * r ** 0.8, "speedup": r ** 0.8,
                  "local_bsz": 32, "accumulation_steps": 0, "batch_size": 32 * r}
                 for r in range(1, args.hosts + 1)]
        hints = os.path.join(work, "hints.json")
        write_hints(hints, make_hints(half, 1, [half // 2, half], 32, time.time(), curve))
        os.makedirs(os.path.join(work, "standbys", "node0"))
        options = ["--hostfile", hostfile, "--hints", hints, "--ssh-port", "0",
                   "--standby-dir", os.path.join(work, "standbys"), "--max-np",
                   str(args.hosts), "--state", os.path.join(work, "state.json")]
        commands = {"editable": [os.path.join(os.path.dirname(sys.executable),
                                              "hvd-adapt-discover")] + options,
                    "regular": regular_install(os.path.join(work, "venv")) + options}
        # The first run makes the first offer; later runs are a job's steady state.
        subprocess.run(commands["editable"], check=True, capture_output=True)
        times = {install: [] for install in commands}
        for _ in range(args.runs):
            for install, command in commands.items():
                started = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True)
                times[install].append(1e3 * (time.perf_counter() - started))
    for install, runs in times.items():
        runs.sort()
        print(f"{install}: {args.runs} runs over {args.hosts} hosts: median "
              f"{statistics.median(runs):.1f} ms, p90 {percentile_90(runs):.1f} ms, max "
              f"{runs[-1]:.1f} ms (goal <= 50 ms)")
    if args.json:
        import record
        record.write(args.json, {"hosts": args.hosts, "runs_ms": times})
    return times


def percentile_90(sorted_runs):
    return sorted_runs[min(len(sorted_runs) - 1, int(0.9 * len(sorted_runs)))]


def regular_install(folder):
    """A fresh virtual environment holding the package, byte-compiled as pip installs it;
    returns the command of its ``hvd-adapt-discover`` entry point. The discovery needs
    nothing beyond the standard library and the package."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    python = os.path.join(folder, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    shutil.copytree(os.path.join(ROOT, "hvd_adapt"), os.path.join(site, "hvd_adapt"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([python, "-m", "compileall", "-q", os.path.join(site, "hvd_adapt")],
                   check=True)
    return [python, "-c", "import sys; from hvd_adapt.scheduling.discover import main; "
                          "sys.exit(main())"]


if __name__ == "__main__":
    main()
