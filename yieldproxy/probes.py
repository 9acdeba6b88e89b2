"""Minimal calls that test what failed: the outage probe of a model call.

``/api/version`` answers while Ollama's runner cannot load or run a model, so
an outage that model calls revealed is probed with a model call of the same
kind: the same route family and the same model, with the smallest input that
still makes Ollama schedule the model (and so load it onto the GPU).  A
request whose own input broke its call (a huge context, a bad option) is not
reproduced by such a probe, which is how the proxy tells "the GPU is down"
from "this request is wrong".
"""

from __future__ import annotations

from typing import Any

import attrs

#: The text embedded by a probe of an embedding route (short, and easy to tell apart in logs).
PROBE_TEXT = "yieldproxy outage probe"


@attrs.frozen
class ModelCall:
    """What failed: a model route (as forwarded) and the model its body named."""

    path: str
    model: str


def _tiny_chat() -> list[dict[str, str]]:
    return [{"role": "user", "content": "hi"}]


def minimal_call(kind: ModelCall) -> tuple[str, str, dict[str, Any]] | None:
    """``(method, path, JSON body)`` of the smallest call of ``kind``'s kind, or None for other routes.

    Embeddings embed one short text.  Ollama's ``/api/generate`` and
    ``/api/chat`` load the model with an empty prompt / no messages and
    answer at once (``server/routes.go``: "load the model"), which is the
    step a GPU failure breaks; the OpenAI-compatible routes have no such
    form, so they generate one token.
    """
    model = kind.model
    path = kind.path
    if path == "/api/embed":
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path == "/api/embeddings":
        return "POST", path, {"model": model, "prompt": PROBE_TEXT}
    if path == "/v1/embeddings":
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path == "/api/generate":
        return "POST", path, {"model": model, "prompt": "", "stream": False}
    if path == "/api/chat":
        return "POST", path, {"model": model, "messages": [], "stream": False}
    if path == "/v1/chat/completions":
        return "POST", path, {"model": model, "messages": _tiny_chat(), "max_tokens": 1, "stream": False}
    if path == "/v1/completions":
        return "POST", path, {"model": model, "prompt": "hi", "max_tokens": 1, "stream": False}
    return None
