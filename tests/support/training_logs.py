"""Reading what workers/elastic_train.py logged, and the exactly-once checks on it."""
import collections
import glob
import json
import os

SAMPLES = 60


def read_attempts(out_dir):
    """What every rank held at the start of each attempt of the training function (after
    its sync), in the order each process wrote them: {pid file: [entries]}."""
    attempts = {}
    for path in glob.glob(os.path.join(out_dir, "attempts.*.jsonl")):
        with open(path) as f:
            attempts[os.path.basename(path)] = [json.loads(line) for line in f]
    return attempts


def read_save_times(out_dir):
    """When each process committed (its state handlers saved), an epoch's end included:
    {pid: [times]}."""
    times = {}
    for path in glob.glob(os.path.join(out_dir, "saves.*.jsonl")):
        with open(path) as f:
            times[os.path.basename(path).split(".")[1]] = [json.loads(line)["time"] for line in f]
    return times


def read_logs(out_dir):
    """Every rank's committed batches (commits.*.jsonl) and rank 0's epoch totals."""
    commits = []
    for path in glob.glob(os.path.join(out_dir, "commits.*.jsonl")):
        with open(path) as f:
            commits += [dict(json.loads(line), pid=os.path.basename(path)) for line in f]
    epochs = []
    if os.path.exists(os.path.join(out_dir, "epochs.jsonl")):
        with open(os.path.join(out_dir, "epochs.jsonl")) as f:
            epochs = [json.loads(line) for line in f]
    return commits, epochs


def check_exactly_once(commits, epochs, num_epochs, samples=SAMPLES, first_epoch=0):
    """Epochs ``first_epoch`` to ``num_epochs - 1`` trained each sample once, and rank 0's
    accumulator totals of each are exact."""
    seen = collections.defaultdict(collections.Counter)
    for entry in commits:
        seen[entry["epoch"]].update(entry["indices"])
    assert sorted(seen) == list(range(first_epoch, num_epochs))
    for epoch, counts in seen.items():
        twice = {i: c for i, c in counts.items() if c != 1}
        missing = set(range(samples)) - set(counts)
        assert not twice and not missing, f"epoch {epoch}: twice {twice}, missing {missing}"
    # Rank 0 may print an epoch again after a restore; each print must be the same.
    totals = {}
    for entry in epochs:
        totals.setdefault(entry["epoch"], set()).add((entry["n"], entry["idsum"]))
    assert sorted(totals) == list(range(first_epoch, num_epochs))
    for epoch, values in totals.items():
        assert values == {(samples, samples * (samples - 1) // 2)}, (epoch, values)


def check_identical_replicas(commits):
    """After every optimizer step, every rank of the world held the same parameters,
    optimizer state, GradScaler scale and noise-scale estimate (all ranks measured the same
    steps)."""
    by_step = collections.defaultdict(set)
    for entry in commits:
        if entry["optim"]:
            held = json.dumps([entry.get("noise"), entry.get("optimizer"), entry.get("scale")])
            by_step[(entry["step"], entry["size"])].add((entry["params"], held))
    differing = {key: len(hashes) for key, hashes in by_step.items() if len(hashes) > 1}
    assert by_step and not differing, f"replicas differ at (step, size): {differing}"


def lineage(commits, attempts):
    """The commits the job's final state descends from, across ``hvd-adapt-run``'s launches:
    a launch's commits from the epoch a later launch resumed in on are dropped (that launch
    trained them again, from its checkpoint). ``attempts``: :func:`read_attempts`'s."""
    resumed = {}
    for entries in attempts.values():
        first = entries[0]
        resumed[first["restarts"]] = min(resumed.get(first["restarts"], first["epoch"]),
                                         first["epoch"])
    kept = []
    for entry in commits:
        later = [epoch for launch, epoch in resumed.items() if launch > entry["restarts"]]
        if not later or entry["epoch"] < min(later):
            kept.append(entry)
    return kept


def check_resumed_from_checkpoint(commits, attempts, launch):
    """Every rank of launch ``launch`` (HVD_ADAPT_RESTARTS) started from the last commit of an
    earlier launch's last finished epoch, the one its checkpoint holds: same step,
    parameters, optimizer state and scale."""
    firsts = [entries[0] for entries in attempts.values() if entries[0]["restarts"] == launch]
    assert firsts, f"no rank of launch {launch} trained"
    epochs = {first["epoch"] for first in firsts}
    assert len(epochs) == 1 and min(epochs) > 0, firsts
    epoch = epochs.pop()
    ended = [entry for entry in commits if entry["restarts"] < launch and entry["optim"]
             and entry["epoch"] == epoch - 1]
    last = max(ended, key=lambda entry: entry["step"])
    for first in firsts:
        assert first["step"] == last["step"] + 1, (first, last["step"])
        assert (first["params"], first["optimizer"], first["scale"]) == \
            (last["params"], last["optimizer"], last["scale"]), first["rank"]
