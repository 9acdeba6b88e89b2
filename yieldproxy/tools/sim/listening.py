"""
The listener the sim owns: its port, its connections, a quiet Site.

``refuse`` must look like a server that went away: the port closed (new
connections refused) and every open connection reset, idle pooled ones too;
leaving ``refuse`` must bring the same port back.  So the sim binds its own
port and tracks every connection, through :class:`Listener`.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from ...edge.tcp import set_no_delay


class _TrackedConnection(ProtocolWrapper):
    """A connection the sim can abort, with Nagle off (see STYLE pitfall 9)."""

    def makeConnection(self, transport: Any) -> None:
        set_no_delay(transport)
        super().makeConnection(transport)


class _TrackingFactory(WrappingFactory):
    """
    Knows every open connection, so ``refuse``, ``stop`` can abort them all,
    including idle keep-alive ones a client pool holds.
    """

    protocol = _TrackedConnection
    noisy = False

    def __init__(self, wrapped: Site) -> None:
        super().__init__(wrapped)
        self._idle_waiters: list[defer.Deferred[None]] = []

    def unregisterProtocol(self, p: Any) -> None:
        """A connection closed: wake :meth:`when_idle` waiters if none is left."""
        super().unregisterProtocol(p)
        if not self.protocols:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def abort_all(self) -> None:
        """Reset every open connection (``refuse``, ``stop``)."""
        for p in list(self.protocols):
            p.transport.abortConnection()

    def when_idle(self) -> defer.Deferred[None]:
        """Fires once no connection is open."""
        if not self.protocols:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._idle_waiters.append(d)
        return d


class QuietSite(Site):
    """A Site without the access log and its once-a-second timer."""

    noisy = False
    displayTracebacks = False

    def startFactory(self) -> None:
        pass

    def stopFactory(self) -> None:
        pass

    def log(self, request: Any) -> None:
        pass


class SimResource(Resource):
    """The ``twisted.web`` face of a sim: every method and path goes to one dispatcher."""

    isLeaf = True

    def __init__(self, render: Callable[[Request], bytes | int]) -> None:
        super().__init__()
        self._dispatch = render

    def render(self, request: Request) -> bytes | int:
        return self._dispatch(request)


@attrs.define(eq=False)
class Listener:
    """
    A TCP port of the sim's own, which it can close and reopen (``refuse``).

    :param reactor: ``IReactorTCP`` (and ``IReactorTime`` for the Site).
    """

    _reactor: Any
    port: int | None = attrs.field(init=False, default=None)
    """The bound port number (kept while the port is closed), or None."""
    interface: str = attrs.field(init=False, default="127.0.0.1")
    listening: bool = attrs.field(init=False, default=False)
    """Between :meth:`listen` and :meth:`stop`, closed or not."""
    _factory: _TrackingFactory | None = attrs.field(init=False, default=None)
    _port: IListeningPort | None = attrs.field(init=False, default=None)
    _lock: defer.DeferredLock = attrs.field(init=False, factory=defer.DeferredLock)

    @property
    def open_connections(self) -> int:
        """TCP connections open now (idle keep-alive ones too)."""
        return len(self._factory.protocols) if self._factory is not None else 0

    def transports(self) -> list[Any]:
        """The open connections' transports (tests check their socket options)."""
        if self._factory is None:
            return []
        return [p.transport for p in self._factory.protocols]

    def listen(
        self, resource: Callable[[], Resource], port: int, interface: str, closed: Callable[[], bool]
    ) -> defer.Deferred[int]:
        """
        Bind ``interface:port`` (0 picks a free port) and serve ``resource()``.

        :param closed: asked once bound: close the port at once (the sim is in ``refuse``).
        :returns: a Deferred firing with the bound port number.
        """
        if self.listening:
            raise RuntimeError("already listening")
        self.listening = True
        self.interface = interface
        if self._factory is None:
            self._factory = _TrackingFactory(QuietSite(resource(), reactor=self._reactor, timeout=None))

        def bind() -> Any:
            listening = self._reactor.listenTCP(port, self._factory, interface=interface)
            self._port = listening
            self.port = listening.getHost().port
            if closed():
                return self._close().addCallback(lambda _: self.port)
            return self.port

        def failed(f: Any) -> Any:
            self.listening = False
            return f

        return self._lock.run(bind).addErrback(failed)

    def close(self) -> defer.Deferred[None]:
        """Stop accepting and reset every connection; fires when all is closed."""
        return self._lock.run(self._close)

    def reopen(self) -> defer.Deferred[None]:
        """Listen again on the port :meth:`close` closed."""
        return self._lock.run(self._reopen)

    def stop(self) -> defer.Deferred[None]:
        """Close for good (until :meth:`listen` again)."""
        self.listening = False
        if self._factory is None:
            return defer.succeed(None)
        return self._lock.run(self._close)

    def _close(self) -> defer.Deferred[None]:
        waits: list[defer.Deferred[Any]] = []
        port, self._port = self._port, None
        if port is not None:
            waits.append(defer.maybeDeferred(port.stopListening))
        if self._factory is not None:
            self._factory.abort_all()
            waits.append(self._factory.when_idle())
        return defer.gatherResults(waits, consumeErrors=True).addCallback(lambda _: None)

    def _reopen(self) -> None:
        if self._port is None and self.listening:
            self._port = self._reactor.listenTCP(self.port, self._factory, interface=self.interface)
