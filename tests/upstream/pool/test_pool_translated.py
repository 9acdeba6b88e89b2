"""Embeddings translated across dialects in the pool, on a Clock (upstream/pool/routing.py, upstream/pool/twins.py).

An Ollama client's ``/api/embed`` may go to a member that serves the model
but not that route (an OpenAI-compatible, Infinity or TEI CPU copy), the
request and answer translated (upstream/translated_attempt.py); never chat or generation,
only a model the member is known to serve, and only as a verified twin of
the model's reference, which is an Ollama member whenever one serves the
model.  The real-socket half is tests/test_pool_translated_real.py.
"""

from __future__ import annotations

import json

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from helpers import Core, advance_through, clock_cooperator, config_with, make_pool_core, pool_config
from yieldproxy.lot.parking import Entry
from yieldproxy.observe.metrics import Metrics
from yieldproxy.schedule.routing import Eligibility
from yieldproxy.service import build_heart
from yieldproxy.tools.sim import expected_embedding
from yieldproxy.upstream.control import Answer
from yieldproxy.upstream.pool.twins import TwinVerifier

MODEL = "all-minilm"
DESKTOP = {"name": "desktop", "models": (MODEL, "llama3.2")}
CPU = {"name": "cpu", "api": "openai", "use": "when_others_yielded", "models": (MODEL,)}


# -- eligibility ---------------------------------------------------------------------------------


def test_a_member_of_another_dialect_is_eligible_only_for_the_embeddings_of_a_model_it_serves():
    scheduler = make_pool_core(DESKTOP, CPU).scheduler
    for path in ("/api/embed", "/api/embeddings"):
        routing = scheduler.routing("POST", path, "batch", MODEL)
        assert routing.eligible == ("desktop", "cpu") and routing.translated == {"cpu"}
        assert routing.kind == "embedding"
    # OpenAI's route is the OpenAI-compatible member's own: nothing to translate.
    native = scheduler.routing("POST", "/v1/embeddings", "batch", MODEL)
    assert native.eligible == ("desktop", "cpu") and native.translated == frozenset()
    # Never chat or generation in a dialect it does not speak, even for a model it serves.
    assert scheduler.routing("POST", "/api/chat", "interactive", MODEL).eligible == ("desktop",)
    assert scheduler.routing("POST", "/api/generate", "interactive", MODEL).eligible == ("desktop",)
    # Never a model it does not serve.
    assert scheduler.routing("POST", "/api/embed", "batch", "llama3.2").eligible == ("desktop",)
    # Never a body that cannot be translated faithfully (token ids, truncate: false).
    untranslatable = scheduler.routing("POST", "/api/embed", "batch", MODEL, translatable=False)
    assert untranslatable.eligible == ("desktop",) and untranslatable.translated == frozenset()
    # Never a passthrough (a GET on an embedding path runs no model).
    assert not Eligibility.translates("GET", "/api/embed", "batch")


def test_a_translated_member_needs_a_known_model_and_its_class():
    # A member that discovers its models and has no list yet serves no model known to it: no translation.
    scheduler = make_pool_core(DESKTOP, {**CPU, "models": ()}).scheduler
    assert scheduler.routing("POST", "/api/embed", "batch", MODEL).eligible == ("desktop",)
    # One that may not serve batch requests.
    scheduler = make_pool_core(DESKTOP, {**CPU, "classes": ("interactive",)}).scheduler
    assert scheduler.routing("POST", "/api/embed", "batch", MODEL).eligible == ("desktop",)
    # A model_map names a model it serves.
    scheduler = make_pool_core(DESKTOP, {**CPU, "models": (), "model_map": {MODEL: "minilm-cpu"}}).scheduler
    assert scheduler.routing("POST", "/api/embed", "batch", MODEL).translated == {"cpu"}


def test_a_pool_without_an_ollama_member_serves_ollama_clients_translated():
    scheduler = make_pool_core(
        {"name": "tei", "api": "tei", "models": (MODEL,)}, {"name": "inf", "api": "infinity", "models": (MODEL,)}
    ).scheduler
    routing = scheduler.routing("POST", "/api/embed", "batch", MODEL)
    assert routing.eligible == ("tei", "inf") and routing.translated == {"tei", "inf"}
    # A model neither serves: the route's own members (none knows it: all), untranslated, to answer in their words.
    assert scheduler.routing("POST", "/api/embed", "batch", "mistral").translated == frozenset()



def test_a_pool_of_one_routes_by_the_same_rule_as_a_pool_of_several():
    """No shortcut for a lone member: it is eligible by its api, its classes and its models as in any pool."""
    alone = make_pool_core({"name": "tei", "api": "tei", "models": (MODEL,)}).scheduler
    routing = alone.routing("POST", "/api/embed", "batch", MODEL)
    assert routing.eligible == ("tei",) and routing.translated == {"tei"}
    # A class its entry leaves out: no member may serve it (a refusal naming upstreams.*.classes).
    chat_only = make_pool_core({"name": "gpu", "classes": ("interactive",)}).scheduler
    assert chat_only.routing("POST", "/api/embed", "batch", MODEL).eligible == ()
    assert chat_only.routing("POST", "/api/chat", "interactive", "llama3.2").eligible == ("gpu",)

# -- the reference and the twin check -------------------------------------------------------------


@attrs.define(eq=False)
class FakeControl:
    """A member's control client answering embed calls in its own shape with the vectors of ``weights``."""

    clock: Clock
    shape: str
    weights: str | None = None
    calls: list = attrs.Factory(list)

    def request(self, method, path, body=None, timeout=10.0, max_body=0):
        self.calls.append((method, path, body))
        model = self.weights or body["model"]
        vectors = [expected_embedding(text, model) for text in body["input"]]
        if self.shape == "ollama":
            answer = {"model": body["model"], "embeddings": vectors}
        else:
            answer = {"object": "list", "data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
        d: Deferred = Deferred()
        d.callback(Answer(200, json.dumps(answer).encode()))
        return d


@attrs.define(eq=False)
class Rig:
    core: Core
    verifier: TwinVerifier
    controls: dict

    @property
    def scheduler(self):
        return self.core.scheduler

    def run(self, seconds: float = 0.0) -> None:
        advance_through(self.core.clock, seconds)

    def admit(self, path="/api/embed", cls="batch", model=MODEL) -> tuple[Entry, Deferred]:
        entry = Entry(cls=cls, routing=self.scheduler.routing("POST", path, cls, model))
        d = self.core.scheduler.admit(entry)
        d.addErrback(lambda f: None)
        self.run()
        return entry, d

    def stop(self) -> None:
        self.verifier.stopService()
        self.scheduler.stop()
        self.run()


def rig(*members, weights: dict | None = None) -> Rig:
    config = pool_config(
        *members,
        config=config_with(verification={"models": (MODEL,), "probe_texts": ("hello", "東京")}, upstream={"detect_outages": False}),
    )
    clock = Clock()
    controls = {
        m["name"]: FakeControl(clock, "ollama" if m.get("api", "ollama") == "ollama" else "openai",
                               (weights or {}).get(m["name"]))
        for m in members
    }
    metrics = Metrics()
    heart = build_heart(
        clock, config, metrics, clock_cooperator(clock), clients=lambda spec: (None, controls[spec.name]), twins=True,
    )
    core = Core(clock, metrics, heart.state, heart.lot, heart.scheduler.drainer(None), heart.scheduler)
    verifier = heart.twins
    verifier.startService()
    r = Rig(core, verifier, controls)
    r.run()
    return r


def test_a_translated_member_is_never_the_reference_while_an_ollama_member_serves_the_model():
    # The CPU copy first in config order: still the desktop's Ollama is the yardstick.
    r = rig(CPU, DESKTOP)
    assert r.verifier.status("desktop")[MODEL]["state"] == "reference"
    assert r.verifier.status("cpu")[MODEL] == {**r.verifier.status("cpu")[MODEL], "state": "verified", "reference": "desktop"}
    # The CPU copy was asked on its own route, in its own shape.
    assert r.controls["cpu"].calls[0][:2] == ("POST", "/v1/embeddings")
    r.stop()
    # No Ollama member serves it: the first member serving it is the reference, as ever.
    r = rig({"name": "tei", "api": "tei", "models": (MODEL,)}, CPU)
    assert r.verifier.status("tei")[MODEL]["state"] == "reference"
    assert r.verifier.status("cpu")[MODEL]["state"] == "verified"
    r.stop()


def test_a_verified_translated_member_takes_embeddings_at_once_while_the_desktop_is_yielded():
    r = rig(DESKTOP, CPU)
    assert r.verifier.status("cpu")[MODEL]["state"] == "verified"
    # Desktop available: the standby CPU copy takes nothing.
    entry, d = r.admit()
    assert entry.released_to == "desktop"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="desktop")
    r.core.state.hold("api", "game", scope="desktop")
    for path in ("/api/embed", "/api/embeddings"):
        entry, d = r.admit(path)
        assert entry.released_to == "cpu" and d.called
        r.core.scheduler.finished(failed=False, seconds=0.01, member="cpu")
    # Chat for the same model waits for the desktop.
    chat, parked = r.admit("/api/chat", "interactive")
    assert not parked.called and len(r.core.lot) == 1
    r.core.state.release("api", scope="desktop")
    r.run()
    assert chat.released_to == "desktop"
    r.stop()


def test_an_unverified_translated_member_never_takes_an_embedding():
    r = rig(DESKTOP, CPU, weights={"cpu": "nomic-embed-text"})
    assert r.verifier.status("cpu")[MODEL]["state"] == "mismatch"
    r.core.state.hold("api", "game", scope="desktop")
    entry, parked = r.admit()
    r.run(60)
    assert not parked.called and entry.released_to is None and len(r.core.lot) == 1
    r.core.state.release("api", scope="desktop")
    r.run()
    assert entry.released_to == "desktop"
    r.stop()


# -- the translated attempt (upstream/translated_attempt.py) ------------------------------------------------------


@attrs.define(eq=False)
class FakeUpstream:
    """An :class:`~yieldproxy.upstream.attempt.Upstream` whose client records each request and lets the test answer it."""

    url: str = "http://cpu:7997"
    sent: list = attrs.Factory(list)

    @property
    def client(self):
        return self

    def target(self, path: bytes) -> bytes:
        return path

    def request(self, method, target, headers, body, handler, replayable=None):
        d: Deferred = Deferred()
        self.sent.append((method, target, json.loads(body), handler, d))
        return d

    def answer(self, code: int, body: bytes, phrase: bytes = b"X") -> None:
        _, _, _, handler, d = self.sent[-1]
        response = attrs.make_class("Response", {"code": attrs.field(), "phrase": attrs.field()})(code, phrase)
        handler.response_started(response)
        handler.body_received(body)
        d.callback(response)


def translated_attempt(route="/api/embed", api="openai", **body):
    from twisted.web.test.requesthelper import DummyRequest

    from yieldproxy.servers import server
    from yieldproxy.upstream.translated_attempt import TranslatedAttempt
    from yieldproxy.upstream.translation import parse_request

    clock, upstream, request = Clock(), FakeUpstream(), DummyRequest([b""])
    wanted = parse_request(route, json.dumps({"model": MODEL, "input": ["a", "b"], "prompt": "a", **body}).encode())
    attempt = TranslatedAttempt(
        clock, upstream, server(api), request, wanted, "minilm-cpu", "ollama", 30.0,
        [(b"x-yield-parked-seconds", b"1.500")], member="cpu",
    )
    outcome: list = []
    attempt.run().addBoth(outcome.append)
    return clock, upstream, request, outcome


def test_a_translated_attempt_sends_the_members_shape_and_name_and_answers_in_the_callers():
    clock, upstream, request, outcome = translated_attempt(api="infinity")
    method, target, body, _, _ = upstream.sent[0]
    assert (method, target) == (b"POST", b"/embeddings")
    assert body == {"model": "minilm-cpu", "input": ["a", "b"], "encoding_format": "float"}
    vectors = [[3.0, 4.0], [0.0, 2.0]]
    upstream.answer(200, json.dumps({"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}).encode())
    assert outcome == [200]
    answer = json.loads(b"".join(request.written))
    assert answer["model"] == MODEL and answer["embeddings"] == [[0.6, 0.8], [0.0, 1.0]]
    assert request.responseHeaders.getRawHeaders(b"x-yield-parked-seconds") == [b"1.500"]
    assert upstream.sent[0][3].translated_by == "cpu"  # the attempt: the request log names its member


def test_a_translated_attempts_failures_are_retryable_with_the_callers_error_shape():
    from yieldproxy.upstream.attempt import RetryableFailure

    # A 503 (busy, in an OpenAI-compatible server's words): retryable, and the answer kept for the
    # caller is in Ollama's shape.
    _, upstream, request, outcome = translated_attempt()
    upstream.answer(503, json.dumps({"error": {"message": "loading", "type": "x", "code": 503}}).encode())
    failure = outcome[0].value
    assert isinstance(failure, RetryableFailure) and failure.reason == "busy"
    assert json.loads(failure.answer.body) == {"error": "loading"} and request.written == []
    # An answer that cannot be read: retryable as bad_answer, nothing written.
    _, upstream, request, outcome = translated_attempt()
    upstream.answer(200, b'{"data": [{"index": 0, "embedding": [1.0]}]}')
    assert outcome[0].value.reason == "bad_answer" and request.written == []
    # No whole answer within the attempt timeout.
    clock, upstream, request, outcome = translated_attempt()
    clock.advance(30.0)
    assert outcome[0].value.reason == "timeout"
    # A 5xx in words nobody listed: retryable as unknown_error (the proxy relays it unless a hold
    # or a failing probe explains it), the answer in the caller's shape.
    _, upstream, request, outcome = translated_attempt()
    upstream.answer(500, json.dumps({"error": {"message": "odd", "type": "x", "code": 500}}).encode())
    failure = outcome[0].value
    assert failure.reason == "unknown_error" and json.loads(failure.answer.body) == {"error": "odd"}
    assert request.written == []
    # Any other error: relayed at once, status kept, in the caller's shape.
    _, upstream, request, outcome = translated_attempt()
    upstream.answer(400, json.dumps({"error": {"message": "input too long", "type": "x", "code": 400}}).encode())
    assert outcome == [400] and request.responseCode == 400
    assert json.loads(b"".join(request.written)) == {"error": "input too long"}


def test_a_translated_answer_is_judged_in_the_members_own_words():
    """llama.cpp's 503 "Loading model" reads as not ready from its own body, not the caller's rewrite of it."""
    from yieldproxy.servers import NOT_READY, server

    loading = json.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}).encode()
    _, upstream, request, outcome = translated_attempt(api="llamacpp")
    upstream.answer(503, loading)
    failure = outcome[0].value
    assert json.loads(failure.answer.body) == {"error": "Loading model"}
    assert failure.words == server("llamacpp").judge(503, loading) == NOT_READY


def test_the_legacy_route_goes_to_the_members_route_as_one_input():
    _, upstream, request, outcome = translated_attempt("/api/embeddings", api="tei")
    method, target, body, _, _ = upstream.sent[0]
    assert target == b"/v1/embeddings" and body["input"] == ["a"]
    upstream.answer(200, json.dumps({"data": [{"index": 0, "embedding": [3.0, 4.0]}]}).encode())
    # Ollama's legacy route is not normalised: the vector as the member gave it.
    assert json.loads(b"".join(request.written)) == {"embedding": [3.0, 4.0]}


def test_a_failed_translated_attempt_is_probed_on_the_members_own_route_and_name():
    """The outage probe after a failure tests the call that failed: the member's embedding route, its model name."""
    from twisted.internet.testing import MemoryReactorClock

    from yieldproxy.proxy.calls import failed_call_on
    from yieldproxy.proxy.target import parse_target
    from yieldproxy.servers import ModelCall
    from yieldproxy.service import build

    config = pool_config(DESKTOP, {**CPU, "api": "infinity", "model_map": {MODEL: "minilm-cpu"}})
    proxy = build(MemoryReactorClock(), config)
    scheduler = proxy.scheduler
    body = json.dumps({"model": MODEL, "input": ["a"]}).encode()
    entry = Entry(cls="batch", routing=scheduler.routing("POST", "/api/embed", "batch", MODEL))
    target = parse_target(b"/api/embed")
    assert failed_call_on(target, entry, body, scheduler.member("cpu")) == ModelCall("/embeddings", "minilm-cpu")
    assert failed_call_on(target, entry, body, scheduler.member("desktop")) == ModelCall("/api/embed", MODEL)
