"""The standby's supervisor (``hvd-adapt-worker --standby``): it boots the training
script ahead of its join, publishes it once ready and serves the first slot that claims it.

It runs the script with a socket (``HVD_ADAPT_STANDBY_FD``) over which the
script, blocked in :func:`hvd_adapt.init` (``_runtime/handover.py``), says
it is ready; then it writes ``DIR/<host>/<pid>.json`` (through
``_runtime/private_files.py``) and keeps its modification time fresh (a
heartbeat, read by ``ready.py``) while it waits for a launch stub
(``launch_stub.py``) of its own user on a socket in the user's private
runtime folder. The supervisor, not the script, holds that connection: it
sees the script's exit status and reports it to the stub; when the stub
dies (Horovod's SIGKILL five seconds after a SIGTERM) it kills the script in
turn; the script is killed by the kernel when its supervisor dies
(``PR_SET_PDEATHSIG``), so no worker outlives its slot either way. One
supervisor serves one slot; start another for the next join.
"""
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from .._runtime.handover import (CLAIM_SECONDS, ENV_FD, peer_credentials, recv_message,
                                 send_message)
from .._runtime.parent_death import death_signal_setter
from .._runtime.private_files import (private_folder, remove_if_present, user_runtime_folder,
                                      write_file_atomically)

log = logging.getLogger("hvd_adapt")

HEARTBEAT_SECONDS = 1.0
# After the stub is gone, the script has this long to end on the SIGTERM (as horovodrun gives).
KILL_AFTER_SECONDS = 5.0


def exit_code(returncode):
    """A script's exit code as a shell reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


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
            recv_message(ours)
        except (EOFError, OSError, ValueError):
            code = exit_code(self.child.wait())
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
            return None, exit_code(self.child.wait())
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
                          exit_code(self.child.returncode))
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
            remove_if_present(path)

    def _serve(self, connection, child_socket):
        connection.settimeout(None)
        try:
            message, fds = recv_message(connection, max_fds=3)
        except (EOFError, OSError, ValueError) as e:
            # The stub died between its connect and its hand-over (Horovod killed the
            # slot): there is no slot to serve, and the script must not outlive it.
            log.error("standby: the launch stub went away before it handed over its slot "
                      "(%s); stopping the script", e)
            self.child.kill()
            self.child.wait()
            return 1
        self.serving = True
        send_message(child_socket, message, fds)
        for fd in fds:
            os.close(fd)
        child_socket.close()
        log.info("standby: slot handed over (rank %s)", message["env"].get("HOROVOD_RANK"))
        threading.Thread(target=self._relay_signals, args=(connection,), daemon=True).start()
        code = exit_code(self.child.wait())
        try:
            send_message(connection, {"exit": code})
        except OSError:
            pass
        return code

    def _relay_signals(self, connection):
        try:
            while True:
                message, _ = recv_message(connection)
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
