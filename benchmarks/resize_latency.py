"""Pause per resize of an elastic job that grows 1 -> 2 -> 3 and shrinks back (localhost).

Runs examples/elastic/train.py under horovodrun with its discovery script
and reads rank 0's step log: the pause of a resize is the time from the
commit that raised HostsUpdatedInterrupt to the first training step in the
new world (reset, rendezvous, a new worker's start-up, sync, and the
batch-size decision).

    python benchmarks/resize_latency.py [--schedule "1 2 3 2 1"]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXAMPLE = os.path.join(ROOT, "examples", "elastic")


def pauses(events):
    rows, pending = [], None
    size_before = None
    for event in events:
        if event["event"] == "resize" and pending is None:
            pending, size_before = event, event["size"]
        elif event["event"] == "step":
            if pending is not None and event["size"] != size_before:
                rows.append((size_before, event["size"], event["time"] - pending["time"]))
                pending = None
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1 2 3 2 1")
    parser.add_argument("--epochs-per-size", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--json", default=None,
                        help="also write the pauses here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hvd_adapt_resize_") as work:
        log = os.path.join(work, "steps.jsonl")
        env = dict(os.environ, HVD_ADAPT_DEMO_DIR=work, HVD_ADAPT_DEMO_SCHEDULE=args.schedule,
                   HVD_ADAPT_DEMO_EPOCHS_PER_SIZE=str(args.epochs_per_size),
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        command = [horovodrun, "-np", args.schedule.split()[0], "--min-np", "1", "--max-np",
                   str(max(int(s) for s in args.schedule.split())), "--network-interface", "lo",
                   "--host-discovery-script", os.path.join(EXAMPLE, "discover.sh"),
                   sys.executable, os.path.join(EXAMPLE, "train.py"), "--samples",
                   str(args.samples), "--step-log", log]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=600)
        with open(log) as f:
            rows = pauses([json.loads(line) for line in f])
    print(f"{'from':>4} {'to':>4} {'pause_s':>8}")
    for before, after, seconds in rows:
        print(f"{before:>4} {after:>4} {seconds:>8.2f}")
    worst = max(seconds for _, _, seconds in rows)
    print(f"max_pause_s={worst:.2f} (goal <= 3)")
    if args.json:
        import record
        record.write(args.json, {"schedule": args.schedule,
                                 "pauses": [{"from": b, "to": a, "seconds": s} for b, a, s in rows]})
    return rows


if __name__ == "__main__":
    main()
