"""What the pool asks of a member's kind of server: its routes, its failures, its health, its model list.

The pool uses a small interface, one description per ``api``, with the
names and meanings of the full server descriptions (``yieldproxy.servers``,
which describe Ollama, OpenAI, TEI, Infinity and llama.cpp):

* ``route(method, path)``: the route, with its class (``cls``) and its wire
  ``dialect``, or None when the server has no such route; and
  :func:`native_apis`, the apis of a pool that serve a route as the first
  one that knows it does (the same dialect: the same request and answer);
* ``judge(status, body)``: what an error answer means (:data:`GPU`,
  :data:`BUSY`, :data:`NOT_READY`, :data:`CALLER`, :data:`UPSTREAM`, :data:`OK`);
* ``health_path`` and ``judge_health(status, body)`` (:data:`UP`, :data:`DOWN`, :data:`NOT_READY`);
* ``models_path`` and ``parse_models(body)``: its model list;
* ``minimal_call(call)``: the smallest call of a failed call's kind, for outage probes.

The descriptions of ``ollama`` and ``openai`` here stand in for the full
ones until ``yieldproxy.servers`` is part of this build, made of what the
proxy already knew (classify.py's tables, probes.py, ollama_errors.py).
Then this module becomes ``from ..servers import server, native_apis, ...``.
Meanwhile a pool with a ``tei``, ``infinity`` or ``llamacpp`` member refuses
to start (:func:`server` raises), rather than route requests blind.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable

import attrs

from ..config import ConfigError
from ..classify import DEFAULT_RULES, MODEL_LOADING_PATHS, PASSTHROUGH_ROUTES
from ..names import PASSTHROUGH
from ..ollama_errors import error_message, is_gpu_failure
from ..probes import minimal_call as ollama_minimal_call

#: What an error answer means (``Server.judge``).
GPU, BUSY, NOT_READY, CALLER, UPSTREAM, OK = "gpu", "busy", "not_ready", "caller", "upstream", "ok"
#: What a health answer means (``Server.judge_health``).
UP, DOWN = "up", "down"
#: Ollama's whole message for a full queue (``ErrMaxQueue``, server/sched.go).
OLLAMA_BUSY = "server busy, please try again.  maximum pending requests exceeded"
#: A model list is read whole; past this it is not read.
MAX_MODEL_LIST = 4 * 1024 * 1024


@attrs.frozen
class Route:
    """One route of a server: its class and its dialect (the shape of its request and answer)."""

    cls: str
    dialect: str


@attrs.frozen
class Server:
    """What the pool knows of one kind of server (see the module docstring)."""

    api: str
    #: ``(method, path) -> Route`` for exact paths; ``(methods, pattern, Route)`` for ``<name>`` ones.
    exact: dict[tuple[str, str], Route]
    patterns: tuple[tuple[frozenset[str], re.Pattern[str], Route], ...]
    judge: Callable[[int, bytes], str]
    health_path: str
    judge_health: Callable[[int, bytes], str]
    models_path: str
    parse_models: Callable[[bytes], tuple[str, ...]]
    minimal_call: Callable[[Any], tuple[str, str, dict] | None]

    def route(self, method: str, path: str) -> Route | None:
        found = self.exact.get((method, path))
        if found is not None:
            return found
        for methods, pattern, route in self.patterns:
            if method in methods and pattern.fullmatch(path):
                return route
        if method == "OPTIONS":
            return Route(PASSTHROUGH, "options")
        return None


def _table(rows: Iterable[tuple[str, str, str, str]]) -> tuple[dict, tuple]:
    """``(methods, path, class, dialect)`` rows as the exact and pattern lookups of :class:`Server`."""
    exact: dict[tuple[str, str], Route] = {}
    patterns = []
    for methods, path, cls, dialect in rows:
        route = Route(cls, dialect)
        if "<" in path:
            patterns.append((frozenset(methods.split()), re.compile(re.sub("<[a-z]+>", "[^/]+", path)), route))
        else:
            for method in methods.split():
                exact[(method, path)] = route
    return exact, tuple(patterns)


def _dialect(path: str) -> str:
    if path == "/v1/messages":
        return "anthropic"
    return "openai" if path.startswith("/v1/") else "ollama"


_OLLAMA_ROWS = [
    *((" ".join(rule.methods), rule.path, rule.cls, _dialect(rule.path)) for rule in DEFAULT_RULES),
    *((" ".join(sorted(methods)), path, PASSTHROUGH, _dialect(path)) for methods, path in PASSTHROUGH_ROUTES),
    *(("POST", path, PASSTHROUGH, "ollama") for path in sorted(MODEL_LOADING_PATHS)),
]
_OPENAI_ROWS = [row for row in _OLLAMA_ROWS if row[3] == "openai"]


def _json(body: bytes, limit: int = MAX_MODEL_LIST) -> Any:
    if not body or len(body) > limit:
        return None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def judge_ollama(status: int, body: bytes) -> str:
    """Ollama's runner and memory failures are the GPU's; its full queue is busy; other 4xx the caller's."""
    if status < 400:
        return OK
    if is_gpu_failure(status, body):
        return GPU
    if status == 503 and error_message(body) == OLLAMA_BUSY:
        return BUSY
    return CALLER if status < 500 else UPSTREAM


def judge_openai(status: int, body: bytes) -> str:
    """Nothing is known of an OpenAI-compatible server's words: 429 and 503 are busy, never the GPU."""
    if status < 400:
        return OK
    if status in (429, 503):
        return BUSY
    return CALLER if status < 500 else UPSTREAM


def up_on_200(status: int, body: bytes) -> str:
    return UP if status == 200 else DOWN


def parse_ollama_models(body: bytes) -> tuple[str, ...]:
    """The names in ``/api/tags``'s answer ``{"models": [{"name": ...}, ...]}``."""
    document = _json(body)
    models = document.get("models") if isinstance(document, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("name"), str) for m in models):
        raise ValueError('not an Ollama model list: expected {"models": [{"name": ...}, ...]}')
    return tuple(dict.fromkeys(m["name"] for m in models if m["name"]))


def parse_openai_models(body: bytes) -> tuple[str, ...]:
    """The ids in an OpenAI model list ``{"data": [{"id": ...}, ...]}``."""
    document = _json(body)
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ValueError('not an OpenAI model list: expected {"data": [{"id": ...}, ...]}')
    return tuple(dict.fromkeys(m["id"] for m in data if m["id"]))


def _openai_minimal_call(call: Any):
    found = ollama_minimal_call(call)
    return found if found is not None and found[1].startswith("/v1/") else None


SERVERS: dict[str, Server] = {
    "ollama": Server(
        "ollama", *_table(_OLLAMA_ROWS), judge_ollama, "/api/version", up_on_200, "/api/tags",
        parse_ollama_models, ollama_minimal_call,
    ),
    "openai": Server(
        "openai", *_table(_OPENAI_ROWS), judge_openai, "/v1/models", up_on_200, "/v1/models",
        parse_openai_models, _openai_minimal_call,
    ),
}


def server(api: str) -> Server:
    """The description of ``api``; ValueError when this build has none."""
    try:
        return SERVERS[api]
    except KeyError:
        raise ValueError(
            f"api {api!r} needs its server description (yieldproxy.servers), which this build does not have "
            f"yet; this build knows {', '.join(SERVERS)}"
        ) from None


def check_apis(config, source: str) -> None:
    """A :class:`~yieldproxy.config.ConfigError` naming ``upstreams[i].api`` for a member this build cannot describe."""
    for index, member in enumerate(config.upstreams):
        try:
            server(member.api)
        except ValueError as e:
            raise ConfigError(f"{source}: upstreams[{index}].api: {e}") from None


def native_apis(apis: Iterable[str], method: str, path: str) -> tuple[str, ...]:
    """The apis among ``apis`` (in their order) that serve ``method path`` natively, in one dialect.

    The dialect is the first knowing api's; an api that knows the path in
    another dialect is left out.  Empty when none knows the route.
    """
    dialect = None
    out = []
    for api in dict.fromkeys(apis):
        route = server(api).route(method, path)
        if route is None:
            continue
        if dialect is None:
            dialect = route.dialect
        if route.dialect == dialect:
            out.append(api)
    return tuple(out)
