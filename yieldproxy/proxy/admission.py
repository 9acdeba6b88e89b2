"""Admission: what a new request is, and whether it is answered now, passes through, or goes to the scheduler.

It reads the target and the body, the ``X-Yield-Class`` and
``X-Yield-Max-Wait`` headers, asks the upstream's own refusal rule, decides
the class and the members that may serve it, and builds the
:class:`~yieldproxy.lot.parking.Entry` the scheduler admits.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs

from ..config import Config
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
from ..lot.parking import Entry
from ..observe.metrics import Metrics
from ..schedule.scheduler import Scheduler
from ..servers import Asked, Origins, refuser
from ..servers.gojson import FULL_READ_LIMIT, FirstValue, find_model, read_request, scan_model
from ..servers.ollama import allowed_origins
from ..upstream.translation import Untranslatable, parse_request
from .facts import RequestFacts
from .outcome import Outcomes, peer_host, write_refusal
from .target import BadTarget, Target, parse_target

#: Bodies larger than this are not read for the unload idiom during a yield.
UNLOAD_BODY_LIMIT = 4096


def model_of(body: bytes, shared: FirstValue | None = None) -> str | None:
    """The model a body names, read as Ollama's Go decoder reads it; None when none (or not JSON)."""
    if not body:
        return None
    try:
        model = find_model(body, shared)
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


def _head_size(request: Any) -> int:
    """Bytes of the request line and header lines: held in memory while parked, like the body."""
    size = len(request.method) + len(request.uri) + len(request.clientproto) + 4
    for name, values in request.requestHeaders.getAllRawHeaders():
        for value in values:
            size += len(name) + len(value) + 4
    return size + 2


@attrs.define(eq=False)
class Admission:
    """Decides each new request: an answer now (its body, said on its facts), or the coroutine that serves it."""

    _config: Config
    _scheduler: Scheduler
    _metrics: Metrics
    _outcomes: Outcomes
    #: ``gated(request, facts, target, entry, body)``: the attempt loop (proxy/attempts.py).
    _gated: Callable[..., Any]
    #: ``passthrough(request, facts, target, body, api, model)``: proxy/passthrough.py.
    _passthrough: Callable[..., Any]
    _classifier: Classifier = attrs.field(init=False)
    #: What the upstreams' own refusal rules need (:meth:`_refused_by_upstream`): the rule of their apis
    #: (:func:`yieldproxy.servers.refusal`, made once), the origins their CORS checks allow, the Host each receives.
    _refusal: Callable[..., Any] = attrs.field(init=False)
    _origins: Origins = attrs.field(init=False)
    _upstream_hosts: frozenset[str] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # Routes are classed by the servers of the pool's members (config order); without [[upstreams]], Ollama's.
        apis = tuple(dict.fromkeys(m.api for m in self._config.upstreams)) or ("ollama",)
        self._classifier = Classifier.from_rules(self._config.routes, self._config.proxy.unknown_route_class, apis)
        self._refusal = refuser(apis)
        self._origins = allowed_origins(self._config.proxy.allowed_origins)
        self._upstream_hosts = frozenset(
            m.upstream.host_header for m in self._scheduler.members if getattr(m.upstream, "host_header", None)
        )

    def admit(self, request: Any, facts: RequestFacts, carried: Any = None):
        """The answer decided at once (the error body, set on ``request``), or the coroutine that finds it.

        ``carried``: what the process this one replaced said of an adopted request.
        """
        refuse = self._outcomes.refuse
        # One canonical target, to classify and to forward (proxy/target.py).
        try:
            target = parse_target(request.uri)
        except BadTarget as e:
            return refuse(request, facts, api_family(request.path), 400, "bad_request", str(e))
        api = api_family(target.api_path)
        # Decoded once: the refusal rule, the class and the routing all read it.
        method = request.method.decode("latin-1")
        # Any file-like body: a plain Site spools a large one to a temporary file.
        request.content.seek(0)
        body = request.content.read()
        # Hold the body once, not twice, while the request may sit parked
        # (Twisted's cleanup accepts None here).
        request.content = None
        if len(body) > self._config.proxy.max_body_bytes:
            # Only behind a plain Site: ProxySite stops reading such a body and calls refuse_oversized.
            return self.too_large(request, facts, api)
        if carried is not None:
            return self._adopted(request, facts, method, target, body, api, carried)
        # The body's one parse, shared by the upstream's refusal rule and the reads below.
        shared = FirstValue(body)
        refused = self._refused_by_upstream(request, facts, method, target, body, shared)
        if refused is not None:
            return refused
        wanted = None
        if self._trusts_header(request):
            try:
                wanted = header_class(request.getHeader(b"x-yield-class"))
            except ValueError:
                return refuse(request, facts, api, 400, "bad_request", "X-Yield-Class must be interactive, batch or long")
        max_wait = None
        raw_wait = request.getHeader(b"x-yield-max-wait")
        if raw_wait is not None:
            try:
                max_wait = float(raw_wait)
                if not math.isfinite(max_wait) or max_wait < 0:
                    raise ValueError
            except ValueError:
                return refuse(
                    request, facts, api, 400, "bad_request", "X-Yield-Max-Wait must be a number of seconds >= 0"
                )
        # Which model it is for decides which members may serve it, and the name each is asked for.
        model = model_of(body, shared)
        try:
            cls = self._class_of(method, target, body, wanted, model, shared)
        except BadBody as e:
            return refuse(request, facts, api, 400, "bad_request", str(e))
        if cls == PASSTHROUGH:
            return self._passthrough(request, facts, target, body, api, model)
        routing = self._routing(method, target, body, cls, model)
        if not routing.eligible:
            return self._no_upstream(request, facts, target, api, cls)
        # Headers are held while parked too: they count against parking.max_parked_bytes.
        entry = Entry(
            cls=cls, size=len(body) + _head_size(request), api=api, max_wait=max_wait, routing=routing,
            route=target.path, client=request.getClientAddress(),
        )
        return self._gated(request, facts, target, entry, body)

    def too_large(self, request: Any, facts: RequestFacts, api: str) -> bytes:
        limit = self._config.proxy.max_body_bytes
        return self._outcomes.refuse(
            request, facts, api, 413, "too_large", f"request body larger than proxy.max_body_bytes ({limit} bytes)"
        )

    def _adopted(
        self, request: Any, facts: RequestFacts, method: str, target: Target, body: bytes, api: str, carried: Any
    ):
        """An adopted request (:meth:`ProxyApp.adopt`) parks again as it was, for the members eligible for it here."""
        facts.started_at = carried.started_at
        cls = carried.standing.cls
        routing = self._routing(method, target, body, cls, model_of(body))
        if not routing.eligible:
            return self._no_upstream(request, facts, target, api, cls)
        entry = Entry.resumed(
            carried.standing, size=len(body) + _head_size(request), api=api, routing=routing,
            route=target.path, client=request.getClientAddress(),
        )
        self._scheduler.number_adopted(entry)
        return self._gated(request, facts, target, entry, body)

    def _refused_by_upstream(
        self, request: Any, facts: RequestFacts, method: str, target: Target, body: bytes, shared: FirstValue
    ) -> bytes | None:
        """The upstream's own answer, given at once, to a request it would refuse at once; else None.

        Asked once, before the class and before it may park (:func:`yieldproxy.servers.refusal`), so no web
        page and no typo holds a place in the lot, and a caller's mistake is not kept waiting out a yield.
        """
        origin = (request.requestHeaders.getRawHeaders(b"origin") or [b""])[0]
        asked = Asked(
            method, target.path, origin.decode("utf-8", "surrogateescape") or None, self._upstream_hosts, body,
            shared=shared, declared=self._classifier.declares(method, target.path),
        )
        refused = self._refusal(asked, self._origins)
        if refused is None:
            return None
        self._metrics.refused_at_once_total.labels(refused.reason).inc()
        facts.cls = self._classifier.classify(method, target.path)
        facts.say(refused.status, refused.reason, 0)
        return write_refusal(request, refused)

    def _routing(self, method: str, target: Target, body: bytes, cls: str, model: str | None):
        """Which members may serve it (:meth:`Scheduler.routing`), for a new request and an adopted one alike."""
        routing = self._scheduler.routing(method, target.path, cls, model)
        if routing.translated and not _translatable(target.path, body):
            # Members that would get it translated could not serve it with the same meaning.
            routing = self._scheduler.routing(method, target.path, cls, model, translatable=False)
        return routing

    def _no_upstream(self, request: Any, facts: RequestFacts, target: Target, api: str, cls: str) -> bytes:
        """No member of the pool may serve it: refused at once, saying which key decides."""
        facts.cls = cls
        return self._outcomes.refuse(
            request, facts, api, self._scheduler.reject_status, "no_upstream",
            f"no upstream of the pool may serve {cls} requests on {target.path} (upstreams.*.classes)",
        )

    def _class_of(
        self, method: str, target: Target, body: bytes, wanted: str | None, model: str | None, shared: FirstValue
    ) -> str:
        """The request's class: a trusted header, else the route rules and the allow-list, and the two
        refinements while its member is yielded (docs/classes.md, "How a request gets its class" and
        "Bodies are read as Ollama reads them"; in a pool, "yielded" is said of the member it would go to).
        """
        path = target.path
        if wanted is not None:
            cls = wanted
        else:
            # ``model`` is the body's model as admission read it (find_model: this same read), or None:
            # read again only then, so that a body Go cannot decode is refused here.
            known, model = model, None
            if self._classifier.needs_model(method, path):
                if len(body) <= FULL_READ_LIMIT:
                    model = known if known is not None else read_request(body, shared).model
                else:
                    model = known if known is not None else scan_model(body)
                    if self._classifier.classify(method, path, model) == PASSTHROUGH:
                        model = read_request(body, shared).model
            cls = self._classifier.classify(method, path, model)
        # Only model-loading and unload routes change class while their upstream (where a request that runs no model goes) is held.
        if (path in MODEL_LOADING_PATHS or path in UNLOAD_PATHS) and self._scheduler.passthrough_member(method, path, model).held():
            if cls == PASSTHROUGH and path in MODEL_LOADING_PATHS:
                return "long"
            # An unload request is a few bytes; a large body is never one.
            if cls != PASSTHROUGH and path in UNLOAD_PATHS and len(body) <= UNLOAD_BODY_LIMIT:
                try:
                    parsed = read_request(body, shared)
                except BadBody:
                    return cls
                if is_unload(method, path, parsed):
                    return PASSTHROUGH
        return cls

    def _trusts_header(self, request: Any) -> bool:
        mode = self._config.proxy.trust_class_header
        if mode == "always":
            return True
        if mode == "never":
            return False
        return is_loopback(peer_host(request))
