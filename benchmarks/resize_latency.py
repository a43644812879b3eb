"""Pause per resize of an elastic job that grows 1 -> 2 -> 3 and shrinks back (localhost).

Runs examples/elastic/train.py under horovodrun with its discovery script
and reads rank 0's step log: the pause of a resize is the time from the
commit that raised HostsUpdatedInterrupt to the first training step in the
new world (reset, rendezvous, a new worker's start-up, sync, and the
batch-size decision). Each worker sleeps ``--join-delay`` seconds before
``init()``, as a worker on a cluster takes to start. Two modes, in one
invocation:

- ``cold``: horovodrun starts each new worker when the host is offered; the
  survivors wait for its whole start-up (today's ``horovodrun --elastic``);
- ``warm``: a standby worker per slot boots ahead (``hvd-adapt-worker
  --standby``), ``hvd-adapt-discover --standby-dir`` offers a slot only once
  its standby is ready, and the launch stub hands the slot over: the
  survivors keep training while it boots.

    python benchmarks/resize_latency.py [--schedule "1 2 3 2 1"] [--join-delay 8]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXAMPLE = os.path.join(ROOT, "examples", "elastic")
BIN = os.path.dirname(sys.executable)


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


def run_job(mode, args, work):
    """One job of the schedule in ``mode``; returns [(from, to, pause_s)]."""
    log = os.path.join(work, "steps.jsonl")
    sizes = [int(s) for s in args.schedule.split()]
    env = dict(os.environ, HVD_ADAPT_DEMO_DIR=work, HVD_ADAPT_DEMO_SCHEDULE=args.schedule,
               HVD_ADAPT_DEMO_EPOCHS_PER_SIZE=str(args.epochs_per_size),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    train = [sys.executable, os.path.join(EXAMPLE, "train.py"), "--samples", str(args.samples),
             "--step-log", log, "--startup-delay", str(args.join_delay)]
    discovery, prefix, standbys = os.path.join(EXAMPLE, "discover.sh"), [], []
    if mode == "warm":
        folder = os.path.join(work, "standbys")
        discovery = (f"{os.path.join(BIN, 'hvd-adapt-discover')} --command {discovery} "
                     f"--standby-dir {folder} --ssh-port 0 --min-np 1 --max-np {max(sizes)} "
                     f"--initial-np {sizes[0]} --state {work}/discover.json")
        prefix = [os.path.join(BIN, "hvd-adapt-worker"), "--standby-dir", folder, "--"]
        # One standby per slot the schedule ever adds, as each new pod would start one.
        grows = sizes[0] + sum(max(0, b - a) for a, b in zip(sizes, sizes[1:]))
        for _ in range(grows):
            standbys.append(subprocess.Popen(
                [os.path.join(BIN, "hvd-adapt-worker"), "--standby", "--standby-dir", folder,
                 "--host", "localhost", "--"] + train, env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
    command = [os.path.join(BIN, "horovodrun"), "-np", str(sizes[0]), "--min-np", "1",
               "--max-np", str(max(sizes)), "--network-interface", "lo",
               "--host-discovery-script", discovery] + prefix + train
    try:
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=900)
    finally:
        for standby in standbys:
            if standby.poll() is None:
                standby.kill()
            standby.wait()
    with open(log) as f:
        return pauses([json.loads(line) for line in f])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1 2 3 2 1")
    parser.add_argument("--epochs-per-size", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--join-delay", type=float, default=8.0,
                        help="seconds every worker sleeps before init() (default 8)")
    parser.add_argument("--modes", default="cold,warm", help="cold, warm or both (default)")
    parser.add_argument("--json", default=None,
                        help="also write the pauses here (relative: under benchmarks/results/)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or set(modes) - {"cold", "warm"}:
        parser.error(f"--modes must be cold, warm or cold,warm, got {args.modes!r}")
    if args.join_delay < 0:
        parser.error(f"--join-delay must be >= 0, got {args.join_delay}")
    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix=f"hvd_adapt_resize_{mode}_") as work:
            results[mode] = run_job(mode, args, work)
    print(f"{'mode':>5} {'from':>4} {'to':>4} {'pause_s':>8}")
    for mode, rows in results.items():
        for before, after, seconds in rows:
            print(f"{mode:>5} {before:>4} {after:>4} {seconds:>8.2f}")
    for mode, rows in results.items():
        grows = [s for b, a, s in rows if a > b]
        print(f"{mode}: max pause on a grow {max(grows, default=float('nan')):.2f} s, "
              f"on a shrink {max([s for b, a, s in rows if a < b], default=float('nan')):.2f} s"
              + (" (goal <= 1 s on a grow)" if mode == "warm" else ""))
    if args.json:
        import record
        record.write(args.json, {
            "schedule": args.schedule, "join_delay_s": args.join_delay,
            "modes": {mode: [{"from": b, "to": a, "seconds": s} for b, a, s in rows]
                      for mode, rows in results.items()}})
    return results


if __name__ == "__main__":
    main()
