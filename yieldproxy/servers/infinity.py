"""Infinity (michaelfeil/infinity): its routes, failures, health and models.

Read from ``libs/infinity_emb/infinity_emb/`` at
``fcb951cb679d0de185bf254600d9b7d2cd3a263a`` (the same code as infinity-emb
0.0.78, which runs here; docs/servers.md has the evidence).

**Routes** (``infinity_server.py``).  ``/embeddings`` (OpenAI's shape),
``/rerank``, ``/classify``, ``/embeddings_image`` and ``/embeddings_audio``
run the model: ``batch``.  ``/models``, ``/docs`` and ``/openapi.json`` do
not; neither do ``/health``, ``/metrics`` and ``GET /`` (a redirect to the
docs).  Every route but those last three is mounted under ``--url-prefix``
(``INFINITY_URL_PREFIX``, ``""`` by default, often ``/v1``): the table holds
both forms, and :meth:`~.base.Server.with_prefix` picks the member's for the
model list and for translated embeddings.

**Failures.**  Infinity's own errors are ``{"error": {"message", "type":
null, "param": null, "code": <status>}}`` (``OpenAIException``,
fastapi_schemas/errors.py:17-50); FastAPI's are ``{"detail": ...}`` (422 for
a body that does not validate, 404, 405).

* 429 ``model <name> is currently overloaded`` (infinity_server.py:224-228):
  more than ``INFINITY_QUEUE_SIZE`` (32,000) items wait: busy.
* 500 ``InternalServerError: ...`` is each route's ``except Exception``
  (infinity_server.py:390-394, 442-446, 486-490, 545-549, 604-608), and it is
  **not** the GPU's.  It catches only what the request's own coroutine
  raises: resolving its input and formatting its answer.  The model runs
  elsewhere, in the batch handler's worker threads, and an exception there
  (a CUDA out-of-memory in the forward pass, ``encode_core``) ends the
  thread (``ModelWorker._core_batch``, inference/batch_handler.py:562-588:
  it logs, raises ``_core_batch crashed.`` into a future nobody reads) and
  fails no request: the request, and every one after it, waits forever.  A
  GPU failure on Infinity is therefore a *hang*, which the proxy's attempt
  timeout and the outage probe see.  A caller, on the other hand, can get
  the 500 with its own input: ``encoding_format: "base64"`` (the openai
  client's default) on a model served with a bit-packed
  ``--embedding-dtype`` raises in ``to_embeddings_response``
  (fastapi_schemas/pymodels.py:159-163) inside that ``try``.  So the 500 is
  relayed, never counted as an outage.
* 400 (``ModelNotDeployedError``, ``Invalid model``, a corrupt image or
  audio), 401, 404, 405 and 422: the caller.

**Health.**  ``GET /health`` answers ``{"unix": <time>}`` and looks at no
engine, so it stays 200 after the GPU failed; while the models load Infinity
is not listening yet (``lifespan``, infinity_server.py:81-117).
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
    openai_model_ids,
    routes,
    up_on_200,
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


def error_shape(path: str) -> str:
    """Infinity's own errors are OpenAI's nested object (its clients are OpenAI clients)."""
    return "openai"


SERVER = Server(
    api="infinity",
    routes=ROUTES,
    judge=judge,
    health_path="/health",
    judge_health=up_on_200,
    models_path="/models",
    parse_models=openai_model_ids,
    minimal_call=minimal_call,
    embed_shape="openai",
    embed_path="/embeddings",
    error_shape=error_shape,
    url_prefixes=PREFIXES,
)
