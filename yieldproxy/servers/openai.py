"""An OpenAI-compatible server the proxy knows nothing else about (vLLM, LM Studio, a hosted API).

Only OpenAI's public API is assumed (https://platform.openai.com/docs/api-reference):
its model routes under ``/v1/`` and its model list; every other route is unknown.
Nothing is known of the server's own words, so no answer is ever read as a GPU
failure; 429 and 503 are OpenAI's "not now, try again", which no request
content can make a server send.  The table: docs/servers.md.
"""

from __future__ import annotations

from .base import BUSY, CALLER, OK, PASSTHROUGH, UPSTREAM, Server, routes

ROUTES = (
    *routes("openai", "batch", "POST /v1/embeddings"),
    *routes(
        "openai", "interactive",
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/audio/transcriptions",
    ),
    *routes("openai", PASSTHROUGH, "GET /v1/models", "GET /v1/models/<name>"),
)


def judge(status: int, body: bytes) -> str:
    """``busy`` for 429 and 503, ``caller`` for any other 4xx, ``upstream`` for any other 5xx; never ``gpu``."""
    if status < 400:
        return OK
    if status in (429, 503):
        return BUSY
    return CALLER if status < 500 else UPSTREAM


SERVER = Server(
    api="openai",
    routes=ROUTES,
    judge=judge,
    health_path="/v1/models",
)
