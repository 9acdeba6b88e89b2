"""Deterministic content: what tests recompute (vectors, replies, tokens, base64)."""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
from typing import Any, Iterable, Sequence

from ...names import canonical_model

DEFAULT_EMBED_MODEL = "all-minilm"
DEFAULT_CHAT_MODEL = "llama3.2"


def _seed(model: str, salt: bytes, text: str) -> bytes:
    """sha256 of the model's canonical name, ``salt`` (one per kind of answer) and ``text``: where an answer starts."""
    return hashlib.sha256(canonical_model(model).encode("utf-8") + salt + text.encode("utf-8", "surrogatepass")).digest()


def raw_embedding(text: str, model: str = DEFAULT_EMBED_MODEL, dim: int = 384) -> list[float]:
    """
    :func:`expected_embedding` before normalisation (TEI's ``normalize: false``): pseudo-random values in
    [-1, 1) from sha256(model, text) and a counter.

    Each block adds 8 values, so the first ``d`` values do not depend on
    ``dim``: ``dimensions`` truncation and a smaller ``dim`` agree.
    """
    if dim < 1:
        raise ValueError(f"dim must be at least 1, not {dim}")
    seed = _seed(model, b"\0", text)
    out: list[float] = []
    counter = 0
    while len(out) < dim:
        block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        out.extend(v / 2147483648.0 for v in struct.unpack("<8i", block))
        counter += 1
    return out[:dim]


def expected_embedding(
    text: str, model: str = DEFAULT_EMBED_MODEL, dim: int = 384
) -> list[float]:
    """
    The vector the sim answers for ``text``: deterministic, L2-normalised.

    Tests recompute it to check every vector that came through the proxy.
    With ``dimensions`` the sim answers ``expected_embedding(text, model,
    dimensions)``, which is the full vector truncated and renormalised, as
    Ollama does.
    """
    raw = raw_embedding(text, model, dim)
    norm = math.sqrt(math.fsum(v * v for v in raw))
    return [v / norm for v in raw]


def to_float32(vector: Sequence[float]) -> list[float]:
    """Round each value through float32, as a base64 answer carries it."""
    n = len(vector)
    return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *vector)))


def expected_embedding_f32(
    text: str, model: str = DEFAULT_EMBED_MODEL, dim: int = 384
) -> list[float]:
    """:func:`expected_embedding` rounded through float32 (base64 answers)."""
    return to_float32(expected_embedding(text, model, dim))


def encode_base64_f32(vector: Sequence[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64_f32(data: str) -> list[float]:
    """The inverse of :func:`encode_base64_f32`, for tests and benchmarks."""
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


_TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """A stand-in tokenizer (words and punctuation) for the usage counts."""
    return len(_TOKEN.findall(text))


_WORDS = (
    "the", "gpu", "came", "back", "and", "every", "parked", "request",
    "was", "answered", "in", "order", "while", "tokens", "kept", "flowing",
)


def expected_reply(
    prompt: str, model: str = DEFAULT_CHAT_MODEL, chunks: int = 5
) -> list[str]:
    """
    The pieces the sim streams for ``prompt``; joined, the whole reply.

    For chat routes the prompt is :func:`messages_prompt` of the messages.
    """
    seed = _seed(model, b"\0reply\0", prompt)
    pieces = []
    for i in range(chunks):
        word = _WORDS[seed[i % len(seed)] % len(_WORDS)]
        pieces.append(word if i == 0 else " " + word)
    return pieces


def _content_text(content: Any) -> str:
    """OpenAI lets content be a list of parts; keep the text ones."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def messages_prompt(messages: Iterable[dict[str, Any]]) -> str:
    """The text a chat reply is derived from: ``role: content`` lines."""
    return "\n".join(
        f"{m.get('role', 'user')}: {_content_text(m.get('content'))}"
        for m in messages
    )


# ---------------------------------------------------------------------------
# For the single-model servers' other routes (TEI, Infinity, llama.cpp).


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is all zeros)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def expected_relevance(query: str, document: str, model: str = DEFAULT_EMBED_MODEL) -> float:
    """
    The score a reranker gives ``document`` for ``query``: in [0, 1], 1 for the same text.

    ``(1 + cosine) / 2`` of the two texts' vectors, so tests can recompute it
    and a document equal to the query always ranks first.
    """
    score = (1.0 + cosine(expected_embedding(query, model), expected_embedding(document, model))) / 2.0
    return min(1.0, max(0.0, score))


def expected_labels(text: str, model: str = DEFAULT_EMBED_MODEL) -> list[tuple[str, float]]:
    """A classifier's ``(label, score)`` pairs for ``text``, highest score first, summing to 1."""
    seed = _seed(model, b"\0label\0", text)
    positive = (int.from_bytes(seed[:4], "big") + 1) / (2**32 + 2)
    pairs = [("positive", positive), ("negative", 1.0 - positive)]
    return sorted(pairs, key=lambda pair: pair[1], reverse=True)


def expected_tokens(text: str) -> list[tuple[int, str, int, int]]:
    """The stand-in tokenizer's tokens of ``text``: ``(id, text, start, stop)``, ids from 1000 up."""
    return [
        (1000 + int.from_bytes(hashlib.sha256(m.group().encode("utf-8", "surrogatepass")).digest()[:4], "big") % 29000,
         m.group(), m.start(), m.end())
        for m in _TOKEN.finditer(text)
    ]


def expected_sparse(text: str, model: str = DEFAULT_EMBED_MODEL) -> list[tuple[int, float]]:
    """A sparse (SPLADE) vector of ``text``: ``(index, value)`` by index, one per distinct token."""
    out: dict[int, float] = {}
    for token_id, token, _, _ in expected_tokens(text):
        seed = _seed(model, b"\0sparse\0", token)
        out[token_id] = 0.05 + 2.95 * int.from_bytes(seed[:4], "big") / 2**32
    return sorted(out.items())
