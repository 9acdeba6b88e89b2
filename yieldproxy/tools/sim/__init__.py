"""
A simulated Ollama backend (and TEI, Infinity or llama.cpp, ``--api``) for the demo, the benchmarks and
the tests.  What it does and where each part is: docs/architecture.md (*The simulated Ollama*); how it
plays each server: docs/servers.md (*The simulated servers*).

Part of tools/ (layer 12): it may import any layer below (it takes the core's
names and the edge's TCP and listen-error helpers); nothing in the proxy imports it.
"""

from __future__ import annotations

from .command import main
from .content import (
    DEFAULT_CHAT_MODEL,
    DEFAULT_EMBED_MODEL,
    canonical_model,
    cosine,
    count_tokens,
    decode_base64_f32,
    encode_base64_f32,
    expected_embedding,
    expected_embedding_f32,
    expected_labels,
    expected_relevance,
    expected_reply,
    expected_sparse,
    expected_tokens,
    messages_prompt,
    raw_embedding,
    to_float32,
)
from .jobs import SimRequest
from .models import parse_keep_alive
from .modes import MODES
from .ollama import BUSY_ERROR, LOAD_OOM_ERROR, OOM_ERROR, SIM_VERSION, UNKNOWN_ERROR
from .ollama_requests import template_error
from .server import APIS, DEFAULT_MODELS, SimOllama

__all__ = [
    "APIS",
    "BUSY_ERROR",
    "DEFAULT_MODELS",
    "DEFAULT_CHAT_MODEL",
    "DEFAULT_EMBED_MODEL",
    "LOAD_OOM_ERROR",
    "MODES",
    "OOM_ERROR",
    "SIM_VERSION",
    "SimOllama",
    "SimRequest",
    "UNKNOWN_ERROR",
    "canonical_model",
    "cosine",
    "count_tokens",
    "decode_base64_f32",
    "encode_base64_f32",
    "expected_embedding",
    "expected_embedding_f32",
    "expected_labels",
    "expected_relevance",
    "expected_reply",
    "expected_sparse",
    "expected_tokens",
    "main",
    "messages_prompt",
    "parse_keep_alive",
    "raw_embedding",
    "template_error",
    "to_float32",
]
