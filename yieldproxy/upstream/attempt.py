"""The upstream hop: one attempt, streamed back to the client.

The hop runs on :mod:`yieldproxy.edge.h1client` (a lean HTTP/1.1 client on a
persistent pool), not ``twisted.web.client.Agent`` and not treq: treq follows
redirects, adds ``Accept-Encoding`` and decodes bodies, keeps a cookie jar
shared by all callers, and spools large request bodies to disk; the Agent is
correct but general, and its per-request machinery (URI parsing, a
``Headers`` object, request and response state machines, several Deferreds)
cost more than the rest of the proxy together (``bench/latency.py``).

An attempt either relays a whole answer, or fails.  A failure *before the
first byte reached the client* is :class:`RetryableFailure` (the caller may
park the request and try again); a failure after that is :class:`RelayBroken`
and ends the response, never silently replayed.  The client never sends a
request twice on its own (``replayable=False``): a pooled connection the
upstream closed while idle is noticed before the request is written to it
(see h1client), and one that dies after the request was written is a
``reset``, retried and counted by the proxy, or reported.

A replay slot stands for work on the GPU, so an attempt ends when the
*upstream* has finished its answer, not when a slow client has read it: what
the client has not taken yet waits in the proxy's memory, within a bound per
response and a bound in total (:class:`ClientBuffers`); a client past either
bound is dropped (:class:`ClientTooSlow`) instead of pausing the upstream.
"""

from __future__ import annotations

from typing import Callable, Sequence
from urllib.parse import urlsplit

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import wrapClientTLS
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime, IStreamClientEndpoint
from twisted.internet.ssl import optionsForClientTLS
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from zope.interface import implementer

from ..edge.h1client import BadResponse, H1Error, H1Pool, Response, client_endpoint
from ..servers.ollama import SERVER as OLLAMA
from ..states import Machine, Moves, Named
from .records import WholeRecords, whole_records
from .verdict import Reason, judged_reason, status_reason

log = Logger()

#: Headers that describe one connection, not the message (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Request headers the proxy sets or consumes itself.
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
#: Response headers not copied as they are: the hop-by-hop ones, and the length (set from the body relayed).
_NOT_RELAYED = HOP_BY_HOP | {b"content-length"}
#: Most bytes of an error body read to decide whether it is retryable (the rest is relayed after it).
_ERROR_BODY_LIMIT = 64 * 1024
#: Seconds an idle upstream connection is kept for reuse.
IDLE_TIMEOUT = 60.0
#: The reasons of the client's own failures (h1client's ``H1Error.reason``) an attempt keeps; any other is a ``reset``.
_CLIENT_REASONS = {"refused": Reason.REFUSED, "connect": Reason.CONNECT, "timeout": Reason.TIMEOUT}


@attrs.frozen
class UpstreamAnswer:
    """An upstream's whole (small) error answer, kept so it can still be relayed as it was."""

    code: int
    phrase: bytes
    #: The header lines as the upstream sent them (names as sent, repeats kept).
    headers: list[tuple[bytes, bytes]]
    body: bytes
    #: The transfer codings ``body`` is still in (``b"gzip"``), relayed with it; None when none.
    codings: bytes | None = None


class RetryableFailure(Exception):
    """The attempt failed before anything reached the client; it may be retried.

    ``reason`` is a :class:`~yieldproxy.upstream.verdict.Reason` (a metric label).
    ``answer`` is the upstream's own answer when it gave one (a 5xx), for the
    caller to relay if it gives up; ``words``, what its server read in it
    (``Server.judge``), for the verdict (yieldproxy/upstream/verdict.py).
    """

    def __init__(self, reason: str, detail: str, answer: UpstreamAnswer | None = None, words: str | None = None):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.answer = answer
        self.words = words


def raise_judged(code: int, judged: str, detail: str, answer: UpstreamAnswer) -> None:
    """Raise the :class:`RetryableFailure` an error answer judged ``judged`` by its server is, if any
    (:func:`~yieldproxy.upstream.verdict.judged_reason`); a 4xx that is the caller's raises nothing: it is relayed."""
    reason = judged_reason(code, judged)
    if reason is None:
        return
    if reason == Reason.BUSY:
        detail = f"upstream busy: {detail}"
    elif reason == Reason.GPU_ERROR:
        detail = f"upstream GPU failure: {detail}"
    raise RetryableFailure(reason, detail, answer, judged)


class RelayBroken(Exception):
    """The upstream failed after part of the answer reached the client.

    ``reason`` is a metric label: ``broken`` (the answer was cut, or could
    not be read on), or ``stall`` (nothing came for ``upstream.stall_timeout_seconds``).
    """

    def __init__(self, detail: str, reason: str = Reason.BROKEN):
        super().__init__(detail)
        self.reason = reason


class ClientTooSlow(Exception):
    """The client read so slowly that its unread answer passed a buffer bound; it was dropped."""


@attrs.define(eq=False)
class ClientBuffers:
    """Bytes of answers that slow clients have not taken yet, held in the proxy's memory.

    A relay counts the bytes it writes while the client's transport has
    paused it (its kernel and Twisted buffers are full) and returns them when
    the transport resumes it, which Twisted does once everything written has
    gone out.  ``per_response`` bounds one answer's share, ``total`` all of
    them; ``on_change`` sees the new total (the metric).
    """

    per_response: int
    total: int
    on_change: Callable[[int], None] = lambda held: None
    held: int = 0

    def take(self, size: int, already: int) -> bool:
        """Account ``size`` more bytes for a response holding ``already``; False past a bound."""
        if already + size > self.per_response or self.held + size > self.total:
            return False
        self.held += size
        self.on_change(self.held)
        return True

    def give_back(self, size: int) -> None:
        if size:
            self.held -= size
            self.on_change(self.held)


def write_answer(request, answer: UpstreamAnswer, extra_headers=()) -> bytes:
    """Set ``request`` up to relay ``answer`` exactly, and return the body to write."""
    request.setResponseCode(answer.code, answer.phrase)
    if answer.codings is not None and request.method != b"HEAD":
        # Still in its transfer codings: sent with them, chunked, never under a plain length.
        request.responseHeaders = _CodedHeaders(request.responseHeaders, answer.codings)
    copy_response_headers(answer.headers, request.responseHeaders)
    if answer.codings is None:
        request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(answer.body)])
    for name, value in extra_headers:
        request.responseHeaders.setRawHeaders(name, [value])
    return answer.body


class _CodedHeaders(Headers):
    """Response headers that keep the transfer codings of a relayed body in front of Twisted's chunking.

    An upstream's ``Transfer-Encoding: gzip, chunked`` body reaches the
    relay de-chunked but still gzip-coded (edge/h1parse.py); it must go out
    labelled so.  Twisted's ``Request.write`` chunks a body of unknown
    length by setting ``Transfer-Encoding: chunked`` over any value set
    before: here that value becomes ``gzip, chunked`` (chunked last, RFC
    9112 6.1).  A client that gets no chunking (HTTP/1.0) gets the codings
    alone, its body read until the close.  ``tests/proxy/test_relay.py`` fails if
    a Twisted release writes the head another way.
    """

    __slots__ = ("_codings",)

    def __init__(self, source: Headers, codings: bytes):
        super().__init__()
        self._codings = codings
        for name, values in source.getAllRawHeaders():
            super().setRawHeaders(name, values)
        super().setRawHeaders(b"transfer-encoding", [codings])

    def setRawHeaders(self, name, values) -> None:
        if (name.lower() if isinstance(name, bytes) else name.lower().encode("ascii")) == b"transfer-encoding":
            if list(values) == [b"chunked"]:
                values = [self._codings + b", chunked"]
        super().setRawHeaders(name, values)


def _listed(connection_values) -> set[bytes]:
    """The header names a ``Connection`` header lists (they describe the connection too)."""
    return {token.strip().lower() for value in connection_values for token in value.split(b",")}


def _content_type(lines: list[tuple[bytes, bytes]]) -> bytes:
    """The first ``Content-Type`` of an answer's header lines, or empty (a loop: no generator per answer)."""
    for name, value in lines:
        if name.lower() == b"content-type":
            return value
    return b""


def upstream_request_headers(incoming: Headers) -> list[tuple[bytes, bytes]]:
    """The client's header lines to forward, repeated ones kept, minus hop-by-hop ones and ours."""
    skip = _NOT_FORWARDED
    connection = incoming.getRawHeaders(b"connection")
    if connection:
        skip = skip | _listed(connection)
    out = []
    for name, values in incoming.getAllRawHeaders():
        lower = name.lower()
        if lower in skip or lower.startswith(b"x-yield-"):
            continue
        for value in values:
            out.append((name, value))
    return out


def copy_response_headers(source: list[tuple[bytes, bytes]], target: Headers) -> None:
    """Copy the upstream's header lines onto the client response, minus hop-by-hop ones and the length.

    A name's first line replaces what the site set (its own ``Server`` and
    ``Date``); its repeats are added after it.
    """
    skip = _NOT_RELAYED
    connection = [value for name, value in source if name.lower() == b"connection"]
    if connection:
        skip = skip | _listed(connection)
    seen = set()
    for name, value in source:
        lower = name.lower()
        if lower in skip:
            continue
        if lower in seen:
            target.addRawHeader(name, value)
        else:
            seen.add(lower)
            target.setRawHeaders(name, [value])


class Upstream:
    """The configured upstream: its base URL and a persistent pool of connections to it.

    The pool does not bound the requests in flight (each one that finds no
    idle connection opens one, as the Agent did); ``max_connections`` bounds
    the idle ones kept for reuse (``upstream.max_connections``).  Connections
    are made by ``endpoint`` (by default TCP, TLS for ``https``; a test's
    in-memory endpoint).
    """

    def __init__(
        self,
        reactor,
        url: str,
        max_connections: int = 64,
        *,
        idle_timeout: float | None = IDLE_TIMEOUT,
        connect_timeout: float = 30.0,
        endpoint: IStreamClientEndpoint | None = None,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        default_port = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default_port
        self.prefix = parts.path.rstrip("/").encode("ascii")
        if endpoint is None:
            endpoint = client_endpoint(reactor, self.host, self.port, connect_timeout)
            if parts.scheme == "https":
                endpoint = wrapClientTLS(optionsForClientTLS(self.host), endpoint)
        name = f"[{self.host}]" if ":" in self.host else self.host
        host_header = name if self.port == default_port else f"{name}:{self.port}"
        #: The ``Host`` every request to it carries (its CORS check compares an ``Origin`` with it).
        self.host_header = host_header
        self.client = H1Pool(
            reactor, self.host, self.port,
            max_connections=None, max_idle=max_connections, idle_timeout=idle_timeout, endpoint=endpoint,
            host_header=host_header.encode("ascii" if host_header.isascii() else "idna"),
        )

    def target(self, target: bytes) -> bytes:
        """The request target sent upstream for a canonical one (``target.Target.raw``).

        The target has no dot segments (proxy/target.py removes them), so it can
        never climb out of the upstream URL's path prefix.
        """
        if not target.startswith(b"/"):
            raise ValueError(f"not a path: {target!r}")
        return self.prefix + target

    def close(self) -> Deferred:
        """Close the idle connections; from now on requests fail (busy connections close when done)."""
        return self.client.close()


def failure_reason(error: H1Error) -> str:
    """The metric reason of a request that got no complete answer: refused, connect, timeout,
    bad_answer (it could not be read: bad framing, a bare LF in a header) or reset."""
    kept = _CLIENT_REASONS.get(error.reason)
    if kept is not None:
        return kept
    # Named as a translated attempt's unreadable answer is.
    return Reason.BAD_ANSWER if isinstance(error, BadResponse) else Reason.RESET


def describe_failure(error: H1Error, url: str) -> str:
    """A sentence about a request that got no complete answer, naming the upstream."""
    if error.reason == "refused":
        return f"upstream {url} refused the connection"
    if error.reason == "connect":
        return f"upstream {url} unreachable: {error}"
    return f"upstream {url}: {error}"


# -- an attempt's states ---------------------------------------------------------------------------


class Answer(Named):
    """Where an attempt's answer is (:attr:`Attempt.state`)."""

    #: Nothing of it reached the client yet: what comes is relayed as it comes.
    AWAITING = "awaiting"
    #: An error answer, read whole to judge it before anything reaches the client.
    JUDGING = "judging"
    #: Its status and headers are the client's: a failure from here ends the answer, never a retry.
    RELAYING = "relaying"
    #: The upstream's part is over: answered, failed, or judged.
    ENDED = "ended"


class Client(Named):
    """How what an attempt writes reaches its client (:attr:`Attempt.client`)."""

    #: It goes out as it is written (the attempt is not the client's producer).
    OPEN = "open"
    #: The client's transport is full: the attempt is its producer, and what it writes waits in
    #: memory, counted in :class:`ClientBuffers`.
    PAUSED = "paused"
    #: Still its producer; everything written so far has gone out.
    RESUMED = "resumed"
    #: The client went away, or was dropped for reading too slowly: nothing more is written.
    GONE = "gone"


AWAITING, JUDGING, RELAYING, ENDED = Answer.AWAITING, Answer.JUDGING, Answer.RELAYING, Answer.ENDED
OPEN, PAUSED, RESUMED, GONE = Client.OPEN, Client.PAUSED, Client.RESUMED, Client.GONE

#: What each event does to an attempt's answer; any other is a bug (:class:`~yieldproxy.states.Unexpected`).
ANSWER_MOVES: Moves[Answer, str] = Moves("an attempt's answer", {
    # An error status: its body is read whole and judged before anything reaches the client.
    (AWAITING, "error_head"): JUDGING,
    # Its status and headers are the client's: with the first byte, an empty answer, or an error relayed whole.
    (AWAITING, "committed"): RELAYING,
    (JUDGING, "committed"): RELAYING,
    # An error body too long to judge: relayed as any answer is, from what was read.
    (JUDGING, "too_long"): AWAITING,
    # The upstream's part is over: answered, failed, or judged.
    **{(state, "ended"): ENDED for state in (AWAITING, JUDGING, RELAYING)},
})
#: What each event of the client's side does; any other is a bug.  The transport's pause and resume, and
#: giving the producer back, leave a side they do not concern as it is.
CLIENT_MOVES: Moves[Client, str] = Moves("an attempt's client", {
    # Its transport is full: the attempt registered as its producer, paused.
    (OPEN, "full"): PAUSED,
    (RESUMED, "paused"): PAUSED,
    **{(state, "paused"): state for state in (OPEN, PAUSED, GONE)},
    (PAUSED, "resumed"): RESUMED,
    **{(state, "resumed"): state for state in (OPEN, RESUMED, GONE)},
    # No longer its producer: drained, abandoned, or before it is dropped or told it is gone.
    (PAUSED, "unregistered"): OPEN,
    (RESUMED, "unregistered"): OPEN,
    **{(state, "unregistered"): state for state in (OPEN, GONE)},
    # It left, or was dropped for reading too slowly (never while the attempt is its producer).
    (OPEN, "gone"): GONE,
    (GONE, "gone"): GONE,
})


class _ClientSide(Machine[Client, str]):
    """An attempt's client side (:attr:`Attempt.client`), moved only by its events."""

    __slots__ = ()
    moves = CLIENT_MOVES

    def __init__(self) -> None:
        self.state = OPEN


def _write_blocked(channel) -> bool:
    """Whether the client's transport is full (what is written waits in memory): the response writer says
    (the listener's ``ServerConnection.write_blocked``: edge/writer.py); a channel that does not tell (a
    test's StubTreq, a plain Site's) is taken as never full."""
    return bool(getattr(channel, "write_blocked", False))


@implementer(IPushProducer)
class Attempt(Machine[Answer, str]):
    """One try at sending a request upstream and relaying its answer.

    ``run()`` returns a Deferred firing with the status code relayed once the
    *upstream* has finished its answer, or failing with
    :class:`RetryableFailure`, :class:`RelayBroken`, :class:`ClientTooSlow`
    or ``CancelledError`` (the client went away).  Its two bounds, the attempt
    timeout and the stall timeout, run on one timer (docs/configuration.md,
    ``attempt_timeout_seconds`` and ``stall_timeout_seconds``).  After a
    success, :meth:`client_drained` fires when the client has read the rest;
    the request must not be finished before.

    The attempt is the upstream client's response handler (``response_started``,
    ``body_received``): an error status (5xx, or 4xx when statuses are
    retried) is read first, up to :data:`_ERROR_BODY_LIMIT` bytes, to judge
    whether it is retryable, and a longer one is then relayed whole, what was
    read first; any other answer is relayed as it comes, the status and
    headers committed with its first byte.

    It is also the client request's producer (not the upstream socket), so it
    never pauses the upstream for a slow client, which would keep its replay
    slot: what it writes while the client's transport is full waits in memory,
    counted in :class:`ClientBuffers`; past a bound the client is dropped
    (:class:`ClientTooSlow` raised into the upstream client, which aborts the
    upstream connection).  It becomes the producer only once the client's
    transport is full (most answers are written at once; a client that leaves
    before then is cancelled by Klein), and stays so after the upstream has
    finished, until the client has taken the rest.

    Its answer's state and its client's side are two named states
    (:data:`ANSWER_MOVES`, :data:`CLIENT_MOVES`).  Whether the answer has
    started, which decides whether a failure may still be retried, is the
    response writer's to say (:meth:`_answer_started`).
    """

    moves = ANSWER_MOVES

    def __init__(
        self,
        clock: IReactorTime,
        upstream: Upstream,
        request,
        body: bytes,
        timeout: float,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
        retry_statuses: bool = True,
        buffers: ClientBuffers | None = None,
        *,
        target: bytes,
        judge: Callable[[int, bytes], str] = OLLAMA.judge,
        stall_timeout: float | None = None,
    ):
        self._clock = clock
        #: The upstream's server reads its own error answers (``Server.judge``): a GPU failure is retried.
        self._judge = judge
        #: The canonical request target forwarded (the one the class was decided on).
        self._target = target
        self._upstream = upstream
        self._request = request
        self._body = body
        self._timeout = timeout
        self._extra_headers = extra_headers
        self._retry_statuses = retry_statuses
        self._buffers = buffers
        self._stall = stall_timeout
        #: The one timer of the attempt (see :meth:`_check`).
        self._timer: IDelayedCall | None = None
        #: When the wait for the first byte ends (``run`` sets it).
        self._deadline = 0.0
        #: When the last bytes of the answer's body came from the upstream (None: none yet).
        self._last: float | None = None
        #: Why the timer ended the attempt: ``timeout`` or ``stall`` (None: it did not).
        self._cut: str | None = None
        self._pending: Deferred | None = None
        self.status: int | None = None
        self._response: Response | None = None
        #: Where the answer is (:data:`ANSWER_MOVES`).
        self.state = AWAITING
        #: How what is written reaches the client (:data:`CLIENT_MOVES`), read as :attr:`client`.
        self._side = _ClientSide()
        #: An error body being judged, and its size.
        self._parts: list[bytes] = []
        self._size = 0
        #: Bytes written since the client's transport paused us, counted in ``buffers``.
        self._buffered = 0
        #: A stream relayed a whole record at a time (upstream/records.py); None: as it comes.
        self._records: WholeRecords | None = None
        self._drained: Deferred | None = None

    @property
    def client(self) -> Client:
        """How what is written reaches the client (:data:`CLIENT_MOVES`)."""
        return self._side.state

    def _answer_started(self) -> bool:
        """Whether the answer's first byte is the client's: from then on a failure ends the answer, never a retry.

        The response writer says (the listener's ``ServerConnection.answer_started``); a channel
        that does not tell (Twisted's ``HTTPChannel``, a test's StubTreq), or none (the client is
        gone), leaves it to the attempt's own state.
        """
        started = getattr(self._request.channel, "answer_started", None)
        return self.state is RELAYING if started is None else started

    def run(self) -> Deferred:
        request = self._request
        upstream = self._upstream
        # Armed first: the client may fail the request at once (a closed pool).
        clock = self._clock
        self._deadline = clock.seconds() + self._timeout
        stall = self._stall
        first = self._timeout if stall is None or stall > self._timeout else stall
        self._timer = clock.callLater(first, self._check)
        try:
            d = upstream.client.request(
                request.method, upstream.target(self._target), upstream_request_headers(request.requestHeaders),
                self._body, self, replayable=False,
            )
        except BaseException:
            self._disarm()
            raise
        self._pending = d
        return d.addCallbacks(self._answered, self._failed)

    def client_has_all(self) -> bool:
        """After a success: True when nothing of the answer waits for the client (or it left).

        Then :meth:`client_drained` would fire at once; checking first spares
        the caller a Deferred and a turn of its coroutine on every request.
        """
        if self._side.state is GONE or self._buffered == 0:
            self._abandon()
            return True
        return False

    def client_drained(self) -> Deferred:
        """After a success: fires once the client has taken the whole answer (at once when nothing waits)."""
        if self.client_has_all():
            return succeed(None)
        self._drained = Deferred(canceller=lambda d: self._abandon())
        return self._drained

    # -- the upstream's answer (h1client's ResponseHandler) --------------------------------

    def response_started(self, response: Response) -> None:
        # The head does not start the stall clock: the first body byte does (a server that
        # streams sends its head before the prefill, bounded by the attempt timeout).
        self._response = response
        code = response.code
        # Any error status may be a GPU failure in its server's words (TEI's is a 424).
        if code >= 500 or (code >= 400 and self._retry_statuses):
            self.fire("error_head")

    def body_received(self, data: bytes) -> None:
        # The stall timer reads it when it fires: one clock read per piece, no timer touched.
        self._last = self._clock.seconds()
        state = self.state
        if state is JUDGING:
            self._parts.append(data)
            self._size += len(data)
            if self._size >= _ERROR_BODY_LIMIT:
                self._judge_long()
            return
        client = self._side.state
        if client is GONE:
            return
        request = self._request
        if client is OPEN:
            channel = request.channel
            if channel is None:
                self._side.fire("gone")  # the cancel follows
                return
            if _write_blocked(channel):
                # The client's transport is full: from here on, what is written waits in memory.
                self._register()
        first = state is AWAITING
        if first:
            # The answer is about to reach the client: from here on, no retry and no
            # attempt timeout (the stall timeout still runs).
            self.fire("committed")
            response = self._response
            assert response is not None  # the body comes after the response
            self._commit(response)
            self._records = whole_records(_content_type(response.headers), response.length, response.codings is not None)
        records = self._records
        if records is not None:
            data = records.whole(data)
            if not data and not first:
                return  # part of a record: it goes out with the record's end
        self._write(data)

    def _write(self, data: bytes) -> None:
        """Write to the client, counting what waits in memory while its transport is full."""
        if self._side.state is PAUSED and self._buffers is not None:
            if not self._buffers.take(len(data), self._buffered):
                self._drop(len(data))
            self._buffered += len(data)
        self._request.write(data)

    def _judge_long(self) -> None:
        """An error body longer than what is read to judge it: a 502/503 is retried, the rest relayed whole."""
        assert self._response is not None  # the body comes after the response
        code = self._response.code
        if code in (502, 503) and self._retry_statuses:
            # Not read further: the client aborts the connection.
            raise RetryableFailure(status_reason(code), f"upstream answered {code}: {_snippet(b''.join(self._parts))}")
        self.fire("too_long")  # relayed as any answer is, from what was read
        head, self._parts = b"".join(self._parts), []
        self.body_received(head)

    # -- the ends ----------------------------------------------------------------------------

    def _answered(self, response: Response) -> int:
        """The upstream's answer is complete."""
        self._disarm()
        try:
            state = self.state
            if state is JUDGING:
                return self._whole_error(response, b"".join(self._parts))
            if state is AWAITING and self._side.state is not GONE:
                self.fire("committed")
                self._commit(response)  # an empty body
            elif self._records is not None and self._side.state is not GONE:
                rest = self._records.rest()  # the stream ended cleanly: its last bytes as they are
                if rest:
                    self._write(rest)
            return response.code
        finally:
            self.fire("ended")

    def _failed(self, failure):
        self._disarm()
        self._abandon()
        try:
            return self._why(failure)
        finally:
            self.fire("ended")

    def _why(self, failure):
        """What the attempt's failure is for its caller: retryable while nothing reached the client, else broken."""
        error = failure.value
        url = self._upstream.url
        if self._cut == Reason.TIMEOUT:
            if self._response is not None and self._last is None:
                raise RetryableFailure(
                    Reason.TIMEOUT,
                    f"upstream {url} sent the head of its answer but no byte of its body within {self._timeout:g}s",
                )
            raise RetryableFailure(Reason.TIMEOUT, f"no answer from the upstream within {self._timeout:g}s")
        if self._cut == Reason.STALL:
            detail = f"upstream {url} sent nothing for {self._stall:g}s in the middle of its answer (stalled)"
            if self._answer_started():
                raise RelayBroken(detail, Reason.STALL)
            raise RetryableFailure(Reason.STALL, detail)
        if not isinstance(error, H1Error):
            # The client left (CancelledError), the answer was judged (RetryableFailure,
            # ClientTooSlow), or a bug: as it is.
            return failure
        if self.state is JUDGING:
            # The connection ended part-way through an error body: what came is the body.
            return self._whole_error(self._response, b"".join(self._parts))
        if self._answer_started():
            raise RelayBroken(describe_failure(error, url))
        raise RetryableFailure(failure_reason(error), describe_failure(error, url))

    def _whole_error(self, response: Response, body: bytes) -> int:
        """A whole (short) error answer: retryable, or relayed as it is with its true length."""
        code = response.code
        if self._retry_statuses:
            answer = UpstreamAnswer(code, response.phrase, response.headers, body, codings=response.codings)
            judged = self._judge(code, body)
            raise_judged(code, judged, f"upstream answered {code}: {_snippet(body)}", answer)
        self.fire("committed")
        self._commit(response)
        if response.codings is None:
            self._request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
        if body:
            self._request.write(body)
        return code

    def _commit(self, response: Response) -> None:
        request = self._request
        self.status = response.code
        request.setResponseCode(response.code, response.phrase)
        if response.codings is not None and request.method != b"HEAD":
            # Relayed with its transfer codings (gzip, ...), never de-chunked and relabelled.
            request.responseHeaders = _CodedHeaders(request.responseHeaders, response.codings)
        headers = request.responseHeaders
        copy_response_headers(response.headers, headers)
        # The upstream's own length, when it sent one (else the answer goes out chunked).
        if response.length is not None and request.method != b"HEAD":
            headers.setRawHeaders(b"content-length", [b"%d" % response.length])
        for name, value in self._extra_headers:
            headers.setRawHeaders(name, [value])

    # -- the timer: the first byte to the client, and the upstream's silences -----------------

    def _disarm(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _check(self) -> None:
        """The one timer fired: end the attempt past a bound, or wait until the next one could pass.

        The timer is not moved as bytes arrive (a piece costs one clock
        read, in :meth:`body_received`); it fires at most once a stall
        timeout, and then looks at when the last body bytes came (the head
        is not one: until the first body byte only the attempt timeout
        applies).  It is never late: each time it is set for at most
        ``stall`` after the last body bytes, or after now when none came yet.
        """
        self._timer = None
        now = self._clock.seconds()
        committed = self._answer_started()
        if not committed and now >= self._deadline:
            self._end(Reason.TIMEOUT)
            return
        stall = self._stall
        last = self._last
        if stall is not None and last is not None and now - last >= stall:
            self._end(Reason.STALL)
            return
        due = None if committed else self._deadline
        if stall is not None:
            quiet_end = (now if last is None else last) + stall
            due = quiet_end if due is None else min(due, quiet_end)
        if due is None:
            return  # the answer flows to the client and no stall bound is set: nothing to watch
        self._timer = self._clock.callLater(max(0.0, due - now), self._check)

    def _end(self, why: str) -> None:
        """Cut the attempt: its upstream connection is aborted, and :meth:`_failed` says why."""
        self._cut = why
        if why == Reason.STALL:
            log.warn(
                "upstream {url} sent nothing for {seconds:g}s in the middle of an answer: ending the attempt",
                url=self._upstream.url, seconds=self._stall,
            )
        if self._pending is not None:
            self._pending.cancel()

    # -- IPushProducer, for the client's transport ----------------------------------------

    # Called by the client's transport, in whatever state it finds the attempt: the table says what each
    # does there.

    def pauseProducing(self) -> None:
        self._side.fire("paused")

    def resumeProducing(self) -> None:
        """Everything written so far has gone out to the client."""
        self._side.fire("resumed")
        self._give_back()
        if self._drained is not None:
            d, self._drained = self._drained, None
            self._unregister()
            d.callback(None)

    def stopProducing(self) -> None:
        """The client's connection is gone: the upstream's work is of no use any more."""
        self._abandon()
        self._side.fire("gone")
        if self._response is not None:
            self._response.stopProducing()  # nothing once the exchange is over

    def _register(self) -> None:
        """Become the producer of a client whose transport is full (it pauses no new producer: we start paused)."""
        try:
            self._request.registerProducer(self, True)
        except Exception:
            # The client is already gone (no channel); the cancel will follow.
            self._side.fire("gone")
            return
        self._side.fire("full")

    def _drop(self, size: int) -> None:
        """Past a buffer bound: raise :class:`ClientTooSlow` into the client (it aborts the upstream)."""
        waiting = self._buffered + size
        assert self._buffers is not None  # only a bounded client drops
        self._abandon()
        self._side.fire("gone")
        raise ClientTooSlow(
            f"the client read too slowly: {waiting} bytes of its answer would wait in the proxy "
            f"(bounds: {self._buffers.per_response} per answer, {self._buffers.total} in all)"
        )

    def _abandon(self) -> None:
        """Stop being the request's producer and return the bytes counted (idempotent)."""
        self._give_back()
        self._unregister()

    def _give_back(self) -> None:
        if self._buffers is not None:
            self._buffers.give_back(self._buffered)
        self._buffered = 0

    def _unregister(self) -> None:
        side = self._side
        registered = side.state
        if side.fire("unregistered") is not registered:
            try:
                self._request.unregisterProducer()
            except Exception:
                pass


def _snippet(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text[:200] if text else "(empty body)"
