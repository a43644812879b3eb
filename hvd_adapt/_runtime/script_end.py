"""The line a worker leaves when its script ends on its own, for ``hvd-adapt-run``.

``hvd-adapt-run`` (:mod:`hvd_adapt.scheduling.job_supervisor`) relaunches a
job when Horovod's driver gives up on it, but not when the script itself
ended: raised its own error, exited, or drained after a SIGTERM. The
driver's words are the same either way ("failure count == 2 -> stop
running"), so the workers say it: under the supervisor (which puts a fresh
token in ``HVD_ADAPT_RUN_TOKEN`` for each launch), ``hvd_adapt.run`` writes
one line to standard error when an exception or exit of the script's own
leaves the training function (Horovod's ``HorovodInternalError`` and
``HostsUpdatedInterrupt``, a lost peer and a resize, are not the script's)::

    hvd-adapt-run: script ended [<token>] {"rank": 0, "size": 2, "generation": 17, "code": 1, "error": "ValueError: ..."}

``horovodrun`` passes the workers' output on to its own (prefixed with the
rank), where the supervisor reads it; the token tells these lines from
anything a script prints. Standard library only: the supervisor imports it.

>>> line = format_record("t0k", rank=1, size=2, generation=5, error=ValueError("bad"))
>>> read_record("[1]<stderr>:" + line, "t0k")["error"]
'ValueError: bad'
>>> read_record(line, "other") is None
True
"""
import json
import os
import sys

TOKEN_ENV = "HVD_ADAPT_RUN_TOKEN"
MARK = "hvd-adapt-run: script ended"
# An error's message is cut here: the record is one line among the job's output.
_ERROR_LIMIT = 500


def exit_code(error):
    """The exit code ``error`` gives the process when it leaves the script uncaught."""
    if isinstance(error, SystemExit):
        code = error.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    if isinstance(error, KeyboardInterrupt):
        return 130     # 128 + SIGINT: Python re-raises the signal
    return 1


def format_record(token, rank, size, generation, error):
    """The record's line (with its newline) for ``error`` leaving the training function."""
    text = f"{type(error).__name__}: {error}"
    if len(text) > _ERROR_LIMIT:
        text = text[:_ERROR_LIMIT] + "..."
    record = {"rank": rank, "size": size, "generation": generation,
              "code": exit_code(error), "error": text}
    return f"{MARK} [{token}] {json.dumps(record)}\n"


def tell(rank, size, generation, error):
    """Under ``hvd-adapt-run``, write the record of ``error`` ending the script on this rank
    (in a world of ``size``, at commit ``generation``) to standard error; elsewhere nothing.
    Never raises: the script's own error goes on its way whatever happens here."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        return
    try:
        sys.stderr.write(format_record(token, rank, size, generation, error))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass    # stderr closed or its reader gone: the supervisor counts it as a lost worker


def read_record(line, token):
    """The record in ``line`` (a line of the launcher's output, prefix and all) written under
    ``token``, as a dict; None where the line holds none or a malformed one."""
    start = line.find(f"{MARK} [{token}] ")
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(MARK) + len(token) + 4:])
    except ValueError:
        return None
    fields = {"rank": int, "size": int, "generation": int, "code": int, "error": str}
    if not isinstance(record, dict) or any(
            type(record.get(name)) is not kind for name, kind in fields.items()):
        return None
    return record
