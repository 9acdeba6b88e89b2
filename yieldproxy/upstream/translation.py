"""Embedding requests and answers, translated between Ollama's API and OpenAI's.

Every request is read into one neutral :class:`EmbedRequest`, sent in the
backend's shape, and its answer read back into plain vectors and rendered in
the client's shape, so the model name is mapped and normalisation and
``encoding_format`` are handled in one place.  What each client API promises,
and so what each route gets: docs/fallback.md ("API translation").

A request that cannot be served faithfully (token-id inputs, ``truncate:
false``, no input) raises :class:`Untranslatable`: the caller parks it and
the primary answers it later, exactly as it would have without a fallback.
Pure functions only: no I/O, no reactor.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any, Sequence

import attrs

from .verdict import Reason, status_reason

#: The client routes the fallback can serve, and the name of each.
EMBED_ROUTES = {"/api/embed": "embed", "/api/embeddings": "legacy", "/v1/embeddings": "v1"}
#: Where each backend shape takes embeddings, relative to its base URL
#: (an Ollama root; an OpenAI base URL such as ``http://host:7997/v1``).
BACKEND_PATHS = {("ollama", "embed"): "/api/embed", ("ollama", "legacy"): "/api/embeddings", ("openai", None): "/embeddings"}


class Untranslatable(ValueError):
    """This request cannot be served by the fallback with the same meaning; park it instead."""


class BackendError(Exception):
    """The backend's answer is an error or cannot be read; ``reason`` is short, ``detail`` says more."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@attrs.frozen
class EmbedRequest:
    """One embedding request, whatever API it came in."""

    #: ``embed`` (Ollama /api/embed), ``legacy`` (Ollama /api/embeddings) or ``v1`` (OpenAI).
    route: str
    model: str
    inputs: tuple[str, ...]
    dimensions: int | None = None
    #: OpenAI's answer encoding: ``float`` or ``base64``.
    encoding_format: str = "float"
    #: Ollama's ``options`` and ``keep_alive``, passed on to an Ollama backend only.
    options: dict[str, Any] | None = attrs.field(default=None, hash=False)
    keep_alive: Any = attrs.field(default=None, hash=False)

    @property
    def unit_vectors(self) -> bool:
        """True when the client's API promises L2-normalised vectors."""
        return self.route != "legacy"


@attrs.frozen
class Embeddings:
    """What a backend answered: one vector per input, and its token count if it gave one."""

    vectors: tuple[tuple[float, ...], ...]
    prompt_tokens: int = 0


# -- vectors ------------------------------------------------------------------


def l2_normalise(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to length 1; a zero vector stays as it is."""
    norm = math.sqrt(math.fsum(v * v for v in vector))
    if norm == 0:
        return list(vector)
    return [v / norm for v in vector]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors of one length (0 when either is zero)."""
    if len(a) != len(b):
        raise ValueError(f"dimensions differ: {len(a)} and {len(b)}")
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(y * y for y in b))
    if na == 0 or nb == 0:
        return 0.0
    return math.fsum(x * y for x, y in zip(a, b)) / (na * nb)


def encode_base64_f32(vector: Sequence[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64_f32(data: str) -> list[float]:
    """The inverse of :func:`encode_base64_f32`."""
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise BackendError(Reason.BAD_ANSWER, f"embedding is not valid base64: {e}") from None
    if len(raw) % 4:
        raise BackendError(Reason.BAD_ANSWER, f"base64 embedding of {len(raw)} bytes is not float32s")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


# -- the client's request -------------------------------------------------------


def route_of(path: str) -> str | None:
    """The embedding route a request path names (trailing slash allowed), or None."""
    return EMBED_ROUTES.get(path.rstrip("/") or "/")


def _text_inputs(value: Any, route: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise Untranslatable("no input to embed")
    if not all(isinstance(text, str) for text in value):
        # OpenAI allows token ids; they belong to the primary's tokenizer, not the fallback's.
        raise Untranslatable("input must be text (token-id inputs are not translated)")
    if route == "v1" and not all(value):
        raise Untranslatable("input contains an empty string")
    return tuple(value)


def _dimensions(body: dict[str, Any]) -> int | None:
    value = body.get("dimensions")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Untranslatable("dimensions must be a positive integer")
    return value


def parse_request(path: str, body: bytes) -> EmbedRequest:
    """Read a client's embedding request; :class:`Untranslatable` when it cannot be served as asked."""
    route = route_of(path)
    if route is None:
        raise Untranslatable(f"{path} is not an embedding route")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Untranslatable("body is not JSON") from None
    if not isinstance(data, dict):
        raise Untranslatable("body is not a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model.strip():
        raise Untranslatable("no model named")
    options = data.get("options")
    if options is not None and not isinstance(options, dict):
        raise Untranslatable("options must be an object")
    if route == "legacy":
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise Untranslatable("no prompt to embed")
        return EmbedRequest("legacy", model, (prompt,), options=options, keep_alive=data.get("keep_alive"))
    if route == "embed":
        if data.get("truncate", True) is not True:
            # The primary would refuse an over-long input; a backend may cut it silently.
            raise Untranslatable("truncate: false is not translated (backends truncate differently)")
        return EmbedRequest(
            "embed", model, _text_inputs(data.get("input"), route), _dimensions(data),
            options=options, keep_alive=data.get("keep_alive"),
        )
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise Untranslatable(f"encoding_format {fmt!r} is not float or base64")
    return EmbedRequest("v1", model, _text_inputs(data.get("input"), route), _dimensions(data), fmt)


# -- the backend's side -------------------------------------------------------------


def backend_request(request: EmbedRequest, api: str, model: str) -> tuple[str, bytes]:
    """The path (relative to the backend's base URL) and JSON body for ``api``."""
    if api == "ollama":
        if request.route == "legacy":
            body: dict[str, Any] = {"model": model, "prompt": request.inputs[0]}
        else:
            body = {"model": model, "input": list(request.inputs), "truncate": True}
            if request.dimensions is not None:
                body["dimensions"] = request.dimensions
        if request.options is not None:
            body["options"] = request.options
        if request.keep_alive is not None:
            body["keep_alive"] = request.keep_alive
        path = BACKEND_PATHS[("ollama", "legacy" if request.route == "legacy" else "embed")]
    elif api == "openai":
        # Floats: every OpenAI-shaped server (TEI, Infinity, llama.cpp, vLLM) speaks them.
        body = {"model": model, "input": list(request.inputs), "encoding_format": "float"}
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        path = BACKEND_PATHS[("openai", None)]
    else:
        raise ValueError(f"unknown API shape {api!r}")
    return path, json.dumps(body).encode("ascii")  # escapes: a lone surrogate stays as sent


def error_message(body: bytes) -> str:
    """The message of an error body in either API's shape (or the start of the raw text)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message
        if isinstance(error, str):
            return error
        # FastAPI (Infinity) validation errors and TEI's {"error", "error_type"} both land here.
        detail = data.get("detail") or data.get("message")
        if detail:
            return detail if isinstance(detail, str) else json.dumps(detail)[:300]
    text = body.decode("utf-8", "replace").strip()
    return text[:300] if text else "(empty body)"


def _vector(value: Any, where: str) -> tuple[float, ...]:
    if isinstance(value, str):
        value = decode_base64_f32(value)
    if not isinstance(value, list) or not value:
        raise BackendError(Reason.BAD_ANSWER, f"{where} is not a non-empty list of numbers")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise BackendError(Reason.BAD_ANSWER, f"{where} holds {x!r}, not a finite number")
        out.append(float(x))
    return tuple(out)


def parse_response(request: EmbedRequest, api: str, status: int, body: bytes) -> Embeddings:
    """Vectors from a backend's answer to :func:`backend_request`, checked; :class:`BackendError` if not."""
    if not 200 <= status < 300:
        raise BackendError(status_reason(status), f"backend answered {status}: {error_message(body)}")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BackendError(Reason.BAD_ANSWER, "backend answer is not JSON") from None
    if not isinstance(data, dict):
        raise BackendError(Reason.BAD_ANSWER, "backend answer is not a JSON object")
    if "error" in data:
        raise BackendError("backend_error", f"backend answered an error: {error_message(body)}")
    tokens: object = 0  # checked below, whatever the backend sent
    if api == "ollama" and request.route == "legacy":
        vectors = [_vector(data.get("embedding"), "embedding")]
    elif api == "ollama":
        raw = data.get("embeddings")
        if not isinstance(raw, list):
            raise BackendError(Reason.BAD_ANSWER, "backend answer has no embeddings list")
        vectors = [_vector(v, f"embeddings[{i}]") for i, v in enumerate(raw)]
        tokens = data.get("prompt_eval_count") or 0
    else:
        items = data.get("data")
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise BackendError(Reason.BAD_ANSWER, "backend answer has no data list")
        order = [item.get("index", i) for i, item in enumerate(items)]
        if not all(type(x) is int for x in order) or sorted(order) != list(range(len(items))):
            raise BackendError(Reason.BAD_ANSWER, "backend answer's data indexes are not 0..n-1")
        by_index = sorted(zip(order, items), key=lambda pair: pair[0])
        vectors = [_vector(item.get("embedding"), f"data[{i}].embedding") for i, item in by_index]
        usage = data.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else 0
    if len(vectors) != len(request.inputs):
        raise BackendError(
            Reason.BAD_ANSWER, f"backend answered {len(vectors)} vectors for {len(request.inputs)} inputs"
        )
    if len({len(v) for v in vectors}) != 1:
        raise BackendError(Reason.BAD_ANSWER, "backend answered vectors of different lengths")
    if request.dimensions is not None:
        dim = len(vectors[0])
        if dim < request.dimensions:
            raise BackendError(
                Reason.BAD_ANSWER, f"asked for {request.dimensions} dimensions, backend answered {dim}"
            )
        # A backend that ignores `dimensions` gets truncated here, as Ollama and OpenAI do.
        vectors = [v[: request.dimensions] for v in vectors]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        tokens = 0
    return Embeddings(tuple(vectors), tokens)


# -- the client's answer -------------------------------------------------------------


def client_response(request: EmbedRequest, result: Embeddings, duration_seconds: float = 0.0) -> bytes:
    """The JSON answer in the client's API shape, naming the model the client asked for."""
    vectors = [l2_normalise(v) if request.unit_vectors else list(v) for v in result.vectors]
    if request.route == "legacy":
        payload: dict[str, Any] = {"embedding": vectors[0]}
    elif request.route == "embed":
        payload = {
            "model": request.model,
            "embeddings": vectors,
            "total_duration": int(duration_seconds * 1e9),
            "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens,
        }
    else:
        encode = encode_base64_f32 if request.encoding_format == "base64" else (lambda v: v)
        payload = {
            "object": "list",
            "data": [{"object": "embedding", "embedding": encode(v), "index": i} for i, v in enumerate(vectors)],
            "model": request.model,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
    return json.dumps(payload, separators=(",", ":")).encode("utf-8")

