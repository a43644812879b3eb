"""The speed-up curve a job publishes for its launcher: a small versioned JSON file.

Rank 0 rewrites it after every batch-size decision (``HVD_ADAPT_HINTS``, or
``autoscale_batch_size(hints_path=...)``); ``hvd-adapt-discover`` and any
scheduler read it. The standard library reads it: no torch, no numpy.

Format, version 1 (every key always present)::

    {
      "version": 1,
      "written_at": 1796400000.5,     # unix time of this write
      "fitted_at": 1796399990.1,      # unix time the throughput model was fitted (null: never)
      "replicas": 2,                  # the world the job trains in now
      "slots_per_node": 1,            # replicas per node the curve counts nodes with
      "replica_counts_timed": [1, 2], # worlds the step-time profile holds
      "timed_two_counts": true,       # >= 2 of them: the communication cost is measured
      "init_batch_size": 64,          # B0
      "curve": [                      # one entry per replica count 1..max (empty: no model yet)
        {"replicas": 1, "nodes": 1, "goodput": 812.0, "speedup": 1.0,
         "local_bsz": 64, "accumulation_steps": 0, "batch_size": 64},
        ...
      ]
    }

``goodput`` is useful samples per second (throughput x statistical
efficiency) at the best batch plan for that many replicas, ``speedup`` the
goodput over that of one replica.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "hints.json")
>>> write_hints(path, make_hints(replicas=1, slots_per_node=1, replica_counts_timed=[1],
...                              init_batch_size=32, fitted_at=None, curve=[]))
>>> read_hints(path)["replicas"]
1
"""
import json
import os
import time

FORMAT_VERSION = 1
CURVE_KEYS = ("replicas", "nodes", "goodput", "speedup", "local_bsz", "accumulation_steps",
              "batch_size")


class HintsError(ValueError):
    """A hints file that is not version-1 hints (names the file and what is wrong)."""


def make_hints(replicas, slots_per_node, replica_counts_timed, init_batch_size, fitted_at,
               curve):
    """The version-1 hints dict (``curve``: a list of dicts with :data:`CURVE_KEYS`)."""
    counts = sorted(int(r) for r in set(replica_counts_timed))
    return {"version": FORMAT_VERSION, "written_at": time.time(), "fitted_at": fitted_at,
            "replicas": int(replicas), "slots_per_node": int(slots_per_node),
            "replica_counts_timed": counts, "timed_two_counts": len(counts) >= 2,
            "init_batch_size": int(init_batch_size), "curve": list(curve)}


def write_hints(path, hints):
    """Replace ``path`` with ``hints`` atomically: a reader sees the old file or the new one."""
    import tempfile      # a writer's need: hvd-adapt-discover only reads, every second
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hints-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(hints, f, separators=(",", ":"))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_hints(path):
    """The hints at ``path`` as a dict, None when there is no file yet; HintsError when the
    file is not version-1 hints."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        hints = json.loads(text)
    except ValueError as e:
        raise HintsError(f"{path}: not JSON ({e})") from None
    if not isinstance(hints, dict) or hints.get("version") != FORMAT_VERSION:
        version = hints.get("version") if isinstance(hints, dict) else None
        raise HintsError(f"{path}: hints format version {version!r}, this hvd_adapt reads "
                         f"version {FORMAT_VERSION}")
    missing = [k for k in ("replicas", "curve", "replica_counts_timed", "written_at")
               if k not in hints]
    if missing:
        raise HintsError(f"{path}: missing {', '.join(missing)}")
    for entry in hints["curve"]:
        absent = [k for k in CURVE_KEYS if k not in entry]
        if absent:
            raise HintsError(f"{path}: a curve entry lacks {', '.join(absent)}: {entry!r}")
    return hints
