"""The listener the sim owns: connection tracking, Nagle off, a quiet Site."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet import defer
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

if TYPE_CHECKING:
    from .server import SimOllama

class _TrackedConnection(ProtocolWrapper):
    """A connection the sim can abort, with Nagle off (see STYLE pitfall 9)."""

    def makeConnection(self, transport: Any) -> None:
        set_no_delay = getattr(transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
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


class _QuietSite(Site):
    """A Site without the access log and its once-a-second timer."""

    noisy = False
    displayTracebacks = False

    def startFactory(self) -> None:
        pass

    def stopFactory(self) -> None:
        pass

    def log(self, request: Any) -> None:
        pass


class _SimResource(Resource):
    """The ``twisted.web`` face of a :class:`SimOllama`: every path."""

    isLeaf = True

    def __init__(self, sim: SimOllama) -> None:
        super().__init__()
        self._sim = sim

    def render(self, request: Request) -> bytes | int:
        """Every method and path goes to the sim's dispatcher."""
        return self._sim._render(request)
