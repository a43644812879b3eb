"""The base discovery's answer: the command run within its deadline, its lines parsed, the host
names checked.

``hvd-adapt-discover`` wraps a base discovery (a host file, or a command such as
the MPI Operator's ``discover_hosts.sh``). What it answers is input, not code:

- the command runs in a process group of its own; past ``--command-timeout``
  the whole group is killed (a shell's children too), and the run counts as
  failed. The answer is what the command printed before it exited: a
  background child it left holding its output does not make it a timeout;
- each line is ``host``, ``host:slots`` or ``host slots=N``; a host name must
  be an RFC 1123 name (letters, digits and inner hyphens, dot-separated
  labels of at most 63, 253 in all) or an IPv4 address. Horovod puts host
  names unquoted into its ssh command lines, so anything else
  (``-oProxyCommand=...``, ``a;b``, ``$(cmd)``) is reported and dropped,
  as is a line that does not parse or a slot count outside [1, 4096].

Standard library only.

>>> hosts, problems = parse_hosts("a:2\\nb slots=3\\n-oProxyCommand=x\\n", 1, "f")
>>> hosts
[('a', 2), ('b', 3)]
>>> problems
["f, line 3: '-oProxyCommand=x' is not a host name (RFC 1123 names and IPv4 addresses only)"]
"""
import os
import re
import signal
import time

MAX_SLOTS = 4096
# The most of a base command's output read: a host list is far smaller.
MAX_OUTPUT = 1 << 22
_LINE = re.compile(r"^\s*(\S+?)(?::(\d{1,9})|\s+slots\s*=\s*(\d{1,9}))?\s*$")
# fullmatch, not match with "$": "$" also matches before a final newline ("a\n").
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class BaseDiscoveryError(RuntimeError):
    """The base discovery gave no answer (failed, timed out, unreadable); the message says
    which command or file and why."""


def valid_host(name):
    """True for an RFC 1123 host name or an IPv4 address: what can go into an ssh command
    line unquoted."""
    # A dotted IPv4 address is such a name too: digits in dot-separated labels.
    if not isinstance(name, str) or not 0 < len(name) <= 253 or not name.isascii():
        return False
    return all(_LABEL.fullmatch(label) for label in name.rstrip(".").split("."))


def parse_hosts(text, default_slots, source):
    """``([(host, slots)], problems)`` from Horovod's ``host[:slots]`` lines or an MPI host
    file's ``host slots=N``; blank lines and ``#`` comments are skipped; a host listed twice
    keeps its first place and its last slot count. A line that does not parse, a name that
    is not a host name or a slot count outside [1, MAX_SLOTS] is left out and described in
    ``problems``."""
    hosts, problems = {}, []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0]
        if not line.strip():
            continue
        where = f"{source}, line {number}"
        match = _LINE.match(line)
        if not match:
            problems.append(f"{where}: expected 'host', 'host:slots' or 'host slots=N', "
                            f"got {raw[:200]!r}")
            continue
        host = match.group(1)
        if not valid_host(host):
            problems.append(f"{where}: {host[:200]!r} is not a host name (RFC 1123 names and "
                            f"IPv4 addresses only)")
            continue
        slots = int(match.group(2) or match.group(3) or default_slots)
        if not 1 <= slots <= MAX_SLOTS:
            problems.append(f"{where}: slots must be in [1, {MAX_SLOTS}], got {raw[:200]!r}")
            continue
        hosts[host] = slots
    return list(hosts.items()), problems


def run_command(command, timeout):
    """What the shell ``command`` printed (stdout, stderr) once it exited; raises
    :class:`BaseDiscoveryError` when it fails or is still running after ``timeout``
    seconds, after killing its whole process group."""
    import selectors        # the base command's needs: a host file reads without them
    import subprocess
    proc = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    output = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + timeout
    try:
        exited = os.pidfd_open(proc.pid)    # readable once the command's process ended
    except (AttributeError, OSError):       # Linux < 5.3: look every 10 ms instead
        exited = None
    try:
        # The command ends when its process does, not when every copy of its output pipes
        # is closed: a background child it started may hold them for as long as it likes.
        with selectors.DefaultSelector() as selector:
            if exited is not None:
                selector.register(exited, selectors.EVENT_READ)
            for pipe in output:
                os.set_blocking(pipe.fileno(), False)
                selector.register(pipe, selectors.EVENT_READ)
            while proc.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BaseDiscoveryError(f"the base discovery {command!r} did not answer "
                                             f"within {timeout:g} s (its processes were "
                                             f"killed)")
                for key, _ in selector.select(left if exited is not None else min(left, 0.01)):
                    if key.fileobj != exited and not _read(key.fileobj, output[key.fileobj]):
                        selector.unregister(key.fileobj)
        for pipe, data in output.items():
            _read(pipe, data)       # what it wrote just before it exited
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if exited is not None:
            os.close(exited)
        for pipe in output:
            pipe.close()
    out, err = (data.decode(errors="replace") for data in output.values())
    if proc.returncode != 0:
        raise BaseDiscoveryError(f"the base discovery {command!r} failed with exit code "
                                 f"{proc.returncode}: {err.strip()[-500:]}")
    return out


def _read(pipe, data):
    """Read what ``pipe`` holds now into ``data``; False at its end."""
    while len(data) <= MAX_OUTPUT:
        try:
            chunk = os.read(pipe.fileno(), 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        data += chunk
    raise BaseDiscoveryError(f"the base discovery printed more than {MAX_OUTPUT} bytes")


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def base_hosts(args):
    """The base discovery's ``([(host, slots)], problems)``, in its order (see
    :func:`parse_hosts`); :class:`BaseDiscoveryError` when it gave no answer."""
    if args.hostfile:
        try:
            with open(args.hostfile, errors="replace") as f:
                text = f.read(MAX_OUTPUT)
        except OSError as e:
            raise BaseDiscoveryError(f"cannot read the host file: {e}") from None
        return parse_hosts(text, args.slots, args.hostfile)
    return parse_hosts(run_command(args.command, args.command_timeout), args.slots,
                       repr(args.command))
