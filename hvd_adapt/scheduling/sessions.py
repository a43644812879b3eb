"""The elastic driver's remote sessions to each host, found among its processes and ended
for a host that the job lost; and whether ssh has a keepalive.

**The Horovod behaviour worked around** (0.28.1, horovod/runner/elastic/driver.py
and registration.py): after a failure the driver forms the next world only once
every slot of the old one has recorded a state, READY (the worker asked for its
new rank) or SUCCESS/FAILURE (the command that runs it, ``ssh <host> ...``,
exited). A host cut off silently (a link or switch down, no reset) never
answers, and its ssh session, without a keepalive, never ends: the survivors
wait until the link heals. Only blacklisting a host makes the driver end that
host's sessions (its host event, common/util/safe_shell_exec.py), and a host
that discovery merely stops listing keeps them. So ``hvd-adapt-discover``,
which the driver runs every poll and which probes the hosts' sshd anyway, ends
the sessions of a host that has stopped answering (:func:`end`): the command
exits non-zero, the driver records the slot's failure, blacklists the host for
its cooldown and forms the next world from the hosts left.

How the sessions are found: Horovod runs each command, the discovery script
included, through ``safe_shell_exec``, whose middleman process (a
``multiprocessing`` spawn child of the driver) starts a session of its own
(``setsid``). So this script's session leader is such a middleman, its parent
is the driver, and the driver's other sessions hold its commands; a process
there whose program is ``ssh`` or ``kubectl`` (the MPI Operator's
``kubexec.sh``) and which names the host as a whole argument is that host's
session. Run any other way (by hand, from a test), no driver is found and
nothing is ended. Linux only (``/proc``); elsewhere nothing is found.

Standard library only.

>>> find_driver(pid=1) is None
True
>>> driver_key() is None          # run by hand, not by a driver
True
"""
import os
import re
import shutil
import signal
import subprocess

from .._runtime.horovod_internals import REMOTE_PROGRAMS, SPAWN_MARK
from .._runtime.rendezvous import ANSWERED, RESET_KEY, RESET_SCOPE, RendezvousServer



def _argv(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _stat(pid):
    """``(ppid, sid, start time)`` of ``pid`` (the start in clock ticks after boot), or None
    where it is gone (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name (field 2) may hold spaces and parentheses: split after it.
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def find_driver(pid=None):
    """The pid of the elastic driver that runs this process as its discovery script
    (through a middleman that leads this session), or None when it is run any other way."""
    pid = os.getpid() if pid is None else pid
    try:
        leader = os.getsid(pid)
    except OSError:
        return None
    if leader == pid or SPAWN_MARK not in _argv(leader):
        return None
    stat = _stat(leader)
    if stat is None or stat[0] < 1:
        return None
    # The driver spawned the middleman with its own interpreter, so both run one program.
    # A middleman whose driver is gone was handed to init (or a subreaper), which runs
    # another; a driver that is PID 1 (a launcher container's command) is still found.
    program = _program(leader)
    if program is None or _program(stat[0]) != program:
        return None
    return stat[0]


def _program(pid):
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def driver_key():
    """``"<pid>.<start time>"`` of the elastic driver that runs this discovery: a key of its
    job that a later job never shares, even where it reuses the pid; None when run any other
    way."""
    driver = find_driver()
    stat = None if driver is None else _stat(driver)
    return None if stat is None else f"{driver}.{stat[2]}"


def running(key):
    """True while the process a :func:`driver_key` names still runs (same pid, same start
    time: a reused pid is not it); False once it has exited."""
    pid, _, start = key.partition(".")
    if not (pid.isdigit() and start.isdigit()):
        return False
    stat = _stat(int(pid))
    return stat is not None and stat[2] == int(start)


def sessions(driver, hosts):
    """``{host: [pids]}``: the driver's processes (outside this process's session) that
    carry a command to one of ``hosts``."""
    if driver is None or not hosts:
        return {}
    own_session = os.getsid(0)
    table = _process_table()
    middlemen = {pid for pid, (ppid, sid, _) in table.items()
                 if ppid == driver and sid == pid and pid != own_session}
    found = {}
    for pid, (_, sid, _) in table.items():
        if sid not in middlemen:
            continue
        argv = _argv(pid)
        if not argv or os.path.basename(argv[0]) not in REMOTE_PROGRAMS:
            continue
        for host in hosts:
            if host in argv[1:]:
                found.setdefault(host, []).append(pid)
    return found


def _process_table():
    """``{pid: (ppid, sid, start)}`` of every process (empty without /proc)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:        # no /proc: nothing can be found, nothing is ended
        return table
    for name in names:
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


# How a worker's command names its host: Horovod puts the slot's variables before the
# command (runner/gloo_run.py), in the shell's command line locally and inside ssh's
# remote command; a shell that execs the command leaves it in the environment.
_HOST_VARIABLE = re.compile(r"(?:^|[\s'\";])HOROVOD_HOSTNAME=([^\s'\";]+)")


def _named_host(pid):
    found = _HOST_VARIABLE.search(" ".join(_argv(pid)))
    if found:
        return found.group(1)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"HOROVOD_HOSTNAME="):
            return entry.split(b"=", 1)[1].decode(errors="replace") or None
    return None


def commands(driver):
    """``({host: [pids]}, launching)``: the driver's worker commands by the host each runs
    a worker on (remote or local: the ``HOROVOD_HOSTNAME`` its command carries), and
    whether a command names no host yet (a middleman just started, not yet running its
    command: a launch under way). ``({}, False)`` without a driver. Where a host has none,
    the driver runs nothing there: the worker's command has exited (or never started)."""
    if driver is None:
        return {}, False
    own_session = os.getsid(0)
    table = _process_table()
    found, launching = {}, False
    for pid, (ppid, sid, _) in table.items():
        if ppid != driver or pid == own_session or SPAWN_MARK not in _argv(pid):
            continue
        # Until the middleman has called setsid its command has not started.
        members = [p for p, (_, s, _) in table.items() if s == pid] if sid == pid else []
        host = next(filter(None, map(_named_host, members)), None)
        if host is None:
            launching = True
        else:
            found.setdefault(host, []).extend(members)
    return found, launching


def runs_a_worker_here(driver, remote):
    """Whether the driver runs a worker on its own host: a worker command of its
    (:func:`commands`) whose session holds none of the ``remote`` sessions' processes
    (``{host: pids}``, :func:`sessions`)."""
    found, _ = commands(driver)
    remote_pids = {pid for pids in remote.values() for pid in pids}
    return any(remote_pids.isdisjoint(members) for members in found.values())


# horovodrun names its rendezvous server in every worker's command (gloo_run.get_run_command).
_SERVER_ADDRESS = re.compile(r"HOROVOD_GLOO_RENDEZVOUS_ADDR=([0-9A-Za-z.:_-]+)")
_SERVER_PORT = re.compile(r"HOROVOD_GLOO_RENDEZVOUS_PORT=(\d+)")


def rendezvous_server(pids):
    """The job's rendezvous server, as the command one of these sessions carries names it
    (a :class:`~hvd_adapt._runtime.rendezvous.RendezvousServer`), or None."""
    for pid in pids:
        command = " ".join(_argv(pid))
        address, port = _SERVER_ADDRESS.search(command), _SERVER_PORT.search(command)
        if address and port:
            return RendezvousServer(address.group(1), port.group(1))
    return None


def peers_reset(pids, timeout=1.0):
    """Whether the workers of the job these sessions belong to have reset (hvd_adapt's reset
    marker is on its rendezvous server); False where no server is named or it does not
    answer within ``timeout`` s."""
    server = rendezvous_server(pids)
    if server is None:
        return False
    reached, status, _ = server.reach("GET", f"/{RESET_SCOPE}/{RESET_KEY}", timeout=timeout)
    return reached == ANSWERED and status == 200


def end(pids):
    """End these sessions (SIGKILL: the link is gone, there is nothing to flush); the
    pids that were still there."""
    ended = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
        except (ProcessLookupError, PermissionError):    # gone, or its pid reused
            pass
    return ended


def keepalive_off(host, timeout=5.0):
    """True where ssh's effective settings for ``host`` (``ssh -G``) have no keepalive
    (``ServerAliveInterval 0``); False where they have one or ssh cannot say."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return False
    try:
        out = subprocess.run([ssh, "-G", host], capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key.lower() == "serveraliveinterval":
            return value.strip() == "0"
    return False
