"""Control-plane calls to the upstream: health probes, ``/api/ps``, model loads and unloads.

These are the proxy's own small requests, not forwarded traffic, so they get
their own :class:`~twisted.web.client.Agent` on a non-persistent pool (a
probe during an outage must not pick up a stale pooled connection, and the
forwarding pool's limits stay for callers).  Each call has a timeout on the
injected reactor and reads the whole (small) body.  Not treq: its ``json=``
goes through ``FileBodyProducer`` on the global reactor's Cooperator.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers

from .forward import BytesProducer, QuietPool

#: A control call that takes longer than this is given up (unless the caller says otherwise).
DEFAULT_TIMEOUT = 10.0
#: Control answers are small (``/api/ps`` lists a few models); more than this is cut.
MAX_BODY_BYTES = 1024 * 1024


class ControlTimeout(Exception):
    """A control-plane call got no complete answer in time."""


@attrs.frozen
class Answer:
    """The status and body of one control-plane call."""

    code: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.body)


class UpstreamControl:
    """Small JSON calls to the configured upstream, each bounded in time."""

    def __init__(self, reactor, url: str):
        self._reactor = reactor
        self.url = url.rstrip("/")
        self._agent: Agent | None = None

    def _get_agent(self) -> Agent:
        """Built on first use, so building a proxy on a Clock never touches sockets."""
        if self._agent is None:
            pool = QuietPool(self._reactor, persistent=False)
            self._agent = Agent(self._reactor, pool=pool, connectTimeout=DEFAULT_TIMEOUT)
        return self._agent

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = DEFAULT_TIMEOUT
    ) -> Deferred[Answer]:
        """``method path`` with an optional JSON ``body``; fails with :class:`ControlTimeout` after ``timeout``."""
        d = Deferred.fromCoroutine(self._request(method, path, body))

        def timed_out(result, seconds):
            return Failure(ControlTimeout(f"{method} {path}: no answer from {self.url} within {seconds:g}s"))

        return d.addTimeout(timeout, self._reactor, onTimeoutCancel=timed_out)

    async def _request(self, method: str, path: str, body: Any) -> Answer:
        headers = Headers({b"user-agent": [b"yieldproxy"], b"accept": [b"application/json"]})
        producer = None
        if body is not None:
            headers.setRawHeaders(b"content-type", [b"application/json"])
            producer = BytesProducer(json.dumps(body, separators=(",", ":")).encode("utf-8"))
        response = await self._get_agent().request(
            method.encode("ascii"), (self.url + path).encode("utf-8"), headers, producer
        )
        done: Deferred = Deferred(canceller=lambda d: collect.transport and collect.transport.stopProducing())
        collect = _Collect(done)
        response.deliverBody(collect)
        return Answer(response.code, await done)


class _Collect(Protocol):
    """The whole body, up to :data:`MAX_BODY_BYTES` (``readBody`` warns about pool transports)."""

    def __init__(self, done: Deferred):
        self._done = done
        self._parts: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        if self._size < MAX_BODY_BYTES:
            self._parts.append(data[: MAX_BODY_BYTES - self._size])
            self._size += len(data)

    def connectionLost(self, reason) -> None:
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback(b"".join(self._parts))
        else:
            self._done.errback(reason)
