"""Twin verification through real sockets: two simulated Ollamas, the proxy, and the real ``ollama`` client.

``desktop`` is the reference of ``all-minilm`` (first in config order);
``server`` serves it too.  With the same weights its vectors are verified
equal at start and it takes every embedding while the desktop games; with
other weights (a model_map to a quantised copy: the sim's vectors come from
the model's name) its verification fails, and no embedding ever reaches it
while a chat for the same model does.
"""

from __future__ import annotations

import ollama
import pytest_twisted
from twisted.internet import reactor

from helpers import admin, embedded, in_thread, start_pool_stack, wait_for
from yieldproxy.tools.sim import (
    expected_embedding,
    expected_embedding_f32,
    expected_reply,
    messages_prompt,
)

MODEL = "all-minilm"
TIMEOUT = 30.0
def twins(status: dict, name: str) -> dict:
    return next(row for row in status["upstreams"] if row["name"] == name)["twins"]


@pytest_twisted.ensureDeferred
async def test_a_verified_twin_serves_embeddings_at_once_with_the_references_vectors():
    stack = await start_pool_stack(reactor, [{"name": "desktop"}, {"name": "server"}])
    try:
        status = await admin(stack, "/status")
        assert twins(status, "server")[MODEL]["state"] == "verified"
        assert twins(status, "server")[MODEL]["reference"] == "desktop"
        assert twins(status, "desktop")[MODEL]["state"] == "reference"
        assert stack.sample("yieldproxy_twin_verified", upstream="server", model=MODEL) == 1
        await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})
        texts = [f"twin text {i}" for i in range(20)]
        client = ollama.Client(host=stack.proxy_url, timeout=TIMEOUT)
        answer = await in_thread(reactor, client.embed, model=MODEL, input=texts, timeout=TIMEOUT)
        # Served by the twin at once: nothing parked, the desktop saw nothing.
        assert stack.sample("yieldproxy_park_seconds_count", **{"class": "batch"}) == 0
        assert embedded(stack.sims["desktop"]) == {}
        assert embedded(stack.sims["server"]) == {text: 1 for text in texts}
        # Every vector is the one the reference gives (asked directly, after the yield).
        await admin(stack, "/resume", {"source": "api"})
        reference = ollama.Client(host=stack.proxy.scheduler.member("desktop").spec.url, timeout=TIMEOUT)
        direct = await in_thread(reactor, reference.embed, model=MODEL, input=texts, timeout=TIMEOUT)
        assert [list(v) for v in answer.embeddings] == [list(v) for v in direct.embeddings]
        assert [list(v) for v in answer.embeddings] == [expected_embedding(t, MODEL) for t in texts]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_an_unverified_twin_never_serves_an_embedding_but_serves_chat():
    other = "all-minilm:q4_0"  # other weights: the sim's vectors come from the model's name
    stack = await start_pool_stack(reactor, [{"name": "desktop"}, {"name": "server", "model_map": {MODEL: other}}])
    try:
        status = await admin(stack, "/status")
        row = twins(status, "server")[MODEL]
        assert row["state"] == "mismatch" and "probe texts differ" in row["reason"]
        assert stack.sample("yieldproxy_twin_verified", upstream="server", model=MODEL) == 0
        assert stack.sample("yieldproxy_twin_verifications_total", upstream="server", result="mismatch") == 1
        await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})
        client = ollama.Client(host=stack.proxy_url, timeout=TIMEOUT)
        text = "must never be embedded by other weights"
        parked = in_thread(reactor, client.embed, model=MODEL, input=text, timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1, timeout=TIMEOUT)
        # A chat for the same model: the twin serves it at once.
        messages = [{"role": "user", "content": "hello twin"}]
        reply = await in_thread(reactor, client.chat, model=MODEL, messages=messages, timeout=TIMEOUT)
        assert reply.message.content == "".join(expected_reply(messages_prompt(messages), other))
        assert stack.sims["server"].requests_total["/api/chat"] == 1
        assert stack.sims["desktop"].requests_total["/api/chat"] == 0
        # The embedding still waits for its reference; the twin never saw it.
        assert not parked.called and len(stack.proxy.lot) == 1
        assert embedded(stack.sims["server"]) == {}
        await admin(stack, "/resume", {"source": "api"})
        answer = await parked
        assert list(answer.embeddings[0]) == expected_embedding(text, MODEL)
        assert embedded(stack.sims["desktop"]) == {text: 1}
        assert embedded(stack.sims["server"]) == {}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_the_openai_client_gets_no_embedding_from_an_unverified_twin():
    """The same through ``/v1/``: the real ``openai`` client (base64 floats) waits for the reference."""
    import asyncio

    import numpy as np
    from openai import AsyncOpenAI

    other = "all-minilm:q4_0"
    stack = await start_pool_stack(reactor, [{"name": "desktop"}, {"name": "server", "model_map": {MODEL: other}}])
    texts = [f"openai twin text {i}" for i in range(8)]
    try:
        await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})

        async def embed():
            client = AsyncOpenAI(base_url=stack.proxy_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            try:
                answer = await client.embeddings.create(model=MODEL, input=texts)
            finally:
                await client.close()
            return [d.embedding for d in answer.data]

        async def chat():
            client = AsyncOpenAI(base_url=stack.proxy_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            try:
                answer = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello twin"}]
                )
            finally:
                await client.close()
            return answer.choices[0].message.content

        parked = in_thread(reactor, lambda: asyncio.run(embed()), timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1, timeout=TIMEOUT)
        reply = await in_thread(reactor, lambda: asyncio.run(chat()), timeout=TIMEOUT)
        assert reply and stack.sims["server"].requests_total["/v1/chat/completions"] == 1
        assert not parked.called and embedded(stack.sims["server"]) == {}
        await admin(stack, "/resume", {"source": "api"})
        vectors = await parked
        for text, vector in zip(texts, vectors):
            assert np.allclose(vector, expected_embedding_f32(text, MODEL), rtol=0, atol=1e-7)
        assert embedded(stack.sims["desktop"]) == {text: 1 for text in texts}
        assert embedded(stack.sims["server"]) == {}
    finally:
        await stack.stop()
