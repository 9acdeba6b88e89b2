"""A member under an API prefix (Infinity's ``--url-prefix /v1``) is verified under it (issue 20), on a Clock.

Infinity's routes move under its prefix, so its embeddings are at
``/v1/embeddings`` there and ``/embeddings`` gets a 404.  A member listed at
its root with its ``models`` given has no model list read to find the prefix
first: the verification's call answered 404 tries the other prefix, keeps
it, and every later call (verification, translated embeddings) goes there.
``tests/test_llamacpp_real.py`` proves the same with a real prefixed Infinity.
"""

from __future__ import annotations

import json

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from helpers import advance_through, clock_cooperator, config_with, pool_config
from test_pool_twins import FakeControl
from yieldproxy.observe.metrics import Metrics
from yieldproxy.service import build_heart
from yieldproxy.tools.sim import expected_embedding
from yieldproxy.upstream.control import Answer

MODEL = "all-minilm"


@attrs.define(eq=False)
class PrefixedInfinity:
    """Infinity started with ``--url-prefix /v1``: OpenAI's embeddings at ``/v1/embeddings``, 404 elsewhere."""

    calls: list = attrs.Factory(list)

    def request(self, method, path, body=None, timeout=10.0, max_body=0) -> Deferred:
        self.calls.append((method, path))
        if (method, path) != ("POST", "/v1/embeddings"):
            return succeed(Answer(404, b'{"detail":"Not Found"}'))
        data = [
            {"object": "embedding", "index": i, "embedding": expected_embedding(text, MODEL)}
            for i, text in enumerate(body["input"])
        ]
        return succeed(Answer(200, json.dumps({"object": "list", "data": data, "model": MODEL}).encode()))


def prefixed_heart(clock, infinity):
    """An Ollama "gpu" and the prefixed Infinity "cpu" at its root, both given the model, verified twins."""
    config = pool_config(
        {"name": "gpu", "models": (MODEL,)},
        {"name": "cpu", "api": "infinity", "models": (MODEL,)},
        config=config_with(
            verification={"models": (MODEL,), "probe_texts": ("hello", "two words")},
            upstream={"detect_outages": False},
        ),
    )
    controls = {"gpu": FakeControl(clock, "gpu"), "cpu": infinity}
    heart = build_heart(
        clock, config, Metrics(), clock_cooperator(clock), clients=lambda spec: (None, controls[spec.name]), twins=True,
    )
    return config, heart


def test_a_prefixed_infinity_with_its_models_given_is_verified_under_its_prefix_and_keeps_it():
    clock = Clock()
    infinity = PrefixedInfinity()
    config, heart = prefixed_heart(clock, infinity)
    verifier = heart.twins
    verifier.startService()
    advance_through(clock, 0)
    assert verifier.status("cpu")[MODEL]["state"] == "verified", verifier.status("cpu")
    assert infinity.calls == [("POST", "/embeddings"), ("POST", "/v1/embeddings")]
    cpu = heart.scheduler.member("cpu")
    assert cpu.server.embed_path == "/v1/embeddings" and cpu.server.models_path == "/v1/models"
    # The next verification goes straight under the prefix.
    advance_through(clock, config.verification.verify_interval_seconds)
    assert infinity.calls[2:] == [("POST", "/v1/embeddings")]
    assert verifier.status("cpu")[MODEL]["state"] == "verified"
    verifier.stopService()
    heart.scheduler.stop()
    advance_through(clock, 0)
    assert clock.getDelayedCalls() == []


@attrs.define(eq=False)
class HeldInfinity(PrefixedInfinity):
    """A prefixed Infinity whose first answer the test gives when it likes."""

    held: list = attrs.Factory(list)

    def request(self, method, path, body=None, timeout=10.0, max_body=0) -> Deferred:
        if not self.held:
            self.calls.append((method, path))
            d: Deferred = Deferred()
            self.held.append(d)
            return d
        return super().request(method, path, body, timeout, max_body)


def test_no_verification_call_under_another_prefix_reaches_a_member_yielded_while_its_404_was_out():
    clock = Clock()
    infinity = HeldInfinity()
    config, heart = prefixed_heart(clock, infinity)
    verifier = heart.twins
    verifier.startService()
    advance_through(clock, 0)
    assert infinity.calls == [("POST", "/embeddings")]
    heart.state.hold("api", "game", scope="cpu")
    infinity.held[0].callback(Answer(404, b'{"detail":"Not Found"}'))
    advance_through(clock, 60)
    assert infinity.calls == [("POST", "/embeddings")], "a call went to the yielded member"
    assert verifier.status("cpu")[MODEL]["state"] == "unverified"
    # Back: the pair is verified under the prefix, which the member keeps.
    heart.state.release("api", "cpu")
    advance_through(clock, 10)
    assert infinity.calls[1:] == [("POST", "/embeddings"), ("POST", "/v1/embeddings")]
    assert verifier.status("cpu")[MODEL]["state"] == "verified"
    verifier.stopService()
    heart.scheduler.stop()
    advance_through(clock, 0)
    assert clock.getDelayedCalls() == []


def test_a_translated_request_answered_404_before_the_prefix_is_known_is_asked_once_under_the_other():
    """The first milliseconds after start, before the model-list reader found Infinity's ``/v1``: the
    caller's translated request gets its vectors, not the wrong path's 404; once the prefix is known a
    404 is the server's own word, relayed with no second call."""
    from twisted.web.test.requesthelper import DummyRequest

    from test_pool_translated import FakeUpstream
    from yieldproxy.upstream.translated_attempt import TranslatedAttempt
    from yieldproxy.upstream.translation import parse_request

    clock = Clock()
    _, heart = prefixed_heart(clock, PrefixedInfinity())
    cpu = heart.scheduler.member("cpu")

    def attempt():
        upstream, request = FakeUpstream(), DummyRequest([b""])
        wanted = parse_request("/api/embed", json.dumps({"model": MODEL, "input": ["a"]}).encode())
        outcome: list = []
        TranslatedAttempt(
            clock, upstream, cpu.server, request, wanted, MODEL, "ollama", 30.0, member="cpu", prefixed=cpu,
        ).run().addBoth(outcome.append)
        return upstream, request, outcome

    not_found = b'{"detail":"Not Found"}'
    upstream, request, outcome = attempt()
    clock.advance(10)
    upstream.answer(404, not_found)
    assert [sent[1] for sent in upstream.sent] == [b"/embeddings", b"/v1/embeddings"] and outcome == []
    clock.advance(19.9)
    upstream.answer(200, json.dumps({"data": [{"index": 0, "embedding": [3.0, 4.0]}]}).encode())
    assert outcome == [200] and json.loads(b"".join(request.written))["embeddings"] == [[0.6, 0.8]]
    assert cpu.server.embed_path == "/v1/embeddings"
    # Known now: a 404 there is the server's, relayed at once.
    upstream, request, outcome = attempt()
    upstream.answer(404, not_found)
    assert [sent[1] for sent in upstream.sent] == [b"/v1/embeddings"] and outcome == [404]
    # The retry is bounded by what is left of the attempt's timeout.
    _, heart = prefixed_heart(clock, PrefixedInfinity())
    cpu = heart.scheduler.member("cpu")
    upstream, request, outcome = attempt()
    clock.advance(10)
    upstream.answer(404, not_found)
    clock.advance(20)
    assert outcome[0].value.reason == "timeout" and len(upstream.sent) == 2
    # Both prefixes 404: the second 404 is relayed, and nothing is kept.
    upstream, request, outcome = attempt()
    upstream.answer(404, not_found)
    upstream.answer(404, not_found)
    assert outcome == [404] and len(upstream.sent) == 2 and cpu.server.embed_path == "/embeddings"
    heart.scheduler.stop()
    advance_through(clock, 0)
    assert clock.getDelayedCalls() == []
