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
from yieldproxy.control import Answer
from yieldproxy.metrics import Metrics
from yieldproxy.service import build_heart
from yieldproxy.sim import expected_embedding

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


def test_a_prefixed_infinity_with_its_models_given_is_verified_under_its_prefix_and_keeps_it():
    config = pool_config(
        {"name": "gpu", "models": (MODEL,)},
        {"name": "cpu", "api": "infinity", "models": (MODEL,)},
        config=config_with(
            verification={"models": (MODEL,), "probe_texts": ("hello", "two words")},
            upstream={"detect_outages": False},
        ),
    )
    clock = Clock()
    infinity = PrefixedInfinity()
    controls = {"gpu": FakeControl(clock, "gpu"), "cpu": infinity}
    heart = build_heart(
        clock, config, Metrics(), clock_cooperator(clock), clients=lambda spec: (None, controls[spec.name]), twins=True,
    )
    verifier = heart.twins
    verifier.startService()
    advance_through(clock, 0)
    assert verifier.status("cpu")[MODEL]["state"] == "verified", verifier.status("cpu")
    assert infinity.calls == [("POST", "/embeddings"), ("POST", "/v1/embeddings")]
    cpu = heart.pool.member("cpu")
    assert cpu.server.embed_path == "/v1/embeddings" and cpu.server.models_path == "/v1/models"
    # The next verification goes straight under the prefix.
    advance_through(clock, config.verification.verify_interval_seconds)
    assert infinity.calls[2:] == [("POST", "/v1/embeddings")]
    assert verifier.status("cpu")[MODEL]["state"] == "verified"
    verifier.stopService()
    heart.pool.stop()
    advance_through(clock, 0)
    assert clock.getDelayedCalls() == []
