"""A pool with a real Infinity member (``api = "infinity"``) beside a simulated Ollama (issue 12).

One real Infinity serving all-MiniLM-L6-v2 (``--url-prefix /v1``, as
``tests/test_fallback_real.py`` starts it) and one simulated Ollama serving
other models sit behind one pool proxy.  Through the real ``openai`` and
``ollama`` clients the test proves that the proxy's ``/v1/models`` is the
union of both, that an Infinity-model embedding goes to Infinity alone with
the vectors Infinity gives when asked directly, and that each member yields
on its own: its requests park and are answered after its resume, while the
other member's are served at once.

Needs the ``fallback-test`` extra (``.ci/run`` installs it); skipped with the
reason where it is missing, failed with ``CI`` set.
"""

from __future__ import annotations

import attrs
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import EPHEMERAL, in_thread, listening_url, pool_config, wait_for
from test_fallback_real import _same_vector, running_infinity
from yieldproxy.tools.sim import SimOllama, expected_embedding

# Real processes for half a minute or more: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

INFINITY_MODEL = "all-minilm"
OLLAMA_MODELS = ("nomic-embed-text", "llama3.2")
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def infinity():
    """One real Infinity of all-MiniLM-L6-v2 under ``/v1``, for the module."""
    with running_infinity("pool") as server:
        yield server


@attrs.define(eq=False)
class MixedPool:
    """The proxy, its simulated Ollama member, and where to reach them."""

    proxy: object
    sim: SimOllama
    proxy_url: str
    admin_url: str

    async def stop(self) -> None:
        if self.proxy.service.running:
            await self.proxy.service.stopService()
        await self.sim.stop()

    def sample(self, name: str, **labels) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def admin(self, path: str, body: dict) -> dict:
        answer = await treq.post(self.admin_url + path, json=body, persistent=False).addTimeout(TIMEOUT, reactor)
        assert answer.code == 200, await answer.text()
        return await answer.json()


async def start_mixed_pool(infinity_root: str) -> MixedPool:
    """``[[upstreams]]``: ``infinity`` (the real one, api infinity) then ``gpu`` (a simulated Ollama)."""
    from yieldproxy.service import build

    sim = SimOllama(reactor, latency=0.002, models=OLLAMA_MODELS)
    port = await sim.listen()
    config = pool_config(
        {"name": "infinity", "url": infinity_root, "api": "infinity", "detect_outages": False},
        {"name": "gpu", "url": f"http://127.0.0.1:{port}", "api": "ollama", "detect_outages": False},
    ).with_overrides(**EPHEMERAL, **{"upstream.detect_outages": False})
    proxy = build(reactor, config)
    proxy.service.startService()
    return MixedPool(proxy, sim, listening_url(proxy, "proxy"), listening_url(proxy, "admin"))


def openai_embed(url: str, texts: list[str], model: str = INFINITY_MODEL) -> list[list[float]]:
    """The ``openai`` client's embeddings (base64, its default) of ``texts`` at ``url``."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    try:
        return [d.embedding for d in client.embeddings.create(model=model, input=texts).data]
    finally:
        client.close()


def ollama_embed(url: str, texts: list[str], model: str = OLLAMA_MODELS[0]) -> list[list[float]]:
    import ollama

    return [list(v) for v in ollama.Client(host=url, timeout=TIMEOUT).embed(model=model, input=texts).embeddings]


def infinity_attempts(pool: MixedPool) -> float:
    return pool.sample("yieldproxy_upstream_attempts_total", upstream="infinity", outcome="ok")


@pytest_twisted.ensureDeferred
async def test_a_real_infinity_member_serves_its_model_and_yields_on_its_own(infinity):
    texts = ["the desktop games", "the server embeds", "Kölner Dom", "東京", "def f(x): return x"]
    direct = await in_thread(reactor, openai_embed, infinity.root, texts)
    pool = await start_mixed_pool(infinity.root)
    try:
        # Both members' model lists have been read (Infinity's under its /v1 prefix).
        await wait_for(
            reactor, lambda: all(m.catalogue.discovered for m in pool.proxy.scheduler.members), timeout=TIMEOUT
        )

        # 1. The union of both members' model lists, through the openai client.
        import openai

        def listed():
            client = openai.OpenAI(base_url=pool.proxy_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            try:
                return [m.id for m in client.models.list()]
            finally:
                client.close()

        ids = await in_thread(reactor, listed)
        assert ids == [INFINITY_MODEL, "nomic-embed-text:latest", "llama3.2:latest"]

        # 2. An Infinity-model embedding goes to Infinity alone, with Infinity's own vectors.
        got = await in_thread(reactor, openai_embed, pool.proxy_url, texts)
        assert all(_same_vector(g, w) for g, w in zip(got, direct)) and len(got) == len(texts)
        # Raw HTTP on Infinity's native route (under its /v1 prefix), floats this time.
        raw = await treq.post(
            pool.proxy_url + "/v1/embeddings", json={"model": INFINITY_MODEL, "input": texts[:2]}, persistent=False
        ).addTimeout(TIMEOUT, reactor)
        body = await raw.json()
        assert raw.code == 200, body
        assert all(_same_vector(d["embedding"], w) for d, w in zip(body["data"], direct[:2]))
        assert infinity_attempts(pool) == 2
        assert pool.sim.requests_total["/v1/embeddings"] == 0 and pool.sim.texts_embedded == {}

        # 3. Infinity yielded: its embeddings park, the Ollama member's are served meanwhile.
        await pool.admin("/yield", {"upstream": "infinity", "source": "restart"})
        parked = in_thread(reactor, openai_embed, pool.proxy_url, texts)
        await wait_for(reactor, lambda: len(pool.proxy.lot) == 1, timeout=TIMEOUT)
        meanwhile = [f"served meanwhile {i}" for i in range(4)]
        vectors = await in_thread(reactor, ollama_embed, pool.proxy_url, meanwhile)
        assert vectors == [expected_embedding(t, OLLAMA_MODELS[0]) for t in meanwhile]
        answers = await in_thread(reactor, openai_embed, pool.proxy_url, meanwhile[:1], OLLAMA_MODELS[0])
        # Served meanwhile (after it parked): the parked request was never let out to Infinity.
        assert len(answers) == 1 and pool.sim.requests_total["/v1/embeddings"] == 1
        assert not parked.called and len(pool.proxy.lot) == 1 and infinity_attempts(pool) == 2
        await pool.admin("/resume", {"source": "restart", "upstream": "infinity"})
        got = await parked
        assert all(_same_vector(g, w) for g, w in zip(got, direct)) and len(got) == len(texts)
        assert infinity_attempts(pool) == 3
        assert pool.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 1

        # 4. The Ollama member yielded: its embeddings park, Infinity's are not affected.
        await pool.admin("/yield", {"upstream": "gpu", "source": "game"})
        parked = in_thread(reactor, ollama_embed, pool.proxy_url, ["parked on the gpu"])
        await wait_for(reactor, lambda: len(pool.proxy.lot) == 1, timeout=TIMEOUT)
        got = await in_thread(reactor, openai_embed, pool.proxy_url, texts)
        assert all(_same_vector(g, w) for g, w in zip(got, direct))
        assert infinity_attempts(pool) == 4
        assert not parked.called and pool.sim.texts_embedded.get("parked on the gpu") is None
        await pool.admin("/resume", {"source": "game", "upstream": "gpu"})
        assert await parked == [expected_embedding("parked on the gpu", OLLAMA_MODELS[0])]
        assert pool.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 2
        assert len(pool.proxy.lot) == 0 and pool.proxy.scheduler.inflight == 0
    finally:
        await pool.stop()
