"""Error responses in the caller's own API shape.

Ollama clients read ``{"error": "..."}``; OpenAI clients read
``{"error": {"message", "type", "code"}}``.  A proxy error in the wrong shape
surfaces as a confusing parse error in the caller, so every refusal goes
through here.
"""

from __future__ import annotations

import json

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


def error_body(api: str, status: int, message: str, code: str) -> bytes:
    """The JSON body for an error, shaped for ``api`` (``ollama`` or ``openai``)."""
    if api == "openai":
        payload = {
            "error": {
                "message": message,
                "type": _OPENAI_TYPES.get(status, "server_error"),
                "code": code,
            }
        }
    else:
        payload = {"error": message}
    return json.dumps(payload).encode("utf-8")


def write_error(request, api: str, status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """Set status and headers on ``request`` and return the body to send."""
    # Twisted knows no reason phrase for 429 and would send "Unknown Status".
    request.setResponseCode(status, b"Too Many Requests" if status == 429 else None)
    request.responseHeaders.setRawHeaders(b"content-type", [b"application/json; charset=utf-8"])
    if retry_after is not None:
        seconds = min(MAX_RETRY_AFTER, max(1, int(retry_after)))
        request.responseHeaders.setRawHeaders(b"retry-after", [b"%d" % seconds])
    return error_body(api, status, message, code)


def stream_error_chunk(content_type: bytes, api: str, message: str) -> bytes | None:
    """The closing error in a stream's own form (NDJSON line or SSE event), if it is a stream."""
    if b"ndjson" in content_type:
        return json.dumps({"error": message}).encode("utf-8") + b"\n"
    if b"event-stream" in content_type:
        return b"data: " + error_body(api, 502, message, "upstream_broken") + b"\n\n"
    return None
