"""What horovodrun's output says about how a run ended, read as it passes through.

``hvd-adapt-run`` forwards horovodrun's standard output and error unchanged
and reads every line on the way (:class:`LineSplitter`, one per stream,
into one :class:`RunOutput`). Two kinds of evidence are kept:

- the workers' script-end records (:mod:`hvd_adapt._runtime.script_end`):
  a rank whose script raised its own error or exited (a drain's 143);
- the driver's reason for giving up on a running job, in Horovod's own
  words (Horovod 0.28's elastic driver: "failure count == N -> stop
  running", "No hosts from previous set remaining, unable to broadcast
  state.", the blacklist, the reset limit, slots that never came), or, for
  a fixed-size job, the first worker whose exit ended the run (horovodrun
  ``--gloo``, ``mpirun``).

Standard library only.

>>> out = RunOutput("t0k")
>>> splitter = LineSplitter(out.read_line)
>>> splitter.feed(b"ERROR:root:failure count == 2 -> stop running\\n")
>>> out.driver_gave_up()
'every worker of the world failed ("failure count == 2 -> stop running"; horovod#3264, #3852)'
>>> out.script_ended() is None
True
"""
import re
import threading
import time

from .._runtime.script_end import read_record

# Where a line ends: horovodrun's prefixer ends a worker's at either (LineSplitter).
_LINE_END = re.compile(rb"[\r\n]")
# A line longer than this is cut: the evidence sits in short lines, and a script's
# output without line ends must not grow the buffer without bound.
LINE_LIMIT = 1 << 16

# The driver's sentences (horovod/runner/elastic/registration.py and driver.py, 0.28),
# each with what it means for the job, the most telling first.
GIVING_UP = (
    (re.compile(r"No hosts from previous set remaining, unable to broadcast state\."),
     "no host of the last world is left to send the state to the next (horovod#3197)"),
    (re.compile(r"failure count == \d+ -> stop running"),
     "every worker of the world failed"),
    (re.compile(r"blacklisted slots count == \d+ -> stop running"),
     "every host of the world is blacklisted"),
    (re.compile(r"reset count \d+ has exceeded limit \d+ -> stop running"),
     "the reset limit (horovodrun --reset-limit) was reached"),
    (re.compile(r"Timed out waiting for minimum number of slots to become available"),
     "fewer slots than --min-np came within --elastic-timeout"),
    # Said first, with the cause (above) in the traceback after it.
    (re.compile(r"failed to activate new hosts -> stop running"),
     "the driver could not start the next world"),
)
# Issues of Horovod's where users lost jobs this way, named in the restart's line.
_ISSUES = {"every worker of the world failed": "horovod#3264, #3852"}
# horovodrun (Gloo) and mpirun name the worker whose exit ended the run on the lines after.
_FIRST_FAILED = re.compile(r"The first process to do so was:")
_PROCESS_NAME = re.compile(r"^\s*Process name:\s+(.+?)\s*$")
_EXIT_CODE = re.compile(r"^\s*Exit code:\s+(-?\d+)\s*$")
_MPI_SIGNAL = re.compile(r"mpirun noticed that process rank (\d+) with PID \d+ on node (\S+) "
                         r"exited on signal (\d+)")
# horovodrun (Gloo, elastic or not) on each worker that exited non-zero.
_WORKER_EXIT = re.compile(r"^Process (\S+) exit with status code (-?\d+)\.")
# A worker's line as the launcher forwards it (optionally after a timestamp): not the driver's.
# horovodrun --gloo tags it "[0]<stdout>:"; horovodrun's MPI mode runs mpirun with
# --tag-output, Open MPI's "[1,0]<stdout>:", or with MPICH's and Intel MPI's -l, "[0] ".
_WORKER_LINE = re.compile(r"^[^\[]*\[\d+(?:,\d+)?\](?:<std(?:out|err|diag)>:| )")


class RunOutput:
    """The evidence one run's output holds; :meth:`read_line` takes each line (from any
    thread). ``token``: the script-end records' token of this launch."""

    def __init__(self, token):
        self.token = token
        self.records = []
        self._reason = None           # (its index in GIVING_UP, the driver's sentence, meaning)
        self._first_failed = None     # {"name": ..., "code": ...} of the worker named
        self._after_first_failed = False
        self._gave_up_at = None       # time.monotonic() when the driver said it stopped the job
        self._failed_exits = []       # "worker: code" of the workers that exited non-zero
        self._lock = threading.Lock()

    def read_line(self, line):
        record = read_record(line, self.token)
        with self._lock:
            if record is not None:
                self.records.append(record)
                return
            if _WORKER_LINE.match(line):
                return
            self._read_launcher_line(line)

    def _read_launcher_line(self, line):
        for index, (pattern, meaning) in enumerate(GIVING_UP):
            if self._reason is not None and self._reason[0] <= index:
                break
            found = pattern.search(line)
            if found:
                self._reason = (index, found.group(0), meaning)
                self._gave_up_at = self._gave_up_at or time.monotonic()
                return
        found = _WORKER_EXIT.match(line)
        if found:
            if found.group(2) != "0":
                self._failed_exits.append(f"worker {found.group(1)}: {found.group(2)}")
            return
        found = _MPI_SIGNAL.search(line)
        if found and self._first_failed is None:
            self._first_failed = {"name": f"rank {found.group(1)} on {found.group(2)}",
                                  "code": f"signal {found.group(3)}"}
            return
        if _FIRST_FAILED.search(line):
            self._after_first_failed = True
            self._first_failed = self._first_failed or {}
            return
        if self._after_first_failed:
            for key, pattern in (("name", _PROCESS_NAME), ("code", _EXIT_CODE)):
                found = pattern.match(line)
                if found and key not in self._first_failed:
                    self._first_failed[key] = found.group(1)
            if len(self._first_failed) == 2:
                self._after_first_failed = False

    def driver_gave_up(self):
        """Why the launcher ended a job that was running, in a sentence quoting it; None
        where its output holds no such sign (a usage error, a host unreachable at start)."""
        with self._lock:
            first = self._first_failed
            if self._reason is not None:
                # The exits that follow are the driver stopping the workers, not a cause.
                _, sentence, meaning = self._reason
                issue = _ISSUES.get(meaning)
                return f'{meaning} ("{sentence}"' + (f"; {issue})" if issue else ")")
            if first and "name" in first:
                return (f"a worker's exit ended the run ({first['name']} exited first, with "
                        f"{first.get('code', '?')})")
            return None

    def workers_failed(self):
        """The workers horovodrun said exited non-zero, ``worker N: code`` in a string (the
        last few), or None."""
        with self._lock:
            if not self._failed_exits:
                return None
            return ", ".join(self._failed_exits[-4:])

    def seconds_since_the_driver_gave_up(self):
        """Seconds since the driver said it stopped the job (None before)."""
        with self._lock:
            return None if self._gave_up_at is None else time.monotonic() - self._gave_up_at

    def script_ended(self):
        """Where every rank of one world (a size and a commit: ranks 0 to size - 1 at the same
        generation) left a script-end record, ``(code, description)`` with the exit code and
        error of the lowest rank that did not exit 0 (rank 0's where all did: a rank's sys.exit(0)
        beside another's error is no success); else None."""
        with self._lock:
            worlds = {}
            for record in self.records:
                key = (record["size"], record["generation"])
                worlds.setdefault(key, {})[record["rank"]] = record
        for (size, generation), ranks in worlds.items():
            if size > 0 and set(ranks) == set(range(size)):
                first = next((ranks[r] for r in range(size) if ranks[r]["code"]), ranks[0])
                return first["code"], (f"every rank of the world of {size} ended its script at "
                                       f"commit {generation}; rank {first['rank']}: "
                                       f"{first['error']}")
        return None

    def records_said(self):
        """The records left, for a log line: ``rank R: error`` each, or None."""
        with self._lock:
            if not self.records:
                return None
            return "; ".join(f"rank {r['rank']} of {r['size']}: {r['error']}"
                             for r in self.records[:4]) + \
                (f"; and {len(self.records) - 4} more" if len(self.records) > 4 else "")


class LineSplitter:
    """Bytes of one stream in, lines out (decoded, without their end, empty ones left out) to
    ``on_line``. A line ends at a newline or a carriage return, as horovodrun's prefixer
    (safe_shell_exec.prefix_connection) ends a worker's: a progress bar's updates (tqdm's,
    on standard error, end with none but the next one's carriage return) are lines of their
    own, each with its rank's prefix, and the driver's sentence or a script-end record
    written after the last is a line of its own, not the tail of a bar's endless line."""

    def __init__(self, on_line):
        self.on_line = on_line
        self._partial = bytearray()
        self._cut = False     # the current line was longer than LINE_LIMIT: its start is out

    def feed(self, data):
        self._partial += data
        while True:
            end = _LINE_END.search(self._partial)
            end = -1 if end is None else end.start()
            if end < 0:
                if len(self._partial) > LINE_LIMIT:
                    # Keep the line's start (where its evidence is), drop the rest of it.
                    if not self._cut:
                        self._emit(bytes(self._partial[:LINE_LIMIT]))
                        self._cut = True
                    del self._partial[:]
                return
            line = bytes(self._partial[:end])
            del self._partial[:end + 1]
            if self._cut:
                self._cut = False
            else:
                self._emit(line[:LINE_LIMIT])

    def close(self):
        if self._partial and not self._cut:
            self._emit(bytes(self._partial[:LINE_LIMIT]))
            self._partial = bytearray()

    def _emit(self, line):
        if line:
            self.on_line(line.decode("utf-8", "replace"))
