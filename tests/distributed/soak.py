"""A seeded soak: one elastic job driven through random resizes and kills.

    python tests/distributed/soak.py --events 50 --seed 7

One ``horovodrun`` job on this machine (1 to 3 workers over the host
entries ``localhost`` and ``127.0.0.1``, Horovod's blacklist cooldown of 1-3 s
so that a killed worker's host comes back) trains workers/elastic_train.py
with weight decay, autoscaling and gradient accumulation on. The seed draws
a schedule of events, a few optimizer steps apart: a resize to other host
entries (grow or shrink), a SIGKILL of a random worker (rank 0 included), or a
SIGKILL inside an accumulation cycle. A kill waits until the world spans both
host entries and has stepped twice, and kills come one per world (Horovod
blacklists the dead worker's host for 1-3 s, and ends a job whose every slot
is blacklisted or whose every worker failed). Afterwards it checks what every rank
logged at its commits: each sample trained exactly once per epoch,
accumulator totals exact, one parameter hash per step and world (replicas
identical after every reset), and the job finished. It prints the seed,
the schedule, what happened, and the seconds each reset took.
"""
import argparse
import glob
import itertools
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from elastic_jobs import run_elastic, sizes_in_order  # noqa: E402
from training_logs import check_exactly_once, check_identical_replicas  # noqa: E402

# Host entries over the two names this machine answers to, both in every one:
# Horovod ends a job when a resize leaves no host of the world before ("No
# hosts from previous set remaining"), which no library can survive without a
# checkpoint, and a kill blacklists one host for a while. Worlds of 2 and 3
# come from resizes, of 1 and 2 from kills.
CONFIGS = [[f"localhost:{a}", f"127.0.0.1:{b}"]
           for a, b in itertools.product(range(1, 3), repeat=2) if a + b <= 3]
KINDS = ("resize", "kill", "kill_mid_cycle")


def make_schedule(events, seed):
    """``(hosts, resizes, kills)``: the first host entries, ``[(step, hosts)]`` and the
    kill plan ``[{"id", "step", "rank", "mid_cycle"}]``, drawn from ``seed``."""
    rng = random.Random(seed)
    hosts = rng.choice(CONFIGS)
    resizes, kills, step, current = [], [], 0, hosts
    for event in range(events):
        step += rng.randint(3, 5)
        kind = rng.choice(KINDS)
        if kind == "resize":
            current = rng.choice([c for c in CONFIGS if c != current])
            resizes.append((step, current))
        else:
            kills.append({"id": event, "step": step, "rank": rng.randrange(3),
                          "mid_cycle": kind == "kill_mid_cycle"})
    return hosts, resizes, kills


def soak(events, seed, timeout=None):
    """Run the soak; returns a summary dict, raising AssertionError when a check fails."""
    hosts, resizes, kills = make_schedule(events, seed)
    last_step = max([s for s, _ in resizes] + [k["step"] for k in kills] + [0])
    schedule = [(0, hosts)] + resizes
    np = sum(int(h.split(":")[1]) for h in hosts)
    args = ["--epochs", 10 ** 6, "--until-step", last_step + 4, "--batch-size", 8,
            "--autoscale", "--max-local-bsz", 2, "--hold-seconds", 10,
            "--wait-steps", json.dumps([s for s, _ in resizes]),
            "--kill-plan", json.dumps(kills)]
    started = time.time()
    job, commits, epochs = run_elastic(
        schedule, np=np, min_np=1, max_np=3, worker_args=args,
        timeout=timeout or 120 + 20 * events,
        launcher_args=["--blacklist-cooldown-range", 1, 3])
    seconds = time.time() - started
    fired = []
    for path in glob.glob(os.path.join(job.out_dir, "killed.*")):
        with open(path) as f:
            fired.append(dict(json.load(f), time=os.path.getmtime(path)))
    summary = {"seed": seed, "events": events, "seconds": round(seconds, 1),
               "returncode": job.returncode, "resizes": len(resizes), "kills": len(kills),
               "kills_fired": len(fired), "killed_rank0": sum(k["rank"] == 0 for k in fired),
               "killed_mid_cycle": sum(k["mid_cycle"] for k in fired),
               "sizes": sizes_in_order(commits),
               "epochs": len({e["epoch"] for e in epochs}), "out_dir": job.out_dir,
               "pauses": pauses(commits), "recovery_after_kill": recoveries(commits, fired)}
    job.check()
    check_exactly_once(commits, epochs, summary["epochs"])
    check_identical_replicas(commits)
    return summary


def pauses(commits, longest=5):
    """The longest gaps in seconds between consecutive commits of any rank: resets,
    holds for a resize, and the time to notice a dead peer."""
    times = sorted(e["time"] for e in commits)
    return sorted((round(b - a, 2) for a, b in zip(times, times[1:])), reverse=True)[:longest]


def recoveries(commits, fired):
    """Seconds from each kill to the next commit of any rank, sorted: how long the
    survivors took to notice the dead peer, reset and take a step again."""
    times = sorted(e["time"] for e in commits)
    out = []
    for kill in fired:
        after = [t for t in times if t > kill["time"]]
        if after:
            out.append(round(after[0] - kill["time"], 1))
    return sorted(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50)
    parser.add_argument("--seed", type=int, default=None, help="default: drawn and printed")
    args = parser.parse_args()
    seed = random.randrange(10 ** 6) if args.seed is None else args.seed
    print(f"soak: seed={seed} events={args.events}", flush=True)
    hosts, resizes, kills = make_schedule(args.events, seed)
    print(f"start {hosts}; resizes {resizes}; kills {kills}", flush=True)
    summary = soak(args.events, seed)
    print(json.dumps(summary))
    print(f"soak passed: seed={seed}")


if __name__ == "__main__":
    main()
