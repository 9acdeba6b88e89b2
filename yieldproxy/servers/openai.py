"""An OpenAI-compatible server the proxy knows nothing else about (vLLM, LM Studio, a hosted API).

Only OpenAI's public API is assumed (https://platform.openai.com/docs/api-reference):
its model routes under ``/v1/`` and its model list; every other route is unknown.
Nothing is known of the server's own words, so no answer is ever read as a GPU
failure; 429 and 503 are OpenAI's "not now, try again", which no request
content can make a server send.  The table: docs/servers.md.
"""

from __future__ import annotations

from .base import (
    BUSY,
    CALLER,
    OK,
    PASSTHROUGH,
    PROBE_TEXT,
    UPSTREAM,
    MinimalCall,
    ModelCall,
    Server,
    routes,
)

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


def minimal_call(kind: ModelCall) -> MinimalCall | None:
    """One short text for embeddings; one generated token for completions."""
    model, path = kind.model, kind.path
    if path == "/v1/embeddings":
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path == "/v1/chat/completions":
        return "POST", path, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "stream": False}
    if path == "/v1/completions":
        return "POST", path, {"model": model, "prompt": "hi", "max_tokens": 1, "stream": False}
    return None


SERVER = Server(
    api="openai",
    routes=ROUTES,
    judge=judge,
    health_path="/v1/models",
    minimal_call=minimal_call,
)
