"""Letting go of a socket in this process without touching the connection itself.

A socket handed to the successor is shared by both processes until this one
closes its descriptor.  Twisted's own ways of closing would end it for both:
``loseConnection`` calls ``shutdown()`` (a FIN for the peer), an abort sets
``SO_LINGER`` to zero on the shared socket (a reset, later, for the
successor's close), and a unix listening port unlinks its path as it stops.
So the transport is taken off the reactor and its descriptor is detached
from the Python socket object first: whatever Twisted does with that object
afterwards (``shutdown``, ``close``) fails on a closed object and is ignored,
while the connection lives on in the successor's copy.
"""

from __future__ import annotations

import os

from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure


class GoneToSuccessor(ConnectionDone):
    """The connection went to the successor: for this process it is over, for the client it is not."""


def duplicate(transport) -> tuple[int, int]:
    """A new descriptor of ``transport``'s socket (to send), and the socket's address family."""
    sock = transport.socket
    return os.dup(sock.fileno()), sock.family


def let_go(transport) -> None:
    """Forget the connection of ``transport`` here: no more reads or writes, no shutdown, no reset.

    Its protocol sees ``connectionLost`` with :class:`GoneToSuccessor`, so the
    channel frees what it holds (timers, the connection count); nothing it
    or its request writes afterwards can reach the socket.
    """
    transport.stopReading()
    transport.stopWriting()
    fd = transport.socket.detach()
    # Still open, so its number is no other socket's: the reactor, asked again by connectionLost, finds
    # it registered nowhere at once (with -1, epoll looks through every descriptor it watches).
    transport.fileno = lambda: fd
    try:
        transport.connectionLost(Failure(GoneToSuccessor("handed over to the new process")))
    finally:
        os.close(fd)


def let_go_port(port) -> None:
    """Stop accepting on a listening port here and close this process's descriptor of it, without unlinking
    a unix socket's path (the successor listens on the same socket)."""
    port.stopReading()
    sock = port.socket
    os.close(sock.detach())
    port.connected = False


def family_of(port) -> int:
    """The address family of a listening port's socket."""
    return int(port.socket.family)


def nonblocking_cloexec(fd: int) -> None:
    """What ``adopt*`` wants of a received descriptor (interfaces.py): non-blocking, closed on exec."""
    os.set_blocking(fd, False)
    os.set_inheritable(fd, False)


