"""llama.cpp's server (``llama-server``): its routes, failures, health and model.

Read from ggml-org/llama.cpp at ``aa6192d38defc9a5d9fb2987413f71b18f214270``
(``tools/server/``).  Only the whole message ``Compute error.`` is the GPU's: any 500
answers an exception with its text, and a parse error quotes the body.  Its 503
``Loading model`` is *not ready*, never an outage, and an input too large for the batch
(:data:`TOO_LARGE`) is the caller's.  The evidence, with the lines of llama.cpp's source
and what the real server answers here: docs/servers.md.
"""

from __future__ import annotations

import re

from .base import (
    BUSY,
    CALLER,
    DOWN,
    GPU,
    NOT_READY,
    OK,
    PASSTHROUGH,
    PROBE_TEXT,
    UP,
    UPSTREAM,
    MinimalCall,
    ModelCall,
    Server,
    json_object,
    openai_call,
    routes,
)

ROUTES = (
    *routes("llamacpp", "interactive", "POST /completion", "POST /completions", "POST /infill", "POST /api/chat"),
    *routes("openai", "interactive", "POST /v1/completions", "POST /chat/completions", "POST /v1/chat/completions"),
    *routes("anthropic", "interactive", "POST /v1/messages"),
    *routes(
        "llamacpp", "batch",
        "POST /embedding", "POST /embeddings", "POST /rerank", "POST /reranking", "POST /v1/rerank",
        "POST /v1/reranking",
    ),
    *routes("openai", "batch", "POST /v1/embeddings"),
    *routes(
        "llamacpp", PASSTHROUGH,
        "GET HEAD /health", "GET HEAD /v1/health", "GET HEAD /metrics", "GET HEAD /props", "POST /props",
        "GET HEAD /models", "GET HEAD /api/tags", "GET HEAD /slots", "POST /slots/<id_slot>",
        "GET HEAD /lora-adapters", "POST /lora-adapters", "GET HEAD /", "POST /api/show", "POST /tokenize",
        "POST /detokenize", "POST /apply-template",
    ),
    *routes("openai", PASSTHROUGH, "GET HEAD /v1/models"),
    *routes("anthropic", PASSTHROUGH, "POST /v1/messages/count_tokens"),
)

#: ``update_slots`` (server.cpp): what every processing slot gets when ``llama_decode`` fails on the device.
COMPUTE_ERROR = "Compute error."
#: ``middleware_server_state`` (server-http.cpp): every route but the model lists while the model loads.
LOADING = "Loading model"
#: ``get_slots`` with ``fail_on_no_slot`` (server.cpp): every slot is busy.
NO_SLOT = "no slot available"
#: ``update_slots`` (server-context.cpp): an input that cannot be split, over the physical batch: the caller's.
TOO_LARGE = re.compile(r"input \(\d+ tokens\) is too large to process\b")
#: ``update_slots``'s other decode failures: the shared context, not the device nor one caller.
SHARED_FAILURES = frozenset({"Context size has been exceeded.", "Invalid input batch."})

#: ``format_error_response`` (server-common.cpp): each error type's status.
STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}


def llamacpp_error(body: bytes) -> tuple[str, str] | None:
    """``(type, message)`` of a llama.cpp error body, or None.

    Only its structure counts: ``{"error": {"code": int, "message": str,
    "type": str, ...}}`` with nothing else at the top, the code the type's status.
    """
    document = json_object(body)
    if document is None or document.keys() != {"error"}:
        return None
    error = document["error"]
    if not isinstance(error, dict):
        return None
    code, message, kind = error.get("code"), error.get("message"), error.get("type")
    if type(code) is not int or not isinstance(message, str) or not isinstance(kind, str) or STATUS_OF_TYPE.get(kind) != code:
        return None
    return kind, message


def judge(status: int, body: bytes) -> str:
    """``gpu`` for a compute error, ``not_ready`` while loading, ``busy`` for no free slot,
    ``upstream`` for shared-context failures and missing features, else the caller's."""
    if status < 400:
        return OK
    error = llamacpp_error(body)
    if error is None or STATUS_OF_TYPE[error[0]] != status:
        return CALLER if status < 500 else UPSTREAM
    kind, message = error
    if kind == "server_error":
        if message == COMPUTE_ERROR:
            return GPU
        if TOO_LARGE.match(message):
            return CALLER
        return UPSTREAM if message in SHARED_FAILURES else CALLER
    if kind == "unavailable_error":
        if message == LOADING:
            return NOT_READY
        return BUSY if message == NO_SLOT else UPSTREAM
    if kind == "not_supported_error":
        return UPSTREAM
    return CALLER


def judge_health(status: int, body: bytes) -> str:
    """``up`` on 200, ``not_ready`` on its 503 ``Loading model``, else ``down``."""
    if status == 200:
        return UP
    if status == 503 and llamacpp_error(body) == ("unavailable_error", LOADING):
        return NOT_READY
    return DOWN


def _tiny_chat() -> list[dict[str, str]]:
    return [{"role": "user", "content": "hi"}]


def minimal_call(kind: ModelCall) -> MinimalCall | None:
    """One generated token, or one short text embedded or reranked, on the failed route."""
    model, path = kind.model, kind.path
    if path in ("/completion", "/completions"):
        return "POST", path, {"prompt": "hi", "n_predict": 1, "stream": False}
    if path == "/infill":
        return "POST", path, {"input_prefix": "hi", "input_suffix": "", "n_predict": 1, "stream": False}
    if path in ("/chat/completions", "/v1/chat/completions", "/api/chat"):
        return "POST", path, {"model": model, "messages": _tiny_chat(), "max_tokens": 1, "stream": False}
    if path == "/v1/messages":
        return "POST", path, {"model": model, "messages": _tiny_chat(), "max_tokens": 1}
    if path in ("/embedding", "/embeddings"):
        return "POST", path, {"content": PROBE_TEXT}
    if path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        return "POST", path, {"query": PROBE_TEXT, "documents": [PROBE_TEXT]}
    return openai_call(kind)  # /v1/completions, /v1/embeddings


SERVER = Server(
    api="llamacpp",
    routes=ROUTES,
    judge=judge,
    health_path="/health",
    judge_health=judge_health,
    minimal_call=minimal_call,
)
