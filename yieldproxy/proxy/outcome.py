"""How a request ends: its answer in the API's shape, and its outcome written once.

:meth:`Outcomes.close` is the one writer of ``requests_total``, a parked request's ``replay_total``
and the request log line (docs/metrics.md), from the request's :class:`~yieldproxy.proxy.facts.RequestFacts`.
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ..errors import stream_error_chunk, write_error
from ..observe.metrics import Metrics
from ..observe.requestlog import CLIENT_GONE, log_request
from ..schedule.scheduler import Scheduler
from ..servers import Refusal
from ..upstream.attempt import ClientTooSlow, RelayBroken
from ..upstream.verdict import Reason
from .facts import HANDED_OVER, RequestFacts

log = Logger()

#: The refusals counted in ``rejected_total`` by the proxy app (the scheduler counts its own).
_COUNTED = frozenset(("too_large", "bad_request", "receiving_full"))


def peer_host(request: Any) -> str | None:
    peer = request.getClientAddress()
    return getattr(peer, "host", None)


def write_refusal(request: Any, refused: Refusal) -> bytes:
    """Set ``request`` up to answer as the upstream would (status, headers, body byte for byte)."""
    request.setResponseCode(refused.status)
    headers = request.responseHeaders
    if refused.content_type is not None:
        headers.setRawHeaders(b"content-type", [refused.content_type])
    for name, value in refused.headers:
        headers.setRawHeaders(name, [value])
    # An explicit length: a bodiless answer gets no Content-Type of Twisted's own either.
    headers.setRawHeaders(b"content-length", [b"%d" % len(refused.body)])
    return refused.body


@attrs.define(eq=False)
class Outcomes:
    """The proxy's answers of its own, and the one place a request's outcome is counted and logged."""

    _clock: IReactorTime
    _metrics: Metrics
    _scheduler: Scheduler
    #: Metric children by (metric, labels): see :meth:`child`.
    _children: dict = attrs.field(init=False, factory=dict)

    def child(self, metric, *labels):
        """``metric.labels(*labels)``, looked up once: ``labels()`` costs a lock and a few objects each call.

        For the metrics every request touches; the label sets are few (classes, status codes).
        """
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels)
        return child

    def close(self, request: Any, facts: RequestFacts) -> None:
        """Count and log how the request ended, as it said (:meth:`RequestFacts.say`, :meth:`RequestFacts.gone`), once.

        Called where its life ends (a ``finally``), or as soon as its answer
        is over when it still waits for its connection to go.
        """
        if facts.written or facts.outcome is None or facts.outcome == HANDED_OVER:
            return  # written already, nothing said (a bug: the resource's error handler answers), or not ours
        facts.written = True
        entry = facts.entry
        if entry is not None and entry.was_parked:
            self._metrics.replay_total.labels(entry.cls, facts.replay or facts.outcome).inc()
        status = facts.status
        self.child(self._metrics.requests_total, facts.cls, str(CLIENT_GONE if status is None else int(status))).inc()
        log_request(
            request, facts.cls, status, facts.outcome, entry.parked_seconds if entry is not None else 0.0,
            facts.attempts, facts.started_at, self._clock, served_by=facts.served_by, translated_by=facts.translated_by,
        )

    def refuse(
        self, request: Any, facts: RequestFacts, api: str, status: int, reason: str, message: str,
        retry_after: float | None = None, attempts: int = 0,
    ) -> bytes:
        """The proxy's own error answer in the API's shape (its body), said on ``facts``."""
        if reason in _COUNTED:
            self._metrics.rejected_total.labels(facts.cls, reason).inc()
        if status in (429, 503) and retry_after is None:
            retry_after = self._scheduler.retry_after()
        facts.say(status, reason, attempts)
        return write_error(request, api, status, message, reason, retry_after)

    async def broken(self, request: Any, facts: RequestFacts, api: str, broken: RelayBroken, attempts: int) -> None:
        """The upstream failed mid-answer (a stall counts as an upstream failure): end a stream in its own
        error form, else close what was sent (docs/admin-api.md, "When the upstream fails mid-answer").

        A clean close, never a reset, which would lose the status line still in the buffers.
        """
        if broken.reason == Reason.STALL:
            self._metrics.upstream_failures_total.labels(facts.cls, Reason.STALL).inc()
        facts.say(request.code, "upstream_error", attempts)
        self.close(request, facts)
        why = str(broken)
        log.warn(
            "{method} {path}: upstream failed mid-answer: {why}",
            method=request.method.decode("latin-1"), path=request.path.decode("latin-1"), why=why,
        )
        headers = request.responseHeaders
        content_type = (headers.getRawHeaders(b"content-type") or [b""])[0]
        chunk = stream_error_chunk(content_type, api, f"upstream failed mid-answer: {why}")
        if request.channel is None:
            return None  # the client is gone already
        if chunk is not None and not headers.hasHeader(b"content-length"):
            request.write(chunk)
            request.channel.persistent = False  # closed once the request is finished
            return None
        request.loseConnection()
        await Deferred()  # The listener cancels this when the connection is gone (edge/request.py).

    async def drop_slow_client(self, request: Any, facts: RequestFacts, slow: ClientTooSlow, attempts: int) -> None:
        """Past a buffer bound: cut the client (the upstream is stopped already), count it as gone (499)."""
        self._metrics.slow_clients_dropped_total.labels(facts.cls).inc()
        log.warn("dropping a slow {cls} client {peer}: {why}", cls=facts.cls, peer=peer_host(request), why=str(slow))
        facts.say(None, "slow_client", attempts, replay="abandoned")
        self.close(request, facts)
        if request.channel is not None:
            request.channel.transport.abortConnection()
        await Deferred()  # The listener cancels this when the connection is gone (edge/request.py).
