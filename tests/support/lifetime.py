"""Run a worker's command and log when it started and when it ended, with its host.

    python lifetime.py LOG -- python elastic_train.py ...

Each line of LOG (appended, one write each) is ``{"host", "pid", "start"}``
or ``{"host", "pid", "end", "code"}``: the whole life of the worker's
process, which a check of "no host ever ran two jobs' workers at once"
needs (a worker's own logs start after its sync and stop at its last
commit). Signals Horovod's driver sends are passed on to the command.
"""
import json
import os
import signal
import subprocess
import sys
import time


def note(path, entry):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def main():
    log, command = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    note(log, {"host": host, "pid": os.getpid(), "start": time.time()})
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    note(log, {"host": host, "pid": os.getpid(), "end": time.time(), "code": code})
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
