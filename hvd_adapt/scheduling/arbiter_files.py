"""What jobs and the arbiter exchange: files in the arbiter's private folder.

::

    DIR/                    this user's, 0700 (checked: another user's folder is refused)
      arbiter.json          the arbiter's state: the grants every job reads, and the rest it
                            needs to restart where it stopped (written atomically)
      jobs/<key>.json       each job's report, rewritten by its discovery at every run

The folder is the authentication: only its user can write there, and every
file is read only if it is a regular file of that user (no symlink
followed, :mod:`hvd_adapt._runtime.private_files`), so nothing another
local user writes can change a grant. Every field read is checked (a bad
file keeps what the reader knew). Standard library only.

**A job's report** (version 1), written before the discovery prints its hosts::

    {"version": 1, "job": "digits",          # the name the logs show (--job)
     "run": 17,                              # counts the discovery's runs: the heartbeat
     "generation": 5,                        # of the grants this run read (null: none yet)
     "min_np": 1, "max_np": 8, "initial_np": 1,   # max_np null: no limit
     "curve": [[1, 812.0], [2, 1500.0]],     # goodput at each replica count (null: none)
     "timed": 2,                             # the most replicas its step times cover
     "settled": true,                        # its curve is from the world it has now
     "offered": [["h1", 1], ["h2", 1]],      # what this run offers
     "holding": ["h1", "h2"],                # hosts its driver runs commands on or is
                                             # offered (null: no driver found)
     "launching": false,                     # a command of its driver names no host yet
     "driver": {"key": "812.5523", "boot": "...", "pidns": 4026531836}}   # or null

**The arbiter's state** (version 1): ``{"version": 1, "generation": 5,
"grants": {key: [[host, slots], ...]}, ...}``; a job reads its own entry
(``key`` is its report's file name without ``.json``) and the generation.

>>> import os, tempfile
>>> folder = arbiter_folder(os.path.join(tempfile.mkdtemp(), "arbiter"))
>>> write_json(state_path(folder), {"version": 1, "generation": 3, "grants": {"a": [["h1", 2]]}})
>>> read_grant(folder, "a")
(3, [('h1', 2)])
"""
import json
import math
import os
import re

from .._runtime.private_files import private_folder, read_own_file, write_file_atomically
from .base import MAX_SLOTS, valid_host
from .hints import MAX_REPLICAS

FORMAT_VERSION = 1
STATE_FILE = "arbiter.json"
JOBS = "jobs"
MAX_BYTES = 1 << 20          # a report or the state: far larger than any real one
MAX_CURVE = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class ArbiterFileError(ValueError):
    """A report or state file that is not what this version writes (names the file and
    the field)."""


def valid_name(name):
    """A job name or key: letters, digits, ``_.-``, at most 128, not starting with a dot."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


def arbiter_folder(path):
    """The arbiter's folder and its ``jobs`` subfolder, created 0700 where missing, checked
    (real folders of this user that no one else may write); the folder's absolute path."""
    folder = private_folder(path)
    private_folder(os.path.join(folder, JOBS))
    return folder


def state_path(folder):
    return os.path.join(folder, STATE_FILE)


def report_path(folder, key):
    return os.path.join(folder, JOBS, f"{key}.json")


def report_keys(folder):
    """The keys of the reports in the folder (sorted)."""
    names = os.listdir(os.path.join(folder, JOBS))
    return sorted(name[:-5] for name in names
                  if name.endswith(".json") and valid_name(name[:-5]))


def write_json(path, data):
    write_file_atomically(path, json.dumps(data, separators=(",", ":")).encode())


def read_json(path):
    """The JSON object in ``path`` (a regular file of this user, at most MAX_BYTES);
    FileNotFoundError where it is missing, :class:`ArbiterFileError` where it is not a JSON
    object, ``UnsafePathError`` where another user could have written it."""
    data = read_own_file(path, limit=MAX_BYTES)
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ArbiterFileError(f"{path}: not JSON ({str(e)[:200]})") from None
    if not isinstance(value, dict) or value.get("version") != FORMAT_VERSION:
        raise ArbiterFileError(f"{path}: not a version-{FORMAT_VERSION} file of hvd_adapt's "
                               "arbiter")
    return value


def _count(value, low=0):
    return type(value) is int and low <= value <= MAX_REPLICAS


def _number(value):
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value < 1e300


def _host_slots(value):
    return (isinstance(value, list) and len(value) == 2 and valid_host(value[0])
            and type(value[1]) is int and 0 < value[1] <= MAX_SLOTS)


def _hosts_list(value):
    return isinstance(value, list) and len(value) <= 1 << 16 and all(_host_slots(e)
                                                                     for e in value)


_REPORT_FIELDS = (
    ("job", valid_name, "a name of letters, digits and _.- (at most 128)"),
    ("run", _count, "an integer >= 0"),
    ("generation", lambda v: v is None or _count(v), "null or an integer >= 0"),
    ("min_np", lambda v: _count(v, 1), "an integer >= 1"),
    ("max_np", lambda v: v is None or _count(v, 1), "null or an integer >= 1"),
    ("initial_np", lambda v: _count(v, 1), "an integer >= 1"),
    ("curve", lambda v: v is None or (isinstance(v, list) and 0 < len(v) <= MAX_CURVE and all(
        isinstance(e, list) and len(e) == 2 and _count(e[0], 1) and _number(e[1])
        for e in v)), "null or a non-empty list of [replicas, goodput >= 0]"),
    ("timed", lambda v: _count(v, 1), "an integer >= 1"),
    ("settled", lambda v: type(v) is bool, "a boolean"),
    ("offered", _hosts_list, "a list of [host, slots]"),
    ("holding", lambda v: v is None or (isinstance(v, list) and len(v) <= 1 << 16
                                        and all(valid_host(h) for h in v)),
     "null or a list of host names"),
    ("launching", lambda v: type(v) is bool, "a boolean"),
    ("driver", lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("key"), str)
                                       and isinstance(v.get("boot"), str)
                                       and type(v.get("pidns")) is int),
     "null or {key, boot, pidns}"),
)


def check_report(path, report):
    """``report`` (a parsed report of ``path``) if every field is as it must be, with the
    curve as ``{replicas: goodput}``; :class:`ArbiterFileError` naming the field."""
    for name, check, allowed in _REPORT_FIELDS:
        if name not in report:
            raise ArbiterFileError(f"{path}: {name} is missing")
        if not check(report[name]):
            raise ArbiterFileError(f"{path}: {name} must be {allowed}")
    if report["max_np"] is not None and report["max_np"] < report["min_np"]:
        raise ArbiterFileError(f"{path}: max_np {report['max_np']} is below min_np "
                               f"{report['min_np']}")
    checked = dict(report)
    checked["curve"] = None if report["curve"] is None else {r: g for r, g in report["curve"]}
    checked["offered"] = [tuple(e) for e in report["offered"]]
    return checked


def process_namespace():
    """``{"boot": this boot's id, "pidns": this PID namespace}``: where two processes that
    share both see each other's pids (None where /proc cannot say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return {"boot": boot, "pidns": os.stat("/proc/self/ns/pid").st_ino}
    except OSError:
        return None


def read_report(folder, key):
    return check_report(report_path(folder, key), read_json(report_path(folder, key)))


def read_grant(folder, key):
    """``(generation, [(host, slots)])``: the grant of job ``key`` in the arbiter's state
    (an empty list where the state names no grant for it). FileNotFoundError where there is
    no state yet; :class:`ArbiterFileError` where the state is not what it must be."""
    path = state_path(folder)
    state = read_json(path)
    generation, grants = state.get("generation"), state.get("grants")
    if not _count(generation) or not isinstance(grants, dict):
        raise ArbiterFileError(f"{path}: generation or grants is not what it must be")
    grant = grants.get(key, [])
    if not _hosts_list(grant):
        raise ArbiterFileError(f"{path}: the grant of {key} is not a list of [host, slots]")
    return generation, [tuple(entry) for entry in grant]
