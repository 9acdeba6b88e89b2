"""The upstream hop: one attempt, streamed back to the client with backpressure.

This uses :class:`twisted.web.client.Agent` on a persistent pool rather than
treq: treq follows redirects, adds ``Accept-Encoding`` and decodes bodies,
keeps a cookie jar shared by all callers, and spools large request bodies to
disk.  A proxy must do none of that.

An attempt either relays a whole answer, or fails.  A failure *before the
first byte reached the client* is :class:`RetryableFailure` (the caller may
park the request and try again); a failure after that is :class:`RelayBroken`
and ends the response, never silently replayed.
"""

from __future__ import annotations

import re
from ipaddress import ip_address
from typing import Callable
from urllib.parse import urlsplit

from twisted.internet import error as ierror
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.ssl import optionsForClientTLS
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
#: An Ollama 500 that means "the GPU went away", not "your request is wrong".
GPU_ERROR = re.compile(rb"cuda|gpu|runner|out of memory|rocm|metal|vram|no compatible", re.I)
#: Most bytes of an error body read to decide whether it is retryable.
_ERROR_BODY_LIMIT = 64 * 1024


class RetryableFailure(Exception):
    """The attempt failed before anything reached the client; it may be retried.

    ``reason`` is a metric label: refused, reset, timeout, status_502,
    status_503, gpu_error.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class RelayBroken(Exception):
    """The upstream failed after part of the answer reached the client."""


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


class _Relay(Protocol):
    """Streams an upstream body to the client; the upstream pauses when the client is slow."""

    def __init__(self, request, commit: Callable[[], None], done: Deferred):
        self._request = request
        self._commit = commit
        self._done = done
        self.committed = False
        self.client_gone = False
        self._registered = False

    def connectionMade(self):
        try:
            self._request.registerProducer(self.transport, True)
            self._registered = True
        except Exception:
            # The client is already gone (no channel); the cancel will follow.
            self.client_gone = True

    def dataReceived(self, data: bytes):
        if self.client_gone:
            return
        if not self.committed:
            self.committed = True
            self._commit()
        self._request.write(data)

    def connectionLost(self, reason):
        if self._registered:
            self._registered = False
            try:
                self._request.unregisterProducer()
            except Exception:
                pass
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            if not self.committed and not self.client_gone:
                self.committed = True
                self._commit()
            self._done.callback(None)
        else:
            self._done.errback(reason)


class _Collect(Protocol):
    """Reads up to a limit of a (small) error body."""

    def __init__(self, done: Deferred, limit: int):
        self._done = done
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def dataReceived(self, data):
        if self._size < self._limit:
            self._parts.append(data[: self._limit - self._size])
            self._size += len(data)

    def connectionLost(self, reason):
        if reason.check(ResponseDone, PotentialDataLoss) or self._parts:
            self._done.callback(b"".join(self._parts))
        else:
            self._done.errback(reason)


class Attempt:
    """One try at sending a request upstream and relaying its answer.

    ``run()`` returns a Deferred firing with the status code relayed, or
    failing with :class:`RetryableFailure`, :class:`RelayBroken` or
    ``CancelledError`` (the client went away).  The attempt timeout covers the
    wait for the first byte only: a long stream, once flowing, is not cut.
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
        self._timed_out = False
        self._timer = None
        self._pending: Deferred | None = None
        self.status: int | None = None

    def run(self) -> Deferred:
        return Deferred.fromCoroutine(self._run())

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
            if self._retry_statuses and code in (502, 503):
                body = await self._read_error(response)
                raise RetryableFailure(f"status_{code}", f"upstream answered {code}: {_snippet(body)}")
            if code >= 500:
                body = await self._read_error(response)
                if self._retry_statuses and code == 500 and GPU_ERROR.search(body):
                    raise RetryableFailure("gpu_error", f"upstream GPU error: {_snippet(body)}")
                self._disarm()
                self._commit(response)
                request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
                if body:
                    request.write(body)
                return code

            done = Deferred(canceller=lambda d: relay.transport and relay.transport.stopProducing())
            relay = _Relay(request, lambda: self._first_byte(response), done)
            response.deliverBody(relay)
            try:
                await self._await(done)
            except (RetryableFailure, CancelledError):
                # A timeout can only fire before the first byte (it is disarmed then).
                raise
            except Exception as e:
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

    async def _read_error(self, response: IResponse) -> bytes:
        done: Deferred = Deferred()
        response.deliverBody(_Collect(done, _ERROR_BODY_LIMIT))
        try:
            return await self._await(done)
        except RetryableFailure:
            raise
        except CancelledError:
            raise
        except Exception:
            return b""


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
