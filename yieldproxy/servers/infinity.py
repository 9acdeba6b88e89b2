"""Infinity (michaelfeil/infinity): its routes, failures, health and models.

Read from ``libs/infinity_emb/infinity_emb/`` at ``fcb951cb679d0de185bf254600d9b7d2cd3a263a``
(the code of infinity-emb 0.0.78, which the real-server tests run).  Its routes sit under
``--url-prefix`` (none or ``/v1``: the table holds both).  A GPU failure on Infinity is a
hang, not an answer (the batch worker's thread dies), and its 500 can be the caller's own:
so no answer of it is ever the GPU's.  The evidence, with the lines of Infinity's source:
docs/servers.md.
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
    nested_error,
    routes,
)

#: ``--url-prefix`` values the table knows: none (the default) and ``/v1``.
PREFIXES = ("", "/v1")

ROUTES = (
    *(route for p in PREFIXES for route in routes("openai", "batch", f"POST {p}/embeddings")),
    *(
        route
        for p in PREFIXES
        for route in routes(
            "infinity", "batch",
            f"POST {p}/rerank", f"POST {p}/classify", f"POST {p}/embeddings_image", f"POST {p}/embeddings_audio",
        )
    ),
    *(route for p in PREFIXES for route in routes("openai", PASSTHROUGH, f"GET {p}/models")),
    *(route for p in PREFIXES for route in routes("infinity", PASSTHROUGH, f"GET {p}/docs", f"GET {p}/openapi.json")),
    *routes("infinity", PASSTHROUGH, "GET /health", "GET /metrics", "GET /"),
)

_EMBEDDINGS = {f"{p}/embeddings" for p in PREFIXES}
_RERANK = {f"{p}/rerank" for p in PREFIXES}
_CLASSIFY = {f"{p}/classify" for p in PREFIXES}


def infinity_error(body: bytes) -> tuple[int, str] | None:
    """``(code, message)`` of an ``OpenAIException`` body, or None.

    Only its exact structure counts: ``{"error": {"message": str, "type",
    "param", "code": int}}`` and nothing else at the top.
    """
    error = nested_error(body)
    if error is None or error.keys() != {"message", "type", "param", "code"} or type(error["code"]) is not int:
        return None
    return error["code"], error["message"]


def judge(status: int, body: bytes) -> str:
    """``busy`` for its full queue, ``caller`` for any other 4xx, ``upstream`` for any 5xx; never ``gpu``
    (a GPU failure makes Infinity hang, see the module docstring)."""
    if status < 400:
        return OK
    error = infinity_error(body)
    if status == 429 and error is not None and error[0] == 429:
        message = error[1]
        if message.startswith("model ") and message.endswith(" is currently overloaded"):
            return BUSY
    return CALLER if status < 500 else UPSTREAM


def minimal_call(kind: ModelCall) -> MinimalCall | None:
    """One short text on the failed route (under its own prefix); None for images and audio."""
    model, path = kind.model, kind.path
    if path in _EMBEDDINGS:
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path in _RERANK:
        return "POST", path, {"model": model, "query": PROBE_TEXT, "documents": [PROBE_TEXT]}
    if path in _CLASSIFY:
        return "POST", path, {"model": model, "input": [PROBE_TEXT]}
    return None


SERVER = Server(
    api="infinity",
    routes=ROUTES,
    judge=judge,
    health_path="/health",
    minimal_call=minimal_call,
    models_path="/models",
    embed_path="/embeddings",
    url_prefixes=PREFIXES,
)
