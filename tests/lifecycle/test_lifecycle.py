"""The proxy's service on a Clock: what starts in which order, and the graceful stop.

``MemoryReactorClock`` gives the listeners something to listen on and the
timers a clock the test moves; the upstream is the simulated Ollama's
resource in memory, so a request in flight is one the sim holds for its
latency, on the same clock.  The real-socket versions (twistd and SIGTERM)
are in ``test_twistd.py`` and ``test_chaos.py``.
"""

from __future__ import annotations

import json

from treq.testing import StubTreq
from twisted.application.service import Service
from twisted.internet.defer import Deferred, fail
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel, capturedLogs

from helpers import config_with
from inmemory import MemoryUpstream
from yieldproxy.service import YieldProxyService, build
from yieldproxy.tools.sim import SimOllama

MODEL = "all-minilm"


class Rig:
    def __init__(self, latency: float = 2.0, **sections):
        self.reactor = MemoryReactorClock()
        self.sim = SimOllama(self.reactor, latency=latency)
        sections.setdefault("upstream", {})["detect_outages"] = False
        config = config_with(
            proxy={"listen": "tcp:11435", **sections.pop("proxy", {})}, admin={"listen": "tcp:11436"}, **sections
        )
        self.upstream = MemoryUpstream(self.sim.resource(), self.reactor)
        self.proxy = build(self.reactor, config, upstream=self.upstream)
        self.http = StubTreq(self.proxy.proxy_app.resource())
        self.service = self.proxy.service

    def embed(self, text: str) -> list:
        """POST one embedding; the list gets the response code once it is answered."""
        codes: list = []
        d = self.http.post(
            "http://127.0.0.1/api/embed", data=json.dumps({"model": MODEL, "input": [text]}).encode()
        )
        d.addCallback(lambda response: codes.append(response.code))
        self.turn()
        return codes

    def turn(self, seconds: float = 0.0) -> None:
        """Run what is due: both in-memory hops, then the clock's zero-delay calls."""
        for _ in range(4):
            self.http.flush()
            self.upstream.flush()
            self.reactor.advance(0)
        if seconds:
            self.reactor.advance(seconds)
            self.turn()

    def listening(self, name: str) -> bool:
        return self.service.getServiceNamed(name).port is not None


def stopped(d: Deferred) -> bool:
    done: list = []
    d.addBoth(lambda r: done.append(r) or r)
    return bool(done)


def test_parts_start_in_order_and_stop_in_the_reverse_order():
    fallback = {"enabled": True, "url": "http://127.0.0.1:9/v1", "models": {MODEL: MODEL}}
    rig = Rig(handover={"unload_on_yield": True}, watchers={"signals": True}, fallback=fallback)
    names = [child.name for child in rig.service]
    assert names == [
        "admin", "clients", "fallback", "history", "served-record", "drain", "watcher:signal", "handover", "proxy",
    ]
    rig.service.startService()
    assert [port for port, *_ in rig.reactor.tcpServers] == [11436, 11435]  # the admin listener binds first
    stops = []
    for child in rig.service:
        original = child.stopService
        child.stopService = lambda original=original, name=child.name: (stops.append(name), original())[1]
    done = rig.service.stopService()
    rig.turn()
    assert stopped(done) and stops == names[::-1]
    assert rig.reactor.getDelayedCalls() == []


def test_the_stop_waits_for_a_request_in_flight_on_its_answer_not_a_poll():
    rig = Rig(latency=2.0)
    rig.service.startService()
    codes = rig.embed("in flight")
    assert rig.proxy.replayer.inflight == 1
    done = rig.service.stopService()
    rig.turn()
    # The proxy listener is closed, the admin listener still answers, and nothing polls:
    # the only timers are the history's next sample, the sim's answer, the drain's bound and
    # the attempt's one timer, first set for the stall timeout (60 s), before its timeout (120 s).
    assert not stopped(done)
    assert not rig.listening("proxy") and rig.listening("admin")
    assert sorted(round(c.getTime(), 3) for c in rig.reactor.getDelayedCalls()) == [1.0, 2.0, 30.0, 60.0]
    # A new request is refused while the drain waits.
    assert rig.embed("too late") == [503]
    rig.turn(2.0)
    assert codes == [200] and stopped(done)
    assert not rig.listening("admin")
    assert rig.reactor.getDelayedCalls() == []


def test_a_yielded_gpu_stays_yielded_and_its_parked_requests_get_503_at_once():
    rig = Rig()
    rig.service.startService()
    rig.proxy.state.hold("api", "game")
    codes = [rig.embed(f"parked {i}") for i in range(3)]
    assert len(rig.proxy.lot) == 3
    done = rig.service.stopService()
    rig.turn()
    assert stopped(done)
    assert [c for code in codes for c in code] == [503, 503, 503]
    assert rig.proxy.state.yielded and rig.sim.texts_embedded == {}
    assert rig.reactor.getDelayedCalls() == []


def test_the_drain_is_bounded_by_the_shutdown_timeout():
    rig = Rig(latency=100.0, proxy={"shutdown_timeout_seconds": 5.0}, replay={"concurrency": 1})
    rig.service.startService()
    rig.proxy.state.hold("api", "game")
    flying, parked = rig.embed("flying"), rig.embed("parked")
    rig.proxy.state.release("api")
    rig.turn()
    # The first went to the only replay slot; the second waits for it.
    assert rig.proxy.replayer.inflight == 1 and len(rig.proxy.lot) == 1
    with capturedLogs() as events:
        done = rig.service.stopService()
        rig.turn(4.9)
        assert not stopped(done) and parked == []
        rig.turn(0.1)
    assert stopped(done) and parked == [503] and flying == []
    warnings = [e for e in events if e["log_level"] == LogLevel.warn and "shutdown" in e.get("log_format", "")]
    assert len(warnings) == 1 and warnings[0]["inflight"] == 1 and warnings[0]["left"] == 1


class _Named(Service):
    def __init__(self, name: str, stops: list, failing: bool = False):
        self.name, self._stops, self._failing = name, stops, failing

    def stopService(self):
        super().stopService()
        self._stops.append(self.name)
        return fail(RuntimeError("cannot stop")) if self._failing else None


def test_a_child_that_fails_to_stop_is_logged_and_the_others_still_stop():
    stops: list = []
    service = YieldProxyService([_Named("first", stops), _Named("broken", stops, failing=True), _Named("last", stops)])
    service.startService()
    with capturedLogs() as events:
        done = service.stopService()
    assert stopped(done) and stops == ["last", "broken", "first"]
    [failure] = [e for e in events if "log_failure" in e]
    assert failure["name"] == "broken" and failure["log_failure"].check(RuntimeError)


def test_in_a_pool_a_request_only_a_held_upstream_may_serve_gets_503_at_once_and_no_lease_outlives_the_stop():
    """A restart during one upstream's game does not wait out the drain's timeout for requests
    that upstream alone could serve; the others' requests are not refused; no hold lease is left."""
    from helpers import pool_config

    reactor = MemoryReactorClock()
    sim = SimOllama(reactor, latency=2.0)
    upstream = MemoryUpstream(sim.resource(), reactor)
    config = pool_config(
        {"name": "a", "models": (MODEL,)}, {"name": "b", "models": ("other-model",)},
        config=config_with(
            proxy={"listen": "tcp:11435"}, admin={"listen": "tcp:11436"}, upstream={"detect_outages": False},
        ),
    )
    proxy = build(reactor, config, upstream=upstream)
    http = StubTreq(proxy.proxy_app.resource())
    proxy.service.startService()
    proxy.state.hold("api", "game", scope="a", for_seconds=3600)
    codes: list = []
    d = http.post("http://127.0.0.1/api/embed", data=json.dumps({"model": MODEL, "input": ["x"]}).encode())
    d.addCallback(lambda response: codes.append(response.code))
    for _ in range(4):
        http.flush()
        reactor.advance(0)
    assert len(proxy.lot) == 1 and codes == []
    done = proxy.service.stopService()
    for _ in range(4):
        http.flush()
        upstream.flush()
        reactor.advance(0)
    assert codes == [503] and stopped(done)
    assert reactor.getDelayedCalls() == []
