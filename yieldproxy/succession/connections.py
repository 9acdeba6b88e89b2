"""The one place a reload writes a client's connection down and makes it again: the HTTP edge's side.

Everything succession/ does to a connection goes through here, so that a new
HTTP edge changes this module alone:

* :func:`export_parked` (a parked request: the request rebuilt, and what the
  client pipelined behind it), :func:`export_idle` (a keep-alive connection
  between requests) and :func:`export_unhandled` (a request read whole that
  this process will not answer: it came after the holds went over) write a
  connection down as an :class:`Exported`: a duplicate of its descriptor to
  send, its address family, and the bytes the new process goes on with;
* the copy here is paused as it is written down (no reads, no timers, never
  reclaimed for the connection cap), and stays so until the new process has
  taken it on (:meth:`Exported.let_go`: gone from here without a word: no
  answer, no FIN, no reset) or will not (:meth:`Exported.resume`: served here
  as if nothing had happened; what the client sent meanwhile waited in the
  socket);
* :func:`make_again` makes a connection sent over again in the new process
  and goes on with its bytes;
* :func:`divert` takes a site's requests away from its resource, each with
  its connection (the old process, once the holds have gone over).

Today's edge is Twisted's ``HTTPChannel`` (httpserver.py's ``ProxyChannel``):
what it read ahead is in ``LineReceiver._buffer`` and ``_dataBuffer``, its
timers are the keep-alive timeout (``TimeoutMixin``) and the read timer of a
connection whose first request counts from the accept.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import attrs
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from .link import _unsent
from .sockets import duplicate, let_go
from .wire import request_bytes

__all__ = ["Exported", "divert", "export_idle", "export_parked", "export_unhandled", "idle_connections", "make_again"]


@attrs.define(eq=False)
class Exported:
    """A connection written down for the new process; its copy here is paused until :meth:`let_go` or
    :meth:`resume`.  :attr:`fd` is a duplicate to send, the sender's to close once it is sent."""

    fd: int
    family: int
    #: What the new process reads first: the request rebuilt (if any), then what the client sent after it.
    data: bytes
    _channel: Any
    _transport: Any
    #: The request this process handled, if it was a parked one (its handler is dropped as it goes).
    _request: Any = None
    #: Which of its listener's sets it was in (``fresh``, ``idle``), to be put back there on :meth:`resume`.
    _was: str | None = None
    #: The keep-alive timeout it had (set again on :meth:`resume`).
    _timeout: float | None = None
    #: The first request's read deadline, for a connection whose read time counts from the accept.
    _read_deadline: float | None = None
    _done: bool = False

    def _pause(self) -> None:
        """No more reads, no timer firing, never closed to make room: nothing here touches it now."""
        channel, transport = self._channel, self._transport
        transport.stopReading()
        connections = getattr(channel, "_connections", None)
        if connections is not None:
            if channel in connections._fresh:
                self._was = "fresh"
            elif channel in connections._idle:
                self._was = "idle"
            connections.set_idle(channel, False)
        self._timeout = channel.setTimeout(None)
        timer = getattr(channel, "_read_timer", None)
        if timer is not None:
            self._read_deadline = channel._read_deadline
            channel._read_timer = None
            if timer.active():
                timer.cancel()

    def let_go(self) -> None:
        """The new process has it: gone from here without a word (its copy lives on there)."""
        if self._done:
            return
        self._done = True
        if self._request is not None:
            self._request.handler = None  # its waiter ends by itself; the client is not gone
        if self._transport.connected:
            let_go(self._transport)

    def resume(self) -> None:
        """The new process will not have it: served here again, as it was."""
        if self._done:
            return
        self._done = True
        channel, transport = self._channel, self._transport
        if not transport.connected:
            return
        connections = getattr(channel, "_connections", None)
        if connections is not None and self._was is not None:
            if self._was == "fresh":
                connections._fresh[channel] = None
            else:
                connections.set_idle(channel, True)
        if self._timeout is not None:
            channel.setTimeout(self._timeout)
        if self._read_deadline is not None:
            channel._read_deadline = self._read_deadline
            left = max(0.0, self._read_deadline - channel._now())
            channel._read_timer = channel.callLater(left, channel._read_timer_fired)
        if not _pushed_back(channel):
            transport.startReading()


def _pushed_back(channel) -> bool:
    """Twisted stopped reading this channel itself: a request is being handled and the client pipelined
    more than it reads ahead (it reads again once that request is answered)."""
    buffered = sum(map(len, getattr(channel, "_dataBuffer", ())))
    return bool(getattr(channel, "_handlingRequest", False)) and buffered > getattr(
        channel, "_optimisticEagerReadSize", buffered
    )


def _read_ahead(channel) -> bytes:
    """What the client sent that the channel holds unparsed (pipelined requests), in the order it came."""
    data = bytes(getattr(channel, "_buffer", b"") or b"") + b"".join(getattr(channel, "_dataBuffer", None) or ())
    return data


def _writable(transport) -> bool:
    return transport is not None and transport.connected and not transport.disconnecting


def _export(channel, data: bytes, request: Any = None) -> Exported:
    transport = channel.transport
    fd, family = duplicate(transport)
    exported = Exported(fd, family, data, channel, transport, request)
    exported._pause()
    return exported


def export_parked(request, body: bytes) -> Exported | None:
    """A parked request with its connection: the request as its client sent it, then what it pipelined
    behind it (read here already, held until this request is answered); None if the client is gone."""
    channel = request.channel
    if channel is None or not _writable(getattr(channel, "transport", None)):
        return None
    data = _rebuilt(request, body) + _read_ahead(channel)
    return _export(channel, data, request)


def export_unhandled(request) -> Exported | None:
    """A request read whole that this process will not handle (see :func:`divert`): it goes over with its
    connection, as if the new process had read it; None if the client is gone."""
    channel = request.channel
    if channel is None or not _writable(getattr(channel, "transport", None)):
        return None
    content = request.content
    body = b""
    if content is not None:
        content.seek(0)
        body = content.read()
    data = _rebuilt(request, body) + _read_ahead(channel)
    return _export(channel, data)


def export_idle(channel) -> Exported | None:
    """A connection between requests (or before its first), if it can go now: not busy, nothing read
    ahead, every byte of its last answer written out (a copy let go here drops what it still buffers)."""
    transport = getattr(channel, "transport", None)
    if not _writable(transport) or _unsent(transport):
        return None
    if getattr(channel, "_handlingRequest", False) or getattr(channel, "_in_request", False):
        return None
    if getattr(channel, "_draining", False) or _read_ahead(channel):
        return None
    return _export(channel, b"")


def idle_connections(connections) -> list:
    """A listener's connections between requests (or before their first)."""
    return connections.idle_channels()


def _rebuilt(request, body: bytes) -> bytes:
    return request_bytes(
        request.method, request.uri, request.requestHeaders.getAllRawHeaders(), body,
        getattr(request, "clientproto", b"HTTP/1.1"),
    )


class _Adopting:
    """The factory of a connection made again: its listener's channel, never refused for the connection cap
    (the connection was accepted, and counted, already; the cap counts it again from now on)."""

    def __init__(self, site):
        self._site = site

    def buildProtocol(self, addr):
        channel_for = getattr(self._site, "channel_for", None)
        return channel_for(addr) if channel_for is not None else self._site.buildProtocol(addr)


def make_again(
    reactor, site, fd: int, family: int, data: bytes = b"", feed: Callable[[Any, bytes], None] | None = None,
) -> Any:
    """The connection of ``fd`` (closed here) served by ``site`` in this process, going on with ``data``:
    ``feed(channel, data)`` reads it (the proxy app's ``adopt``, for a parked request), else the channel."""
    try:
        transport = reactor.adoptStreamConnection(fd, family, _Adopting(site))
    finally:
        os.close(fd)
    channel = transport.protocol
    if feed is not None:
        feed(channel, data)
    elif data:
        channel.dataReceived(data)
    return channel


class _Diverting(Resource):
    """A site's resource while its requests go elsewhere: each is given to ``take``, unanswered here."""

    isLeaf = True

    def __init__(self, inner: Resource, take: Callable[[Any], None]):
        super().__init__()
        self.inner = inner
        self._take = take

    def render(self, request):
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


def serve_here(request) -> None:
    """A request :func:`divert` took, served here after all (by its site's own resource)."""
    resource = request.site.resource
    request.render(resource.inner if isinstance(resource, _Diverting) else resource)
