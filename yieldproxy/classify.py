"""Which class a request belongs to: configured route rules, then the defaults.

``interactive`` wants an answer in seconds, ``batch`` can wait, ``long`` can
wait minutes; ``passthrough`` routes (model lists, version, ...) are never
parked.  Rules match on method, path or path prefix, and optionally on the
model named in the JSON body; the first rule that matches wins.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from ipaddress import ip_address
from typing import Any, Iterable

import attrs

from .config import RouteRule

PASSTHROUGH = "passthrough"
CLASSES = ("interactive", "batch", "long")

#: DESIGN.md's default routes; everything else is passthrough.
DEFAULT_RULES: tuple[RouteRule, ...] = tuple(
    RouteRule(cls=cls, path=path)
    for path, cls in [
        ("/api/embed", "batch"),
        ("/api/embeddings", "batch"),
        ("/v1/embeddings", "batch"),
        ("/api/chat", "interactive"),
        ("/api/generate", "interactive"),
        ("/v1/chat/completions", "interactive"),
        ("/v1/completions", "interactive"),
    ]
)

#: Routes that make Ollama fetch or build a model; held (as ``long``) during a yield.
MODEL_LOADING_PATHS = frozenset({"/api/pull", "/api/create"})
#: Routes where ``keep_alive: 0`` with nothing to compute is an unload request.
_UNLOAD_INPUT_KEYS = {"/api/generate": "prompt", "/api/chat": "messages", "/api/embed": "input"}


class BadBody(ValueError):
    """The body had to be read (to find the model) and is not a JSON object."""


def api_family(path: bytes) -> str:
    """``openai`` for /v1/ routes, else ``ollama``: the shape of our error bodies."""
    return "openai" if path.startswith(b"/v1/") else "ollama"


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and unix-socket peers (host None)."""
    if host is None:
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or :class:`BadBody` saying what is wrong."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadBody(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadBody("request body is nested too deeply to read") from None
    if not isinstance(value, dict):
        raise BadBody("request body must be a JSON object")
    return value


def is_unload(path: str, body: dict[str, Any]) -> bool:
    """True for Ollama's unload idiom: ``keep_alive: 0`` and nothing to compute.

    An unload frees GPU memory and never loads anything, so it may pass even
    while the GPU is yielded.
    """
    key = _UNLOAD_INPUT_KEYS.get(path)
    if key is None or body.get("keep_alive") not in (0, "0", "0s", "0m"):
        return False
    return not body.get(key)


@attrs.frozen
class Classifier:
    """Route rules in order, the configured ones before the defaults."""

    rules: tuple[RouteRule, ...]

    @classmethod
    def from_rules(cls, configured: Iterable[RouteRule]) -> "Classifier":
        return cls((*configured, *DEFAULT_RULES))

    def _matches(self, rule: RouteRule, method: str, path: str) -> bool:
        if rule.path and path != rule.path:
            return False
        if rule.prefix and not path.startswith(rule.prefix):
            return False
        return not rule.methods or method in rule.methods

    def needs_model(self, method: str, path: str) -> bool:
        """True when a rule that could match depends on the body's model name."""
        return any(rule.models and self._matches(rule, method, path) for rule in self.rules)

    def classify(self, method: str, path: str, model: str | None = None) -> str:
        """The class of the first matching rule, or ``passthrough``."""
        for rule in self.rules:
            if not self._matches(rule, method, path):
                continue
            if rule.models and not (model and any(fnmatchcase(model, m) for m in rule.models)):
                continue
            return rule.cls
        return PASSTHROUGH


def header_class(value: bytes | None) -> str | None:
    """The class an ``X-Yield-Class`` header asks for; ValueError when it names none."""
    if value is None:
        return None
    wanted = value.strip().lower().decode("ascii", "replace")
    if wanted not in CLASSES:
        raise ValueError(wanted)
    return wanted
