"""Which class a request belongs to: configured route rules, then the servers' own tables.

The rules, in order: docs/classes.md, "How a request gets its class"; why only routes known to run
no model pass through (an unknown one parks): "Passthrough is an allow-list".
The route tables are the servers' (one module per server, one source of truth); a classifier is
built for the apis of the upstreams it fronts, in config order.
"""

from __future__ import annotations

import functools
from fnmatch import fnmatchcase
from ipaddress import ip_address
from typing import Iterable

import attrs

from ..config import RouteRule
from ..names import CLASS_NAMES, PASSTHROUGH, name_tuple
from ..servers import Server, server
from ..servers.gojson import BadBody
from ..servers.ollama import MODEL_LOADING_PATHS, UNLOAD_PATHS, api_family, is_unload

__all__ = [
    "BadBody",
    "MODEL_LOADING_PATHS",
    "PASSTHROUGH",
    "UNLOAD_PATHS",
    "Classifier",
    "api_family",
    "header_class",
    "is_loopback",
    "is_unload",
    "runs_no_model",
]


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
    """True for a request Ollama serves without scheduling a runner (its allow-list, :mod:`yieldproxy.servers.ollama`)."""
    return path not in MODEL_LOADING_PATHS and server("ollama").route_class(method, path) == PASSTHROUGH


#: Routes whose class :class:`Classifier` keeps (paths come from clients: the cache is bounded).
_ROUTE_CACHE = 4096


@attrs.frozen
class Classifier:
    """The configured route rules in order; then the tables of the servers of ``apis``."""

    #: The ``[[routes]]`` rules, in the config file's order.
    rules: tuple[RouteRule, ...]
    #: The class of a route no rule names and no server's table holds.
    unknown_class: str = "interactive"
    #: The apis of the upstreams, in config order: their tables classify what no rule does.
    apis: tuple[str, ...] = attrs.field(default=("ollama",), converter=name_tuple)
    #: Their descriptions (an unknown api is a ValueError here).
    _servers: tuple[Server, ...] = attrs.field(
        init=False, repr=False, default=attrs.Factory(lambda self: tuple(map(server, self.apis)), takes_self=True)
    )
    #: What does not depend on the body, by (method, path): whether a model rule
    #: could match, the class without a model, and whether a rule names the route.  Every request asks; the
    #: routes are few (at most :data:`_ROUTE_CACHE` are kept).
    _routes: dict[tuple[str, str], tuple[bool, str, bool]] = attrs.field(init=False, factory=dict, eq=False, repr=False)

    @classmethod
    def from_rules(
        cls, configured: Iterable[RouteRule], unknown_class: str = "interactive", apis: Iterable[str] = ("ollama",)
    ) -> "Classifier":
        return cls(tuple(configured), unknown_class, tuple(apis))

    def _matches(self, rule: RouteRule, method: str, path: str) -> bool:
        if rule.path and path != rule.path:
            return False
        if rule.prefix and not path.startswith(rule.prefix):
            return False
        return not rule.methods or method in rule.methods

    def declares(self, method: str, path: str) -> bool:
        """True when a ``[[routes]]`` rule names this route: the operator knows it (it is never refused as unknown)."""
        return self._route(method, path)[2]

    def needs_model(self, method: str, path: str) -> bool:
        """True when a rule that could match depends on the body's model name."""
        return self._route(method, path)[0]

    def classify(self, method: str, path: str, model: str | None = None) -> str:
        """The class of the first matching rule; else the class the first server that knows
        the route gives it (a model route's class, or passthrough for a route on its
        allow-list or one that loads models, which the proxy holds during a yield); else
        the unknown-route class."""
        if model is None:
            return self._route(method, path)[1]
        return self._classify(method, path, model)

    def _route(self, method: str, path: str) -> tuple[bool, str, bool]:
        """(a rule that could match reads the model, the class without a model, a rule names the route)."""
        key = (method, path)
        known = self._routes.get(key)
        if known is None:
            known = (
                any(rule.models and self._matches(rule, method, path) for rule in self.rules),
                self._classify(method, path, None),
                any(self._matches(rule, method, path) for rule in self.rules),
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
        for known in self._servers:
            cls = known.route_class(method, path)
            if cls is not None:
                return cls
        return self.unknown_class


def header_class(value: bytes | None) -> str | None:
    """The class an ``X-Yield-Class`` header asks for; ValueError when it names none."""
    if value is None:
        return None
    wanted = value.strip().lower().decode("ascii", "replace")
    if wanted not in CLASS_NAMES:
        raise ValueError(wanted)
    return wanted
