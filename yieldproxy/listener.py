"""A listener: one endpoint from the config, serving one site, as a service.

It binds in ``privilegedStartService``, which twistd calls before it drops
privileges (so a port below 1024 works), and a failure to bind is one line,
:class:`CannotListen`, naming the config key, the endpoint and why
(listen_errors.py), instead of a traceback.

Why not ``strports.service``: its ``StreamServerEndpointService`` keeps the
listening port private (``_waitingForPort``), and it raises a failure to bind
only through a private flag; a listener on port 0 (every test) needs its
port, and the one-line error needs the failure.  This is the same few steps
with the port kept: ``serverFromString(reactor, description).listen(factory)``.
"""

from __future__ import annotations

import os

from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger
from twisted.python.failure import Failure

from .edge.capacity import MAX_REFUSING
from .listen_errors import why_cannot_listen
from .succession.sockets import let_go_port

log = Logger()


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
        self._factory = factory
        #: A listening socket of the process this one replaces (succession/): ``(fd, family)``,
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
        super().stopService()
        port, self.port = self.port, None
        self._unregister()
        return maybeDeferred(port.stopListening) if port is not None else succeed(None)

    @property
    def factory(self) -> IProtocolFactory:
        """What serves its connections (the successor adopts handed-over connections into it)."""
        return self._factory

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
        """Forget the port without closing the socket for the process that took it over (succession/)."""
        port, self.port = self.port, None
        self._unregister()
        if port is not None:
            let_go_port(port)

    def _register(self) -> None:
        """A site with a connection cap holds its listener back while too many connections are being refused."""
        connections = getattr(self._factory, "connections", None)
        if connections is not None:
            connections.listening(self)

    def _unregister(self) -> None:
        connections = getattr(self._factory, "connections", None)
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
                self.port = self._reactor.adoptStreamPort(fd, family, self._factory)
            finally:
                os.close(fd)
            self.pause()
            self._register()
            self._say_where("taken over from the process before")
            return
        outcome: list = []
        self._endpoint.listen(self._factory).addBoth(outcome.append)
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
