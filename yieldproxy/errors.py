"""Error responses in the caller's own API shape.

Ollama clients read ``{"error": "..."}``; OpenAI clients (and Infinity's and
llama.cpp's) read ``{"error": {"message", "type", "code"}}``; TEI's clients
read ``{"error": "...", "error_type": "..."}`` on its own routes and
``{"message", "code", "type"}`` on its OpenAI-compatible ones.  A proxy error
in the wrong shape surfaces as a confusing parse error in the caller, so every
refusal goes through here.  Which shape a route takes is its server's
business (:attr:`yieldproxy.servers.Server.error_shape`).
"""

from __future__ import annotations

import json
from typing import Any

from .servers.ollama import api_family

#: The longest Retry-After sent (an hour): past that a client does better to ask again
#: than to sleep on an estimate, and a caller-given estimate must not become a huge header.
MAX_RETRY_AFTER = 3600

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


#: The shapes :func:`error_body` writes.
ERROR_SHAPES = ("ollama", "openai", "tei", "tei_openai")


def tei_error_type(status: int) -> str:
    """The TEI ``ErrorType`` (router/src/lib.rs) a client of TEI expects with ``status``.

    TEI's clients may decode the type as its enum, so only its own variants
    are used: overload for 429, the unhealthy backend for 503 (a yield, a
    shutdown), a backend failure for other 5xx, a validation error for 4xx.
    """
    if status == 429:
        return "Overloaded"
    if status == 503:
        return "Unhealthy"
    return "Backend" if status >= 500 else "Validation"


def error_body(api: str, status: int, message: str, code: str) -> bytes:
    """The JSON body for an error, in the shape ``api`` names (one of :data:`ERROR_SHAPES`)."""
    if api == "openai":
        payload: dict[str, Any] = {
            "error": {
                "message": message,
                "type": _OPENAI_TYPES.get(status, "server_error"),
                "code": code,
            }
        }
    elif api == "ollama":
        payload = {"error": message}
    elif api == "tei":
        payload = {"error": message, "error_type": tei_error_type(status)}
    elif api == "tei_openai":
        payload = {"message": message, "code": status, "type": tei_error_type(status)}
    else:
        raise ValueError(f"unknown error shape {api!r}; expected one of {ERROR_SHAPES}")
    return json.dumps(payload).encode("utf-8")


def listener_error_body(path: bytes, status: int, message: str, code: str) -> bytes:
    """The error body the listeners' HTTP edge writes for a request it answers itself (edge/), in the shape of
    the API its path belongs to (the proxy's routes and the admin API's alike)."""
    return error_body(api_family(path), status, message, code)


def write_error(request: Any, api: str, status: int, message: str, code: str, retry_after: float | None = None) -> bytes:
    """Set status and headers on ``request`` and return the body to send."""
    # Twisted knows no reason phrase for 429 and would send "Unknown Status".
    request.setResponseCode(status, b"Too Many Requests" if status == 429 else None)
    request.responseHeaders.setRawHeaders(b"content-type", [b"application/json; charset=utf-8"])
    if retry_after is not None:
        seconds = min(MAX_RETRY_AFTER, max(1, int(retry_after)))
        request.responseHeaders.setRawHeaders(b"retry-after", [b"%d" % seconds])
    return error_body(api, status, message, code)


def stream_form(content_type: bytes) -> str | None:
    """``ndjson`` or ``sse`` for a stream the proxy can end with an error record of its own, else None."""
    if b"ndjson" in content_type:
        return "ndjson"
    if b"event-stream" in content_type:
        return "sse"
    return None


def stream_error_chunk(content_type: bytes, api: str, message: str) -> bytes | None:
    """The closing error in a stream's own form (NDJSON line or SSE event), if it is a stream.

    It is a whole record and must follow one: the relay writes a stream's
    records whole (upstream/records.py), so it never lands inside half of one.
    """
    form = stream_form(content_type)
    if form == "ndjson":
        return json.dumps({"error": message}).encode("utf-8") + b"\n"
    if form == "sse":
        return b"data: " + error_body(api, 502, message, "upstream_broken") + b"\n\n"
    return None
