"""
A simulated Ollama backend for the demo, the benchmarks and the tests.

No Ollama binary and no GPU can be reached where yieldproxy is built and
tested, yet the proxy must be checked against something that speaks Ollama's
API, serves a bounded number of requests at once, and can fail the ways a
real GPU server fails.  :class:`SimOllama` is that something:

* it answers the model routes (``/api/embed``, ``/api/embeddings``,
  ``/v1/embeddings``, ``/api/chat``, ``/api/generate``,
  ``/v1/chat/completions``, ``/v1/completions``) with deterministic content,
  so a test can recompute every vector (:func:`expected_embedding`) and every
  reply (:func:`expected_reply`) that came through the proxy;
* it serves at most ``parallel`` requests at once (like
  ``OLLAMA_NUM_PARALLEL``) and counts what it saw (``in_flight``,
  ``peak_in_flight``, ``peak_serving``, ``requests_total``,
  ``texts_embedded``), so a test can check the proxy's replay cap and prove
  that no text was embedded twice;
* it can be switched at run time into an outage (:meth:`SimOllama.set_mode`):
  ``refuse``, ``error500`` (``/api/version`` answers while every model call
  gets Ollama's runner out-of-memory 500), ``error500_unknown`` (the same in
  words no list has), ``hang``, ``reset``, ``stall`` (the head of the answer
  and its first bytes, then nothing) or ``stall_head`` (the head alone, then
  nothing);
* with ``api="tei"``, ``"infinity"`` or ``"llamacpp"`` (``--api``) it plays
  text-embeddings-inference, Infinity or llama.cpp's server instead: their
  native routes, answers and error shapes, each from its own source
  (docs/servers.md), with the same deterministic content;
* it can fail one model while it serves the others
  (:meth:`SimOllama.set_model_mode`: ``hang``, ``error500``, ``error500_unknown``),
  and load one model slowly (:meth:`SimOllama.set_load_seconds`);
* it fails single requests the way Ollama does for their own input: a
  ``template`` it cannot parse gets a 500 quoting the template's parse error
  (:func:`template_error`), and an ``options.num_ctx`` above ``max_num_ctx``
  gets a load out-of-memory 500 (:data:`LOAD_OOM_ERROR`) while other calls work.

Every timer goes through the injected reactor, so the logic runs under a
:class:`twisted.internet.task.Clock` too.  Only :func:`main` touches the
global reactor.

Where things are: :mod:`.content` (the deterministic vectors and replies),
:mod:`.server` (:class:`SimOllama`, which follows each request through the
parts), :mod:`.jobs` (the parallel cap and queue), :mod:`.models` (loads and
keep-alive), :mod:`.modes` (the outage modes), :mod:`.listening` (the port it
owns), :mod:`.api` (what a server's API is made of), :mod:`.ollama` and
:mod:`.ollama_requests` (Ollama's routes, answers and request checks),
:mod:`.tei`, :mod:`.infinity`, :mod:`.llamacpp` (the other servers' APIs),
:mod:`.openai` (OpenAI's shapes), :mod:`.command` (the command line).

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
