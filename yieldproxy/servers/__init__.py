"""What the proxy knows about each server it can front, one module per server.

A pool member's ``api`` names one :class:`Server` description
(:data:`SERVERS`): :mod:`.ollama`, :mod:`.openai` (any OpenAI-compatible
server), :mod:`.tei`, :mod:`.infinity` and :mod:`.llamacpp`.  Each is a
frozen value read from that server's own source (docs/servers.md; :mod:`.base`
lists what it holds).  Pure data and functions: no I/O, no reactor.  :mod:`.gojson` reads a request
body the way Ollama's Go server reads it.

Layer 1: it may import the core's names, text, clock, periodic and callbacks
(and the standard library, attrs, twisted), nothing else of the package's.

For a pool of several apis, :func:`route_class` takes the first api that
knows the route and :func:`native_apis` those that speak it in one dialect
(docs/servers.md, "Several servers in one pool").
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from . import infinity, llamacpp, ollama, openai, tei
from .base import (
    BUSY,
    CALLER,
    DOWN,
    GPU,
    HEALTH,
    JUDGEMENTS,
    NOT_READY,
    OK,
    PASSTHROUGH,
    PROBE_TEXT,
    UP,
    UPSTREAM,
    Asked,
    ModelCall,
    Refusal,
    Route,
    Server,
)
from .cors import Origins

__all__ = [
    "APIS",
    "BUSY",
    "CALLER",
    "DOWN",
    "GPU",
    "HEALTH",
    "JUDGEMENTS",
    "NOT_READY",
    "OK",
    "PASSTHROUGH",
    "PROBE_TEXT",
    "SERVERS",
    "UP",
    "UPSTREAM",
    "Asked",
    "ModelCall",
    "Origins",
    "Refusal",
    "Route",
    "Server",
    "native_apis",
    "refusal",
    "refuser",
    "route_class",
    "server",
]

#: Every server description by its ``api`` name.
SERVERS: dict[str, Server] = {
    s.api: s for s in (ollama.SERVER, openai.SERVER, tei.SERVER, infinity.SERVER, llamacpp.SERVER)
}
#: The values ``[[upstreams]] api`` takes.
APIS = tuple(SERVERS)


def server(api: str) -> Server:
    """The description of ``api``; ValueError naming the known ones."""
    try:
        return SERVERS[api]
    except KeyError:
        raise ValueError(f"unknown api {api!r}; expected one of {', '.join(APIS)}") from None


def route_class(apis: Iterable[str], method: str, path: str) -> str | None:
    """The class of ``method path`` on the first of ``apis`` that knows the route, or None."""
    for api in apis:
        cls = server(api).route_class(method, path)
        if cls is not None:
            return cls
    return None


#: A path prefix whose callers speak one server's API: ``/api/`` is Ollama's
#: (llama.cpp also answers ``/api/chat``, in OpenAI's shape, which an Ollama
#: client cannot read).
_OWNERS = (("/api/", "ollama"),)


def native_apis(apis: Iterable[str], method: str, path: str) -> tuple[str, ...]:
    """The apis among ``apis`` (in their order) that serve ``method path`` natively, in one dialect.

    The dialect is the path's owner's when an api of ``apis`` speaks it
    (Ollama's for ``/api/``), else the first knowing api's; an api that
    knows the path in another dialect (a different body) is left out.
    Empty when none knows it.
    """
    known = []
    for api in dict.fromkeys(apis):
        s = server(api)
        route = s.route(method, path)
        if route is None and path in s.model_loading_paths:
            route = s.route("POST", path)
        if route is not None:
            known.append((api, route.dialect))
    if not known:
        return ()
    dialect = known[0][1]
    for prefix, owner in _OWNERS:
        if path.startswith(prefix):
            own = server(owner).route(method, path)
            if own is not None and any(d == own.dialect for _, d in known):
                dialect = own.dialect
    return tuple(api for api, d in known if d == dialect)


def refusal(apis: Iterable[str], asked: Asked, origins: Origins) -> Refusal | None:
    """The answer the upstream would give ``asked`` at once, when every api that could serve it refuses it.

    The apis that could serve it are those that serve the route natively
    (:func:`native_apis`), or every api of the pool for a route none knows;
    each refuses by its own rule (:attr:`Server.refuse`).  One that would
    take it is enough to let it in (an api whose refusals the proxy does not
    know refuses nothing), so no request a member would take is refused;
    the answer is the first api's, in its own words.
    """
    return refuser(apis)(asked, origins)


def refuser(apis: Iterable[str]) -> Callable[[Asked, Origins], Refusal | None]:
    """:func:`refusal` for one pool's ``apis``, made once: their order and servers are found here, not per request
    (a pool of one api is its server's own rule)."""
    apis = tuple(dict.fromkeys(apis))
    if len(apis) == 1:
        return server(apis[0]).refuse
    return functools.partial(_first_refusal, apis)


def _first_refusal(apis: tuple[str, ...], asked: Asked, origins: Origins) -> Refusal | None:
    candidates = native_apis(apis, asked.method, asked.path) or apis
    first: Refusal | None = None
    for api in candidates:
        refused = server(api).refuse(asked, origins)
        if refused is None:
            return None
        first = first or refused
    return first
