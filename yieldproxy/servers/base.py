"""What the proxy knows about one kind of server, as a frozen description.

Each module of this package (:mod:`.ollama`, :mod:`.openai`, :mod:`.tei`,
:mod:`.infinity`, :mod:`.llamacpp`) fills in one :class:`Server` from that
server's own source (docs/servers.md has the evidence); nothing here does I/O.
The pool asks a member's description, by its ``api``, what each of
:class:`Server`'s fields says: its routes with their class and dialect, what
an error or health answer means, its model list, its minimal call, its
translated embeddings, the shape of the proxy's errors, what it refuses at once.

Every judge reads only the server's own error structure and its own words,
and no judgement declares an outage by itself: a server that quotes the
caller's input in an error must not let that input hold the upstream, so the
outage probe, whose text is the proxy's, decides (watchers/outage.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable

import attrs

from ..names import PASSTHROUGH as PASSTHROUGH  # re-exported: the servers' tables name it
from .gojson import FirstValue

# -- what an error answer means (Server.judge) ------------------------------------

#: The server says its GPU or backend failed: try another member, count it as
#: evidence of an outage (the outage watcher then probes).
GPU = "gpu"
#: The server is up but too loaded to take the request now: try another member
#: or later; no evidence of an outage.
BUSY = "busy"
#: The server is up but not serving yet (its model is still loading): the member
#: is not available; no evidence of an outage.
NOT_READY = "not_ready"
#: The request itself is wrong (its body, its route, a model this server lacks):
#: relay the answer as it is, never retry (a 5xx goes back to the lot only while
#: a hold covers the upstream).
CALLER = "caller"
#: Any other failure the server reports, which says neither of the above (an
#: unexpected 500, a feature it was started without): a 4xx is relayed as it
#: is; a 5xx is judged by the outage probe (the proxy's own minimal call): if
#: that fails too it is an outage, else the answer is relayed as it is.
UPSTREAM = "upstream"
#: Not an error at all (a status below 400).
OK = "ok"
JUDGEMENTS = (GPU, BUSY, NOT_READY, CALLER, UPSTREAM, OK)

# -- what a health answer means (Server.judge_health) ------------------------------

#: The server answers and can run its model.
UP = "up"
#: The server answers but cannot run its model (an outage).
DOWN = "down"
HEALTH = (UP, NOT_READY, DOWN)

#: Error bodies are a few hundred bytes; a longer one is not read as JSON.
MAX_ERROR_BODY = 64 * 1024
#: A model list is read whole; past this it is not read at all.
MAX_MODEL_LIST = 4 * 1024 * 1024

#: The text embedded by a probe of an embedding route (short, and easy to tell apart in logs).
PROBE_TEXT = "yieldproxy outage probe"

_PLACEHOLDER = re.compile("<[a-z_]+>")


@attrs.frozen
class ModelCall:
    """What failed: a model route (as forwarded) and the model its body named."""

    path: str
    model: str


#: ``(method, path, JSON body)`` of a minimal model call, or None where there is none.
MinimalCall = tuple[str, str, dict[str, Any]]


@attrs.frozen
class Route:
    """One route of a server: its methods, its path, its class, its dialect.

    ``path`` is exact, or holds ``<name>`` placeholders that each match one
    non-empty path segment (``/api/blobs/<digest>``).  ``dialect`` names the
    request and answer shapes: routes of two servers with one dialect are
    interchangeable (``openai`` for OpenAI's ``/v1/embeddings`` on TEI,
    Infinity and llama.cpp alike), routes with different dialects are not
    (``POST /rerank`` is ``tei`` on TEI, ``infinity`` on Infinity).
    """

    methods: frozenset[str]
    path: str
    cls: str
    dialect: str
    pattern: re.Pattern[str] | None = attrs.field(
        init=False, eq=False, repr=False, default=attrs.Factory(lambda self: _compile(self.path), takes_self=True)
    )


def _compile(path: str) -> re.Pattern[str] | None:
    """The pattern of a path with ``<name>`` placeholders (one segment each), or None for an exact path."""
    if "<" not in path:
        return None
    return re.compile(_PLACEHOLDER.sub("[^/]+", re.escape(path)))


def routes(dialect: str, cls: str, *table: str) -> tuple[Route, ...]:
    """Routes of one class and dialect, each written ``"METHOD[ METHOD...] /path"``."""
    out = []
    for line in table:
        *methods, path = line.split()
        out.append(Route(frozenset(methods), path, cls, dialect))
    return tuple(out)


def json_object(body: bytes, limit: int = MAX_ERROR_BODY) -> dict[str, Any] | None:
    """``body`` as a JSON object, or None (empty, too long, not JSON, not an object)."""
    if not body or len(body) > limit:
        return None
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def nested_error(body: bytes) -> dict[str, Any] | None:
    """The ``error`` object of OpenAI's shape ``{"error": {"message": str, ...}}``, or None."""
    document = json_object(body)
    error = document.get("error") if document is not None else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error
    return None


def listed_names(body: bytes, key: str, field: str, kind: str) -> tuple[str, ...]:
    """The ``field`` of each entry of a model list ``{key: [{field: ...}, ...]}``; ValueError naming ``kind``."""
    document = json_object(body, MAX_MODEL_LIST)
    entries = document.get(key) if document is not None else None
    if not isinstance(entries, list) or not all(
        isinstance(m, dict) and isinstance(m.get(field), str) for m in entries
    ):
        raise ValueError(f'not {kind} model list: expected {{"{key}": [{{"{field}": ...}}, ...]}}')
    return unique_names(m[field] for m in entries)


def openai_model_ids(body: bytes) -> tuple[str, ...]:
    """The ``id`` of each entry of an OpenAI-shaped model list ``{"data": [{"id": ...}]}``."""
    return listed_names(body, "data", "id", "an OpenAI")


def unique_names(names: Iterable[str]) -> tuple[str, ...]:
    """Names in order, each once, none empty."""
    return tuple(dict.fromkeys(n for n in names if n))


@attrs.define
class Asked:
    """What a server's refusal rule reads of a request, as the upstream would receive it.

    Made for every request, so not frozen: a frozen class's ``__init__`` sets each field through
    ``object.__setattr__``, about twice the instructions (bench/instructions.py)."""

    method: str
    #: The canonical decoded path (:mod:`yieldproxy.proxy.target`): what the upstream routes on.
    path: str
    #: The request's first ``Origin`` value (as Go's ``Header.Get`` reads it), or None.
    origin: str | None
    #: The ``Host`` values the upstream may receive (the proxy sends each upstream its own).
    hosts: frozenset[str]
    body: bytes
    #: The body's one parse, shared with the proxy's own reads of it (None: parsed here if needed).
    shared: FirstValue | None = None
    #: A ``[[routes]]`` rule names this route: the operator knows it, so it is never refused as unknown.
    declared: bool = False


@attrs.frozen
class Refusal:
    """The answer the upstream gives at once, before it runs anything: the proxy gives it instead."""

    status: int
    #: The body, byte for byte as the upstream writes it (empty for a bare status).
    body: bytes = b""
    #: Its ``Content-Type``, or None when the upstream sends none.
    content_type: bytes | None = None
    #: Other headers the upstream sends with it (a 405's ``Allow``).
    headers: tuple[tuple[bytes, bytes], ...] = ()
    #: Why, for the proxy's metrics and log: ``origin``, ``unknown_route`` or ``bad_body``.
    reason: str = "bad_body"


def never_refuses(asked: Asked, origins: Any) -> Refusal | None:
    """A server whose refusals the proxy does not know exactly: it refuses nothing on its behalf."""
    return None


def never_unload(method: str, path: str, request: Any) -> bool:
    """Servers other than Ollama have no request that only unloads a model."""
    return False


def openai_errors(path: str) -> str:
    """OpenAI's nested error object on every route (the server's clients are OpenAI clients)."""
    return "openai"


def up_on_200(status: int, body: bytes) -> str:
    """The health check of a server whose health route answers 200 when it serves, anything else when not."""
    return UP if status == 200 else DOWN


def openai_call(kind: ModelCall) -> MinimalCall | None:
    """The smallest call on OpenAI's model routes: one short text embedded, one token generated; None elsewhere."""
    model, path = kind.model, kind.path
    if path == "/v1/embeddings":
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path == "/v1/chat/completions":
        return "POST", path, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "stream": False}
    if path == "/v1/completions":
        return "POST", path, {"model": model, "prompt": "hi", "max_tokens": 1, "stream": False}
    return None


@attrs.frozen
class Server:
    """Everything the proxy knows about one kind of server (see the module docstring).

    The defaults are OpenAI's API; each server names only where it differs.
    """

    #: The name ``[[upstreams]] api`` takes.
    api: str
    #: Its routes: the model routes with their class, then the allow-list of
    #: routes that run no model (passthrough).  Any other route is unknown.
    routes: tuple[Route, ...]
    #: ``judge(status, body)``: one of :data:`JUDGEMENTS` for an answer it gave.
    judge: Callable[[int, bytes], str]
    #: ``GET`` this path (relative to the member URL) to learn whether it serves.
    health_path: str
    #: ``minimal_call(call)``: the smallest call of the failed call's kind, or
    #: None (the outage probe then uses the health route).
    minimal_call: Callable[[ModelCall], MinimalCall | None] = openai_call
    #: ``judge_health(status, body)``: one of :data:`HEALTH` for the health route's answer.
    judge_health: Callable[[int, bytes], str] = up_on_200
    #: ``GET`` this path for the names of the models it serves.
    models_path: str = "/v1/models"
    #: ``parse_models(body)``: the names in its model list's answer; ValueError if it is not one.
    parse_models: Callable[[bytes], tuple[str, ...]] = openai_model_ids
    #: The body shape an embedding request translated for it takes: ``ollama``
    #: or ``openai`` (:func:`yieldproxy.upstream.translation.backend_request`'s ``api``).
    embed_shape: str = "openai"
    #: Where that translated request goes, relative to the member URL.
    embed_path: str = "/v1/embeddings"
    #: ``error_shape(path)``: the shape of the proxy's own error bodies on this path.
    error_shape: Callable[[str], str] = openai_errors
    #: Routes that fetch or build a model: passthrough while the GPU is there,
    #: held (as ``long``) during a yield (any method).
    model_loading_paths: frozenset[str] = frozenset()
    #: ``is_unload(method, path, GoRequest)``: True for a request that only unloads a model.
    is_unload: Callable[[str, str, Any], bool] = never_unload
    #: Path prefixes its API may be mounted under (Infinity's ``--url-prefix``);
    #: :meth:`with_prefix` picks one for :attr:`models_path` and :attr:`embed_path`.
    url_prefixes: tuple[str, ...] = ("",)
    #: ``refuse(asked, origins)``: the answer the server gives this request at once, without
    #: running anything (its CORS check, an unknown route, a body it cannot decode), or None.
    #: ``origins`` (:class:`~.cors.Origins`) mirrors its own allowed-origins setting.
    #: Called once per request before it may park, so a request it refuses never waits.
    refuse: Callable[[Asked, Any], Refusal | None] = never_refuses
    _exact: dict[tuple[str, str], Route] = attrs.field(
        init=False, eq=False, repr=False, default=attrs.Factory(lambda self: self._index(), takes_self=True)
    )

    def _index(self) -> dict[tuple[str, str], Route]:
        exact: dict[tuple[str, str], Route] = {}
        for route in self.routes:
            if route.pattern is not None:
                continue
            for method in route.methods:
                if (method, route.path) in exact:
                    raise ValueError(f"{self.api}: {method} {route.path} is listed twice")
                exact[(method, route.path)] = route
        return exact

    def route(self, method: str, path: str) -> Route | None:
        """The route serving ``method`` on the canonical ``path``, or None when the server has none."""
        found = self._exact.get((method, path))
        if found is not None:
            return found
        for route in self.routes:
            if route.pattern is not None and method in route.methods and route.pattern.fullmatch(path):
                return route
        if method == "OPTIONS":  # a CORS preflight (or a 405) on any path runs no model
            return OPTIONS_ROUTE
        return None

    def route_class(self, method: str, path: str) -> str | None:
        """The class this server's table gives the route, or None for a route it does not know."""
        found = self._exact.get((method, path))
        if found is not None:
            return found.cls
        if path in self.model_loading_paths:
            return PASSTHROUGH
        route = self.route(method, path)
        return route.cls if route is not None else None

    def with_prefix(self, prefix: str) -> "Server":
        """This description for a server mounted under ``prefix`` (one of :attr:`url_prefixes`)."""
        if prefix not in self.url_prefixes:
            raise ValueError(f"{self.api}: no API prefix {prefix!r}; expected one of {self.url_prefixes}")
        return attrs.evolve(
            self,
            models_path=prefix + self._unprefixed(self.models_path),
            embed_path=prefix + self._unprefixed(self.embed_path),
        )

    def _unprefixed(self, path: str) -> str:
        """``path`` without the API prefix it carries now, if any."""
        for known in sorted(self.url_prefixes, key=len, reverse=True):
            if known and path.startswith(known + "/"):
                return path[len(known):]
        return path


#: ``OPTIONS`` on any path: a CORS preflight (or a 405), never a model.
OPTIONS_ROUTE = Route(frozenset({"OPTIONS"}), "*", PASSTHROUGH, "options")
