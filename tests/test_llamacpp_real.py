"""A real llama.cpp ``llama-server`` in the pool (issue 20).

The server is built once per machine by ``.ci/llama-server`` (see
tests/llamaserver.py) and serves all-MiniLM-L6-v2 as ``all-minilm``: ready
in well under a second, 503 ``Loading model`` until then.  Two of them run
for the module; the start and restart tests start their own.

* its answers as :mod:`yieldproxy.servers.llamacpp` judges them (the loading
  503, the too-large 500, the context 400, ``input: []``);
* a member ``api = "llamacpp"``: ``/v1/embeddings``, its native
  ``/embedding`` and the Ollama client's ``/api/embed`` (translated) give the
  server's own vectors; a second llama-server is verified as its twin with
  the default probe texts (their long texts included) and serves the Ollama
  client while the first is yielded;
* a yield of that member parks what only it serves, and the rest goes on;
* an input over its batch is the caller's 500, relayed at once, nobody
  parked, no outage;
* started after the proxy, or killed (``kill -9``) and started again
  mid-burst: its loading 503 is *not ready*, and a burst through it ends
  with no failure;
* with a real Infinity (``--url-prefix /v1``, see tests/test_fallback_real.py):
  not twins with the default probe texts (Infinity cuts MiniLM at 256
  tokens, llama-server reads 512), either way round; twins with short probe
  texts only, which also proves every call to the prefixed Infinity goes
  under its prefix, as reference and as twin, with its models given in
  config too.
"""

from __future__ import annotations

import json
import shutil
import signal
import time

import attrs
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import EPHEMERAL, in_thread, listening_url, pool_config, sleep, wait_for
from llamaserver import ALIAS, LlamaServer, free_port, require_llama, started
from test_burst import Burst
from test_fallback_real import _same_vector, running_infinity
from yieldproxy.config import DEFAULT_PROBE_TEXTS, LONG_PROBE_TEXTS
from yieldproxy.servers import BUSY, CALLER, NOT_READY, OK, UP, server
from yieldproxy.tools.sim import SimOllama, expected_embedding

# Real processes for half a minute or more: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 60.0
TEXTS = ["the desktop games", "the server embeds", "Kölner Dom", "東京", "def f(x): return x"]
SHORT_PROBE_TEXTS = tuple(t for t in DEFAULT_PROBE_TEXTS if t not in LONG_PROBE_TEXTS)


@pytest.fixture(scope="module")
def llamas():
    """Two llama-servers of all-MiniLM-L6-v2, for the module."""
    require_llama()
    servers: list = []
    try:
        for _ in range(2):  # one by one: the first is stopped below if the second never gets ready
            servers.append(started())
        yield servers
    finally:
        for s in servers:
            s.stop()
            shutil.rmtree(s.workdir, ignore_errors=True)


@pytest.fixture
def llama_port():
    """A port for a llama-server the test starts itself (after the proxy); stopped at the end."""
    require_llama()
    own = LlamaServer(free_port())
    yield own
    own.stop()
    shutil.rmtree(own.workdir, ignore_errors=True)


@attrs.define(eq=False)
class Proxy:
    proxy: object
    url: str
    admin_url: str
    sims: list

    async def stop(self) -> None:
        if self.proxy.service.running:
            await self.proxy.service.stopService()
        for sim in self.sims:
            await sim.stop()

    def sample(self, name: str, **labels) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def attempts(self, member: str) -> float:
        return self.sample("yieldproxy_upstream_attempts_total", upstream=member, outcome="ok")

    async def admin(self, path: str, body: dict | None = None) -> dict:
        if body is None:
            answer = await treq.get(self.admin_url + path, persistent=False).addTimeout(TIMEOUT, reactor)
        else:
            answer = await treq.post(self.admin_url + path, json=body, persistent=False).addTimeout(TIMEOUT, reactor)
        assert answer.code == 200, await answer.text()
        return await answer.json()

    async def twin(self, name: str) -> dict:
        status = await self.admin("/status")
        return next(row for row in status["upstreams"] if row["name"] == name)["twins"].get(ALIAS, {})


def start_proxy(*members: dict, sims=(), **overrides) -> Proxy:
    from yieldproxy.service import build

    config = pool_config(*members).with_overrides(**EPHEMERAL, **overrides)
    proxy = build(reactor, config)
    proxy.service.startService()
    return Proxy(proxy, listening_url(proxy, "proxy"), listening_url(proxy, "admin"), list(sims))


def llama_member(name: str, llama: LlamaServer, **keys) -> dict:
    return {"name": name, "url": llama.root, "api": "llamacpp", **keys}


def openai_embed(url: str, texts: list[str], model: str = ALIAS) -> list[list[float]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    try:
        return [d.embedding for d in client.embeddings.create(model=model, input=texts).data]
    finally:
        client.close()


def ollama_embed(url: str, texts: list[str], model: str = ALIAS) -> list[list[float]]:
    import ollama

    return [list(v) for v in ollama.Client(host=url, timeout=TIMEOUT).embed(model=model, input=texts).embeddings]


def all_same(got, want) -> bool:
    return len(got) == len(want) and all(_same_vector(g, w) for g, w in zip(got, want))


def worst_cosine(got, want) -> float:
    """The lowest cosine between paired vectors (llama.cpp's float sums depend a little on what else is in
    the batch: 0.99999 and more for the same text asked alone or with others)."""
    assert len(got) == len(want)
    import numpy as np

    return min(
        float(np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w))) for g, w in zip(got, want)
    )


async def wait_twin_state(proxy: Proxy, name: str, states=("verified", "mismatch", "error")) -> dict:
    """``name``'s twin row for the model once its state is one of ``states``."""
    row: dict = {}
    began = time.monotonic()
    while time.monotonic() - began < TIMEOUT:
        row = await proxy.twin(name)
        if row.get("state") in states:
            return row
        await sleep(reactor, 0.1)
    pytest.fail(f"{name} never reached {states}: {row}")


# -- its answers, judged -------------------------------------------------------------------


def test_the_real_llama_servers_answers_are_judged_as_its_module_says(llamas, llama_port):
    llama = server("llamacpp")
    # The loading 503, on every route, until the model is loaded: not ready, and its health says so.
    own = llama_port.start()
    own.wait_until((503,))
    status, body = own.post("/v1/embeddings", {"input": "hi"})
    raw = json.dumps(body).encode()
    if status == 503:  # it may have finished loading between the two calls
        assert body == {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
        assert llama.judge(status, raw) == NOT_READY and llama.judge_health(status, raw) == NOT_READY
    own.wait_ready()

    a = llamas[0]
    # An input over the physical batch (512): the caller's 500.
    status, body = a.post("/v1/embeddings", {"model": ALIAS, "input": " ".join(LONG_PROBE_TEXTS)})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert body["error"]["message"].startswith("input (")
    assert "tokens) is too large to process. increase the physical batch size (current batch size: 512)" in (
        body["error"]["message"]
    )
    assert llama.judge(status, json.dumps(body).encode()) == CALLER
    # The same on the native route.
    status, body = a.post("/embedding", {"content": " ".join(LONG_PROBE_TEXTS)})
    assert status == 500 and llama.judge(status, json.dumps(body).encode()) == CALLER
    # An empty input list: 400.
    status, body = a.post("/v1/embeddings", {"model": ALIAS, "input": []})
    assert status == 400 and body["error"]["message"] == '"input" must not be empty'
    assert llama.judge(status, json.dumps(body).encode()) == CALLER
    # Every default probe text is accepted (the long ones are within the batch), "" too.
    assert len(a.embed(list(DEFAULT_PROBE_TEXTS))) == len(DEFAULT_PROBE_TEXTS)
    assert len(a.embed([""])) == 1
    # Its health and its model list.
    assert llama.judge_health(200, b'{"status":"ok"}') == UP and a.health() == 200
    import urllib.request

    with urllib.request.urlopen(a.root + "/v1/models", timeout=10) as answer:
        assert llama.parse_models(answer.read()) == (ALIAS,)
    assert llama.judge(200, b"{}") == OK and BUSY != CALLER


def test_an_input_over_the_context_is_a_400_with_a_larger_batch(llama_port):
    """With a batch larger than the context (512), an input over the context gets the context 400."""
    own = LlamaServer(llama_port.port, ("--batch-size", "1024", "--ubatch-size", "1024"))
    try:
        own.start().wait_ready()
        status, body = own.post("/v1/embeddings", {"model": ALIAS, "input": " ".join(LONG_PROBE_TEXTS)})
        assert status == 400, body
        assert body["error"]["type"] == "exceed_context_size_error", body
        assert server("llamacpp").judge(status, json.dumps(body).encode()) == CALLER
    finally:
        own.stop()
        shutil.rmtree(own.workdir, ignore_errors=True)


# -- a member, its twin, its yield -----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_llamacpp_member_serves_every_embedding_route_and_a_verified_twin_the_ollama_client(llamas):
    a, b = llamas
    direct = await in_thread(reactor, a.embed, TEXTS)
    native = await in_thread(reactor, a.post, "/embedding", {"content": TEXTS[0]})
    proxy = start_proxy(
        llama_member("a", a), llama_member("b", b),
        **{"verification.models": (ALIAS,), "upstream.detect_outages": False},
    )
    try:
        # b is verified with the default probe texts (their long ones included: a accepts them all).
        row = await wait_twin_state(proxy, "b")
        assert row["state"] == "verified" and row["reference"] == "a", row
        assert row["worst_cosine"] > 0.9999 and row["dimension"] == 384
        assert (await proxy.twin("a"))["state"] == "reference"

        # OpenAI's /v1/embeddings (the openai client, base64), to a: the server's own vectors.
        got = await in_thread(reactor, openai_embed, proxy.url, TEXTS)
        assert all_same(got, direct) and proxy.attempts("a") == 1 and proxy.attempts("b") == 0
        # Its native /embedding, relayed as it is: the same answer as asked directly.
        answer = await treq.post(
            proxy.url + "/embedding", json={"content": TEXTS[0]}, persistent=False
        ).addTimeout(TIMEOUT, reactor)
        body = await answer.json()
        assert answer.code == 200 and native[0] == 200, body
        assert body[0]["index"] == 0 and _same_vector(body[0]["embedding"][0], native[1][0]["embedding"][0])
        assert proxy.attempts("a") == 2
        # The Ollama client's /api/embed, translated to a's /v1/embeddings.
        got = await in_thread(reactor, ollama_embed, proxy.url, TEXTS)
        assert all_same(got, direct) and proxy.attempts("a") == 3

        # a yielded: the Ollama client is served by its verified twin at once, with a's vectors.
        await proxy.admin("/yield", {"upstream": "a", "source": "game"})
        got = await in_thread(reactor, ollama_embed, proxy.url, TEXTS)
        assert all_same(got, direct)
        assert proxy.attempts("b") == 1 and proxy.attempts("a") == 3 and len(proxy.proxy.lot) == 0
        assert proxy.sample("yieldproxy_park_seconds_count", **{"class": "batch"}) == 0
        await proxy.admin("/resume", {"upstream": "a", "source": "game"})
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_a_yield_of_the_llamacpp_member_parks_what_only_it_serves_and_the_rest_goes_on(llamas):
    a = llamas[0]
    direct = await in_thread(reactor, a.embed, TEXTS)
    sim = SimOllama(reactor, latency=0.002, models=("nomic-embed-text",))
    port = await sim.listen()
    proxy = start_proxy(
        llama_member("llama", a), {"name": "gpu", "url": f"http://127.0.0.1:{port}", "api": "ollama"},
        sims=[sim], **{"upstream.detect_outages": False},
    )
    try:
        await wait_for(reactor, lambda: all(m.catalogue.discovered for m in proxy.proxy.scheduler.members), timeout=TIMEOUT)
        await proxy.admin("/yield", {"upstream": "llama", "source": "game"})
        parked = in_thread(reactor, openai_embed, proxy.url, TEXTS)
        await wait_for(reactor, lambda: len(proxy.proxy.lot) == 1, timeout=TIMEOUT)
        meanwhile = [f"served meanwhile {i}" for i in range(4)]
        got = await in_thread(reactor, ollama_embed, proxy.url, meanwhile, "nomic-embed-text")
        assert got == [expected_embedding(t, "nomic-embed-text") for t in meanwhile]
        assert not parked.called and len(proxy.proxy.lot) == 1 and proxy.attempts("llama") == 0
        await proxy.admin("/resume", {"upstream": "llama", "source": "game"})
        assert all_same(await parked, direct)
        assert proxy.attempts("llama") == 1 and len(proxy.proxy.lot) == 0
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_an_input_over_its_batch_is_the_callers_500_relayed_at_once_with_nobody_parked(llamas):
    a = llamas[0]
    # One upstream, outages detected: a 500 the proxy could not place would make it probe.
    proxy = start_proxy(llama_member("llama", a))
    try:
        most_parked = 0

        def watch() -> None:
            nonlocal most_parked
            most_parked = max(most_parked, len(proxy.proxy.lot))

        from twisted.internet.task import LoopingCall

        watcher = LoopingCall(watch)
        watcher.start(0.001)
        too_long = " ".join(LONG_PROBE_TEXTS)
        probes = lambda: sum(  # noqa: E731
            proxy.sample("yieldproxy_outage_probes_total", upstream="llama", probe=p, result=r)
            for p in ("health", "model") for r in ("up", "down", "not_ready")
        )
        # It has answered (the outage watcher's first look at it is over).
        assert all_same(await in_thread(reactor, openai_embed, proxy.url, TEXTS[:2]), a.embed(TEXTS[:2]))
        await sleep(reactor, 1.0)
        probed = probes()
        began = time.monotonic()
        answer = await treq.post(
            proxy.url + "/v1/embeddings", json={"model": ALIAS, "input": too_long}, persistent=False
        ).addTimeout(TIMEOUT, reactor)
        body = await answer.json()
        took = time.monotonic() - began
        watcher.stop()
        assert answer.code == 500, body
        assert "is too large to process. increase the physical batch size" in body["error"]["message"]
        assert took < 10 and most_parked == 0
        # Judged the caller's on its words: no probe was needed to place it.
        assert probes() == probed, [(p, r, proxy.sample("yieldproxy_outage_probes_total", upstream="llama", probe=p, result=r)) for p in ("health", "model") for r in ("up", "down")]
        assert proxy.sample("yieldproxy_yields_total", source="outage") == 0
        assert proxy.sample("yieldproxy_retries_total", **{"class": "batch"}) == 0
        # The next caller is served as ever.
        assert all_same(await in_thread(reactor, openai_embed, proxy.url, TEXTS[2:]), a.embed(TEXTS[2:]))
    finally:
        await proxy.stop()


# -- start and restart ------------------------------------------------------------------------


class OpenAIBurst(Burst):
    """Embeds ``texts`` one per call through ``url`` with ``concurrency`` openai clients (no retries),
    keeping each vector (the server's own, compared after)."""

    def __init__(self, url: str, texts: list[str], concurrency: int):
        super().__init__(url, texts, concurrency)
        self.vectors: dict[str, list[float]] = {}

    def _client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)

    def _call(self, client, text: str) -> bool:
        self.vectors[text] = client.embeddings.create(model=ALIAS, input=[text]).data[0].embedding
        return True


def burst_texts(n: int, tag: str) -> list[str]:
    return [f"{tag} chunk {i}: the ingest goes on while the server restarts" for i in range(n)]


@pytest_twisted.ensureDeferred
async def test_a_llama_server_started_after_the_proxy_is_not_ready_for_a_moment_and_a_burst_loses_nothing(llama_port):
    # A request reaches it while it loads unless its load ends first once it runs again (a race inside
    # llama-server, lost now and then on a loaded machine): the scenario runs again, at most three times,
    # each with a proxy and a server of its own, until one saw the loading 503s.  Every run loses nothing.
    for run in range(3):
        if run:
            llama_port.stop()
        seen_loading = await _a_burst_through_a_late_start(llama_port)
        if seen_loading:
            break
    assert seen_loading, "in three runs, no request reached llama-server while it was loading"


async def _a_burst_through_a_late_start(llama_port) -> float:
    """A burst through a proxy started before its llama-server; how many loading 503s its attempts had."""
    proxy = start_proxy(llama_member("llama", llama_port))
    try:
        llama_port.start()
        # Caught loading (503 "Loading model") and kept there a moment, while a burst arrives.
        await in_thread(reactor, llama_port.wait_until, (503,))
        llama_port.process.send_signal(signal.SIGSTOP)
        burst = OpenAIBurst(proxy.url, burst_texts(40, "started late"), concurrency=8)
        running = in_thread(reactor, burst.run, timeout=TIMEOUT * 2)
        # Every client's first request is with the server (stopped, still loading) before it goes on.
        scheduler = proxy.proxy.scheduler
        await wait_for(reactor, lambda: scheduler.inflight + len(proxy.proxy.lot) >= 8, timeout=TIMEOUT)
        await sleep(reactor, 0.1)
        llama_port.process.send_signal(signal.SIGCONT)
        await running
        assert burst.failures == []
        direct = await in_thread(reactor, llama_port.embed, burst.texts)
        assert worst_cosine([burst.vectors[t] for t in burst.texts], direct) > 0.9999
        # Its loading 503s were "not ready": failed attempts, never an outage.
        assert proxy.sample("yieldproxy_yields_total", source="outage") == 0
        assert proxy.sample("yieldproxy_yields_total", source="loading") == 0
        assert len(proxy.proxy.lot) == 0
        return proxy.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "status_503"})
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_a_kill_9_and_a_start_again_mid_burst_lose_nothing(llama_port):
    llama_port.start().wait_ready()
    proxy = start_proxy(llama_member("llama", llama_port))
    try:
        burst = OpenAIBurst(proxy.url, burst_texts(240, "restarted"), concurrency=8)
        running = in_thread(reactor, burst.run, timeout=TIMEOUT * 3)
        await wait_for(reactor, lambda: burst.done >= 60, timeout=TIMEOUT)
        llama_port.kill9()
        await sleep(reactor, 0.3)
        llama_port.start()  # not waited for: its loading 503s meet the burst
        await running
        assert burst.failures == []
        assert llama_port.starts == 2
        direct = await in_thread(reactor, llama_port.embed, burst.texts)
        assert worst_cosine([burst.vectors[t] for t in burst.texts], direct) > 0.9999
        assert len(proxy.proxy.lot) == 0
        # Never held for its loading: the "loading" hold is for a server stuck loading.
        assert proxy.sample("yieldproxy_yields_total", source="loading") == 0
    finally:
        await proxy.stop()


# -- llama-server and Infinity: twins for short texts only ----------------------------------


@pytest.fixture(scope="module")
def infinity():
    """A real Infinity of all-MiniLM-L6-v2 under ``--url-prefix /v1`` (tests/test_fallback_real.py), for the module."""
    require_llama()
    with running_infinity("llama") as server:
        yield server


def infinity_member(infinity, **keys) -> dict:
    """Infinity at its root: its ``/v1`` prefix is the proxy's to find."""
    return {"name": "infinity", "url": infinity.root, "api": "infinity", **keys}


@pytest.mark.parametrize("infinity_first", [False, True], ids=["llama-reference", "infinity-reference"])
@pytest_twisted.ensureDeferred
async def test_llama_server_and_infinity_are_no_twins_with_the_default_probe_texts(llamas, infinity, infinity_first):
    llama = llama_member("llama", llamas[0])
    members = (infinity_member(infinity), llama) if infinity_first else (llama, infinity_member(infinity))
    twin = "llama" if infinity_first else "infinity"
    proxy = start_proxy(*members, **{"verification.models": (ALIAS,), "upstream.detect_outages": False})
    try:
        row = await wait_twin_state(proxy, twin)
        assert row["state"] == "mismatch", row
        assert row["reference"] == ("infinity" if infinity_first else "llama")
        # Only the two long texts differ (Infinity read 256 word pieces of them, llama-server all).
        assert row["reason"].startswith("the long probe texts differ"), row["reason"]
        assert "probably truncation" in row["reason"] and "2 of 12 probe texts differ" in row["reason"]
        assert 0.8 < row["worst_cosine"] < 0.99
        # Infinity's model list and embeddings were both asked under its /v1 prefix.
        assert proxy.proxy.scheduler.member("infinity").server.embed_path == "/v1/embeddings"
        # While the reference is yielded, its embeddings wait for it: the twin serves none.
        reference = "infinity" if infinity_first else "llama"
        await proxy.admin("/yield", {"upstream": reference, "source": "game"})
        parked = in_thread(reactor, ollama_embed, proxy.url, TEXTS[:1])
        await wait_for(reactor, lambda: len(proxy.proxy.lot) == 1, timeout=TIMEOUT)
        assert proxy.attempts(twin) == 0 and not parked.called
        await proxy.admin("/resume", {"upstream": reference, "source": "game"})
        assert len(await parked) == 1 and proxy.attempts(reference) == 1
    finally:
        await proxy.stop()


@pytest.mark.parametrize("infinity_first", [False, True], ids=["llama-reference", "infinity-reference"])
@pytest_twisted.ensureDeferred
async def test_with_short_probe_texts_only_they_are_twins_and_infinity_is_called_under_its_prefix(
    llamas, infinity, infinity_first
):
    a = llamas[0]
    # Infinity's models given in config (its list never read): its prefix is found all the same.
    inf = infinity_member(infinity, models=[ALIAS]) if infinity_first else infinity_member(infinity)
    members = (inf, llama_member("llama", a)) if infinity_first else (llama_member("llama", a), inf)
    reference, twin = ("infinity", "llama") if infinity_first else ("llama", "infinity")
    proxy = start_proxy(
        *members,
        **{
            "verification.models": (ALIAS,), "verification.probe_texts": SHORT_PROBE_TEXTS,
            "upstream.detect_outages": False,
        },
    )
    try:
        row = await wait_twin_state(proxy, twin)
        assert row["state"] == "verified" and row["reference"] == reference, row.get("reason")
        assert row["worst_cosine"] > 0.9999
        assert proxy.proxy.scheduler.member("infinity").server.embed_path == "/v1/embeddings"
        # The reference yielded: the Ollama client is served by the twin at once (translated, under
        # Infinity's prefix when the twin is Infinity), with vectors equal to llama-server's for short texts.
        await proxy.admin("/yield", {"upstream": reference, "source": "game"})
        got = await in_thread(reactor, ollama_embed, proxy.url, TEXTS)
        assert proxy.attempts(twin) == 1 and proxy.attempts(reference) == 0 and len(proxy.proxy.lot) == 0
        assert worst_cosine(got, await in_thread(reactor, a.embed, TEXTS)) > 0.9999
        await proxy.admin("/resume", {"upstream": reference, "source": "game"})
    finally:
        await proxy.stop()

