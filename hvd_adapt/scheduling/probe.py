"""Which hosts accept a TCP connection on a port (sshd's), all probed at once.

A Kubernetes pod that is "Running" may not run sshd yet, and Horovod's
driver launches a worker on a host the moment discovery lists it: a failed
ssh there blacklists the host. So a new host is offered only once its port
answers. Connections start together, non-blocking, and whatever has not
answered by the deadline counts as not ready: the discovery script's whole
run stays within its budget however many hosts are down.

>>> reachable([], port=22, timeout=0.01)
set()
"""
import errno
import selectors
import socket
import time


def reachable(hosts, port, timeout):
    """The subset of ``hosts`` whose ``port`` accepted a connection within ``timeout`` seconds
    (name resolution included; a name that does not resolve is not reachable)."""
    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    answered = set()
    try:
        for host in set(hosts):
            try:
                address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            except OSError:
                continue
            sock = socket.socket(address[0], socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex(address[4])
            if code == 0:
                answered.add(host)
                sock.close()
            elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                selector.register(sock, selectors.EVENT_WRITE, host)
            else:
                sock.close()
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in selector.select(left):
                sock = key.fileobj
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    answered.add(key.data)
                selector.unregister(sock)
                sock.close()
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()
    return answered
