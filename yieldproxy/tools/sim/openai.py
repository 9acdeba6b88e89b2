"""
OpenAI's wire shapes, as the servers that imitate it write them.

Ollama, llama.cpp and Infinity all answer ``/v1/...`` routes in OpenAI's
shapes, each with small differences (a ``system_fingerprint``, extra fields,
the error's ``code``); these builders take the differences as arguments.
"""

from __future__ import annotations

from typing import Any, Sequence

from .api import sse
from .content import encode_base64_f32


def error_body(code: int, message: str) -> dict[str, Any]:
    """OpenAI's error object, as Ollama's ``/v1/`` routes write it (``code`` null)."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
    }.get(code, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def embeddings_body(
    vectors: Sequence[Sequence[float]], model: str, tokens: int, encoding_format: str = "float"
) -> dict[str, Any]:
    """``/v1/embeddings``: a list of embedding objects, base64 when asked."""
    encode = encode_base64_f32 if encoding_format == "base64" else list
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` block of a completion."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    chat: bool, id: str, created: int, model: str, text: str, usage: dict[str, int], fingerprint: str
) -> dict[str, Any]:
    """A whole ``chat.completion`` (``chat``) or ``text_completion``."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
    else:
        choice = {"text": text, "index": 0, "finish_reason": "stop"}
    return {
        "id": id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [choice],
        "usage": usage,
    }


def stream_events(
    chat: bool,
    id: str,
    created: int,
    model: str,
    fingerprint: str,
    i: int,
    pieces: Sequence[str],
    usage: dict[str, int] | None,
) -> bytes:
    """The events for piece ``i`` of a stream; the last adds ``usage`` (when given) and ``[DONE]``."""
    done = i >= len(pieces)
    base = {
        "id": id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
    }
    piece = "" if done else pieces[i]
    finish = "stop" if done else None
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": piece},
            "finish_reason": finish,
        }
    else:
        choice = {"text": piece, "index": 0, "finish_reason": finish}
    out = [sse(dict(base, choices=[choice]))]
    if done:
        if usage is not None:
            out.append(sse(dict(base, choices=[], usage=usage)))
        out.append(b"data: [DONE]\n\n")
    return b"".join(out)
