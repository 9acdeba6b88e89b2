"""Outages judged by probes, not by one request's words (issue 10, findings 3 and 10).

* Only Ollama's own runner and memory failure messages, at the start of the
  message in its error JSON, count as a GPU failure: a client's words quoted
  back in a 500 (a bad ``template``) are relayed to that client at once.
* A failure of an outage kind is judged by a probe of the same kind of call:
  if it fails too, the proxy holds (and the attempts lost to the outage do
  not count); if it passes, the request failed alone and ends after
  ``upstream.max_attempts`` with the upstream's own answer.
* An outage that model calls revealed, with ``/api/version`` answering all
  along, costs a burst of real ``ollama`` clients nothing.

That burst of real clients runs on 127.0.0.1; everything else here is
judgement and time, and runs with the proxy in memory on a Clock
(``tests/inmemory.py``): its bursts are in-memory callers
(``test_chaos.MemoryBurst``), its outages last seconds of the clock.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.web.resource import Resource

from helpers import config_with, in_thread, start_stack, wait_for
from inmemory import Answer, Rig, answered
from rawhttp import counter_by, counter_total
from test_burst import Burst, assert_clean
from test_chaos import MemoryBurst
from yieldproxy.servers.base import PROBE_TEXT
from yieldproxy.servers.ollama import GPU_FAILURE_PREFIXES, is_gpu_failure
from yieldproxy.tools.sim import LOAD_OOM_ERROR, OOM_ERROR, template_error

TIMEOUT = 60


def ollama_error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def openai_error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "api_error", "param": None, "code": None}}).encode()


@pytest.mark.parametrize(
    "status, body, gpu",
    [
        (500, ollama_error(OOM_ERROR), True),
        (500, openai_error(OOM_ERROR), True),
        (500, ollama_error("llama-server process no longer running: exit status 2 CUDA error"), True),
        (500, ollama_error("model requires more system memory (5.2 GiB) than is available (3.1 GiB)"), True),
        (400, ollama_error("do embedding request: Post \"http://127.0.0.1:41853/embedding\": EOF"), True),
        # llama.cpp's own words, passed through by HEAD's llama-server runner.
        (500, ollama_error("Compute error."), True),
        (500, ollama_error("Compute error. "), False),
        # Ollama's out-of-memory substrings anywhere in the message, in any case (llm/status.go).
        (500, ollama_error("CUDA error: out of memory"), True),
        (500, ollama_error("x llama runner process has terminated: CUDA error: out of memory"), True),
        (500, ollama_error("ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 1234"), True),
        (500, ollama_error("ErrorOutOfDeviceMemory"), False),
        (500, ollama_error("vk::Device::allocateMemory: ErrorOutOfMemory"), True),
        (500, ollama_error("out of memory"), True),
        (500, openai_error("hipMalloc failed: Not Enough Memory"), True),
        # ...in a 500 only: a 400 is the caller's unless a prefix says otherwise.
        (400, ollama_error("invalid input: CUDA error: out of memory"), False),
        (400, ollama_error("Compute error."), True),
        # A client's words, quoted back: not GPU words (the probe judges such a 500, not the words).
        (500, ollama_error('template: :1: function "gpu" not defined'), False),
        (500, ollama_error('template: :1: function "cuda" not defined'), False),
        (500, ollama_error("CUDA error: an illegal memory access was encountered"), False),
        (500, ollama_error(" llama runner process has terminated"), False),
        (500, b"llama runner process has terminated: CUDA error: out of memory", False),
        (500, json.dumps({"detail": OOM_ERROR}).encode(), False),
        (500, json.dumps({"error": [OOM_ERROR]}).encode(), False),
        (500, json.dumps([{"error": OOM_ERROR}]).encode(), False),
        (500, ollama_error(OOM_ERROR)[:-2], False),
        (404, ollama_error(OOM_ERROR), False),
        (502, ollama_error(OOM_ERROR), False),
        (500, ollama_error("GPU error"), False),
    ],
)
def test_only_ollamas_own_failure_words_count_as_a_gpu_failure(status, body, gpu):
    assert is_gpu_failure(status, body) is gpu


def test_the_prefixes_are_ollamas_own_words():
    """Every prefix names a runner or memory failure; none is a word a request could lead with."""
    assert len(set(GPU_FAILURE_PREFIXES)) == len(GPU_FAILURE_PREFIXES)
    for prefix in GPU_FAILURE_PREFIXES:
        assert len(prefix) >= 12 and prefix == prefix.strip()
        assert not prefix.lower().startswith(("gpu", "cuda", "template"))


def test_the_simulated_ollama_quotes_a_bad_template_as_go_does():
    assert template_error("{{ gpu }}") == 'template: :1: function "gpu" not defined'
    assert template_error("{{ .System }}\n{{ .Prompt | cuda }}") == 'template: :2: function "cuda" not defined'
    assert template_error('{{ if .System }}{{ printf "%s gpu" .System }}{{ end }}{{ .Prompt }}') is None
    assert template_error("{{ .Prompt ") == "template: :1: unclosed action"


def outage_sources(stack) -> float:
    return stack.sample("yieldproxy_yields_total", source="outage")


def record_states(stack) -> list[bool]:
    """Every yield-state change from now on (True: yielded)."""
    changes: list[bool] = []
    stack.proxy.state.observe(changes.append)
    return changes


async def reachable(stack) -> None:
    outage = next(s for s in stack.proxy.watchers if s.name == "watcher:outage")
    await wait_for(reactor, lambda: outage.reachable, timeout=10)


# -- the proxy in memory on a Clock (tests/inmemory.py): time moves only when the test moves it ---------


def outage_rig(config, watchers: bool = True, **rig) -> Rig:
    """A started proxy in memory; with ``watchers``, once its outage watcher has reached the upstream."""
    rig = Rig(config, watchers=watchers, reactor=MemoryReactorClock(), **rig)
    rig.start()
    if watchers:
        outage = next(s for s in rig.proxy.watchers if s.name == "watcher:outage")
        rig.until(lambda: outage.reachable, 10)
    return rig


def answer_of(rig: Rig, d: Deferred, seconds: float = TIMEOUT) -> Answer:
    """``d``'s answer once the clock has moved as far as it takes (at most ``seconds``)."""
    rig.until(lambda: answered(d), seconds)
    return rig.result(d)


def admin_call(rig: Rig, path: str, body: dict) -> dict:
    """``POST path`` on the admin API; its JSON, asserted 200 (as helpers.admin)."""
    answer = rig.call("POST", rig.admin_url + path, json=body)
    assert answer.code == 200, answer.text()
    return answer.json()


def stopped(rig: Rig) -> None:
    """Stop the proxy: nothing is left scheduled."""
    rig.stop()
    assert rig.clock.getDelayedCalls() == []


# -- finding 3: a client's words are not an outage -----------------------------------------


def test_a_template_quoting_gpu_gets_ollamas_own_500_at_once_and_nobody_is_parked():
    """``"template": "{{ gpu }}"``: the sender gets Ollama's 500 body at once; no hold; others are not parked."""
    rig = outage_rig(config_with(replay={"concurrency": 4}), latency=0.02)
    states = record_states(rig)
    bad = {"model": "llama3.2", "prompt": "hello", "template": "{{ gpu }}", "stream": False}
    expected = json.dumps({"error": 'template: :1: function "gpu" not defined'}, separators=(",", ":")).encode()
    others = [rig.post("/api/embed", {"model": "all-minilm", "input": f"other {i}"}) for i in range(20)]
    for _ in range(5):
        response = answer_of(rig, rig.post("/api/generate", bad))
        assert response.code == 500
        assert response.body == expected
        assert response.length == len(expected)
        # At once: never parked (and, below, never retried, probed or held).
        assert response.header("x-yield-parked-seconds") is None
    for pending in others:
        answer = answer_of(rig, pending)
        assert answer.code == 200
        assert answer.header("x-yield-parked-seconds") is None
    # Each bad request reached Ollama once: no retry, no hold.  A 500 in words no list has is judged on
    # evidence about the GPU, never on the model the request named: a probe (the proxy's text) of the
    # model the upstream served, believed for a few seconds, or, before anything was served, none at
    # all; either way the caller got Ollama's answer.
    generates = [r for r in rig.sim.history if r.path == "/api/generate"]
    assert [r.outcome for r in generates].count("template_error") == 5
    assert rig.sim.outcomes["template_error"] == 5
    assert len(generates) == 5
    assert rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="up") <= 1
    assert rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="down") == 0
    assert rig.sim.texts_embedded[PROBE_TEXT] <= 1
    assert counter_total(rig, "yieldproxy_failures_alone", reason="unknown_error") == 5
    assert states == [] and not rig.proxy.state.yielded
    assert outage_sources(rig) == 0
    assert counter_total(rig, "yieldproxy_upstream_failures") == 5
    assert counter_total(rig, "yieldproxy_retries") == 0
    # Relayed to its sender, the attempt is an answer like any other (no failing-upstream alert).
    assert counter_by(rig, "yieldproxy_upstream_attempts", "outcome") == {"ok": 25.0}
    assert counter_by(rig, "yieldproxy_requests", "code") == {"500": 5.0, "200": 20.0}
    stopped(rig)


def test_a_request_whose_own_input_breaks_the_gpu_call_fails_alone_with_ollamas_answer():
    """Its own num_ctx does not fit: probes of the same call pass, so no hold, and after
    upstream.max_attempts it gets Ollama's own 500; the traffic around it is never parked."""
    config = config_with(upstream={"retry_backoff_seconds": 0.05, "retry_backoff_max_seconds": 0.1})
    rig = outage_rig(config, latency=0.01, max_num_ctx=8192)
    states = record_states(rig)
    heavy = {"model": "all-minilm", "input": "too much context", "options": {"num_ctx": 131072}}
    others = [rig.post("/api/embed", {"model": "all-minilm", "input": f"fine {i}"}) for i in range(10)]
    response = answer_of(rig, rig.post("/api/embed", heavy))
    assert response.code == 500
    assert response.json() == {"error": LOAD_OOM_ERROR}
    for pending in others:
        answer = answer_of(rig, pending)
        assert answer.code == 200
        assert answer.header("x-yield-parked-seconds") is None
    max_attempts = config.upstream.max_attempts
    assert rig.sim.outcomes["error500"] == max_attempts
    # One passing probe judges every attempt: it is believed for a few seconds (not one probe per attempt).
    assert rig.sim.texts_embedded[PROBE_TEXT] == 1
    assert states == [] and outage_sources(rig) == 0
    assert rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="up") == 1
    assert rig.sample("yieldproxy_forgiven_attempts_total", **{"class": "batch"}) == 0
    stopped(rig)


# -- finding 10: an undeclared GPU failure fails nobody ------------------------------------------


def test_attempts_lost_to_a_recognised_outage_do_not_count():
    """max_attempts = 1, and the GPU fails for a while: the request waits it out and succeeds.  (The upstream
    served the model before: that is the evidence a probe of it failing too is an outage.)"""
    config = config_with(upstream={"max_attempts": 1, "health_max_interval_seconds": 0.5})
    rig = outage_rig(config)
    assert answer_of(rig, rig.post("/api/embed", {"model": "all-minilm", "input": "served"})).code == 200
    rig.sim.set_mode("error500")
    pending = rig.post("/api/embed", {"model": "all-minilm", "input": "patient"})
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    # The GPU stays down through two more probes (the watcher's own re-checks)...
    down = lambda: rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="down")  # noqa: E731
    before = down()
    rig.until(lambda: down() >= before + 2, 10)
    # ...and the request with its one attempt is parked behind the hold, not failed.
    assert len(rig.proxy.lot) == 1 and not answered(pending)
    rig.sim.set_mode("ok")
    response = answer_of(rig, pending)
    assert response.code == 200
    assert response.json()["embeddings"]
    assert rig.sample("yieldproxy_forgiven_attempts_total", **{"class": "batch"}) >= 1
    rig.until(lambda: not rig.proxy.state.yielded, 10)
    stopped(rig)


@pytest_twisted.ensureDeferred
async def test_undeclared_gpu_failure_mid_burst_with_version_answering_fails_nobody():
    """1,200 embeddings from 24 real ollama clients; mid-burst every model call fails with Ollama's
    "CUDA error: out of memory" through three failed model probes while /api/version answers, and nobody declares a yield:
    0 failures, every vector right."""
    config = config_with(replay={"concurrency": 4}, upstream={"health_max_interval_seconds": 2.0})
    stack = await start_stack(reactor, config, watchers=True, latency=0.004, parallel=4)
    try:
        await reachable(stack)
        burst = Burst(stack.proxy_url, [f"gpu gone {i}" for i in range(1200)], concurrency=24)
        running = in_thread(reactor, burst.run, timeout=180)
        await wait_for(reactor, lambda: burst.done >= 300, timeout=60)
        await stack.sim.set_mode("error500")
        await wait_for(reactor, lambda: stack.proxy.state.hold_of("outage") is not None, timeout=10)
        # The outage lasts until the watcher's model probe has failed three times (its own re-checks,
        # no sleep), while /api/version answers throughout.
        version = await treq.get(stack.sim.url + "/api/version", persistent=False).addTimeout(5, reactor)
        assert version.code == 200
        await version.content()
        await wait_for(
            reactor,
            lambda: stack.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="down") >= 3,
            timeout=30,
        )
        version = await treq.get(stack.sim.url + "/api/version", persistent=False).addTimeout(5, reactor)
        assert version.code == 200
        await version.content()
        done_in_outage = burst.done
        await stack.sim.set_mode("ok")
        await running
        assert done_in_outage < len(burst.texts)
        assert_clean(burst, stack)
        assert stack.sim.outcomes["error500"] > 0
        assert outage_sources(stack) >= 1
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "upstream_error"}) == 0
        assert stack.sample("yieldproxy_forgiven_attempts_total", **{"class": "batch"}) > 0
        assert stack.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="down") >= 3
        assert counter_by(stack, "yieldproxy_requests", "code") == {"200": float(len(burst.texts))}
        assert not stack.proxy.state.yielded
    finally:
        await stack.stop()


def test_a_template_naming_ollamas_oom_words_is_retried_alone_and_never_holds():
    """``{{ ErrorOutOfMemory }}``: Ollama quotes a function name that holds one of its own out-of-memory
    substrings, so the words read as a GPU failure; the probe (the proxy's text) passes, so nothing is
    held, nobody else parks, and after upstream.max_attempts the sender gets Ollama's own 500."""
    config = config_with(upstream={"max_attempts": 2, "retry_backoff_seconds": 0.01, "retry_backoff_max_seconds": 0.02})
    rig = outage_rig(config, latency=0.01)
    states = record_states(rig)
    bad = {"model": "llama3.2", "prompt": "hello", "template": "{{ ErrorOutOfMemory }}", "stream": False}
    others = [rig.post("/api/embed", {"model": "all-minilm", "input": f"other {i}"}) for i in range(10)]
    response = answer_of(rig, rig.post("/api/generate", bad))
    assert response.code == 500
    assert response.json() == {"error": 'template: :1: function "ErrorOutOfMemory" not defined'}
    for pending in others:
        answer = answer_of(rig, pending)
        assert answer.code == 200
        assert answer.header("x-yield-parked-seconds") is None
    assert rig.sim.outcomes["template_error"] == 2
    assert rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="up") <= 1
    assert states == [] and outage_sources(rig) == 0
    stopped(rig)


# -- issue 16: a request caught by a declared yield survives, whatever words the upstream uses ----------


def test_a_declared_yield_keeps_in_flight_requests_whatever_words_the_upstream_fails_in():
    """A burst at concurrency 32; POST /yield and, at the same moment, every model call gets a 500 in words
    no list has: the requests in flight go back to the lot (not counted, no probe needed), and
    after the resume every caller has its vector.  (Before: relayed as the callers' own 500s.)"""
    config = config_with(replay={"concurrency": 4}, upstream={"max_attempts": 1})
    # No outage watcher: the declared hold alone explains the failures.
    rig = outage_rig(config, watchers=False, latency=0.02, parallel=4)
    burst = MemoryBurst(rig, [f"yield words {i}" for i in range(240)], concurrency=32)
    burst.start()
    rig.until(lambda: burst.done >= 40, 60)
    # The yield is declared, and the GPU goes at once: the requests in flight fail after it.
    admin_call(rig, "/yield", {"reason": "game", "source": "broker"})
    rig.sim.set_mode("error500_unknown", in_flight=True)
    rig.until(lambda: len(rig.proxy.lot) == 32, 10)
    rig.run(0.5)
    rig.sim.set_mode("ok")
    admin_call(rig, "/resume", {"source": "broker"})
    rig.until(lambda: burst.finished, 120)
    assert_clean(burst, rig)
    assert rig.sim.outcomes["error500"] > 0
    assert counter_by(rig, "yieldproxy_upstream_failures", "reason") == {
        "unknown_error": rig.sim.outcomes["error500"]
    }
    assert rig.sample("yieldproxy_forgiven_attempts_total", **{"class": "batch"}) == rig.sim.outcomes["error500"]
    assert counter_by(rig, "yieldproxy_requests", "code") == {"200": float(len(burst.texts))}
    stopped(rig)


# -- issue 16: an error in words nobody listed is judged by a probe ------------------------------------------


def test_an_undeclared_500_in_unknown_words_mid_burst_is_judged_by_a_few_probes_and_fails_nobody():
    """Mid-burst every model call gets a 500 in words no list has, for 2 s, and nobody yields: a probe of
    the same call fails too, so the outage hold is taken and the requests park; probes are shared, so
    the whole burst costs a handful; 0 failures, every vector right.  (Before: relayed at once.)"""
    config = config_with(
        replay={"concurrency": 4},
        upstream={"health_interval_seconds": 0.25, "health_max_interval_seconds": 0.5},
    )
    rig = outage_rig(config, latency=0.004, parallel=4)
    burst = MemoryBurst(rig, [f"unknown words {i}" for i in range(400)], concurrency=24)
    burst.start()
    rig.until(lambda: burst.done >= 100, 60)
    rig.sim.set_mode("error500_unknown")
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    rig.run(2)
    rig.sim.set_mode("ok")
    rig.until(lambda: burst.finished, 120)
    assert_clean(burst, rig)
    assert rig.sim.outcomes["error500"] > 0
    assert outage_sources(rig) >= 1
    probes = counter_total(rig, "yieldproxy_outage_probes", probe="model")
    assert 1 <= probes <= 10, probes
    assert rig.sim.requests_total["/api/embed"] <= len(burst.texts) + 2 * 24
    assert counter_by(rig, "yieldproxy_requests", "code") == {"200": float(len(burst.texts))}
    assert not rig.proxy.state.yielded
    stopped(rig)


# -- a model the GPU cannot hold is that model's trouble, not an outage --------------------------------------


class _TooBigForTheGpu(Resource):
    """An Ollama whose GPU serves ``all-minilm`` and cannot load ``huge``: every call of it, the proxy's
    probe included, gets Ollama's own 500 (``model requires more system memory``, a GPU prefix)."""

    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"version": "0.12.0"}).encode()

    def render_POST(self, request):
        request.setHeader(b"content-type", b"application/json")
        body = json.loads(request.content.read())
        if body.get("model") == "huge":
            request.setResponseCode(500)
            return ollama_error("model requires more system memory (48.0 GiB) than is available (23.4 GiB)")
        return json.dumps({"model": body["model"], "embeddings": [[0.5, 0.5]]}).encode()


def test_a_model_too_big_for_the_gpu_fails_alone_and_holds_nobody():
    """One caller names an installed model the GPU cannot load, after others were served: the probe of
    that very call fails too, but only that model fails (the upstream served other model calls and never
    this one), so no outage hold is taken: that caller gets Ollama's 500 after upstream.max_attempts and
    the others are never parked.  (Before: the hold was taken and lasted until a call of the model that
    never fits passed, i.e. for ever, parking every caller.)"""
    config = config_with(upstream={"max_attempts": 2, "retry_backoff_seconds": 0.01, "retry_backoff_max_seconds": 0.02})
    rig = outage_rig(config, upstream=_TooBigForTheGpu())
    states = record_states(rig)
    small = {"model": "all-minilm", "input": "served"}
    served = answer_of(rig, rig.post("/api/embed", small), 10)
    assert served.code == 200
    answer = answer_of(rig, rig.post("/api/embed", {"model": "huge", "input": "x"}), 10)
    assert answer.code == 500
    assert b"requires more system memory" in answer.body
    assert answer.header("x-yield-parked-seconds") is None
    after = answer_of(rig, rig.post("/api/embed", small), 10)
    assert after.code == 200 and after.header("x-yield-parked-seconds") is None
    assert states == [] and outage_sources(rig) == 0
    # Judged on the model it served (its probe passes), never on the model that does not fit.
    assert rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="down") == 0
    assert rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="up") == 1
    stopped(rig)


class _OllamaOfOneModel(Resource):
    """An Ollama with one model, ``all-minilm``: another name is its 404 (``model "x" not found``), and
    with ``broken`` set its GPU fails every call of the model in its own words."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.broken = False
        self.models: list[str] = []

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        if request.path == b"/api/tags":
            return json.dumps({"models": [{"name": "all-minilm:latest", "model": "all-minilm:latest"}]}).encode()
        return json.dumps({"version": "0.12.0"}).encode()

    def render_POST(self, request):
        request.setHeader(b"content-type", b"application/json")
        model = json.loads(request.content.read()).get("model")
        self.models.append(model)
        if model not in ("all-minilm", "all-minilm:latest"):
            request.setResponseCode(404)
            return ollama_error(f'model "{model}" not found, try pulling it first')
        if self.broken:
            request.setResponseCode(500)
            return ollama_error(OOM_ERROR)
        return json.dumps({"model": model, "embeddings": [[0.5, 0.5]]}).encode()


def test_an_outage_of_a_mapped_model_is_probed_with_the_upstreams_own_name():
    """An upstream whose model_map gives the client's ``alias`` its own name ``all-minilm``: when its GPU
    fails, the probe asks for ``all-minilm`` (what the request asked it for), so the probe fails too, the
    outage hold is taken and the caller waits and gets its vector.  (Before: the probe asked for
    ``alias``, the upstream's 404 read as "it serves", and the caller got the 500 after max_attempts.)"""
    backend = _OllamaOfOneModel()
    config = config_with(upstream={"max_attempts": 2, "retry_backoff_seconds": 0.01, "retry_backoff_max_seconds": 0.02,
                                   "health_interval_seconds": 0.1, "health_max_interval_seconds": 0.2})
    rig = Rig(config, members=[{"name": "a", "upstream": backend, "model_map": {"alias": "all-minilm"}}], watchers=True)
    rig.start()
    first = answer_of(rig, rig.post("/api/embed", {"model": "alias", "input": "x"}), 10)
    assert first.code == 200, first.body
    backend.broken = True
    pending = rig.post("/api/embed", {"model": "alias", "input": "y"})
    rig.until(lambda: any(h.source == "outage" for h in rig.proxy.state.holds), 5)
    backend.broken = False
    answer = answer_of(rig, pending, 10)
    assert answer.code == 200, answer.body
    assert "alias" not in backend.models
    stopped(rig)
