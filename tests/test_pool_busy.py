"""Busy is not failure: a pool member's "busy" answer sends the request to another member (issue 16, section 5).

A member whose server says it is full (Ollama's 503 ``server busy``, TEI's
429 ``Overloaded``) is up: the request goes to another eligible member that
has not answered it busy, not counted against ``upstream.max_attempts``, and
no outage is probed or held for it.  With no other member left, a 429 is the
caller's to hear (with its own words) and a 503 is judged as any 503.
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import config_with, start_pool_stack, wait_for
from rawhttp import counter_total
from yieldproxy.sim import expected_embedding, expected_reply, messages_prompt

TIMEOUT = 30.0
CHAT = "llama3.2"
#: Member a serves one request at a time and queues none: one call of its own fills it.
FULL = {"parallel": 1, "max_queue": 0, "latency": 3.0}
#: The same for embeddings, slow only for a long batch (twin verification's few texts stay quick).
ONE_SLOT = {"parallel": 1, "max_queue": 0, "per_item_latency": 0.1}
#: A batch that takes ONE_SLOT's slot for about 3 s.
LONG_BATCH = {"inputs": [f"long {i}" for i in range(30)]}

async def fill(sim, path: str, body: dict):
    """A call straight to ``sim`` (not through the proxy) that takes its one slot; wait until it does."""
    pending = treq.post(sim.url + path, json=body, persistent=False).addTimeout(TIMEOUT, reactor)
    await wait_for(reactor, lambda: sim.serving == 1, timeout=10)
    return pending

@pytest_twisted.ensureDeferred
async def test_an_ollama_members_busy_503_goes_to_another_member_uncounted_and_holds_nothing():
    members = [{"name": "a", "sim": FULL}, {"name": "b"}]
    config = config_with(upstream={"max_attempts": 1})
    stack = await start_pool_stack(reactor, members, config=config, watchers=True, latency=0.01)
    try:
        occupied = await fill(stack.sims["a"], "/api/chat", {"model": CHAT, "messages": [{"role": "user", "content": "x"}], "stream": False})
        messages = [{"role": "user", "content": "who serves"}]
        answer = await treq.post(
            stack.proxy_url + "/api/chat", json={"model": CHAT, "messages": messages, "stream": False},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        body = json.loads(await answer.content())
        assert answer.code == 200, body
        assert body["message"]["content"] == "".join(expected_reply(messages_prompt(messages), CHAT))
        # a said busy once (Ollama's own words), b served it; with max_attempts = 1 it was not counted.
        assert stack.sims["a"].outcomes["busy"] == 1
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="a", outcome="busy") == 1
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok") == 1
        # Busy is not an outage: nothing probed, nothing held, nothing counted as a failure.
        assert counter_total(stack, "yieldproxy_outage_probes", probe="model") == 0
        assert not stack.proxy.state.yielded_for("a")
        assert counter_total(stack, "yieldproxy_upstream_failures") == 0
        assert (await occupied).code == 200
    finally:
        await stack.stop()

@pytest_twisted.ensureDeferred
async def test_a_busy_429_goes_to_another_member_and_is_relayed_only_when_every_member_said_busy():
    model = "BAAI/bge-small-en-v1.5"
    tei = {"api": "tei", "models": (model,)}
    members = [
        {"name": "a", "api": "tei", "sim": {**tei, **ONE_SLOT}},
        {"name": "b", "api": "tei", "sim": {**tei, **ONE_SLOT}},
    ]
    # b is a's verified twin (same model, same vectors), so either may serve the model's embeddings.
    config = config_with(verification={"models": (model,)})
    stack = await start_pool_stack(reactor, members, config=config, latency=0.01)
    try:
        assert stack.proxy.twins.settled
        occupied = [await fill(stack.sims["a"], "/embed", LONG_BATCH)]
        request = {"model": model, "input": ["t"]}
        answer = await treq.post(stack.proxy_url + "/v1/embeddings", json=request, persistent=False).addTimeout(
            TIMEOUT, reactor
        )
        assert answer.code == 200
        assert json.loads(await answer.content())["data"][0]["embedding"] == expected_embedding("t", model)
        assert stack.sims["a"].outcomes["busy"] == 1
        # Both full: each said busy once, and the caller hears TEI's own 429 (before: at once, from a).
        occupied.append(await fill(stack.sims["b"], "/embed", LONG_BATCH))
        answer = await treq.post(stack.proxy_url + "/v1/embeddings", json=request, persistent=False).addTimeout(
            TIMEOUT, reactor
        )
        assert answer.code == 429
        assert json.loads(await answer.content())["type"] == "Overloaded"
        assert stack.sims["a"].outcomes["busy"] == 2 and stack.sims["b"].outcomes["busy"] == 1
        for pending in occupied:
            assert (await pending).code == 200
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_busy_answer_is_not_retried_on_the_same_member_for_a_standby_that_may_not_take_it():
    """a (``always``) is full and answers busy; b is a standby (``use = "when_others_yielded"``), which
    may take nothing while a is available (busy is not unavailable).  So no other member may take the
    request now: a's 503 is judged as any 503 (here counted: max_attempts = 1, no outage watcher: given
    up, 502), once.
    (Before: b counted as a member that may take it, so the request went back to the lot, a took it
    again, said busy again, and so on, uncounted, one upstream call per turn until a had room.)"""
    members = [{"name": "a", "sim": FULL}, {"name": "b", "use": "when_others_yielded"}]
    config = config_with(upstream={"max_attempts": 1, "retry_backoff_seconds": 0.05, "retry_backoff_max_seconds": 0.1})
    stack = await start_pool_stack(reactor, members, config=config, latency=0.01)
    try:
        occupied = await fill(stack.sims["a"], "/api/chat", {"model": CHAT, "messages": [{"role": "user", "content": "x"}], "stream": False})
        answer = await treq.post(
            stack.proxy_url + "/api/chat", json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "stream": False},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        body = json.loads(await answer.content())
        # Given up after its one counted attempt, in the proxy's words quoting Ollama's.
        assert answer.code == 502, body
        assert "server busy" in body["error"]
        assert stack.sims["a"].outcomes["busy"] == 1
        assert stack.sims["b"].requests_total["/api/chat"] == 0
        assert (await occupied).code == 200
    finally:
        await stack.stop()
