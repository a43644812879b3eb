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
