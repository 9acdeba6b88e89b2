"""The routes the sim answers, and the JSON it writes (bodies, events, errors)."""

from __future__ import annotations

import json
from typing import Any

import attrs

SIM_VERSION = "0.12.0-sim"
_JSON = b"application/json; charset=utf-8"
_NDJSON = b"application/x-ndjson"
_SSE = b"text/event-stream"


@attrs.frozen
class _Route:
    """What a path is: its methods, whether it needs the model, its API."""

    methods: tuple[str, ...]
    kind: str  # "model" or "info"
    style: str  # "ollama" or "openai"
    op: str


_ROUTES: dict[str, _Route] = {
    "/api/embed": _Route(("POST",), "model", "ollama", "embed"),
    "/api/embeddings": _Route(("POST",), "model", "ollama", "embeddings"),
    "/v1/embeddings": _Route(("POST",), "model", "openai", "v1_embeddings"),
    "/api/chat": _Route(("POST",), "model", "ollama", "chat"),
    "/api/generate": _Route(("POST",), "model", "ollama", "generate"),
    "/v1/chat/completions": _Route(("POST",), "model", "openai", "v1_chat"),
    "/v1/completions": _Route(("POST",), "model", "openai", "v1_completions"),
    "/": _Route(("GET", "HEAD"), "info", "ollama", "root"),
    "/api/version": _Route(("GET", "HEAD"), "info", "ollama", "version"),
    "/api/tags": _Route(("GET", "HEAD"), "info", "ollama", "tags"),
    "/api/ps": _Route(("GET", "HEAD"), "info", "ollama", "ps"),
    "/v1/models": _Route(("GET", "HEAD"), "info", "openai", "v1_models"),
    "/_sim/stats": _Route(("GET", "HEAD"), "info", "ollama", "stats"),
}

_EMBED_OPS = ("embed", "embeddings", "v1_embeddings")


def _dumps(obj: Any) -> bytes:
    """Compact JSON, as Ollama writes it."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def _sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj``."""
    return b"data: " + _dumps(obj) + b"\n\n"


def _error_body(style: str, code: int, message: str) -> dict[str, Any]:
    """Ollama's ``{"error": "..."}`` or OpenAI's ``{"error": {...}}``."""
    if style == "ollama":
        return {"error": message}
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
    }.get(code, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
