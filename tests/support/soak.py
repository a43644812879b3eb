"""Seeded soaks: elastic jobs driven through many resets of one kind, then checked.

    python tests/support/soak.py --kind mixed --events 50 --seed 7
    python tests/support/soak.py --kind all --events 50      # every kind in turn

Every job runs on this machine under ``horovodrun`` (discovery polled every
0.2 s, Horovod's blacklist cooldown 1-3 s so that a killed worker's host
comes back) over the host entries ``localhost`` and ``127.0.0.1``, and trains
workers/elastic_train.py with AdamW and weight decay under bf16 autocast
with a GradScaler (its scale backs off twice early on). The kinds:

- ``mixed``: random resizes to other host entries, SIGKILLs of a random
  worker (rank 0 included), some inside an accumulation cycle (autoscaling
  with gradient accumulation on).
- ``kill_after_sync``: a host joins, and right after the sync, before any
  commit, the worker that held the state before dies: the joiner must
  restore to what it was synced to.
- ``poll_race``: a removal and an addition within one discovery poll (0.1 s).
- ``kill_in_checkpoint``: rank 0 dies while its (slowed) checkpoint write is
  under way, with one checkpoint folder per host: the next rank 0 must make
  the checkpoint current again.
- ``slow_join``: every joining worker sleeps 8 s before ``init()``, as on a
  cluster.
- ``drain``: SIGTERM to ``horovodrun`` at a random moment, commits 3 s apart:
  each drain must write a complete checkpoint of the commit it stopped at and
  exit 143 on every rank (horovodrun SIGKILLs 5 s after its SIGTERM; the
  summary reports how long each drain took), and the next run resumes
  exactly where it stopped.

Afterwards what every rank logged is checked: each sample trained exactly
once per epoch, accumulator totals exact, one hash of parameters, optimizer
state and scale per step and world (replicas identical after every reset),
every restore point what the rank last committed or synced, the checkpoint
never older than the last epoch committed, no hang. It prints the seed, the
schedule and a summary.
"""
import argparse
import glob
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":
    # Run by path (python tests/support/soak.py): its siblings are imported from tests/ as
    # the package ``support``, as pytest imports them.
    sys.path.insert(0, os.path.dirname(HERE))

from support.elastic_jobs import (FAST_HOROVODRUN, discovery_script, run_elastic,  # noqa: E402
                                  sizes_in_order)
from support.launch import WORKERS, launch_env  # noqa: E402
from support.training_logs import (SAMPLES, check_exactly_once,  # noqa: E402
                                   check_identical_replicas, read_attempts, read_logs,
                                   read_save_times)

KINDS = ("mixed", "kill_after_sync", "poll_race", "kill_in_checkpoint", "slow_join", "drain")
# The recipe every soak trains: AdamW with weight decay, bf16 autocast with a
# GradScaler whose scale backs off at steps 1 and 2.
RECIPE = ["--adamw", "--amp", "--inf-steps", "[1, 2]", "--batch-size", 8]
COOLDOWN = ["--blacklist-cooldown-range", 1, 3]
BOTH = ["localhost:1", "127.0.0.1:1"]

# Host entries over the two names this machine answers to, both in every one:
# Horovod ends a job when a resize leaves no host of the world before ("No
# hosts from previous set remaining"), which no library can survive without a
# checkpoint, and a kill blacklists one host for a while. Worlds of 2 and 3
# come from resizes, of 1 and 2 from kills.
CONFIGS = [[f"localhost:{a}", f"127.0.0.1:{b}"]
           for a, b in itertools.product(range(1, 3), repeat=2) if a + b <= 3]


def make_schedule(events, seed):
    """The ``mixed`` kind's ``(hosts, resizes, kills)``: the first host entries,
    ``[(step, hosts)]`` and the kill plan ``[{"id", "step", "rank", "mid_cycle"}]``."""
    rng = random.Random(seed)
    hosts = rng.choice(CONFIGS)
    resizes, kills, step, current = [], [], 0, hosts
    for event in range(events):
        step += rng.randint(3, 5)
        kind = rng.choice(("resize", "kill", "kill_mid_cycle"))
        if kind == "resize":
            current = rng.choice([c for c in CONFIGS if c != current])
            resizes.append((step, current))
        else:
            kills.append({"id": event, "step": step, "rank": rng.randrange(3),
                          "mid_cycle": kind == "kill_mid_cycle"})
    return hosts, resizes, kills


def _poll_races(events, seed):
    """Pairs of host lists a tenth of a second apart: one removes a host entry, the next adds
    another, so the driver may see both in one poll."""
    rng = random.Random(seed)
    schedule, step = [(0, BOTH)], 0
    for event in range(events):
        step += rng.randint(3, 5)
        if event % 2 == 0:
            schedule += [(step, ["localhost:1"]), (step, ["localhost:2"], 0.1)]
        else:
            schedule += [(step, ["localhost:1"]), (step, BOTH, 0.1)]
    return schedule


def _job(kind, events, seed):
    """``(schedule, np, worker_args, launcher_args, timeout)`` of one elastic job of ``kind``."""
    rng = random.Random(seed)
    if kind == "mixed":
        hosts, resizes, kills = make_schedule(events, seed)
        last = max([s for s, _ in resizes] + [k["step"] for k in kills] + [0])
        args = ["--epochs", 10 ** 6, "--until-step", last + 4, "--autoscale",
                "--max-local-bsz", 2, "--hold-seconds", 10,
                "--wait-steps", json.dumps([s for s, _ in resizes]),
                "--kill-plan", json.dumps(kills)]
        np = sum(int(h.split(":")[1]) for h in hosts)
        return [(0, hosts)] + resizes, np, args, COOLDOWN, 120 + 20 * events
    if kind == "kill_after_sync":
        # One host first, so that the first grow comes from discovery; after
        # that every kill's host comes back from the blacklist as a grow.
        args = ["--epochs", 10 ** 6, "--kill-old-after-grow", events]
        return [(0, ["localhost:1"]), (2, BOTH)], 1, args, COOLDOWN, 120 + 15 * events
    if kind == "poll_race":
        schedule = _poll_races(events, seed)
        steps = sorted({entry[0] for entry in schedule[1:]})
        args = ["--epochs", 10 ** 6, "--until-step", steps[-1] + 4, "--hold-seconds", 10,
                "--wait-steps", json.dumps(steps)]
        return schedule, 2, args, [], 120 + 10 * events
    if kind == "kill_in_checkpoint":
        folder = tempfile.mkdtemp(prefix="hvd_adapt_soak_ckpt_")
        args = ["--epochs", 10 ** 6, "--kill-in-checkpoint", events,
                "--slow-checkpoint-fsync", 0.5,
                "--checkpoint", os.path.join(folder, "{host}", "job.pt")]
        return [(0, BOTH)], 2, args, COOLDOWN, 120 + 15 * events
    if kind == "slow_join":
        schedule, step = [(0, ["localhost:1"])], 0
        for event in range(events):
            step += rng.randint(3, 5)
            schedule.append((step, BOTH if event % 2 == 0 else ["localhost:1"]))
        steps = [s for s, _ in schedule[1:]]
        args = ["--epochs", 10 ** 6, "--until-step", steps[-1] + 4, "--slow-join", 8,
                "--hold-seconds", 40, "--wait-steps", json.dumps(steps)]
        return schedule, 1, args, [], 120 + 20 * events
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def soak(events, seed, kind="mixed"):
    """Run one soak of ``kind``; returns a summary dict, raising AssertionError when a check
    fails."""
    if kind == "drain":
        return _drain_soak(events, seed)
    schedule, np, args, launcher_args, timeout = _job(kind, events, seed)
    started = time.time()
    job, commits, epochs = run_elastic(schedule, np=np, min_np=1, max_np=3,
                                       worker_args=RECIPE + args, timeout=timeout,
                                       launcher_args=launcher_args)
    seconds = time.time() - started
    fired = _fired(job.out_dir)
    summary = {"kind": kind, "seed": seed, "events": events, "seconds": round(seconds, 1),
               "returncode": job.returncode, "kills_fired": len(fired),
               "killed_rank0": sum(k["rank"] == 0 for k in fired),
               "sizes": sizes_in_order(commits), "resets": _resets(job.out_dir),
               "epochs": len({e["epoch"] for e in epochs}), "out_dir": job.out_dir,
               "pauses": pauses(commits), "recovery_after_kill": recoveries(commits, fired)}
    job.check()
    check_exactly_once(commits, epochs, summary["epochs"])
    check_identical_replicas(commits)
    summary["restore_points_checked"] = check_restore_points(job.out_dir)
    summary["checkpoint_ages_checked"] = check_checkpoint_ages(job.out_dir)
    return summary


def _fired(out_dir):
    fired = []
    for path in glob.glob(os.path.join(out_dir, "killed.*")):
        with open(path) as f:
            text = f.read()
        entry = dict({"rank": -1, "time": os.path.getmtime(path)}, **(json.loads(text) if text else {}))
        fired.append(entry)
    return fired


def _resets(out_dir):
    """Attempts of the training function beyond each process's first: the resets it saw."""
    return sum(len(entries) - 1 for entries in read_attempts(out_dir).values())


def check_restore_points(out_dir):
    """Wherever a process ran the training function again without committing in between
    (a failure right after its sync; the next attempt's own sync saves once), it held
    exactly what it held at the attempt before:
    its restore point was what it was synced to. Returns how many were checked."""
    keys = ("step", "epoch", "position", "params", "optimizer", "scale", "generation")
    commit_times = read_save_times(out_dir)
    checked = 0
    for name, entries in read_attempts(out_dir).items():
        times = commit_times.get(name.split(".")[1], [])
        for before, after in zip(entries, entries[1:]):
            # Every attempt starts with a sync, and every sync saves: one save
            # in between is the later attempt's own sync, more are commits.
            if sum(before["time"] < t < after["time"] for t in times) <= 1:
                assert {k: before[k] for k in keys} == {k: after[k] for k in keys}, \
                    (name, before, after)
                checked += 1
    return checked


def check_checkpoint_ages(out_dir):
    """At every epoch's start rank 0's checkpoint held at least the last epoch committed."""
    path = os.path.join(out_dir, "checkpoint_ages.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        ages = [json.loads(line) for line in f]
    stale = [a for a in ages if a["file"] is None or a["file"] < a["epoch_end"]]
    assert not stale, stale
    return len(ages)


def _drain_soak(events, seed):
    """``events`` runs of one job, each stopped by a SIGTERM to horovodrun at a random moment
    (commits 3 s apart) and resumed by the next from its checkpoint."""
    rng = random.Random(seed)
    folder = tempfile.mkdtemp(prefix="hvd_adapt_soak_drain_")
    checkpoint = os.path.join(folder, "job.pt")
    all_commits, all_epochs, drains, started = [], [], [], time.time()
    previous = None
    for event in range(events + 1):
        last = event == events
        out_dir = tempfile.mkdtemp(prefix="hvd_adapt_elastic_")
        # The last run finishes the epoch it resumes in (and so every epoch is whole).
        args = RECIPE + ["--samples", SAMPLES, "--epochs", 10 ** 6, "--checkpoint", checkpoint,
                         "--drain", "--batch-seconds", 1.0, "--commit-every", 3] + \
            (["--until-step", 0] if last else [])
        command = [sys.executable, FAST_HOROVODRUN, "-np", 2, "--min-np", 1, "--max-np", 2,
                   "--network-interface", "lo",
                   "--host-discovery-script", discovery_script(out_dir, [(0, BOTH)]),
                   sys.executable, os.path.join(WORKERS, "elastic_train.py")] + args
        with open(os.path.join(out_dir, "output.log"), "w") as log:
            proc = subprocess.Popen([str(a) for a in command], env=launch_env(out_dir),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                if not last:
                    _wait_for(lambda: os.path.exists(os.path.join(out_dir, "committed")), 120)
                    time.sleep(rng.uniform(0.0, 6.0))
                    signalled = time.time()
                    proc.send_signal(signal.SIGTERM)
                code = proc.wait(timeout=120)
                ended = time.time()
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
        with open(os.path.join(out_dir, "output.log")) as f:
            output = f.read()
        commits, epochs = read_logs(out_dir)
        attempts = read_attempts(out_dir)
        first = [entries[0] for entries in attempts.values()]
        if previous is not None:
            # Every rank resumed exactly where the drain stopped.
            keys = ("step", "params", "optimizer", "scale", "generation")
            assert all({k: a[k] for k in keys} == {k: previous[k] for k in keys}
                       for a in first), (previous, first)
        all_commits += commits
        all_epochs += epochs
        if last:
            assert code == 0, output[-3000:]
            break
        drained = []
        for path in glob.glob(os.path.join(out_dir, "drained.*.jsonl")):
            with open(path) as f:
                drained += [json.loads(line) for line in f]
        keys = ("step", "params", "optimizer", "scale", "generation")
        # Both ranks stopped at one commit, with 143, before horovodrun's SIGKILL.
        assert len(drained) == 2 and {d["code"] for d in drained} == {143}, output[-3000:]
        assert len({json.dumps([d[k] for k in keys]) for d in drained}) == 1, drained
        # What horovodrun's SIGKILL 5 s after its SIGTERM threatens: the drain's
        # checkpoint is complete (every record's CRC checks), it is the drained
        # commit, and the next run resumes from it exactly (checked above, at the
        # next event). How long the drain took is a timing goal, which a loaded
        # machine misses: the summary reports it (benchmarks/report.py).
        assert _complete(checkpoint), checkpoint
        assert drained[0]["generation"] == _generation(checkpoint)
        drains.append(round(ended - signalled, 2))
        # What the next run must start from: the drain's commit.
        previous = {k: drained[0][k] for k in keys}
    num_epochs = 1 + max(e["epoch"] for e in all_epochs)
    check_exactly_once(all_commits, all_epochs, num_epochs)
    check_identical_replicas(all_commits)
    return {"kind": "drain", "seed": seed, "events": events,
            "seconds": round(time.time() - started, 1), "epochs": num_epochs,
            "signal_to_exit": sorted(drains)}


def _complete(path):
    """True when every record of the checkpoint file at ``path`` reads back with its CRC."""
    import zipfile
    with zipfile.ZipFile(path) as archive:
        return archive.testzip() is None


def _generation(path):
    from hvd_adapt.elastic.checkpoint import generation_of
    return generation_of(path)


def _wait_for(condition, seconds):
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"nothing happened within {seconds} s")
        time.sleep(0.05)


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
    parser.add_argument("--kind", default="mixed", choices=KINDS + ("all",))
    parser.add_argument("--events", type=int, default=50)
    parser.add_argument("--seed", type=int, default=None, help="default: drawn and printed")
    parser.add_argument("--json", default=None,
                        help="also write each kind's summary here (a folder; relative: under "
                             "benchmarks/results/)")
    args = parser.parse_args()
    seed = random.randrange(10 ** 6) if args.seed is None else args.seed
    for kind in KINDS if args.kind == "all" else (args.kind,):
        print(f"soak: kind={kind} seed={seed} events={args.events}", flush=True)
        summary = soak(args.events, seed, kind)
        print(json.dumps(summary), flush=True)
        print(f"soak passed: kind={kind} seed={seed}", flush=True)
        if args.json:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
            import record
            record.write(os.path.join(args.json, f"{kind}.json"), summary)


if __name__ == "__main__":
    main()
