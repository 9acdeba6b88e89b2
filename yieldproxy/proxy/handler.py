"""The proxy listener's application: the Klein app, its one route, its site and the listener's refusals.

The listener (:class:`~yieldproxy.edge.site.ProxySite`) hands each request
to the Klein app here, whose one route hands it to :meth:`ProxyApp._handle`
(proxy/resource.py) and whose error handler answers what it cannot route.
When the client goes away the listener's request cancels the handler's
Deferred (edge/request.py, ``connectionLost``).  The rooms it hands a
request to: docs/architecture.md, "The proxy app".
"""

from __future__ import annotations

from types import CoroutineType
from typing import Callable

import attrs
from klein import Klein
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import IResource
from werkzeug.exceptions import NotFound

from ..config import Config, proxy_max_connections
from ..edge.capacity import Connections
from ..edge.hosts import HostPolicy
from ..edge.request import RECEIVING_RETRY_AFTER, receiving_full_message
from ..edge.site import ProxySite
from ..errors import listener_error_body
from ..lot.classify import PASSTHROUGH, api_family
from ..lot.parking import Entry
from ..observe.metrics import Metrics
from ..observe.requestlog import log_request
from ..schedule.scheduler import Scheduler
from ..upstream.attempt import ClientBuffers
from ..upstream.pool.member import Member
from .admission import Admission
from .attempts import AttemptLoop
from .facts import RequestFacts
from .outcome import Outcomes
from .passthrough import Passthrough
from .resource import HandlerResource, KleinEntry, asks_no_klein_request
from .target import BadTarget, parse_target


@attrs.define(eq=False)
class ProxyApp:
    """What the proxy listener does with a request (its resource: :meth:`resource`)."""

    _clock: IReactorTime
    _config: Config
    #: The upstreams: each attempt runs on a member, reported to its health (reachability, outage verdicts).
    _scheduler: Scheduler
    _metrics: Metrics
    #: Told of every attempt as it ends: ``(member, entry, outcome)`` (the ``[fallback]`` counts its own).
    _on_attempt: Callable[[Member, Entry, str], None] = lambda member, entry, outcome: None
    #: The listener's open connections and their cap (one count for every site built here).
    connections: Connections = attrs.field(init=False)
    #: Requests being adopted from the process this one replaced, by channel (see :meth:`adopt`).
    _carried: dict = attrs.field(init=False, factory=dict)
    _outcomes: Outcomes = attrs.field(init=False)
    _admission: Admission = attrs.field(init=False)

    app = Klein()

    def __attrs_post_init__(self) -> None:
        proxy = self._config.proxy
        buffers = ClientBuffers(
            proxy.slow_client_buffer_bytes, proxy.slow_client_buffer_total_bytes,
            on_change=self._metrics.client_buffered_bytes.set,
        )
        self.connections = Connections(
            proxy_max_connections(self._config), "proxy.max_connections", max_receiving_bytes=proxy.max_receiving_bytes,
        )
        self._outcomes = outcomes = Outcomes(self._clock, self._metrics, self._scheduler)
        attempts = AttemptLoop(
            self._clock, self._config, self._scheduler, self._metrics, outcomes, buffers, self._on_attempt
        )
        passthrough = Passthrough(self._clock, self._config, self._scheduler, outcomes, buffers)
        self._admission = Admission(
            self._config, self._scheduler, self._metrics, outcomes, attempts.run, passthrough.run
        )

    #: What the one route answers: the leaf that runs the handler once Klein has routed (proxy/resource.py).
    _entry: HandlerResource = attrs.field(
        init=False, default=attrs.Factory(lambda app: HandlerResource(app._handle, app._internal_error), takes_self=True)
    )

    # Every path, as two plain routes rather than one branch route: Klein runs a branch route through
    # its request adapter (``IKleinRequest``) on every request, work the proxy's route has no use for.
    @app.route("/", strict_slashes=False, endpoint="proxy_root")
    @app.route("/<path:path>", strict_slashes=False, endpoint="proxy")
    @asks_no_klein_request
    def proxy(self, request, path: str = ""):
        return self._entry

    @app.handle_errors(NotFound)
    def unroutable(self, request, failure):
        """A path Klein's router cannot match (a decoded line break): a 400 in JSON, not its HTML 404."""
        try:
            parse_target(request.uri)
            why = "request path cannot be routed"
        except BadTarget as e:
            why = str(e)
        return self._refuse_now(request, api_family(request.path), 400, "bad_request", why)

    def resource(self) -> IResource:
        """The listener's resource: the Klein app, the one entry of every request (proxy/resource.py)."""
        return KleinEntry(self.app)

    def site(self) -> ProxySite:
        proxy = self._config.proxy
        return ProxySite(
            self.resource(),
            proxy.max_body_bytes,
            request_read_timeout=proxy.request_read_timeout_seconds,
            timeout=proxy.keepalive_timeout_seconds,
            stall_timeout=proxy.idle_timeout_seconds,
            connections=self.connections,
            host_policy=HostPolicy.from_config("proxy.allowed_hosts", proxy.allowed_hosts),
            oversized=self.refuse_oversized,
            receiving_full=self.refuse_receiving,
            error_body=listener_error_body,
            on_refused=self._refused_by_listener,
            reactor=self._clock,
        )

    def adopt(self, channel, carried, connection: dict, data: bytes) -> None:
        """A parked request handed over by the process this one replaced (lifecycle/succession/): its connection
        (``channel``, adopted) is taken up as it was there (``connection``: edge/connection.py's
        ``snapshot``), ``data`` (the request as its client sent it) is read on it as any request is, and
        ``carried`` gives it back its class, its place in line, its arrival and its deadline."""
        self._carried[channel] = carried
        try:
            channel.resume(connection, data)
        finally:
            self._carried.pop(channel, None)

    def _handle(self, request):
        """The answer decided at once (the error body, set on ``request``), or the coroutine that finds it.

        Not a coroutine itself: a parked request then holds one coroutine
        frame (the attempt loop's), not two.  An answer given now is written
        out here; a coroutine writes its own where it ends.
        """
        facts = request.facts = RequestFacts(self._clock.seconds())
        carried = self._carried.pop(request.channel, None) if self._carried else None
        answer = self._admission.admit(request, facts, carried)
        if not isinstance(answer, CoroutineType):
            self._outcomes.close(request, facts)
        return answer

    # -- the listener's own answers ---------------------------------------------

    def _refuse_now(self, request, api: str, status: int, reason: str, message: str, **kw) -> bytes:
        """An answer given outside the handler's life (the listener's, a bug's), its outcome written at once."""
        facts = self._new_facts(request)
        answer = self._outcomes.refuse(request, facts, api, status, reason, message, **kw)
        self._outcomes.close(request, facts)
        return answer

    def _new_facts(self, request) -> RequestFacts:
        """A fresh record for an answer given outside the handler's life; a bug's keeps the request's arrival
        and the member it went to."""
        known: RequestFacts | None = getattr(request, "facts", None)
        facts = request.facts = RequestFacts(self._clock.seconds())
        if known is not None:
            facts.started_at, facts.served_by, facts.translated_by = known.started_at, known.served_by, known.translated_by
        return facts

    def _internal_error(self, request) -> bytes:
        """A bug's answer (its traceback is logged): a 500 in the API's shape, counted and logged once."""
        return self._refuse_now(
            request, api_family(request.path), 500, "error", "the proxy failed on this request (see its log)"
        )

    def _refused_by_listener(self, request, status: int, code: str) -> None:
        """A request the listener answered itself (a bad Host, CONNECT...): its request log line."""
        now = self._clock.seconds()
        log_request(request, PASSTHROUGH, status, code, 0.0, 0, now, self._clock)

    def refuse_oversized(self, request) -> bytes:
        """The answer to a body over ``proxy.max_body_bytes`` that the HTTP layer stopped reading."""
        try:
            target = parse_target(request.uri)
        except BadTarget as e:
            return self._refuse_now(request, api_family(request.path), 400, "bad_request", str(e))
        facts = self._new_facts(request)
        answer = self._admission.too_large(request, facts, api_family(target.api_path))
        self._outcomes.close(request, facts)
        return answer

    def refuse_receiving(self, request) -> bytes:
        """The answer to a body the HTTP layer stopped reading: ``proxy.max_receiving_bytes`` is used up."""
        return self._refuse_now(
            request, api_family(request.path), 503, "receiving_full",
            receiving_full_message(self.connections), retry_after=RECEIVING_RETRY_AFTER,
        )
