"""The proxy listener's request handling: classify, gate, park, and forward to a pool member.

The listener (:class:`~yieldproxy.edge.site.ProxySite`) hands each request
to the Klein app here, whose one route hands it to :meth:`ProxyApp._handle`
(proxy/resource.py) and whose error handler answers what it cannot route.
When the client goes away the listener's request cancels the handler's
Deferred (edge/request.py, ``connectionLost``).

Each request ends in exactly one outcome: relayed from the upstream, or an
explicit error in its API's shape (400/413/502/503/504...).  A client that
goes away while parked leaves the lot at once and is never sent upstream.

With a pool of upstreams (upstream/pool/routing.py) each attempt runs on the member
the gate or a member's drainer chose; a retryable failure sends the request
back to its place in the lot, where another eligible member may take it;
once bytes reach the client it never moves.
"""

from __future__ import annotations

import math
from typing import Callable

import attrs
from klein import Klein
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.resource import IResource
from werkzeug.exceptions import NotFound

from ..config import Config, proxy_max_connections
from ..edge.capacity import Connections
from ..edge.hosts import HostPolicy
from ..edge.request import RECEIVING_RETRY_AFTER, receiving_full_message
from ..edge.site import ProxySite
from ..errors import listener_error_body, stream_error_chunk, write_error
from ..lot.classify import (
    MODEL_LOADING_PATHS,
    PASSTHROUGH,
    UNLOAD_PATHS,
    BadBody,
    Classifier,
    api_family,
    header_class,
    is_loopback,
    is_unload,
)
from ..lot.gate import Gate
from ..lot.parking import LEFT, Entry, HandedOver, Refused
from ..observe.metrics import Metrics
from ..observe.requestlog import CLIENT_GONE, log_request
from ..servers import Asked, ModelCall, Origins, Refusal, refusal
from ..servers.gojson import FULL_READ_LIMIT, find_model, read_request, scan_model
from ..servers.ollama import allowed_origins
from ..upstream.attempt import (
    Attempt,
    ClientBuffers,
    ClientTooSlow,
    RelayBroken,
    RetryableFailure,
    UpstreamAnswer,
    write_answer,
)
from ..upstream.pool.lists import UNION_PATHS, union_list
from ..upstream.pool.member import Member
from ..upstream.pool.members import answer_headers, served_outcome
from ..upstream.pool.rename import renamed_body
from ..upstream.pool.routing import Pool
from ..upstream.served import MANAGEMENT_PATHS, redefined_by
from ..upstream.translated_attempt import TranslatedAttempt
from ..upstream.translation import Untranslatable, parse_request
from ..upstream.verdict import Facts, Reason, Verdict, gateway_status, judged_later, reported, slows_replay, verdict
from .resource import HandlerResource, KleinEntry, routed
from .target import BadTarget, Target, parse_target

log = Logger()

#: Bodies larger than this are not read for the unload idiom during a yield.
_UNLOAD_BODY_LIMIT = 4096
#: :meth:`ProxyApp._after_failure`'s answer when the request goes round again.
_RETRY = object()


def failed_call(target: Target, body: bytes) -> ModelCall | None:
    """What a failed model call was (route and model), so the outage probe can test the same kind.

    The route is the canonical path the request was classified and forwarded
    on; the model is the one Ollama's Go decoder reads (:func:`gojson.find_model`:
    a large body is scanned, not parsed whole).  None when the body names no
    model: the probe is then the health path.
    """
    try:
        model = find_model(body)
    except BadBody:
        return None
    return ModelCall(target.path, model) if model else None


def _model_of(body: bytes) -> str | None:
    """The model a body names, read as Ollama's Go decoder reads it; None when none (or not JSON)."""
    if not body:
        return None
    try:
        model = find_model(body)
    except BadBody:
        return None
    return model if isinstance(model, str) and model else None


def _translatable(path: str, body: bytes) -> bool:
    """Whether an embedding request's body can be served translated with the same meaning."""
    try:
        parse_request(path, body)
    except Untranslatable:
        return False
    return True


def _write_refusal(request, refused: Refusal) -> bytes:
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


def _unloads(method: bytes, path: str, body: bytes) -> bool:
    """Whether a request answered 2xx was an unload (it loaded nothing, so it shows nothing about the GPU)."""
    if path not in UNLOAD_PATHS or len(body) > _UNLOAD_BODY_LIMIT:
        return False
    try:
        return is_unload(method.decode("latin-1"), path, read_request(body))
    except BadBody:
        return False


def _no_verdict(value: object, timeout: float) -> None:
    """The outage verdict was not in within the caller's budget: none (the verdict then counts it out of time)."""
    return None


def _bound_spent(entry: Entry, now: float) -> str:
    """"its hold bound (...) is spent" when a request's wait bound is spent at ``now``, else ""."""
    if entry.deadline is None or entry.first_parked is None or now < entry.deadline:
        return ""
    if entry.bound_by_caller:
        return f"your X-Yield-Max-Wait ({entry.max_wait:g}s) is spent"
    return f"its hold bound ({entry.deadline - entry.first_parked:g}s for {entry.cls} requests) is spent"


def _managed(member: Member, path: str, body: bytes) -> None:
    """A model-management call was answered 2xx: the model it defined anew loses its standing in the record
    of what ``member`` served, the one it deleted leaves it (upstream/served.py)."""
    redefined, deleted = redefined_by(path, body)
    if redefined is not None:
        member.health.record.redefined(redefined)
    if deleted is not None:
        member.health.record.deleted(deleted)


def _peer_host(request) -> str | None:
    peer = request.getClientAddress()
    return getattr(peer, "host", None)


def _head_size(request) -> int:
    """Bytes of the request line and header lines: held in memory while parked, like the body."""
    size = len(request.method) + len(request.uri) + len(request.clientproto) + 4
    for name, values in request.requestHeaders.getAllRawHeaders():
        for value in values:
            size += len(name) + len(value) + 4
    return size + 2


@attrs.define(eq=False)
class ProxyApp:
    """What the proxy listener does with a request (its resource: :meth:`resource`)."""

    _clock: IReactorTime
    _config: Config
    _gate: Gate
    #: The upstreams: each attempt runs on a member, reported to its health (reachability, outage verdicts).
    _pool: Pool
    _metrics: Metrics
    #: Told of every attempt as it ends: ``(member, entry, outcome)`` (the ``[fallback]`` counts its own).
    _on_attempt: Callable[[Member, Entry, str], None] = lambda member, entry, outcome: None
    _classifier: Classifier = attrs.field(init=False)
    #: Answers waiting in memory for slow clients (proxy.slow_client_buffer_*).
    _buffers: ClientBuffers = attrs.field(init=False)
    #: The listener's open connections and their cap (one count for every site built here).
    connections: Connections = attrs.field(init=False)
    #: Metric children by (metric, labels): see :meth:`_child`.
    _children: dict = attrs.field(init=False, factory=dict)
    #: Requests being adopted from the process this one replaced, by channel (see :meth:`adopt`).
    _carried: dict = attrs.field(init=False, factory=dict)
    #: What the upstreams' own refusal rules need (:meth:`_refused_by_upstream`): their apis, the
    #: origins their CORS checks allow, the Host each receives.
    _apis: tuple[str, ...] = attrs.field(init=False)
    _origins: Origins = attrs.field(init=False)
    _upstream_hosts: frozenset[str] = attrs.field(init=False)

    app = Klein()

    def __attrs_post_init__(self) -> None:
        # Routes are classed by the servers of the pool's members (config order); a config without
        # [[upstreams]] keeps Ollama's table, as a single upstream always had.
        apis = tuple(dict.fromkeys(m.api for m in self._config.upstreams)) or ("ollama",)
        self._classifier = Classifier.from_rules(self._config.routes, self._config.proxy.unknown_route_class, apis)
        self._apis = apis
        self._origins = allowed_origins(self._config.proxy.allowed_origins)
        self._upstream_hosts = frozenset(
            m.upstream.host_header for m in self._pool.members if getattr(m.upstream, "host_header", None)
        )
        self._buffers = ClientBuffers(
            self._config.proxy.slow_client_buffer_bytes,
            self._config.proxy.slow_client_buffer_total_bytes,
            on_change=self._metrics.client_buffered_bytes.set,
        )
        self.connections = Connections(
            proxy_max_connections(self._config), "proxy.max_connections",
            max_receiving_bytes=self._config.proxy.max_receiving_bytes,
        )

    #: What the one route answers: the leaf that runs the handler once Klein has routed (proxy/resource.py).
    _entry: HandlerResource = attrs.field(
        init=False, default=attrs.Factory(lambda app: HandlerResource(app._handle, app._internal_error), takes_self=True)
    )

    @app.route("/", branch=True, strict_slashes=False)
    def proxy(self, request):
        return routed(request, self._entry)

    @app.handle_errors(NotFound)
    def unroutable(self, request, failure):
        """A path Klein's router cannot match (a decoded line break): a 400 in JSON, not its HTML 404."""
        request.started_at = self._clock.seconds()
        try:
            parse_target(request.uri)
            why = "request path cannot be routed"
        except BadTarget as e:
            why = str(e)
        return self._reject(request, PASSTHROUGH, api_family(request.path), 400, "bad_request", why)

    def resource(self) -> IResource:
        """The listener's resource: the Klein app, the one entry of every request (proxy/resource.py)."""
        return KleinEntry(self.app)

    def _internal_error(self, request) -> bytes:
        """A bug's answer (its traceback is logged): a 500 in the API's shape, counted and logged once."""
        api = api_family(request.path)
        return self._reject(request, PASSTHROUGH, api, 500, "error", "the proxy failed on this request (see its log)")

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

    def _refused_by_listener(self, request, status: int, code: str) -> None:
        """A request the listener answered itself (a bad Host, CONNECT...): its request log line."""
        now = self._clock.seconds()
        log_request(request, PASSTHROUGH, status, code, 0.0, 0, now, self._clock)

    def refuse_oversized(self, request) -> bytes:
        """The answer to a body over ``proxy.max_body_bytes`` that the HTTP layer stopped reading."""
        request.started_at = self._clock.seconds()
        try:
            target = parse_target(request.uri)
        except BadTarget as e:
            return self._reject(request, PASSTHROUGH, api_family(request.path), 400, "bad_request", str(e))
        return self._too_large(request, api_family(target.api_path))

    def refuse_receiving(self, request) -> bytes:
        """The answer to a body the HTTP layer stopped reading: ``proxy.max_receiving_bytes`` is used up."""
        request.started_at = self._clock.seconds()
        return self._reject(
            request, PASSTHROUGH, api_family(request.path), 503, "receiving_full",
            receiving_full_message(self.connections), retry_after=RECEIVING_RETRY_AFTER,
        )

    def _too_large(self, request, api: str) -> bytes:
        limit = self._config.proxy.max_body_bytes
        return self._reject(
            request, PASSTHROUGH, api, 413, "too_large", f"request body larger than proxy.max_body_bytes ({limit} bytes)"
        )

    # -- the request's life -------------------------------------------------

    def _handle(self, request):
        """The answer decided at once (the error body, set on ``request``), or the coroutine that finds it.

        Not a coroutine itself: a parked request then holds one coroutine
        frame (:meth:`_gated`'s), not two.
        """
        request.started_at = self._clock.seconds()
        # One canonical target, to classify and to forward: the upstream sees
        # exactly the path the class was decided on (proxy/target.py).
        try:
            target = parse_target(request.uri)
        except BadTarget as e:
            return self._reject(request, PASSTHROUGH, api_family(request.path), 400, "bad_request", str(e))
        api = api_family(target.api_path)
        # Any file-like body: a plain Site spools a large one to a temporary file.
        request.content.seek(0)
        body = request.content.read()
        # Hold the body once, not twice, while the request may sit parked
        # (Twisted's cleanup accepts None here).
        request.content = None
        if len(body) > self._config.proxy.max_body_bytes:
            # Only behind a plain Site: ProxySite stops reading such a body and calls refuse_oversized.
            return self._too_large(request, api)
        if self._carried:
            carried = self._carried.pop(request.channel, None)
            if carried is not None:
                return self._adopted(request, target, body, api, carried)
        refused = self._refused_by_upstream(request, target, body)
        if refused is not None:
            return refused
        wanted = None
        if self._trusts_header(request):
            try:
                wanted = header_class(request.getHeader(b"x-yield-class"))
            except ValueError:
                return self._reject(
                    request, PASSTHROUGH, api, 400, "bad_request",
                    "X-Yield-Class must be interactive, batch or long",
                )
        max_wait = None
        raw_wait = request.getHeader(b"x-yield-max-wait")
        if raw_wait is not None:
            try:
                max_wait = float(raw_wait)
                if not math.isfinite(max_wait) or max_wait < 0:
                    raise ValueError
            except ValueError:
                return self._reject(
                    request, PASSTHROUGH, api, 400, "bad_request",
                    "X-Yield-Max-Wait must be a number of seconds >= 0",
                )
        # Which model it is for decides which members may serve it, and the name each is asked for.
        model = _model_of(body)
        try:
            cls = self._class_of(request, target, body, wanted, model)
        except BadBody as e:
            return self._reject(request, PASSTHROUGH, api, 400, "bad_request", str(e))
        if cls == PASSTHROUGH:
            return self._passthrough(request, target, body, api, model)
        routing = self._routing(request, target, body, cls, model)
        if not routing.eligible:
            return self._no_upstream(request, target, api, cls)
        # Headers are held while parked too: they count against parking.max_parked_bytes.
        entry = Entry(
            cls=cls, size=len(body) + _head_size(request), api=api, max_wait=max_wait, routing=routing,
            route=target.path, client=request.getClientAddress(),
        )
        return self._gated(request, target, entry, body)

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

    def _adopted(self, request, target: Target, body: bytes, api: str, carried):
        """An adopted request (:meth:`adopt`) parks again as it was, for the members eligible for it here."""
        request.started_at = carried.started_at
        cls = carried.standing.cls
        routing = self._routing(request, target, body, cls, _model_of(body))
        if not routing.eligible:
            return self._no_upstream(request, target, api, cls)
        entry = Entry.resumed(
            carried.standing, size=len(body) + _head_size(request), api=api, routing=routing,
            route=target.path, client=request.getClientAddress(),
        )
        self._gate.number_adopted(entry)
        return self._gated(request, target, entry, body)

    def _refused_by_upstream(self, request, target: Target, body: bytes) -> bytes | None:
        """The upstream's own answer, given at once, to a request it would refuse at once; else None.

        Every new request is asked once, before its class is decided and
        before it may park (:func:`yieldproxy.servers.refusal`: the upstream's
        CORS check, an unknown route of a server whose routes are all known, a
        body its decoder refuses), so no web page and no typo holds a place in
        the lot, and a caller's mistake is answered without waiting out a yield.
        """
        method = request.method.decode("latin-1")
        origin = (request.requestHeaders.getRawHeaders(b"origin") or [b""])[0]
        asked = Asked(
            method, target.path, origin.decode("utf-8", "surrogateescape") or None, self._upstream_hosts, body,
            declared=self._classifier.declares(method, target.path),
        )
        refused = refusal(self._apis, asked, self._origins)
        if refused is None:
            return None
        self._metrics.refused_at_once_total.labels(refused.reason).inc()
        self._log(request, self._classifier.classify(method, target.path), refused.status, refused.reason, None, 0)
        return _write_refusal(request, refused)

    def _routing(self, request, target: Target, body: bytes, cls: str, model: str | None):
        """Which members may serve it (:meth:`Pool.routing`), for a new request and an adopted one alike."""
        method = request.method.decode("latin-1")
        routing = self._pool.routing(method, target.path, cls, model)
        if routing.translated and not _translatable(target.path, body):
            # Members that would get it translated could not serve it with the same meaning.
            routing = self._pool.routing(method, target.path, cls, model, translatable=False)
        return routing

    def _no_upstream(self, request, target: Target, api: str, cls: str):
        """No member of the pool may serve it: refused at once, saying which key decides."""
        return self._reject(
            request, cls, api, self._gate.reject_status, "no_upstream",
            f"no upstream of the pool may serve {cls} requests on {target.path} (upstreams.*.classes)",
        )

    def _class_of(self, request, target: Target, body: bytes, wanted: str | None, model: str | None = None) -> str:
        """The request's class: a trusted header, else the route rules and the allow-list.

        The body is read as Ollama's Go decoder reads it (servers/gojson.py): whole when
        small, scanned for its model when large.  The scan never decides
        passthrough alone: a model rule that would pass the request is
        confirmed on the whole body.  While the GPU is yielded, two refinements
        keep Ollama from touching it: model pulls and builds wait (as ``long``)
        instead of passing through, and a true unload request (see
        :func:`~yieldproxy.lot.classify.is_unload`, decided only on a small body
        read whole) passes through instead of waiting, since it only frees
        memory.  In a pool, "yielded" is said of the member such a request
        would go to.
        """
        method = request.method.decode("latin-1")
        path = target.path
        if wanted is not None:
            cls = wanted
        else:
            # ``model`` is the body's model as the handler read it (find_model: this same read), or None:
            # read again only then, so that a body Go cannot decode is refused here.
            known, model = model, None
            if self._classifier.needs_model(method, path):
                if len(body) <= FULL_READ_LIMIT:
                    model = known if known is not None else read_request(body).model
                else:
                    model = known if known is not None else scan_model(body)
                    if self._classifier.classify(method, path, model) == PASSTHROUGH:
                        model = read_request(body).model
            cls = self._classifier.classify(method, path, model)
        # Only model-loading and unload routes change class while their upstream is held.
        if (path in MODEL_LOADING_PATHS or path in UNLOAD_PATHS) and self._route_held(method, path, model):
            if cls == PASSTHROUGH and path in MODEL_LOADING_PATHS:
                return "long"
            # An unload request is a few bytes; a large body is never one.
            if cls != PASSTHROUGH and path in UNLOAD_PATHS and len(body) <= _UNLOAD_BODY_LIMIT:
                try:
                    parsed = read_request(body)
                except BadBody:
                    return cls
                if is_unload(method, path, parsed):
                    return PASSTHROUGH
        return cls

    async def _gated(self, request, target: Target, entry: Entry, body: bytes):
        max_attempts = self._config.upstream.max_attempts
        #: The members that answered this request "busy" (:meth:`_after_failure`).
        busy_on: set[str] = set()
        while True:
            try:
                await self._gate.admit(entry)
            except Refused as refused:
                refusal = self._gate.explain(refused, entry)
                if entry.was_parked:
                    outcome = refusal.reason if refusal.reason in ("expired", "shutdown") else "rejected"
                    self._metrics.replay_total.labels(entry.cls, outcome).inc()
                return self._reject(
                    request, entry.cls, entry.api, refusal.status, refusal.reason,
                    refusal.message, refusal.retry_after, count=False,
                    entry=entry, attempts=entry.tries,
                )
            except CancelledError:
                self._metrics.replay_total.labels(entry.cls, "abandoned").inc()
                self._log(request, entry.cls, None, "abandoned", entry, entry.tries)
                raise
            except HandedOver as handed:
                # Taken, with its connection, by the process that replaces this one (lifecycle/succession/): it ends
                # there once that process has it (True), or parks here again, in its place (False).
                outcome = handed.take(request, entry, body)
                if outcome is None or await outcome:
                    entry.move(LEFT)
                    return None
                continue
            member = self._pool.member(entry.released_to)
            request.served_by = member.log_name  # the request log names it (observe/requestlog.py)
            extra = []
            if entry.was_parked:
                extra.append((b"x-yield-parked-seconds", b"%.3f" % entry.parked_seconds))
            began = self._clock.seconds()
            attempt: Attempt | TranslatedAttempt | None = None
            failure = None
            outcome = "error"
            # Only the upstream's failures slow the replay down, not a client leaving.
            failed = False
            try:
                # Built inside the slot's try: whatever fails here still gives the slot back.
                if entry.routing is not None and member.name in entry.routing.translated:
                    attempt = self._translated_attempt(request, target, entry, body, member, extra)
                else:
                    attempt = Attempt(
                        self._clock, member.upstream, request, self._body_for(member, entry, body),
                        self._attempt_timeout(entry.cls), extra, buffers=self._buffers, target=target.raw,
                        judge=member.server.judge, stall_timeout=self._config.upstream.stall_timeout_seconds,
                    )
                status = await attempt.run()
                outcome = "ok"
            except RetryableFailure as retryable:
                # An answer that may yet be the caller's (relayed unless a hold or a probe explains it)
                # does not slow the replay down.
                failed = slows_replay(retryable.reason)
                failure = retryable
                outcome = retryable.reason
            except RelayBroken as broken:
                failed = True
                outcome = broken.reason
                if broken.reason == Reason.STALL:
                    self._metrics.upstream_failures_total.labels(entry.cls, Reason.STALL).inc()
                self._outcome(entry, "upstream_error")
                self._log(request, entry.cls, request.code, "upstream_error", entry, entry.tries + 1)
                return await self._broken(request, entry.api, str(broken))
            except ClientTooSlow as slow:
                outcome = "slow_client"
                self._outcome(entry, "abandoned")
                return await self._drop_slow_client(request, entry.cls, slow, entry, entry.tries + 1)
            except CancelledError:
                outcome = "abandoned"
                if entry.was_parked:
                    self._metrics.replay_total.labels(entry.cls, "abandoned").inc()
                self._log(request, entry.cls, None, "abandoned", entry, entry.tries + 1)
                raise
            finally:
                # The upstream is done with this attempt: its replay slot is free,
                # whether or not the client has read the whole answer yet.
                elapsed = self._clock.seconds() - began
                self._gate.finished(failed=failed, seconds=elapsed, member=entry.released_to)
                self._metrics.upstream_attempt_seconds.labels(member.name, entry.cls).observe(elapsed)
                # A 5xx that may yet be the caller's is counted once judged (below): ``ok`` when relayed.
                later = failure is not None and judged_later(failure.reason, member.spec.fallback)
                if not later:
                    self._attempt_ended(member, entry, outcome)
            if failure is not None:
                ended = "abandoned"
                try:
                    answered = await self._after_failure(
                        request, target, entry, body, failure, max_attempts, member, busy_on, extra
                    )
                    ended = failure.reason if answered is _RETRY else "ok"
                finally:
                    if later:
                        self._attempt_ended(member, entry, ended)
                if answered is not _RETRY:
                    return answered
                continue
            # Only a 2xx shows that the upstream serves the model (a 404 for a model it lacks does not, nor an
            # unload, which loads nothing): its record of served models is the evidence of its outage verdicts
            # (upstream/served.py).
            ran = 200 <= status < 300 and not _unloads(request.method, target.path, body)
            member.health.served(self._failed_call(target, entry, body, member) if ran else None, began)
            if 200 <= status < 300 and target.path in MANAGEMENT_PATHS:
                _managed(member, target.path, self._body_for(member, entry, body))
            self._child(self._metrics.upstream_seconds, entry.cls).observe(elapsed)
            assert attempt is not None  # it ran: it was made
            try:
                if not attempt.client_has_all():
                    await attempt.client_drained()
            except CancelledError:
                self._outcome(entry, "abandoned")
                self._log(request, entry.cls, None, "abandoned", entry, entry.tries + 1)
                raise
            served = served_outcome(member.spec)
            self._outcome(entry, served)
            self._log(request, entry.cls, status, served, entry, entry.tries + 1)
            return None

    def _attempt_ended(self, member: Member, entry: Entry, outcome: str) -> None:
        """Count an attempt by how it ended (``yieldproxy_upstream_attempts_total``) and tell who listens."""
        self._metrics.upstream_attempts_total.labels(member.name, outcome).inc()
        self._on_attempt(member, entry, outcome)

    def _failed_call(self, target: Target, entry: Entry, body: bytes, member: Member) -> ModelCall | None:
        """What failed (or was served) on ``member``, for its outage probe: a translated attempt ran its own
        embedding route."""
        if entry.routing is not None and member.name in entry.routing.translated and entry.model:
            return ModelCall(member.server.embed_path, member.catalogue.own_name(entry.model) or entry.model)
        if entry.model:
            # Read at admission, as failed_call reads it: not read again on every success.  The member's
            # own name (its model_map), as the request asked it: the probe asks for what failed.
            return ModelCall(target.path, member.catalogue.own_name(entry.model) or entry.model)
        return failed_call(target, body)

    def _translated_attempt(self, request, target: Target, entry: Entry, body: bytes, member: Member, extra):
        """The attempt on a member that serves this embedding route only translated (upstream/translated_attempt.py).

        The body was read the same way at admission (:func:`_translatable`), so it reads again.
        """
        wanted = parse_request(target.path, body)
        own = member.catalogue.own_name(wanted.model) or wanted.model
        spec = member.spec
        return TranslatedAttempt(
            self._clock, member.upstream, member.server, request, wanted, own, entry.api,
            spec.attempt_timeout_seconds or self._attempt_timeout(entry.cls), [*extra, *answer_headers(spec, own)],
            member=member.name, relay_errors=not spec.fallback,
            prefixed=member if len(member.server.url_prefixes) > 1 else None,
        )

    def _body_for(self, member: Member, entry: Entry, body: bytes) -> bytes:
        """The body as ``member`` takes it: with its own name for the model when its ``model_map`` renames it."""
        if entry.model is None:
            return body
        own = member.catalogue.own_name(entry.model)
        return body if own is None else renamed_body(body, own)

    async def _after_failure(
        self, request, target: Target, entry: Entry, body: bytes, failure: RetryableFailure, max_attempts: int,
        member: Member, busy_on: set[str] | None = None, extra=(),
    ):
        """A failed attempt: retry it (:data:`_RETRY`), or answer the caller now, as the verdict says.

        The verdict (yieldproxy/upstream/verdict.py, its table in its docstring) is
        the policy; this gathers the facts it rests on, asks for the ones it
        asks for (the pool, when an answer said busy; the outage judge, the
        member's health, which may probe), and does what it returns: the
        counts, the log lines and the answer.  In short: while a hold covers
        the member any failure goes back to its place in the lot uncounted;
        a member not ready is passed over uncounted; a busy answer goes to
        another member that may take it now; an outage the judge recognises
        parks the request behind its hold uncounted; a request that fails
        alone ends after ``upstream.max_attempts`` counted attempts, with
        the upstream's own answer (its GPU words) or a 502/504 naming its
        model when the watcher judged that model failing alone (upstream/failing.py);
        a 5xx in words no list has gets the upstream's answer once no outage
        explains it, and one whose words blame the caller at once.
        """
        answer = failure.answer
        facts = Facts(
            failure.reason, failure.words, answer.code if answer is not None else None,
            standby=member.spec.fallback, held=member.held(),
            attempts=entry.attempts, unreadable=entry.unreadable, max_attempts=max_attempts,
        )
        decided = verdict(facts)
        if decided is Verdict.ASK_POOL:
            facts = attrs.evolve(facts, elsewhere=self._busy_elsewhere(entry, member, busy_on))
            decided = verdict(facts)
        if decided is Verdict.ASK_JUDGE:
            reason = reported(facts)
            if reason != failure.reason:
                failure = RetryableFailure(reason, failure.detail, answer, failure.words)
            self._metrics.upstream_failures_total.labels(entry.cls, reason).inc()
            # The verdict is waited for within the caller's budget, as any wait (a probe may take a minute).
            entry.start_waiting(self._clock.seconds(), self._config.classes[entry.cls].hold_seconds)
            assert entry.deadline is not None  # set just now, or when it first waited
            judged = member.health.report(reason, self._failed_call(target, entry, body, member))
            judged.addTimeout(max(0.0, entry.deadline - self._clock.seconds()), self._clock, _no_verdict)
            try:
                outage = await judged
            except CancelledError:
                if entry.was_parked:
                    self._metrics.replay_total.labels(entry.cls, "abandoned").inc()
                self._log(request, entry.cls, None, "abandoned", entry, entry.tries)
                raise
            decided = verdict(attrs.evolve(
                facts, reason=reason, outage=bool(outage), held=member.held(), reachable=member.health.reachable,
                others_reachable=any(not self._pool.member(n).unreachable for n in entry.eligible if n != member.name),
                out_of_time=outage is None or self._clock.seconds() >= entry.deadline,
            ))
        return self._act(decided, request, target, entry, body, failure, member, extra)

    def _busy_elsewhere(self, entry: Entry, member: Member, busy_on: set[str] | None) -> bool:
        """``member`` answered busy: whether another eligible member that has not answered it busy may take it
        now, as its drainer decides with this one failed on (a standby takes nothing while this one is
        available: busy is not unavailable)."""
        if busy_on is None:
            return False
        busy_on.add(member.name)
        entry.failed_on = member.name
        return any(
            n not in busy_on and self._pool.usable(self._pool.member(n), entry) and self._pool.may_take(n, entry)
            for n in entry.eligible
        )

    def _act(
        self, decided: Verdict, request, target: Target, entry: Entry, body: bytes, failure: RetryableFailure,
        member: Member, extra,
    ):
        """Do what the verdict on a failed attempt says: :data:`_RETRY`, or the answer written."""
        if decided is Verdict.STANDBY:
            # The fallback's errors are never shown: back to its place in the lot, not counted
            # against the request, and not given to the fallback again (upstream/pool/routing.py).
            entry.failed_on = member.name
            entry.forgiven += 1
            return _RETRY
        if decided is Verdict.NOT_READY:
            self._metrics.upstream_failures_total.labels(entry.cls, failure.reason).inc()
            member.health.not_ready(failure.detail, self._failed_call(target, entry, body, member))
            return self._again_uncounted(entry, member, "found it not ready", failure)
        if decided is Verdict.HELD:
            return self._held_back(entry, member, failure)
        if decided is Verdict.ELSEWHERE:
            return self._again_uncounted(entry, member, "found it busy, trying another", failure)
        if decided is Verdict.RELAY:
            assert failure.answer is not None  # only an answer is relayed
            return self._relay(request, entry, member, failure.answer, extra)
        # Another eligible member takes it first, when one is available.
        entry.failed_on = member.name
        if decided is Verdict.PASS_OVER:
            # Never reached since start, but the pool has others that may serve it: pass
            # this one over (checked again on its own) and let another take it, not counted.
            member.refused()
            entry.forgiven += 1
            self._metrics.retries_total.labels(entry.cls).inc()
            return _RETRY
        if decided is Verdict.FORGIVEN:
            entry.forgiven += 1
            self._metrics.forgiven_attempts_total.labels(entry.cls).inc()
            log.info(
                "{cls} attempt failed ({reason}) in a recognised outage, not counted: {detail}",
                cls=entry.cls, reason=failure.reason, detail=failure.detail,
            )
            self._metrics.retries_total.labels(entry.cls).inc()
            return _RETRY
        entry.attempts += 1
        if decided is Verdict.UNREACHABLE:
            # Never reached since start: a wrong URL or a backend not started
            # yet. Waiting cannot help; say so at once.
            return self._upstream_gave_up(request, entry, failure, "the upstream has not answered since the proxy started")
        alone = self._failing_alone(entry, member)
        log.info(
            "{cls} attempt {n} failed ({reason}){alone}: {detail}",
            cls=entry.cls, n=entry.attempts, reason=failure.reason, detail=failure.detail,
            alone=f"; {alone}, retried within the class's bound" if alone else "",
        )
        if failure.reason == Reason.BAD_ANSWER:
            entry.unreadable += 1
        if decided is not Verdict.RETRY:
            why = f"{alone}: gave up after {entry.attempts} attempts" if alone else None
            if entry.attempts < self._config.upstream.max_attempts and _bound_spent(entry, self._clock.seconds()):
                spent = _bound_spent(entry, self._clock.seconds())
                why = f"{why} as {spent}" if why else f"upstream failed {entry.attempts} times, giving up as {spent}"
            return self._upstream_gave_up(request, entry, failure, why, relay=decided is Verdict.GIVE_UP_RELAY)
        self._metrics.retries_total.labels(entry.cls).inc()
        return _RETRY

    def _failing_alone(self, entry: Entry, member: Member) -> str | None:
        """"model X fails alone on upstream Y (evidence)" when the outage watcher judged the request's model
        failing alone there (upstream/failing.py), else None: what its log lines and its 502/504 say."""
        if not entry.model:
            return None
        own = member.catalogue.own_name(entry.model) or entry.model
        note = member.health.failing.get(own, self._clock.seconds())
        if note is None:
            return None
        return f"model {entry.model} fails alone on upstream {member.name} ({note.evidence})"

    def _held_back(self, entry: Entry, member: Member, failure: RetryableFailure):
        """A failure while a hold covers ``member``: back to its place in the lot, not counted."""
        self._metrics.upstream_failures_total.labels(entry.cls, failure.reason).inc()
        self._metrics.forgiven_attempts_total.labels(entry.cls).inc()
        return self._again_uncounted(entry, member, f"failed ({failure.reason}) while it is held", failure)

    def _again_uncounted(self, entry: Entry, member: Member, what: str, failure: RetryableFailure):
        """Back to its place in the lot, the attempt not counted against ``max_attempts``; another member may take it."""
        entry.failed_on = member.name
        entry.forgiven += 1
        self._metrics.retries_total.labels(entry.cls).inc()
        log.info(
            "{cls} attempt on upstream {name} {what}, not counted: {detail}",
            cls=entry.cls, name=member.name, what=what, detail=failure.detail,
        )
        return _RETRY

    def _relay(self, request, entry: Entry, member: Member, answer: UpstreamAnswer, extra=()) -> bytes:
        """The upstream's whole error answer is the caller's: relay it as it came (the upstream answered)."""
        member.health.served()
        self._outcome(entry, "ok")
        self._log(request, entry.cls, answer.code, "ok", entry, entry.tries + 1)
        return write_answer(request, answer, extra)

    async def _passthrough(self, request, target: Target, body: bytes, api: str, model: str | None = None):
        """Routes that never park: one attempt, failures reported as they are.

        In a pool it goes to one member (:meth:`Pool.passthrough_member`);
        the model lists (``GET /api/tags``, ``/v1/models``) are the union of
        every member's that serves the route.
        """
        method = request.method.decode("latin-1")
        if method == "GET" and target.path in UNION_PATHS:
            members = self._pool.members_serving(method, target.path)
            if len(members) > 1:
                return await self._union(request, target, api, members)
        member = self._pool.passthrough_member(method, target.path, model)
        request.served_by = member.log_name  # the request log names it (observe/requestlog.py)
        sent = self._body_for_passthrough(member, model, body)
        attempt = Attempt(
            self._clock, member.upstream, request, sent,
            self._config.upstream.attempt_timeout_seconds, retry_statuses=False, buffers=self._buffers,
            target=target.raw, stall_timeout=self._config.upstream.stall_timeout_seconds,
        )
        try:
            status = await attempt.run()
        except RetryableFailure as failure:
            # Reported for outage detection; nobody waits on the verdict.
            member.health.report(failure.reason)
            return self._reject(request, PASSTHROUGH, api, gateway_status(failure.reason), "upstream_error", failure.detail, attempts=1)
        except RelayBroken as broken:
            if broken.reason == Reason.STALL:
                self._metrics.upstream_failures_total.labels(PASSTHROUGH, Reason.STALL).inc()
            self._log(request, PASSTHROUGH, request.code, "upstream_error", None, 1)
            return await self._broken(request, api, str(broken))
        except ClientTooSlow as slow:
            return await self._drop_slow_client(request, PASSTHROUGH, slow, None, 1)
        except CancelledError:
            self._log(request, PASSTHROUGH, None, "abandoned", None, 1)
            raise
        member.health.report(None)
        if 200 <= status < 300 and target.path in MANAGEMENT_PATHS:
            _managed(member, target.path, sent)
        try:
            if not attempt.client_has_all():
                await attempt.client_drained()
        except CancelledError:
            self._log(request, PASSTHROUGH, None, "abandoned", None, 1)
            raise
        self._log(request, PASSTHROUGH, status, "ok", None, 1)
        return None

    def _body_for_passthrough(self, member: Member, model: str | None, body: bytes) -> bytes:
        if model is None:
            return body
        own = member.catalogue.own_name(model)
        return body if own is None else renamed_body(body, own)

    async def _union(self, request, target: Target, api: str, members: list[Member]):
        """``GET /api/tags`` or ``/v1/models`` of a pool: every member's list, each model once."""
        try:
            answer = await union_list(
                members, target.path, timeout=self._config.upstream.health_timeout_seconds
            )
        except CancelledError:
            self._log(request, PASSTHROUGH, None, "abandoned", None, 1)
            raise
        if answer is None:
            return self._reject(
                request, PASSTHROUGH, api, 502, "upstream_error",
                f"no upstream of the pool answered {target.path}", attempts=len(members),
            )
        request.setResponseCode(200)
        request.responseHeaders.setRawHeaders(b"content-type", [b"application/json; charset=utf-8"])
        request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(answer)])
        self._log(request, PASSTHROUGH, 200, "ok", None, len(members))
        return answer

    def _route_held(self, method: str, path: str, model: str | None) -> bool:
        """Whether the member a request that runs no model would go to is yielded (the GPU, with one upstream)."""
        return self._pool.passthrough_member(method, path, model).held()

    # -- outcomes -------------------------------------------------------------

    def _outcome(self, entry: Entry, outcome: str) -> None:
        if entry.was_parked:
            self._metrics.replay_total.labels(entry.cls, outcome).inc()

    def _upstream_gave_up(
        self, request, entry: Entry, failure: RetryableFailure, why: str | None = None, relay: bool = False
    ):
        """The request gives up: the upstream's own answer when ``relay`` (its GPU words say more than ours
        would: :attr:`Verdict.GIVE_UP_RELAY`), else a 502 or a 504 saying why."""
        self._outcome(entry, "upstream_error")
        if relay:
            assert failure.answer is not None  # the verdict relays only an answer
            # Ollama's own words about its own failure say more than ours would.
            log.info(
                "{cls} request gave up after {n} failed attempts ({reason}); relaying the upstream's answer",
                cls=entry.cls, n=entry.attempts, reason=failure.reason,
            )
            self._log(request, entry.cls, failure.answer.code, "upstream_error", entry, entry.tries)
            return write_answer(request, failure.answer)
        why = why or f"upstream failed {entry.attempts} times, giving up"
        return self._reject(
            request, entry.cls, entry.api, gateway_status(failure.reason), "upstream_error", f"{why}: {failure.detail}", count=False,
            entry=entry, attempts=entry.tries,
        )

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, looked up once: ``labels()`` costs a lock and a few objects each call.

        For the metrics every request touches; the label sets are few (classes, status codes).
        """
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels)
        return child

    def _attempt_timeout(self, cls: str) -> float:
        """The class's own attempt timeout, or the upstream default."""
        own = self._config.classes[cls].attempt_timeout_seconds if cls in self._config.classes else 0
        return own or self._config.upstream.attempt_timeout_seconds

    def _reject(
        self, request, cls, api, status, reason, message, retry_after=None, count=True, entry=None, attempts=0
    ):
        if count and reason in ("too_large", "bad_request", "receiving_full"):
            self._metrics.rejected_total.labels(cls, reason).inc()
        if status in (429, 503) and retry_after is None:
            retry_after = self._gate.retry_after()
        self._log(request, cls, status, reason, entry, attempts)
        return write_error(request, api, status, message, reason, retry_after)

    def _log(self, request, cls: str, status: int | None, outcome: str, entry: Entry | None, attempts: int) -> None:
        """Once per request, where it ends: its count in requests_total and its log line.

        A client that went away is counted as code 499 (nginx's), so the codes
        of ``yieldproxy_requests_total`` add up to every request the proxy took.
        """
        code = CLIENT_GONE if status is None else int(status)
        self._child(self._metrics.requests_total, cls, str(code)).inc()
        log_request(
            request, cls, status, outcome,
            entry.parked_seconds if entry is not None else 0.0,
            attempts, request.started_at, self._clock,
        )

    async def _broken(self, request, api: str, why: str):
        """The upstream failed mid-answer: end a stream in its own error form, else close what was sent.

        A stream the proxy frames (no ``Content-Length``) gets its error line
        (NDJSON) or event (SSE), its last chunk, and the connection closes.
        Any other answer cannot be ended honestly: the connection closes
        after what was sent (a clean close, never a reset, which would lose
        the status line still in the buffers), so the client sees a body
        short of its length or with no last chunk, never a complete wrong one.
        """
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

    async def _drop_slow_client(self, request, cls: str, slow: ClientTooSlow, entry: Entry | None, attempts: int):
        """Past a buffer bound: cut the client (the upstream is stopped already), count it as gone (499)."""
        self._metrics.slow_clients_dropped_total.labels(cls).inc()
        peer = _peer_host(request)
        log.warn("dropping a slow {cls} client {peer}: {why}", cls=cls, peer=peer, why=str(slow))
        self._log(request, cls, None, "slow_client", entry, attempts)
        if request.channel is not None:
            request.channel.transport.abortConnection()
        await Deferred()  # The listener cancels this when the connection is gone (edge/request.py).

    def _trusts_header(self, request) -> bool:
        mode = self._config.proxy.trust_class_header
        if mode == "always":
            return True
        if mode == "never":
            return False
        return is_loopback(_peer_host(request))
