"""A lean HTTP/1.1 client for the upstream hop: persistent connections to one server.

``twisted.web.client.Agent`` is general, and a reverse proxy that relays
bytes to one upstream pays for that generality on every request; this does
the hop with one object and one Deferred per request.  A request that met a
stale pooled connection is sent once more only when nothing of its answer
came and it may be sent twice.  The specification (the pool, the states, the
failures, the stale connection): docs/architecture.md, *The upstream client*.
"""

from __future__ import annotations

import select
import socket
from ipaddress import ip_address
from typing import Any, Callable, Iterable, Literal, Protocol as TypingProtocol

from twisted.internet import error as ierror, tcp
from twisted.internet.defer import CancelledError, Deferred, gatherResults, succeed
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from ..states import Machine, Moves
from .h1parse import ParseError, ResponseParser
from .tcp import set_no_delay

#: Methods whose effect is the same sent once or twice (RFC 9110 9.2.2).
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
#: Methods that always send a Content-Length (0 when there is no body).
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
#: Bodies up to this size go out in the same write as the head.
SMALL_BODY = 64 * 1024


# -- failures ----------------------------------------------------------------------------------


class H1Error(Exception):
    """A request that got no complete response; ``reason`` is its metric label."""

    reason = "reset"

    def __init__(self, message: str, *, request_sent: bool = False, reused: bool = False, retried: bool = False):
        super().__init__(message)
        #: The request was written to the connection (the server may have seen it).
        self.request_sent = request_sent
        #: The connection came from the pool (it had served a request before).
        self.reused = reused
        #: The request was sent a second time after a stale connection (see the module docstring).
        self.retried = retried


class ConnectFailed(H1Error):
    """No connection to the upstream: ``refused``, or ``connect`` (timeout, no route, DNS)."""

    def __init__(self, message: str, reason: str = "connect", **kw: Any):
        super().__init__(message, **kw)
        self.reason = reason


class ResponseNeverReceived(H1Error):
    """The connection ended after the request was written, before any byte of a response."""


class ResponseIncomplete(H1Error):
    """The connection ended part-way through the response."""


class ResponseTimeout(H1Error):
    """No response head within the request's timeout; the connection was aborted."""

    reason = "timeout"


class BadResponse(H1Error):
    """The upstream sent something that is not an HTTP/1.x response."""

    reason = "bad_response"


class PoolClosed(H1Error):
    """The pool was closed before the request could be sent."""

    reason = "closed"


# -- states -----------------------------------------------------------------------------------------

# A connection's (H1Connection.state).
IDLE = "IDLE"
BUSY = "BUSY"
CLOSING = "CLOSING"
LOST = "LOST"

# An exchange's (_Exchange.state).
NEW = "NEW"
WAITING = "WAITING"
CONNECTING = "CONNECTING"
SENT = "SENT"
STOPPING = "STOPPING"
DONE = "DONE"

#: What each event does to a connection.  ``close`` and ``abort`` of one already closing or lost, and
#: the end of an answer on one (read until the close), leave it as it is.
CONNECTION_MOVES: Moves[str, str] = Moves("an upstream connection", {
    (IDLE, "start"): BUSY,
    (BUSY, "answered"): IDLE,
    (CLOSING, "answered"): CLOSING,
    (LOST, "answered"): LOST,
    **{(state, event): CLOSING for state in (IDLE, BUSY, CLOSING) for event in ("close", "abort")},
    (LOST, "close"): LOST,
    (LOST, "abort"): LOST,
    **{(state, "lost"): LOST for state in (IDLE, BUSY, CLOSING)},
})

#: What each event does to an exchange.  A stale connection sends one from ``SENT`` back to ``WAITING`` or
#: ``CONNECTING``; ``end`` (answered, failed, cancelled) from anywhere but ``DONE``.
EXCHANGE_MOVES: Moves[str, str] = Moves("an upstream exchange", {
    (NEW, "wait"): WAITING,
    (SENT, "wait"): WAITING,
    **{(state, "connect"): CONNECTING for state in (NEW, WAITING, SENT)},
    **{(state, "send"): SENT for state in (NEW, WAITING, CONNECTING)},
    (SENT, "stop"): STOPPING,
    **{(state, "end"): DONE for state in (NEW, WAITING, CONNECTING, SENT, STOPPING)},
})


# -- the response and the exchange ----------------------------------------------------------------


class ResponseHandler(TypingProtocol):
    """Where a response goes as it arrives (a relay, or :class:`Collector`)."""

    def response_started(self, response: "Response") -> None: ...

    def body_received(self, data: bytes) -> None: ...


class Collector:
    """A handler that keeps the body, up to ``limit`` bytes, in ``response.body``."""

    __slots__ = ("_parts", "_size", "_limit", "_response")

    def __init__(self, limit: int | None = None):
        self._parts: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._response: Response | None = None

    def response_started(self, response: "Response") -> None:
        self._response = response
        response.body = b""

    def body_received(self, data: bytes) -> None:
        if self._limit is not None:
            room = self._limit - self._size
            if room <= 0:
                return
            data = data[:room]
        self._parts.append(data)
        self._size += len(data)
        if self._response is not None:
            self._response.body = b"".join(self._parts) if len(self._parts) > 1 else data


@implementer(IPushProducer)
class Response:
    """A response head, and the producer of its body while its exchange lasts.

    ``headers`` are the raw lines, in order, repeats kept, names as sent
    (``Content-Length`` and ``Transfer-Encoding`` included: a relay drops the
    hop-by-hop ones).  ``length`` is the body's length when the upstream
    framed it with ``Content-Length`` (0 for no body), else None.
    ``pauseProducing``/``resumeProducing`` pause the upstream socket;
    ``stopProducing`` abandons the request: its connection is aborted, and
    the Deferred fails with ``CancelledError`` when the connection is gone.
    All three do nothing once the exchange is over.
    """

    __slots__ = ("version", "code", "phrase", "headers", "length", "codings", "body", "retried", "_exchange")

    def __init__(self, version: bytes, code: int, phrase: bytes, headers: list, length: int | None,
                 exchange: "_Exchange", codings: bytes | None = None):
        self.version = version
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.length = length
        #: The transfer codings the body still carries (``b"gzip"`` of ``gzip, chunked``: the
        #: chunks are removed, not the rest), for a relay to send on; None when none.
        self.codings = codings
        #: The body, when the handler was a :class:`Collector` (the default).
        self.body: bytes | None = None
        #: The request was sent a second time after a stale connection.
        self.retried = exchange.retried
        self._exchange: _Exchange | None = exchange

    def pauseProducing(self) -> None:
        ex = self._exchange
        if ex is not None and ex.conn is not None:
            ex.conn.pause()

    def resumeProducing(self) -> None:
        ex = self._exchange
        if ex is not None and ex.conn is not None:
            ex.conn.resume()

    def stopProducing(self) -> None:
        ex = self._exchange
        if ex is None or ex.state is not SENT:
            return
        conn = ex.conn
        assert conn is not None  # SENT: on a connection
        # The consumer is gone (its connection was lost): drop the upstream
        # connection; the request fails with CancelledError once it is gone,
        # not from within the consumer's own connectionLost (as with a
        # transport registered as producer, which closes on a later turn).
        ex.fire("stop")
        conn.abort()


class _Exchange(Machine[str, str]):
    """One request and its way to a response: the only per-request object besides the Response.

    ``state`` moves by :data:`EXCHANGE_MOVES`; ``conn`` is its connection while ``SENT`` or ``STOPPING``.
    """

    __slots__ = ("method", "data", "body", "handler", "deferred", "replayable", "timer", "conn",
                 "reused", "retried", "response")
    moves = EXCHANGE_MOVES

    def __init__(self, method: bytes, data: bytes, body: bytes, handler: ResponseHandler, replayable: bool,
                 canceller: Callable[["_Exchange"], None]):
        self.method = method
        #: The head (with a small body appended); ``body`` holds a large body apart.
        self.data = data
        self.body = body
        self.handler = handler
        self.deferred: Deferred = Deferred(lambda d: canceller(self))
        self.replayable = replayable
        self.timer: IDelayedCall | None = None
        self.conn: H1Connection | None = None
        self.reused = False
        self.retried = False
        self.response: Response | None = None
        self.state = NEW

    def _enter_DONE(self) -> None:
        """Over: its timer stops, and its response no longer produces."""
        timer, self.timer = self.timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.response is not None:
            self.response._exchange = None


# -- one connection ------------------------------------------------------------------------------


class H1Connection(Machine[str, str], Protocol):
    """One persistent connection: runs one exchange at a time, then goes back to its pool.

    ``state`` moves by :data:`CONNECTION_MOVES`; ``exchange`` is the one it carries while ``BUSY``, and
    the one being stopped while ``CLOSING`` after ``Response.stopProducing``.
    """

    #: Set by ``makeConnection``: a TCP (or TLS) transport, its own push producer too.
    transport: Any
    moves = CONNECTION_MOVES

    def __init__(self, pool: "H1Pool"):
        self._pool = pool
        self._parser = ResponseParser(self)
        self.exchange: _Exchange | None = None
        #: When it last went back to the pool (``reactor.seconds()``).
        self.idle_since = 0.0
        self.state = IDLE
        #: The upstream socket is paused for a slow consumer (a producer's flag, not a state).
        self._paused = False
        #: Requests this connection has carried.
        self.served = 0
        #: For :meth:`still_open`: a poll object on the socket (False: no socket to poll).
        self._poller: select.poll | Literal[False] | None = None
        #: Fired when the connection is gone (the pool's close waits on these).
        self.when_lost: list[Deferred] = []
        #: Every byte written so far went out at once (:func:`write_now`): the transport holds none.
        self._direct = True

    def connectionMade(self) -> None:
        set_no_delay(self.transport)

    # -- the exchange -----------------------------------------------------------

    def start(self, ex: _Exchange) -> None:
        """Send ``ex``'s request on this (``IDLE``) connection."""
        self.fire("start")
        self.exchange = ex
        ex.fire("send")
        ex.conn = self
        ex.reused = self.served > 0
        self.served += 1
        self._parser.start(ex.method == b"HEAD")
        if self._direct:
            self._direct = write_now(self.transport, ex.data)
        else:
            self.transport.write(ex.data)
        if ex.body:
            self._direct = False
            self.transport.write(ex.body)

    def still_open(self) -> bool:
        """False when the socket has ended, failed, or holds unread bytes (checked without reading).

        The reactor may not have handled the upstream's close of an idle
        connection yet (it arrived during this turn); the kernel has.  A
        transport without a socket (TLS, tests) is taken as open.
        """
        poller = self._poller
        if poller is None:
            get_handle = getattr(self.transport, "getHandle", None)
            sock = get_handle() if get_handle is not None else None
            if not isinstance(sock, socket.socket):
                self._poller = False
                return True
            # A poll object of its own: one poll(2) call, no exception, per check.
            poller = self._poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
        elif poller is False:
            return True
        # Readable: the end, an error, or bytes nobody asked for.
        return not poller.poll(0)

    def pause(self) -> None:
        if not self._paused and self.state is not LOST:
            self._paused = True
            self.transport.pauseProducing()

    def resume(self) -> None:
        if self._paused and self.state is not LOST:
            self._paused = False
            self.transport.resumeProducing()

    def close(self) -> None:
        """Close the connection once what was written is sent (``IDLE`` or ``BUSY`` -> ``CLOSING``)."""
        old = self.state
        if self.fire("close") is not old:
            self.transport.loseConnection()

    def abort(self) -> None:
        """Drop the connection now; it is never reused (-> ``CLOSING``, unless ``LOST`` already)."""
        self._parser.halt()
        if self.fire("abort") is CLOSING:
            self.transport.abortConnection()

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state is not BUSY:
            if state is IDLE:
                # Nothing was asked: a confused upstream. CLOSING or LOST: bytes after the end, dropped.
                self.close()
            return
        try:
            self._parser.feed(data)
        except ParseError as e:
            ex = self.exchange
            self.abort()
            if ex is not None:
                self._pool._fail(ex, BadResponse(str(e), request_sent=True, reused=ex.reused, retried=ex.retried))

    # -- parser events ------------------------------------------------------------

    def on_head(self, version: bytes, code: int, phrase: bytes, headers: list, length: int | None) -> None:
        ex = self.exchange
        assert ex is not None  # the parser runs only during an exchange
        if ex.timer is not None:
            # The timeout covers the wait for the head; a long body is not cut.
            if ex.timer.active():
                ex.timer.cancel()
            ex.timer = None
        ex.response = response = Response(version, code, phrase, headers, length, ex, self._parser.codings)
        try:
            ex.handler.response_started(response)
        except BaseException:
            self._handler_failed(ex, Failure())

    def on_body(self, data: bytes) -> None:
        ex = self.exchange
        try:
            ex.handler.body_received(data)  # type: ignore[union-attr]  # the parser runs only during an exchange
        except BaseException:
            assert ex is not None
            self._handler_failed(ex, Failure())

    def on_end(self, keep_alive: bool) -> None:
        ex = self.exchange
        assert ex is not None  # the parser runs only during an exchange
        self.exchange = None
        ex.conn = None
        if self._paused and self.state is not LOST:
            self._paused = False
            self.transport.resumeProducing()
        if keep_alive and not self._parser.extra:
            if self.fire("answered") is IDLE:
                self._pool._release(self)
        else:
            self.close()
        self._pool._succeed(ex)

    def _handler_failed(self, ex: _Exchange, failure: Failure) -> None:
        """The handler raised: the exchange fails with its error, the connection is dropped."""
        if self.exchange is ex:
            self.exchange = None
            ex.conn = None
            self.abort()
            self._pool._fail(ex, failure)

    # -- the end ---------------------------------------------------------------------

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.fire("lost")
        # Leave the count first, so a retry can have a fresh connection in its place.
        self._pool._connection_lost(self)
        ex = self.exchange
        clean = reason is None or reason.check(ierror.ConnectionDone) is not None
        if ex is not None and not self._parser.feed_eof(clean):
            self.exchange = None
            ex.conn = None
            self._parser.halt()
            self._pool._lost(ex, self._parser.received, reason)
        waiters, self.when_lost = self.when_lost, []
        for d in waiters:
            d.callback(None)


def write_now(transport: Any, data: bytes) -> bool:
    """Send ``data`` on a TCP ``transport`` at once (``writeSomeData``), what the socket does not take through
    ``transport.write``; True when all of it went out at once.

    What a TCP transport's own write costs: edge/writer.py's module
    docstring.  Only for a connection whose every byte so far went out
    this way (the caller keeps that fact, :attr:`H1Connection._direct`): once
    a write was left to the transport, it may still hold bytes, and a direct
    send would pass them.  Anything else (TLS, a test's transport, a closing
    connection) takes the transport's own way.
    """
    if isinstance(transport, tcp.Connection) and transport.connected and not transport.disconnecting:
        sent = transport.writeSomeData(data)
        if isinstance(sent, int) and sent > 0:
            if sent == len(data):
                return True
            data = data[sent:]
    transport.write(data)
    return False


class _ConnectionFactory(Factory):
    noisy = False

    def __init__(self, pool: "H1Pool"):
        self._pool = pool

    def buildProtocol(self, addr: Any) -> H1Connection:
        return H1Connection(self._pool)


# -- the pool ------------------------------------------------------------------------------------


def client_endpoint(reactor: Any, host: str, port: int, timeout: float = 30.0) -> IStreamClientEndpoint:
    """A plain TCP endpoint for an IP literal; ``HostnameEndpoint`` only for names.

    HostnameEndpoint waits its ``attemptDelay`` (0.3 s) before reporting a
    refused connection, which would slow every retry during an outage.
    """
    try:
        address = ip_address(host)
    except ValueError:
        return HostnameEndpoint(reactor, host, port, timeout=timeout)
    if address.version == 6:
        return TCP6ClientEndpoint(reactor, host, port, timeout=timeout)
    return TCP4ClientEndpoint(reactor, host, port, timeout=timeout)


class H1Pool:
    """Persistent HTTP/1.1 connections to one upstream, and requests over them.

    ``max_connections`` (busy, idle and being made; None: no bound),
    ``max_idle`` (None: ``max_connections``) and ``idle_timeout`` (seconds;
    None: no limit) are docs/architecture.md's (*The upstream client*).
    ``host`` (an IP literal, or a name) and ``port`` are for the connections
    and the ``Host`` header; ``endpoint`` connects instead (TLS, a unix
    socket, a test's endpoint).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        host: str,
        port: int,
        *,
        max_connections: int | None = 64,
        max_idle: int | None = None,
        idle_timeout: float | None = 60.0,
        connect_timeout: float = 30.0,
        endpoint: IStreamClientEndpoint | None = None,
        host_header: bytes | None = None,
    ):
        if max_connections is not None and max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if max_idle is None:
            max_idle = max_connections
        elif max_idle < 0:
            raise ValueError("max_idle must be at least 0")
        self._reactor = reactor
        self._endpoint = endpoint if endpoint is not None else client_endpoint(reactor, host, port, connect_timeout)
        self.max_connections = max_connections
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        if host_header is None:
            name = f"[{host}]" if ":" in host else host
            host_header = (name if port == 80 else f"{name}:{port}").encode("idna" if not name.isascii() else "ascii")
        self._head_start = b" HTTP/1.1\r\nHost: " + host_header + b"\r\n"
        self._factory = _ConnectionFactory(self)
        #: Idle connections, the most recently used last.
        self._idle: list[H1Connection] = []
        #: Requests waiting for a connection, in order.
        self._waiting: list[_Exchange] = []
        #: Connections open or being opened.
        self._count = 0
        self._closed = False
        #: The one timer that closes idle connections past ``idle_timeout`` (see :meth:`_sweep`).
        self._sweeper: IDelayedCall | None = None

    # -- public -----------------------------------------------------------------------------

    def request(
        self,
        method: bytes,
        target: bytes,
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        handler: ResponseHandler | None = None,
        *,
        timeout: float | None = None,
        replayable: bool | None = None,
    ) -> Deferred:
        """Send a request; a Deferred firing with the :class:`Response` once its body is complete.

        :param target: the request target (``/path?query``), sent as it is.
        :param headers: header lines, sent as given; the client writes
            ``Host`` and ``Content-Length`` itself (so these must not be among
            them, nor ``Transfer-Encoding``).
        :param handler: gets the head and the body as they arrive; by
            default a :class:`Collector` keeps the body in ``response.body``.
        :param timeout: seconds to wait for the response head (connecting
            and waiting for a free connection included); then the request
            fails with :class:`ResponseTimeout` and its connection is aborted.
        :param replayable: True: the request may be sent again after a stale
            connection even if its method is not idempotent; False: never,
            whatever its method; None: if its method is idempotent (see the
            module docstring).

        Cancelling the Deferred abandons the request, as :meth:`Response.stopProducing` does.
        """
        parts = [method, b" ", target, self._head_start]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        lines = 2 + len(parts) // 4 - 1
        if body or method in _BODY_METHODS:
            parts += (b"Content-Length: ", b"%d" % len(body), b"\r\n")
            lines += 1
        parts.append(b"\r\n")
        head = b"".join(parts)
        # One CRLF per line and no other CR, LF or NUL: nothing can smuggle a line in.
        if (
            head.count(b"\r\n") != lines + 1
            or head.count(b"\r") != lines + 1
            or head.count(b"\n") != lines + 1
            or b"\0" in head
            or b" " in target
            or not target
        ):
            raise ValueError("CR, LF, NUL or space in a request line or header")
        if replayable is None:
            replayable = method in IDEMPOTENT
        if len(body) <= SMALL_BODY:
            ex = _Exchange(method, head + body if body else head, b"", handler or Collector(), replayable, self._cancel)
        else:
            ex = _Exchange(method, head, body, handler or Collector(), replayable, self._cancel)
        if timeout is not None:
            ex.timer = self._reactor.callLater(timeout, self._timed_out, ex, timeout)
        self._dispatch(ex)
        return ex.deferred

    def close(self) -> Deferred:
        """Close the idle connections and refuse new requests; busy ones close when done.

        Fires when the idle connections are closed.
        """
        self._closed = True
        self._stop_sweeper()
        for ex in self._waiting[:]:
            self._fail(ex, PoolClosed("the upstream client was closed"))
        waits = []
        for conn in self._idle[:]:
            self._drop_idle(conn)
            done: Deferred = Deferred()
            conn.when_lost.append(done)
            waits.append(done)
            conn.close()
        return gatherResults(waits).addCallback(lambda _: None) if waits else succeed(None)

    def stats(self) -> dict[str, int]:
        """Open, idle and waiting counts (for tests and status)."""
        return {"open": self._count, "idle": len(self._idle), "waiting": len(self._waiting)}

    # -- getting a connection ---------------------------------------------------------------------

    def _dispatch(self, ex: _Exchange) -> None:
        """Send ``ex`` on an idle connection, a new one, or queue it."""
        if self._closed:
            self._fail(ex, PoolClosed("the upstream client was closed"))
            return
        if not ex.retried:
            idle = self._idle
            while idle:
                conn = idle.pop()
                if conn.state is not IDLE:
                    continue
                if not conn.still_open():
                    # Closed by the upstream (or written to) while idle: nothing was sent on it.
                    conn.close()
                    continue
                conn.start(ex)
                return
        bound = self.max_connections
        if bound is not None and self._count >= bound and ex.retried and self._idle:
            # A retry wants a fresh connection: make room by closing the oldest idle one.
            oldest = self._idle[0]
            self._drop_idle(oldest)
            oldest.close()
        if bound is None or self._count < bound:
            self._connect(ex)
        else:
            ex.fire("wait")
            self._waiting.append(ex)

    def _connect(self, ex: _Exchange | None) -> None:
        self._count += 1
        if ex is not None:
            ex.fire("connect")
        d = self._endpoint.connect(self._factory)

        def connected(conn: H1Connection) -> None:
            if ex is not None and ex.state is CONNECTING:
                conn.start(ex)
            else:
                self._release(conn)  # made for a request that left (DONE)

        def failed(f: Failure) -> None:
            self._count -= 1
            if ex is not None and ex.state is CONNECTING:
                self._fail(ex, _connect_error(f.value))
            self._kick()

        d.addCallbacks(connected, failed)

    def _release(self, conn: H1Connection) -> None:
        """A connection is free (``IDLE``: after a complete response, or made for a request that left)."""
        if conn.state is not IDLE:
            return
        if self._closed:
            conn.close()
            return
        while self._waiting:
            ex = self._waiting.pop(0)
            if ex.state is DONE:
                continue
            if ex.retried:
                # It wants a fresh connection: trade this one for a new one.
                # (The closing one is counted until it is gone: one over the bound, briefly.)
                conn.close()
                self._connect(ex)
                return
            conn.start(ex)
            return
        idle = self._idle
        if self.max_idle is not None and len(idle) >= self.max_idle:
            # Room for this one (the warmest): the oldest idle one goes, as the Agent's pool does.
            if not idle:
                conn.close()
                return
            oldest = idle[0]
            self._drop_idle(oldest)
            oldest.close()
        idle.append(conn)
        if self.idle_timeout is not None:
            conn.idle_since = self._reactor.seconds()
            if self._sweeper is None:
                self._sweeper = self._reactor.callLater(self.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for ``idle_timeout``; wait for the next one to be.

        One timer per pool rather than one per connection each time it goes
        back to the pool: the idle list is in the order connections came
        back (reuse takes the last), so the oldest are first.
        """
        self._sweeper = None
        idle = self._idle
        now = self._reactor.seconds()
        timeout = self.idle_timeout
        assert timeout is not None  # no sweeper without a timeout
        while idle and idle[0].idle_since + timeout <= now:
            idle.pop(0).close()
        if idle:
            self._sweeper = self._reactor.callLater(idle[0].idle_since + timeout - now, self._sweep)

    def _stop_sweeper(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None and sweeper.active():
            sweeper.cancel()

    def _drop_idle(self, conn: H1Connection) -> None:
        idle = self._idle
        if conn in idle:
            idle.remove(conn)
            if not idle:
                self._stop_sweeper()

    def _connection_lost(self, conn: H1Connection) -> None:
        self._count -= 1
        self._drop_idle(conn)
        self._kick()

    def _kick(self) -> None:
        """Room for a connection: open one for the first waiting request."""
        while self._waiting and not self._closed and (
            self.max_connections is None or self._count < self.max_connections
        ):
            ex = self._waiting.pop(0)
            if ex.state is not DONE:
                self._connect(ex)

    # -- ends of an exchange ------------------------------------------------------------------------

    def _succeed(self, ex: _Exchange) -> None:
        if ex.state is DONE:
            return
        ex.fire("end")
        ex.deferred.callback(ex.response)

    def _fail(self, ex: _Exchange, error: BaseException | Failure) -> None:
        if ex.state is DONE:
            return
        if ex.state is WAITING:
            self._waiting.remove(ex)
        ex.fire("end")
        ex.deferred.errback(error)

    def _lost(self, ex: _Exchange, received: bool, reason: Failure | None) -> None:
        """The connection of ``ex`` ended before its response did."""
        if ex.state is DONE:
            return
        if ex.state is STOPPING:
            self._fail(ex, CancelledError("the response's consumer stopped it"))
            return
        what = type(reason.value).__name__ if reason is not None else "closed"
        if not received:
            if ex.reused and ex.replayable and not ex.retried:
                # The stale connection: once more on a fresh one (module docstring).
                ex.retried = True
                self._dispatch(ex)
                return
            error: H1Error = ResponseNeverReceived(
                f"the upstream closed the connection before answering ({what})",
                request_sent=True, reused=ex.reused, retried=ex.retried,
            )
        else:
            error = ResponseIncomplete(
                f"the upstream closed the connection mid-response ({what})",
                request_sent=True, reused=ex.reused, retried=ex.retried,
            )
        self._fail(ex, error)

    def _cancel(self, ex: _Exchange) -> None:
        """Canceller: the caller gave up; abort its connection (the Deferred fails with CancelledError)."""
        if ex.state is DONE:
            return
        if ex.state is WAITING:
            self._waiting.remove(ex)
        ex.fire("end")
        conn = ex.conn
        if conn is not None:
            conn.exchange = None
            ex.conn = None
            conn.abort()
        # A connection being made for it is kept: it joins the pool when made.

    def _timed_out(self, ex: _Exchange, seconds: float) -> None:
        ex.timer = None
        if ex.state is DONE:
            return
        conn = ex.conn
        if conn is not None:
            conn.exchange = None
            ex.conn = None
            conn.abort()
        sent = conn is not None
        self._fail(ex, ResponseTimeout(
            f"no response from the upstream within {seconds:g}s",
            request_sent=sent, reused=ex.reused, retried=ex.retried,
        ))


def _connect_error(e: BaseException) -> ConnectFailed:
    if isinstance(e, ierror.ConnectionRefusedError):
        return ConnectFailed(f"connection refused ({e})", "refused")
    return ConnectFailed(f"could not connect ({type(e).__name__}: {e})", "connect")
