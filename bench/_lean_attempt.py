"""The proxy's upstream attempt on yieldproxy.h1client instead of the Agent: a measurement variant.

Not part of the proxy: ``_proxy_runner.py --client lean`` installs it (it
replaces ``yieldproxy.proxy.Attempt``) so ``latency.py --lean`` can show what
the whole proxy would cost with the lean client, before ``forward.py`` itself
is changed.  It keeps ``forward.Attempt``'s contract: the status relayed, or
:class:`~yieldproxy.forward.RetryableFailure` (nothing reached the client),
:class:`~yieldproxy.forward.RelayBroken` (part of the answer did), or
``CancelledError`` (the client went away); 502/503 and GPU 500s retryable;
the timeout covers the wait for the first byte to the client; the upstream
socket registered as producer on the client's request (backpressure).
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred

from yieldproxy.forward import (
    _ERROR_BODY_LIMIT,
    _NOT_FORWARDED,
    GPU_ERROR,
    HOP_BY_HOP,
    RelayBroken,
    RetryableFailure,
    _snippet,
)
from yieldproxy.h1client import H1Error, H1Pool

_REASONS = {"refused", "connect", "reset", "timeout"}


def _pool(clock, upstream) -> H1Pool:
    """One pool per Upstream, made on first use (the runner's reactor is the clock)."""
    pool = getattr(upstream, "h1", None)
    if pool is None:
        pool = upstream.h1 = H1Pool(clock, upstream.host, upstream.port, max_connections=64)
        upstream.close = pool.close
    return pool


class _Relay:
    """The h1client handler: collects an error body, or relays the answer as it comes."""

    __slots__ = ("attempt", "response", "collect", "parts", "size", "committed", "registered")

    def __init__(self, attempt: "LeanAttempt"):
        self.attempt = attempt
        self.response = None
        self.collect = False
        self.parts: list[bytes] = []
        self.size = 0
        self.committed = False
        self.registered = False

    def response_started(self, response) -> None:
        self.response = response
        code = response.code
        if code >= 500:
            self.collect = True  # read it first: it may be retryable
            return
        try:
            self.attempt._request.registerProducer(response, True)
            self.registered = True
        except Exception:
            pass  # the client is gone; the cancel follows

    def body_received(self, data: bytes) -> None:
        if self.collect:
            if self.size < _ERROR_BODY_LIMIT:
                self.parts.append(data[: _ERROR_BODY_LIMIT - self.size])
                self.size += len(data)
            return
        if not self.committed:
            self.committed = True
            self.attempt._commit(self.response)
        self.attempt._request.write(data)

    def unregister(self) -> None:
        if self.registered:
            self.registered = False
            try:
                self.attempt._request.unregisterProducer()
            except Exception:
                pass


class LeanAttempt:
    """``forward.Attempt`` on h1client (same constructor, same ``run()``)."""

    def __init__(self, clock, upstream, request, body: bytes, timeout: float, extra_headers=(),
                 retry_statuses: bool = True):
        self._clock = clock
        self._upstream = upstream
        self._request = request
        self._body = body
        self._timeout = timeout
        self._extra_headers = extra_headers
        self._retry_statuses = retry_statuses
        self._timer = None
        self._timed_out = False
        self.status: int | None = None

    def run(self) -> Deferred:
        request = self._request
        incoming = request.requestHeaders
        skip = _NOT_FORWARDED
        connection = incoming.getRawHeaders(b"connection")
        if connection:
            skip = skip | {t.strip().lower() for v in connection for t in v.split(b",")}
        headers = [
            (name, value)
            for name, values in incoming.getAllRawHeaders()
            if (lower := name.lower()) not in skip and not lower.startswith(b"x-yield-")
            for value in values
        ]
        relay = _Relay(self)
        d = _pool(self._clock, self._upstream).request(
            request.method, self._upstream.prefix + request.uri, headers, self._body, relay,
        )
        self._timer = self._clock.callLater(self._timeout, self._expire, d)
        return d.addCallbacks(self._done, self._failed, callbackArgs=(relay,), errbackArgs=(relay,))

    def _expire(self, d: Deferred) -> None:
        self._timer = None
        self._timed_out = True
        d.cancel()

    def _disarm(self) -> None:
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def _commit(self, response) -> None:
        """The answer is about to reach the client: no retry and no timeout from here on."""
        self._disarm()
        request = self._request
        self.status = response.code
        request.setResponseCode(response.code, response.phrase)
        skip = HOP_BY_HOP
        connection = response.header_values(b"connection")
        if connection:
            skip = skip | {t.strip().lower() for v in connection for t in v.split(b",")}
        out = request.responseHeaders
        seen = set()  # the upstream's Server and Date replace the site's own; repeats are kept
        for name, value in response.headers:
            lower = name.lower()
            if lower in skip:
                continue
            if lower in seen:
                out.addRawHeader(name, value)
            else:
                seen.add(lower)
                out.setRawHeaders(name, [value])
        for name, value in self._extra_headers:
            out.setRawHeaders(name, [value])

    def _done(self, response, relay: _Relay) -> int:
        relay.unregister()
        self._disarm()
        code = response.code
        if relay.collect:
            body = b"".join(relay.parts)
            if self._retry_statuses and code in (502, 503):
                raise RetryableFailure(f"status_{code}", f"upstream answered {code}: {_snippet(body)}")
            if self._retry_statuses and code == 500 and GPU_ERROR.search(body):
                raise RetryableFailure("gpu_error", f"upstream GPU error: {_snippet(body)}")
            self._commit(response)
            self._request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
            if body:
                self._request.write(body)
            return code
        if not relay.committed:
            relay.committed = True
            self._commit(response)
        return code

    def _failed(self, failure, relay: _Relay):
        relay.unregister()
        self._disarm()
        if failure.check(CancelledError):
            if self._timed_out and not relay.committed:
                raise RetryableFailure("timeout", f"no answer from the upstream within {self._timeout:g}s")
            return failure
        error = failure.value
        url = self._upstream.url
        if relay.committed:
            raise RelayBroken(f"upstream {url} dropped the connection ({type(error).__name__})")
        if isinstance(error, H1Error):
            reason = error.reason if error.reason in _REASONS else "reset"
            raise RetryableFailure(reason, f"upstream {url}: {error}")
        return failure


def install() -> None:
    """Make the proxy forward with :class:`LeanAttempt` (before ``service.build``)."""
    import yieldproxy.proxy

    yieldproxy.proxy.Attempt = LeanAttempt
