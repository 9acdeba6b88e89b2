"""The CPU fallback: configuration, verification, and its use during a yield.

The core runs on a Clock with fake backends (no sockets).  The real-socket
tests put two simulated backends behind the proxy: one is the primary, the
other an OpenAI-shaped fallback; a sim's vectors depend only on the model
name and the text, so mapping to the same name is a faithful twin and
mapping to another name is a wrong model.  The same flows against a real
CPU embedding server are in ``test_fallback_real.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import attrs
import ollama
import openai
import pytest
import pytest_twisted
import treq
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import Clock
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from helpers import (
    EPHEMERAL,
    TEST_MODELS,
    clock_cooperator,
    config_with,
    in_thread,
    listening_url,
    start_stack,
    wait_for,
)
from inmemory import EmbedResource, MemoryUpstream
from yieldproxy.config import DEFAULT_PROBE_TEXTS, ConfigError, FallbackConfig, from_dict
from yieldproxy.lot.parking import ParkingLot
from yieldproxy.lot.replay import Replayer
from yieldproxy.lot.state import YieldState
from yieldproxy.observe.metrics import Metrics
from yieldproxy.proxy.handler import ProxyApp
from yieldproxy.schedule.scheduler import Scheduler
from yieldproxy.service import build_heart
from yieldproxy.tools.sim import SimOllama, decode_base64_f32, expected_embedding
from yieldproxy.upstream.attempt import Upstream
from yieldproxy.upstream.fallback import (
    RETRY_AFTER_ERROR_SECONDS,
    EmbedBackend,
    Fallback,
    NotNow,
    compare,
    format_table,
)
from yieldproxy.upstream.translation import BackendError, EmbedRequest, Embeddings

MODEL = "all-minilm"
TIMEOUT = 30


# -- configuration ----------------------------------------------------------------------


def test_defaults():
    fc = FallbackConfig()
    assert not fc.enabled and fc.api == "ollama" and fc.primary_api == "ollama"
    assert fc.classes == ("batch",) and fc.concurrency == 2
    assert (fc.verify_interval_seconds, fc.max_verification_age_seconds, fc.min_cosine) == (600, 1800, 0.99)
    assert fc.probe_texts == DEFAULT_PROBE_TEXTS and len(fc.probe_texts) >= 8
    # Varied: something long, non-ASCII scripts, code, digits, emoji.
    assert any(len(t) > 300 for t in fc.probe_texts)
    assert any("東京" in t for t in fc.probe_texts) and any("ö" in t for t in fc.probe_texts)
    assert any("def " in t for t in fc.probe_texts) and any("🎉" in t for t in fc.probe_texts)


ENABLED = {"enabled": True, "url": "http://127.0.0.1:7997/v1", "api": "openai", "models": {MODEL: MODEL}}


def test_policy_fallback_needs_an_enabled_fallback():
    with pytest.raises(ConfigError, match=r"classes\.batch\.policy: 'fallback' needs .*fallback\.enabled is false"):
        from_dict({"classes": {"batch": {"policy": "fallback"}}})
    config = from_dict({"classes": {"batch": {"policy": "fallback"}}, "fallback": ENABLED})
    assert config.classes["batch"].policy == "fallback"
    assert config.fallback.models == {MODEL: MODEL}
    # A class may use it only when fallback.classes lists it.
    with pytest.raises(ConfigError, match=r"classes\.long\.policy: 'fallback', but fallback\.classes"):
        from_dict({"classes": {"long": {"policy": "fallback"}}, "fallback": ENABLED})
    config = from_dict({"classes": {"long": {"policy": "fallback"}}, "fallback": {**ENABLED, "classes": ["batch", "long"]}})
    assert config.fallback.classes == ("batch", "long")


@pytest.mark.parametrize(
    "table, error",
    [
        ({"enabled": True, "models": {MODEL: MODEL}}, r"fallback\.url: required"),
        ({"enabled": True, "url": "http://x:1"}, r"fallback\.models: required"),
        ({"url": "ftp://x"}, r"fallback\.url: must be an http"),
        ({"api": "grpc"}, r"fallback\.api: must be one of ollama, openai"),
        ({"models": {MODEL: 3}}, r"fallback\.models: must be a table of strings"),
        ({"models": {MODEL: " "}}, r"fallback\.models: must map model names"),
        ({"classes": ["bulk"]}, r"fallback\.classes: unknown class 'bulk'"),
        ({"concurrency": 0}, r"fallback\.concurrency: must be >= 1"),
        ({"min_cosine": 0}, r"fallback\.min_cosine: must be above 0"),
        ({"probe_texts": []}, r"fallback\.probe_texts: must be a non-empty list"),
        ({"probe_texts": ["ok", "  "]}, r"fallback\.probe_texts: must be a non-empty list of non-blank"),
        ({**ENABLED, "verify_interval_seconds": 900, "max_verification_age_seconds": 600},
         r"fallback\.max_verification_age_seconds: must be >= fallback\.verify_interval_seconds"),
        ({"colour": "blue"}, r"fallback\.colour: unknown key"),
    ],
)
def test_config_errors_name_the_key(table, error):
    with pytest.raises(ConfigError, match=error):
        from_dict({"fallback": table})


# -- comparing vectors -------------------------------------------------------------------------


def test_compare_passes_on_the_same_directions():
    texts = ["a", "b"]
    primary = [[1.0, 0.0], [0.6, 0.8]]
    # A server that does not normalise: same directions, other lengths.
    fallback = [[5.0, 0.0], [3.0, 4.0]]
    v = compare(MODEL, "other", texts, primary, fallback, 0.99, at=10.0)
    assert v.ok and v.reason == "" and v.at == 10.0
    assert v.worst_cosine == pytest.approx(1.0)
    assert [r.cosine for r in v.rows] == [pytest.approx(1.0)] * 2


def test_compare_fails_on_one_text_or_a_dimension():
    v = compare(MODEL, MODEL, ["a", "b"], [[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.9, 0.5]], 0.99, at=0)
    assert not v.ok and v.worst_cosine == pytest.approx(0.874, abs=1e-3)
    assert "1 of 2 probe texts differ" in v.reason and "text 2 'b'" in v.reason and "< 0.99" in v.reason
    v = compare(MODEL, MODEL, ["a"], [[1.0, 0.0, 0.0]], [[1.0, 0.0]], 0.99, at=0)
    assert not v.ok and v.worst_cosine is None
    assert "dimension 2 on the fallback, 3 on the primary" in v.reason
    table = format_table({MODEL: v}, 0.99)
    assert "FAILED" in table and "<- differs" in table and "dim primary" in table


# -- the core on a Clock ----------------------------------------------------------------------------


class FakeBackend:
    """Answers like a sim would for ``model`` (or another name), fails, or holds answers back."""

    def __init__(self, api="openai", url="http://fake"):
        self.api = api
        self.url = url
        self.calls: list[tuple] = []
        self.fail: str | None = None
        self.hold = False
        self.held: list[Deferred] = []
        self.rename: dict[str, str] = {}

    async def embed(self, request, model):
        self.calls.append((request, model))
        if self.hold:
            d = Deferred()
            self.held.append(d)
            await d
        if self.fail:
            raise BackendError("refused", self.fail)
        name = self.rename.get(model, model)
        return Embeddings(tuple(tuple(expected_embedding(t, name)) for t in request.inputs), 3)

    def close(self):
        return succeed(None)


class Answer:
    """What a caller got: status, headers and body (nothing while its request is parked)."""

    def __init__(self):
        self.responseHeaders = Headers()
        self.code = None
        self.written: list[bytes] = []


@attrs.define
class Core:
    """The proxy on a Clock with fake backends behind its two members (the primary and the
    fallback, in memory), wired as ``build`` does."""

    clock: Clock
    fallback: Fallback
    primary: FakeBackend
    backend: FakeBackend
    metrics: Metrics
    state: YieldState
    lot: ParkingLot
    scheduler: Scheduler
    replayer: Replayer
    http: StubTreq
    wires: tuple

    def sample(self, name, **labels):
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def turn(self):
        for _ in range(4):
            self.http.flush()
            for wire in self.wires:
                wire.flush()
            self.clock.advance(0)

    def serve(self, path=b"/api/embed", cls="batch", **body):
        """Send one request; its Deferred fires True once the fallback answered it, False when it
        parked (or the primary answered it)."""
        body = {"model": MODEL, "input": ["x"], **body}
        answer = Answer()
        parked = len(self.lot)
        sent = self.http.post(
            "http://proxy.invalid" + path.decode(), data=json.dumps(body).encode(),
            headers={b"x-yield-class": [cls.encode()]},
        )

        def got(response):
            answer.code = response.code
            answer.responseHeaders = response.headers
            return self.http.content(response).addCallback(read, response)

        def read(content, response):
            answer.written.append(content)
            return response.headers.getRawHeaders(b"x-yield-served-by") == [b"fallback"]

        sent.addCallback(got)
        self.turn()
        if len(self.lot) > parked and answer.code is None:
            sent.addErrback(lambda failure: None)
            return answer, succeed(False)
        return answer, sent

    def yield_(self):
        self.state.hold("api", "test")

    def resume(self):
        self.state.release("api")


def make_core(policy="fallback", **fallback) -> Core:
    clock = Clock()
    fc = attrs.evolve(FallbackConfig(), **{**ENABLED, "probe_texts": ("one", "two", "three"), **fallback})
    config = attrs.evolve(config_with(classes={"batch": {"policy": policy}}), fallback=fc)
    primary, backend = FakeBackend("ollama"), FakeBackend("openai")
    metrics = Metrics()
    wires = {"default": MemoryUpstream(EmbedResource(primary), clock), "fallback": MemoryUpstream(EmbedResource(backend), clock)}
    heart = build_heart(
        clock, config, metrics, clock_cooperator(clock), lambda spec: (wires[spec.name], None), (primary, backend),
    )
    fb = heart.fallback
    app = ProxyApp(clock, config, heart.scheduler, metrics, on_attempt=fb.attempt_ended)
    return Core(
        clock, fb, primary, backend, metrics, heart.state, heart.lot, heart.scheduler, heart.scheduler.drainer(None),
        StubTreq(app.resource()), tuple(wires.values()),
    )


def verified(core: Core) -> Core:
    core.fallback.verify()
    assert core.fallback.why_not(MODEL) is None
    core.yield_()
    return core


def test_never_verified_is_not_used():
    core = make_core()
    core.yield_()
    request, d = core.serve()
    assert d.result is False  # park it
    assert request.written == [] and core.backend.calls == []
    assert core.fallback.why_not(MODEL) == "never verified"
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_unverified"}) == 1
    assert core.sample("yieldproxy_fallback_verified", model=MODEL) == 0
    # Never compared: no cosine to report.
    assert core.metrics.registry.get_sample_value("yieldproxy_fallback_min_cosine", {"model": MODEL}) is None
    status = core.fallback.status()
    assert status["models"][MODEL] == {
        "fallback_model": MODEL, "usable": False, "why_not": "never verified", "verification": None,
    }


def test_verified_then_stale():
    core = make_core()
    results = core.fallback.verify().result
    assert results[MODEL].ok and results[MODEL].worst_cosine == pytest.approx(1.0)
    # Both sides got every probe text, under their own names.
    assert [(r.inputs, m) for r, m in core.primary.calls] == [(("one", "two", "three"), MODEL)]
    assert [(r.inputs, m) for r, m in core.backend.calls] == [(("one", "two", "three"), MODEL)]
    assert core.sample("yieldproxy_fallback_verified", model=MODEL) == 1
    assert core.sample("yieldproxy_fallback_min_cosine", model=MODEL) == pytest.approx(1.0)
    core.clock.advance(1800)
    assert core.fallback.why_not(MODEL) is None
    core.clock.advance(1)
    assert "1801s old, more than fallback.max_verification_age_seconds (1800)" in core.fallback.why_not(MODEL)
    assert core.sample("yieldproxy_fallback_verified", model=MODEL) == 0
    core.yield_()
    _, d = core.serve()
    assert d.result is False
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_unverified"}) == 1


def test_a_wrong_model_fails_verification():
    core = make_core()
    core.backend.rename = {MODEL: "nomic-embed-text"}  # the fallback serves other weights
    v = core.fallback.verify().result[MODEL]
    assert not v.ok and v.worst_cosine < 0.5
    assert "3 of 3 probe texts differ" in v.reason
    why = core.fallback.why_not(MODEL)
    assert why.startswith("last verification failed: 3 of 3 probe texts differ")
    assert core.sample("yieldproxy_fallback_verified", model=MODEL) == 0
    assert core.sample("yieldproxy_fallback_min_cosine", model=MODEL) == pytest.approx(v.worst_cosine)
    assert core.fallback.status()["models"][MODEL]["why_not"] == why


@pytest.mark.parametrize("side", ["primary", "backend"])
def test_an_unreachable_side_fails_verification_and_is_retried_sooner(side):
    core = make_core()
    getattr(core, side).fail = "connection refused"
    core.fallback.startService()
    core.clock.advance(0)
    v = core.fallback.verifications[MODEL]
    assert not v.ok and v.rows == ()
    assert v.reason == ("primary: " if side == "primary" else "fallback: ") + "connection refused"
    getattr(core, side).fail = None
    core.clock.advance(RETRY_AFTER_ERROR_SECONDS)
    assert core.fallback.verifications[MODEL].ok
    # Then the regular interval.
    assert [c.getTime() for c in core.clock.getDelayedCalls()] == [RETRY_AFTER_ERROR_SECONDS + 600]
    core.fallback.stopService()
    assert core.clock.getDelayedCalls() == []


def test_verification_runs_on_a_timer_and_waits_out_a_yield():
    core = make_core()
    core.fallback.startService()
    core.clock.advance(0)
    assert len(core.primary.calls) == 1
    core.clock.advance(600)
    assert len(core.primary.calls) == 2
    core.yield_()
    core.clock.advance(600)
    assert len(core.primary.calls) == 2  # the primary is away: nothing sent to it
    assert core.fallback.status()["verification_due"] is True
    core.resume()
    core.clock.advance(0)
    assert len(core.primary.calls) == 3
    assert core.fallback.status()["verification_due"] is False
    core.fallback.stopService()
    assert core.clock.getDelayedCalls() == []


def test_on_demand_verification_refused_while_yielded_and_shared_while_running():
    core = make_core()
    core.yield_()
    with pytest.raises(NotNow):
        core.fallback.verify()
    core.resume()
    core.primary.hold = True
    first, second = core.fallback.verify(), core.fallback.verify()
    assert core.fallback.status()["verifying"] is True
    assert "a verification is running" in core.fallback.why_not(MODEL)
    core.primary.hold = False
    core.primary.held.pop().callback(None)
    assert first.result[MODEL].ok and second.result[MODEL].ok
    assert len(core.primary.calls) == 1


def test_a_yield_mid_verification_stops_it_without_a_verdict():
    core = make_core(models={MODEL: MODEL, "nomic-embed-text": "nomic-embed-text"})
    core.primary.hold = True
    d = core.fallback.verify()
    core.yield_()
    core.primary.held.pop().callback(None)  # first model done; the second must not touch the primary
    assert set(d.result) == {MODEL}
    assert len(core.primary.calls) == 1
    assert core.fallback.status()["verification_due"] is True


def test_serves_a_verified_model_with_a_header():
    core = verified(make_core())
    request, d = core.serve(model=MODEL, input=["hello", "world"])
    assert d.result is True
    assert request.code == 200
    assert request.responseHeaders.getRawHeaders(b"x-yield-served-by") == [b"fallback"]
    assert request.responseHeaders.getRawHeaders(b"x-yield-fallback-model") == [MODEL.encode()]
    answer = json.loads(b"".join(request.written))
    assert answer["model"] == MODEL
    assert answer["embeddings"][1] == pytest.approx(expected_embedding("world", MODEL))
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "ok"}) == 1
    # requests_total is the proxy's to count, once per request (proxy/outcome.py, Outcomes.close).


def test_model_names_with_and_without_latest_are_one_model():
    core = verified(make_core())
    _, d = core.serve(model=MODEL + ":latest", input="x")
    assert d.result is True
    assert core.backend.calls[-1][1] == MODEL  # the mapped fallback name


@pytest.mark.parametrize(
    "why, kwargs",
    [
        ("not yielded", {"yielded": False}),
        ("class policy is park", {"policy": "park"}),
        ("class not in fallback.classes", {"classes": ("long",)}),
    ],
)
def test_not_tried_at_all(why, kwargs):
    yielded = kwargs.pop("yielded", True)
    core = make_core(**kwargs)
    core.fallback.verify()
    if yielded:
        core.yield_()
    _, d = core.serve()
    assert d.result is False
    assert len(core.backend.calls) == 1  # only verification's
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "ok"}) == 0


@pytest.mark.parametrize(
    "path, body",
    [
        (b"/api/embed", {"model": "llama3", "input": "x"}),  # not mapped
        (b"/api/embed", {"model": MODEL, "input": "x", "truncate": False}),
        (b"/v1/embeddings", {"model": MODEL, "input": [101, 102]}),
        (b"/api/chat", {"model": MODEL, "messages": []}),
    ],
)
def test_requests_it_cannot_serve_park(path, body):
    core = verified(make_core())
    _, d = core.serve(path, **body)
    assert d.result is False
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_unsupported"}) == 1


def test_at_most_concurrency_at_once_the_rest_wait_in_line():
    core = verified(make_core(concurrency=2))
    core.backend.hold = True
    served = [core.serve(input=[f"t{i}"]) for i in range(3)]
    # The third is admitted as usual (it parks), in line for the fallback: its
    # drainer serves it when a slot frees (tests/upstream/fallback/test_fallback_drain.py).
    assert served[2][1].result is False
    assert core.fallback.waiting == 1 and len(core.lot) == 1  # the third alone is in line for it
    assert core.fallback.inflight == 2 and len(core.backend.calls) == 1 + 2  # verification's, then two
    # Waiting in line is not a skip: skipped_busy counts one that leaves the lot without its turn.
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_busy"}) == 0
    core.backend.hold = False
    for d in list(core.backend.held):
        d.callback(None)
    core.turn()
    assert [s[1].result for s in served[:2]] == [True, True]
    assert core.fallback.inflight == 0


def test_a_failing_fallback_parks_and_writes_nothing():
    core = verified(make_core())
    core.backend.fail = "answered 500: out of memory"
    request, d = core.serve()
    assert d.result is False
    assert request.written == [] and request.code is None
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "failed_parked"}) == 1
    assert core.fallback.inflight == 0


def test_a_caller_that_leaves_is_counted_abandoned():
    core = verified(make_core())
    core.backend.hold = True
    request, d = core.serve()
    d.cancel()
    failure = d.result
    d.addErrback(lambda f: None)
    core.turn()
    assert "CancelledError" in repr(failure)
    assert core.fallback.inflight == 0
    assert core.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "abandoned"}) == 1


# -- over real sockets: two sims, one the primary, one an OpenAI-shaped fallback --------------------


async def fallback_stack(fallback_model=MODEL, token=None, **fallback):
    """A proxy on a primary sim, with a second sim as its verified-or-not OpenAI-shaped fallback."""
    twin = SimOllama(reactor, latency=0.005, models=TEST_MODELS)
    port = await twin.listen()
    settings = {
        **ENABLED, "url": f"http://127.0.0.1:{port}/v1", "models": {MODEL: fallback_model},
        "timeout_seconds": 5.0, **fallback,
    }
    config = config_with(classes={"batch": {"policy": "fallback"}}, fallback=settings, replay={"concurrency": 4})
    stack = await start_stack(reactor, config, token=token, latency=0.005)
    return stack, twin


async def stop(stack, twin):
    await stack.stop()
    await twin.stop()


def embed_all(url, texts, concurrency, timeout=60):
    """Embed ``texts`` with the official ollama client from ``concurrency`` threads; {text: vector}."""
    from concurrent.futures import ThreadPoolExecutor

    def one(text):
        return text, ollama.Client(host=url, timeout=timeout).embed(model=MODEL, input=text).embeddings[0]

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(pool.map(one, texts))


@pytest_twisted.ensureDeferred
async def test_a_burst_of_40_during_a_yield_is_all_served_by_the_verified_twin():
    """Issue 10, finding 9: with fallback.concurrency = 2, a burst of 40 embeddings during a
    yield is answered during the yield, two at a time at the fallback, none left parked."""
    stack, twin = await fallback_stack(concurrency=2)
    twin.latency = 0.03  # a CPU twin is slower than the GPU: the lot fills while it works
    try:
        results = await stack.proxy.fallback.verify()
        assert results[MODEL].ok
        assert sum(twin.texts_embedded.values()) == len(DEFAULT_PROBE_TEXTS)
        stack.proxy.state.hold("api", "game")
        texts = [f"fallback burst {i}" for i in range(40)]
        # LightRAG's embedding timeout (30 s) as the clients' own; the yield never ends here.
        vectors = await in_thread(reactor, embed_all, stack.proxy_url, texts, 40, 30, timeout=90)
        assert stack.proxy.state.yielded
        for text in texts:
            assert vectors[text] == pytest.approx(expected_embedding(text, MODEL), abs=1e-6)
        # All 40 were the twin's, each once; nothing reached the yielded primary.
        assert all(twin.texts_embedded[t] == 1 for t in texts)
        assert not any(t in stack.sim.texts_embedded for t in texts)
        assert len(stack.proxy.lot) == 0
        # Never more than fallback.concurrency at the twin at once.
        assert twin.peak_in_flight == 2
        sample = stack.sample
        assert sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "ok"}) == 40
        assert sample("yieldproxy_requests_total", **{"class": "batch", "code": "200"}) == 40
        # Those that waited in line for it are parked requests ended by the fallback.
        from_lot = sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "fallback"})
        assert 1 <= from_lot <= 38
        assert sample("yieldproxy_park_seconds_count", **{"class": "batch"}) == from_lot
        assert sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 0
        assert sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_busy"}) == 0
    finally:
        await stop(stack, twin)


@pytest_twisted.ensureDeferred
async def test_a_graceful_stop_lets_the_fallback_finish_and_answers_its_line_503():
    """Stopping during a yield: what the fallback is serving finishes before the stop ends; the line gets 503."""
    from yieldproxy.service import build

    twin = SimOllama(reactor, latency=1.0, models=TEST_MODELS)
    twin_port = await twin.listen()
    sim = SimOllama(reactor, models=TEST_MODELS)
    sim_port = await sim.listen()
    config = config_with(
        proxy={"upstream": f"http://127.0.0.1:{sim_port}"},
        classes={"batch": {"policy": "fallback"}},
        fallback={**ENABLED, "url": f"http://127.0.0.1:{twin_port}/v1", "timeout_seconds": 10.0},
    ).with_overrides(**EPHEMERAL)
    proxy = build(reactor, config)
    service = proxy.service
    service.startService()  # verifies the fallback at once
    try:
        await wait_for(reactor, lambda: proxy.fallback.why_not(MODEL) is None, timeout=20)
        proxy.state.hold("api", "game")
        url = listening_url(proxy, "proxy") + "/api/embed"
        pending = [
            treq.post(url, json={"model": MODEL, "input": f"stop {i}"}, persistent=False).addTimeout(TIMEOUT, reactor)
            for i in range(6)
        ]
        await wait_for(reactor, lambda: proxy.fallback.inflight == 2 and len(proxy.lot) == 4, timeout=10)
        await service.stopService()
        # The two at the fallback were done before the stop ended (it waited for them)...
        assert proxy.fallback.inflight == 0
        # ...and answered from it; the four in line got 503.
        codes = [(await d).code for d in pending]
        assert sorted(codes) == [200, 200, 503, 503, 503, 503]
        assert len([text for text in twin.texts_embedded if text.startswith("stop")]) == 2
        assert not any(text.startswith("stop") for text in sim.texts_embedded)  # only the probe texts
        sample = lambda outcome: proxy.metrics.registry.get_sample_value(  # noqa: E731
            "yieldproxy_fallback_total", {"class": "batch", "outcome": outcome}
        )
        assert (sample("ok"), sample("skipped_busy")) == (2, 4)
    finally:
        if service.running:
            await service.stopService()
        await twin.stop()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_openai_client_gets_base64_from_the_fallback_with_the_header():
    stack, twin = await fallback_stack(concurrency=4)
    try:
        await stack.proxy.fallback.verify()
        stack.proxy.state.hold("api", "test")

        def call():
            client = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="x", max_retries=0, timeout=30)
            raw = client.embeddings.with_raw_response.create(model=MODEL, input=["alpha", "beta"])
            return raw.headers.get("x-yield-served-by"), [d.embedding for d in raw.parse().data]

        header, vectors = await in_thread(reactor, call, timeout=TIMEOUT)
        assert header == "fallback"
        assert vectors[1] == pytest.approx(expected_embedding("beta", MODEL), abs=1e-6)
        # The legacy route too, and the raw body carries the float32 base64 the client asked for.
        legacy = await in_thread(
            reactor, lambda: ollama.Client(host=stack.proxy_url).embeddings(model=MODEL, prompt="gamma"), timeout=TIMEOUT
        )
        assert list(legacy.embedding) == pytest.approx(expected_embedding("gamma", MODEL), abs=1e-6)
        response = await treq.post(
            stack.proxy_url + "/v1/embeddings", json={"model": MODEL, "input": "delta", "encoding_format": "base64"},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        answer = await response.json()
        assert response.headers.getRawHeaders("x-yield-served-by") == ["fallback"]
        assert decode_base64_f32(answer["data"][0]["embedding"]) == pytest.approx(expected_embedding("delta", MODEL), abs=1e-6)
        assert not stack.sim.texts_embedded.keys() & {"alpha", "beta", "gamma", "delta"}
    finally:
        await stop(stack, twin)


@pytest_twisted.ensureDeferred
async def test_a_failing_fallback_parks_and_the_caller_sees_no_error():
    stack, twin = await fallback_stack()
    try:
        await stack.proxy.fallback.verify()
        await twin.set_mode("error500")
        stack.proxy.state.hold("api", "test")
        pending = in_thread(reactor, embed_all, stack.proxy_url, ["f1", "f2"], 2, timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 2, timeout=10)
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "failed_parked"}) == 2
        stack.proxy.state.release("api")
        vectors = await pending
        assert vectors["f2"] == pytest.approx(expected_embedding("f2", MODEL), abs=1e-9)
        assert stack.sim.texts_embedded["f1"] == 1
    finally:
        await stop(stack, twin)


@pytest_twisted.ensureDeferred
async def test_a_wrong_model_is_never_used_and_status_says_why():
    stack, twin = await fallback_stack(fallback_model="nomic-embed-text", token="s3cret")
    try:
        results = await stack.proxy.fallback.verify()
        assert not results[MODEL].ok
        auth = {"Authorization": "Bearer s3cret"}
        status = await (await treq.get(stack.admin_url + "/status", headers=auth).addTimeout(TIMEOUT, reactor)).json()
        entry = status["fallback"]["models"][MODEL]
        assert entry["usable"] is False and "probe texts differ" in entry["why_not"]
        assert entry["verification"]["worst_cosine"] < 0.5
        before = sum(twin.texts_embedded.values())
        stack.proxy.state.hold("api", "test")
        texts = [f"wrong {i}" for i in range(12)]
        pending = in_thread(reactor, embed_all, stack.proxy_url, texts, len(texts), timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == len(texts), timeout=10)
        stack.proxy.state.release("api")
        vectors = await pending
        for text in texts:
            assert vectors[text] == pytest.approx(expected_embedding(text, MODEL), abs=1e-9)
        assert sum(twin.texts_embedded.values()) == before  # nothing but the probes reached it
        # Every one parked and was replayed.
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_unverified"}) == 12
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 12
        metrics = (await (await treq.get(stack.admin_url + "/metrics", headers=auth)).text())
        assert 'yieldproxy_fallback_verified{model="all-minilm"} 0.0' in metrics
        assert "yieldproxy_fallback_min_cosine" in metrics
    finally:
        await stop(stack, twin)


@pytest_twisted.ensureDeferred
async def test_admin_verify_route():
    stack, twin = await fallback_stack(token="s3cret")
    try:
        url = stack.admin_url + "/fallback/verify"
        denied = await treq.post(url, persistent=False).addTimeout(TIMEOUT, reactor)
        assert denied.code == 401
        auth = {"Authorization": "Bearer s3cret"}
        auth["Content-Type"] = "application/json"
        answer = await treq.post(url, headers=auth, persistent=False).addTimeout(TIMEOUT, reactor)
        body = await answer.json()
        assert answer.code == 200 and body["models"][MODEL]["usable"] is True
        assert body["models"][MODEL]["verification"]["dimension"] == 384
        stack.proxy.state.hold("api", "test")
        answer = await treq.post(url, headers=auth, persistent=False).addTimeout(TIMEOUT, reactor)
        assert answer.code == 409 and "yielded" in (await answer.json())["error"]
    finally:
        await stop(stack, twin)


@pytest_twisted.ensureDeferred
async def test_disabled_fallback_in_status_and_admin():
    stack = await start_stack(reactor)
    try:
        status = await (await treq.get(stack.admin_url + "/status").addTimeout(TIMEOUT, reactor)).json()
        assert status["fallback"] == {"enabled": False}
        answer = await treq.post(
            stack.admin_url + "/fallback/verify", headers={"Content-Type": "application/json"}, persistent=False
        ).addTimeout(TIMEOUT, reactor)
        assert answer.code == 404
    finally:
        await stack.stop()


def check_fallback(config_path):
    return subprocess.run(
        [sys.executable, "-m", "yieldproxy.tools.cli", "check-fallback", "--config", str(config_path)],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("fallback_model, code", [(MODEL, 0), ("nomic-embed-text", 1)])
@pytest_twisted.ensureDeferred
async def test_check_fallback_command(tmp_path, fallback_model, code):
    primary, twin = SimOllama(reactor, models=TEST_MODELS), SimOllama(reactor, models=TEST_MODELS)
    try:
        p, t = await primary.listen(), await twin.listen()
        config = tmp_path / "yieldproxy.toml"
        config.write_text(textwrap.dedent(f"""\
            [proxy]
            upstream = "http://127.0.0.1:{p}"
            [fallback]
            url = "http://127.0.0.1:{t}/v1"
            api = "openai"
            probe_texts = ["hello", "Grüße aus Köln 🎉"]
            [fallback.models]
            "{MODEL}" = "{fallback_model}"
        """))
        done = await in_thread(reactor, check_fallback, config, timeout=90)
        assert done.returncode == code, done.stderr
        out = done.stdout
        assert f"{MODEL} -> {fallback_model}: {'OK' if code == 0 else 'FAILED'}" in out
        assert "dim primary" in out and "Grüße aus Köln 🎉" in out and " 384 " in out
        assert ("fallback verified" if code == 0 else "fallback NOT verified") in out
    finally:
        await primary.stop()
        await twin.stop()


def test_check_fallback_without_a_fallback_is_a_usage_error(tmp_path):
    config = tmp_path / "empty.toml"
    config.write_text("")
    done = check_fallback(config)
    assert done.returncode == 2
    assert "fallback.url and fallback.models not set" in done.stderr


# -- the HTTP side of a backend: timeouts and refusals are BackendErrors, never hangs -----------------


class Hang(Resource):
    """Never answers, or sends the headers and part of a body, then nothing."""

    isLeaf = True

    def __init__(self, partial: bool):
        super().__init__()
        self.partial = partial

    def render(self, request):
        if self.partial:
            request.setHeader(b"content-length", b"1000")
            request.write(b'{"data": [')
        return NOT_DONE_YET


@pytest.mark.parametrize("partial", [False, True])
@pytest_twisted.ensureDeferred
async def test_a_hanging_backend_times_out(partial):
    site = Site(Hang(partial))
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    upstream = Upstream(reactor, f"http://127.0.0.1:{port.getHost().port}/v1")
    backend = EmbedBackend(reactor, upstream, "openai", timeout=0.3)
    try:
        with pytest.raises(BackendError) as caught:
            await Deferred.fromCoroutine(backend.embed(EmbedRequest("embed", MODEL, ("x",)), MODEL)).addTimeout(TIMEOUT, reactor)
        assert caught.value.reason == "timeout" and "no answer within 0.3s" in caught.value.detail
    finally:
        await backend.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_refusing_backend_is_a_backend_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    backend = EmbedBackend(reactor, Upstream(reactor, f"http://127.0.0.1:{free}"), "ollama", timeout=5)
    try:
        with pytest.raises(BackendError) as caught:
            await Deferred.fromCoroutine(backend.embed(EmbedRequest("embed", MODEL, ("x",)), MODEL)).addTimeout(TIMEOUT, reactor)
        assert caught.value.reason == "refused"
    finally:
        await backend.close()


def test_status_lists_the_fallback_as_a_standby_member():
    """Issue 17: ``[fallback]`` is a pool member like any other, a standby one: ``/status`` lists it."""
    from yieldproxy.service import build

    config = attrs.evolve(
        config_with(classes={"batch": {"policy": "fallback"}}), fallback=attrs.evolve(FallbackConfig(), **ENABLED),
    )
    proxy = build(Clock(), config)
    rows = {row["name"]: row for row in proxy.admin_app.status()["upstreams"]}
    assert list(rows) == ["default", "fallback"]
    fallback = rows["fallback"]
    assert (fallback["use"], fallback["url"], fallback["api"]) == ("when_others_yielded", ENABLED["url"], "openai")
    assert fallback["models"] == [MODEL] and fallback["classes"] == ["batch"] and fallback["replay_concurrency"] == 2
    assert fallback["state"] == "available" and proxy.scheduler.member("fallback").spec.standby
    # The one drain model: it drains the one lot like any member; no engine of its own.
    assert [m.name for m in proxy.scheduler.members] == ["default", "fallback"]
