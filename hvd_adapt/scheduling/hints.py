"""The speed-up curve a job publishes for its launcher: a small versioned JSON file.

Rank 0 rewrites it after every batch-size decision (``HVD_ADAPT_HINTS``, or
``autoscale_batch_size(hints_path=...)``); ``hvd-adapt-discover`` and any
scheduler of the job's user read it. The standard library reads it: no
torch, no numpy. Whoever may write the file steers how many workers the job
gets, so :func:`read_hints` takes only a regular file of its own user that
no one else may write, and checks every field's type and range.

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
import math
import os
import reprlib
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
    from .._runtime.private_files import write_file_atomically   # a writer's need
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_file_atomically(path, json.dumps(hints, separators=(",", ":")).encode(), mode=0o644)


# Bounds on what a hints file may hold: far beyond any job, far below what breaks arithmetic.
MAX_REPLICAS = 1 << 20
MAX_ENTRIES = 1 << 16
MAX_BYTES = 16 << 20


def read_hints(path):
    """The hints at ``path`` as a dict, None when there is no file yet; HintsError (naming
    the file and what is wrong) when it is not version-1 hints: not JSON, a key missing, a
    value of the wrong type or out of range. The file must be this user's, writable by no
    one else and not a symlink: anyone who may write it steers how many workers the job
    gets."""
    from .._runtime.private_files import read_own_file
    try:
        text = read_own_file(path, limit=MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise HintsError(f"{path}: cannot be read ({e})") from None
    try:
        hints = json.loads(text)
    except (ValueError, RecursionError) as e:     # RecursionError: nested too deep
        raise HintsError(f"{path}: not JSON ({str(e)[:200]})") from None
    if not isinstance(hints, dict) or hints.get("version") != FORMAT_VERSION:
        version = hints.get("version") if isinstance(hints, dict) else None
        raise HintsError(f"{path}: hints format version {_show(version)}, this hvd_adapt "
                         f"reads version {FORMAT_VERSION}")
    missing = [k for k in ("replicas", "curve", "replica_counts_timed", "written_at")
               if k not in hints]
    if missing:
        raise HintsError(f"{path}: missing {', '.join(missing)}")
    problem = _schema_problem(hints)
    if problem:
        raise HintsError(f"{path}: {problem}")
    return hints


def _is_count(value, low=1):
    return type(value) is int and low <= value <= MAX_REPLICAS


def _is_number(value):
    return type(value) in (int, float) and math.isfinite(value) and abs(value) < 1e300


def _schema_problem(hints):
    """What makes ``hints`` (a dict with the required keys) not version-1 hints, or None."""
    for key, check, allowed in (
            ("written_at", _is_number, "a finite number"),
            ("replicas", _is_count, f"an integer in [1, {MAX_REPLICAS}]"),
            ("slots_per_node", _is_count, f"an integer in [1, {MAX_REPLICAS}]"),
            ("fitted_at", lambda v: v is None or _is_number(v), "null or a finite number"),
            ("init_batch_size", lambda v: _is_count(v, 0), "an integer >= 0"),
            ("replica_counts_timed", lambda v: isinstance(v, list) and len(v) <= MAX_ENTRIES
             and all(_is_count(r) for r in v), f"a list of integers in [1, {MAX_REPLICAS}]"),
            ("curve", lambda v: isinstance(v, list) and len(v) <= MAX_ENTRIES
             and all(isinstance(e, dict) for e in v), "a list of objects")):
        if key in hints and not check(hints[key]):
            return f"{key} must be {allowed}, got {_show(hints[key])}"
    for entry in hints["curve"]:
        absent = [k for k in CURVE_KEYS if k not in entry]
        if absent:
            return f"a curve entry lacks {', '.join(absent)}: {_show(entry)}"
        if not _is_count(entry["replicas"]):
            return (f"a curve entry's replicas must be an integer in [1, {MAX_REPLICAS}], "
                    f"got {_show(entry['replicas'])}")
        bad = [k for k in CURVE_KEYS if k != "replicas"
               and not (_is_number(entry[k]) and entry[k] >= 0)]
        if bad:
            return (f"a curve entry's {', '.join(bad)} must be a finite number >= 0: "
                    f"{_show(entry)}")
    return None


def _show(value):
    # A hostile file's value, short and shallow enough for a log line.
    return reprlib.repr(value)
