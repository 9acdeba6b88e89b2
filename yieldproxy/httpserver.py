"""The proxy listener's HTTP server pieces: bounded requests, TCP_NODELAY, no access log.

Everything about how bytes from a client become a request lives here, apart
from what the proxy does with the request (proxy.py).  A hostile or broken
client must not be able to make the proxy buffer without bound, wait without
bound, or forward anything it did not parse itself, so this layer:

* refuses a body over ``proxy.max_body_bytes`` as soon as that is known (from
  ``Content-Length``, or mid-way through a chunked body): the request is
  answered 413 at once, without its body (by the site's ``oversized``, the
  proxy app's own answer); the rest of the body is read and dropped, then the
  connection is closed;
* answers 431 for too many or too large header lines, 414 for an overlong
  request line, and a JSON 400 for every request Twisted's parser rejects
  (conflicting ``Content-Length``/``Transfer-Encoding``, CR/LF/NUL in a
  header value, malformed chunks...), always with ``Connection: close``;
* gives a client ``request_read_timeout`` seconds to deliver a whole request
  (headers and body) from its first byte, so a client that dribbles its
  headers a byte at a time (slowloris) gets 408 instead of holding a
  connection for as long as it keeps sending;
* drops a client that stops reading its answer for the idle timeout, so a
  stalled reader cannot hold an upstream connection and a replay slot;
* never parses form bodies (Twisted does by default) and never opens a
  tunnel (``CONNECT`` is answered 405);
* accepts ``Transfer-Encoding: chunked`` and nothing else (any other coding,
  ``identity`` included, is a 400: a body the proxy cannot delimit the way
  the upstream would is a request smuggled past it);
* answers only to its own names (a ``Host`` outside the listener's
  :class:`~yieldproxy.hosts.HostPolicy` gets 403), so a web page cannot reach
  it through DNS rebinding;
* keeps at most ``max_connections`` connections open (:class:`Connections`):
  past it, an idle keep-alive connection (one that finished a request) is
  closed to make room, or the new one is answered 503 with ``Retry-After``
  and closed, never closed unanswered (under a flood the port pauses
  accepting), so a flood cannot use up the process's file descriptors; the
  admin listener also caps each peer address and keeps room for requests
  that come whole at once (:class:`OverCapacity`), so the operator gets in;
* bounds the bytes of bodies being received at once, all connections
  together (``proxy.max_receiving_bytes``): past it a body is answered 503
  before it is read, a quarter being kept for small bodies;
* refuses a head or a chunk line ending in a bare LF and a chunk size of more
  than 16 hex digits with its 400 at once (:class:`StrictChunkedDecoder`),
  where Twisted would wait for a CRLF that never comes;
* closes a connection that waits for its next request longer than the
  keep-alive timeout (the Site's ``timeout``), much shorter than the time a
  slow reader is given (``stall_timeout``).

After refusing, the connection lingers a moment, reading and dropping what the
client still sends, so the client reads our answer instead of a TCP reset.

The channel hooks into :class:`twisted.web.http.HTTPChannel` internals
(``_receivedHeaderSize``, ``_handlingRequest``, ``_respondToBadRequestAndDisconnect``,
``_failChooseTransferDecoder``, ``_finishRequestBody``, ``LineReceiver._buffer``,
``_ChunkedTransferDecoder`` and ``tcp.Port.numberAccepts``...), as they are in
Twisted 26.10; ``tests/test_httpserver_hooks.py`` fails, naming the hook, if a Twisted release
stops calling one.
"""

from __future__ import annotations

import io
import re
from typing import Any, Callable
from urllib.parse import unquote_to_bytes

import attrs
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.http import RESPONSES, HTTPChannel, _ChunkedTransferDecoder, _MalformedChunkedDataError
from twisted.web.server import Request, Site

from .classify import api_family
from .errors import error_body
from .hosts import HostPolicy
from .requestlog import log_request
from .tcp import set_no_delay

log = Logger()

#: Seconds to deliver a whole request (proxy.request_read_timeout_seconds).
DEFAULT_REQUEST_READ_TIMEOUT = 30.0
#: Seconds a refused connection keeps reading (and dropping) before it is cut.
LINGER_SECONDS = 5.0
#: Reason phrases Twisted's table lacks.
_PHRASES = {431: b"Request Header Fields Too Large"}
#: Header lines per request (Twisted allows 500; no Ollama client sends 30).
MAX_HEADERS = 100
#: Bytes of the request line plus every header line (Twisted's default).
MAX_HEADER_BYTES = 16384
#: Seconds a connection over the cap waits for its request line (to answer in its API's shape).
OVER_CAPACITY_WAIT = 1.0
#: Retry-After, in seconds, of the 503 for a connection over the cap.
OVER_CAPACITY_RETRY_AFTER = 2
#: Connections being refused at once (each holds a descriptor for a second or two);
#: at it the listener stops accepting until one is done (see :class:`Connections`).
MAX_REFUSING = 64
#: Connections a listener keeps past its cap for requests that come whole at once (the admin
#: listener's, see :class:`OverCapacity`); they fit in the open-file budget's reserve (limits.py).
QUICK_ROOM = 8
#: Seconds between two log lines about refused connections.
REFUSAL_LOG_INTERVAL = 10.0
#: The Content-Length of a head, for :func:`_complete` (a malformed one is the channel's 400 to give).
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,12})[ \t]*\r\n", re.IGNORECASE)
#: A body up to this size is small: the last quarter of the receiving budget is kept for such bodies.
SMALL_BODY_BYTES = 64 * 1024
#: Retry-After, in seconds, of the 503 for a body refused because the receiving budget is used up.
RECEIVING_RETRY_AFTER = 5


#: Hex digits of a chunk size: 16 make 64 bits, as Go's ``parseHexUint`` takes (net/http/internal/chunked.go).
MAX_CHUNK_SIZE_DIGITS = 16


class StrictChunkedDecoder(_ChunkedTransferDecoder):
    """Twisted's chunked decoder, refusing what it would wait on forever or read another way.

    Twisted's looks for CRLF only: a chunk-size line, the last chunk or a
    trailer ended by a bare LF was waited on until the read timeout, and a
    size of any number of digits was taken.  Here a bare LF and a size over
    :data:`MAX_CHUNK_SIZE_DIGITS` digits are malformed (the channel's 400),
    and each size read is shown to ``on_size`` (the request refuses a chunk
    that cannot fit its body limit as soon as it is announced).
    """

    #: Why the body was found malformed (the channel's 400 says it).
    error: str | None = None

    def __init__(self, dataCallback, finishCallback, on_size: Callable[[int], None]):
        super().__init__(dataCallback, finishCallback)
        self._on_size = on_size

    def _malformed(self, why: str) -> _MalformedChunkedDataError:
        self.error = why
        return _MalformedChunkedDataError(why)

    def _check_line(self) -> None:
        """The buffer starts with a line: it must end in CRLF (once its LF is in)."""
        buffer = self._buffer
        lf = buffer.find(b"\n")
        if lf == 0 or (lf > 0 and buffer[lf - 1] != 0x0D):
            raise self._malformed("a chunk line ends in a bare LF (chunk lines end in CRLF)")

    def _dataReceived_CHUNK_LENGTH(self) -> bool:
        self._check_line()
        buffer = self._buffer
        end = buffer.find(b"\r")
        digits = buffer[: end if end >= 0 else len(buffer)].split(b";", 1)[0]
        if len(digits) > MAX_CHUNK_SIZE_DIGITS:
            raise self._malformed(f"a chunk size of more than {MAX_CHUNK_SIZE_DIGITS} hex digits")
        went_on = super()._dataReceived_CHUNK_LENGTH()
        if went_on:
            self._on_size(self.length)
        return went_on

    def _dataReceived_TRAILER(self) -> bool:
        self._check_line()
        return super()._dataReceived_TRAILER()


def _peer_host(address) -> str | None:
    """The host of a peer address (None for a unix socket's: no cap per address there)."""
    return getattr(address, "host", None)


@attrs.define(eq=False)
class Connections:
    """The open connections of one listener, and its cap.

    Counted from the channels' own ``connectionMade``/``connectionLost``, so
    the count cannot drift.  Idle keep-alive connections (ones that finished
    a request and wait for the next) are kept oldest first: at the cap, the
    oldest is closed to make room (as nginx reuses them) before a new
    connection is refused.  A connection just accepted is not idle: its
    client is about to send its first request, and closing it would leave
    that client without an answer.

    A connection past the cap is answered 503 (:class:`OverCapacity`), which
    holds its descriptor for a second or two.  With :data:`MAX_REFUSING`
    being refused at once, the listeners (see :meth:`listening`) stop
    accepting until one of them is done: further clients wait in the
    kernel's backlog for their answer instead of getting a bare close.
    """

    #: Connections at once; the config key named in the refusal.
    limit: int
    key: str = "proxy.max_connections"
    open: int = 0
    #: Connections answered 503 (or closed unanswered) because of the cap, since start.
    refused: int = 0
    #: Idle keep-alive connections closed to make room, since start.
    reclaimed: int = 0
    refusing: int = 0
    #: Bytes of request bodies being received at once (None: not bounded); see :meth:`take_receiving`.
    max_receiving_bytes: int | None = None
    #: Bytes of request bodies being received now (a declared length counts whole from its head).
    receiving: int = 0
    #: Connections one peer address may hold (None: no cap per address); past it, as past the cap.
    per_peer: int | None = None
    #: Connections past ``limit`` kept for requests that come whole within ``quick_seconds`` (see
    #: :class:`OverCapacity`); 0 with ``quick_seconds`` None: no such room (the proxy listener).
    reserved: int = 0
    quick_seconds: float | None = None
    _peers: dict = attrs.Factory(dict)
    _peer_of: dict = attrs.Factory(dict)
    _idle: dict = attrs.Factory(dict)
    _last_log: float | None = None
    _refused_since_log: int = 0
    #: The listeners serving these connections (listener.py), held back while too many are being refused.
    _listeners: list = attrs.Factory(list)
    _held_back: bool = False
    #: Connections accepted that have not sent a byte yet (not reclaimable, but a reload hands them over).
    _fresh: dict = attrs.Factory(dict)
    #: Connections past the cap whose whole request came in time, waiting (first come, first served) for
    #: room in :attr:`reserved` (see :class:`OverCapacity`).
    _waiting: dict = attrs.Factory(dict)
    #: Every open channel (a stop waits for the answers still to be written to them: :meth:`flushed`).
    _channels: dict = attrs.Factory(dict)
    #: The channels a stop waits to see written out and closed, and its waiter (:meth:`flushed`).
    _flushing: dict = attrs.Factory(dict)
    _flushed: list = attrs.Factory(list)

    def opened(self, channel) -> None:
        """A channel's connection is made (counted whatever it does next; not idle: its request is coming)."""
        self.open += 1
        self._channels[channel] = None
        self._fresh[channel] = None
        if self.per_peer is not None:
            host = _peer_host(channel.transport.getPeer())
            if host is not None:
                self._peer_of[channel] = host
                self._peers[host] = self._peers.get(host, 0) + 1

    def closed(self, channel) -> None:
        """A channel's connection is gone: its descriptor is free again."""
        self.open -= 1
        self._channels.pop(channel, None)
        if self._flushing and self._flushing.pop(channel, 1) is None and not self._flushing:
            self._done_flushing()
        if self._waiting:
            next(iter(self._waiting)).room_freed()
        self._idle.pop(channel, None)
        self._fresh.pop(channel, None)
        if self._peer_of:
            host = self._peer_of.pop(channel, None)
            if host is not None:
                left = self._peers[host] - 1
                if left:
                    self._peers[host] = left
                else:
                    del self._peers[host]

    def flushed(self) -> Deferred[None]:
        """Fires once every connection holding answer bytes not yet written to its socket has written them
        and closed (each is closed: its transport's ``loseConnection`` writes them first).

        The stop's last step: the process ends right after, and the reactor's end drops what a transport
        still buffers, so an answer written just before (the drain's 503s) would reach its client as a bare
        close.  Connections with nothing left to write are not waited for."""
        waiter: Deferred[None] = Deferred()
        self._flushed.append(waiter)
        for channel in list(self._channels):
            transport = channel.transport
            if transport is not None and _unsent(transport):
                self._flushing[channel] = None
        for channel in list(self._flushing):
            channel.loseConnection()
        if not self._flushing:
            self._done_flushing()
        return waiter

    def _done_flushing(self) -> None:
        waiters, self._flushed = self._flushed, []
        for waiter in waiters:
            if not waiter.called:
                waiter.callback(None)

    def peer_full(self, address) -> bool:
        """``address`` holds its share of the listener already (``per_peer``)."""
        if self.per_peer is None:
            return False
        host = _peer_host(address)
        return host is not None and self._peers.get(host, 0) >= self.per_peer

    def make_room(self) -> bool:
        """Room for a request that came whole at once: the room kept for such requests, or an idle connection's."""
        return self.open < self.limit + self.reserved or self.reclaim_idle()

    def wait_for_room(self, waiter) -> None:
        """``waiter`` (an :class:`OverCapacity`) has a whole request and no room: its ``room_freed`` is called,
        first come first served, when a connection closes."""
        self._waiting[waiter] = None

    def stop_waiting(self, waiter) -> None:
        self._waiting.pop(waiter, None)
        if self._waiting and self.open < self.limit + self.reserved:
            next(iter(self._waiting)).room_freed()

    def first_in_line(self, waiter) -> bool:
        """No request that came whole before ``waiter``'s is still waiting for room."""
        return not self._waiting or next(iter(self._waiting)) is waiter

    def set_idle(self, channel, idle: bool) -> None:
        """Mark ``channel`` as waiting for its next request (reclaimable) or busy with one."""
        self._idle.pop(channel, None)
        if idle:
            self._idle[channel] = None
        else:
            self._fresh.pop(channel, None)

    def idle_channels(self) -> list:
        """The connections waiting for a request, the first or the next (a reload hands them over)."""
        return [*self._fresh, *self._idle]

    def full(self) -> bool:
        """At the cap: a new connection needs room made, or is refused."""
        return self.open >= self.limit

    def reclaim_idle(self) -> bool:
        """Close the oldest idle keep-alive connection, if there is one."""
        while self._idle:
            channel = next(iter(self._idle))
            del self._idle[channel]
            transport = channel.transport
            if transport is None or transport.disconnecting:
                continue
            self.reclaimed += 1
            channel.loseConnection()
            return True
        return False

    def take_receiving(self, size: int, large: bool) -> bool:
        """Count ``size`` more bytes of a body being received, if they fit; False if they do not.

        A large body (over :data:`SMALL_BODY_BYTES`) may fill three quarters
        of ``max_receiving_bytes``; the last quarter is kept for small ones,
        so that uploads holding back their last byte cannot stop small
        requests.  With nothing being received, any body fits: the budget
        never refuses a body the body limit allows when it is alone.
        """
        limit = self.max_receiving_bytes
        if limit is not None and self.receiving:
            room = limit - limit // 4 if large else limit
            if self.receiving + size > room:
                return False
        self.receiving += size
        return True

    def give_back_receiving(self, size: int) -> None:
        self.receiving -= size

    def listening(self, listener) -> None:
        """``listener`` accepts these connections: it is held back (``hold_back``/``let_in``) under a flood."""
        if listener not in self._listeners:
            self._listeners.append(listener)
            if self._held_back:
                listener.hold_back()

    def stopped_listening(self, listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def refusing_started(self) -> None:
        """A connection is being refused: at :data:`MAX_REFUSING`, stop accepting until one is done."""
        self.refusing += 1
        if self.refusing >= MAX_REFUSING and not self._held_back:
            self._held_back = True
            for listener in self._listeners:
                listener.hold_back()

    def refusing_ended(self) -> None:
        self.refusing -= 1
        if self._held_back and self.refusing < MAX_REFUSING:
            self._held_back = False
            for listener in self._listeners:
                listener.let_in()

    def note_refusal(self, clock) -> None:
        """Count a refused connection; log it, at most once every few seconds."""
        self.refused += 1
        self._refused_since_log += 1
        now = clock.seconds()
        if self._last_log is None or now - self._last_log >= REFUSAL_LOG_INTERVAL:
            log.warn(
                "connection cap reached ({key} = {limit}): refused {count} connection(s) with 503",
                key=self.key, limit=self.limit, count=self._refused_since_log,
            )
            self._last_log = now
            self._refused_since_log = 0


def _unsent(transport) -> bool:
    """Whether ``transport`` (or the one under it: TLS) holds bytes written to it but not yet to its socket."""
    while transport is not None:
        if len(getattr(transport, "dataBuffer", b"")) - getattr(transport, "offset", 0) > 0:
            return True
        if getattr(transport, "_tempDataLen", 0):
            return True
        transport = getattr(transport, "transport", None)
    return False


def _complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole request: its head, and as many body bytes as its Content-Length says."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    length = _CONTENT_LENGTH.search(data, 0, end + 2)
    return length is None or len(data) - end - 4 >= int(length.group(1))


class OverCapacity(Protocol):
    """A connection past the cap: a 503 with Retry-After in its API's shape, then closed.

    It waits up to :data:`OVER_CAPACITY_WAIT` for the request line, to answer
    an OpenAI client in the OpenAI shape; then it writes the answer, shuts
    its side, and drops what still comes for a moment (so the client reads
    the answer rather than a reset).

    With ``promote`` (the admin listener, whose :class:`Connections` keeps
    room for quick requests), a connection whose whole request comes within
    ``quick_seconds`` is not refused if there is room kept for it: it is
    handed to a channel built by ``promote(address)``, which reads the
    request as if it had come to it, answers it with ``Connection: close``
    and closes.  A flood of connections that send a byte and wait never
    fills that room, and one that sends a whole request holds its place only
    while it is answered (kept alive, a next request begun in the same
    packet held it for the read timeout), so the operator's own calls, whole
    in their first packet, get through.  When that room is full, a whole
    request waits for it in line, first come first served, up to
    :data:`OVER_CAPACITY_WAIT`: a flood of whole requests cannot crowd the
    operator's out, since each of them is answered in turn.
    """

    #: Set by ``makeConnection``: a TCP (or unix) transport.
    transport: Any

    def __init__(self, connections: Connections, clock, promote: Callable[[Any], Any] | None = None):
        self._connections = connections
        self._clock = clock
        self._promote = promote
        self._head = b""
        self._timer = None
        self._answered = False
        #: The next try for room, after a connection closed (:meth:`room_freed`).
        self._retry = None
        #: Its whole request waits for room kept (:meth:`Connections.wait_for_room`).
        self._in_line = False

    def connectionMade(self):
        self._connections.refusing_started()
        wait = OVER_CAPACITY_WAIT
        if self._promote is not None:
            wait = self._connections.quick_seconds or wait
        self._timer = self._clock.callLater(wait, self._answer)

    def dataReceived(self, data):
        if self._answered:
            return
        self._head += data
        if self._in_line:
            if len(self._head) > MAX_HEADER_BYTES:
                self._answer()
            return
        if self._promote is not None and _complete(self._head):
            if self._connections.first_in_line(self) and self._connections.make_room() and self._hand_over():
                return
            if getattr(self.transport, "protocol", None) is not self:
                self._answer()  # a wrapping transport (TLS) cannot be handed over: refused as usual
                return
            # In line for the room kept, for a while: every request before it is answered in turn.
            self._in_line = True
            self._connections.wait_for_room(self)
            self._stop_timer()
            self._timer = self._clock.callLater(OVER_CAPACITY_WAIT, self._answer)
        elif (self._promote is None and b"\n" in self._head) or len(self._head) > MAX_HEADER_BYTES:
            self._answer()

    def room_freed(self) -> None:
        """A connection closed: try for room once the reactor is through with that close."""
        if self._retry is None and not self._answered:
            self._retry = self._clock.callLater(0, self._try_room)

    def _try_room(self) -> None:
        self._retry = None
        if not self._answered and self._connections.make_room():
            self._hand_over()

    def _hand_over(self) -> bool:
        """Give the connection, and what it sent, to a channel of the site; False if its transport cannot switch."""
        transport = self.transport
        if getattr(transport, "protocol", None) is not self:
            return False  # a wrapping transport (TLS) delivers to another attribute: refused as usual
        self._answered = True
        self._stop_timer()
        self._connections.stop_waiting(self)
        self._connections.refusing_ended()
        channel = self._promote(transport.getPeer())
        channel.one_request = True
        transport.protocol = channel
        channel.makeConnection(transport)
        channel.dataReceived(self._head)
        return True

    def _answer(self) -> None:
        if self._answered:
            return
        self._answered = True
        self._stop_timer()
        self._connections.stop_waiting(self)
        self._connections.note_refusal(self._clock)
        parts = self._head.split(b"\n", 1)[0].split(b" ")
        path = parts[1] if len(parts) > 2 else b""
        message = (
            f"too many connections to this listener ({self._connections.key} = {self._connections.limit}); "
            "try again shortly"
        )
        body = error_body(api_family(path), 503, message, "too_many_connections")
        transport = self.transport
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json; charset=utf-8\r\n"
            b"retry-after: %d\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (OVER_CAPACITY_RETRY_AFTER, len(body), body)
        )
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is None:
            transport.loseConnection()
            return
        lose_write()
        self._timer = self._clock.callLater(OVER_CAPACITY_WAIT, transport.abortConnection)

    def _stop_timer(self) -> None:
        for name in ("_timer", "_retry"):
            timer = getattr(self, name)
            setattr(self, name, None)
            if timer is not None and timer.active():
                timer.cancel()

    def connectionLost(self, reason):
        self._stop_timer()
        self._connections.stop_waiting(self)
        self._connections.refusing_ended()


class ProxyRequest(Request):
    """A request whose body is held in memory up to a limit, and refused past it.

    Twisted's own Request spools bodies over 100 KB to a temporary file and
    accepts any size; a parked request must stay in memory (it is counted in
    ``parking.max_parked_bytes``) and an oversized one must neither fill the
    disk nor be read whole before it is refused.
    """

    #: The body so far (Twisted types it None until ``gotLength``).
    content: Any
    max_body_bytes = 32 * 1024 * 1024
    #: Set once the body passed ``max_body_bytes``: it is no longer kept, and the app never sees it.
    too_large = False
    #: Give the requests answered here their line in the request log (requestlog.py).
    request_log = True
    #: The handler's Deferred while it runs (proxyresource.py), cancelled if the client goes away:
    #: what a ``notifyFinish`` errback did, without a Deferred more per request.
    handler = None
    #: Set once the body was refused because the listener's receiving budget is used up (a 503).
    receiving_full = False
    #: Bytes this request counts in its listener's receiving budget while its body arrives.
    _receiving = 0

    def gotLength(self, length):
        self.content = io.BytesIO()
        if length:
            if length > self.max_body_bytes:
                self._refuse_body()
            else:
                self._take_receiving(length, length > SMALL_BODY_BYTES)

    def handleContentChunk(self, data):
        if self.too_large or self.receiving_full:
            return
        size = self.content.tell() + len(data)
        if size > self.max_body_bytes:
            # Only a chunked body gets here: a declared length is checked in gotLength.
            self._refuse_body()
            return
        if self._receiving < size and not self._take_receiving(len(data), size > SMALL_BODY_BYTES):
            return
        self.content.write(data)

    def _take_receiving(self, size: int, large: bool) -> bool:
        """Count ``size`` body bytes in the listener's receiving budget; refuse the body (503) if they do not fit."""
        connections = getattr(self.channel, "_connections", None)
        if connections is None:
            return True
        if not connections.take_receiving(size, large):
            self._refuse_body(receiving_full=True)
            return False
        self._receiving += size
        return True

    def received(self) -> None:
        """The body is in (or will never be): its bytes leave the receiving budget."""
        size, self._receiving = self._receiving, 0
        if size:
            connections = getattr(self.channel, "_connections", None)
            if connections is not None:
                connections.give_back_receiving(size)

    def chunk_size(self, length: int) -> None:
        """A chunk of ``length`` bytes is announced: refused at once if the body cannot hold it."""
        if not self.too_large and self.content.tell() + length > self.max_body_bytes:
            self._refuse_body()

    def _refuse_body(self, receiving_full: bool = False) -> None:
        """Drop what was kept and let the channel answer now instead of reading on."""
        if receiving_full:
            self.receiving_full = True
        else:
            self.too_large = True
        self.received()
        self.content = io.BytesIO()
        # No "100 Continue" for a body that will be refused: the client need not send it.
        self.requestHeaders.removeHeader(b"expect")
        refuse = getattr(self.channel, "refuse_body", None)
        if refuse is not None:
            refuse(self)

    def connectionLost(self, reason):
        self.received()
        super().connectionLost(reason)
        handler, self.handler = self.handler, None
        if handler is not None:
            handler.cancel()

    def process(self):
        """Hand the request to the app, unless it is answered here (see :meth:`_refusal`).

        A body over the limit was not read: such a request goes to the site's
        ``oversized`` answer (the proxy app's, which counts it) instead of the
        app's resource, which only ever sees whole bodies.
        """
        refusal = self._refusal()
        if refusal is None:
            site = self.channel.site
            if self.too_large:
                answer = site.oversized
            elif self.receiving_full:
                answer = site.receiving_full
            else:
                super().process()
                return
            body = answer(self)
            self.setHeader(b"content-length", b"%d" % len(body))
            self.write(body)
            self.finish()
            return
        status, message, code = refusal
        if self.request_log:
            clock = self.channel.site.reactor
            log_request(self, "passthrough", status, code, 0.0, 0, clock.seconds(), clock)
        body = error_body(api_family(self.path or b""), status, message, code)
        self.setResponseCode(status)
        if status == 405:
            self.setHeader(b"allow", b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
        if status == 503:
            self.setHeader(b"retry-after", b"%d" % RECEIVING_RETRY_AFTER)
        self.setHeader(b"content-type", b"application/json; charset=utf-8")
        self.setHeader(b"content-length", b"%d" % len(body))
        self.write(body)
        self.finish()

    def _refusal(self) -> tuple[int, str, str] | None:
        """Why this request is answered here without reaching the app, if it is.

        Klein needs the Host header and the (percent-decoded) path in UTF-8,
        and logs a traceback for each request where they are not: a client
        could fill the log with them.  RFC 9112 (3.2) wants 400 for an invalid
        Host anyway; the proxy itself never uses it.
        """
        if self.method == b"CONNECT":
            # A reverse proxy for one upstream opens no tunnels, whatever the target.
            return 405, "CONNECT is not served here: this is a reverse proxy for one upstream", "bad_request"
        if self.too_large and self.channel.site.oversized is None:  # type: ignore[attr-defined]  # Site.buildProtocol sets it
            return 413, f"request body larger than {self.max_body_bytes} bytes", "too_large"
        if self.receiving_full and self.channel.site.receiving_full is None:  # type: ignore[attr-defined]
            return 503, receiving_full_message(self.channel._connections), "receiving_full"  # type: ignore[attr-defined]
        hosts = self.requestHeaders.getRawHeaders(b"host", [])
        channel = self.channel
        # The Host this connection's last request passed the checks below with:
        # a keep-alive client sends the same one every time.
        known = len(hosts) == 1 and hosts[0] == getattr(channel, "_host_passed", None)
        if not known:
            for host in hosts:
                try:
                    host.decode("utf-8")
                except UnicodeDecodeError:
                    return 400, "the Host header is not valid UTF-8", "bad_request"
            if len(hosts) > 1:
                # RFC 9112 3.2: more than one Host is a 400.
                return 400, "more than one Host header", "bad_request"
        path = self.path
        if b"%" in path or not path.isascii():
            try:
                unquote_to_bytes(path).decode("utf-8")
            except UnicodeDecodeError:
                return 400, "the request path is not valid UTF-8 (once percent-decoded)", "bad_request"
        if known:
            return None
        policy = getattr(channel.site, "host_policy", None)  # type: ignore[attr-defined]  # Site.buildProtocol sets it
        # A target that is not a path (absolute-form) goes nowhere whatever its Host:
        # the app refuses it with its own 400.  A unix socket is out of any web page's reach.
        if policy is not None and self.uri[:1] in (b"/", b"*"):
            local = self.getHost()
            if not isinstance(local, UNIXAddress):
                named = hosts[0].decode("utf-8") if hosts else None
                if named is not None and not policy.allows(named, getattr(local, "host", None)):
                    return (
                        403,
                        f"Host {named[:100]!r} is not a name of this listener (a web page using DNS "
                        f"rebinding?); if it is yours, add it to {policy.key}",
                        "forbidden_host",
                    )
            if len(hosts) == 1 and isinstance(channel, ProxyChannel):
                channel._host_passed = hosts[0]
        return None


class ProxyChannel(HTTPChannel):
    """HTTP/1.1 with Nagle off, bounded reading, and explicit answers to bad requests."""

    #: Set by ``makeConnection``: a TCP (or unix) transport.
    transport: Any

    maxHeaders = MAX_HEADERS
    totalHeadersSize = MAX_HEADER_BYTES
    MAX_LENGTH = MAX_HEADER_BYTES
    linger_seconds = LINGER_SECONDS

    # This channel's own state lives in slots, not in the instance dict: with
    # Twisted's attributes and these, the dict had over 30 keys, past which
    # CPython stops sharing keys between instances and gives each channel a
    # full dict of its own (1.6 KB per connection, held by every parked request).
    __slots__ = (
        "_draining", "_in_request", "_connections", "_read_timer", "_read_deadline", "_local_address",
        "_secure", "_host_passed", "_read_timeout_seconds", "_stall_timer", "_linger_timer",
        "_idle_timeout", "_bad_reason", "one_request",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: Set once this connection is refusing: everything it still reads is dropped.
        self._draining = False
        #: Set from a request's first byte until it is read in full.
        self._in_request = False
        self._connections = None
        self._read_timer = None
        #: When the request being read must be in (``clock.seconds()``); None between requests.
        self._read_deadline = None
        #: The listener's address this connection came in on (it never changes: read once).
        self._local_address = None
        #: Whether the transport is TLS (it never changes: asked once).
        self._secure = None
        #: The ``Host`` value a request on this connection was last allowed with (see ``ProxyRequest._refusal``).
        self._host_passed = None
        #: The site's request read timeout, read once (see :meth:`_arm_read_timer`).
        self._read_timeout_seconds = None
        self._stall_timer = None
        self._linger_timer = None
        self._idle_timeout = None
        self._bad_reason = None
        #: Serve one request, then close (a connection let in past the cap: see :class:`OverCapacity`).
        self.one_request = False

    # -- connection --------------------------------------------------------------

    def connectionMade(self):
        super().connectionMade()
        set_no_delay(self.transport)
        # The read timeout starts with a request's first byte: a connection that
        # sends nothing at all is the keep-alive timeout's (closed without an answer).
        site = getattr(self, "site", None)
        self._idle_timeout = getattr(site, "stall_timeout", None) or self.timeOut
        self._connections = getattr(site, "connections", None)
        if self._connections is not None:
            self._connections.opened(self)
        if getattr(site, "read_from_accept", False):
            # The first request's time counts from the accept (the admin listener): a connection
            # that sends nothing, or a byte, holds its place no longer than a slow request may.
            self._arm_read_timer()

    def getHost(self):
        """The local address, read once: Twisted asks for it with every request (a ``getsockname`` call)."""
        local = self._local_address
        if local is None:
            local = self._local_address = super().getHost()
        return local

    def isSecure(self):
        """Asked once: Klein asks twice a request (an interface adaptation of the transport each time)."""
        secure = self._secure
        if secure is None:
            secure = self._secure = super().isSecure()
        return secure

    def connectionLost(self, reason):
        for name in ("_read_timer", "_stall_timer", "_linger_timer"):
            self._cancel(name)
        if self._connections is not None:
            self._connections.closed(self)
            self._connections = None
        super().connectionLost(reason)

    def _cancel(self, name: str) -> None:
        """Cancel the timer kept in attribute ``name``, if it is set and pending."""
        call = getattr(self, name)
        setattr(self, name, None)
        if call is not None and call.active():
            call.cancel()

    def _read_timeout(self) -> float | None:
        """The site's request read timeout (the default for a channel used without a ProxySite)."""
        site = getattr(self, "site", None)
        return getattr(site, "request_read_timeout", DEFAULT_REQUEST_READ_TIMEOUT)

    # -- reading a request ----------------------------------------------------------

    def dataReceived(self, data):
        if self._draining:
            return
        if not self._in_request and not self._handlingRequest and data:
            # The first byte of a request (the first on this connection, or the next).
            self._in_request = True
            if self._connections is not None:
                self._connections.set_idle(self, False)
            if self._read_deadline is None:  # else armed at the accept (``read_from_accept``)
                self._arm_read_timer()
        super().dataReceived(data)
        # Reading a head, what is left is the start of a line: a LF in it is bare (a CRLF would
        # have ended the line), and Twisted would wait for a CRLF that never comes.
        if self.line_mode and b"\n" in self._buffer and not self._draining and not self.paused:
            self._bad_reason = "a request line or header line ends in a bare LF (lines end in CRLF)"
            self._buffer = b""
            self._respondToBadRequestAndDisconnect()

    def _arm_read_timer(self) -> None:
        """Start counting the time this request takes to arrive.

        One timer per connection, not one per request: each request sets its
        deadline; the timer, when it fires, waits on for a later deadline (a
        request that came after), or does nothing between requests.  A
        keep-alive connection's requests then cost no timer each.
        """
        timeout = self._read_timeout_seconds
        if timeout is None:
            timeout = self._read_timeout_seconds = self._read_timeout() or 0
        if not timeout:
            return
        self._read_deadline = self._now() + timeout
        if self._read_timer is None:
            self._read_timer = self.callLater(timeout, self._read_timer_fired)

    def _now(self) -> float:
        """The time on the clock of ``callLater``: the site's reactor (``HTTPFactory.buildProtocol`` gives
        the channel that reactor's ``callLater`` and itself as ``factory``)."""
        return self.factory.reactor.seconds()

    def _read_timer_fired(self) -> None:
        self._read_timer = None
        deadline = self._read_deadline
        if deadline is None:
            return  # no request being read: the next one arms it again
        left = deadline - self._now()
        if left > 0:
            self._read_timer = self.callLater(left, self._read_timer_fired)
            return
        self._read_timed_out()

    def _read_timed_out(self) -> None:
        """The request did not arrive in full in time: 408, unless it did meanwhile."""
        self._read_deadline = None
        if self._handlingRequest or self._draining:
            return
        self._refuse(
            408, f"the request was not received in full within {self._read_timeout():g}s", "request_timeout"
        )

    def lineReceived(self, line):
        if self._draining:
            return None
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._refuse(431, f"request headers larger than {self.totalHeadersSize} bytes", "headers_too_large")
            return None
        return super().lineReceived(line)

    def lineLengthExceeded(self, line):
        if self._draining:
            return None
        if self._receivedHeaderSize == 0:
            self._refuse(414, f"request line longer than {self.MAX_LENGTH} bytes", "uri_too_long")
        else:
            self._refuse(431, f"a header line is longer than {self.MAX_LENGTH} bytes", "headers_too_large")
        return None

    def headerReceived(self, line):
        if self._draining:
            return False
        if self._receivedHeaderCount >= self.maxHeaders:
            self._refuse(431, f"more than {self.maxHeaders} request headers", "headers_too_large")
            return False
        return super().headerReceived(line)

    def rawDataReceived(self, data):
        if self._draining:
            return None
        return super().rawDataReceived(data)

    def allContentReceived(self):
        self._in_request = False
        if self.requests and getattr(self.requests[-1], "_receiving", 0):
            self.requests[-1].received()
        self._read_deadline = None  # its timer stays armed for the next request (see _arm_read_timer)
        super().allContentReceived()

    def checkPersistence(self, request, version):
        if self.one_request:
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return super().checkPersistence(request, version)

    def requestDone(self, request):
        super().requestDone(request)
        # Back to waiting for the next request (unless a pipelined one started already).
        if (
            self._connections is not None and self.persistent and not self._in_request
            and not self._handlingRequest and not self._draining
        ):
            self._connections.set_idle(self, True)

    def _finishRequestBody(self, data):
        # A refused chunked body was answered already; its end changes nothing.
        if self._draining:
            return
        super()._finishRequestBody(data)

    def _maybeChooseTransferDecoder(self, header, data):
        # Twisted ignores "Transfer-Encoding: identity": the body would then be
        # read as the next request, while another server may read it as a body.
        if header == b"Transfer-Encoding" and data.lower() != b"chunked":
            self._bad_reason = "Transfer-Encoding must be chunked (no other coding is accepted)"
            return self._failChooseTransferDecoder()
        went_on = super()._maybeChooseTransferDecoder(header, data)
        decoder = self._transferDecoder
        if went_on and type(decoder) is _ChunkedTransferDecoder:
            request = self.requests[-1]
            self._transferDecoder = StrictChunkedDecoder(
                decoder.dataCallback, decoder.finishCallback, getattr(request, "chunk_size", _no_check)
            )
        return went_on

    def _failChooseTransferDecoder(self):
        self._bad_reason = self._bad_reason or "invalid or conflicting Content-Length / Transfer-Encoding"
        return super()._failChooseTransferDecoder()

    def _respondToBadRequestAndDisconnect(self):
        """Twisted's parser refused the request: say so in JSON, not a bare 400."""
        why = self._bad_reason or getattr(self._transferDecoder, "error", None)
        self._refuse(400, why or "malformed HTTP request", "bad_request")

    # -- refusing --------------------------------------------------------------------

    def refuse_body(self, request) -> None:
        """The body is over the limit: hand the request to the app now, drop the rest, close.

        Called by :class:`ProxyRequest` from ``gotLength`` (a declared length:
        the channel is still in the header phase and hands the request over as
        if it had no body) or from ``handleContentChunk`` (a chunked body: the
        request is handed over at once).
        """
        if self._draining or self._handlingRequest or not self.requests or self.requests[-1] is not request:
            return
        self.persistent = False
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        if self.line_mode:
            # From gotLength: lineReceived calls allContentReceived when length is 0.
            self.length = 0
            self._draining = True
        else:
            self._draining = True
            self.allContentReceived()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer a request that will not be read to its end, then close the connection."""
        if self._draining:
            return
        self._draining = True
        self.persistent = False
        self._read_deadline = None
        self._cancel("_read_timer")
        path = getattr(self, "_path", None) or b""
        body = error_body(api_family(path), status, message, code)
        phrase = _PHRASES.get(status) or RESPONSES.get(status, b"Error")
        peer = self.transport.getPeer() if self.transport is not None else None
        log.info(
            "refused a request from {peer}: {status} {message}",
            peer=getattr(peer, "host", peer), status=status, message=message,
        )
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, phrase, len(body), body)
        )
        self.loseConnection()

    def loseConnection(self):
        """Close; a refusing connection first lingers, reading and dropping what still comes.

        Closing a socket with unread input makes the kernel send a reset,
        which can destroy our answer before the client reads it.  So the
        write side is shut once the answer is out, the rest of the input is
        read and dropped, and the connection is cut after ``linger_seconds``
        if the client has not closed it by then.
        """
        transport = self.transport
        lose_write = getattr(transport, "loseWriteConnection", None)
        if not self._draining or self._linger_timer is not None or lose_write is None or transport.disconnecting:
            return super().loseConnection()
        self._networkProducer.unregisterProducer()
        self._linger_timer = self.callLater(self.linger_seconds, transport.abortConnection)
        transport.resumeProducing()
        lose_write()
        return None

    # -- writing an answer -----------------------------------------------------------

    def pauseProducing(self):
        """The client stopped reading: give it the idle timeout to start again."""
        super().pauseProducing()
        if self._handlingRequest and self._stall_timer is None and self._idle_timeout:
            self._stall_timer = self.callLater(self._idle_timeout, self._stalled)

    def resumeProducing(self):
        self._cancel("_stall_timer")
        super().resumeProducing()

    def _stalled(self) -> None:
        """The client read nothing for the idle timeout: drop it (the app sees it go, and frees its slot)."""
        self._stall_timer = None
        peer = self.transport.getPeer()
        log.info(
            "dropping a client that read nothing for {seconds:g}s: {peer}",
            seconds=self._idle_timeout, peer=getattr(peer, "host", peer),
        )
        self.transport.abortConnection()


def receiving_full_message(connections: Connections | None) -> str:
    """What a client whose body was refused for the receiving budget is told."""
    limit = connections.max_receiving_bytes if connections is not None else None
    return (
        f"too many request bodies are being received at once (proxy.max_receiving_bytes = {limit}); "
        "try again shortly"
    )


def _no_check(length: int) -> None:
    """A request class without a body limit of its own: a chunk size is not checked."""


class ProxySite(Site):
    """A Site with bounded requests in memory, TCP_NODELAY, and no per-request access log.

    A body over ``max_body_bytes`` is not read: the request is answered by
    ``oversized(request)``, which sets the status and headers and returns the
    body (the proxy app's 413, counted in its metrics), or, without it, by a
    plain 413 here (the admin API).  ``request_log=False`` keeps the requests
    answered here out of the request log.

    ``timeout`` (Twisted's) is the keep-alive timeout: how long a connection
    may wait for a request.  ``stall_timeout`` is how long a client may read
    nothing of its answer (default: ``timeout``).  ``connections`` caps the
    open connections and ``host_policy`` the ``Host`` values answered.
    """

    displayTracebacks = False
    protocol = ProxyChannel  # type: ignore[assignment]  # plain HTTP/1.1 channels, no HTTP/2 negotiation

    def __init__(
        self,
        resource,
        max_body_bytes: int,
        request_read_timeout: float | None = DEFAULT_REQUEST_READ_TIMEOUT,
        oversized: Callable[[Request], bytes] | None = None,
        receiving_full: Callable[[Request], bytes] | None = None,
        request_log: bool = True,
        stall_timeout: float | None = None,
        connections: Connections | None = None,
        host_policy: HostPolicy | None = None,
        read_from_accept: bool = False,
        **kwargs,
    ):
        request_class = type(
            "BoundedProxyRequest",
            (ProxyRequest,),
            {"max_body_bytes": max_body_bytes, "request_log": request_log},
        )
        # A proxy forwards bodies as they are: no parsing of form uploads into request.args.
        super().__init__(resource, requestFactory=request_class, parsePOSTFormSubmission=False, **kwargs)
        #: Seconds a client has to deliver a whole request (None: no limit).
        self.request_read_timeout = request_read_timeout
        #: Seconds a client may read nothing of its answer (None: the keep-alive timeout).
        self.stall_timeout = stall_timeout
        self.connections = connections
        self.host_policy = host_policy
        #: The first request's read timeout counts from the accept, not from its first byte.
        self.read_from_accept = read_from_accept
        #: Answers a request whose body passed the limit (None: a plain 413 here).
        self.oversized = oversized
        #: Answers a request whose body found the receiving budget used up (None: a plain 503 here).
        self.receiving_full = receiving_full

    def buildProtocol(self, addr):
        """A channel, unless the listener is full: then make room, or refuse (see :class:`Connections`)."""
        connections = self.connections
        if connections is not None and (
            connections.peer_full(addr) or (connections.full() and not connections.reclaim_idle())
        ):
            # Even past MAX_REFUSING (the rest of an accept loop under way): the ports are paused by now.
            promote = self._channel if connections.quick_seconds else None
            return OverCapacity(connections, self.reactor, promote)
        return self._channel(addr)

    def channel_for(self, addr):
        """A channel, whatever the cap: for a connection accepted already (a reload hands it over, succession/)."""
        return self._channel(addr)

    def _channel(self, addr):
        """A channel for a connection from ``addr`` (the cap decided already)."""
        return super().buildProtocol(addr)

    def log(self, request):
        """The request log is ours (one line with class and outcome), not Twisted's."""
