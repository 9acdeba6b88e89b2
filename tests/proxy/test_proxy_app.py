"""The proxy app driven in memory: ``StubTreq`` in front, the simulated Ollama behind, one Clock.

``build(clock, config, upstream=MemoryUpstream(...))`` wires the proxy as
the service does; ``StubTreq`` sends requests through a real Site and Agent
in memory, so no socket is opened and time moves only when the test moves
it.  Behaviour that is about the wire (slow clients, resets, the HTTP
parser's limits) stays in the real-socket tests.
"""

from __future__ import annotations

import json

from treq.testing import StubTreq
from twisted.internet.task import Clock

from helpers import config_with
from inmemory import MemoryUpstream
from yieldproxy.service import build
from yieldproxy.tools.sim import SimOllama, expected_embedding

MODEL = "all-minilm"


class Rig:
    """One proxy on a Clock, its upstream the sim's resource."""

    def __init__(self, config=None):
        self.clock = Clock()
        self.sim = SimOllama(self.clock)
        self.upstream = MemoryUpstream(self.sim.resource(), self.clock)
        self.proxy = build(self.clock, config or config_with(), upstream=self.upstream)
        self.http = StubTreq(self.proxy.proxy_app.resource())

    def post(self, path: str, body, headers=None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        d = self.http.post("http://127.0.0.1" + path, data=data, headers=headers)
        self.turn()
        return d

    def turn(self) -> None:
        """Run what is due: the in-memory connections, then the clock's zero-delay calls."""
        for _ in range(4):
            self.http.flush()
            self.upstream.flush()
            self.clock.advance(0)

    def answer(self, d) -> tuple[int, dict, object]:
        results = []
        d.addBoth(results.append)
        assert results, "no answer yet"
        response = results[0]
        content = []
        response.content().addBoth(content.append)
        self.turn()
        headers = {k.decode().lower(): v[0].decode() for k, v in response.headers.getAllRawHeaders()}
        return response.code, headers, json.loads(content[0])

    def sample(self, name: str, **labels) -> float:
        return self.proxy.metrics.registry.get_sample_value(name, labels) or 0.0


def answered(d) -> bool:
    """True once ``d`` has its result (``called`` is also true while it waits on another Deferred)."""
    results = []
    d.addBoth(lambda r: results.append(r) or r)
    return bool(results)


def test_a_parked_request_is_replayed_when_the_gpu_comes_back():
    rig = Rig()
    rig.proxy.state.hold("api", "game")
    d = rig.post("/api/embed", {"model": MODEL, "input": ["parked"]})
    rig.clock.advance(3)
    rig.turn()
    assert not answered(d) and len(rig.proxy.lot) == 1
    assert rig.sim.texts_embedded == {}
    rig.proxy.state.release("api")
    rig.turn()
    code, headers, body = rig.answer(d)
    assert code == 200
    assert float(headers["x-yield-parked-seconds"]) == 3.0
    assert body["embeddings"][0] == expected_embedding("parked", MODEL)
    assert rig.sim.texts_embedded == {"parked": 1}
    assert rig.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 1
    assert len(rig.proxy.lot) == 0 and rig.proxy.replayer.inflight == 0
    assert rig.clock.getDelayedCalls() == []


def test_a_body_over_max_body_bytes_gets_413_in_its_apis_shape():
    rig = Rig(config_with(proxy={"max_body_bytes": 100}))
    big = {"model": MODEL, "input": ["x" * 200]}
    code, _, body = rig.answer(rig.post("/api/embed", big))
    assert code == 413 and "proxy.max_body_bytes (100 bytes)" in body["error"]
    code, _, body = rig.answer(rig.post("/v1/embeddings", big))
    assert code == 413
    assert body["error"]["code"] == "too_large" and body["error"]["type"] == "invalid_request_error"
    assert rig.sim.texts_embedded == {}
    assert rig.sample("yieldproxy_rejected_total", **{"class": "passthrough", "reason": "too_large"}) == 2
    assert rig.sample("yieldproxy_requests_total", **{"class": "passthrough", "code": "413"}) == 2


def test_a_bad_request_gets_400_in_each_apis_shape():
    rig = Rig()
    bad_wait = {b"X-Yield-Max-Wait": [b"soon"]}
    code, _, body = rig.answer(rig.post("/api/chat", {"model": "m", "messages": []}, bad_wait))
    assert code == 400 and body == {"error": "X-Yield-Max-Wait must be a number of seconds >= 0"}
    code, _, body = rig.answer(rig.post("/v1/chat/completions", {"model": "m", "messages": []}, bad_wait))
    assert code == 400 and body == {
        "error": {
            "message": "X-Yield-Max-Wait must be a number of seconds >= 0",
            "type": "invalid_request_error",
            "code": "bad_request",
        }
    }
    bad_class = {b"X-Yield-Class": [b"urgent"]}
    code, _, body = rig.answer(rig.post("/api/embed", {"model": MODEL, "input": "x"}, bad_class))
    assert code == 400 and body == {"error": "X-Yield-Class must be interactive, batch or long"}
    code, _, body = rig.answer(rig.post("/v1/embeddings", {"model": MODEL, "input": "x"}, bad_class))
    assert code == 400 and body["error"]["code"] == "bad_request"
    assert rig.sample("yieldproxy_rejected_total", **{"class": "passthrough", "reason": "bad_request"}) == 4
    assert rig.sim.texts_embedded == {} and rig.clock.getDelayedCalls() == []
