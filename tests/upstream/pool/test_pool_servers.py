"""A pool of a TEI, a llama.cpp and an Ollama member (the sim plays each) (issue 12).

Each member's native model routes (TEI's ``/embed`` and ``/rerank``,
llama.cpp's ``/completion`` and ``/embedding``) are served by that member
alone; while a member is yielded they park and are replayed on it after its
resume, while the other members serve theirs and its metadata routes pass.
A llama.cpp member still loading its model (503 "Loading model") is read as
not ready, not as an outage.  Also: the model list of a server mounted under
an API prefix (Infinity's ``--url-prefix /v1``) is found there.

The native routes and their parking run once through real sockets; the
loads, restarts and GPU failures, which are about time and judgement, run
with the proxy in memory on a Clock (``tests/inmemory.py``).
"""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred, succeed

from helpers import admin, config_with, start_pool_stack, wait_for
from inmemory import Rig, answered
from yieldproxy.servers import server
from yieldproxy.tools.sim import expected_embedding, expected_relevance, expected_reply
from yieldproxy.upstream.control import Answer
from yieldproxy.upstream.pool.models import ModelCatalogue, ModelDiscovery

TEI_MODEL = "BAAI/bge-small-en-v1.5"
LLAMA_MODEL = "qwen2.5-0.5b"
OLLAMA_MODEL = "all-minilm"
TIMEOUT = 30.0

MEMBERS = [
    {"name": "tei", "api": "tei", "sim": {"api": "tei", "models": (TEI_MODEL,)}},
    {"name": "llama", "api": "llamacpp", "sim": {"api": "llamacpp", "models": (LLAMA_MODEL,)}},
    {"name": "ollama", "api": "ollama"},
]


def post(stack, path: str, body: dict) -> Deferred:
    """``(status, JSON body)`` of a POST through the proxy; sent at once."""
    return ensureDeferred(_post(stack, path, body))


async def _post(stack, path: str, body: dict):
    answer = await treq.post(stack.proxy_url + path, json=body, persistent=False).addTimeout(TIMEOUT, reactor)
    return answer.code, json.loads(await answer.content())


async def get(stack, path: str):
    answer = await treq.get(stack.proxy_url + path, persistent=False).addTimeout(TIMEOUT, reactor)
    return answer.code, await answer.content()


def model_requests(sim) -> list[str]:
    """The paths of the model routes a sim was asked, sorted (its history, without the metadata routes)."""
    return sorted(h.path for h in sim.history if h.path in MODEL_PATHS)


MODEL_PATHS = {"/embed", "/rerank", "/completion", "/embedding", "/api/embed", "/api/chat"}

TEI_TEXTS = ["the desktop games", "the server embeds"]
RERANK = {"query": "which box serves", "texts": ["the server", "the desktop", "nobody"]}


def tei_calls(stack, post=post):
    return post(stack, "/embed", {"inputs": TEI_TEXTS}), post(stack, "/rerank", RERANK)


def check_tei(embed, rerank) -> None:
    assert embed == (200, [expected_embedding(t, TEI_MODEL) for t in TEI_TEXTS])
    code, ranks = rerank
    assert code == 200
    want = {i: expected_relevance(RERANK["query"], t, TEI_MODEL) for i, t in enumerate(RERANK["texts"])}
    assert {r["index"]: r["score"] for r in ranks} == want


def llama_calls(stack, post=post):
    return (
        post(stack, "/completion", {"prompt": "tell me about pools", "n_predict": 8}),
        post(stack, "/embedding", {"content": "a llama vector"}),
    )


def check_llama(completion, embedding) -> None:
    code, body = completion
    assert code == 200 and body["content"] == "".join(expected_reply("tell me about pools", LLAMA_MODEL))
    assert embedding == (200, [{"index": 0, "embedding": [expected_embedding("a llama vector", LLAMA_MODEL)]}])


async def check_ollama(stack, text: str) -> None:
    code, body = await post(stack, "/api/embed", {"model": OLLAMA_MODEL, "input": [text]})
    assert code == 200 and body["embeddings"] == [expected_embedding(text, OLLAMA_MODEL)]


@pytest_twisted.ensureDeferred
async def test_tei_and_llamacpp_members_serve_their_native_routes_and_park_while_yielded():
    stack = await start_pool_stack(reactor, MEMBERS, latency=0.002)
    tei, llama, ollama = (stack.sims[n] for n in ("tei", "llama", "ollama"))
    try:
        # Each native model route goes to its own server.
        check_tei(*[await call for call in tei_calls(stack)])
        check_llama(*[await call for call in llama_calls(stack)])
        await check_ollama(stack, "before")
        assert model_requests(tei) == ["/embed", "/rerank"]
        assert model_requests(llama) == ["/completion", "/embedding"]
        assert model_requests(ollama) == ["/api/embed"]

        # TEI yielded: its model routes park; llama.cpp and Ollama serve; TEI's metadata passes.
        await admin(stack, "/yield", {"upstream": "tei", "source": "restart"})
        parked = [call for call in tei_calls(stack)]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 2, timeout=TIMEOUT)
        check_llama(*[await call for call in llama_calls(stack)])
        await check_ollama(stack, "during the tei yield")
        code, info = await get(stack, "/info")
        assert code == 200 and json.loads(info)["model_id"] == TEI_MODEL, info
        code, tokens = await post(stack, "/tokenize", {"inputs": "a b"})
        assert code == 200 and len(tokens) == 1
        # The other members answered meanwhile, after these parked: none was let out to it.
        assert not any(d.called for d in parked) and model_requests(tei) == ["/embed", "/rerank"]
        assert stack.proxy.scheduler.waiting_for("tei") == 2 and stack.proxy.scheduler.waiting_for("llama") == 0
        await admin(stack, "/resume", {"source": "restart", "upstream": "tei"})
        check_tei(*[await d for d in parked])
        assert model_requests(tei) == ["/embed"] * 2 + ["/rerank"] * 2

        # llama.cpp yielded: its model routes park; TEI and Ollama serve; its metadata passes.
        await admin(stack, "/yield", {"upstream": "llama", "source": "game"})
        parked = [call for call in llama_calls(stack)]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 2, timeout=TIMEOUT)
        check_tei(*[await call for call in tei_calls(stack)])
        await check_ollama(stack, "during the llama yield")
        code, _ = await get(stack, "/props")
        assert code == 200
        code, models = await get(stack, "/v1/models")
        assert code == 200 and LLAMA_MODEL in [m["id"] for m in json.loads(models)["data"]]
        # The other members answered meanwhile, after these parked: none was let out to it.
        assert not any(d.called for d in parked) and model_requests(llama) == ["/completion"] * 2 + ["/embedding"] * 2
        await admin(stack, "/resume", {"source": "game", "upstream": "llama"})
        check_llama(*[await d for d in parked])
        assert model_requests(llama) == ["/completion"] * 3 + ["/embedding"] * 3
        assert model_requests(ollama) == ["/api/embed"] * 3
        # Four parked requests, each replayed once and answered, in the class their server gives them:
        # TEI's /embed and /rerank and llama.cpp's /embedding are batch, its /completion interactive.
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 3
        assert stack.sample("yieldproxy_replay_total", **{"class": "interactive", "outcome": "ok"}) == 1
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="tei", outcome="ok") == 6
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="llama", outcome="ok") == 6
        assert len(stack.proxy.lot) == 0 and stack.proxy.scheduler.inflight == 0
    finally:
        await stack.stop()


# -- the same pool in memory, on a Clock (tests/inmemory.py): what a load, a restart and a GPU failure do ------


def pool_rig(members, config, watchers: bool = False) -> Rig:
    """The proxy pooling ``members`` in memory, started, its model lists read and its twins verified."""
    rig = Rig(config, members=members, watchers=watchers, latency=0.002)
    rig.start()
    rig.settle()
    return rig


def rig_post(rig: Rig, path: str, body: dict) -> Deferred:
    """``(status, JSON body)`` of a POST through the proxy in memory; sent at once."""
    return rig.post(path, body).addCallback(lambda answer: (answer.code, answer.json()))


def rig_result(rig: Rig, d: Deferred, seconds: float = TIMEOUT):
    """``d``'s result once the clock has moved as far as it takes (at most ``seconds``)."""
    rig.until(lambda: answered(d), seconds)
    return rig.result(d)


def check_ollama_in(rig: Rig, text: str) -> None:
    code, body = rig_result(rig, rig_post(rig, "/api/embed", {"model": OLLAMA_MODEL, "input": [text]}))
    assert code == 200 and body["embeddings"] == [expected_embedding(text, OLLAMA_MODEL)]


def stopped(rig: Rig) -> None:
    rig.stop()
    assert rig.clock.getDelayedCalls() == []


def test_a_llamacpp_member_loading_its_model_is_not_ready_not_an_outage():
    """llama.cpp answers 503 "Loading model" for a while after it starts: no outage hold, the others serve,
    and a completion sent meanwhile is answered once it has loaded."""
    config = config_with(upstream={"health_interval_seconds": 0.2})
    members = [
        {**MEMBERS[1], "sim": {**MEMBERS[1]["sim"], "load_seconds": 2.5}},
        MEMBERS[2],
    ]
    rig = pool_rig(members, config, watchers=True)
    llama = rig.sims["llama"]
    assert llama.loading
    member = rig.proxy.scheduler.member("llama")
    # What the pool reads on the member's health route while it loads.
    health = rig_result(rig, member.control.request("GET", member.spec.health_path, timeout=TIMEOUT))
    assert health.code == 503 and json.loads(health.body)["error"]["message"] == "Loading model"
    assert member.server.judge_health(health.code, health.body) == "not_ready"
    completion = rig_post(rig, "/completion", {"prompt": "tell me about pools"})
    states = []
    while llama.loading:
        states.append(member.state_name())
        check_ollama_in(rig, f"while llama loads {len(states)}")
        rig.run(0.05)
    assert states, "the load was over before the test looked"
    code, answer = rig_result(rig, completion)
    assert code == 200 and answer["content"] == "".join(expected_reply("tell me about pools", LLAMA_MODEL))
    states.append(member.state_name())
    # Never read as an outage: no outage hold was taken on it (nor on anything else).
    assert "outage" not in states and rig.proxy.state.holds_for("llama") == []
    # Not ready while it loaded (its health read so at start, or the completion's attempt did).
    assert "not_ready" in states
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="llama", outcome="ok") == 1
    assert llama.requests_total["/completion"] >= 1
    stopped(rig)


def test_a_llamacpp_member_loading_longer_than_its_retries_last_answers_after_the_load_with_no_outage():
    """The stronger cousin: each load lasts many times what the request's 5 tries would have lasted
    (its retry backoff is short here), once at start and once after a restart when the member had answered
    before; the client gets its answer after each load, never a 5xx, and the member is never held."""
    config = config_with(
        upstream={
            "health_interval_seconds": 0.1, "health_max_interval_seconds": 0.2,
            # 5 tries, 0.05 s then 0.1 s apart: the old limit was about 0.3 s of loading, here each load is 2 s.
            "retry_backoff_seconds": 0.05, "retry_backoff_max_seconds": 0.1,
        }
    )
    members = [{**MEMBERS[1], "sim": {**MEMBERS[1]["sim"], "load_seconds": 2.0}}, MEMBERS[2]]
    rig = pool_rig(members, config, watchers=True)
    llama = rig.sims["llama"]
    member = rig.proxy.scheduler.member("llama")
    states: list[str] = []

    def look(seconds: float) -> None:
        """Move the clock ``seconds`` on, noting the member's state every 0.02 s of it."""
        end = rig.clock.seconds() + seconds
        while rig.clock.seconds() < end:
            states.append(member.state_name())
            rig.run(min(0.02, end - rig.clock.seconds()))

    for load in ("at start", "after a restart"):
        assert llama.loading, load
        began = rig.clock.seconds()
        prompts = [f"{load} {i}" for i in range(3)]
        asked = [rig_post(rig, "/completion", {"prompt": p}) for p in prompts]
        look(0.5)  # past the old limit, still loading
        assert llama.loading and not any(answered(d) for d in asked), load
        version = rig.call("GET", rig.proxy_url + "/api/version")  # the others serve meanwhile
        assert json.loads(version.body or b"{}").get("version"), load
        for _ in range(int(TIMEOUT / 0.02)):
            if all(answered(d) for d in asked):
                break
            look(0.02)
        for prompt, d in zip(prompts, asked):
            code, answer = rig.result(d)
            assert code == 200, (load, answer)
            assert answer["content"] == "".join(expected_reply(prompt, LLAMA_MODEL))
        assert rig.clock.seconds() - began >= 1.5, load  # answered after the load, not before
        assert "not_ready" in states and "outage" not in states, (load, sorted(set(states)))
        assert rig.proxy.state.holds == [], load
        assert member.health.reachable
        # A restart: the server loads its model again, after it had answered.
        llama.set_mode("refuse")
        llama.set_mode("ok")
        states.clear()
    assert rig.sample("yieldproxy_requests_total", **{"class": "interactive", "code": "200"}) == 6
    for code in ("502", "503", "504"):
        assert rig.sample("yieldproxy_requests_total", **{"class": "interactive", "code": code}) == 0
    stopped(rig)


class ListAt:
    """A control client whose server lists ``names`` at ``path`` only (404 elsewhere); records what it was asked."""

    def __init__(self, path: str, names: list[str]):
        self.path = path
        self.names = names
        self.asked: list[str] = []

    def request(self, method, path, body=None, timeout=None):
        self.asked.append(path)
        if path != self.path:
            return succeed(Answer(404, b'{"detail":"Not Found"}'))
        return succeed(Answer(200, json.dumps({"object": "list", "data": [{"id": n} for n in self.names]}).encode()))


def test_a_model_list_under_an_api_prefix_is_found_there():
    """Infinity started with ``--url-prefix /v1`` lists its models at ``/v1/models``, not ``/models``."""
    from twisted.internet.task import Clock

    from yieldproxy.service import _prefixed_models_paths

    inf = server("infinity")
    assert _prefixed_models_paths(inf) == ("/v1/models",)
    assert _prefixed_models_paths(server("ollama")) == () == _prefixed_models_paths(server("llamacpp"))
    for where in ("/models", "/v1/models"):
        catalogue, control = ModelCatalogue(), ListAt(where, ["all-minilm"])
        discovery = ModelDiscovery(
            Clock(), catalogue, control, "infinity", inf.models_path, inf.parse_models,
            other_paths=_prefixed_models_paths(inf),
        )
        discovery.refresh()
        assert catalogue.discovered == ("all-minilm",) and catalogue.serves("all-minilm") is True
        assert control.asked == (["/models"] if where == "/models" else ["/models", "/v1/models"])
    # Not there at all: the list stays unknown.
    catalogue, control = ModelCatalogue(), ListAt("/elsewhere", [])
    ModelDiscovery(
        Clock(), catalogue, control, "infinity", inf.models_path, inf.parse_models,
        other_paths=_prefixed_models_paths(inf),
    ).refresh()
    assert catalogue.discovered is None and control.asked == ["/models", "/v1/models"]


def test_each_members_gpu_failures_are_retried_by_its_own_servers_words():
    """llama.cpp's whole "Compute error." and TEI's own GPU failure answers are GPU failures of that
    member, read by its own server's judge: retried up to upstream.max_attempts (Ollama's judge, which
    every attempt used to read, relayed them at once as the caller's)."""
    config = config_with(upstream={"retry_backoff_seconds": 0.01, "retry_backoff_max_seconds": 0.02})
    rig = pool_rig(MEMBERS, config)
    tries = config.upstream.max_attempts
    for name, calls in (("llama", llama_calls), ("tei", tei_calls)):
        rig.sims[name].set_mode("error500")
        answers = [rig_result(rig, d) for d in calls(rig, rig_post)]
        # After its last try the member's own answer is relayed: llama.cpp's 500, TEI's 424 Backend.
        assert all(code in (424, 500) and "error" in body for code, body in answers), answers
        assert rig.sample("yieldproxy_upstream_attempts_total", upstream=name, outcome="gpu_error") == tries * 2
        assert rig.sample("yieldproxy_upstream_attempts_total", upstream=name, outcome="ok") == 0
        rig.sims[name].set_mode("ok")
    stopped(rig)
