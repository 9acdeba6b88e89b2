"""The one place a reload writes a client's connection down and makes it again: the HTTP edge's side.

Everything lifecycle/succession/ does to a connection goes through here, on what
the edge's connection offers for it (edge/connection.py: ``snapshot``,
``resume``, ``freeze``, ``thaw``, ``read_ahead``, ``unsent``).  A connection
written down (:class:`Exported`) stays frozen here (it reads nothing, its
deadline does not run, the cap does not reclaim it) until the new process has
taken it on (:meth:`Exported.let_go`: gone from here without a word: no answer,
no FIN, no reset) or will not (:meth:`Exported.resume`: served here as if
nothing had happened; what the client sent meanwhile waited in the socket).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import attrs
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from ...edge.connection import FRESH as FRESH_STATE, IDLE
from ...edge.sockets import duplicate, let_go
from .wire import request_bytes

__all__ = [
    "Exported", "divert", "export_idle", "export_parked", "export_unhandled", "idle_connections", "make_again",
    "serve_here",
]

#: The connection as data when none came with it (a fresh connection that has sent nothing).
FRESH = {"state": "fresh"}


@attrs.define(eq=False)
class Exported:
    """A connection written down for the new process; its copy here is frozen until :meth:`let_go` or
    :meth:`resume`.  :attr:`fd` is a duplicate to send, the link's once given to it (link.py closes it)."""

    fd: int
    family: int
    #: The connection as data (edge/connection.py's ``snapshot``): the new process takes it up in that state.
    connection: dict[str, Any]
    #: What the new process reads first: the request rebuilt (if any), then what the client sent after it.
    data: bytes
    _channel: Any
    #: The request this process handled, if it was a parked one (its handler is dropped as it goes).
    _request: Any = None
    _done: bool = False

    def record(self, **fields: Any) -> tuple[dict[str, Any], bytes]:
        """``fields`` and the connection as the new process takes it up, with the bytes it goes on with (the
        frame has them now: not held here twice while the commit is awaited)."""
        data, self.data = self.data, b""
        return {**fields, "family": self.family, "connection": self.connection, "fd": self.fd}, data

    def let_go(self) -> None:
        """The new process has it: gone from here without a word (its copy lives on there)."""
        if self._done:
            return
        self._done = True
        if self._request is not None:
            self._request.handler = None  # its waiter ends by itself; the client is not gone
        transport = self._channel.transport
        if transport is not None and transport.connected:
            let_go(transport)

    def resume(self) -> None:
        """The new process will not have it: served here again, as it was."""
        if self._done:
            return
        self._done = True
        self._channel.thaw()


def _writable(channel: Any) -> bool:
    transport = getattr(channel, "transport", None)
    return transport is not None and transport.connected and not transport.disconnecting


def _export(channel: Any, data: bytes, request: Any = None) -> Exported:
    fd, family = duplicate(channel.transport)
    exported = Exported(fd, family, channel.snapshot(), data, channel, request)
    channel.freeze()
    return exported


def export_parked(request: Any, body: bytes, parked: bool = True) -> Exported | None:
    """A parked request with its connection: the request as its client sent it, then what it pipelined
    behind it (read here already, held until this request is answered); None if the client is gone."""
    channel = request.channel
    if channel is None or not _writable(channel):
        return None
    return _export(channel, _rebuilt(request, body) + channel.read_ahead, request if parked else None)


def export_unhandled(request: Any) -> Exported | None:
    """A request read whole that this process will not handle (see :func:`divert`): it goes over with its
    connection, as if the new process had read it; None if the client is gone."""
    content = request.content
    body = b""
    if content is not None:
        content.seek(0)
        body = content.read()
    return export_parked(request, body, parked=False)


def export_idle(channel: Any) -> Exported | None:
    """A connection between requests (or before its first), if it can go now: nothing read ahead, every
    byte of its last answer written out (a copy let go here drops what it still buffers)."""
    if not _writable(channel) or channel.unsent or channel.frozen:
        return None
    if channel.state not in (FRESH_STATE, IDLE) or channel.read_ahead:
        return None
    return _export(channel, b"")


def idle_connections(connections: Any) -> list[Any]:
    """A listener's connections between requests (or before their first)."""
    return list(connections.idle_channels())


def _rebuilt(request: Any, body: bytes) -> bytes:
    return request_bytes(
        request.method, request.uri, request.requestHeaders.getAllRawHeaders(), body,
        getattr(request, "clientproto", b"HTTP/1.1"),
    )


class _Adopting:
    """The factory of a connection made again: its listener's connection, never refused for the connection
    cap (the connection was accepted, and counted, already; the cap counts it again from now on)."""

    def __init__(self, site: Any):
        self._site = site

    def buildProtocol(self, addr: Any) -> Any:
        return self._site.connection_for(addr)


def make_again(
    reactor: Any, site: Any, fd: int, family: int, data: bytes = b"",
    feed: Callable[[Any, dict[str, Any], bytes], None] | None = None, connection: dict[str, Any] | None = None,
) -> Any:
    """The connection of ``fd`` (closed here) served by ``site`` in this process, in the state ``connection``
    says it was in, going on with ``data``: ``feed(channel, connection, data)`` takes it up (the proxy app's
    ``adopt``, for a parked request), else the channel itself."""
    try:
        transport = reactor.adoptStreamConnection(fd, family, _Adopting(site))
    finally:
        os.close(fd)
    channel = transport.protocol
    state = connection if connection is not None else FRESH
    if feed is not None:
        feed(channel, state, data)
    else:
        channel.resume(state, data)
    return channel


class _Diverting(Resource):
    """A site's resource while its requests go elsewhere: each is given to ``take``, unanswered here."""

    isLeaf = True

    def __init__(self, inner: Resource, take: Callable[[Any], None]):
        super().__init__()
        self.inner = inner
        self._take = take

    def render(self, request: Any) -> Any:
        self._take(request)
        return NOT_DONE_YET


def divert(sites: Iterable[Any], take: Callable[[Any], None]) -> Callable[[], None]:
    """From now on every request that reaches one of ``sites`` (read whole, not refused by the HTTP layer
    itself) goes to ``take(request)`` instead of its resource; the callable returned puts them back.

    A request taken and then not sent on is served with :func:`serve_here`."""
    sites = list(sites)
    for site in sites:
        site.resource = _Diverting(site.resource, take)

    def undo() -> None:
        for site in sites:
            if isinstance(site.resource, _Diverting):
                site.resource = site.resource.inner

    return undo


def serve_here(request: Any) -> None:
    """A request :func:`divert` took, served here after all (by its site's own resource)."""
    resource = request.site.resource
    request.render(resource.inner if isinstance(resource, _Diverting) else resource)
