"""A pool of simulated Ollamas behind one proxy, through real sockets and the real clients (issue 12).

Every sim answers the same model with the same deterministic vectors, so
every answer is recomputed; each sim counts what it embedded and answered
(``texts_embedded``), which proves where each request went and that none
was answered twice.  The ``ollama`` client runs in threads (it blocks), the
``openai`` client in an asyncio loop in a thread; the proxy and the sims stay
in the reactor.
"""

from __future__ import annotations

import asyncio

import ollama
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import admin, config_with, embedded, in_thread, start_pool_stack, wait_for
from test_burst import Burst
from yieldproxy.tools.sim import expected_embedding, expected_embedding_f32, expected_reply

MODEL = "all-minilm"
TIMEOUT = 30.0


def assert_clean(burst: Burst, stack) -> None:
    """Every text answered, right, by exactly one embedding somewhere (bar counted retries); nothing left."""
    assert burst.failures == []
    assert burst.wrong == []
    assert burst.done == len(burst.texts)
    counts: dict[str, int] = {}
    for sim in stack.sims.values():
        for text, n in embedded(sim).items():
            counts[text] = counts.get(text, 0) + n
    assert set(counts) == set(burst.texts)
    # A text embedded twice is only ever a counted retry (the backend answered, the connection died).
    extra = sum(n - 1 for n in counts.values())
    assert extra <= stack.sample("yieldproxy_retries_total", **{"class": "batch"})
    assert len(stack.proxy.lot) == 0 and stack.proxy.scheduler.inflight == 0


@pytest_twisted.ensureDeferred
async def test_one_upstream_yielded_nothing_parks_and_the_other_answers_everything():
    """The desktop games (POST /yield {"upstream": "desktop"}): a burst is served, right, by the server alone."""
    stack = await start_pool_stack(reactor, [{"name": "desktop"}, {"name": "server"}], latency=0.002, parallel=4)
    try:
        status = await admin(stack, "/yield", {"upstream": "desktop", "reason": "game"})
        assert status["state"] == "available"
        assert [(u["name"], u["state"]) for u in status["upstreams"]] == [("desktop", "yielded"), ("server", "available")]
        burst = Burst(stack.proxy_url, [f"desktop games {i}" for i in range(300)], concurrency=16)
        await in_thread(reactor, burst.run, timeout=120)
        assert_clean(burst, stack)
        assert embedded(stack.sims["desktop"]) == {}
        assert set(embedded(stack.sims["server"]).values()) == {1}
        # Nothing ever parked.
        assert stack.sample("yieldproxy_park_seconds_count", **{"class": "batch"}) == 0
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="server", outcome="ok") == 300
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="desktop", outcome="ok") == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_the_openai_client_is_served_by_the_available_upstream():
    """The ``openai`` client (base64 floats) through a pool with one upstream yielded."""
    import numpy as np
    from openai import AsyncOpenAI

    stack = await start_pool_stack(reactor, [{"name": "a"}, {"name": "b"}], latency=0.002)
    texts = [f"openai text {i}" for i in range(64)]
    try:
        await admin(stack, "/yield", {"upstream": "b"})

        async def main():
            client = AsyncOpenAI(base_url=stack.proxy_url + "/v1", api_key="x", max_retries=0)
            try:
                batches = [texts[i : i + 8] for i in range(0, len(texts), 8)]
                answers = await asyncio.gather(*(client.embeddings.create(model=MODEL, input=b) for b in batches))
            finally:
                await client.close()
            return [(batch, [d.embedding for d in a.data]) for batch, a in zip(batches, answers)]

        results = await in_thread(reactor, lambda: asyncio.run(main()), timeout=60)
        for batch, vectors in results:
            for text, vector in zip(batch, vectors):
                assert np.allclose(vector, expected_embedding_f32(text, MODEL), rtol=0, atol=1e-7)
        assert set(embedded(stack.sims["a"])) == set(texts) and embedded(stack.sims["b"]) == {}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_all_yielded_requests_park_and_replay():
    stack = await start_pool_stack(reactor, [{"name": "a"}, {"name": "b"}], latency=0.002)
    try:
        status = await admin(stack, "/yield", {"reason": "both busy"})
        assert status["state"] == "yielded"
        burst = Burst(stack.proxy_url, [f"parked {i}" for i in range(40)], concurrency=8)
        running = in_thread(reactor, burst.run, timeout=60)
        # All 8 callers are parked, so none can be at a backend.
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 8, timeout=TIMEOUT)
        assert burst.done == 0 and all(embedded(sim) == {} for sim in stack.sims.values())
        await admin(stack, "/resume", {})
        await running
        assert_clean(burst, stack)
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) >= 8
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_one_resumed_the_lot_drains_into_it_at_its_cap_while_the_other_stays_held():
    stack = await start_pool_stack(
        reactor, [{"name": "a", "replay_concurrency": 2}, {"name": "b", "replay_concurrency": 3}],
        latency=0.02, parallel=8,
    )
    try:
        await admin(stack, "/yield", {"upstream": "a", "source": "game"})
        await admin(stack, "/yield", {"upstream": "b", "source": "backup"})
        burst = Burst(stack.proxy_url, [f"one back {i}" for i in range(60)], concurrency=24)
        running = in_thread(reactor, burst.run, timeout=60)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 24, timeout=TIMEOUT)
        for sim in stack.sims.values():
            sim.reset_peak()
        status = await admin(stack, "/resume", {"source": "game", "upstream": "a"})
        assert [(u["name"], u["state"]) for u in status["upstreams"]] == [("a", "available"), ("b", "yielded")]
        await running
        assert_clean(burst, stack)
        # Replay started at once on a, never above its own cap; b stayed held and saw nothing.
        assert stack.sims["a"].peak_in_flight <= 2
        assert embedded(stack.sims["b"]) == {}
        assert stack.proxy.state.yielded_for("b")
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_model_only_one_upstream_serves_parks_while_that_one_is_yielded():
    stack = await start_pool_stack(
        reactor,
        [{"name": "big", "models": ["llama3.2", MODEL]}, {"name": "small", "models": [MODEL]}],
        latency=0.002,
    )
    try:
        await admin(stack, "/yield", {"upstream": "big"})
        chat = in_thread(
            reactor,
            lambda: ollama.Client(host=stack.proxy_url, timeout=60).generate(model="llama3.2", prompt="hello"),
            timeout=60,
        )
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1, timeout=TIMEOUT)
        # Embeddings are not held up: the small one serves them.
        burst = Burst(stack.proxy_url, [f"meanwhile {i}" for i in range(20)], concurrency=4)
        await in_thread(reactor, burst.run, timeout=60)
        assert burst.done == 20 and burst.failures == [] and len(stack.proxy.lot) == 1
        assert set(embedded(stack.sims["small"])) == set(burst.texts)
        assert stack.proxy.scheduler.waiting_for("big") == 1 and stack.proxy.scheduler.waiting_for("small") == 0
        await admin(stack, "/resume", {})
        answer = await chat
        assert answer.response == "".join(expected_reply("hello"))
        assert stack.sims["big"].requests_total["/api/generate"] == 1
        assert stack.sims["small"].requests_total["/api/generate"] == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_one_upstream_killed_mid_burst_the_others_carry_the_load():
    """A box dies mid-burst: its outage is detected, the others serve everything, nothing lost or doubled."""
    config = config_with(upstream={"attempt_timeout_seconds": 2.0, "health_interval_seconds": 0.2})
    stack = await start_pool_stack(
        reactor, [{"name": "a"}, {"name": "b"}, {"name": "c"}], config=config, watchers=True,
        latency=0.005, parallel=4,
    )
    try:
        await wait_for(reactor, lambda: all(m.health.reachable for m in stack.proxy.scheduler.members), timeout=TIMEOUT)
        burst = Burst(stack.proxy_url, [f"killed {i}" for i in range(600)], concurrency=16)
        running = in_thread(reactor, burst.run, timeout=120)
        await wait_for(reactor, lambda: burst.done >= 100 and stack.sims["a"].in_flight >= 1, timeout=TIMEOUT)
        await stack.sims["a"].set_mode("refuse")
        await wait_for(reactor, lambda: stack.proxy.scheduler.member("a").state_name() == "outage", timeout=TIMEOUT)
        done_when_down = burst.done
        await running
        assert done_when_down < len(burst.texts)
        assert_clean(burst, stack)
        # b and c served the rest.
        served_after = sum(len(embedded(stack.sims[n])) for n in ("b", "c"))
        assert served_after >= len(burst.texts) - len(embedded(stack.sims["a"]))
        # a comes back: its outage hold ends, and it serves again.
        await stack.sims["a"].set_mode("ok")
        await wait_for(reactor, lambda: stack.proxy.scheduler.member("a").available(), timeout=TIMEOUT)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_model_lists_are_the_union_and_passthrough_goes_to_one_upstream():
    stack = await start_pool_stack(
        reactor,
        [{"name": "a", "sim": {"models": ("all-minilm", "llama3.2")}}, {"name": "b", "sim": {"models": ("bge-m3", "all-minilm")}}],
    )
    try:
        tags = await (await treq.get(stack.proxy_url + "/api/tags").addTimeout(TIMEOUT, reactor)).json()
        assert [m["name"] for m in tags["models"]] == ["all-minilm:latest", "llama3.2:latest", "bge-m3:latest"]
        listed = await (await treq.get(stack.proxy_url + "/v1/models").addTimeout(TIMEOUT, reactor)).json()
        assert [m["id"] for m in listed["data"]] == ["all-minilm:latest", "llama3.2:latest", "bge-m3:latest"]
        version = await treq.get(stack.proxy_url + "/api/version").addTimeout(TIMEOUT, reactor)
        assert version.code == 200
        assert stack.sims["a"].requests_total["/api/version"] == 1 and stack.sims["b"].requests_total["/api/version"] == 0
        # Discovered lists route a model only one upstream has.
        await wait_for(reactor, lambda: all(m.catalogue.discovered for m in stack.proxy.scheduler.members), timeout=TIMEOUT)
        r = await treq.post(stack.proxy_url + "/api/embed", json={"model": "bge-m3", "input": "x"}).addTimeout(
            TIMEOUT, reactor
        )
        assert r.code == 200 and embedded(stack.sims["b"]) == {"x": 1}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_admin_names_the_upstreams_and_scopes_resumes():
    stack = await start_pool_stack(reactor, [{"name": "a"}, {"name": "b"}])
    try:
        answer = await treq.post(stack.admin_url + "/yield", json={"upstream": "c"}).addTimeout(TIMEOUT, reactor)
        assert answer.code == 400
        assert (await answer.json())["error"] == "unknown upstream 'c'; the upstreams are a, b"
        await admin(stack, "/yield", {"source": "broker"})
        # A hold of every upstream is not ended upstream by upstream.
        answer = await treq.post(stack.admin_url + "/resume", json={"source": "broker", "upstream": "a"})
        assert answer.code == 409 and "holds every upstream" in (await answer.json())["error"]
        await admin(stack, "/yield", {"source": "broker", "upstream": "a"})
        status = await admin(stack, "/resume", {"source": "broker"})
        assert status["holds"] == [] and status["state"] == "available"
        metrics = await (await treq.get(stack.admin_url + "/metrics")).text()
        assert 'yieldproxy_upstream_available{upstream="a"} 1.0' in metrics
        assert 'yieldproxy_upstream_available{upstream="b"} 1.0' in metrics
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_pool_of_one_gets_its_own_name_for_a_mapped_model_too():
    """A single ``[[upstreams]]`` entry's ``model_map`` renames as a pool of three's does (a pool of one read no
    model, so its upstream was asked for all-minilm, which it does not serve)."""
    stack = await start_pool_stack(
        reactor, [{"name": "b", "model_map": {MODEL: "minilm-l6"}, "sim": {"models": ("minilm-l6",)}}],
    )
    try:
        r = await treq.post(
            stack.proxy_url + "/api/embed", json={"model": MODEL, "input": ["mapped"]}
        ).addTimeout(TIMEOUT, reactor)
        body = await r.json()
        assert r.code == 200, body
        assert body["embeddings"][0] == expected_embedding("mapped", "minilm-l6")
        assert [(h.path, h.model) for h in stack.sims["b"].history if h.path != "/api/tags"] == [("/api/embed", "minilm-l6")]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_an_upstream_gets_its_own_name_for_a_mapped_model():
    """``model_map``: the request names all-minilm; the server that calls it minilm-l6 is asked for minilm-l6."""
    stack = await start_pool_stack(
        reactor,
        [{"name": "a", "models": ["llama3.2"]}, {"name": "b", "model_map": {MODEL: "minilm-l6"}, "sim": {"models": ("minilm-l6",)}}],
    )
    try:
        r = await treq.post(
            stack.proxy_url + "/api/embed", json={"Model": MODEL, "input": ["mapped"]}
        ).addTimeout(TIMEOUT, reactor)
        body = await r.json()
        assert r.code == 200, body
        assert body["embeddings"][0] == expected_embedding("mapped", "minilm-l6")
        assert [(h.path, h.model) for h in stack.sims["b"].history if h.path != "/api/tags"] == [("/api/embed", "minilm-l6")]
        assert embedded(stack.sims["a"]) == {}
    finally:
        await stack.stop()
