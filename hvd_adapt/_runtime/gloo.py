"""What a Gloo world needs from the host before ``hvd.init()``: an address its peers reach.

Horovod 0.28.1 creates one more Gloo context than the global, local and
cross ones, for the global process set that every job has
(``GlooContext::InitializeForProcessSet``, horovod/common/gloo/gloo_context.cc),
and that context's device is made from the context's own ``gloo_iface_``,
which only ``Initialize`` sets, so it is always empty there: Gloo then
listens on the first address that the host's name (``gethostname()``)
resolves to, whatever ``--network-interface`` said. On a host whose name
resolves to loopback (Debian's ``127.0.1.1 <name>``, or an image's shared
name) the job's peers on other hosts connect to their own loopback and fail
(``gloo::IoException ... connect [127.0.0.1]: Connection refused``). The
context cannot be told its interface from outside Horovod, so
:func:`check_host_address` refuses such a host before ``hvd.init()``,
naming the host, where its name resolves and the fix.
"""
import ipaddress
import socket

import psutil

# Set by horovodrun (gloo_run.create_run_env_vars) for every Gloo worker.
IFACE_VARIABLE = "HOROVOD_GLOO_IFACE"


def gloo_host_address():
    """The address Gloo listens on when no interface is named: the first address of
    ``gethostname()`` that a socket can bind (gloo/transport/tcp/device.cc,
    lookupAddrForHostname), or None when the name does not resolve."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, 0, socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
            except OSError:
                continue
        return address[0]
    return None


def interface_addresses(iface):
    """The IPv4 and IPv6 addresses of network interface ``iface`` (empty if it has none)."""
    return [entry.address.split("%")[0] for entry in psutil.net_if_addrs().get(iface, ())
            if entry.family in (socket.AF_INET, socket.AF_INET6)]


def check_host_address(iface, num_hosts):
    """Raise RuntimeError if a world of ``num_hosts`` hosts that talks over ``iface``
    cannot reach this host's process-set context: its name resolves to a loopback
    address while ``iface`` is not loopback and the world spans other hosts.

    ``iface`` None (not a Gloo launch) or a loopback interface (every peer on this
    machine, as in ``-H localhost:1,127.0.0.1:1``), or one host, is always fine.

    >>> check_host_address(None, 4)
    >>> check_host_address("lo", 2)
    """
    if not iface or num_hosts <= 1:
        return
    own = interface_addresses(iface)
    if any(ipaddress.ip_address(address).is_loopback for address in own):
        return
    address = gloo_host_address()
    if address is None or not ipaddress.ip_address(address).is_loopback:
        return
    name = socket.gethostname()
    suggestion = f"'{own[0]} {name}'" if own else f"'<{iface}'s address> {name}'"
    raise RuntimeError(
        f"host {name!r} resolves to {address} (loopback) on this host, but the job spans "
        f"{num_hosts} hosts over interface {iface!r} ({', '.join(own) or 'no address'}): "
        f"Horovod 0.28's process-set Gloo context ignores --network-interface and listens on "
        f"what the host name resolves to, so the other hosts cannot connect to it. Make "
        f"{name!r} resolve to {iface}'s address on this host (in /etc/hosts: {suggestion} "
        f"instead of '{address} {name}', or in DNS)")
