"""Which class a request belongs to: configured route rules, the defaults, an allow-list.

``interactive`` wants an answer in seconds, ``batch`` can wait, ``long`` can
wait minutes; ``passthrough`` requests are never parked, so only routes known
not to run a model are passthrough (:data:`PASSTHROUGH_ROUTES`, and true
unloads).  A route the proxy does not know gets ``proxy.unknown_route_class``
(``interactive`` by default): during a yield it parks, since nothing says it
leaves the GPU alone.  Rules match on method, path or path prefix, and
optionally on the model named in the JSON body; the first rule that matches
wins.  Paths are the decoded canonical paths of :mod:`yieldproxy.target`;
bodies are read as Ollama reads them (:mod:`yieldproxy.gojson`).
"""

from __future__ import annotations

import functools

import re
from fnmatch import fnmatchcase
from ipaddress import ip_address
from typing import Iterable

import attrs

from .config import RouteRule
from .gojson import BadBody, GoRequest

__all__ = ["BadBody"]

PASSTHROUGH = "passthrough"
CLASSES = ("interactive", "batch", "long")

#: DESIGN.md's default routes: every route of Ollama that runs a model (each
#: is POST only in Ollama; another method there is an unknown route).
DEFAULT_RULES: tuple[RouteRule, ...] = tuple(
    RouteRule(cls=cls, path=path, methods=("POST",))
    for path, cls in [
        ("/api/embed", "batch"),
        ("/api/embeddings", "batch"),
        ("/v1/embeddings", "batch"),
        ("/api/chat", "interactive"),
        ("/api/generate", "interactive"),
        ("/v1/chat/completions", "interactive"),
        ("/v1/completions", "interactive"),
        ("/v1/responses", "interactive"),
        ("/v1/messages", "interactive"),
        ("/v1/audio/transcriptions", "interactive"),
    ]
)

# Ollama's routes that never schedule a runner, checked against
# server/routes.go of ollama/ollama at fb30760996871fa9460115c753afd2c60d4ab0f7
# (GenerateRoutes, lines 1841-1929) and each handler it names:
#   GET/HEAD /, GET/HEAD /api/version    inline handlers, a constant answer    (1877-1880)
#   GET /api/status                      StatusHandler: cloud status only      (2146)
#   GET/HEAD /api/tags, GET /v1/models   ListHandler: the model list cache     (1632)
#   GET /api/ps                          PsHandler: reads sched.loadedModels() (2271)
#   POST /api/show, GET /v1/models/:model ShowHandler -> GetModelInfo, reads
#                                        the manifest and GGUF metadata from
#                                        disk (llm.LoadModel decodes the file,
#                                        no runner)                            (1300, 1396, 1600)
#   HEAD/POST /api/blobs/:digest         Head/CreateBlobHandler: files         (1688, 1703)
#   POST /api/copy, DELETE /api/delete   Copy/DeleteHandler: manifests         (1647, 1247)
#   POST /api/push                       PushHandler: uploads to a registry    (1163)
#   POST /api/me, POST /api/signout,
#   DELETE /api/user/keys/:encodedKey    Whoami/SignoutHandler: ollama.com     (2184, 2238)
# and OPTIONS on any path: gin-contrib/cors answers a preflight itself, and
# gin answers any other OPTIONS 405 (HandleMethodNotAllowed, no OPTIONS
# route), so no handler runs.  Left out on purpose: /api/pull and
# /api/create (MODEL_LOADING_PATHS below) and the /api/experimental/ routes
# (they may change without notice).
_ONE_SEGMENT = "[^/]+"
PASSTHROUGH_ROUTES: tuple[tuple[frozenset[str], str], ...] = tuple(
    (frozenset(methods.split()), path)
    for methods, path in [
        ("GET HEAD", "/"),
        ("GET HEAD", "/api/version"),
        ("GET", "/api/status"),
        ("GET HEAD", "/api/tags"),
        ("GET", "/api/ps"),
        ("POST", "/api/show"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/<name>"),
        ("HEAD POST", "/api/blobs/<digest>"),
        ("POST", "/api/copy"),
        ("DELETE", "/api/delete"),
        ("POST", "/api/push"),
        ("POST", "/api/me"),
        ("POST", "/api/signout"),
        ("DELETE", "/api/user/keys/<key>"),
    ]
)
_PASSTHROUGH_EXACT = {
    (method, path) for methods, path in PASSTHROUGH_ROUTES if "<" not in path for method in methods
}
_PASSTHROUGH_PATTERNS = tuple(
    (methods, re.compile(re.sub("<[a-z]+>", _ONE_SEGMENT, path)))
    for methods, path in PASSTHROUGH_ROUTES
    if "<" in path
)

#: Routes that make Ollama fetch or build a model: passthrough while the GPU is
#: there, held (as ``long``) during a yield.
MODEL_LOADING_PATHS = frozenset({"/api/pull", "/api/create"})
#: Routes where ``keep_alive: 0`` with nothing to compute unloads without loading.
UNLOAD_PATHS = frozenset({"/api/generate", "/api/chat"})


def api_family(path: bytes) -> str:
    """``openai`` for /v1/ routes, else ``ollama``: the shape of our error bodies."""
    return "openai" if path.startswith(b"/v1/") else "ollama"


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and unix-socket peers (host None)."""
    if host is None:
        return True
    return _is_loopback_address(host)


@functools.lru_cache(maxsize=1024)
def _is_loopback_address(host: str) -> bool:
    """Parsing an address costs microseconds on every request; a client's peer address repeats."""
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def runs_no_model(method: str, path: str) -> bool:
    """True for a request Ollama serves without scheduling a runner (:data:`PASSTHROUGH_ROUTES`)."""
    if method == "OPTIONS" or (method, path) in _PASSTHROUGH_EXACT:
        return True
    return any(method in methods and pattern.fullmatch(path) for methods, pattern in _PASSTHROUGH_PATTERNS)


def is_unload(method: str, path: str, request: GoRequest) -> bool:
    """True for a request Ollama answers by unloading a model, without loading one.

    Ollama's server/routes.go at fb30760996871fa9460115c753afd2c60d4ab0f7:
    ``GenerateHandler`` expires the runner when ``req.Prompt == "" &&
    req.KeepAlive != nil && req.KeepAlive.Duration == 0`` (line 404) and
    nothing before that line schedules one (the body is bound, the model
    looked up on disk; cloud models are proxied elsewhere); ``ChatHandler``
    likewise when ``len(req.Messages) == 0`` and keep_alive is 0 (line
    2505).  ``EmbedHandler`` and ``EmbeddingsHandler`` call
    ``scheduleRunner`` before anything else (lines 854, 1072): with
    ``keep_alive: 0`` and no input they *load* the model, so they are never
    an unload.  ``keep_alive`` is an ``api.Duration`` (api/types.go,
    ``Duration.UnmarshalJSON``), read by :func:`yieldproxy.gojson.go_duration`.
    A request with any field Go could not decode is not an unload (Ollama
    refuses it; parking it is the safe side).
    """
    if method != "POST" or path not in UNLOAD_PATHS or request.type_errors:
        return False
    if request.values.get("keep_alive") != 0:
        return False
    if path == "/api/generate":
        return request.values.get("prompt", "") == ""
    return request.values.get("messages", 0) == 0


#: Routes whose class :class:`Classifier` keeps (paths come from clients: the cache is bounded).
_ROUTE_CACHE = 4096


@attrs.frozen
class Classifier:
    """Route rules in order, the configured ones before the defaults; then the allow-list."""

    rules: tuple[RouteRule, ...]
    #: The class of a route no rule names and the allow-list does not hold.
    unknown_class: str = "interactive"
    #: What does not depend on the body, by (method, path): whether a model rule
    #: could match, and the class without a model.  Every request asks; the
    #: routes are few (at most :data:`_ROUTE_CACHE` are kept).
    _routes: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)

    @classmethod
    def from_rules(cls, configured: Iterable[RouteRule], unknown_class: str = "interactive") -> "Classifier":
        return cls((*configured, *DEFAULT_RULES), unknown_class)

    def _matches(self, rule: RouteRule, method: str, path: str) -> bool:
        if rule.path and path != rule.path:
            return False
        if rule.prefix and not path.startswith(rule.prefix):
            return False
        return not rule.methods or method in rule.methods

    def needs_model(self, method: str, path: str) -> bool:
        """True when a rule that could match depends on the body's model name."""
        return self._route(method, path)[0]

    def classify(self, method: str, path: str, model: str | None = None) -> str:
        """The class of the first matching rule; else passthrough for a route known to run no
        model (or one that loads models, which the proxy holds during a yield); else the
        unknown-route class."""
        if model is None:
            return self._route(method, path)[1]
        return self._classify(method, path, model)

    def _route(self, method: str, path: str) -> tuple[bool, str]:
        key = (method, path)
        known = self._routes.get(key)
        if known is None:
            known = (
                any(rule.models and self._matches(rule, method, path) for rule in self.rules),
                self._classify(method, path, None),
            )
            if len(self._routes) < _ROUTE_CACHE:
                self._routes[key] = known
        return known

    def _classify(self, method: str, path: str, model: str | None) -> str:
        for rule in self.rules:
            if not self._matches(rule, method, path):
                continue
            if rule.models and not (model and any(fnmatchcase(model, m) for m in rule.models)):
                continue
            return rule.cls
        if path in MODEL_LOADING_PATHS or runs_no_model(method, path):
            return PASSTHROUGH
        return self.unknown_class


def header_class(value: bytes | None) -> str | None:
    """The class an ``X-Yield-Class`` header asks for; ValueError when it names none."""
    if value is None:
        return None
    wanted = value.strip().lower().decode("ascii", "replace")
    if wanted not in CLASSES:
        raise ValueError(wanted)
    return wanted
