"""What ``hvd-adapt-discover`` remembers between its runs: :class:`DiscoveryState`, a small
JSON file in this user's private runtime folder (or ``--state``).

Horovod runs the discovery every second, each run a new process, so the
answer of one run is the next one's starting point: the hosts offered and
when they last changed, the standbys' heartbeats seen, the problems already
said, the hosts being judged lost, and under an arbiter the last grant read
and the runs reported. Every field has a default, so a state file written
by an older version, or none at all, is a fresh start where a field is
missing; a field of the wrong type makes the whole file ignored (with the
reason), never half-read. Standard library only.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "state.json")
>>> save_state(path, DiscoveryState(hosts={"a": 2}, changed_at=5.0))
>>> state = load_state(path)
>>> state.hosts, state.changed_at, state.watch
({'a': 2}, 5.0, [])
"""
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field

from .._runtime.private_files import UnsafePathError, read_own_file, write_file_atomically
from .base import MAX_SLOTS, valid_host


@dataclass
class DiscoveryState:
    """One run's memory, for the next run."""
    # The hosts last offered, in the order offered, with their slots.
    hosts: dict = field(default_factory=dict)
    # When the offer last changed (this machine's clock).
    changed_at: float = 0.0
    # {ready file: [mtime_ns, change seen at or None]}: the standbys' heartbeats seen.
    standbys: dict = field(default_factory=dict)
    # The problems said on stderr by the last run (each is said once while it lasts).
    said: list = field(default_factory=list)
    # Hosts the job's driver had sessions to.
    watch: list = field(default_factory=list)
    # {host: [first missed probe at, probes missed]} for the hosts being judged lost.
    unanswered: dict = field(default_factory=dict)
    # {host: when its sessions were ended}.
    ended: dict = field(default_factory=dict)
    # Whether the missing-keepalive warning was considered.
    keepalive_checked: bool = False
    # Under an arbiter: the last grant read, [(host, slots)] (None: none yet), its
    # generation, and how many reports this job has written.
    grant: list = None
    generation: int = None
    reports: int = 0

    def to_json(self):
        fields = dataclasses.asdict(self)
        fields["hosts"] = [[host, slots] for host, slots in self.hosts.items()]
        return fields


def _finite(value):
    return type(value) in (int, float) and math.isfinite(value)


def _host_slots(value):
    return (isinstance(value, list) and len(value) == 2 and valid_host(value[0])
            and type(value[1]) is int and 0 < value[1] <= MAX_SLOTS)


# Each field's check on what a file holds, and what the message says it must be.
_CHECKS = {
    "hosts": (lambda v: isinstance(v, list) and all(_host_slots(e) for e in v),
              "a list of [host, slots]"),
    "changed_at": (_finite, "a finite number"),
    "standbys": (lambda v: isinstance(v, dict) and all(
        isinstance(s, list) and len(s) == 2 and type(s[0]) is int
        and (s[1] is None or _finite(s[1])) for s in v.values()),
        "{ready file: [mtime_ns, seen at]}"),
    "said": (lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v),
             "a list of strings"),
    "watch": (lambda v: isinstance(v, list) and all(valid_host(h) for h in v),
              "a list of host names"),
    "unanswered": (lambda v: isinstance(v, dict) and all(
        valid_host(h) and isinstance(e, list) and len(e) == 2 and _finite(e[0])
        and type(e[1]) is int and e[1] > 0 for h, e in v.items()),
        "{host: [first missed at, probes missed]}"),
    "ended": (lambda v: isinstance(v, dict) and all(valid_host(h) and _finite(t)
                                                    for h, t in v.items()),
              "{host: time}"),
    "keepalive_checked": (lambda v: type(v) is bool, "a boolean"),
    "grant": (lambda v: v is None or (isinstance(v, list) and all(_host_slots(e) for e in v)),
              "null or a list of [host, slots]"),
    "generation": (lambda v: v is None or (type(v) is int and v >= 0),
                   "null or an integer >= 0"),
    "reports": (lambda v: type(v) is int and v >= 0, "an integer >= 0"),
}


def state_from_json(data):
    """The :class:`DiscoveryState` a file's parsed JSON holds (fields it lacks take their
    defaults); ``ValueError`` naming the first field that is not what it must be."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    for name, (check, allowed) in _CHECKS.items():
        if name in data and not check(data[name]):
            raise ValueError(f"{name} must be {allowed}")
    known = {name: data[name] for name in _CHECKS if name in data}
    if "hosts" in known:
        known["hosts"] = {host: slots for host, slots in known["hosts"]}
    if "grant" in known and known["grant"] is not None:
        known["grant"] = [tuple(entry) for entry in known["grant"]]
    return DiscoveryState(**known)


def load_state(path):
    """The state the last run saved at ``path``; a fresh :class:`DiscoveryState` where there
    is none, or where the file is not one (the reason on stderr). A file of another user,
    or one others may write, raises
    :class:`~hvd_adapt._runtime.private_files.UnsafePathError`."""
    try:
        return state_from_json(json.loads(read_own_file(path, limit=1 << 20)))
    except FileNotFoundError:
        pass
    except UnsafePathError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        sys.stderr.write(f"hvd-adapt-discover: ignoring the state file {path}: {e}\n")
    return DiscoveryState()


def save_state(path, state):
    """Remember ``state`` for the next run; a failed write (a full disk) costs the memory,
    not the answer: a line on stderr, and the run goes on."""
    try:
        write_file_atomically(path, json.dumps(state.to_json()).encode())
    except OSError as e:
        sys.stderr.write(f"hvd-adapt-discover: cannot save the state file: {e}\n")
