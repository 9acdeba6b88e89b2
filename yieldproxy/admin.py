"""The admin listener: health, status, yield/resume and metrics.

Brokers call ``POST /yield`` and ``POST /resume``; monitoring reads
``/metrics``; people read ``/status``.  With a token configured, every route
but ``/healthz`` needs ``Authorization: Bearer TOKEN``.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any, Callable

import attrs
from klein import Klein
from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Site

from . import __version__
from .config import Config
from .gate import Gate
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .parking import ParkingLot
from .replay import Replayer
from .state import YieldState

_MAX_SOURCE_LENGTH = 64


class BadRequest(ValueError):
    """An admin call whose body does not say something we can do."""


def _json(request, payload: Any, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    request.setHeader(b"cache-control", b"no-store")
    return json.dumps(payload, indent=1).encode("utf-8") + b"\n"


def _read_json(request) -> dict:
    request.content.seek(0)
    raw = request.content.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
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
    return float(value)


def _text(body: dict, key: str, default: str, limit: int = 500) -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise BadRequest(f"{key} must be a string")
    if len(value) > limit:
        raise BadRequest(f"{key} is longer than {limit} characters")
    return value


def parse_yield(body: dict) -> dict:
    """The keyword arguments of :meth:`YieldState.hold` from a ``POST /yield`` body."""
    unknown = set(body) - {"reason", "source", "expected_seconds", "for_seconds"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    source = _text(body, "source", "api", _MAX_SOURCE_LENGTH)
    if not source:
        raise BadRequest("source must not be empty")
    return {
        "source": source,
        "reason": _text(body, "reason", ""),
        "expected_seconds": _seconds(body, "expected_seconds"),
        "for_seconds": _seconds(body, "for_seconds"),
    }


@attrs.define(eq=False)
class AdminApp:
    """The Klein app of the admin listener."""

    _clock: IReactorTime
    _config: Config
    _state: YieldState
    _gate: Gate
    _lot: ParkingLot
    _replayer: Replayer
    _metrics: Metrics
    token: str | None = None
    #: Extra ``/status`` fields from other parts (watchers, fallback), by name.
    status_extras: dict[str, Callable[[], Any]] = attrs.Factory(dict)

    app = Klein()

    def site(self) -> Site:
        site = Site(self.app.resource())
        site.displayTracebacks = False
        site.log = lambda request: None
        return site

    def status(self) -> dict:
        parked = {name: 0 for name in self._config.classes}
        parked.update(self._lot.count_by_class())
        now = self._clock.seconds()
        end = self._state.expected_end()
        status = {
            "state": self._gate.state_name,
            "holds": [h.as_json() for h in self._state.holds],
            "expected_end": end,
            "expected_remaining_seconds": None if end is None else max(0.0, end - now),
            "parked": parked,
            "parked_total": len(self._lot),
            "parked_bytes": self._lot.parked_bytes,
            "inflight": self._replayer.inflight,
            "now": now,
            "version": __version__,
            "config": {
                "upstream": self._config.proxy.upstream,
                "replay": attrs.asdict(self._config.replay),
                "parking": attrs.asdict(self._config.parking),
                "classes": {k: attrs.asdict(v) for k, v in self._config.classes.items()},
            },
        }
        for name, read in self.status_extras.items():
            status[name] = read()
        return status

    def _authorized(self, request) -> bool:
        if self.token is None:
            return True
        given = request.getHeader(b"authorization") or b""
        expected = b"Bearer " + self.token.encode("utf-8")
        return hmac.compare_digest(given, expected)

    def _guard(self, request) -> bytes | None:
        """The 401 body when the caller lacks the token, else None."""
        if self._authorized(request):
            return None
        request.setHeader(b"www-authenticate", b'Bearer realm="yieldproxy"')
        return _json(request, {"error": "missing or wrong admin token (Authorization: Bearer TOKEN)"}, 401)

    @app.route("/healthz", methods=["GET", "HEAD"])
    def healthz(self, request):
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return b"ok"

    @app.route("/status", methods=["GET"])
    def get_status(self, request):
        return self._guard(request) or _json(request, self.status())

    @app.route("/yield", methods=["POST"])
    def post_yield(self, request):
        denied = self._guard(request)
        if denied:
            return denied
        try:
            hold = parse_yield(_read_json(request))
        except BadRequest as e:
            return _json(request, {"error": str(e)}, 400)
        self._state.hold(**hold)
        return _json(request, self.status())

    @app.route("/resume", methods=["POST"])
    def post_resume(self, request):
        denied = self._guard(request)
        if denied:
            return denied
        try:
            body = _read_json(request)
            unknown = set(body) - {"source"}
            if unknown:
                raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
            source = _text(body, "source", "api", _MAX_SOURCE_LENGTH)
        except BadRequest as e:
            return _json(request, {"error": str(e)}, 400)
        self._state.release(source)
        return _json(request, self.status())

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request):
        denied = self._guard(request)
        if denied:
            return denied
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return self._metrics.render()

    @app.handle_errors
    def not_found(self, request, failure):
        from werkzeug.exceptions import MethodNotAllowed, NotFound

        if failure.check(NotFound):
            return _json(request, {"error": f"no such admin route: {request.path.decode('latin-1')}"}, 404)
        if failure.check(MethodNotAllowed):
            return _json(request, {"error": f"method {request.method.decode('latin-1')} not allowed here"}, 405)
        return _json(request, {"error": "internal error in the admin API"}, 500)
