"""
Infinity (michaelfeil/infinity): its routes, answers and errors.

From ``libs/infinity_emb/infinity_emb/infinity_server.py``,
``fastapi_schemas/pymodels.py`` and ``fastapi_schemas/errors.py`` (commit
fcb951c, the same as infinity-emb 0.0.78, which runs here), and checked
against that real server: docs/servers.md has the details.  With one model
Infinity answers whatever ``model`` a request names, with the served name.
Its own errors are OpenAI-like ``{"error": {"message", "type": null,
"param": null, "code"}}``; FastAPI's are ``{"detail": ...}`` (422 for a
body that does not validate, 404, 405).

Infinity is often started with ``--url-prefix /v1``: the sim answers the
model routes and ``/models`` both with and without that prefix
(``/health`` and ``/metrics`` are never prefixed).
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.web.server import Request

from .api import Api, BadRequest, Reply, Route, Sim, dumps
from .content import (
    count_tokens,
    encode_base64_f32,
    expected_embedding,
    expected_labels,
    expected_relevance,
)
from .jobs import Job

#: pymodels.py: the name a request without ``model`` carries.
DEFAULT_MODEL = "default/not-specified"

#: What an embedding call gets once the GPU failed: torch's error, wrapped by
#: the route's ``except Exception`` as ``InternalServerError: {ex}``.
OOM_MESSAGE = (
    "InternalServerError: CUDA out of memory. Tried to allocate 20.00 MiB. "
    "GPU 0 has a total capacity of 7.79 GiB of which 3.12 MiB is free."
)

_GET = ("GET",)
_POST = ("POST",)
_ROUTES: dict[str, Route] = {
    "/health": Route(_GET, "info", "infinity", "health"),
    "/metrics": Route(_GET, "info", "infinity", "metrics"),
    "/": Route(_GET, "info", "infinity", "root"),
    "/_sim/stats": Route(("GET", "HEAD"), "info", "infinity", "stats"),
}
for _prefix in ("", "/v1"):
    _ROUTES.update({
        f"{_prefix}/embeddings": Route(_POST, "batch", "infinity", "embeddings"),
        f"{_prefix}/rerank": Route(_POST, "batch", "infinity", "rerank"),
        f"{_prefix}/classify": Route(_POST, "batch", "infinity", "classify"),
        f"{_prefix}/models": Route(_GET, "info", "infinity", "models"),
    })


def _openai_error(code: int, message: str) -> Reply:
    """errors.py ``OpenAIException.json()``: type and param are always null."""
    return Reply(code, dumps({"error": {"message": message, "type": None, "param": None, "code": code}}))


class _Invalid(BadRequest):
    """A body FastAPI's validation refuses: 422 ``{"detail": [...]}``."""

    def __init__(self, *detail: dict[str, Any]) -> None:
        super().__init__(json.dumps(list(detail)), "validation")


def _missing(field: str, body: Any, loc: tuple[str, ...] = ("body",)) -> _Invalid:
    return _Invalid({"type": "missing", "loc": [*loc, field], "msg": "Field required", "input": body})


def _strings(value: Any, field: str, loc: tuple[str, ...], single: bool) -> list[str]:
    """
    A non-empty list of strings (or, when ``single``, one string), refused as pydantic refuses it.

    ``single`` is ``/embeddings``' ``Union[conlist(str), str]``: pydantic then
    reports each branch, its location suffixed with the branch's name.
    """
    if single and isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    where: list[str | int] = [*loc, field, "list[constrained-str]"] if single else [*loc, field]
    if isinstance(value, list) and not value:
        detail = [{
            "type": "too_short", "loc": where,
            "msg": "List should have at least 1 item after validation, not 0", "input": [],
            "ctx": {"field_type": "List", "min_length": 1, "actual_length": 0},
        }]
    elif isinstance(value, list):
        detail = [{"type": "string_type", "loc": [*where, i], "msg": _NOT_A_STRING, "input": v}
                  for i, v in enumerate(value) if not isinstance(v, str)]
    else:
        detail = [{"type": "list_type", "loc": where, "msg": "Input should be a valid list", "input": value}]
    if single:
        detail.append({"type": "string_type", "loc": [*loc, field, "constrained-str"], "msg": _NOT_A_STRING,
                       "input": value})
    raise _Invalid(*detail)


_NOT_A_STRING = "Input should be a valid string"


class InfinityApi(Api):
    """Infinity: embeddings, rerank and classify, one model served under any name."""

    name = "infinity"
    routes = _ROUTES

    def style_of(self, path: str) -> str:
        return "infinity"

    def error(self, style: str, failure: str, message: str, job: Job | None = None) -> Reply:
        if failure == "not_found":
            return Reply(404, dumps({"detail": "Not Found"}))
        if failure == "method":
            return Reply(405, dumps({"detail": "Method Not Allowed"}))
        if failure == "validation":
            return Reply(422, dumps({"detail": json.loads(message)}))
        if failure == "busy":
            model = job.options.get("requested", DEFAULT_MODEL) if job is not None else DEFAULT_MODEL
            return _openai_error(429, f"model {model} is currently overloaded")
        if failure == "outage":
            return _openai_error(500, OOM_MESSAGE)
        if failure == "internal":
            return _openai_error(500, "InternalServerError: sim internal error")
        return _openai_error(400, message)

    def read(self, request: Request) -> Any:
        raw = request.content.read() if request.content is not None else b""
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Invalid({"type": "json_invalid", "loc": ["body", getattr(e, "pos", 0)],
                            "msg": "JSON decode error", "input": {},
                            "ctx": {"error": getattr(e, "msg", str(e))}}) from None

    def parse(self, sim: Sim, job: Job, body: Any) -> None:
        if not isinstance(body, dict):
            raise _Invalid({"type": "model_attributes_type", "loc": ["body"], "input": body,
                            "msg": "Input should be a valid dictionary or object to extract fields from"})
        requested = body.get("model", DEFAULT_MODEL)
        job.options["requested"] = requested if isinstance(requested, str) else DEFAULT_MODEL
        job.model = job.key = sim.served_model
        op = job.route.op
        if op == "embeddings":
            loc = ("body", "text")
            if "input" not in body:
                raise _missing("input", body, loc)
            job.texts = _strings(body["input"], "input", loc, single=True)
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise _Invalid({"type": "enum", "loc": [*loc, "encoding_format"], "input": fmt,
                                "msg": "Input should be 'float' or 'base64'"})
            job.encoding_format = fmt
            dimensions = body.get("dimensions", 0)
            if isinstance(dimensions, int) and not isinstance(dimensions, bool) and 0 < dimensions < sim.dim:
                job.dimensions = dimensions
        elif op == "rerank":
            if not isinstance(body.get("query"), str):
                raise _missing("query", body)
            if "documents" not in body:
                raise _missing("documents", body)
            job.texts = _strings(body["documents"], "documents", ("body",), single=False)
            top_n = body.get("top_n")
            job.options.update(query=body["query"], top_n=top_n if isinstance(top_n, int) and top_n > 0 else None,
                               return_documents=body.get("return_documents") is True)
        else:
            if "input" not in body:
                raise _missing("input", body)
            job.texts = _strings(body["input"], "input", ("body",), single=False)

    def answer(self, sim: Sim, job: Job) -> Any:
        op, model = job.route.op, job.model
        tokens = sum(count_tokens(t) for t in job.texts)
        if op == "embeddings":
            # Infinity's matryoshka dimensions truncate the vector, without renormalising it.
            vectors = [expected_embedding(t, model, sim.dim)[: job.dimensions or sim.dim] for t in job.texts]
            encode = encode_base64_f32 if job.encoding_format == "base64" else list
            data: Any = [{"object": "embedding", "embedding": encode(v), "index": i} for i, v in enumerate(vectors)]
            kind = "list"
        elif op == "rerank":
            query = job.options["query"]
            tokens += count_tokens(query) * len(job.texts)
            results = sorted(
                ({"relevance_score": expected_relevance(query, text, model), "index": i,
                  "document": text if job.options["return_documents"] else None}
                 for i, text in enumerate(job.texts)),
                key=lambda r: cast(float, r["relevance_score"]), reverse=True,
            )
            kind, data = "rerank", results[: job.options["top_n"]]
        else:
            kind = "classify"
            data = [[{"score": score, "label": label} for label, score in expected_labels(t, model)] for t in job.texts]
        return {
            "object": kind,
            "results" if kind == "rerank" else "data": data,
            "model": sim.served_model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "id": sim.next_id("infinity"),
            "created": int(sim.now()),
        }

    def info(self, sim: Sim, request: Request, route: Route) -> Reply:
        op = route.op
        if op == "health":
            return Reply(200, dumps({"unix": sim.now()}))
        if op == "root":
            return Reply(307, b"", b"text/plain; charset=utf-8", ((b"location", b"/docs"),))
        if op == "metrics":
            return Reply(200, b"# TYPE http_requests_total counter\n", b"text/plain; version=1.0.0; charset=utf-8")
        queued = sim.queued
        return Reply(200, dumps({
            "data": [{
                "id": sim.served_model,
                "stats": {
                    "queue_fraction": queued / max(1, sim.max_queue),
                    "queue_absolute": queued,
                    "results_pending": sim.serving,
                    "batch_size": 32,
                },
                "object": "model",
                "owned_by": "infinity",
                "created": int(sim.now()),
                "backend": "torch",
                "capabilities": ["embed", "rerank", "classify"],
            }],
            "object": "list",
        }))


INFINITY = InfinityApi()
