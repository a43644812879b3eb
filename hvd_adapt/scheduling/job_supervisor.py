"""``hvd-adapt-run``: a job that Horovod's driver gave up on is launched again, from its
checkpoint, until its script ends.

    hvd-adapt-run --max-restarts 3 -- horovodrun -np 4 --min-np 2 --max-np 8 \\
        --host-discovery-script ./discover.sh python train.py

Horovod's elastic driver stops a job that could go on: when every worker of
a world fails at once ("failure count == N -> stop running", horovod#3264,
#3852), when no host of the last world is left to send the state from ("No
hosts from previous set remaining, unable to broadcast state.",
horovod#3197: every host replaced), when every host is blacklisted, at the
reset limit, or when slots do not come within ``--elastic-timeout``; a
fixed-size ``horovodrun`` stops at the first worker lost. ``hvd-adapt-run``
runs the command (the whole ``horovodrun`` command line, elastic or not)
and, when the run ends that way, runs the same command again; the script
resumes where its last checkpoint left it (``state.load_checkpoint(path)``
before training, ``remaining_epochs_until(..., checkpoint=path)``), so
every sample is still trained once per epoch: what the lost run trained
after that checkpoint is trained again by the next, in its place.

How it tells the script's end from the driver's giving up, on evidence:

- every rank of one world left a script-end record (``hvd_adapt.run``
  writes one when an error or exit of the script's own leaves the training
  function: see :mod:`hvd_adapt._runtime.script_end`): the script ended
  (its own error, a drain after SIGTERM); exit with its code (the lowest
  rank's that is not 0: 1 for an exception, 143 for a drain; horovodrun's
  where every rank said 0), not restarted, whatever horovodrun's own code
  (one told to stop has exited 0 after every rank drained). A record from
  some ranks only is a worker's failure, as Horovod treats it.
- otherwise, horovodrun exited 0: the script finished; exit 0.
- ``hvd-adapt-run`` was asked to stop (SIGTERM, SIGINT): it passed the signal
  to horovodrun, which passes it to the workers (they drain where the
  script installed ``install_sigterm_drain``); never restarted.
- the driver said it gave up (one of the sentences above), or a worker's
  exit ended a fixed-size run, or horovodrun was killed by a signal, or it
  was left with no worker (below): the job could go on; restarted, with a line on standard error that says why, while
  ``--max-restarts`` allows (default 3, counted over the whole job, as
  torchrun's; then it exits with horovodrun's code, saying the budget is
  spent).
- anything else (a usage error, hosts unreachable at the start): no sign
  that a running job was given up; exit with horovodrun's code.

The records travel in horovodrun's output: with ``--output-filename`` the
workers' output goes to files instead, and every failure counts as the
driver's (restarted while the budget lasts).

One copy per job: ``hvd-adapt-run`` holds a lock for as long as it or the
horovodrun it started lives (a ``flock`` on a file, which the kernel frees
when they die, even by SIGKILL); a second copy of the job exits at once with
code 1, naming the first. A job is its command line in its working folder
(the lock file is in this user's runtime folder), or ``--lock PATH``: put
that beside the checkpoint on the shared file system where the job may be
launched from several machines. horovodrun runs in a session of its own,
gets SIGTERM if ``hvd-adapt-run`` dies (``PR_SET_PDEATHSIG``), and every
process it leaves behind when it ends (orphans come to ``hvd-adapt-run``:
``PR_SET_CHILD_SUBREAPER``) is ended before the next launch as horovodrun
ends its workers (SIGTERM, SIGKILL 5 s later): two runs never overlap on
this machine. A horovodrun whose driver said it stopped the job but that is
still there 10 s later, or that has had no worker for 10 s after its workers
failed, is killed and the job launched again: Horovod 0.28 hangs there at
times, and waits for ever when every host is lost and comes back under the
same names (see ``DRIVER_EXIT_SECONDS``). Each launch's environment carries ``HVD_ADAPT_RESTARTS`` (0,
1, ...). Standard library only: it starts in milliseconds.
"""
import argparse
import errno
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from .._runtime.parent_death import become_subreaper, death_signal_setter
from .._runtime.private_files import (UnsafePathError, hold_lock, read_own_file,
                                      user_runtime_folder)
from .._runtime.script_end import TOKEN_ENV
from .launcher_output import LineSplitter, RunOutput

log = logging.getLogger("hvd_adapt")

DEFAULT_MAX_RESTARTS = 3
RESTARTS_ENV = "HVD_ADAPT_RESTARTS"
# What horovodrun gives its workers between SIGTERM and SIGKILL (GRACEFUL_TERMINATION_TIME_S),
# given here to the processes a run left behind.
LEFTOVER_GRACE_SECONDS = 5.0
# Once its driver said it stopped the job, horovodrun only ends its workers (SIGTERM, SIGKILL
# 5 s later) and exits. Horovod 0.28 hangs there at times: a worker that registered with the
# driver's rendezvous and then died leaves a thread waiting in the registry's barrier, which
# horovodrun joins forever, deaf to SIGTERM (seen on the namespace cluster after "No hosts
# from previous set remaining" when every host crashed). And where every worker was lost
# that way, the driver may never say it stopped: it waits for slots, and when the hosts come
# back under the same names (a StatefulSet's pods) it starts no worker there (it takes their
# slots for still filled) and waits for ever. A horovodrun still there twice its workers'
# grace after its driver stopped, or that long without any worker after workers failed, is
# SIGKILLed; the workers it leaves are then ended as any run's leftovers are.
DRIVER_EXIT_SECONDS = 10.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(returncode):
    """A shell's exit status for a Popen ``returncode`` (negative: killed by that signal)."""
    return 128 - returncode if returncode < 0 else returncode


def default_lock_path(command, cwd):
    """The lock of the job ``command`` run in ``cwd``, in this user's runtime folder."""
    key = hashlib.sha256(json.dumps([cwd, command]).encode()).hexdigest()[:24]
    return os.path.join(user_runtime_folder("jobs"), f"{key}.lock")


class JobLocked(RuntimeError):
    """Another copy of the job holds its lock; the message names it."""


def _open_standard_streams():
    """Put /dev/null on each of descriptors 0-2 that is closed (a daemon's, a cron line's
    ``>&-``), so that no file opened later takes a standard stream's number: the lock on
    descriptor 1 would be overwritten by the job's output, and horovodrun's standard output
    would replace the lock it inherits."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)      # the lowest free descriptor: this one


def take_lock(path, command):
    """Hold the job's lock at ``path`` (its descriptor) and write who holds it into the
    file; :class:`JobLocked` naming the holder where another copy runs."""
    try:
        fd = hold_lock(path)
    except BlockingIOError:
        try:
            holder = json.loads(read_own_file(path, limit=1 << 16))
            who = (f"pid {holder['pid']} on {holder['host']} since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}")
        except (OSError, ValueError, KeyError, TypeError):
            who = "a process that has not yet said who it is"
        raise JobLocked(f"this job is already running ({who}; lock {path}): not starting a "
                        f"second copy") from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
          "cwd": os.getcwd(), "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
    return fd


def _forward(source, target, splitter):
    """Copy the pipe ``source`` to the descriptor ``target`` until its end, reading every
    line; a target that fails (a closed terminal) stops the copy, not the reading, so
    horovodrun never blocks on a full pipe."""
    copying = True
    while True:
        try:
            data = os.read(source, 1 << 16)
        except InterruptedError:
            continue
        if not data:
            break
        splitter.feed(data)
        while copying and data:
            try:
                data = data[os.write(target, data):]
            except InterruptedError:
                continue
            except OSError:
                copying = False
    splitter.close()
    os.close(source)


def _parents():
    """``{pid: parent pid}`` of every process."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def _command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def _children():
    """This process's children, as ``{pid: command line}`` (zombies reaped first: call it
    only once horovodrun was waited for)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return {}
        if pid == 0:
            break
    me, found = os.getpid(), {}
    for pid, parent in _parents().items():
        if parent == me:
            command = _command_line(pid)
            if command is not None:
                found[pid] = command
    return found


def _exports_rank(pid):
    """Whether process ``pid`` runs a worker's command: its command line exports the slot's
    rank (``sh -c 'env ... HOROVOD_RANK=...'`` on this host, ``ssh HOST '...
    HOROVOD_RANK=...'`` to another), or its environment holds it where a shell exec'd that
    command (bash, /bin/sh on RHEL or Fedora, does: the command line is then the script's
    own). The environment is evidence only where this process's own has no HOROVOD_RANK
    (else every descendant inherits it)."""
    command = _command_line(pid)
    if command is not None and "HOROVOD_RANK=" in command:
        return True
    if "HOROVOD_RANK" in os.environ:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return any(entry.startswith(b"HOROVOD_RANK=") for entry in f.read().split(b"\0"))
    except OSError:
        return False


def _worker_sessions(root):
    """How many of ``root``'s descendants are worker sessions horovodrun started (the first
    process of each line of descent that :func:`_exports_rank`)."""
    children = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    sessions, todo = 0, list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if _exports_rank(pid):
            sessions += 1
        else:
            todo += children.get(pid, ())
    return sessions


class JobSupervisor:
    """Runs ``command`` until its script ends, the budget of ``max_restarts`` is spent, or
    it is asked to stop; :meth:`run` returns the exit code."""

    def __init__(self, command, max_restarts=DEFAULT_MAX_RESTARTS, lock_path=None):
        self.command = list(command)
        self.max_restarts = max_restarts
        self.lock_path = lock_path      # None: default_lock_path's, found in run()
        self.stop_signal = None
        self.lost_every_worker = False   # the last run's horovodrun was killed for it
        self._proc = None

    # -- signals -------------------------------------------------------------------------
    def _on_stop_signal(self, signum, frame):
        self.stop_signal = signum
        proc = self._proc
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    # -- one run ---------------------------------------------------------------------------
    def launch(self, restarts):
        """Run the command once; returns ``(returncode, RunOutput)``."""
        output = RunOutput(os.urandom(8).hex())
        env = dict(os.environ, **{TOKEN_ENV: output.token, RESTARTS_ENV: str(restarts)})
        self._proc = subprocess.Popen(
            self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=(self._lock_fd,),
            preexec_fn=self._set_death_signal)
        if self.stop_signal is not None:
            # The signal came while it started: it gets it now.
            self._proc.send_signal(self.stop_signal)
        copies = []
        for pipe, target in ((self._proc.stdout, 1), (self._proc.stderr, 2)):
            splitter = LineSplitter(output.read_line)
            thread = threading.Thread(target=_forward, args=(os.dup(pipe.fileno()), target,
                                                             splitter),
                                      name="hvd_adapt-forward", daemon=True)
            pipe.close()
            thread.start()
            copies.append(thread)
        returncode = self._wait(self._proc, output)
        self._end_leftovers()
        for thread in copies:
            thread.join()
        return returncode, output

    def _wait(self, proc, output):
        """Wait for horovodrun's end. SIGKILL it where its driver said it stopped the job
        ``DRIVER_EXIT_SECONDS`` ago and its workers are gone, or where it has had no worker
        for that long after workers failed (``self.lost_every_worker``). Either way the
        evidence is the process tree's as well as the output's: workers of this run were
        seen and none is left (a line of output alone may be a script's, and a horovodrun
        whose workers run is not hanging)."""
        self.lost_every_worker = False
        seen_workers, alone_since = False, None
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if _worker_sessions(proc.pid):
                seen_workers, alone_since = True, None
                continue
            stopped = output.seconds_since_the_driver_gave_up()
            failed = output.workers_failed()
            if not seen_workers or (stopped is None and not failed):
                continue
            if stopped is not None and stopped > DRIVER_EXIT_SECONDS:
                log.warning("Horovod's driver stopped the job %.0f s ago, its workers are gone "
                            "and horovodrun has not exited (it hangs at times after a stop): "
                            "killing it", stopped)
                proc.kill()
                return proc.wait()
            alone_since = alone_since or time.monotonic()
            if failed and time.monotonic() - alone_since > DRIVER_EXIT_SECONDS:
                log.warning("horovodrun has had no worker for %.0f s, its last ones failed (%s), "
                            "and its driver waits on: the job's state is gone but for its "
                            "checkpoint; killing it", DRIVER_EXIT_SECONDS, failed)
                self.lost_every_worker = True
                proc.kill()
                return proc.wait()

    def _end_leftovers(self):
        """End what the run left on this machine (orphans of its workers' launchers, which
        came to this process): their launcher is gone, so the job they belonged to has ended.
        What is still there a second after horovodrun (helpers that end once its pipes
        close, such as multiprocessing's resource tracker, are gone by then) gets SIGTERM,
        then SIGKILL after the grace horovodrun gives its workers."""
        deadline = time.monotonic() + 1.0
        while _children() and time.monotonic() < deadline:
            time.sleep(0.05)
        warned = set()
        while True:
            children = _children()
            if not children:
                return
            new = {pid: cmd for pid, cmd in children.items() if pid not in warned}
            if new:
                log.warning("horovodrun ended and left %d process(es) of its run on this "
                            "machine: %s; ending them (SIGTERM, SIGKILL after %g s)", len(new),
                            "; ".join(f"{pid}: {cmd[:120]}" for pid, cmd in new.items()),
                            LEFTOVER_GRACE_SECONDS)
                for pid in new:
                    _signal(pid, signal.SIGTERM)
                warned.update(new)
            deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
            while _children() and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in _children():
                if pid in warned:
                    _signal(pid, signal.SIGKILL)

    # -- the job ---------------------------------------------------------------------------
    def judge(self, returncode, output):
        """``(restart, exit code, why)`` for a run that ended with ``returncode``."""
        code = exit_status(returncode)
        ended = output.script_ended()
        # Every rank's own record of its end outranks horovodrun's code: a horovodrun told to
        # stop has exited 0 after every rank drained with 143 (seen once, elastic, on a loaded
        # machine), and a drained job must not look finished to whatever runs it.
        if ended is not None and (ended[0] or returncode):
            # Where horovodrun failed, the job did: never 0, even where every rank said 0.
            return False, ended[0] or code, f"the script ended: {ended[1]}"
        if returncode == 0:
            return False, 0, "the script finished"
        if self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name
            return False, code, f"stopped by {name} (passed on to horovodrun)"
        reason = output.driver_gave_up()
        if reason is None and self.lost_every_worker:
            reason = ("every worker was lost and Horovod's driver waited on without one (it "
                      "does when the lost hosts come back under the same names)")
        if reason is None and returncode < 0:
            reason = f"horovodrun was killed by {signal.Signals(-returncode).name}"
        if reason is None:
            return False, code, ("horovodrun exited with %d and its output shows no sign that "
                                 "a running job was given up (see above)" % code)
        said = output.records_said()
        if said:
            reason += f"; the script ended on some ranks only ({said})"
        return True, code, reason

    def run(self):
        """Hold the job's lock and run the command until its script ends, the restart budget
        is spent or a signal stops it; returns the exit code."""
        _open_standard_streams()
        try:
            if self.lock_path is None:
                # In this user's runtime folder, which another local user may have planted.
                self.lock_path = default_lock_path(self.command, os.getcwd())
            self._lock_fd = take_lock(self.lock_path, self.command)
        except (JobLocked, UnsafePathError) as e:
            log.error("%s", e)
            return 1
        except OSError as e:      # a folder, a missing folder, no permission
            log.error("cannot take the job's lock %s: %s; not starting the job",
                      self.lock_path, e.strerror or e)
            return 1
        self._set_death_signal = death_signal_setter(signal.SIGTERM)
        become_subreaper()
        previous = {sig: signal.signal(sig, self._on_stop_signal) for sig in _STOP_SIGNALS}
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(self._lock_fd)

    def _supervise(self):
        restarts, code = 0, None
        while True:
            if self.stop_signal is not None:
                # Stopped before a run: it is not started.
                code = 128 + self.stop_signal if code is None else code
                log.info("stopped by %s before the next run; exiting with %d",
                         signal.Signals(self.stop_signal).name, code)
                return code
            try:
                returncode, output = self.launch(restarts)
            except OSError as e:
                log.error("cannot run %r: %s", self.command[0], e)
                return 127 if e.errno == errno.ENOENT else 126
            restart, code, why = self.judge(returncode, output)
            if not restart:
                if restarts or code != 0:
                    log.info("%s; exiting with %d%s", why, code,
                             f" after {restarts} restart(s)" if restarts else "")
                return code
            if restarts >= self.max_restarts:
                log.error("the job could go on (%s), but the restart budget is spent "
                          "(--max-restarts %d): exiting with %d", why, self.max_restarts, code)
                return code
            restarts += 1
            log.warning("restart %d of %d: the job could go on (%s); launching the same "
                        "command again (the script resumes from its last checkpoint)",
                        restarts, self.max_restarts, why)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _restart_budget(text):
    """``--max-restarts``'s value; a usage error names the bad value and the range."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def parser():
    """``hvd-adapt-run``'s command line."""
    p = argparse.ArgumentParser(
        prog="hvd-adapt-run",
        description="Run a horovodrun command (after --) and launch it again from the job's "
                    "last checkpoint when Horovod's driver gives up while the job could go "
                    "on (see hvd_adapt.scheduling.job_supervisor).")
    p.add_argument("--max-restarts", type=_restart_budget, default=DEFAULT_MAX_RESTARTS,
                   metavar="N",
                   help="restarts allowed over the whole job (default %(default)s)")
    p.add_argument("--lock", default=None, metavar="PATH",
                   help="the job's lock file (default: one per command line and working "
                        "folder in this user's runtime folder); beside the checkpoint on a "
                        "shared file system where the job may be launched from several "
                        "machines")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the horovodrun command line, after --")
    return p


def parse(p, argv=None):
    """``hvd-adapt-run``'s arguments from ``argv``, and the command after ``--``; a usage error
    names a bad value."""
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("the horovodrun command is missing (give it after --)")
    if args.lock == "":
        p.error("--lock must name a file, got ''")
    return args, command


def main(argv=None):
    """``hvd-adapt-run``."""
    args, command = parse(parser(), argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s hvd-adapt-run: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return JobSupervisor(command, args.max_restarts, args.lock).run()


if __name__ == "__main__":
    sys.exit(main())
