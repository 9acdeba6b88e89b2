"""One client connection of a listener: HTTP/1.1 in named states, each owning its resources.

A :class:`ServerConnection` is a plain :class:`~twisted.internet.protocol.Protocol`.
It reads requests with the I/O-free :class:`~yieldproxy.edge.reader.RequestReader`
and serves each as an ordinary :class:`twisted.web.server.Request` through the
channel interface a ``Request`` uses and nothing else, as Twisted's own HTTP/2
stream does: no private name of Twisted is read, written or overridden.  Its
states move only through :data:`MOVES`; each takes what it owns in its
``_enter_<STATE>`` and gives it back in its ``_leave_<STATE>``.  Each state, what
it owns, the deadlines, and a connection handed over by a reload:
docs/architecture.md (*The HTTP edge*).
"""

from __future__ import annotations

import io
import socket
from typing import Any

from twisted.internet.interfaces import IHalfCloseableProtocol, ISSLTransport
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from zope.interface import implementer

from ..states import Machine, Moves, Named
from .reader import (
    NEED_DATA,
    PAUSED,
    BodyData,
    ChunkAnnounced,
    Closed,
    EndOfMessage,
    Incomplete,
    RequestHead,
    RequestReader,
)
from .refusal import Refusal, shut_write, wire_answer
from .tcp import set_no_delay
from .writer import writer_for

log = Logger()


class State(Named):
    """Where a connection is in its life (see the module docstring)."""

    FRESH = "fresh"
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    HANDLING = "handling"
    WRITING = "writing"
    REFUSING = "refusing"
    LINGER = "linger"
    CLOSING = "closing"
    CLOSED = "closed"


FRESH, IDLE, HEAD, BODY = State.FRESH, State.IDLE, State.HEAD, State.BODY
HANDLING, WRITING, REFUSING = State.HANDLING, State.WRITING, State.REFUSING
LINGER, CLOSING, CLOSED = State.LINGER, State.CLOSING, State.CLOSED

_EVERY = tuple(State)

#: What each event does to a connection; any other is a bug (:class:`~yieldproxy.states.Unexpected`).
MOVES: Moves[State, str] = Moves("a connection", {
    # Bytes of a request: its head begins (read from the socket, or read ahead while the last was served).
    # Elsewhere they go to the reader, are read ahead, or are dropped.
    **{(state, "bytes"): state for state in _EVERY},
    (FRESH, "bytes"): HEAD,
    (IDLE, "bytes"): HEAD,
    # A connection taken over from the process before this one (a reload), idle as it was there.
    (FRESH, "adopted"): IDLE,
    # A head whose body follows.
    (HEAD, "body"): BODY,
    # The request is whole: the app has it.
    (HEAD, "complete"): HANDLING,
    (BODY, "complete"): HANDLING,
    # Its body will not be read (over the body limit, or the receiving budget used up): the app answers now.
    (HEAD, "refuse_body"): REFUSING,
    (BODY, "refuse_body"): REFUSING,
    # A request refused before it is whole (400/414/431, or 408): answered, then lingering.  Fresh or
    # idle: a 408 of a request that never began (the admin listener's read deadline runs from the accept).
    **{(state, "refused"): LINGER for state in (FRESH, IDLE, HEAD, BODY)},
    # The answer's head is written: elsewhere (refusing, or the connection closing) nothing moves.
    **{(state, "answering"): state for state in _EVERY},
    (HANDLING, "answering"): WRITING,
    # The answer is done: the next request (kept alive); a refused one's: lingering.
    (WRITING, "answered"): IDLE,
    (REFUSING, "answered"): LINGER,
    # Close once what is written has gone out (the keep-alive deadline, a stop, the cap, the app, a half
    # close); said again while lingering, closing or closed, nothing moves.
    **{(state, "close"): CLOSING for state in (FRESH, IDLE, HEAD, BODY, HANDLING, WRITING, REFUSING)},
    **{(state, "close"): state for state in (LINGER, CLOSING, CLOSED)},
    # The transport is gone.
    **{(state, "lost"): CLOSED for state in _EVERY},
})

#: The states whose connection reads a request: its bytes go to the reader.
READING = frozenset({FRESH, IDLE, HEAD, BODY})
#: The states where a request of the connection is the app's (it is told when the client goes).
SERVING = frozenset({HANDLING, WRITING, REFUSING})
#: The states a connection can be written down in and made again (see :meth:`ServerConnection.snapshot`).
PORTABLE = frozenset({FRESH, IDLE, HANDLING})

#: Bytes of pipelined requests read ahead while a request is served; past it the connection stops
#: reading until the answer is done (Twisted's HTTPChannel reads 16 KiB ahead; a little more costs
#: nothing and keeps a client that pipelines a few requests from being paused).
MAX_READ_AHEAD = 64 * 1024
#: Seconds a refused connection keeps reading (and dropping) before it is cut.
LINGER_SECONDS = 5.0
#: Seconds a connection cut to make a place for a whole request has to take its 408 before it is aborted.
SHED_SECONDS = 0.25
#: Seconds a request may still be unanswered after its client shut its side before the client is asked whether it
#: is still there (a parked request: see :meth:`ServerConnection.readConnectionLost`), and seconds for its reply.
PROBE_AFTER_SECONDS = 1.0
PROBE_SECONDS = 0.05


@implementer(IHalfCloseableProtocol)
class ServerConnection(Machine[State, str], Protocol):
    """One HTTP/1.1 connection of a listener (see the module docstring)."""

    #: Set by ``makeConnection``: a TCP (or unix) transport.
    transport: Any

    moves = MOVES

    __slots__ = (
        "site", "factory", "requestFactory", "connections", "request", "persistent", "one_request",
        "host_passed", "_reader", "_clock", "_body", "_body_size", "_length", "_receiving", "_deadline",
        "_deadline_kind", "_timer", "_producer", "_streaming", "_pull", "_reading_paused",
        "_processing", "_host", "_peer", "_secure", "_read_timeout", "_idle_timeout", "_keepalive", "writer",
        "_frozen", "_progress_at", "_body_started", "_body_last", "_read_shut", "_probe",
    )

    def __init__(self, site: Any):
        #: The listener's :class:`~yieldproxy.edge.site.ProxySite` (the Request reads ``channel.site``).
        self.site = site
        self.factory = site
        self.requestFactory = site.requestFactory
        self.connections = site.connections
        self.state = FRESH
        #: The request of the connection while it is read, or served; None between requests.
        self.request: Any = None
        #: Whether the connection carries another request once this answer is done.
        self.persistent = True
        #: Serve one request, then close (a connection let in past the cap: capacity.OverCapacity).
        self.one_request = False
        #: The ``Host`` a request on this connection last passed the checks with (edge/request.py).
        self.host_passed: bytes | None = None
        self._reader = RequestReader(site.reader_limits)
        self._clock = site.reactor
        self._body: list[bytes] = []
        self._body_size = 0
        #: The declared length of the body being read (None: chunked).
        self._length: int | None = None
        #: Bytes this connection counts in the listener's receiving budget (state body only).
        self._receiving = 0
        #: The deadline in force (``clock.seconds()``), what it means, and the one timer that keeps it.
        self._deadline: float | None = None
        self._deadline_kind: str | None = None
        self._timer: Any = None
        #: The request's producer (what writes its answer) and whether it is a push producer.
        self._producer: Any = None
        self._streaming = True
        self._pull: Any = None
        self._reading_paused = False
        self._processing = False
        self._host: Any = None
        self._peer: Any = None
        self._secure: bool | None = None
        self._read_timeout = site.request_read_timeout or 0
        self._idle_timeout = site.stall_timeout or site.timeOut
        self._keepalive = site.timeOut
        #: What writes to the transport, and knows whether the client has it all (writer.py); set at connectionMade.
        self.writer: Any = None
        #: While a reload hands it over (:meth:`freeze`): its deadline's kind and the time it had left, and
        #: whether it was reading.
        self._frozen: tuple[str | None, float | None, bool] | None = None
        #: When it last made progress: a byte read, or its client read what waited (capacity.Connections.shed_for).
        self._progress_at = 0.0
        #: When the body being read began, and when its last bytes came (capacity.Connections.take_receiving).
        self._body_started = 0.0
        self._body_last = 0.0
        #: The client shut its side (a half-close): the answer is written, then the connection closes.
        self._read_shut = False
        #: The check, after a half-close, that the client is still there to read its answer.
        self._probe: Any = None

    # -- what each state owns: taken on entering it, given back on leaving it ----------------------

    def _leave_FRESH(self) -> None:
        if self.connections is not None:
            self.connections.busy(self)

    _leave_IDLE = _leave_FRESH

    def _enter_IDLE(self) -> None:
        if self.connections is not None:
            self.connections.idle(self)
        self._expect("keepalive", self._keepalive)

    def _enter_HEAD(self) -> None:
        if self._deadline_kind != "read":
            # The read deadline counts from the request's first byte (from the accept on the admin
            # listener: then it runs on from fresh).
            self._expect("read", self._read_timeout)

    def _enter_BODY(self) -> None:
        self._body_started = self._body_last = self._clock.seconds()

    def _leave_BODY(self) -> None:
        self._give_back_receiving()

    def _enter_HANDLING(self) -> None:
        self._expect(None)

    _enter_REFUSING = _enter_HANDLING

    def _enter_WRITING(self) -> None:
        self._expect("stall" if self.writer.blocked else None, self._idle_timeout)

    def _enter_LINGER(self) -> None:
        self._expect("linger", self.site.linger_seconds)

    def _enter_CLOSING(self) -> None:
        self._expect("closing", self._idle_timeout)

    def _enter_CLOSED(self) -> None:
        self._deadline = self._deadline_kind = None
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        pull, self._pull = self._pull, None
        if pull is not None and pull.active():
            pull.cancel()
        probe, self._probe = self._probe, None
        if probe is not None and probe.active():
            probe.cancel()
        if self.writer is not None:
            self.writer.drop()

    # -- deadlines: one timer per connection --------------------------------------------------

    def _expect(self, kind: str | None, seconds: float = 0.0, at: float | None = None) -> None:
        """The deadline of the state entered: ``kind`` after ``seconds`` (or at ``at``); None: none."""
        if kind is None or (not seconds and at is None):
            self._deadline = self._deadline_kind = None
            return
        deadline = self._clock.seconds() + seconds if at is None else at
        self._deadline = deadline
        self._deadline_kind = kind
        timer = self._timer
        if timer is None:
            self._timer = self._clock.callLater(max(0.0, deadline - self._clock.seconds()), self._timer_fired)
        elif timer.getTime() > deadline:
            timer.reset(max(0.0, deadline - self._clock.seconds()))
        # Else the timer fires first, and waits on for what is left.

    def _timer_fired(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        left = deadline - self._clock.seconds()
        if left > 0:
            self._timer = self._clock.callLater(left, self._timer_fired)
            return
        kind = self._deadline_kind
        self._deadline = self._deadline_kind = None
        if kind == "keepalive":
            # A connection that waited for its next request too long: closed without a word.
            self.loseConnection()
        elif kind == "read":
            self._refuse(Refusal(
                408, f"the request was not received in full within {self.site.request_read_timeout:g}s",
                "request_timeout",
            ))
        elif kind == "stall":
            log.info(
                "dropping a client that read nothing for {seconds:g}s: {peer}",
                seconds=self._idle_timeout, peer=getattr(self.getPeer(), "host", None),
            )
            self.transport.abortConnection()
        else:  # linger, closing: the client had its time to read what we wrote
            self.transport.abortConnection()

    @property
    def deadline_in(self) -> float | None:
        """Seconds left on the deadline in force (None: none)."""
        if self._deadline is None:
            return None
        return self._deadline - float(self._clock.seconds())

    # -- the connection -----------------------------------------------------------------------

    def connectionMade(self) -> None:
        transport = self.transport
        set_no_delay(transport)
        self._progress_at = self._clock.seconds()
        self.writer = writer_for(transport, self._clock, self._blocked, self._drained)
        if self.connections is not None:
            self.connections.opened(self)
        if self.site.read_from_accept and self._read_timeout:
            # The admin listener: the first request's time counts from the accept, so a
            # connection that sends nothing (or a byte) holds its place no longer than a slow request.
            self._expect("read", self._read_timeout)
        else:
            self._expect("keepalive", self._keepalive)

    def connectionLost(self, reason: Any = None) -> None:
        old = self.state
        if self.fire("lost") is old:
            return  # lost already
        request, self.request = self.request, None
        if request is not None and old not in READING:
            # The app has it (served, being answered, or closing mid-answer): it hears the client go.
            request.connectionLost(reason)
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.stopProducing()
            except Exception:
                log.failure("a request's producer failed to stop")
        if self.connections is not None:
            self.connections.closed(self)

    # -- the client shuts its side (IHalfCloseableProtocol) ------------------------------------

    def readConnectionLost(self) -> None:
        """The client shut its side of the connection: what it sent whole is answered, in order, then the close;
        a request still unanswered a second later (parked) draws an interim ``100 Continue``, to learn from a
        reset whether the client closed its socket instead (the same FIN).  The rules: docs/guarantees.md (a
        client that shuts its side)."""
        first, self._read_shut = not self._read_shut, True
        state = self.state
        if state is CLOSED:
            return
        self._reader.feed_eof()
        if state in SERVING:
            if state is HANDLING and first:
                self._check_client_later()
            return
        if state is LINGER or state is CLOSING:
            self.transport.loseConnection()
            return
        self.loseConnection()

    def writeConnectionLost(self) -> None:
        """Our side is shut (a refusal lingers: :meth:`_linger`); the linger deadline runs on."""

    def _check_client_later(self) -> None:
        request = self.request
        handle = getattr(self.transport, "getHandle", None)
        sock = handle() if handle is not None else None
        if request is None or request.clientproto != b"HTTP/1.1" or not hasattr(sock, "getsockopt"):
            return  # no interim answer for HTTP/1.0, and no socket to ask (a test's transport): answered all the same
        self._probe = self._clock.callLater(PROBE_AFTER_SECONDS, self._ask_client, sock)

    def _ask_client(self, sock: Any) -> None:
        """An interim answer, which HTTP/1.1 clients skip (RFC 9110 15.2), to draw a reset from a client gone."""
        self._probe = None
        if self.state is HANDLING:
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.writer.flush()
            self._probe = self._clock.callLater(PROBE_SECONDS, self._check_client, sock)

    def _check_client(self, sock: Any) -> None:
        """A reset to the interim answer: the client closed its socket and is gone."""
        self._probe = None
        if self.state is not HANDLING:
            return
        try:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError:
            error = 1
        if error:
            self.transport.abortConnection()

    def loseConnection(self) -> None:
        """Close once what is written has gone out (a refused connection lingers: see :meth:`_refuse`)."""
        state = self.state
        if self.fire("close") is state:
            return  # lingering, closing or closed already
        self.writer.release()
        self.transport.loseConnection()

    def getPeer(self) -> Any:
        peer = self._peer
        if peer is None:
            peer = self._peer = self.transport.getPeer()
        return peer

    def getHost(self) -> Any:
        """The local address, read once: a Request asks for it every time (a ``getsockname`` call)."""
        host = self._host
        if host is None:
            host = self._host = self.transport.getHost()
        return host

    def isSecure(self) -> bool:
        secure = self._secure
        if secure is None:
            secure = self._secure = ISSLTransport.providedBy(self.transport)
        return secure

    @property
    def write_blocked(self) -> bool:
        """The client reads nothing for now: what is written waits in memory (upstream/attempt.py registers then)."""
        return bool(self.writer is not None and self.writer.blocked)

    @property
    def unsent(self) -> bool:
        """Bytes written that the client's socket has not taken yet (writer.py)."""
        return bool(self.writer is not None and self.writer.unsent)

    @property
    def serving(self) -> bool:
        """A request of this connection is the app's (parked, in flight, being answered)."""
        return self.state in SERVING

    @property
    def reclaimable(self) -> bool:
        """Waiting for its next request, and not being handed over: the cap may close it to make room."""
        return self.state is IDLE and self._frozen is None

    @property
    def answer_started(self) -> bool:
        """The first byte of the answer is written: the request can no longer be tried elsewhere."""
        return self.state is WRITING or self.state is CLOSING

    # -- reading -------------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        self._progress_at = self._clock.seconds()
        if self.fire("bytes") is state and state not in READING:
            if state in SERVING and state is not REFUSING:
                # Read ahead (pipelined requests), as far as MAX_READ_AHEAD; the client's close is
                # still seen while its request is served.
                self._reader.feed(data)
                if len(self._reader.read_ahead) > MAX_READ_AHEAD:
                    self._pause_reading()
            return  # refusing, lingering, closing: dropped
        self._reader.feed(data)
        self._read()

    def _read(self) -> None:
        """Act on every event the reader has, until it needs data or waits for the answer."""
        if self._processing:
            return
        self._processing = True
        reader = self._reader
        try:
            while self.state in READING:
                event = reader.next_event()
                if event is NEED_DATA or event is PAUSED:
                    return
                kind = type(event)
                if kind is BodyData:
                    self._body_data(event.data)  # type: ignore[union-attr]
                elif kind is RequestHead:
                    self._head(event)  # type: ignore[arg-type]
                elif kind is EndOfMessage:
                    self._complete()
                elif kind is ChunkAnnounced:
                    if self._body_size + event.size > self.site.max_body_bytes:  # type: ignore[union-attr]
                        self._refuse_body(too_large=True)
                elif kind is Refusal:
                    self._refuse(event)  # type: ignore[arg-type]
                elif kind is Incomplete or kind is Closed:
                    return
        finally:
            self._processing = False

    def _head(self, head: RequestHead) -> None:
        request = self.request = self.requestFactory(self)
        add = request.requestHeaders.addRawHeader
        for name, value in head.headers:
            add(name, value)
        # What the app and the request log may read before the request is whole (a refusal).
        request.method, request.uri, request.clientproto = head.method, head.target, head.version
        request.path = head.target.split(b"?", 1)[0]
        self.persistent = head.keep_alive and not self.one_request
        if not self.persistent:
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        self._body = []
        self._body_size = 0
        self._length = head.length
        if head.length is None and not head.chunked:
            return  # no body: the reader's EndOfMessage follows
        if head.length is not None and head.length > self.site.max_body_bytes:
            self._refuse_body(too_large=True)
            return
        if head.length == 0:
            return
        self.fire("body")
        if head.expect_continue and head.version == b"HTTP/1.1":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.writer.flush()

    def _body_data(self, data: bytes) -> None:
        size = self._body_size + len(data)
        if size > self.site.max_body_bytes:
            # A chunked body past the limit (a declared length was checked at its head).
            self._refuse_body(too_large=True)
            return
        connections = self.connections
        if connections is not None and connections.max_receiving_bytes is not None:
            length = self._length
            large = (length if length is not None else size) > connections.small_body_bytes
            now = self._clock.seconds()
            if not connections.take_receiving(self, len(data), large, now):
                self._refuse_body(too_large=False)
                return
            self._receiving += len(data)
            self._body_last = now
        self._body_size = size
        self._body.append(data)

    def _give_back_receiving(self) -> None:
        size, self._receiving = self._receiving, 0
        if size and self.connections is not None:
            self.connections.give_back_receiving(self, size)

    @property
    def receiving_held(self) -> int:
        """Bytes of its body this connection holds in the listener's receiving budget."""
        return self._receiving

    def receiving_pace(self, now: float) -> tuple[float, float]:
        """The body's bytes a second since its first, and the seconds since its last (capacity.Connections)."""
        elapsed = now - self._body_started
        pace = self._receiving / elapsed if elapsed > 0 else float("inf")
        return pace, now - self._body_last

    def cut_stalled(self) -> None:
        """Its body stalled while another needed the budget it holds: 408, and the budget given back."""
        if self.state is BODY:
            self._refuse(Refusal(
                408, "the request body stopped arriving while other bodies needed the room it held; send it again",
                "request_timeout",
            ))

    def shed_rank(self) -> float | None:
        """When it last made progress, if it may be cut to make a place for a whole request (docs/security.md,
        *The admin API under a flood*); else None.  An answer its client has not taken yet does not keep it (a
        25 KiB status page to a client with a tiny receive window would hold its place for the closing deadline)."""
        state = self.state
        if state in READING or state is LINGER:
            return self._progress_at
        writer = self.writer
        if (state is WRITING or state is CLOSING) and writer is not None and (writer.blocked or writer.unsent):
            return self._progress_at
        return None

    def shed(self) -> None:
        """Cut to make a place for a whole request: a request begun gets a 408, then the connection closes
        (aborted if it has not closed in :data:`SHED_SECONDS`)."""
        state = self.state
        if state is CLOSED:
            return
        if state is HEAD or state is BODY:
            self.persistent = False
            self.request = None
            self._write_refusal(
                Refusal(408, "the request was not received in full while the listener was full", "request_timeout")
            )
        if state in READING:
            self.fire("close")
            self.writer.release()
            self.transport.loseConnection()
            self._expect("closing", SHED_SECONDS)
        else:
            self.transport.abortConnection()

    def _complete(self) -> None:
        """The request is in: the app has it."""
        request = self.request
        body = self._body
        self._body = []
        request.content = io.BytesIO(body[0] if len(body) == 1 else b"".join(body))
        self.fire("complete")
        request.requestReceived(request.method, request.uri, request.clientproto)

    # -- refusing ------------------------------------------------------------------------------

    def _refuse_body(self, too_large: bool) -> None:
        """A body that will not be read (over the body limit, or the receiving budget used up): the app
        answers the request now, what still comes of it is dropped, and the connection then lingers."""
        request = self.request
        self._body = []
        if too_large:
            request.too_large = True
        else:
            request.receiving_full = True
        self.persistent = False
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        # No "100 Continue" for a body that will be refused: the client need not send it.
        request.requestHeaders.removeHeader(b"expect")
        request.content = io.BytesIO()
        self.fire("refuse_body")
        request.requestReceived(request.method, request.uri, request.clientproto)

    def _refuse(self, refusal: Refusal) -> None:
        """Answer a request that will not be read to its end, then linger and close."""
        self.persistent = False
        self.request = None  # never the app's: nobody else to tell
        self._body = []
        self.fire("refused")
        log.info(
            "refused a request from {peer}: {status} {message}",
            peer=getattr(self.getPeer(), "host", None), status=refusal.status, message=refusal.message,
        )
        self._write_refusal(refusal)
        self._linger()

    def refuse_request(self, request: Any, refusal: Refusal) -> None:
        """Answer ``request``, read whole or refused before its body, without the app (edge/request.py); then
        on to the next request, or the end, as after any answer."""
        if request is not self.request:
            return
        request.setResponseCode(refusal.status)
        self.fire("answering")
        self._write_refusal(refusal)
        self.requestDone(request)

    def _write_refusal(self, refusal: Refusal) -> None:
        """The one answer of the edge (refusal.py), in the shape of the route the request line named."""
        self.writer.write(wire_answer(refusal, self.site.error_body, self._reader.request_line, not self.persistent))

    def _linger(self) -> None:
        """Shut the write side once the answer is out and drop what still comes (:func:`shut_write`)."""
        self.writer.release()
        self._resume_reading()
        if self._read_shut:
            self.transport.loseConnection()
        else:
            shut_write(self.transport)

    # -- writing the answer (the channel interface of a Request) -------------------------------

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        """The answer's head.  ``headers`` is a :class:`~twisted.web.http_headers.Headers` (Twisted 25 and
        later) or a list of ``(name, value)`` pairs (before): those go through ``Headers`` first, as Twisted's
        own channel does, so that no value can break a line."""
        self.fire("answering")
        if not isinstance(headers, Headers):
            sanitized = Headers()
            for name, value in _one_transfer_encoding(headers):
                sanitized.addRawHeader(name, value)
            headers = sanitized
        parts = [version, b" ", code, b" ", reason, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                parts.extend((name, b": ", value, b"\r\n"))
        parts.append(b"\r\n")
        self.writer.write(b"".join(parts))

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    def writeSequence(self, data: Any) -> None:
        self.writer.write(b"".join(data))

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        """The request's producer: paused while the client reads nothing, resumed when it reads again."""
        if self._producer is not None:
            raise RuntimeError(f"a producer is registered already: {self._producer!r}")
        self._producer = producer
        self._streaming = streaming
        if streaming:
            if self.writer.blocked:
                producer.pauseProducing()
        else:
            self._schedule_pull()

    def unregisterProducer(self) -> None:
        self._producer = None
        pull, self._pull = self._pull, None
        if pull is not None and pull.active():
            pull.cancel()

    def _schedule_pull(self) -> None:
        """A pull producer (twisted.web.static.File) writes one piece per ``resumeProducing``: ask for the
        next on the next turn, while the client reads."""
        if self._pull is None and not self.writer.blocked and self.state is not CLOSED:
            self._pull = self._clock.callLater(0, self._pull_once)

    def _pull_once(self) -> None:
        self._pull = None
        producer = self._producer
        if producer is not None and not self._streaming and not self.writer.blocked:
            producer.resumeProducing()
            if self._producer is producer:
                self._schedule_pull()

    # -- the client's pace (the writer hears it from the transport) ------------------------------

    def _blocked(self) -> None:
        """The client stopped reading: the request's producer waits, for the slow-reader bound at most."""
        if self.state is WRITING or self.state is HANDLING or self.state is REFUSING:
            self._expect("stall", self._idle_timeout)
        producer = self._producer
        if producer is not None and self._streaming:
            producer.pauseProducing()

    def _drained(self) -> None:
        """The client read what waited: the request's producer goes on."""
        self._progress_at = self._clock.seconds()
        if self._deadline_kind == "stall":
            self._expect(None)
        producer = self._producer
        if producer is not None:
            if self._streaming:
                producer.resumeProducing()
            else:
                self._schedule_pull()

    def _pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            self.transport.pauseProducing()

    def _resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resumeProducing()

    # -- the end of an answer -----------------------------------------------------------------

    def requestDone(self, request: Any) -> None:
        """Called by the request when its answer is done: the next request, or the end."""
        if request is not self.request:
            return
        self.request = None
        self.writer.flush()
        if self.state is REFUSING:
            self.fire("answered")
            self._linger()
            return
        if self.state is CLOSING or self.state is CLOSED:
            return
        if not self.persistent:
            self.loseConnection()
            return
        self.fire("answered")
        self._reader.start_next()
        self._resume_reading()
        if self._reader.read_ahead:
            self.fire("bytes")
            self._read()
        if self._read_shut and self.state in READING:
            self.loseConnection()  # the client shut its side: nothing more will come

    # -- a reload hands it over ----------------------------------------------------------------

    def freeze(self) -> None:
        """Until :meth:`thaw` (or the end): nothing of it moves here.  It reads nothing (the client's bytes wait
        in the socket), its deadline does not run (the time it has left is kept), and the cap does not close
        it to make room.  A reload's old process does this to a connection it has written down for the new
        one, until that one has it (lifecycle/succession/connections.py)."""
        if self._frozen is not None or self.state is CLOSED:
            return
        self._frozen = (self._deadline_kind, self.deadline_in, not self._reading_paused)
        self._deadline = self._deadline_kind = None
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.connections is not None:
            self.connections.busy(self)
        self._pause_reading()

    def thaw(self) -> None:
        """Served here again as if nothing had happened (the new process will not have it)."""
        frozen, self._frozen = self._frozen, None
        if frozen is None or self.state is CLOSED:
            return
        kind, left, reading = frozen
        if kind is not None and left is not None:
            self._expect(kind, at=self._clock.seconds() + max(0.0, left))
        if self.state is IDLE and self.connections is not None:
            self.connections.idle(self)
        if reading:
            self._resume_reading()

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    # -- a connection as data (a reload hands it over) ----------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This connection written down, to be made again by :meth:`resume`: in states fresh, idle, or
        handling (its request parked, not a byte of its answer written; the request itself, and the bytes
        read ahead of it (:attr:`read_ahead`), travel beside this as the bytes :meth:`resume` reads)."""
        if self.state not in PORTABLE:
            raise ValueError(f"a connection {self.state.value} cannot be handed over")
        kind, left = self._deadline_kind, self.deadline_in
        if self._frozen is not None:
            kind, left = self._frozen[0], self._frozen[1]
        return {
            "state": self.state.value,
            "persistent": self.persistent,
            "one_request": self.one_request,
            "deadline": kind,
            "deadline_in": left,
            "host_passed": self.host_passed.decode("latin-1") if self.host_passed is not None else None,
        }

    @property
    def read_ahead(self) -> bytes:
        """What the client sent after the request being served (pipelined), read but not yet parsed."""
        return self._reader.read_ahead

    def resume(self, snapshot: dict[str, Any], data: bytes = b"") -> None:
        """Take up a connection that a process before this one wrote down (:meth:`snapshot`), on its adopted
        transport (``makeConnection`` done): in the state it was in, its deadline running on with the time it
        had left.  ``data`` is read as if it came now: a parked request as its client sent it (in its own HTTP
        version), then what was read ahead of it; the request is the app's again (state handling)."""
        state = State(snapshot["state"])
        if state not in PORTABLE:
            raise ValueError(f"a connection {state.value} cannot be taken over")
        self.persistent = bool(snapshot.get("persistent", True))
        self.one_request = bool(snapshot.get("one_request", False))
        passed = snapshot.get("host_passed")
        self.host_passed = passed.encode("latin-1") if isinstance(passed, str) else None
        if state is IDLE:
            self.fire("adopted")
        kind, left = snapshot.get("deadline"), snapshot.get("deadline_in")
        if state is not HANDLING and kind in ("keepalive", "read") and isinstance(left, (int, float)):
            self._expect(str(kind), at=self._clock.seconds() + max(0.0, float(left)))
        if data:
            self.dataReceived(data)


def _one_transfer_encoding(given: Any) -> list[tuple[bytes, bytes]]:
    """An answer's header pairs as Twisted before 25 gives them, with one ``Transfer-Encoding``.

    That Twisted puts its own ``Transfer-Encoding: chunked`` first and the request's headers after it,
    so a body relayed in its codings (upstream/attempt.py: ``gzip``) would go out with two such headers, the
    chunking named before the coding it wraps.  One header, the codings in the order they were applied
    and ``chunked`` last (RFC 9112 6.1), as Twisted 25 and later write it.
    """
    pairs: list[tuple[bytes, bytes]] = list(given)
    codings = [value for name, value in pairs if name.lower() == b"transfer-encoding"]
    if len(codings) < 2 or b"chunked" not in codings:
        return pairs
    joined = b", ".join([c for c in codings if c != b"chunked"] + [b"chunked"])
    out: list[tuple[bytes, bytes]] = []
    for name, value in pairs:
        if name.lower() != b"transfer-encoding":
            out.append((name, value))
        elif joined:
            out.append((name, joined))
            joined = b""
    return out

