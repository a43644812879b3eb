"""A host that says nothing: a listener whose SYNs the kernel drops."""
import socket


def silent_listener(address, port):
    """A listener on ``address`` whose accept queue is full: the kernel drops new
    connections' SYNs, so a probe hears nothing, as from a host cut off. The sockets to
    close afterwards."""
    server = socket.socket()
    server.bind((address, port))
    server.listen(0)
    filler = socket.create_connection((address, port), timeout=5)
    return [filler, server]
