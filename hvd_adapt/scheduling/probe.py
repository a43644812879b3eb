"""Which hosts accept a TCP connection on a port (sshd's), all probed at once; and which
said nothing at all (:func:`answers`).

A Kubernetes pod that is "Running" may not run sshd yet, and Horovod's
driver launches a worker on a host the moment discovery lists it: a failed
ssh there blacklists the host. So a new host is offered only once its port
answers. Every host is probed at once, each on a daemon thread of its own
(name resolution, then the connection), and whatever has not answered by
the deadline counts as not ready: the discovery script's whole run stays
within its budget however many hosts are down. Threads, not non-blocking
sockets alone: ``getaddrinfo`` blocks and cannot be interrupted, and one
name behind a slow DNS server would otherwise hold the run (and Horovod's
driver, which waits for it) for the resolver's own timeout. A probe still
running at the deadline is left behind; it does not hold the interpreter's
exit.

>>> reachable([], port=22, timeout=0.01)
set()
"""
import socket
import threading
import time


def reachable(hosts, port, timeout):
    """The subset of ``hosts`` whose ``port`` accepted a connection within ``timeout`` seconds
    (name resolution included; a name that does not resolve in time is not reachable)."""
    return {host for host, accepted in answers(hosts, port, timeout).items() if accepted}


def answers(hosts, port, timeout):
    """What each of ``hosts`` said on ``port`` within ``timeout`` seconds: True where it
    accepted a connection, False where it refused it (the host is up, nothing listens),
    None where its name resolved but the host said nothing (the connection timed out or
    the host is unreachable: down, or cut off silently). A host whose name did not resolve
    in time is left out: that is the name service's silence, not the host's.

    >>> answers([], port=22, timeout=0.01)
    {}
    """
    deadline = time.monotonic() + timeout
    answered, lock = {}, threading.Lock()

    def probe(host):
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port,
                                                          type=socket.SOCK_STREAM)[0]
        except OSError:
            return
        with lock:
            answered[host] = None
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(left)
                sock.connect(address)
            said = True
        except ConnectionRefusedError:
            said = False
        except OSError:       # timed out, host or network unreachable
            return
        with lock:
            answered[host] = said

    threads = [threading.Thread(target=probe, args=(host,), daemon=True,
                                name=f"hvd_adapt-probe-{host}") for host in set(hosts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(answered)
