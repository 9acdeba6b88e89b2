"""
llama.cpp's server (``llama-server``): its routes, answers and errors.

From ``tools/server/server.cpp`` (the route table in ``main()``, the
handlers in ``server_routes``), ``server-http.cpp`` (the loading and 404
middleware), ``server-common.cpp`` (``format_error_response``, the OpenAI
and rerank response builders) and ``server-task.cpp`` (result objects), all
at commit aa6192d of ggml-org/llama.cpp; docs/servers.md has the details.

It serves one model, ignores the request's ``model`` (its OpenAI answers echo
it back) and starts its HTTP server before the model is loaded: meanwhile
every route but the model lists answers 503 "Loading model".  Errors are
``{"error": {"code", "message", "type"}}``; note that a malformed JSON body
or a chat body it cannot parse is a 500 ``server_error`` there, the
caller's mistake all the same.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.server import Request

from . import openai
from .api import SSE, Api, BadRequest, Reply, Route, Sim, dumps, sse
from .content import (
    count_tokens,
    encode_base64_f32,
    expected_embedding,
    expected_relevance,
    expected_tokens,
    messages_prompt,
)
from .jobs import Job

#: ``build_info``: what llama.cpp puts in ``system_fingerprint``.
BUILD_INFO = "b7000-aa6192d3"
#: server-common.h: the ``model`` of an OpenAI answer when the request names none.
DEFAULT_OAICOMPAT_MODEL = "gpt-3.5-turbo"
#: What every slot's request gets when ``llama_decode`` fails on the GPU (``send_error``).
COMPUTE_ERROR = "Compute error."
#: server-http.cpp: the answer of every route but the model lists while the model loads.
LOADING_BODY = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}

_GET = ("GET",)
_POST = ("POST",)
_CHAT = Route(_POST, "generate", "llamacpp", "v1_chat")
_COMPLETION = Route(_POST, "generate", "llamacpp", "completion")
_EMBEDDING = Route(_POST, "batch", "llamacpp", "embedding")
_RERANK = Route(_POST, "batch", "llamacpp", "rerank")
_MODELS = Route(_GET, "info", "llamacpp", "models")
_HEALTH = Route(_GET, "info", "llamacpp", "health")

_ROUTES: dict[str, Route] = {
    "/health": _HEALTH,
    "/v1/health": _HEALTH,
    "/metrics": Route(_GET, "info", "llamacpp", "metrics"),
    "/props": Route(_GET, "info", "llamacpp", "props"),
    "/models": _MODELS,
    "/v1/models": _MODELS,
    "/api/tags": _MODELS,
    "/completion": _COMPLETION,
    "/completions": _COMPLETION,
    "/v1/completions": Route(_POST, "generate", "llamacpp", "v1_completions"),
    "/chat/completions": _CHAT,
    "/v1/chat/completions": _CHAT,
    # Ollama's path, llama.cpp's OpenAI-shaped chat.
    "/api/chat": _CHAT,
    "/infill": Route(_POST, "generate", "llamacpp", "infill"),
    "/embedding": _EMBEDDING,
    "/embeddings": _EMBEDDING,
    "/v1/embeddings": Route(_POST, "batch", "llamacpp", "v1_embeddings"),
    "/rerank": _RERANK,
    "/reranking": _RERANK,
    "/v1/rerank": _RERANK,
    "/v1/reranking": _RERANK,
    "/tokenize": Route(_POST, "info", "llamacpp", "tokenize"),
    "/detokenize": Route(_POST, "info", "llamacpp", "detokenize"),
    "/apply-template": Route(_POST, "info", "llamacpp", "apply_template"),
    "/slots": Route(_GET, "info", "llamacpp", "slots"),
    "/": Route(_GET, "info", "llamacpp", "root"),
    "/_sim/stats": Route(("GET", "HEAD"), "info", "llamacpp", "stats"),
}

#: Answered while the model loads (server-http.cpp, ``middleware_server_state``).
_OPEN_WHILE_LOADING = ("/models", "/v1/models", "/api/tags", "/_sim/stats")

#: ``format_error_response``: the type and status of each error_type.
_TYPES = {
    "invalid_request_error": 400,
    "not_found_error": 404,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
}

_FAILURES = {
    "bad_request": "invalid_request_error",
    "server_error": "server_error",
    "busy": "unavailable_error",
    "outage": "server_error",
    "internal": "server_error",
}

_WORDING = {
    "busy": "no slot available",
    "outage": COMPUTE_ERROR,
    "internal": "sim internal error",
}


def _error(error_type: str, message: str) -> Reply:
    code = _TYPES[error_type]
    return Reply(code, dumps({"error": {"code": code, "message": message, "type": error_type}}))


def _prompt(body: dict[str, Any], key: str = "prompt") -> str:
    """A completion's prompt: a string, or a list holding one."""
    prompt = body.get(key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(f"[json.exception.out_of_range.403] key '{key}' not found")
    return prompt


def _inputs(body: dict[str, Any]) -> list[str]:
    """The embedding routes' ``input`` (or ``content``): a string or strings, none empty."""
    raw = body["input"] if "input" in body else body.get("content")
    if raw is None:
        raise BadRequest('"input" or "content" must be provided')
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest("\"prompt\" elements must be string, list of tokens, or JSON object", "server_error")
    if not texts or any(not t for t in texts):
        raise BadRequest("Input content cannot be empty")
    return texts


class LlamaCppApi(Api):
    """llama-server: native completion/embedding/rerank routes, OpenAI-compatible ones, a loading state."""

    name = "llamacpp"
    routes = _ROUTES
    loads_at_start = True

    def style_of(self, path: str) -> str:
        return "llamacpp"

    def while_loading(self, path: str) -> Reply | None:
        if path in _OPEN_WHILE_LOADING:
            return None
        if path == "/" or path.endswith(".html"):
            return Reply(503, b"<html><body>Loading model</body></html>", b"text/html; charset=utf-8")
        return Reply(503, dumps(LOADING_BODY))

    def error(self, style: str, failure: str, message: str, job: Job | None = None) -> Reply:
        if failure in ("not_found", "method"):
            # cpp-httplib has no 405: a path without this method is not found.
            return Reply(404, dumps({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}))
        return _error(_FAILURES.get(failure, "invalid_request_error"), _WORDING.get(failure, message))

    def read(self, request: Request) -> Any:
        raw = request.content.read() if request.content is not None else b""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            # json::parse throws; ex_wrapper answers any exception 500.
            raise BadRequest(f"[json.exception.parse_error.101] parse error: {e}", "server_error") from None
        if not isinstance(body, dict):
            raise BadRequest("[json.exception.type_error.302] type must be object", "server_error")
        return body

    def parse(self, sim: Sim, job: Job, body: Any) -> None:
        # One model; OpenAI answers echo the name asked for (or gpt-3.5-turbo).
        job.key = sim.served_model
        job.model = body.get("model") if isinstance(body.get("model"), str) else DEFAULT_OAICOMPAT_MODEL
        op = job.route.op
        if op in ("embedding", "v1_embeddings"):
            job.texts = _inputs(body)
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise BadRequest("The format to return the embeddings in. Can be either float or base64")
            job.encoding_format = fmt
        elif op == "rerank":
            query = body.get("query")
            if query is None:
                raise BadRequest('"query" must be provided')
            if not isinstance(query, str):
                raise BadRequest('"query" must be a string')
            documents = body.get("documents", body.get("texts"))
            if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
                raise BadRequest('"documents" must be a non-empty string array')
            job.texts = list(documents)
            top_n = body.get("top_n")
            job.options.update(
                query=query,
                tei_format="texts" in body,
                return_text=body.get("return_text") is True,
                top_n=top_n if isinstance(top_n, int) else len(documents),
            )
        elif op == "v1_chat":
            messages = body.get("messages")
            if "messages" not in body:
                raise BadRequest("'messages' is required", "server_error")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise BadRequest("Expected 'messages' to be an array", "server_error")
            job.prompt = messages_prompt(messages)
            job.stream = body.get("stream") is True
        elif op == "infill":
            for key in ("input_prefix", "input_suffix"):
                if not isinstance(body.get(key), str):
                    raise BadRequest(f'"{key}" is required')
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise BadRequest('"prompt" must be a string')
            job.prompt = body["input_prefix"] + body["input_suffix"] + prompt
            job.stream = body.get("stream") is True
        else:  # completion, v1_completions
            job.prompt = _prompt(body)
            job.stream = body.get("stream") is True

    def answer(self, sim: Sim, job: Job) -> Any:
        model = job.key
        if job.route.op == "rerank":
            return self._rerank(job)
        vectors = [expected_embedding(t, model, sim.dim) for t in job.texts]
        if job.route.op == "embedding":
            # Pooled: one row per input ("embedding" holds a row per token without pooling).
            return [{"index": i, "embedding": [v]} for i, v in enumerate(vectors)]
        data = []
        for i, v in enumerate(vectors):
            if job.encoding_format == "base64":
                data.append({"embedding": encode_base64_f32(v), "index": i, "object": "embedding",
                             "encoding_format": "base64"})
            else:
                data.append({"embedding": v, "index": i, "object": "embedding"})
        tokens = sum(count_tokens(t) for t in job.texts)
        return {"model": job.model, "object": "list", "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": data}

    def _rerank(self, job: Job) -> Any:
        options, model = job.options, job.key
        label = "score" if options["tei_format"] else "relevance_score"
        ranks = []
        for index, text in enumerate(job.texts):
            rank: dict[str, Any] = {"index": index, label: expected_relevance(options["query"], text, model)}
            if options["tei_format"] and options["return_text"]:
                rank["text"] = text
            ranks.append(rank)
        ranks.sort(key=lambda r: r[label], reverse=True)
        ranks = ranks[: max(0, options["top_n"])]
        if options["tei_format"]:
            return ranks
        tokens = sum(count_tokens(options["query"]) + count_tokens(t) for t in job.texts)
        return {"model": job.model, "object": "list", "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": ranks}

    def reply(self, sim: Sim, job: Job, text: str) -> Any:
        op = job.route.op
        if op in ("completion", "infill"):
            return self._native(sim, job, text, stop=True)
        chat = op == "v1_chat"
        return openai.completion_body(
            chat, sim.next_id("chatcmpl" if chat else "cmpl"), int(sim.now()), job.model, text,
            openai.usage(count_tokens(job.prompt), sim.chunks), BUILD_INFO,
        )

    def _native(self, sim: Sim, job: Job, content: str, stop: bool) -> dict[str, Any]:
        """``/completion``'s object (``to_json_non_oaicompat``), whole or one streamed piece."""
        body: dict[str, Any] = {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": stop,
            "model": job.model,
            "tokens_predicted": sim.chunks if stop else 0,
            "tokens_evaluated": count_tokens(job.prompt),
        }
        if stop:
            body.update({
                "prompt": job.prompt,
                "has_new_line": False,
                "truncated": False,
                "stop_type": "eos",
                "stopping_word": "",
                "tokens_cached": 0,
                "timings": {"prompt_n": count_tokens(job.prompt), "predicted_n": sim.chunks},
            })
        return body

    def start_stream(self, sim: Sim, job: Job) -> None:
        job.request.setResponseCode(200)
        job.request.setHeader(b"content-type", SSE)
        job.stream_id = sim.next_id("chatcmpl" if job.route.op == "v1_chat" else "cmpl")

    def stream_chunk(self, sim: Sim, job: Job, i: int, pieces: list[str]) -> bytes:
        op = job.route.op
        if op in ("completion", "infill"):
            # Native streams end with the final object, and no [DONE].
            if i >= len(pieces):
                return sse(self._native(sim, job, "", stop=True))
            return sse(self._native(sim, job, pieces[i], stop=False))
        return openai.stream_events(
            op == "v1_chat", job.stream_id, int(sim.now()), job.model, BUILD_INFO, i, pieces, None
        )

    def info(self, sim: Sim, request: Request, route: Route) -> Reply:
        op = route.op
        if op == "health":
            return Reply(200, dumps({"status": "ok"}))
        if op == "root":
            return Reply(200, b"<html><body>llama.cpp</body></html>", b"text/html; charset=utf-8")
        if op == "metrics":
            return Reply(200, b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing "
                         + str(sim.serving).encode() + b"\n", b"text/plain; version=0.0.4")
        if op == "props":
            return Reply(200, dumps({"total_slots": sim.parallel, "model_path": sim.served_model,
                                     "model_alias": sim.served_model, "build_info": BUILD_INFO}))
        if op == "slots":
            return Reply(200, dumps([{"id": i, "n_ctx": sim.context_length, "is_processing": i < sim.serving}
                                     for i in range(sim.parallel)]))
        if op == "models":
            return Reply(200, dumps(self._models(sim)))
        try:
            body = self.read(request)
        except BadRequest as e:
            return self.error("llamacpp", e.kind, str(e))
        if op == "tokenize":
            content = body.get("content", "")
            tokens = expected_tokens(content) if isinstance(content, str) else []
            if body.get("with_pieces") is True:
                return Reply(200, dumps({"tokens": [{"id": i, "piece": t} for i, t, _, _ in tokens]}))
            return Reply(200, dumps({"tokens": [i for i, _, _, _ in tokens]}))
        if op == "detokenize":
            ids = body.get("tokens", [])
            return Reply(200, dumps({"content": "".join(f" tok{i}" for i in ids if isinstance(i, int))}))
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return _error("server_error", "'messages' is required")
        return Reply(200, dumps({"prompt": messages_prompt(messages)}))

    def _models(self, sim: Sim) -> dict[str, Any]:
        """``/models``, ``/v1/models`` and ``/api/tags``: one body with Ollama's and OpenAI's lists."""
        name = sim.served_model
        meta = None if sim.loading else {"n_ctx_train": sim.context_length, "n_embd": sim.dim}
        return {
            "models": [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                        "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                        "parameters": "", "details": {"format": "gguf"}}],
            "object": "list",
            "data": [{"id": name, "object": "model", "created": int(sim.now()), "owned_by": "llamacpp",
                      "meta": meta}],
        }


LLAMACPP = LlamaCppApi()
