"""
Hugging Face text-embeddings-inference (TEI): its routes, answers and errors.

From the router's source (``router/src/http/server.rs`` and ``types.rs``,
``router/src/lib.rs`` for the error types, commit 0d124dc of
huggingface/text-embeddings-inference); docs/servers.md has the details.
TEI serves one model and takes no model name on its own routes; its
OpenAI-compatible one ignores the name and answers with the served one.
Errors are ``{"error": "...", "error_type": "..."}`` (``{"message", "code",
"type"}`` on the OpenAI route), except the JSON extractor's own rejections,
which are plain text.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.server import Request

from . import openai
from .api import Api, BadRequest, Reply, Route, Sim, dumps
from .content import (
    cosine,
    count_tokens,
    expected_embedding,
    expected_labels,
    expected_relevance,
    expected_sparse,
    expected_tokens,
    raw_embedding,
)
from .jobs import Job

TEI_VERSION = "1.9.3"

#: What TEI answers a model request once its backend failed (candle's CUDA
#: out-of-memory, as ``Backend error: {0}`` formats it).
BACKEND_ERROR = 'Backend error: DriverError(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")'

#: TEI's ``--max-client-batch-size`` default.
MAX_CLIENT_BATCH_SIZE = 32

_GET = ("GET", "HEAD")
_POST = ("POST",)
_HEALTH = Route(_GET, "probe", "tei", "health")
_EMBED = Route(_POST, "batch", "tei", "embed")
_OPENAI_EMBED = Route(_POST, "batch", "tei_openai", "v1_embeddings")

_ROUTES: dict[str, Route] = {
    "/embed": _EMBED,
    "/embed_all": Route(_POST, "batch", "tei", "embed_all"),
    "/embed_sparse": Route(_POST, "batch", "tei", "embed_sparse"),
    "/predict": Route(_POST, "batch", "tei", "predict"),
    "/rerank": Route(_POST, "batch", "tei", "rerank"),
    "/similarity": Route(_POST, "batch", "tei", "similarity"),
    "/embeddings": _OPENAI_EMBED,
    "/v1/embeddings": _OPENAI_EMBED,
    # SageMaker's route runs the model's default task (embed, for an embedding model).
    "/invocations": _EMBED,
    "/tokenize": Route(_POST, "info", "tei", "tokenize"),
    "/decode": Route(_POST, "info", "tei", "decode"),
    "/info": Route(_GET, "info", "tei", "info"),
    "/health": _HEALTH,
    "/ping": _HEALTH,
    "/metrics": Route(_GET, "info", "tei", "metrics"),
    "/_sim/stats": Route(_GET, "info", "tei", "stats"),
}

#: ErrorType (router/src/lib.rs) and its status (server.rs, ``From<&ErrorType> for StatusCode``).
_STATUS = {
    "Unhealthy": 503,
    "Backend": 424,
    "Overloaded": 429,
    "Validation": 422,
    "Tokenizer": 422,
    "Empty": 400,
}

#: Plain-text rejections of axum's ``Json`` extractor, by BadRequest kind.
_REJECTIONS = {
    "json_syntax": (400, "Failed to parse the request body as JSON: "),
    "json_data": (422, "Failed to deserialize the JSON body into the target type: "),
    "content_type": (415, ""),
}

_FAILURES = {
    "busy": ("Overloaded", "Model is overloaded"),
    "outage": ("Backend", BACKEND_ERROR),
    "internal": ("Backend", "Backend error: sim internal error"),
    "empty": ("Empty", None),
    "validation": ("Validation", None),
}


def _error(style: str, error_type: str, message: str) -> Reply:
    code = _STATUS[error_type]
    if style == "tei_openai":
        return Reply(code, dumps({"message": message, "code": code, "type": error_type}))
    return Reply(code, dumps({"error": message, "error_type": error_type}))


def _texts(value: Any, what: str = "inputs") -> list[str]:
    """TEI's ``Input``: a string or a batch of strings, neither empty, the batch at most 32."""
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        if not value:
            raise BadRequest(f"`{what}` cannot be empty", "empty")
        if len(value) > MAX_CLIENT_BATCH_SIZE:
            raise BadRequest(
                f"batch size {len(value)} > maximum allowed batch size {MAX_CLIENT_BATCH_SIZE}", "validation"
            )
        texts = list(value)
    else:
        raise BadRequest(f"data did not match any variant of untagged enum Input for `{what}`", "json_data")
    if any(text == "" for text in texts):
        raise BadRequest(f"Input validation error: `{what}` cannot be empty", "empty")
    return texts


def _check_length(sim: Sim, texts: list[str], body: dict[str, Any]) -> None:
    """``truncate`` defaults to true (``--auto-truncate``); off, a long input is a 422."""
    if body.get("truncate") is False:
        for text in texts:
            tokens = count_tokens(text)
            if tokens > sim.context_length:
                raise BadRequest(
                    f"Input validation error: `inputs` must have less than {sim.context_length} tokens. "
                    f"Given: {tokens}",
                    "validation",
                )


def _sequences(value: Any) -> tuple[list[list[str]], bool]:
    """``/predict``'s inputs: a string, a pair, or a batch of singles and pairs; and whether a batch."""
    def sequence(item: Any) -> list[str]:
        if not (isinstance(item, list) and 1 <= len(item) <= 2 and all(isinstance(s, str) for s in item)):
            raise BadRequest("invalid length, expected a string, a pair of strings or a batch", "json_data")
        return item

    if isinstance(value, str):
        return [[value]], False
    if isinstance(value, list) and value and all(isinstance(s, str) for s in value):
        return [sequence(value)], False
    if isinstance(value, list) and value:
        return [sequence(item) for item in value], True
    raise BadRequest("invalid length 0, expected a string, a pair of strings or a batch", "json_data")


class TeiApi(Api):
    """text-embeddings-inference: one model, native routes plus ``/v1/embeddings``."""

    name = "tei"
    routes = _ROUTES

    def route(self, path: str, method: str) -> Route | None:
        if path == "/":
            # GET / is the health check, POST / the model's default task.
            return _EMBED if method == "POST" else _HEALTH
        return self.routes.get(path)

    def style_of(self, path: str) -> str:
        return "tei"

    def error(self, style: str, failure: str, message: str, job: Job | None = None) -> Reply:
        if failure in ("not_found", "method"):
            # axum's own 404 and 405: no body at all.
            return Reply(404 if failure == "not_found" else 405, b"", b"text/plain; charset=utf-8")
        if failure in _REJECTIONS:
            code, prefix = _REJECTIONS[failure]
            return Reply(code, (prefix + message).encode("utf-8"), b"text/plain; charset=utf-8")
        error_type, text = _FAILURES.get(failure, ("Validation", None))
        return _error(style, error_type, text if text is not None else message)

    def read(self, request: Request) -> Any:
        content_type = (request.getHeader(b"content-type") or b"").split(b";")[0].strip().lower()
        if content_type != b"application/json" and not content_type.endswith(b"+json"):
            raise BadRequest("Expected request with `Content-Type: application/json`", "content_type")
        raw = request.content.read() if request.content is not None else b""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(str(e), "json_syntax") from None
        if not isinstance(body, dict):
            raise BadRequest("invalid type: expected struct", "json_data")
        return body

    def parse(self, sim: Sim, job: Job, body: Any) -> None:
        job.model = job.key = sim.served_model
        op = job.route.op
        if op == "rerank":
            query, texts = body.get("query"), body.get("texts")
            if not isinstance(query, str):
                raise BadRequest("missing field `query`", "json_data")
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("missing field `texts`", "json_data")
            if not texts:
                raise BadRequest("`texts` cannot be empty", "empty")
            job.texts = _texts(texts, "texts")
            job.options.update(query=query, return_text=body.get("return_text") is True,
                               raw_scores=body.get("raw_scores") is True)
        elif op == "predict":
            if "inputs" not in body:
                raise BadRequest("missing field `inputs`", "json_data")
            sequences, batch = _sequences(body["inputs"])
            job.texts = ["\n".join(s) for s in sequences]
            job.options["batch"] = batch
        elif op == "similarity":
            inputs = body.get("inputs")
            if not isinstance(inputs, dict) or not isinstance(inputs.get("source_sentence"), str):
                raise BadRequest("missing field `inputs`", "json_data")
            sentences = inputs.get("sentences")
            if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
                raise BadRequest("missing field `sentences`", "json_data")
            if not sentences:
                raise BadRequest("`inputs.sentences` cannot be empty", "empty")
            job.texts = [inputs["source_sentence"], *sentences]
        elif op == "v1_embeddings":
            if "input" not in body:
                raise BadRequest("missing field `input`", "json_data")
            job.texts = _texts(body["input"])
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise BadRequest(f"unknown variant `{fmt}`, expected `float` or `base64`", "json_data")
            job.encoding_format = fmt
        else:
            if "inputs" not in body:
                raise BadRequest("missing field `inputs`", "json_data")
            job.texts = _texts(body["inputs"])
            job.options["normalize"] = body.get("normalize", True) is not False
        dimensions = body.get("dimensions")
        if isinstance(dimensions, int) and not isinstance(dimensions, bool) and 0 < dimensions < sim.dim:
            job.dimensions = dimensions
        _check_length(sim, job.texts, body)

    def answer(self, sim: Sim, job: Job) -> Any:
        op, model, dim = job.route.op, job.model, job.dimensions or sim.dim
        if op in ("embed", "v1_embeddings"):
            make = expected_embedding if job.options.get("normalize", True) else raw_embedding
            vectors = [make(text, model, dim) for text in job.texts]
            if op == "embed":
                return vectors
            tokens = sum(count_tokens(t) for t in job.texts)
            return openai.embeddings_body(vectors, sim.served_model, tokens, job.encoding_format)
        if op == "embed_all":
            return [[raw_embedding(token, model, sim.dim) for _, token, _, _ in expected_tokens(text)]
                    for text in job.texts]
        if op == "embed_sparse":
            return [[{"index": i, "value": v} for i, v in expected_sparse(text, model)] for text in job.texts]
        if op == "rerank":
            query = job.options["query"]
            ranks = []
            for index, text in enumerate(job.texts):
                rank: dict[str, Any] = {"index": index}
                if job.options["return_text"]:
                    rank["text"] = text
                rank["score"] = expected_relevance(query, text, model)
                ranks.append(rank)
            return sorted(ranks, key=lambda r: r["score"], reverse=True)
        if op == "similarity":
            source, *sentences = job.texts
            return [cosine(expected_embedding(source, model, dim), expected_embedding(s, model, dim)) for s in sentences]
        predictions = [[{"score": score, "label": label} for label, score in expected_labels(text, model)]
                       for text in job.texts]
        return predictions if job.options["batch"] else predictions[0]

    def info(self, sim: Sim, request: Request, route: Route) -> Reply:
        op = route.op
        if op == "health":
            if sim.mode == "error500":
                # After a failed request TEI's health check runs the model, and fails.
                return _error("tei", "Unhealthy", "unhealthy")
            return Reply(200, b"", b"text/plain; charset=utf-8")
        if op == "metrics":
            return Reply(200, b"# TYPE te_request_count counter\n", b"text/plain; charset=utf-8")
        if op == "info":
            return Reply(200, dumps({
                "model_id": sim.served_model,
                "model_sha": None,
                "model_dtype": "float16",
                "served_model_name": sim.served_model,
                "model_type": {"embedding": {"pooling": "mean"}},
                "max_concurrent_requests": sim.parallel + sim.max_queue,
                "max_input_length": sim.context_length,
                "max_batch_tokens": 16384,
                "max_batch_requests": None,
                "max_client_batch_size": MAX_CLIENT_BATCH_SIZE,
                "auto_truncate": True,
                "tokenization_workers": 1,
                "version": TEI_VERSION,
                "sha": None,
                "docker_label": None,
            }))
        try:
            body = self.read(request)
        except BadRequest as e:
            return self.error("tei", e.kind, str(e))
        if op == "tokenize":
            return self._tokenize(body)
        ids = body.get("ids")
        batch = isinstance(ids, list) and bool(ids) and all(isinstance(i, list) for i in ids)
        rows = ids if batch else [ids]
        if not all(isinstance(row, list) and all(isinstance(i, int) for i in row) for row in rows):
            return self.error("tei", "json_data", "missing field `ids`")
        # Not the inverse of the stand-in tokenizer: each id decodes to a placeholder word.
        return Reply(200, dumps([" ".join(f"tok{i}" for i in row) for row in rows]))

    def _tokenize(self, body: dict[str, Any]) -> Reply:
        try:
            texts = _texts(body.get("inputs"))
        except BadRequest as e:
            return self.error("tei", e.kind, str(e))
        special = body.get("add_special_tokens", True) is not False
        out = []
        for text in texts:
            tokens = [{"id": i, "text": t, "special": False, "start": a, "stop": b}
                      for i, t, a, b in expected_tokens(text)]
            if special:
                tokens = ([{"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}] + tokens
                          + [{"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None}])
            out.append(tokens)
        return Reply(200, dumps(out))


TEI = TeiApi()
