"""A small cluster on this machine: N network namespaces on a bridge, an sshd per host.

    with Bed(3, launcher=True) as bed:        # hosts h1, h2, h3, and h0 for the launcher
        bed.run("h1", ["hostname"])           # a command on h1 (its net, mount, UTS namespaces)
        bed.crash("h3")                       # every process of h3 killed, sshd included
        bed.cut("h3"); bed.heal("h3")         # its link down silently (no RST), and back
        bed.cut("h0")                         # the launcher cut off; the workers still meet

Each host is a network namespace with one interface, ``eth0``, on a bridge
the bed creates (10.236.X.0/24, no address on the machine's side, no route
out: the hosts reach each other and their own loopback only). Each has its
own UTS namespace (``hostname`` says ``h1``), its own ``/etc/hosts``
(``ip netns exec`` binds ``/etc/netns/<ns>/hosts`` over it; ``loopback_name``
maps the host's own name to 127.0.1.1 as Debian's installer does) and one
sshd that lets root in with the bed's generated key only. Root's home is
the bed's ``home`` folder on every host, as a cluster's shared home (its
``.ssh/config`` names the key, skips host-key checks and sets the keepalive
``ssh_options`` asks for; no login scripts); the Python this runs on is
bound into it where it lives in root's real home (pyenv). The rest of the
file system is shared as well (the job's folder, the venv), except
``local``, a tmpfs of its own on each host ("local disk").

Names (namespaces, bridge, veths) carry a random tag, so beds of parallel
test runs do not collide; ``close()`` kills every process of the bed's
namespaces and removes everything it made. A bed whose maker died without
closing it (a test run killed at its timeout) is swept away by the next
bed built on the machine: the bridge's alias names the maker's pid. Needs root, ``ip``, ``unshare``,
``nsenter``, ``sshd`` and ``ssh-keygen``: :func:`missing` says what is
missing (the fixture skips with that reason).
"""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TOOLS = ("ip", "unshare", "nsenter", "ssh", "ssh-keygen")
SSHD = "/usr/sbin/sshd"
# The keepalive the docs ask users to set (docs/elastic.md): an ssh session
# to a host that stopped answering ends after 3 unanswered probes 2 s apart,
# so Horovod's driver learns that the worker behind it is gone.
KEEPALIVE = {"ServerAliveInterval": "2", "ServerAliveCountMax": "3"}


def missing():
    """Why a bed cannot be built here (a sentence), or None."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (network namespaces, mounts)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not os.access(SSHD, os.X_OK):
        absent.append(SSHD)
    if absent:
        return (f"the namespace cluster needs {', '.join(absent)} "
                "(scripts/setup.sh installs openssh-server)")
    probe = f"hvdbedprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _sh(*args, check=True):
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def sweep_orphans():
    """Remove the beds whose maker is no longer running: their namespaces' processes,
    namespaces, hosts files and bridge (the veths go with their namespaces)."""
    links = _sh("ip", "-o", "link", "show", "type", "bridge", check=False).stdout
    for line in links.splitlines():
        found = re.search(r"\d+: hb([0-9a-f]{6})br[:@].* alias hvdbed-owner-(\d+)", line)
        if not found or os.path.exists(f"/proc/{found.group(2)}"):
            continue
        tag = found.group(1)
        for netns in _sh("ip", "netns", "list", check=False).stdout.split():
            if re.fullmatch(f"hvdbed{tag}h\\d+", netns):
                for pid in _sh("ip", "netns", "pids", netns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _sh("ip", "netns", "delete", netns, check=False)
                shutil.rmtree(os.path.join("/etc/netns", netns), ignore_errors=True)
        _sh("ip", "link", "delete", f"hb{tag}br", check=False)


class Host:
    def __init__(self, bed, index):
        self.name = f"h{index}"
        self.netns = f"hvdbed{bed.tag}h{index}"
        self.veth = f"hb{bed.tag}v{index}"    # the bridge's side; eth0 inside
        self.address = f"{bed.prefix}.{10 + index}"
        self.dir = os.path.join(bed.dir, self.name)
        self.sshd = None                       # the Popen of `ip netns exec ... sshd`


class Bed:
    def __init__(self, hosts=3, ssh_options=None, loopback_name=(), root=None, launcher=False):
        """``hosts`` hosts h1..hN; ``launcher``: and h0, a host of the launcher's own (as a
        cluster's login node: cut it off and the workers still reach each other);
        ``ssh_options``: extra client settings for every host (e.g. :data:`KEEPALIVE`);
        ``loopback_name``: hosts whose own name resolves to 127.0.1.1 in their hosts file;
        ``root``: where the bed's folder goes (default: a new private temporary folder)."""
        self.tag = "%06x" % random.randrange(16 ** 6)
        self.prefix = f"10.236.{random.randrange(1, 255)}"
        self.bridge = f"hb{self.tag}br"
        self.dir = tempfile.mkdtemp(prefix=f"hvdbed{self.tag}-", dir=root)
        self.home = os.path.join(self.dir, "home")
        self.local = os.path.join(self.dir, "local")
        self.hosts = {h.name: h for h in (Host(self, i) for i in range(0 if launcher else 1,
                                                                       hosts + 1))}
        #: Where faults.py runs horovodrun: h0 where the bed has it, else h1.
        self.launcher = "h0" if launcher else "h1"
        self.ssh_options = dict(ssh_options or {})
        self.loopback_name = set(loopback_name)
        self._made = []                        # undo steps, run in reverse by close()

    # -- building -------------------------------------------------------------------------
    def __enter__(self):
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def build(self):
        sweep_orphans()
        os.makedirs(self.local)
        self._make_keys()
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(["ip", "link", "delete", self.bridge])
        _sh("ip", "link", "set", self.bridge, "alias", f"hvdbed-owner-{os.getpid()}")
        _sh("ip", "link", "set", self.bridge, "up")
        for host in self.hosts.values():
            self._make_host(host)
        for host in self.hosts.values():
            self.start_sshd(host.name)
        for host in self.hosts.values():
            self.wait_for_ssh(host.name)

    def _make_keys(self):
        ssh_dir = os.path.join(self.home, ".ssh")
        os.makedirs(ssh_dir, mode=0o700)
        os.chmod(self.home, 0o700)
        key = os.path.join(ssh_dir, "id_ed25519")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hvdbed{self.tag}", "-f", key)
        shutil.copy(key + ".pub", os.path.join(ssh_dir, "authorized_keys"))
        os.chmod(os.path.join(ssh_dir, "authorized_keys"), 0o600)
        options = {"IdentityFile": key, "IdentitiesOnly": "yes", "BatchMode": "yes",
                   "StrictHostKeyChecking": "no", "UserKnownHostsFile": "/dev/null",
                   "LogLevel": "ERROR", "ConnectTimeout": "5", **self.ssh_options}
        with open(os.path.join(ssh_dir, "config"), "w") as f:
            f.write("Host *\n" + "".join(f"    {k} {v}\n" for k, v in options.items()))
        os.chmod(os.path.join(ssh_dir, "config"), 0o600)

    def _make_host(self, host):
        os.makedirs(host.dir)
        _sh("ip", "netns", "add", host.netns)
        self._made.append(["ip", "netns", "delete", host.netns])
        etc = os.path.join("/etc/netns", host.netns)
        os.makedirs(etc)
        self._made.append(["rm", "-rf", etc])
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            if host.name in self.loopback_name:
                f.write(f"127.0.1.1 {host.name}\n")
            for other in self.hosts.values():
                if not (other is host and host.name in self.loopback_name):
                    f.write(f"{other.address} {other.name}\n")
        _sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
            "netns", host.netns)
        self._made.append(["ip", "link", "delete", host.veth])
        _sh("ip", "link", "set", host.veth, "master", self.bridge, "up")
        inside = ["ip", "netns", "exec", host.netns, "ip"]
        _sh(*inside, "link", "set", "lo", "up")
        _sh(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _sh(*inside, "link", "set", "eth0", "up")
        key = os.path.join(host.dir, "ssh_host_ed25519_key")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        with open(os.path.join(host.dir, "sshd_config"), "w") as f:
            f.write(f"ListenAddress 0.0.0.0\nPort 22\nHostKey {key}\n"
                    "PidFile none\nPermitRootLogin prohibit-password\n"
                    "PubkeyAuthentication yes\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes yes\n"
                    "AuthorizedKeysFile .ssh/authorized_keys\nPrintMotd no\n"
                    "X11Forwarding no\nAllowTcpForwarding no\nMaxStartups 100\n")

    def start_sshd(self, name):
        """Start ``name``'s sshd (again, after a crash) in its namespaces: a UTS namespace
        named after the host, a mount namespace where root's ``~/.ssh`` is the bed's and
        ``local`` a tmpfs of its own."""
        host = self.hosts[name]
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)    # sshd's privilege separation
        setup = (f"hostname {host.name} && {self._home_mounts()} && "
                 f"mount -t tmpfs -o size=64m,mode=0700 hvdbed-local {self.local} && "
                 f"exec {SSHD} -D -e -f {host.dir}/sshd_config")
        log = open(os.path.join(host.dir, "sshd.log"), "a")
        host.sshd = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-c", setup],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def _home_mounts(self):
        """Shell commands that make the bed's home root's, keeping the folder of root's
        real home that holds this Python (pyenv's ``~/.pyenv``)."""
        mounts = []
        real_home = os.path.realpath(os.path.expanduser("~root"))
        base = os.path.realpath(sys.base_prefix)
        if base.startswith(real_home + os.sep):
            top = base[len(real_home) + 1:].split(os.sep)[0]
            os.makedirs(os.path.join(self.home, top), exist_ok=True)
            mounts.append(f"mount --bind {real_home}/{top} {self.home}/{top}")
        mounts.append(f"mount --rbind {self.home} {real_home}")
        return " && ".join(mounts)

    def wait_for_ssh(self, name, timeout=30):
        """Wait until ``ssh <name> true`` works from h1 (from itself for h1)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.run(next(iter(self.hosts)), ["ssh", name, "true"], timeout=10,
                              check=False)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                with open(os.path.join(self.hosts[name].dir, "sshd.log")) as f:
                    log = f.read()
                raise RuntimeError(f"ssh to {name} does not work: {result.stderr}\nsshd: {log}")
            time.sleep(0.2)

    # -- using ----------------------------------------------------------------------------
    def enter(self, name, cwd=None):
        """The command prefix that runs a command on ``name`` in ``cwd`` (default: this
        process's), in the namespaces its sshd's sessions have."""
        return ["nsenter", "-t", str(self.sshd_pid(name)), "-n", "-m", "-u",
                f"--wd={cwd or os.getcwd()}", "--"]

    def sshd_pid(self, name):
        """The pid of ``name``'s sshd, once the Popen's chain of execs (ip, unshare, sh)
        reached it, so that its namespaces are the host's."""
        pid = self.hosts[name].sshd.pid
        deadline = time.monotonic() + 10
        while os.path.basename(os.readlink(f"/proc/{pid}/exe")) != "sshd":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}'s sshd did not start: see {self.hosts[name].dir}")
            time.sleep(0.05)
        return pid

    def run(self, name, command, timeout=60, check=True, cwd=None, **kwargs):
        result = subprocess.run(self.enter(name, cwd) + list(command), capture_output=True,
                                text=True, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"{command} on {name} failed: {result.stderr}")
        return result

    def popen(self, name, command, cwd=None, **kwargs):
        return subprocess.Popen(self.enter(name, cwd) + list(command), **kwargs)

    def pids(self, name):
        """Every process in ``name``'s network namespace."""
        out = _sh("ip", "netns", "pids", self.hosts[name].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def find(self, name, text):
        """Processes of ``name`` whose command line contains ``text``."""
        found = []
        for pid in self.pids(name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(pid)
        return found

    def crash(self, name):
        """Kill every process of ``name`` at once (SIGKILL), sshd included, as a host that
        loses power: the kernel closes their sockets."""
        for _ in range(5):    # processes forked meanwhile
            pids = self.pids(name)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def cut(self, name):
        """Take ``name``'s link down on the bridge's side: its packets vanish, nobody gets a
        reset (a silent partition)."""
        _sh("ip", "link", "set", self.hosts[name].veth, "down")

    def heal(self, name):
        """Bring ``name``'s link back (after :meth:`cut`), and its sshd (after
        :meth:`crash`)."""
        _sh("ip", "link", "set", self.hosts[name].veth, "up")
        if not self.pids(name):
            self.start_sshd(name)
        self.wait_for_ssh(name)

    def stop(self, pid, sig=signal.SIGSTOP):
        os.kill(pid, sig)

    def close(self):
        for name in self.hosts:
            if os.path.exists(os.path.join("/run/netns", self.hosts[name].netns)):
                self.crash(name)
        for host in self.hosts.values():
            if host.sshd is not None:
                host.sshd.wait()
        for undo in reversed(self._made):
            subprocess.run(undo, capture_output=True)
        self._made = []
