"""Hugging Face text-embeddings-inference (TEI): its routes, failures, health and model.

Read from huggingface/text-embeddings-inference at
``0d124dc9773be6ac5a9a57d8439aba9bbbf33273`` (TEI 1.9.3).  Every route that runs the
model is ``batch``.  Its errors carry a type set by TEI's code, never by the request:
424 ``Backend`` is the GPU's unless it is one of TEI's own answers to a task the model
cannot do (:data:`WRONG_TASK`, the caller's).  While its model loads TEI is not
listening at all.  The evidence, with the lines of TEI's source: docs/servers.md.
"""

from __future__ import annotations

from .base import (
    BUSY,
    CALLER,
    GPU,
    MAX_MODEL_LIST,
    OK,
    PASSTHROUGH,
    PROBE_TEXT,
    UPSTREAM,
    MinimalCall,
    ModelCall,
    Server,
    json_object,
    routes,
    unique_names,
)

ROUTES = (
    *routes(
        "tei", "batch",
        "POST /embed", "POST /embed_all", "POST /embed_sparse", "POST /predict", "POST /rerank", "POST /similarity",
        "POST /", "POST /invocations", "POST /vertex",
    ),
    *routes("openai", "batch", "POST /embeddings", "POST /v1/embeddings"),
    *routes(
        "tei", PASSTHROUGH,
        "GET HEAD /health", "GET HEAD /", "GET HEAD /ping", "GET HEAD /info", "GET HEAD /metrics",
        "GET HEAD /docs", "GET HEAD /api-doc/openapi.json", "POST /tokenize", "POST /decode",
    ),
)

#: ``ErrorType`` (router/src/lib.rs) and the status it is sent with (server.rs).
STATUS_OF_TYPE = {
    "Unhealthy": 503,
    "Backend": 424,
    "Overloaded": 429,
    "Validation": 422,
    "Tokenizer": 422,
    "Empty": 400,
}

#: How TEI's ``Backend`` errors from the GPU's side begin (``TextEmbeddingsError::Backend``).
BACKEND_PREFIX = "Backend error: "

#: TEI's 424 ``Backend`` answers to a task the model cannot do: the route, not the GPU.
WRONG_TASK = frozenset(
    BACKEND_PREFIX + message
    for message in (
        "`embed_all` is not available for SPLADE models",  # core/src/infer.rs:131
        "Model is not an embedding model with SPLADE pooling",  # core/src/infer.rs:182
        "`normalize` is not available for SPLADE models",  # core/src/infer.rs:241
        "Model is not an embedding model",  # core/src/infer.rs:337
        "Model is not a classifier model",  # core/src/infer.rs:403
        "model is not a re-ranker model",  # router/src/http/server.rs:337
        "raw embeddings are not supported for the Python backend.",  # backends/python/src/lib.rs:78, 107
    )
)

_OPENAI_PATHS = frozenset({"/embeddings", "/v1/embeddings"})


def tei_error(body: bytes) -> tuple[str, str] | None:
    """``(type, message)`` of a TEI error body, in either of its shapes, or None.

    Only TEI's exact structures count: ``{"error": str, "error_type": str}``
    or ``{"message": str, "code": int, "type": str}``, nothing more.
    """
    document = json_object(body)
    if document is None:
        return None
    if document.keys() == {"error", "error_type"}:
        kind, message = document["error_type"], document["error"]
    elif document.keys() == {"message", "code", "type"} and type(document["code"]) is int:
        kind, message = document["type"], document["message"]
    else:
        return None
    if isinstance(kind, str) and isinstance(message, str) and kind in STATUS_OF_TYPE:
        return kind, message
    return None


def judge(status: int, body: bytes) -> str:
    """``gpu`` for a backend failure or an unhealthy backend, ``busy`` when overloaded,
    ``caller`` for its validation errors and a task the model cannot do, else by status."""
    if status < 400:
        return OK
    error = tei_error(body)
    if error is not None and STATUS_OF_TYPE[error[0]] == status:
        kind, message = error
        if kind == "Unhealthy":
            return GPU
        if kind == "Overloaded":
            return BUSY
        if kind == "Backend":
            if message in WRONG_TASK:
                return CALLER
            return GPU if message.startswith(BACKEND_PREFIX) else UPSTREAM
        return CALLER
    return CALLER if status < 500 else UPSTREAM


def parse_models(body: bytes) -> tuple[str, ...]:
    """``/info``'s ``served_model_name`` and ``model_id`` (router/src/lib.rs ``Info``)."""
    document = json_object(body, MAX_MODEL_LIST)
    if document is None or not isinstance(document.get("model_id"), str):
        raise ValueError('not TEI\'s /info: expected {"model_id": ...}')
    served = document.get("served_model_name")
    return unique_names([served if isinstance(served, str) else "", document["model_id"]])


def minimal_call(kind: ModelCall) -> MinimalCall | None:
    """One short text on the failed route; None for ``/``, ``/invocations`` and ``/vertex``,
    whose task depends on the model (the health route, which runs the model after a failure, probes those)."""
    path = kind.path
    if path in ("/embed", "/embed_all", "/embed_sparse", "/predict"):
        return "POST", path, {"inputs": PROBE_TEXT}
    if path == "/rerank":
        return "POST", path, {"query": PROBE_TEXT, "texts": [PROBE_TEXT]}
    if path == "/similarity":
        return "POST", path, {"inputs": {"source_sentence": PROBE_TEXT, "sentences": [PROBE_TEXT]}}
    if path in _OPENAI_PATHS:
        return "POST", path, {"model": kind.model, "input": PROBE_TEXT}
    return None


def error_shape(path: str) -> str:
    """TEI's flat OpenAI-compatible shape on its OpenAI routes, its own elsewhere."""
    return "tei_openai" if path in _OPENAI_PATHS else "tei"


SERVER = Server(
    api="tei",
    routes=ROUTES,
    judge=judge,
    health_path="/health",
    minimal_call=minimal_call,
    models_path="/info",
    parse_models=parse_models,
    error_shape=error_shape,
)
