"""The upstream hop: one attempt, streamed back to the client with backpressure.

This uses :class:`twisted.web.client.Agent` on a persistent pool rather than
treq: treq follows redirects, adds ``Accept-Encoding`` and decodes bodies,
keeps a cookie jar shared by all callers, and spools large request bodies to
disk.  A proxy must do none of that.

An attempt either relays a whole answer, or fails.  A failure *before the
first byte reached the client* is :class:`RetryableFailure` (the caller may
park the request and try again); a failure after that is :class:`RelayBroken`
and ends the response, never silently replayed.

A replay slot stands for work on the GPU, so an attempt ends when the
*upstream* has finished its answer, not when a slow client has read it: what
the client has not taken yet waits in the proxy's memory, within a bound per
response and a bound in total (:class:`ClientBuffers`); a client past either
bound is dropped (:class:`ClientTooSlow`) instead of pausing the upstream.
"""

from __future__ import annotations

from ipaddress import ip_address
from typing import Callable
from urllib.parse import urlsplit

import attrs

from twisted.internet import error as ierror
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IPushProducer, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.ssl import optionsForClientTLS
from twisted.logger import Logger
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    _HTTP11ClientFactory,
    ResponseDone,
    ResponseFailed,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from .servers.ollama import is_gpu_failure

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
#: Most bytes of an error body read to decide whether it is retryable (the rest is relayed after it).
_ERROR_BODY_LIMIT = 64 * 1024


@attrs.frozen
class UpstreamAnswer:
    """An upstream's whole (small) error answer, kept so it can still be relayed as it was."""

    code: int
    phrase: bytes
    headers: Headers
    body: bytes


class RetryableFailure(Exception):
    """The attempt failed before anything reached the client; it may be retried.

    ``reason`` is a metric label: refused, reset, timeout, status_502,
    status_503, gpu_error.  ``answer`` is the upstream's own answer when it
    gave one (a 5xx), for the caller to relay if it gives up.
    """

    def __init__(self, reason: str, detail: str, answer: UpstreamAnswer | None = None):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.answer = answer


class RelayBroken(Exception):
    """The upstream failed after part of the answer reached the client."""


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
    copy_response_headers(answer.headers, request.responseHeaders)
    request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(answer.body)])
    for name, value in extra_headers:
        request.responseHeaders.setRawHeaders(name, [value])
    return answer.body


def connection_headers(headers: Headers) -> set[bytes]:
    """Hop-by-hop names: the fixed set plus those the Connection header lists."""
    names = set(HOP_BY_HOP)
    for value in headers.getRawHeaders(b"connection", []):
        names.update(token.strip().lower() for token in value.split(b","))
    return names


def upstream_request_headers(incoming: Headers) -> Headers:
    """Copy the client's headers, repeated ones kept, minus hop-by-hop and ours."""
    skip = connection_headers(incoming) | _NOT_FORWARDED
    out = Headers()
    for name, values in incoming.getAllRawHeaders():
        lower = name.lower()
        if lower in skip or lower.startswith(b"x-yield-"):
            continue
        out.setRawHeaders(name, values)
    return out


def copy_response_headers(source: Headers, target: Headers) -> None:
    """Copy the upstream's headers onto the client response, minus hop-by-hop."""
    skip = connection_headers(source)
    for name, values in source.getAllRawHeaders():
        if name.lower() not in skip:
            target.setRawHeaders(name, values)


class _QuietClientFactory(_HTTP11ClientFactory):
    """Twisted logs "Starting factory" for every new pooled connection; we do not."""

    noisy = False


class QuietPool(HTTPConnectionPool):
    """An HTTPConnectionPool that does not log each connection it opens."""

    _factory = _QuietClientFactory


@implementer(IBodyProducer)
class BytesProducer:
    """A request body already in memory, written in one go.

    ``FileBodyProducer`` would cooperate through the global reactor's
    Cooperator and copy in 64 KiB slices for no benefit here.
    """

    def __init__(self, body: bytes):
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer):
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


@implementer(IStreamClientEndpoint)
class _NoDelayEndpoint:
    """Sets TCP_NODELAY on every upstream connection (Nagle adds ~40 ms here)."""

    def __init__(self, wrapped: IStreamClientEndpoint):
        self._wrapped = wrapped

    def connect(self, factory):
        def nodelay(protocol):
            transport = getattr(protocol, "transport", None)
            set_nodelay = getattr(transport, "setTcpNoDelay", None)
            if set_nodelay is not None:
                set_nodelay(True)
            return protocol

        return self._wrapped.connect(factory).addCallback(nodelay)


@implementer(IAgentEndpointFactory)
class _FixedEndpointFactory:
    """Every request goes to the one configured upstream, whatever its URI says."""

    def __init__(self, endpoint: IStreamClientEndpoint):
        self._endpoint = endpoint

    def endpointForURI(self, uri):
        return self._endpoint


def _client_endpoint(reactor, host: str, port: int) -> IStreamClientEndpoint:
    """A plain TCP endpoint for an IP literal; HostnameEndpoint only for names.

    HostnameEndpoint waits its ``attemptDelay`` (0.3 s) before reporting a
    refused connection, which would slow every retry during an outage.
    """
    try:
        address = ip_address(host)
    except ValueError:
        return HostnameEndpoint(reactor, host, port)
    if address.version == 6:
        return TCP6ClientEndpoint(reactor, host, port)
    return TCP4ClientEndpoint(reactor, host, port)


class Upstream:
    """The configured upstream: its base URL and an Agent on a persistent pool."""

    def __init__(self, reactor, url: str, max_connections: int = 64):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/").encode("ascii")
        self._base = f"{parts.scheme}://{parts.netloc}".encode("ascii")
        endpoint = _client_endpoint(reactor, self.host, self.port)
        if parts.scheme == "https":
            endpoint = wrapClientTLS(optionsForClientTLS(self.host), endpoint)
        self.pool = QuietPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = max_connections
        self.agent = Agent.usingEndpointFactory(
            reactor, _FixedEndpointFactory(_NoDelayEndpoint(endpoint)), pool=self.pool
        )

    def uri(self, target: bytes) -> bytes:
        """The upstream URI for a canonical request target (``target.Target.raw``).

        The target has no dot segments (target.py removes them), so it can
        never climb out of the upstream URL's path prefix.
        """
        if not target.startswith(b"/"):
            raise ValueError(f"not a path: {target!r}")
        return self._base + self.prefix + target

    def close(self) -> Deferred:
        return self.pool.closeCachedConnections()


def classify_failure(failure_value: BaseException) -> str | None:
    """The metric reason for a connection-level failure, or None if not retryable."""
    if isinstance(failure_value, ierror.ConnectionRefusedError):
        return "refused"
    if isinstance(failure_value, (ierror.ConnectError, ierror.DNSLookupError)):
        return "connect"
    if isinstance(failure_value, ResponseFailed) or type(failure_value).__name__ in (
        "ResponseNeverReceived",
        "RequestTransmissionFailed",
        "RequestNotSent",
    ):
        return "reset"
    if isinstance(failure_value, (ierror.ConnectionLost, ierror.ConnectionDone)):
        return "reset"
    return None


@implementer(IPushProducer)
class _Relay(Protocol):
    """Streams an upstream body to the client, and never pauses the upstream for it.

    It registers itself (not the upstream's transport) as the client
    request's producer, so a slow client cannot stall the upstream and keep
    its replay slot: the relay only learns when the client's transport is
    full (``pauseProducing``) and when everything written has gone out
    (``resumeProducing``).  What it writes in between waits in memory,
    counted in :class:`ClientBuffers`; past a bound the client is dropped
    (``done`` fails with :class:`ClientTooSlow`) and the upstream stopped.

    It stays the request's producer after the upstream has finished, until
    :meth:`drained` reports that the client has taken the rest.
    """

    def __init__(self, request, commit: Callable[[], None], done: Deferred, buffers: ClientBuffers | None):
        self._request = request
        self._commit = commit
        self._done = done
        self._buffers = buffers
        self.committed = False
        self.client_gone = False
        self.upstream_done = False
        #: Bytes written since the client's transport paused us, counted in ``buffers``.
        self.buffered = 0
        self._registered = False
        self._paused = False
        self._drained: Deferred | None = None

    def connectionMade(self):
        try:
            self._request.registerProducer(self, True)
            self._registered = True
        except Exception:
            # The client is already gone (no channel); the cancel will follow.
            self.client_gone = True
            return
        # A transport that was full before this answer began does not pause a new producer.
        channel = getattr(self._request, "channel", None)
        self._paused = bool(getattr(channel, "_waitingForTransport", False))

    # -- the upstream's body ------------------------------------------------------------

    def dataReceived(self, data: bytes):
        if self.client_gone:
            return
        if not self.committed:
            self.committed = True
            self._commit()
        if self._paused and self._buffers is not None:
            if not self._buffers.take(len(data), self.buffered):
                self._drop(len(data))
                return
            self.buffered += len(data)
        self._request.write(data)

    def connectionLost(self, reason):
        self.upstream_done = True
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            if not self.committed and not self.client_gone:
                self.committed = True
                self._commit()
            self._done.callback(None)
        else:
            self.abandon()
            self._done.errback(reason)

    # -- IPushProducer, for the client's transport ----------------------------------------

    def pauseProducing(self):
        self._paused = True

    def resumeProducing(self):
        """Everything written so far has gone out to the client."""
        self._paused = False
        self._give_back()
        if self._drained is not None:
            d, self._drained = self._drained, None
            self._unregister()
            d.callback(None)

    def stopProducing(self):
        """The client's connection is gone: the upstream's work is of no use any more."""
        self.client_gone = True
        self.abandon()
        if not self.upstream_done and self.transport is not None:
            self.transport.stopProducing()

    # -- for the attempt --------------------------------------------------------------------

    def drained(self) -> Deferred:
        """Fires once the client has taken the whole answer (at once when nothing waits for it)."""
        if self.client_gone or self.buffered == 0:
            self.abandon()
            return succeed(None)
        self._drained = Deferred(canceller=lambda d: self.abandon())
        return self._drained

    def abandon(self) -> None:
        """Stop being the request's producer and return the bytes counted (idempotent)."""
        self._give_back()
        self._unregister()

    def _drop(self, size: int) -> None:
        """Past a buffer bound: fail the attempt with :class:`ClientTooSlow` and stop the upstream."""
        waiting = self.buffered + size
        self.client_gone = True
        self.abandon()
        self._done.errback(
            ClientTooSlow(
                f"the client read too slowly: {waiting} bytes of its answer would wait in the proxy "
                f"(bounds: {self._buffers.per_response} per answer, {self._buffers.total} in all)"
            )
        )
        if self.transport is not None:
            self.transport.stopProducing()

    def _give_back(self) -> None:
        if self._buffers is not None:
            self._buffers.give_back(self.buffered)
        self.buffered = 0

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            try:
                self._request.unregisterProducer()
            except Exception:
                pass


class _Inspect(Protocol):
    """Reads the head of an error body to judge it, then hands the rest to a relay, or drops it.

    ``judged`` fires once ``limit`` bytes arrived or the body ended, whichever
    is first; the upstream is paused until :meth:`hand_over` or :meth:`discard`.
    """

    def __init__(self, limit: int):
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self._next: Protocol | None = None
        self._reason = None
        #: True once the whole body is here.
        self.ended = False
        self.judged: Deferred = Deferred(canceller=lambda d: self.discard())

    def body(self) -> bytes:
        """What was read (the whole body when :attr:`ended`)."""
        return b"".join(self._parts)

    def dataReceived(self, data: bytes):
        if self._next is not None:
            self._next.dataReceived(data)
            return
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._limit and not self.judged.called:
            self.transport.pauseProducing()
            self.judged.callback(self)

    def connectionLost(self, reason):
        if self._next is not None:
            self._next.connectionLost(reason)
            return
        self.ended = True
        self._reason = reason
        if not self.judged.called:
            if reason.check(ResponseDone, PotentialDataLoss) or self._parts:
                self.judged.callback(self)
            else:
                self.judged.errback(reason)

    def hand_over(self, relay: Protocol) -> None:
        """The body goes on to ``relay``: what was read first, then the rest as it comes."""
        relay.makeConnection(self.transport)
        self._next = relay
        head = self.body()
        self._parts = []
        if head:
            relay.dataReceived(head)
        if self.ended:
            relay.connectionLost(self._reason)
        else:
            self.transport.resumeProducing()

    def discard(self) -> None:
        """The rest is not wanted: close the upstream connection rather than read it."""
        if not self.ended and self.transport is not None:
            self.transport.stopProducing()


class Attempt:
    """One try at sending a request upstream and relaying its answer.

    ``run()`` returns a Deferred firing with the status code relayed once the
    *upstream* has finished its answer, or failing with
    :class:`RetryableFailure`, :class:`RelayBroken`, :class:`ClientTooSlow`
    or ``CancelledError`` (the client went away).  The attempt timeout covers
    the wait for the first byte only: a long stream, once flowing, is not cut.
    After a success, :meth:`client_drained` fires when the client has read
    the rest; the request must not be finished before.
    """

    def __init__(
        self,
        clock: IReactorTime,
        upstream: Upstream,
        request,
        body: bytes,
        timeout: float,
        extra_headers: list[tuple[bytes, bytes]] = (),
        retry_statuses: bool = True,
        buffers: ClientBuffers | None = None,
        *,
        target: bytes,
    ):
        self._clock = clock
        #: The canonical request target forwarded (the one the class was decided on).
        self._target = target
        self._upstream = upstream
        self._request = request
        self._body = body
        self._timeout = timeout
        self._extra_headers = extra_headers
        self._retry_statuses = retry_statuses
        self._buffers = buffers
        self._timed_out = False
        self._timer = None
        self._pending: Deferred | None = None
        self._relay: _Relay | None = None
        self.status: int | None = None

    def run(self) -> Deferred:
        return Deferred.fromCoroutine(self._run())

    def client_drained(self) -> Deferred:
        """After a success: fires once the client has taken the whole answer."""
        if self._relay is None:
            return succeed(None)
        return self._relay.drained()

    def _arm(self) -> None:
        self._timer = self._clock.callLater(self._timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self._timed_out = True
        if self._pending is not None:
            self._pending.cancel()

    async def _await(self, d: Deferred):
        """Wait on ``d`` so the attempt timeout can cancel it.

        A cancelled Agent request fails with ``ResponseNeverReceived`` wrapping
        the CancelledError, not with CancelledError itself, hence the flag.
        """
        self._pending = d
        try:
            return await d
        except Exception as e:
            if self._timed_out:
                raise RetryableFailure(
                    "timeout", f"no answer from the upstream within {self._timeout:g}s"
                ) from None
            if _was_cancelled(e):
                raise CancelledError("the client went away") from None
            raise
        finally:
            self._pending = None

    async def _run(self) -> int:
        request = self._request
        method = request.method
        producer = BytesProducer(self._body) if (self._body or method in (b"POST", b"PUT", b"PATCH")) else None
        self._arm()
        try:
            try:
                response: IResponse = await self._await(
                    self._upstream.agent.request(
                        method,
                        self._upstream.uri(self._target),
                        upstream_request_headers(request.requestHeaders),
                        producer,
                    )
                )
            except (RetryableFailure, CancelledError):
                raise
            except Exception as e:
                reason = classify_failure(e)
                if reason is None:
                    raise
                raise RetryableFailure(reason, _describe(e, self._upstream.url)) from None

            code = response.code
            relay_from = response
            if code >= 500 or (self._retry_statuses and code == 400):
                head = await self._inspect(response)
                body = head.body()
                if self._retry_statuses:
                    answer = UpstreamAnswer(code, response.phrase, response.headers, body) if head.ended else None
                    if code in (502, 503):
                        head.discard()
                        raise RetryableFailure(f"status_{code}", f"upstream answered {code}: {_snippet(body)}", answer)
                    if head.ended and is_gpu_failure(code, body):
                        raise RetryableFailure("gpu_error", f"upstream GPU failure: {_snippet(body)}", answer)
                if head.ended:
                    # A whole (small) answer: relayed as it is, with its true length.
                    self._disarm()
                    self._commit(response)
                    request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
                    if body:
                        request.write(body)
                    return code
                # Longer than what was read to judge it: relayed whole, that part first.
                relay_from = head

            done = Deferred(canceller=lambda d: relay.transport and relay.transport.stopProducing())
            relay = self._relay = _Relay(request, lambda: self._first_byte(response), done, self._buffers)
            if relay_from is response:
                response.deliverBody(relay)
            else:
                relay_from.hand_over(relay)
            try:
                await self._await(done)
            except Exception as e:
                relay.abandon()
                if isinstance(e, (RetryableFailure, CancelledError, ClientTooSlow)):
                    # A timeout can only fire before the first byte (it is disarmed then).
                    raise
                if relay.committed:
                    raise RelayBroken(_describe(e, self._upstream.url)) from None
                raise RetryableFailure("reset", _describe(e, self._upstream.url)) from None
            return code
        finally:
            self._disarm()

    def _first_byte(self, response: IResponse) -> None:
        """The answer is about to reach the client: from here on, no retry and no timeout."""
        self._disarm()
        self._commit(response)

    def _commit(self, response: IResponse) -> None:
        self.status = response.code
        self._request.setResponseCode(response.code, response.phrase)
        copy_response_headers(response.headers, self._request.responseHeaders)
        # The Agent moves the upstream's Content-Length into response.length;
        # put it back, or every answer would go out chunked.
        if isinstance(response.length, int) and self._request.method != b"HEAD":
            self._request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % response.length])
        for name, value in self._extra_headers:
            self._request.responseHeaders.setRawHeaders(name, [value])

    async def _inspect(self, response: IResponse) -> _Inspect:
        """The head of an error body (all of it when short), the upstream paused after it."""
        inspect = _Inspect(_ERROR_BODY_LIMIT)
        response.deliverBody(inspect)
        try:
            return await self._await(inspect.judged)
        except (RetryableFailure, CancelledError):
            raise
        except Exception:
            # The connection ended before any of the body came: an empty body.
            return inspect


def _was_cancelled(e: BaseException) -> bool:
    """True for a CancelledError, bare or wrapped by the HTTP client's failure types."""
    if isinstance(e, CancelledError):
        return True
    return any(f.check(CancelledError) for f in getattr(e, "reasons", None) or [])


def _snippet(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text[:200] if text else "(empty body)"


def _describe(e: BaseException, url: str) -> str:
    """A sentence about a connection failure, naming the upstream."""
    if isinstance(e, ierror.ConnectionRefusedError):
        return f"upstream {url} refused the connection"
    if isinstance(e, ierror.DNSLookupError):
        return f"upstream {url}: host name not found"
    if isinstance(e, ierror.ConnectError):
        return f"upstream {url} unreachable: {e}"
    reasons = getattr(e, "reasons", None)
    if reasons:
        inner = reasons[0].value
        return f"upstream {url} dropped the connection ({type(inner).__name__})"
    return f"upstream {url} failed: {type(e).__name__}"
