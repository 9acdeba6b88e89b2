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

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.python.failure import Failure

from .listen_errors import why_cannot_listen


class CannotListen(Exception):
    """A listener could not start; the message is one line naming the key, the endpoint and why."""


class Listener(Service):
    """Listens on ``description`` (an endpoint string, on ``reactor``) while running."""

    def __init__(self, reactor, key: str, description: str, factory: IProtocolFactory):
        #: ``proxy`` or ``admin``: the service's name.
        self.name = key.split(".")[0]  # type: ignore[assignment]  # Twisted types Service.name as None
        #: The config key the endpoint came from, for the error.
        self.key = key
        self.description = description
        self._endpoint = serverFromString(reactor, description)
        self._factory = factory
        #: The listening port while running (its ``getHost()`` says where a port 0 ended up).
        self.port: IListeningPort | None = None

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
        if port is None:
            return succeed(None)
        connections = getattr(self._factory, "connections", None)
        if connections is not None:
            connections.stopped_listening(port)
        return maybeDeferred(port.stopListening)

    def _listen(self) -> None:
        """Bind now; a TCP or unix endpoint binds (or fails) before ``listen`` returns."""
        outcome: list = []
        self._endpoint.listen(self._factory).addBoth(outcome.append)
        if not outcome:
            raise CannotListen(f"{self.key} {self.description!r}: cannot listen: the endpoint did not bind at once")
        if isinstance(outcome[0], Failure):
            why = why_cannot_listen(outcome[0].value)
            raise CannotListen(f"{self.key} {self.description!r}: cannot listen: {why}") from outcome[0].value
        self.port = outcome[0]
        # A site with a connection cap pauses its port while too many connections are being refused.
        connections = getattr(self._factory, "connections", None)
        if connections is not None:
            connections.listening(self.port)
