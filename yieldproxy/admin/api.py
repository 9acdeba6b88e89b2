"""The admin listener: health, status, yield/resume, metrics and the status page.

Brokers call ``POST /yield`` and ``POST /resume``; monitoring reads ``/metrics``; scripts read
``/status``; people open ``/`` (the status page, which polls ``/status`` and ``/history``).  Who may call
which route (the admin token, the read-only one, the routes that refuse another web page's requests):
docs/security.md and docs/admin-api.md.
"""

from __future__ import annotations

import hmac
import html
import importlib.resources
import json
import math
import os
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping

import attrs
from klein import Klein
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.server import Site

from .. import __version__
from ..clock import WallClock, same
from ..config import Config
from ..edge.capacity import QUICK_ROOM, Connections
from ..edge.hosts import HostPolicy, cross_site
from ..edge.site import ProxySite
from ..errors import listener_error_body
from ..lot.parking import ParkingLot, Waiting
from ..lot.state import ALL, MAX_HOLD_SECONDS, TooManyHolds, UnknownScope, YieldState
from ..names import check_source
from ..observe.history import History
from ..observe.metrics import CONTENT_TYPE_LATEST, Metrics
from ..schedule.scheduler import Scheduler
from ..upstream.fallback import NotNow

_log = Logger()

#: Admin bodies are a few fields of JSON.
_ADMIN_BODY_LIMIT = 64 * 1024
#: Brokers and scrapers reconnect; an idle admin connection need not live long.
_ADMIN_IDLE_SECONDS = 60
#: Seconds an admin client has to send a whole request, counted from the accept (a few fields of JSON).
ADMIN_READ_SECONDS = 5.0
#: Seconds within which a request must come whole to be served past ``admin.max_connections``
#: (in the room kept for such requests, ``edge.capacity.QUICK_ROOM``): the operator's calls are one packet.
ADMIN_QUICK_SECONDS = 0.5
#: Retry-After, in seconds, of a hold change refused because a reload handed the holds to a new process.
HOLDS_MOVED_RETRY_AFTER = 1

#: The status page's files in ``yieldproxy/admin/static/``, with their content types.
#: Only these are served: nothing else in the package is reachable.
STATIC_FILES = {
    "index.html": b"text/html; charset=utf-8",
    "status.js": b"text/javascript; charset=utf-8",
    "status.css": b"text/css; charset=utf-8",
}

#: The page loads only its own files and talks only to this listener.  Hold
#: reasons are caller-written text: the script renders them with textContent,
#: and this policy is the second line of defence if that ever slips.
_PAGE_SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


def _static_file(name: str) -> bytes:
    """One file of the status page, read from the installed package."""
    return importlib.resources.files(__package__).joinpath("static", name).read_bytes()


#: What the page shows before its script has run (index.html), replaced by :func:`first_view`.
_BADGE = b'<span id="state" class="state state-unknown" data-state="unknown">connecting\xe2\x80\xa6</span>'
_DETAIL = b'<span id="state-detail"></span>'
_SUMMARY = b'<p id="summary" class="summary"></p>'
_RESTORED = b'<div id="restored" class="banner restored" role="alert" hidden></div>'


def restored_warning(holds: list[dict]) -> str:
    """The warning about holds older than the process (``restored``), as status.js writes it: empty when none.

    Someone who restarted the proxy to reset it finds it still yielded; this
    says which hold does it and the command that ends it.  Escaped: sources
    and reasons are caller-written text.
    """
    kept = [h for h in holds if h.get("restored")]
    if not kept:
        return _RESTORED.decode("ascii")
    lines = []
    for h in kept:
        where = "the GPU" if h.get("upstream") is None else h["upstream"]
        command = f"yieldproxy resume --source {h['source']}" + (
            "" if h.get("upstream") is None else f" --upstream {h['upstream']}")
        since = time.strftime("%H:%M:%S UTC", time.gmtime(h["since"]))
        lines.append(
            f'<p class="restored-hold" data-source="{html.escape(h["source"])}">'
            f'{html.escape(h["source"])} holds {html.escape(where)} since {since} '
            f'({html.escape(h["reason"] or "no reason given")}). End it: '
            f'<code class="resume-command">{html.escape(command)}</code></p>'
        )
    head = "a hold yields" if len(kept) == 1 else f"{len(kept)} holds yield"
    return (f'<div id="restored" class="banner restored" role="alert"><strong>Kept from before the proxy started: '
            f'{head} the GPU until it ends.</strong>{"".join(lines)}</div>')


def _state_detail(status: dict) -> str:
    """The words beside the state badge (status.js says the same once it runs)."""
    if status["state"] == "yielded":
        return "held by " + ", ".join(h["source"] for h in status["holds"])
    if status["state"] == "draining":
        return "replaying parked requests"
    if status["state"] == "unreachable":
        return "the upstream has not answered since the proxy started"
    return "requests go straight to the upstream"


def first_view(page: bytes, status: dict | None, now: float) -> bytes:
    """The status page with the state at the time it was served, for a reader without JavaScript (or before it runs).

    ``status`` is None when the admin API has a token: the page is public and
    holds no data then; it says what to do instead.  Every value is escaped:
    hold reasons and sources are caller-written text.
    """
    if status is None:
        badge = '<span id="state" class="state state-locked" data-state="locked">token needed</span>'
        summary = ("This proxy has an admin token: the page asks for it to show the state (it needs JavaScript). "
                   "Without it, run yieldproxy status --token-file FILE.")
        detail = ""
    else:
        state = html.escape(status["state"])
        badge = f'<span id="state" class="state state-{state}" data-state="{state}">{state}</span>'
        detail = _state_detail(status)
        parked = ", ".join(f"{cls} {n}" for cls, n in status["parked"].items() if n)
        summary = (
            f"{status['parked_total']} parked{f' ({parked})' if parked else ''}, {status['inflight']} in flight"
            + "".join(f"; {h['source']} holds {h.get('upstream') or 'all'}: {h['reason'] or 'no reason given'}"
                      for h in status["holds"])
            + time.strftime(" (as of %H:%M:%S UTC)", time.gmtime(now))
        )
    restored = restored_warning(status["holds"]) if status is not None else _RESTORED.decode("ascii")
    return (
        page.replace(_BADGE, badge.encode("utf-8"))
        .replace(_RESTORED, restored.encode("utf-8"))
        .replace(_DETAIL, f'<span id="state-detail">{html.escape(detail)}</span>'.encode("utf-8"))
        .replace(_SUMMARY, f'<p id="summary" class="summary">{html.escape(summary)}</p>'.encode("utf-8"))
    )


class BadRequest(ValueError):
    """An admin call whose body does not say something we can do."""


def _json(request, payload: Any, status: int = 200, indent: int | None = 1) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    request.setHeader(b"cache-control", b"no-store")
    separators = None if indent is not None else (",", ":")
    return json.dumps(payload, indent=indent, separators=separators).encode("utf-8") + b"\n"


def _read_json(request) -> dict:
    request.content.seek(0)
    raw = request.content.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _seconds(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadRequest(f"{key} must be a positive number of seconds")
    if value > MAX_HOLD_SECONDS:
        raise BadRequest(f"{key} must be at most {MAX_HOLD_SECONDS:g} seconds (a week)")
    return float(value)


def _source(body: dict) -> str:
    try:
        return check_source(body.get("source", "api"))
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _text(body: dict, key: str, default: str, limit: int = 500) -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise BadRequest(f"{key} must be a string")
    if len(value) > limit:
        raise BadRequest(f"{key} is longer than {limit} characters")
    return value


def _upstream(body: dict, known: tuple[str, ...]) -> str:
    """The hold's scope: the member ``upstream`` names, or all of them (``*``) when it names none."""
    name = body.get("upstream")
    if name is None:
        return ALL
    if not isinstance(name, str) or name not in known:
        raise BadRequest(f"unknown upstream {name!r}; the upstreams are {', '.join(known)}")
    return name


def parse_yield(body: dict, upstreams: tuple[str, ...] = ("default",)) -> dict:
    """The keyword arguments of :meth:`YieldState.hold` from a ``POST /yield`` body."""
    unknown = set(body) - {"reason", "source", "expected_seconds", "for_seconds", "upstream"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    return {
        "source": _source(body),
        "reason": _text(body, "reason", ""),
        "expected_seconds": _seconds(body, "expected_seconds"),
        "for_seconds": _seconds(body, "for_seconds"),
        "scope": _upstream(body, upstreams),
    }


#: ``GET /parked``: entries in a page when ``limit`` is not given, and the most one page holds.
DEFAULT_PARKED_PAGE = 50
MAX_PARKED_PAGE = 500


def _count_arg(request, name: str, default: int, least: int, most: int | None) -> int:
    """A whole-number query argument between ``least`` and ``most``, or :class:`BadRequest` saying so."""
    raw = request.args.get(name.encode("ascii"))
    if not raw:
        return default
    text = raw[-1].decode("latin-1")
    if not text.isascii() or not text.isdigit() or int(text) < least or most is not None and int(text) > most:
        limits = f"from {least} to {most}" if most is not None else f"{least} or more"
        raise BadRequest(f"{name} must be a whole number {limits}, not {text[:40]!r}")
    return int(text)


def client_text(address: Any) -> str | None:
    """A client's address as people write it: ``host:port``, ``[v6]:port``, ``unix`` (a unix socket's peer)."""
    if address is None:
        return None
    host, port = getattr(address, "host", None), getattr(address, "port", None)
    if host is not None and port is not None:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if type(address).__name__ == "UNIXAddress":
        return "unix"
    return str(address)[:100]


def parked_json(waiting: Waiting) -> dict[str, Any]:
    """One parked request as ``GET /parked`` lists it (docs/admin-api.md)."""
    return {
        "position": waiting.position,
        "class_position": waiting.class_position,
        "class": waiting.cls,
        "route": waiting.route,
        "model": waiting.model,
        "upstreams": list(waiting.eligible),
        "client": client_text(waiting.client),
        "waited_seconds": round(waiting.waited, 3),
        "bound_seconds": round(waiting.bound, 3),
        "bound_by": "X-Yield-Max-Wait" if waiting.bound_by_caller else "hold_seconds",
        "remaining_seconds": round(waiting.remaining, 3),
        "attempts": waiting.tries,
    }


def _read_only(sections: Mapping[str, Callable[[], Any]]) -> Mapping[str, Callable[[], Any]]:
    """A read-only view of the status sections (typed, for the attrs converter)."""
    return MappingProxyType(sections)


@attrs.define(eq=False)
class AdminApp:
    """The Klein app of the admin listener."""

    _clock: IReactorTime
    _config: Config
    _state: YieldState
    #: The scheduler: its state, what is in flight, which names ``upstream`` may take.
    _scheduler: Scheduler
    _lot: ParkingLot
    _metrics: Metrics
    token: str | None = None
    #: A token that opens the reading routes only (``GET /status``, ``/parked``, ``/metrics``, ``/history``).
    read_token: str | None = None
    #: The last hour of samples for the status page's chart (``GET /history``).
    history: History | None = None
    #: Other parts' ``/status`` sections (``watchers``, ``handover``, ``fallback``), each read when asked.
    sections: Mapping[str, Callable[[], Any]] = attrs.field(factory=dict, converter=_read_only)
    #: The CPU fallback (``fallback.Fallback``), for ``POST /fallback/verify``; None when disabled.
    fallback: Any = None
    #: ``POST /reload``: hand over to a new process (lifecycle/succession/); None where the proxy cannot (not run by twistd).
    reload: Callable[[], Any] | None = None
    #: The wall clock, for the times ``/status`` and the page show (None: the elapsed clock's times, as they are).
    wall: WallClock | None = None
    #: Why the holds are not this process's to change now (a reload handed them over), or None (lifecycle/succession/).
    holds_elsewhere: Callable[[], str | None] | None = None
    #: The admin listener's open connections, capped apart from the proxy's (``admin.max_connections``).
    connections: Connections = attrs.field(init=False)
    #: When the running code started (``/status`` ``started_at``: with ``version``, which code answers).
    started_at: float = attrs.field(init=False)

    app = Klein()

    def __attrs_post_init__(self) -> None:
        admin = self._config.admin
        self.connections = Connections(
            admin.max_connections, "admin.max_connections", per_peer=admin.max_connections_per_peer,
            reserved=QUICK_ROOM, quick_seconds=ADMIN_QUICK_SECONDS,
        )
        self.started_at = self._clock.seconds()

    def site(self) -> Site:
        """The same hardened HTTP layer as the proxy's: small bodies, read timeouts, no tracebacks."""
        return ProxySite(
            self.app.resource(),
            _ADMIN_BODY_LIMIT,
            request_read_timeout=ADMIN_READ_SECONDS,
            read_from_accept=True,
            error_body=listener_error_body,
            timeout=_ADMIN_IDLE_SECONDS,
            connections=self.connections,
            host_policy=HostPolicy.from_config("admin.allowed_hosts", self._config.admin.allowed_hosts),
            reactor=self._clock,
        )

    def status(self) -> dict:
        parked = {name: 0 for name in self._config.classes}
        parked.update(self._lot.count_by_class())
        now = self._clock.seconds()
        end = self._state.expected_end()
        shown = self.shown()
        status = {
            "state": self._scheduler.state_name,
            # A hold older than this process came from before it: the holds file kept it across a
            # restart (or a reload handed it over); the page says so, and how to end it.
            "holds": [{**h.as_json(shown), "restored": h.since < self.started_at} for h in self._state.holds],
            "expected_end": None if end is None else shown(end),
            "expected_remaining_seconds": None if end is None else max(0.0, end - now),
            "parked": parked,
            "parked_total": len(self._lot),
            "parked_bytes": self._lot.parked_bytes,
            "inflight": self._scheduler.inflight,
            "now": shown(now),
            "version": __version__,
            "started_at": shown(self.started_at),
            "pid": os.getpid(),
            "config": {
                # With [[upstreams]] proxy.upstream is unused: each upstream's URL is in its row.
                "upstream": None if self._config.upstreams else self._config.proxy.upstream,
                "replay": attrs.asdict(self._config.replay),
                "parking": attrs.asdict(self._config.parking),
                "classes": {k: attrs.asdict(v) for k, v in self._config.classes.items()},
            },
        }
        for name, read in self.sections.items():
            status[name] = read()
        return status

    def shown(self) -> Callable[[float], float]:
        """Elapsed-clock times as the wall clock shows them, now (one offset for one answer: clock.py)."""
        return same if self.wall is None else self.wall.shown()

    def _token_given(self, request, token: str | None) -> bool:
        if token is None:
            return False
        given = request.getHeader(b"authorization") or b""
        return hmac.compare_digest(given, b"Bearer " + token.encode("utf-8"))

    def _guard(self, request) -> bytes | None:
        """For a reading route: the 401 body when the caller has neither token, else None."""
        if self.token is None or self._token_given(request, self.token) or self._token_given(request, self.read_token):
            return None
        return self._unauthorized(request)

    def _unauthorized(self, request) -> bytes:
        request.setHeader(b"www-authenticate", b'Bearer realm="yieldproxy"')
        return _json(request, {"error": "missing or wrong admin token (Authorization: Bearer TOKEN)"}, 401)

    def _guard_change(self, request) -> bytes | None:
        """For a route that changes something: the refusal, else None.

        The admin token (not the read-only one), then a JSON body (415
        otherwise: a web page can send ``text/plain`` and form bodies to any
        address without asking), then no sign of another web page (403).
        """
        if self.token is not None and not self._token_given(request, self.token):
            if self._token_given(request, self.read_token):
                return _json(
                    request,
                    {"error": "this token may only read (GET /status, /parked, /metrics, /history); "
                              "changes need the admin token (admin.token_file)"},
                    403,
                )
            return self._unauthorized(request)
        types = request.requestHeaders.getRawHeaders(b"content-type") or []
        media = types[0].split(b";")[0].strip().lower() if len(types) == 1 else b""
        if media != b"application/json":
            return _json(
                request,
                {"error": "send the body as JSON, with Content-Type: application/json (an empty body is fine)"},
                415,
            )
        why = cross_site(request.requestHeaders)
        if why is not None:
            return _json(request, {"error": f"{why}: only the operator changes the yield state"}, 403)
        return None

    @app.route("/healthz", methods=["GET", "HEAD"])
    def healthz(self, request):
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return b"ok"

    @app.route("/status", methods=["GET"])
    def get_status(self, request):
        return self._guard(request) or _json(request, self.status())

    @app.route("/history", methods=["GET"])
    def get_history(self, request):
        denied = self._guard(request)
        if denied:
            return denied
        if self.history is None:
            return _json(request, {"error": "this proxy keeps no history"}, 404)
        since = None
        raw = request.args.get(b"since")
        if raw:
            try:
                since = float(raw[0])
                if not math.isfinite(since):
                    raise ValueError
            except ValueError:
                return _json(request, {"error": "since must be a number (a sample's t)"}, 400)
        return _json(request, self.history.as_json(since), indent=None)

    @app.route("/parked", methods=["GET"])
    def get_parked(self, request):
        """Who waits: the parked requests in arrival order, a page at a time (``limit``, ``offset``)."""
        denied = self._guard(request)
        if denied:
            return denied
        try:
            limit = _count_arg(request, "limit", DEFAULT_PARKED_PAGE, 1, MAX_PARKED_PAGE)
            offset = _count_arg(request, "offset", 0, 0, None)
        except BadRequest as e:
            return _json(request, {"error": str(e)}, 400)
        shown_now = self.shown()(self._clock.seconds())
        page = self._lot.waiting(offset, limit)
        total = len(self._lot)
        end = offset + len(page)
        return _json(request, {
            "total": total,
            "offset": offset,
            "limit": limit,
            "next_offset": end if end < total else None,
            "now": shown_now,
            "parked": [parked_json(w) for w in page],
        })

    @app.route("/", methods=["GET", "HEAD"])
    def page(self, request):
        body = self._static(request, "index.html")
        return first_view(body, None if self.token is not None else self.status(), self.shown()(self._clock.seconds()))

    @app.route("/static/<name>", methods=["GET", "HEAD"])
    def static(self, request, name):
        return self._static(request, name)

    def _static(self, request, name: str):
        """A status-page file: public, because it is the same for everyone and holds no state."""
        content_type = STATIC_FILES.get(name)
        if content_type is None:
            return _json(request, {"error": f"no such file: {name}"}, 404)
        request.setHeader(b"content-type", content_type)
        for header, value in _PAGE_SECURITY_HEADERS:
            request.setHeader(header, value)
        return _static_file(name)

    def _holds_moved(self, request) -> bytes | None:
        """503 with ``Retry-After`` when the holds are another process's now (a reload handed them over): a
        change made here would not be kept, so none is made; asked again, the new process answers."""
        why = self.holds_elsewhere() if self.holds_elsewhere is not None else None
        if why is None:
            return None
        request.setHeader(b"retry-after", b"%d" % HOLDS_MOVED_RETRY_AFTER)
        return _json(request, {"error": f"{why}: ask again"}, 503)

    @app.route("/yield", methods=["POST"])
    def post_yield(self, request):
        denied = self._guard_change(request) or self._holds_moved(request)
        if denied:
            return denied
        try:
            hold = parse_yield(_read_json(request), self._scheduler.names)
        except BadRequest as e:
            return _json(request, {"error": str(e)}, 400)
        try:
            self._state.hold(**hold)
        except TooManyHolds as e:
            return _json(request, {"error": str(e)}, 409)
        except UnknownScope as e:
            return _json(request, {"error": str(e)}, 400)
        return _json(request, self.status())

    @app.route("/resume", methods=["POST"])
    def post_resume(self, request):
        denied = self._guard_change(request) or self._holds_moved(request)
        if denied:
            return denied
        try:
            body = _read_json(request)
            unknown = set(body) - {"source", "upstream"}
            if unknown:
                raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
            source = _source(body)
            scope = _upstream(body, self._scheduler.names)
        except BadRequest as e:
            return _json(request, {"error": str(e)}, 400)
        if scope == ALL:
            # No upstream named: every hold of the source ends, whichever upstream it holds.
            ended = self._state.release_source(source)
        else:
            ended = int(self._state.release(source, scope))
            if not ended and self._covered(source, scope):
                return _json(
                    request,
                    {"error": f"source {source} holds every upstream (its hold named none): resume it without "
                              f"upstream, or yield the others by name first"},
                    409,
                )
        # How many holds this call ended: 0 says the source held nothing (a typo, or ended already).
        return _json(request, {**self.status(), "holds_ended": ended})

    def _covered(self, source: str, scope: str) -> bool:
        """True when ``source``'s hold of every upstream holds ``scope`` (a resume of ``scope`` alone cannot end it)."""
        hold = self._state.hold_of(source)
        return hold is not None and self._state.applies(hold, scope)

    @app.route("/reload", methods=["POST"])
    def post_reload(self, request):
        """Re-read the config and run the installed code, handing everything over (docs/operating.md)."""
        denied = self._guard_change(request)
        if denied:
            return denied
        if self.reload is None:
            return _json(request, {"error": "this proxy cannot reload: it was not started by twistd"}, 501)
        from ..lifecycle.succession import ReloadBusy, ReloadRefused, ReloadUnavailable

        def failed(failure):
            code = (
                400 if failure.check(ReloadRefused) else 409 if failure.check(ReloadBusy)
                else 501 if failure.check(ReloadUnavailable) else 500
            )
            return _json(request, {"error": str(failure.value), "reloaded": False}, code)

        return self.reload().addCallbacks(lambda outcome: _json(request, outcome), failed)

    @app.route("/fallback/verify", methods=["POST"])
    def post_fallback_verify(self, request):
        """Verify the fallback against the primary now; answers with the ``fallback`` status."""
        denied = self._guard_change(request)
        if denied:
            return denied
        if self.fallback is None:
            return _json(request, {"error": "no fallback configured (fallback.enabled is false)"}, 404)
        try:
            running = self.fallback.verify()
        except NotNow as e:
            return _json(request, {"error": str(e)}, 409)
        return running.addCallback(lambda _: _json(request, self.fallback.status(self.shown())))

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request):
        denied = self._guard(request)
        if denied:
            return denied
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return self._metrics.render()

    @app.handle_errors
    def not_found(self, request, failure):  # type: ignore[misc]  # klein types the handler as a plain function
        """Routing's answers in JSON; anything else is a bug: logged with its traceback, a 500.

        werkzeug's router raises a redirect for a path it would spell
        otherwise (``/static//status``: its merged slashes): that path is not
        a route, so it is a 404 like any other, not a redirect to a path the
        client did not ask for.
        """
        from werkzeug.exceptions import HTTPException, MethodNotAllowed
        from werkzeug.routing import RequestRedirect

        path = request.path.decode("latin-1")
        if failure.check(MethodNotAllowed):
            return _json(request, {"error": f"method {request.method.decode('latin-1')} not allowed here"}, 405)
        if failure.check(RequestRedirect) or failure.check(HTTPException) and failure.value.code == 404:
            return _json(request, {"error": f"no such admin route: {path[:300]}"}, 404)
        if failure.check(HTTPException) and 400 <= (failure.value.code or 0) < 500:
            return _json(request, {"error": f"{failure.value.name}: {path[:300]}"}, failure.value.code)
        _log.failure("admin API: {method} {path} failed", failure, method=request.method, path=path[:300])
        return _json(request, {"error": "internal error in the admin API"}, 500)
