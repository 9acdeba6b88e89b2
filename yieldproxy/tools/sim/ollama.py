"""
Ollama's API: its routes, its answers, its errors (and the OpenAI-compatible routes it serves).

Shapes follow Ollama's ``api/types.go`` and ``server/routes.go``: compact
JSON, durations in nanoseconds, RFC 3339 timestamps, ``{"error": "..."}`` on
its own routes and OpenAI's error object on ``/v1/`` ones.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from typing import Any

from twisted.web.server import Request

from ...servers import ollama as ollama_front
from ...servers.base import Asked
from . import ollama_requests, openai
from .api import NDJSON, SSE, Api, BadRequest, Reply, Route, Sim, dumps
from .content import canonical_model, count_tokens, expected_embedding
from .jobs import Job
from .models import FOREVER, LoadedModel
from .ollama_requests import EMBED_OPS

SIM_VERSION = "0.12.0-sim"

OOM_ERROR = "llama runner process has terminated: CUDA error: out of memory"
"""The error a model request gets in ``error500`` mode, in Ollama's wording."""

UNKNOWN_ERROR = "CUDA error: an illegal memory access was encountered"
"""The error a model request gets in ``error500_unknown`` mode: a GPU fault in words no list has
(neither a prefix of Ollama's nor one of its out-of-memory substrings)."""

LOAD_OOM_ERROR = "llama runner process has terminated: cudaMalloc failed: out of memory"
"""What a request whose ``num_ctx`` passes ``max_num_ctx`` gets: its own load does not fit."""

BUSY_ERROR = "server busy, please try again.  maximum pending requests exceeded"
"""Ollama's 503 once ``OLLAMA_MAX_QUEUE`` requests wait (see ``max_queue``)."""

_FINGERPRINT = "fp_ollama"
#: Ollama's default CORS origins (no ``OLLAMA_ORIGINS``).
_ORIGINS = ollama_front.allowed_origins()

_ROUTES: dict[str, Route] = {
    "/api/embed": Route(("POST",), "batch", "ollama", "embed"),
    "/api/embeddings": Route(("POST",), "batch", "ollama", "embeddings"),
    "/v1/embeddings": Route(("POST",), "batch", "openai", "v1_embeddings"),
    "/api/chat": Route(("POST",), "generate", "ollama", "chat"),
    "/api/generate": Route(("POST",), "generate", "ollama", "generate"),
    "/v1/chat/completions": Route(("POST",), "generate", "openai", "v1_chat"),
    "/v1/completions": Route(("POST",), "generate", "openai", "v1_completions"),
    "/": Route(("GET", "HEAD"), "info", "ollama", "root"),
    "/api/version": Route(("GET", "HEAD"), "info", "ollama", "version"),
    "/api/tags": Route(("GET", "HEAD"), "info", "ollama", "tags"),
    "/api/ps": Route(("GET", "HEAD"), "info", "ollama", "ps"),
    "/api/show": Route(("POST",), "info", "ollama", "show"),
    "/v1/models": Route(("GET", "HEAD"), "info", "openai", "v1_models"),
    "/api/copy": Route(("POST",), "info", "ollama", "copy"),
    "/api/create": Route(("POST",), "info", "ollama", "create"),
    "/api/delete": Route(("DELETE",), "info", "ollama", "delete"),
    "/_sim/stats": Route(("GET", "HEAD"), "info", "ollama", "stats"),
}

#: What Ollama answers when the sim refuses a request itself.
_FAILURES: dict[str, tuple[int, str]] = {
    "not_found": (404, "404 page not found"),
    "method": (405, "405 method not allowed"),
    "busy": (503, BUSY_ERROR),
    "outage": (500, OOM_ERROR),
    "outage_unknown": (500, UNKNOWN_ERROR),
    "load_oom": (500, LOAD_OOM_ERROR),
    "internal": (500, "sim internal error"),
}


def model_not_found(op: str, model: str) -> str:
    """Ollama's 404 words for a model it does not have, as each handler writes them (v0.12.0, ``server/routes.go``).

    The embed routes look the model up when they schedule its runner:
    ``handleScheduleError`` (line 2110) says ``model "X" not found, try pulling it first``.
    ``GenerateHandler`` (185), ``ChatHandler`` (1740) and ``ShowHandler`` (967) look it
    up first: ``model 'X' not found``.  ``X`` is the name as the request gave it.  The
    ``/v1/`` routes run the same handlers, their words in OpenAI's error object.
    """
    if op in EMBED_OPS:
        return f"model {ollama_front.go_quote(model)} not found, try pulling it first"
    return f"model '{model}' not found"


#: A created model whose ``parameters.num_gpu`` is at least this fails every load (Ollama's out-of-memory 500).
FAILING_NUM_GPU = 1000


def _manage(sim: Sim, op: str, body: dict[str, Any]) -> Reply:
    """``/api/copy``, ``/api/create`` and ``/api/delete``, on the sim's list of models and their modes.

    A copy or a create ``from`` a model takes its mode (:meth:`~.server.SimOllama.set_model_mode`); a
    create whose ``parameters`` ask ``num_gpu`` of :data:`FAILING_NUM_GPU` or more fails every load in
    Ollama's out-of-memory words (``error500``), as a model re-created with settings the GPU cannot hold.
    """
    def named(*fields: str) -> str:
        return next((body[f] for f in fields if isinstance(body.get(f), str) and body[f]), "")

    def not_found(name: str) -> Reply:
        return Reply(404, dumps({"error": f"model '{name}' not found"}))

    modes = sim.model_modes
    if op == "copy":
        source, destination = named("source"), named("destination")
        if not source or not destination:
            return Reply(400, dumps({"error": "source and destination are required"}))
        if not sim.store.has(canonical_model(source)):
            return not_found(source)
        source_mode = modes.get(canonical_model(source))
        _define(sim, destination, source_mode)
        return Reply(200, b"")
    name = named("model", "name")
    if not name:
        return Reply(400, dumps({"error": "model is required"}))
    if op == "delete":
        if not sim.store.has(canonical_model(name)):
            return not_found(name)
        sim.store.forget(canonical_model(name))
        modes.pop(canonical_model(name), None)
        return Reply(200, b"")
    origin = named("from")
    if origin and not sim.store.has(canonical_model(origin)):
        return not_found(origin)
    mode = modes.get(canonical_model(origin)) if origin else None
    parameters = body.get("parameters")
    num_gpu = parameters.get("num_gpu") if isinstance(parameters, dict) else None
    if isinstance(num_gpu, (int, float)) and num_gpu >= FAILING_NUM_GPU:
        mode = "error500"
    _define(sim, name, mode)
    return Reply(200, dumps({"status": "success"}))


def _define(sim: Sim, name: str, mode: str | None) -> None:
    key = canonical_model(name)
    sim.store.forget(key)
    sim.store.know(key)
    if mode is None:
        sim.model_modes.pop(key, None)
    else:
        sim.model_modes[key] = mode


def iso(t: float) -> str:
    """RFC 3339 the way Ollama writes its timestamps."""
    if math.isinf(t):
        return "2318-01-01T00:00:00Z"
    return (
        datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
        .isoformat()
        .replace("+00:00", "Z")
    )


def ns(seconds: float) -> int:
    """Ollama reports durations in integer nanoseconds."""
    return max(0, int(round(seconds * 1e9)))


def _model_details(name: str) -> tuple[dict[str, Any], int]:
    """Plausible ``details`` and size, so clients that parse them are happy."""
    lowered = name.lower()
    if any(k in lowered for k in ("minilm", "embed", "bge", "e5")):
        family, params, size = "bert", "23M", 45_960_996
    else:
        family, params, size = "llama", "3.2B", 2_019_393_189
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": params,
        "quantization_level": "F16" if family == "bert" else "Q4_K_M",
    }
    return details, size


def _digest(name: str) -> str:
    """A stable stand-in for a model's blob digest."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def _model_entry(name: str) -> dict[str, Any]:
    """A model as ``/api/tags`` lists it."""
    details, size = _model_details(name)
    return {
        "name": name,
        "model": name,
        "modified_at": iso(0),
        "size": size,
        "digest": _digest(name),
        "details": details,
    }


def _ps_entry(sim: Sim, model: LoadedModel) -> dict[str, Any]:
    """A loaded model as ``/api/ps`` lists it."""
    entry = _model_entry(model.name)
    del entry["modified_at"]
    entry["expires_at"] = iso(FOREVER if model.busy else model.expires_at)
    entry["size_vram"] = entry["size"]
    entry["context_length"] = sim.context_length
    return entry


def _show(sim: Sim, request: Request) -> Reply:
    """``POST /api/show``: a model the server has, described; Ollama's 400 and 404 otherwise
    (v0.12.0 ``server/routes.go`` ``ShowHandler``, 942-975: ``model``, else ``name``)."""
    try:
        body = ollama_requests.read_json(request)
    except BadRequest as e:
        return Reply(400, dumps({"error": str(e)}))
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        return Reply(400, dumps({"error": "model is required"}))
    key = canonical_model(name)
    if not sim.store.has(key):
        return Reply(404, dumps({"error": model_not_found("show", name)}))
    details, _ = _model_details(key)
    family = details["family"]
    embedding = family == "bert"
    return Reply(200, dumps({
        "license": "",
        "modelfile": f"# Modelfile of the simulated {key}\nFROM {key}\n",
        "parameters": "",
        "template": "" if embedding else "{{ .Prompt }}",
        "details": details,
        "model_info": {
            "general.architecture": family,
            f"{family}.context_length": sim.context_length,
            f"{family}.embedding_length": sim.dim,
        },
        "capabilities": ["embedding"] if embedding else ["completion"],
        "modified_at": iso(0),
    }))


def _durations(sim: Sim, job: Job) -> dict[str, Any]:
    """The timing fields of Ollama's final chat/generate object."""
    return {
        "total_duration": ns(sim.now() - job.arrived),
        "load_duration": ns(job.load_wait),
        "prompt_eval_count": count_tokens(job.prompt),
        "prompt_eval_duration": ns(sim.latency),
        "eval_count": sim.chunks,
        "eval_duration": ns(sim.chunk_delay * sim.chunks),
    }


def _context(sim: Sim, job: Job) -> list[int]:
    """The token ids a generation leaves for the next call (``context`` of ``/api/generate``'s last object)."""
    return list(range(1, count_tokens(job.prompt) + sim.chunks + 1))


def _usage(sim: Sim, job: Job) -> dict[str, int]:
    """OpenAI's usage block for a reply."""
    return openai.usage(count_tokens(job.prompt), sim.chunks)


class OllamaApi(Api):
    """Ollama's own routes and the OpenAI-compatible ones it serves."""

    name = "ollama"
    routes = _ROUTES
    loads_on_demand = True

    def style_of(self, path: str) -> str:
        return "openai" if path.startswith("/v1/") else "ollama"

    def front(self, request: Request) -> Reply | None:
        # The proxy's own reading of Ollama's front (servers/ollama.py ``refuse``): one rule for both,
        # held to the real Ollama by tests/test_sim_vs_ollama_real.py.
        host = (request.getHeader("host") or "").split(":")[0]
        content = request.content.read() if request.content is not None else b""
        if request.content is not None:
            request.content.seek(0)
        asked = Asked(
            request.method.decode("latin-1"), request.path.decode("latin-1"), request.getHeader("origin"),
            frozenset({host, "127.0.0.1", "localhost"}), content,
        )
        refusal = ollama_front.refuse(asked, _ORIGINS)
        if refusal is None:
            return None
        return Reply(refusal.status, refusal.body, refusal.content_type or b"", refusal.headers)

    def error(self, style: str, failure: str, message: str, job: Job | None = None) -> Reply:
        code, text = _FAILURES.get(failure, (400, message))
        if failure in ("not_found", "method"):
            # gin answers an unknown path or method itself, in plain text, before any handler or middleware.
            return Reply(code, text.encode(), b"text/plain")
        if failure == "template":
            code, text = 500, message
        elif failure == "model_not_found":
            code, text = 404, model_not_found(job.route.op if job is not None else "", message)
        if style == "ollama":
            return Reply(code, dumps({"error": text}))
        return Reply(code, dumps(openai.error_body(code, text)))

    def read(self, request: Request) -> Any:
        return ollama_requests.read_json(request)

    def parse(self, sim: Sim, job: Job, body: Any) -> None:
        ollama_requests.parse(sim, job, body)

    def info(self, sim: Sim, request: Request, route: Route) -> Reply:
        op = route.op
        if op in ("copy", "create", "delete"):
            try:
                return _manage(sim, op, ollama_requests.read_json(request))
            except BadRequest as e:
                return Reply(400, dumps({"error": str(e)}))
        if op == "root":
            return Reply(200, b"Ollama is running", b"text/plain; charset=utf-8")
        if op == "version":
            body: Any = {"version": SIM_VERSION}
        elif op == "tags":
            body = {"models": [_model_entry(name) for name in sim.store.known()]}
        elif op == "ps":
            body = {"models": [_ps_entry(sim, m) for m in sim.store.loaded()]}
        elif op == "show":
            return _show(sim, request)
        else:
            body = {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "library"}
                    for name in sim.store.known()
                ],
            }
        return Reply(200, dumps(body))

    def answer(self, sim: Sim, job: Job) -> Any:
        """The three embed routes, each in its own shape."""
        vectors = [expected_embedding(t, job.model, job.dimensions or sim.dim) for t in job.texts]
        tokens = sum(count_tokens(t) for t in job.texts)
        op = job.route.op
        if op == "embed":
            return {
                "model": job.model,
                "embeddings": vectors,
                "total_duration": ns(sim.now() - job.arrived),
                "load_duration": ns(job.load_wait),
                "prompt_eval_count": tokens,
            }
        if op == "embeddings":
            return {"embedding": vectors[0]}
        return openai.embeddings_body(vectors, job.model, tokens, job.encoding_format)

    def reply(self, sim: Sim, job: Job, text: str) -> Any:
        op = job.route.op
        if op in ("chat", "generate"):
            body: dict[str, Any] = {"model": job.model, "created_at": iso(sim.now())}
            if op == "chat":
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["response"] = text
            body.update({"done": True, "done_reason": "stop"})
            body.update(_durations(sim, job))
            if op == "generate":
                body["context"] = _context(sim, job)
            return body
        chat = op == "v1_chat"
        return openai.completion_body(
            chat,
            sim.next_id("chatcmpl" if chat else "cmpl"),
            int(sim.now()),
            job.model,
            text,
            _usage(sim, job),
            _FINGERPRINT,
        )

    def start_stream(self, sim: Sim, job: Job) -> None:
        request = job.request
        request.setResponseCode(200)
        if job.route.style == "openai":
            request.setHeader(b"content-type", SSE)
            request.setHeader(b"cache-control", b"no-cache")
            job.stream_id = sim.next_id("chatcmpl" if job.route.op == "v1_chat" else "cmpl")
        else:
            request.setHeader(b"content-type", NDJSON)

    def stream_chunk(self, sim: Sim, job: Job, i: int, pieces: list[str]) -> bytes:
        if job.route.style == "openai":
            return openai.stream_events(
                job.route.op == "v1_chat",
                job.stream_id,
                int(sim.now()),
                job.model,
                _FINGERPRINT,
                i,
                pieces,
                _usage(sim, job) if job.include_usage else None,
            )
        done = i >= len(pieces)
        piece = "" if done else pieces[i]
        line: dict[str, Any] = {"model": job.model, "created_at": iso(sim.now())}
        if job.route.op == "chat":
            line["message"] = {"role": "assistant", "content": piece}
        else:
            line["response"] = piece
        line["done"] = done
        if done:
            line["done_reason"] = "stop"
            if job.route.op == "generate":
                line["context"] = _context(sim, job)
            line.update(_durations(sim, job))
        return dumps(line) + b"\n"

    def load_answer(self, sim: Sim, job: Job, reason: str) -> Any:
        op = job.route.op
        if op == "embed":
            return {
                "model": job.model,
                "embeddings": [],
                "total_duration": ns(sim.now() - job.arrived),
                "load_duration": ns(job.load_wait),
                "prompt_eval_count": 0,
            }
        if op == "embeddings":
            return {"embedding": []}
        body: dict[str, Any] = {"model": job.model, "created_at": iso(sim.now())}
        if op == "chat":
            body["message"] = {"role": "assistant", "content": ""}
        else:
            body["response"] = ""
        body["done"] = True
        body["done_reason"] = reason
        return body


OLLAMA = OllamaApi()
