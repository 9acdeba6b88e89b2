"""A CPU copy for embeddings in the pool, through real sockets and the real ``ollama`` client.

``desktop`` is a simulated Ollama (``always``); ``cpu`` a simulated server
of another dialect, ``use = "when_others_yielded"``: an OpenAI-compatible
server (a sim answering ``/v1/embeddings``, with a ``model_map`` that
renames the model to a name giving the same vectors) or an Infinity.  While
the desktop games, an Ollama client's ``/api/embed`` and ``/api/embeddings``
are answered at once by ``cpu``, translated, with the reference's vectors;
chat parks (``cpu`` cannot serve Ollama's chat); after the resume everything
goes back to the desktop.  A ``cpu`` whose vectors differ never serves.
"""

from __future__ import annotations

import json

import numpy as np
import ollama
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.logger import globalLogPublisher

from helpers import admin, embedded, in_thread, start_pool_stack, wait_for
from yieldproxy.tools.sim import OOM_ERROR, expected_embedding, expected_reply, messages_prompt

MODEL = "all-minilm"
TIMEOUT = 30.0
#: ``cpu`` as each kind of server: its ``[[upstreams]]`` keys and its sim's options.
CPUS = {
    # An OpenAI-compatible server; the model_map renames the model (same weights: the sim's vectors
    # come from the canonical name), so the test sees the map applied on the translated request.
    "openai": {"api": "openai", "model_map": {MODEL: f"{MODEL}:latest"}, "sim": {}},
    # Infinity serves one model under any name; its list (/models) names it.
    "infinity": {"api": "infinity", "sim": {"api": "infinity", "models": (MODEL,)}},
}


def pool(kind: str, **extra) -> list[dict]:
    return [{"name": "desktop"}, {"name": "cpu", "use": "when_others_yielded", **CPUS[kind], **extra}]


def twin_state(status: dict, name: str) -> dict:
    return next(row for row in status["upstreams"] if row["name"] == name)["twins"][MODEL]


def close(a, b) -> bool:
    """The same vector (the translation renormalises an already unit vector: the last bits may move)."""
    return np.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(CPUS))
@pytest_twisted.ensureDeferred
async def test_an_ollama_client_gets_embeddings_from_a_cpu_copy_at_once_while_the_desktop_games(kind):
    stack = await start_pool_stack(reactor, pool(kind))
    lines: list[dict] = []

    def observe(event: dict) -> None:
        if "request_line" in event:
            lines.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        status = await admin(stack, "/status")
        assert twin_state(status, "cpu")["state"] == "verified"
        assert twin_state(status, "desktop")["state"] == "reference"
        await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})
        client = ollama.Client(host=stack.proxy_url, timeout=TIMEOUT)
        texts = [f"cpu copy text {i}" for i in range(24)]
        answer = await in_thread(reactor, client.embed, model=MODEL, input=texts, timeout=TIMEOUT)
        legacy = await in_thread(reactor, client.embeddings, model=MODEL, prompt="legacy text", timeout=TIMEOUT)
        # Answered at once by cpu, in Ollama's shape, naming the caller's model: nothing parked.
        assert answer.model == MODEL and len(answer.embeddings) == len(texts)
        assert stack.sample("yieldproxy_park_seconds_count", **{"class": "batch"}) == 0
        assert embedded(stack.sims["desktop"]) == {}
        assert embedded(stack.sims["cpu"]) == {**{t: 1 for t in texts}, "legacy text": 1}
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="cpu", outcome="ok") == 2
        if kind == "openai":
            # The translated requests named the cpu's own model (its model_map), on its own route.
            seen = [(r.path, r.model) for r in stack.sims["cpu"].history if r.path == "/v1/embeddings"]
            assert seen[-2:] == [("/v1/embeddings", f"{MODEL}:latest")] * 2
        # Chat for the same model parks: cpu does not speak Ollama's chat.
        messages = [{"role": "user", "content": "hello"}]
        chat = in_thread(reactor, client.chat, model=MODEL, messages=messages, timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1, timeout=TIMEOUT)
        assert not chat.called
        await admin(stack, "/resume", {"source": "api"})
        reply = await chat
        assert reply.message.content == "".join(expected_reply(messages_prompt(messages), MODEL))
        # Back on the desktop: the same texts, the same vectors, now from the reference itself.
        again = await in_thread(reactor, client.embed, model=MODEL, input=texts, timeout=TIMEOUT)
        assert embedded(stack.sims["desktop"]) == {t: 1 for t in texts}
        for text, got, reference in zip(texts, answer.embeddings, again.embeddings):
            assert close(got, reference) and close(got, expected_embedding(text, MODEL))
        # Ollama's legacy route is not normalised by Ollama; the sim's vectors are unit ones already.
        assert close(legacy.embedding, expected_embedding("legacy text", MODEL))
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="cpu", outcome="ok") == 2
        # The request log tells the translated answers apart.
        logged = [(e["path"], e["status"], e.get("translated")) for e in lines if e["path"].startswith("/api/emb")]
        assert logged == [
            ("/api/embed", 200, "cpu"), ("/api/embeddings", 200, "cpu"), ("/api/embed", 200, None)
        ]
        assert [e for e in lines if e.get("translated")][0]["request_line"].endswith(" translated=cpu")
    finally:
        globalLogPublisher.removeObserver(observe)
        await stack.stop()


@pytest.mark.parametrize("kind", sorted(CPUS))
@pytest_twisted.ensureDeferred
async def test_a_cpu_copy_with_other_vectors_never_serves_an_ollama_client(kind):
    if kind == "openai":
        cpu = {"model_map": {MODEL: f"{MODEL}:q4_0"}}  # other weights: the sim's vectors come from the name
    else:
        cpu = {"sim": {"api": "infinity", "models": ("nomic-embed-text",)}, "models": [MODEL]}
    stack = await start_pool_stack(reactor, pool(kind, **cpu))
    try:
        status = await admin(stack, "/status")
        assert twin_state(status, "cpu")["state"] == "mismatch"
        await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})
        client = ollama.Client(host=stack.proxy_url, timeout=TIMEOUT)
        text = "must never be embedded by other weights"
        parked = in_thread(reactor, client.embed, model=MODEL, input=text, timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1, timeout=TIMEOUT)
        assert not parked.called and embedded(stack.sims["cpu"]) == {}
        await admin(stack, "/resume", {"source": "api"})
        answer = await parked
        assert list(answer.embeddings[0]) == expected_embedding(text, MODEL)
        assert embedded(stack.sims["desktop"]) == {text: 1} and embedded(stack.sims["cpu"]) == {}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_cpu_copys_error_reaches_the_ollama_client_in_ollamas_shape():
    """An error the cpu answers in OpenAI's shape is relayed to the Ollama client as ``{"error": "..."}``, status kept."""
    stack = await start_pool_stack(reactor, pool("openai"))
    try:
        await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})
        stack.sims["cpu"].set_mode("error500")
        body = {"model": MODEL, "input": ["x"]}
        answer = await treq.post(stack.proxy_url + "/api/embed", json=body, persistent=False).addTimeout(TIMEOUT, reactor)
        assert answer.code == 500
        assert json.loads(await answer.text()) == {"error": OOM_ERROR}
        assert answer.headers.getRawHeaders(b"content-type") == [b"application/json; charset=utf-8"]
        assert len(stack.proxy.lot) == 0
    finally:
        await stack.stop()
