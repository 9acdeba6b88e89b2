"""A listener: one endpoint from the config, serving one site, as a service.

It binds in ``privilegedStartService``, which twistd calls before it drops
privileges (so a port below 1024 works), and a failure to bind is one line,
:class:`CannotListen`, naming the config key, the endpoint and why
(edge/listen_errors.py), instead of a traceback.

Why not ``strports.service``: its ``StreamServerEndpointService`` keeps the
listening port private (``_waitingForPort``), and it raises a failure to bind
only through a private flag; a listener on port 0 (every test) needs its
port, and the one-line error needs the failure.  This is the same few steps
with the port kept: ``serverFromString(reactor, description).listen(factory)``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
from typing import Any

from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger
from twisted.python.failure import Failure

from .capacity import MAX_REFUSING
from .listen_errors import why_cannot_listen
from .sockets import let_go_port

log = Logger()


#: Seconds a stopping listener lets handshakes under way complete before it accepts what waits and closes.
SETTLE_SECONDS = 0.05
#: Connections accepted at a time while a stopping listener empties its backlog.
_DRAIN_BATCH = 1000
#: ``SO_ATTACH_FILTER`` (Linux): a classic BPF program run on each packet the socket receives.
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
#: Drops a TCP segment with SYN and without ACK (a new connection), passes the rest: the filter sees
#: the TCP header first, its flags at byte 13.  (code, jt, jf, k) each.
_NO_NEW_CONNECTIONS = (
    (0x30, 0, 0, 13),  # ldb [13]
    (0x54, 0, 0, 0x12),  # and #(SYN | ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN: next, else skip one
    (0x06, 0, 0, 0),  # ret #0: dropped
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: kept whole
)


def _drop_new_connections(sock) -> bool:
    """Make a listening TCP socket drop the SYNs of new connections (Linux); False where it cannot."""
    if not sys.platform.startswith("linux") or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return False
    program = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in _NO_NEW_CONNECTIONS))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                        struct.pack("HP", len(_NO_NEW_CONNECTIONS), ctypes.addressof(program)))
    except (OSError, ValueError) as e:
        log.debug("cannot turn new connections away before closing the listener: {error}", error=e)
        return False
    return True


def _accept_waiting(port) -> None:
    """Accept every connection waiting in ``port``'s backlog (Twisted's accept loop, until it runs dry)."""
    for _ in range(100):
        port.numberAccepts = _DRAIN_BATCH
        port.doRead()
        if port.numberAccepts < _DRAIN_BATCH:  # it accepted fewer than it could: nothing is left
            return


def where(address) -> str:
    """A listening address as a person types it: ``127.0.0.1:11435``, ``[::1]:11435``, ``unix:/run/x.sock``."""
    if isinstance(address, IPv6Address):
        return f"[{address.host}]:{address.port}"
    if isinstance(address, IPv4Address):
        return f"{address.host}:{address.port}"
    if isinstance(address, UNIXAddress):
        name = address.name.decode("utf-8", "replace") if isinstance(address.name, bytes) else address.name
        return f"unix:{name}"
    return str(address)


class CannotListen(Exception):
    """A listener could not start; the message is one line naming the key, the endpoint and why."""


class Listener(Service):
    """Listens on ``description`` (an endpoint string, on ``reactor``) while running."""

    def __init__(
        self, reactor, key: str, description: str, factory: IProtocolFactory, inherited: tuple[int, int] | None = None,
    ):
        #: ``proxy`` or ``admin``: the service's name.
        self.name = key.split(".")[0]  # type: ignore[assignment]  # Twisted types Service.name as None
        #: The config key the endpoint came from, for the error.
        self.key = key
        self.description = description
        self._reactor = reactor
        self._endpoint = serverFromString(reactor, description)
        #: What serves its connections (the successor adopts handed-over connections into it).
        self.factory = factory
        #: A listening socket of the process this one replaces (lifecycle/succession/): ``(fd, family)``,
        #: adopted instead of binding, and not accepting until :meth:`resume`.
        self._inherited = inherited
        #: The listening port while running (its ``getHost()`` says where a port 0 ended up).
        self.port: IListeningPort | None = None
        #: Not accepting: paused (:meth:`pause`, a reload) and/or held back (:meth:`hold_back`, a flood).
        self._paused = False
        self._held_back = False

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:
        super().startService()
        if self.port is None:
            self._listen()

    def stopService(self) -> Deferred:
        """Stop listening, without resetting a connection the kernel completed and nobody accepted yet.

        Closing a listening socket resets every connection waiting in its
        backlog: a client that connected, and perhaps sent its request, sees
        a reset instead of an answer.  So new connections are turned away
        first (:func:`_drop_new_connections`: their SYNs are dropped, so the
        client tries again a second later and finds the port closed, a plain
        refusal), the handshakes under way get :data:`SETTLE_SECONDS` to
        complete, what waits is accepted (and served, or answered 503 by the
        stop, as any connection), and then the socket is closed.
        """
        super().stopService()
        return self.close()

    def close(self) -> Deferred:
        """Stop listening for good, as :meth:`stopService` does (also for a reload's old process, whose
        successor listens elsewhere now)."""
        port, self.port = self.port, None
        self._unregister()
        if port is None:
            return succeed(None)
        sock = getattr(port, "socket", None)
        if sock is None or not callable(getattr(port, "doRead", None)) or not _drop_new_connections(sock):
            return maybeDeferred(port.stopListening)
        stopped: Deferred[Any] = Deferred()

        def drained() -> None:
            try:
                _accept_waiting(port)
            finally:
                maybeDeferred(port.stopListening).chainDeferred(stopped)

        self._reactor.callLater(SETTLE_SECONDS, drained)
        return stopped

    def pause(self) -> None:
        """Stop accepting; new connections wait in the socket's backlog."""
        self._paused = True
        if self.port is not None:
            self.port.stopReading()  # type: ignore[attr-defined]  # a FileDescriptor port

    def resume(self) -> None:
        """Accept again (or for the first time, on an inherited socket), unless held back by a flood."""
        self._paused = False
        if self.port is not None and not self._held_back:
            self.port.startReading()  # type: ignore[attr-defined]

    def hold_back(self) -> None:
        """Too many connections are being refused at once (edge/capacity.py's Connections): accept none for now.

        The accept loop under way goes on to its batch size (``tcp.Port.numberAccepts``,
        which grows under load): it is brought down to the refusals a listener may hold.
        """
        self._held_back = True
        port = self.port
        if port is not None:
            port.stopReading()  # type: ignore[attr-defined]
            if getattr(port, "numberAccepts", 0) > MAX_REFUSING:
                port.numberAccepts = MAX_REFUSING  # type: ignore[attr-defined]

    def let_in(self) -> None:
        """The flood's refusals are down again: accept, unless paused."""
        self._held_back = False
        port = self.port
        if port is not None and not self._paused and not getattr(port, "disconnecting", False):
            port.startReading()  # type: ignore[attr-defined]

    def release(self) -> None:
        """Forget the port without closing the socket for the process that took it over (lifecycle/succession/)."""
        port, self.port = self.port, None
        self._unregister()
        if port is not None:
            let_go_port(port)

    def _register(self) -> None:
        """A site with a connection cap holds its listener back while too many connections are being refused."""
        connections = getattr(self.factory, "connections", None)
        if connections is not None:
            connections.listening(self)

    def _unregister(self) -> None:
        connections = getattr(self.factory, "connections", None)
        if connections is not None:
            connections.stopped_listening(self)

    def _listen(self) -> None:
        """Bind now; a TCP or unix endpoint binds (or fails) before ``listen`` returns.

        With an inherited socket: adopt it, paused (the process it came from
        still owns its backlog until it hands over).
        """
        if self._inherited is not None:
            fd, family = self._inherited
            self._inherited = None
            try:
                self.port = self._reactor.adoptStreamPort(fd, family, self.factory)
            finally:
                os.close(fd)
            self.pause()
            self._register()
            self._say_where("taken over from the process before")
            return
        outcome: list = []
        self._endpoint.listen(self.factory).addBoth(outcome.append)
        if not outcome:
            raise CannotListen(f"{self.key} {self.description!r}: cannot listen: the endpoint did not bind at once")
        if isinstance(outcome[0], Failure):
            why = why_cannot_listen(outcome[0].value)
            raise CannotListen(f"{self.key} {self.description!r}: cannot listen: {why}") from outcome[0].value
        self.port = outcome[0]
        self._register()
        self._say_where()

    def _say_where(self, how: str = "") -> None:
        """One line naming the listener and where it listens: the two sites alone are both "ProxySite"."""
        assert self.port is not None
        log.info(
            "{name} listening on {address} ({key} = {description!r}{how})",
            name=self.name, address=where(self.port.getHost()), key=self.key, description=self.description,
            how=f"; {how}" if how else "",
        )
