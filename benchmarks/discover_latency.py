"""How long one run of ``hvd-adapt-discover`` takes, as horovodrun runs it every second.

A base list of ``--hosts`` hosts (this machine's aliases are not needed: no
probe, ``--ssh-port 0``), the job's hints with a curve for as many replicas,
a standby folder, and the state file of a job already running on half the
hosts: the work of a steady-state run. Each run is a fresh interpreter, as
Horovod starts it; the wall time includes the interpreter's start.

    python benchmarks/discover_latency.py [--runs 30] [--hosts 64]
"""
import argparse
import os
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
    discover = os.path.join(os.path.dirname(sys.executable), "hvd-adapt-discover")
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
        command = [discover, "--hostfile", hostfile, "--hints", hints, "--ssh-port", "0",
                   "--standby-dir", os.path.join(work, "standbys"), "--max-np",
                   str(args.hosts), "--state", os.path.join(work, "state.json")]
        # The first run makes the first offer; later runs are a job's steady state.
        subprocess.run(command, check=True, capture_output=True)
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times.append(1e3 * (time.perf_counter() - started))
    times.sort()
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    print(f"{args.runs} runs over {args.hosts} hosts: median {statistics.median(times):.1f} ms, "
          f"p90 {p90:.1f} ms, max {times[-1]:.1f} ms (goal <= 50 ms)")
    if args.json:
        import record
        record.write(args.json, {"hosts": args.hosts, "runs_ms": times})
    return times


if __name__ == "__main__":
    main()
