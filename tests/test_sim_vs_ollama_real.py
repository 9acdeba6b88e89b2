"""The simulated Ollama against the real one (issue 30): one list of scenarios, both servers, the same answers.

Every Ollama behaviour the proxy relies on (its routes, its error statuses,
shapes and words, what it answers a body it cannot decode or a foreign
Origin) is played by :class:`yieldproxy.tools.sim.SimOllama` in most of the
suite.  Here each scenario is sent, directly and not through the proxy, to
the sim and to a real Ollama (``.ci/ollama``, tests/ollamaserver.py), and the
answers are compared: the status, the error's shape and its words; for a
success, the shape (the keys) only, since the sim's vectors and replies are
its own.

Where Ollama's current source answers otherwise than the version built
here, the sim follows the current source and :data:`CURRENT_SOURCE` says
what differs and where the current source says so.  Any other difference
fails the test: fix the sim (or the scenario's claim), never widen the
comparison.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import in_thread
from ollamaserver import CHAT_MODEL, EMBED_MODEL, request, require_ollama, started

pytestmark = pytest.mark.heavy


@attrs.frozen
class Scenario:
    name: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def send(self, root: str) -> tuple[int, dict[str, str], bytes]:
        return request(root, self.method, self.path, self.body, raw=self.raw, headers=dict(self.headers))


LONG = " ".join(["yield"] * 2000)

SCENARIOS = [
    # Model calls that succeed: the shapes.
    Scenario("embed", "POST", "/api/embed", {"model": EMBED_MODEL, "input": ["a", "b"]}),
    Scenario("embed one text", "POST", "/api/embed", {"model": EMBED_MODEL, "input": "a"}),
    Scenario("embeddings (legacy)", "POST", "/api/embeddings", {"model": EMBED_MODEL, "prompt": "a"}),
    Scenario("v1 embeddings", "POST", "/v1/embeddings", {"model": EMBED_MODEL, "input": ["a"]}),
    Scenario("chat, not streamed", "POST", "/api/chat",
             {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False, "options": {"num_predict": 4}}),
    Scenario("generate, not streamed", "POST", "/api/generate",
             {"model": CHAT_MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 4}}),
    Scenario("unload", "POST", "/api/generate", {"model": CHAT_MODEL, "keep_alive": 0}),
    # Unknown models.
    Scenario("embed, unknown model", "POST", "/api/embed", {"model": "no-such", "input": "a"}),
    Scenario("embeddings, unknown model", "POST", "/api/embeddings", {"model": "no-such", "prompt": "a"}),
    Scenario("chat, unknown model", "POST", "/api/chat", {"model": "no-such", "messages": [{"role": "user", "content": "hi"}]}),
    Scenario("generate, unknown model", "POST", "/api/generate", {"model": "no-such", "prompt": "hi"}),
    Scenario("show, unknown model", "POST", "/api/show", {"model": "no-such"}),
    Scenario("v1 embeddings, unknown model", "POST", "/v1/embeddings", {"model": "no-such", "input": "a"}),
    Scenario("v1 chat, unknown model", "POST", "/v1/chat/completions", {"model": "no-such", "messages": [{"role": "user", "content": "hi"}]}),
    # Bodies Ollama cannot read.
    Scenario("embed, not JSON", "POST", "/api/embed", raw=b"not json"),
    Scenario("embed, no body", "POST", "/api/embed", raw=b""),
    Scenario("embed, model of the wrong type", "POST", "/api/embed", {"model": 5, "input": "a"}),
    Scenario("embed, input of the wrong type", "POST", "/api/embed", {"model": EMBED_MODEL, "input": 5}),
    Scenario("chat, messages of the wrong type", "POST", "/api/chat", {"model": CHAT_MODEL, "messages": "hi"}),
    Scenario("embed, over the context with truncate false", "POST", "/api/embed",
             {"model": EMBED_MODEL, "input": LONG, "truncate": False}),
    # Routes and methods.
    Scenario("unknown route", "POST", "/api/embedd", {"model": EMBED_MODEL}),
    Scenario("wrong method", "GET", "/api/embed"),
    Scenario("model list", "GET", "/api/tags"),
    Scenario("loaded models", "GET", "/api/ps"),
    Scenario("version", "GET", "/api/version"),
    Scenario("v1 model list", "GET", "/v1/models"),
    # CORS.
    Scenario("foreign Origin", "POST", "/api/embed", {"model": EMBED_MODEL, "input": "a"}, headers=(("Origin", "https://evil.example"),)),
    Scenario("local Origin", "POST", "/api/embed", {"model": "no-such", "input": "a"}, headers=(("Origin", "http://localhost:3000"),)),
]

#: Where Ollama's current source answers otherwise than v0.11.4, the sim follows the current source:
#: scenario -> (what the sim answers instead, where the current source says so).
CURRENT_SOURCE: dict[str, tuple[Any, str]] = {}


def shape(value: Any) -> Any:
    """The keys of a JSON answer, nested, without the values (the sim's numbers and words are its own)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if not isinstance(value, (int, float)) or isinstance(value, bool) else "number"


def reading(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """What the comparison looks at: the status, and the error's exact form or the success's shape."""
    kind = (headers.get("Content-Type") or "").split(";")[0]
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    if status >= 400:
        if parsed is None:
            return {"status": status, "content-type": kind or None, "body": body.decode(errors="replace")}
        if isinstance(parsed.get("error"), dict):  # OpenAI's shape: the words and the type, not null fields
            error = {k: v for k, v in parsed["error"].items() if v is not None}
            return {"status": status, "error": error}
        return {"status": status, "error": parsed.get("error")}
    return {"status": status, "shape": shape(parsed) if parsed is not None else body.decode(errors="replace")}


@pytest.fixture(scope="module")
def both():
    """A real Ollama and a sim that serves the same two models, on free ports."""
    require_ollama()
    real = started()
    try:
        yield real
    finally:
        real.cleanup()


@pytest_twisted.ensureDeferred
async def test_the_sim_answers_every_scenario_as_the_real_ollama_does(both):
    from yieldproxy.tools.sim import SimOllama

    sim = SimOllama(reactor, models=(EMBED_MODEL, CHAT_MODEL))
    port = await sim.listen()
    sim_root = f"http://127.0.0.1:{port}"
    try:
        differences = []
        for scenario in SCENARIOS:
            real = reading(*await in_thread(reactor, scenario.send, both.root))
            simulated = reading(*await in_thread(reactor, scenario.send, sim_root))
            expected = CURRENT_SOURCE.get(scenario.name, (real, ""))[0]
            if simulated != expected:
                differences.append(f"{scenario.name}:\n  real {real}\n  sim  {simulated}")
        assert not differences, "the sim differs from the real Ollama:\n" + "\n".join(differences)
    finally:
        await sim.stop()
