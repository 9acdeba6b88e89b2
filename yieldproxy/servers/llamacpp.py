"""llama.cpp's server (``llama-server``): its routes, failures, health and model.

Read from ggml-org/llama.cpp at ``aa6192d38defc9a5d9fb2987413f71b18f214270``
(``tools/server/``; docs/servers.md has the evidence).

**Routes** (``server.cpp`` ``main()``, the ``ctx_http.get``/``post`` table).
Completions, chat (OpenAI's, Anthropic's ``/v1/messages`` and Ollama's path
``/api/chat`` with OpenAI-shaped answers) and ``/infill`` are
``interactive``; ``/embedding``, ``/embeddings``, ``/v1/embeddings`` and the
four rerank paths are ``batch``.  Health, metrics, props, the model lists,
the tokenizer, template rendering, token counting, LoRA and slot settings
run no model.  cpp-httplib answers ``HEAD`` with the ``GET`` handler and the
pre-routing handler answers every ``OPTIONS`` itself (server-http.cpp).

Note the dialects: ``/embeddings`` is llama.cpp's native embedding route (a
bare list, a vector per token without pooling), not OpenAI's, which lives at
``/v1/embeddings`` only; ``/completions`` is the native completion, OpenAI's
is ``/v1/completions``.

**Failures.**  Errors are ``{"error": {"code", "message", "type"}}``
(``format_error_response``, server-common.cpp), the status following the type.

* 500 ``server_error`` ``Compute error.``: ``llama_decode`` failed on the
  device; every slot being processed gets it (``update_slots``, server.cpp).
  Only the whole message counts: a 500 can also quote the request, since
  ``ex_wrapper`` (server.cpp) answers *any* exception 500 with its
  ``what()``, and nlohmann's parse errors end ``last read: '<the body>'``.
  A CUDA out-of-memory inside ggml usually aborts the process instead: the
  connection drops.
* 503 ``unavailable_error`` ``Loading model``: the model is still loading
  (``middleware_server_state``, server-http.cpp; the HTTP server starts before
  the model loads): not ready yet.
* 503 ``unavailable_error`` ``no slot available``: ``GET
  /slots?fail_on_no_slot=1`` with every slot busy (the sim's full queue says
  the same).  The real server otherwise queues without bound.
* 500 ``server_error`` ``Context size has been exceeded.`` or ``Invalid input
  batch.`` (``llama_decode`` returning 1 at a batch of one, or -1): the
  shared context is full or the batch was refused; every processing slot
  gets it.  Not the device, not this caller alone: relayed.
* 500 ``server_error`` ``input (N tokens) is too large to process. increase
  the physical batch size (current batch size: B)`` (newer builds: ``... too
  large to process with the current encoder/runtime limits. ...``): an input
  that cannot be split (an embedding, a rerank) over ``n_ubatch``
  (``update_slots``, ``!slot.can_split()``, tools/server/server-context.cpp
  in the llama.cpp that llama-cpp-python 0.3.36 vendors; seen on the real
  server, tests/test_llamacpp_real.py).  Only that slot is released: the
  caller's input, named as such (:data:`TOO_LARGE`), never an outage.
* Any other 500 ``server_error``: the caller (a malformed JSON body, a chat
  body it cannot parse).
* 501 ``not_supported_error``: the server was started without the feature
  (``--embeddings``, ``--reranking``, ``--slots``): relayed.
* 400, 401, 403, 404 (also for a known path with another method: no 405 in
  cpp-httplib): the caller.

**Health.**  ``GET /health`` answers ``{"status":"ok"}``, 503 ``Loading
model`` while loading, and stays 200 after a compute error.

**Model.**  One per server; ``/v1/models`` lists it (its ``--alias``, else its
path) and answers during the load too.
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
    openai_model_ids,
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
    if path == "/v1/completions":
        return "POST", path, {"model": model, "prompt": "hi", "max_tokens": 1, "stream": False}
    if path in ("/chat/completions", "/v1/chat/completions", "/api/chat"):
        return "POST", path, {"model": model, "messages": _tiny_chat(), "max_tokens": 1, "stream": False}
    if path == "/v1/messages":
        return "POST", path, {"model": model, "messages": _tiny_chat(), "max_tokens": 1}
    if path in ("/embedding", "/embeddings"):
        return "POST", path, {"content": PROBE_TEXT}
    if path == "/v1/embeddings":
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        return "POST", path, {"query": PROBE_TEXT, "documents": [PROBE_TEXT]}
    return None


def error_shape(path: str) -> str:
    """llama.cpp's errors are OpenAI's nested object on every route (``/api/chat`` too)."""
    return "openai"


SERVER = Server(
    api="llamacpp",
    routes=ROUTES,
    judge=judge,
    health_path="/health",
    judge_health=judge_health,
    models_path="/v1/models",
    parse_models=openai_model_ids,
    minimal_call=minimal_call,
    embed_shape="openai",
    embed_path="/v1/embeddings",
    error_shape=error_shape,
)
