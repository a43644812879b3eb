"""Warm standby workers: a new worker boots while the job trains, and joins in a moment.

Horovod's elastic driver starts a new worker only once every survivor waits
in the reset's rendezvous, so the survivors wait for its whole start-up (a
container, ``import torch``, the script up to ``init()``): seconds, 8-40 on
a cluster. A standby does that start-up before the host is offered:

1. ``hvd-adapt-worker --standby --standby-dir DIR -- python train.py ...``
   on the new host (its pod's command, or started by hand) runs the script,
   which boots as usual and blocks in :func:`hvd_adapt.init` (see
   :func:`wait_for_handover`); then the standby writes ``DIR/<host>/<pid>.json``
   and keeps its modification time fresh (a heartbeat) while it waits.
2. ``hvd-adapt-discover --standby-dir DIR`` offers a new host only once it
   has such a file whose heartbeat it has seen beat (:mod:`.ready`), so the
   survivors train on until the worker is ready.
3. Horovod launches ``hvd-adapt-worker --standby-dir DIR -- python train.py ...``
   for the slot: this launch stub (standard library only, milliseconds to
   start) claims the standby (an atomic rename of its file), passes it the
   slot's environment (:func:`slot_environment`), working directory and
   standard streams over a Unix socket, forwards signals to it and exits
   with its exit code. Where no standby is ready, or anything about the
   claim fails, it runs the command itself (a cold start).

The standby's supervisor, not the script, holds the socket: it sees the
script's exit status, and when the stub dies (Horovod's SIGKILL five
seconds after a SIGTERM) it kills the script in turn; the script is killed
by the kernel when its supervisor dies (``PR_SET_PDEATHSIG``), so no worker
outlives its slot either way. The supervisor serves one slot; start another
for the next join.

Trust: the stub hands its slot only to a standby of its own user. The
folder ``DIR/<host>`` must belong to that user and be writable by no one
else (the supervisor creates it so; the stub starts cold on any other), the
ready file must be a regular file of that user, its socket too, and the
process listening on the socket must be that user's and the very pid the
ready file names (``SO_PEERCRED``). ``DIR`` itself may be shared (a volume,
``/tmp``).
"""
import argparse
import json
import logging
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

from .._runtime.parent_death import death_signal_setter
from .._runtime.private_files import (UnsafePathError, check_owned, private_folder,
                                      read_own_file, user_runtime_folder, write_file_atomically)
from .ready import ready_files

log = logging.getLogger("hvd_adapt")

ENV_FD = "HVD_ADAPT_STANDBY_FD"
HEARTBEAT_SECONDS = 1.0
# Seconds a claimed standby waits for its stub to connect before it offers itself again.
CLAIM_SECONDS = 10.0
# After the stub is gone, the script has this long to end on the SIGTERM (as horovodrun gives).
KILL_AFTER_SECONDS = 5.0
_HEADER = struct.Struct("!Q")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# The slot's variables a script needs (Horovod's rendezvous and ranks, the launcher's
# settings for the library, NCCL, Gloo and MPI, the devices of the slot); the rest of the
# launcher's environment (its secrets among them) stays with the stub.
SLOT_PREFIXES = ("HOROVOD_", "HVD_ADAPT_", "NCCL_", "GLOO_", "OMPI_", "PMIX_")
SLOT_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")
# A ready file is a few hundred bytes; more is not one.
_READY_FILE_LIMIT = 1 << 16
_UCRED = struct.Struct("3i")


# -- messages: a length header carrying the file descriptors, then JSON ----------------------
def _send(sock, message, fds=()):
    data = json.dumps(message).encode()
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exactly(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(sock, max_fds=0):
    fds = []
    if max_fds:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
        if not header:
            raise EOFError("the other end closed the connection")
        header += _recv_exactly(sock, _HEADER.size - len(header))
    else:
        header = _recv_exactly(sock, _HEADER.size)
    (length,) = _HEADER.unpack(header)
    return json.loads(_recv_exactly(sock, length)), fds


def peer_credentials(sock):
    """``(pid, uid)`` of the process at the other end of the Unix socket ``sock``."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _UCRED.size))
    return pid, uid


def slot_environment(environ, passed=()):
    """The part of ``environ`` a stub hands its standby: :data:`SLOT_PREFIXES`,
    :data:`SLOT_NAMES` and the names in ``passed`` (``--pass-env``)."""
    return {name: value for name, value in environ.items()
            if name != ENV_FD and (name.startswith(SLOT_PREFIXES) or name in SLOT_NAMES
                                   or name in passed)}


def _exit_code(returncode):
    # A script killed by signal N exits as a shell reports it: 128 + N.
    return 128 - returncode if returncode < 0 else returncode


# -- the script's side ----------------------------------------------------------------------
# What a training script imports after init() in nearly every job is imported
# while the standby waits, so that it does not count in the survivors' pause:
# every public name of the library (each loads its module on first use), and
# what torch.optim imports at the first optimizer's construction (its compiler
# stack, more than a second on this machine): a throwaway optimizer loads it.
def _preload():
    import hvd_adapt
    import torch
    for name in hvd_adapt.__all__:
        getattr(hvd_adapt, name)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def wait_for_handover():
    """In a standby (``HVD_ADAPT_STANDBY_FD`` set by its supervisor): report ready, wait until
    a launch hands over its slot, then take on its environment, working directory and
    standard streams. Elsewhere: return at once. :func:`hvd_adapt.init` calls it first."""
    fd = os.environ.pop(ENV_FD, None)
    if fd is None:
        return
    _preload()
    with socket.socket(fileno=int(fd)) as sock:
        _send(sock, {"ready": True})
        log.info("standby: booted, waiting for a slot")
        message, fds = _recv(sock, max_fds=3)
    sys.stdout.flush()
    sys.stderr.flush()
    for target, received in zip((0, 1, 2), fds):
        os.dup2(received, target)
        os.close(received)
    os.chdir(message["cwd"])
    # The standby's own environment (its pod's), with the slot's variables over it.
    os.environ.update(message["env"])


# -- the supervisor (``--standby``) ---------------------------------------------------------
def _die_with_parent(parent):
    """A ``preexec_fn``: the kernel kills the script when the supervisor ``parent`` dies
    (``PR_SET_PDEATHSIG``, Linux), so a killed supervisor leaves no script behind."""
    set_death_signal = death_signal_setter()     # looked up before the fork

    def preexec():
        # An exception here ends the child before the script starts (Popen reports it).
        set_death_signal()
        if os.getppid() != parent:
            raise ChildProcessError("the supervisor died before the script started")
    return preexec


class Supervisor:
    """Runs ``command`` as a standby for ``host``, publishes it under ``folder`` once it is
    ready, hands it the first slot that claims it and reports its exit status."""

    def __init__(self, command, folder, host):
        self.command = list(command)
        self.folder = os.path.join(folder, host)
        self.host = host
        self.child = None
        self.serving = False
        self.signalled = False
        self.ready_path = os.path.join(self.folder, f"{os.getpid()}.json")
        self.claimed_path = os.path.join(self.folder, f"{os.getpid()}.claimed")

    def run(self):
        """Returns the exit code to leave with."""
        try:
            private_folder(self.folder)
            # The socket lives in this user's private runtime folder: no other user reaches it.
            sockets = user_runtime_folder("standby")
        except OSError as e:        # UnsafePathError among them: names the folder and why
            log.error("standby: cannot use the standby folder or the runtime folder: %s", e)
            return 2
        address = os.path.join(sockets, f"{os.getpid()}-{os.urandom(4).hex()}.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Bound before the script boots: an address the kernel refuses (longer than
            # AF_UNIX's 108 bytes, under a deep TMPDIR) is a clear error, not a traceback
            # after the boot.
            server.bind(address)
        except OSError as e:
            server.close()
            log.error("standby: cannot bind its socket %s: %s", address, e)
            return 2
        try:
            with server:
                os.chmod(address, 0o600)
                connection, ours = self._boot_and_accept(server)
        finally:
            os.unlink(address)
        if connection is None:
            return ours
        with connection:
            return self._serve(connection, ours)

    def _boot_and_accept(self, server):
        """Boot the script, publish the standby once it is ready and wait for a stub of this
        user on ``server``: ``(connection, the script's socket)``, or ``(None, exit code)``
        where the standby ends without a slot."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ, **{ENV_FD: str(theirs.fileno())})
        self.child = subprocess.Popen(self.command, env=env, pass_fds=[theirs.fileno()],
                                      preexec_fn=_die_with_parent(os.getpid()))
        theirs.close()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._stop_waiting)
        try:
            _recv(ours)
        except (EOFError, OSError, ValueError):
            code = _exit_code(self.child.wait())
            log.error("standby: %s ended (exit code %d) before it reached hvd_adapt.init(); "
                      "a standby's script must call hvd_adapt.init()",
                      " ".join(self.command), code)
            return None, code or 1
        server.listen(4)
        server.settimeout(HEARTBEAT_SECONDS)
        try:
            self._publish(server.getsockname())
        except OSError as e:    # a full disk: no standby, and no script left behind
            log.error("standby: cannot publish %s: %s", self.ready_path, e)
            self.child.kill()
            self.child.wait()
            return None, 1
        connection = self._accept(server)
        if connection is None:
            return None, _exit_code(self.child.wait())
        return connection, ours

    def _stop_waiting(self, signum, frame):
        # The script gets the signal too; before it serves a slot the standby is done,
        # while it serves one it waits for the script's exit status as usual.
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)
            self.signalled = True
        if not self.serving:
            self._remove_files()
            raise SystemExit(128 + signum)

    def _publish(self, address):
        info = {"socket": address, "pid": os.getpid(), "host": self.host,
                "command": self.command, "ready_at": time.time()}
        write_file_atomically(self.ready_path, json.dumps(info).encode())
        log.info("standby: ready for a slot on %s (%s)", self.host, self.ready_path)

    def _accept(self, server):
        claimed_since = None
        while True:
            if self.child.poll() is not None:
                self._remove_files()
                log.error("standby: the script ended (exit code %d) while waiting for a slot",
                          _exit_code(self.child.returncode))
                return None
            try:
                connection, _ = server.accept()
            except socket.timeout:
                connection = None
            if connection is not None:
                if peer_credentials(connection)[1] == os.geteuid():
                    self._remove_files()
                    return connection
                connection.close()      # not a stub of this user: not a slot
            try:
                os.utime(self.ready_path, follow_symlinks=False)
                claimed_since = None
            except FileNotFoundError:
                # Claimed: a stub connects next, unless it died in between.
                claimed_since = claimed_since or time.monotonic()
                if time.monotonic() - claimed_since > CLAIM_SECONDS and \
                        os.path.exists(self.claimed_path):
                    os.replace(self.claimed_path, self.ready_path)

    def _remove_files(self):
        for path in (self.ready_path, self.claimed_path):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def _serve(self, connection, child_socket):
        connection.settimeout(None)
        try:
            message, fds = _recv(connection, max_fds=3)
        except (EOFError, OSError, ValueError) as e:
            # The stub died between its connect and its hand-over (Horovod killed the
            # slot): there is no slot to serve, and the script must not outlive it.
            log.error("standby: the launch stub went away before it handed over its slot "
                      "(%s); stopping the script", e)
            self.child.kill()
            self.child.wait()
            return 1
        self.serving = True
        _send(child_socket, message, fds)
        for fd in fds:
            os.close(fd)
        child_socket.close()
        log.info("standby: slot handed over (rank %s)", message["env"].get("HOROVOD_RANK"))
        threading.Thread(target=self._relay_signals, args=(connection,), daemon=True).start()
        code = _exit_code(self.child.wait())
        try:
            _send(connection, {"exit": code})
        except OSError:
            pass
        return code

    def _relay_signals(self, connection):
        try:
            while True:
                message, _ = _recv(connection)
                if self.child.poll() is None:
                    self.child.send_signal(message["signal"])
                    self.signalled = True
        except (EOFError, OSError, ValueError):
            pass
        if self.child.poll() is None:
            # The stub is gone (killed with its slot): so is the slot. Signalled
            # before, the script has had its grace period (horovodrun kills the
            # stub 5 s after its SIGTERM).
            if self.signalled:
                self.child.kill()
                return
            self.child.terminate()
            try:
                self.child.wait(KILL_AFTER_SECONDS)
            except subprocess.TimeoutExpired:
                self.child.kill()


# -- the launch stub (what Horovod starts) --------------------------------------------------
def hand_over(folder, host, command, passed=()):
    """Hand this process's slot to a ready standby of ``host`` running ``command``; returns
    the standby's exit code once it ends, or None when no standby took the slot (a
    warning on stderr says why where one was refused). Only the slot's environment
    (:func:`slot_environment` with ``passed``) goes to the standby."""
    try:
        paths = ready_files(folder, host)
    except OSError as e:        # UnsafePathError among them: a folder others may write
        _warn(f"not using the standby folder: {e}")
        return None
    for path in paths:
        try:
            connection = _claim(path, command)
        except Exception as e:      # any failed claim is a cold start, never a failed slot
            _warn(f"not using the standby of {path}: {e}")
            continue
        if connection is None:
            continue
        try:
            _send(connection, {"env": slot_environment(os.environ, passed),
                               "cwd": os.getcwd()}, (0, 1, 2))
        except OSError as e:
            connection.close()
            _warn(f"the standby of {path} went away during the hand-over: {e}")
            continue
        return _relay(connection)
    return None


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _warn(message):
    sys.stderr.write(f"hvd-adapt-worker: {message}\n")
    sys.stderr.flush()


def _claim(path, command):
    """The connection to the standby of ready file ``path`` once it is claimed and proved
    to be this user's; None where it is another command's, already claimed or gone."""
    info = json.loads(read_own_file(path, limit=_READY_FILE_LIMIT))
    if not (isinstance(info, dict) and isinstance(info.get("socket"), str)
            and type(info.get("pid")) is int and isinstance(info.get("command"), list)):
        raise ValueError("not a ready file (socket, pid and command expected)")
    if info["command"] != list(command):
        return None
    claimed = path[:-len(".json")] + ".claimed"
    try:
        st = os.lstat(info["socket"])
    except FileNotFoundError:
        _remove(path)           # its standby ended and its socket with it: the file is stale
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(f"{info['socket']} is not a socket")
    check_owned(st, info["socket"])
    try:
        os.rename(path, claimed)
    except FileNotFoundError:
        return None             # another stub was first
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A standby that cannot take the connection within CLAIM_SECONDS is not one to wait for.
        connection.settimeout(CLAIM_SECONDS)
        try:
            connection.connect(info["socket"])
        except ConnectionRefusedError:
            _remove(claimed)    # a killed standby's file and socket
            connection.close()
            return None
        pid, uid = peer_credentials(connection)
        if uid != os.geteuid() or pid != info["pid"]:
            raise UnsafePathError(f"{info['socket']} is served by pid {pid} of uid {uid}, not "
                                  f"by the standby's pid {info['pid']} of this user "
                                  f"(uid {os.geteuid()})")
    except BaseException:
        connection.close()
        raise
    connection.settimeout(None)
    return connection


def _relay(connection):
    def forward(signum, frame):
        try:
            _send(connection, {"signal": signum})
        except OSError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    with connection:
        try:
            message, _ = _recv(connection)
            return int(message["exit"])
        except (EOFError, OSError, ValueError, KeyError):
            sys.stderr.write("hvd-adapt-worker: the standby went away without an exit status\n")
            return 1


def parser():
    """``hvd-adapt-worker``'s command line."""
    p = argparse.ArgumentParser(
        prog="hvd-adapt-worker",
        description="Warm standby workers for horovodrun --elastic (see hvd_adapt.scheduling."
                    "standby). Put it before the training command in horovodrun's command "
                    "line; run it with --standby on a host to boot a worker ahead of its join.")
    p.add_argument("--standby", action="store_true",
                   help="boot COMMAND as a standby and wait for a slot")
    p.add_argument("--standby-dir", required=True,
                   help="folder of the ready files (shared with hvd-adapt-discover)")
    p.add_argument("--pass-env", action="append", default=[], metavar="NAME",
                   help="also hand the standby this variable of the slot's environment "
                        "(repeatable; HOROVOD_*, HVD_ADAPT_*, NCCL_*, GLOO_*, OMPI_*, PMIX_*, "
                        "CUDA_VISIBLE_DEVICES and PYTHONUNBUFFERED always go)")
    p.add_argument("--host", default=None,
                   help="the host name as the discovery lists it (default: "
                        "$HOROVOD_HOSTNAME, else this machine's name)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command, after --")
    return p


def parse(p, argv=None):
    """``hvd-adapt-worker``'s arguments from ``argv``, and the training command after ``--``."""
    args = p.parse_args(argv)
    return args, args.command[1:] if args.command[:1] == ["--"] else args.command


def main(argv=None):
    """``hvd-adapt-worker``: run a standby (``--standby``), or launch a slot through one."""
    p = parser()
    args, command = parse(p, argv)
    if not command:
        p.error("the training command is missing (give it after --)")
    host = args.host or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    if args.standby:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.INFO)
        return Supervisor(command, args.standby_dir, host).run()
    code = hand_over(args.standby_dir, host, command, args.pass_env)
    if code is not None:
        return code
    _warn(f"no standby ready on {host}; starting cold")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"hvd-adapt-worker: cannot run {command[0]!r}: {e}\n")
        return 127


if __name__ == "__main__":
    sys.exit(main())
