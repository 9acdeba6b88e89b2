"""The per-request work made cheap (issue 11, performance), each piece with the behaviour it keeps.

Every request pays for what is done on its way, so what can be done once (a
connection's timers and addresses, a metric's children, a peer's address
kind, a route's class) is done once.  Each test checks the mechanism on a
``Clock`` (or a count of calls) and the behaviour around it.
"""

from __future__ import annotations

import json

import pytest
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, Logger, capturedLogs
from twisted.web.resource import Resource

from helpers import config_with
from inmemory import MemoryUpstream
from yieldproxy.config import RouteRule
from yieldproxy.edge import hosts
from yieldproxy.edge.h1client import H1Pool
from yieldproxy.edge.hosts import HostPolicy
from yieldproxy.edge.site import ProxySite
from yieldproxy.lot import classify
from yieldproxy.lot.classify import PASSTHROUGH, Classifier
from yieldproxy.observe.requestlog import log_request
from yieldproxy.proxy import attempts
from yieldproxy.service import build
from yieldproxy.tools.sim import SimOllama


class Counting:
    """Wraps ``clock.callLater`` (before anything captures it) to record what gets scheduled."""

    def __init__(self, clock: Clock):
        self.names: list[str] = []
        real = clock.callLater

        def call_later(delay, f, *args, **kwargs):
            self.names.append(getattr(f, "__name__", repr(f)))
            return real(delay, f, *args, **kwargs)

        clock.callLater = call_later

    def count(self, *names: str) -> int:
        return sum(self.names.count(name) for name in names)


# -- the listener: one read timer per connection, its addresses read once ------------------------


class Ok(Resource):
    isLeaf = True

    def render(self, request):
        request.too_large  # what the proxy app reads: ProxyRequest has it
        return b"ok"


def connect(site: ProxySite) -> tuple[object, StringTransport]:
    channel = site.buildProtocol(None)
    transport = StringTransport()
    lookups = []
    real_get_host = transport.getHost
    transport.getHost = lambda: lookups.append(1) or real_get_host()
    transport.host_lookups = lookups
    channel.makeConnection(transport)
    return channel, transport


def get(host: bytes = b"localhost") -> bytes:
    return b"GET /api/tags HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"


def test_a_keep_alive_connection_arms_one_read_timer_and_a_late_request_still_gets_its_408():
    clock = Clock()
    timers = Counting(clock)
    site = ProxySite(Ok(), 1000, request_read_timeout=30.0, timeout=300, reactor=clock)
    channel, transport = connect(site)
    for _ in range(5):
        channel.dataReceived(get())
        assert transport.value().count(b"200 OK") >= 1
    assert transport.value().count(b"HTTP/1.1 200 OK") == 5
    # One timer for the connection, not one per request (each used to arm and cancel its own).
    assert timers.count("_timer_fired") == 1
    # The local address is asked for once (a getsockname call each time on a socket).
    assert len(transport.host_lookups) == 1
    # A request that starts late has its own deadline, 30 s from its first byte.
    clock.advance(25)
    channel.dataReceived(b"GET /api/tags HTTP/1.1\r\n")
    clock.advance(29.9)
    assert b"408" not in transport.value()
    clock.advance(0.2)
    assert b"HTTP/1.1 408 " in transport.value() and b"not received in full within 30s" in transport.value()
    channel.connectionLost(None)
    assert clock.getDelayedCalls() == []


def test_a_host_that_passed_once_is_checked_again_when_it_changes_on_the_same_connection():
    clock = Clock()
    site = ProxySite(Ok(), 1000, timeout=300, reactor=clock, host_policy=HostPolicy("proxy.allowed_hosts"))
    channel, transport = connect(site)
    channel.dataReceived(get(b"localhost:11434") + get(b"localhost:11434"))
    assert transport.value().count(b"HTTP/1.1 200 OK") == 2
    channel.dataReceived(get(b"evil.example"))
    assert b"HTTP/1.1 403 Forbidden" in transport.value()
    assert b"is not a name of this listener" in transport.value()


# -- the upstream pool: one idle timer per pool ----------------------------------------------------


def test_idle_pooled_connections_share_one_timer():
    from test_h1client import Endpoint, ok

    clock = Clock()
    timers = Counting(clock)
    endpoint = Endpoint()
    pool = H1Pool(clock, "127.0.0.1", 11434, endpoint=endpoint, idle_timeout=5.0)
    for i in range(10):
        d = pool.request(b"GET", b"/%d" % i)
        endpoint.made[0][0].dataReceived(ok())
        assert d.called
        clock.advance(1)
    assert len(endpoint.made) == 1
    # One sweep timer, re-armed when it finds the connection was used since (not one per request).
    assert timers.count("_sweep", "_idle_expired") <= 3
    clock.advance(5)
    assert endpoint.made[0][1].disconnecting and pool.stats()["idle"] == 0
    assert clock.getDelayedCalls() == []


# -- the request log: no Logger.emit for the hot line ---------------------------------------------


def test_a_request_line_reaches_its_observer_without_logger_emit(monkeypatch):
    def no_emit(self, level, format=None, **kwargs):
        raise AssertionError("Logger.emit sorts the log levels on every call")

    monkeypatch.setattr(Logger, "emit", no_emit)

    class Request:
        path = b"/api/embed"
        method = b"POST"
        sentLength = 3

        def getClientAddress(self):
            return None

    events = []
    logger = Logger(namespace="yieldproxy.requestlog", observer=events.append)
    log_request(Request(), "batch", 502, "upstream_error", 0.0, 1, 0.0, Clock(), logger=logger)
    (event,) = events
    assert event["log_level"] == LogLevel.warn and event["log_namespace"] == "yieldproxy.requestlog"
    assert event["log_logger"] is logger and event["status"] == 502


# -- addresses and routes: worked out once -----------------------------------------------------------


def test_a_peer_address_is_parsed_once(monkeypatch):
    parsed = []
    real = classify.ip_address
    monkeypatch.setattr(classify, "ip_address", lambda text: parsed.append(text) or real(text))
    classify._is_loopback_address.cache_clear()
    assert all(classify.is_loopback("127.0.0.1") for _ in range(5))
    assert not any(classify.is_loopback("10.1.2.3") for _ in range(5))
    assert classify.is_loopback(None) and not classify.is_loopback("not-an-address")
    assert parsed == ["127.0.0.1", "10.1.2.3", "not-an-address"]


def test_a_host_address_is_parsed_once(monkeypatch):
    parsed = []
    real = hosts.ip_address
    monkeypatch.setattr(hosts, "ip_address", lambda text: parsed.append(text) or real(text))
    hosts._is_private_ip.cache_clear()
    policy = HostPolicy("proxy.allowed_hosts")
    for _ in range(5):
        assert policy.allows("192.168.1.9:11434") and not policy.allows("8.8.8.8")
        assert policy.allows("8.8.8.8", "8.8.8.8")  # the listener's own address
    assert parsed == ["192.168.1.9", "8.8.8.8"]


def test_routes_are_classified_once_and_model_rules_still_read_the_model():
    rules = (RouteRule(path="/api/embed", models=("nomic*",), cls="batch"),)
    classifier = Classifier.from_rules(rules)
    assert classifier.needs_model("POST", "/api/embed")
    assert classifier.classify("POST", "/api/embed", "nomic-embed-text") == "batch"
    assert classifier.classify("POST", "/api/embed", "other") == classifier.classify("POST", "/api/embed")
    assert classifier.classify("GET", "/api/tags") == PASSTHROUGH
    for i in range(classify._ROUTE_CACHE + 10):
        classifier.classify("GET", f"/random/{i}")
    assert len(classifier._routes) == classify._ROUTE_CACHE  # bounded: paths come from clients
    assert classifier.classify("GET", "/api/tags") == PASSTHROUGH


def test_whether_a_rule_names_a_route_is_decided_once_per_route(monkeypatch):
    """The refusal rule asks every request whether a ``[[routes]]`` rule names its route (``declares``): the answer
    is kept with the route's class, so the rules are matched once per route, not once per request."""
    rules = (RouteRule(path="/api/embed", models=("nomic*",), cls="batch"), RouteRule(path="/custom", cls="long"))
    classifier = Classifier.from_rules(rules)
    matched = []
    real = Classifier._matches
    monkeypatch.setattr(Classifier, "_matches", lambda self, *a: matched.append(a) or real(self, *a))
    for _ in range(3):
        assert classifier.declares("POST", "/custom") and classifier.declares("POST", "/api/embed")
        assert not classifier.declares("POST", "/api/chat")
    once = len(matched)
    for _ in range(3):
        classifier.declares("POST", "/custom"), classifier.declares("POST", "/api/chat")
    assert len(matched) == once


def test_a_body_is_parsed_once_though_the_upstream_s_refusal_rule_and_the_handler_both_read_it(monkeypatch):
    """Admission makes one parse of a request's body (gojson.FirstValue) and passes it along: the refusal rule's
    read (decode_error) and admission's own (find_model, read_request) of one request are one parse."""
    from inmemory import Rig as MemoryRig

    class Upstream(Resource):
        """Answers every embedding without reading its body (the simulated Ollama reads it too)."""

        isLeaf = True

        def render_POST(self, request):
            request.setHeader(b"content-type", b"application/json; charset=utf-8")
            return b'{"model":"all-minilm","embeddings":[[0.5]]}'

    rig = MemoryRig(upstream=Upstream())
    text = json.dumps({"model": "all-minilm", "input": ["x" * 500]})
    parsed = []
    real = json.JSONDecoder.raw_decode
    monkeypatch.setattr(
        json.JSONDecoder, "raw_decode", lambda self, s, idx=0: parsed.append(s == text) or real(self, s, idx)
    )
    for _ in range(2):
        answer = rig.result(rig.post("/api/embed", data=text.encode(), headers={"Content-Type": "application/json"}))
        assert answer.code == 200
    assert parsed.count(True) == 2


def test_a_target_is_read_once_and_a_bad_one_is_refused_every_time():
    from yieldproxy.proxy.target import BadTarget, parse_target

    parse_target.cache_clear()
    first = parse_target(b"/api/%65mbed?x=1")
    assert parse_target(b"/api/%65mbed?x=1") is first and first.path == "/api/embed"
    assert parse_target.cache_info().hits == 1
    for _ in range(2):
        with pytest.raises(BadTarget):
            parse_target(b"/api/embed#x")


# -- the proxy on a Clock: metric children, the in-flight gauge, no producer for a fast client -----


class Rig:
    """The proxy (``service.build``) on a Clock: StubTreq in front, the sim behind the proxy's own client in memory."""

    def __init__(self, latency: float = 0.0):
        self.clock = Clock()
        self.sim = SimOllama(self.clock, latency=latency)
        self.wire = MemoryUpstream(self.sim.resource(), self.clock)
        proxy = build(self.clock, config_with(), upstream=self.wire)
        self.metrics = proxy.metrics
        self.http = StubTreq(proxy.proxy_app.resource())

    def turn(self) -> None:
        for _ in range(6):
            self.http.flush()
            self.wire.flush()
            self.clock.advance(0)

    def embed(self, text: str):
        body = json.dumps({"model": "all-minilm", "input": text}).encode()
        d = self.http.post("http://proxy.invalid/api/embed", data=body)
        self.turn()
        return d

    def sample(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def test_metric_children_are_looked_up_once_and_the_inflight_gauge_is_read_when_scraped(monkeypatch):
    rig = Rig(latency=1.0)
    looked_up = []
    for name in ("requests_total", "upstream_seconds"):
        metric = getattr(rig.metrics, name)
        real = metric.labels
        monkeypatch.setattr(metric, "labels", lambda *labels, real=real, name=name: looked_up.append(name) or real(*labels))
    gauge = rig.metrics.inflight_requests
    monkeypatch.setattr(gauge, "set", lambda value: pytest.fail("the in-flight gauge is set on every request"))
    for i in range(3):
        d = rig.embed(f"text {i}")
        assert rig.sample("yieldproxy_inflight_requests") == 1  # held by the sim's latency
        rig.clock.advance(1.0)
        rig.turn()
        assert d.result.code == 200
        assert rig.sample("yieldproxy_inflight_requests") == 0
    assert sorted(looked_up) == ["requests_total", "upstream_seconds"]
    assert rig.sample("yieldproxy_requests_total", **{"class": "batch", "code": "200"}) == 3
    assert rig.sample("yieldproxy_upstream_seconds_count", **{"class": "batch"}) == 3
    assert rig.clock.getDelayedCalls() == []


def test_a_client_that_takes_its_answer_at_once_never_registers_a_producer(monkeypatch):
    from twisted.web.server import Request

    registered = []
    real = Request.registerProducer
    monkeypatch.setattr(Request, "registerProducer", lambda self, p, s: registered.append(p) or real(self, p, s))
    rig = Rig()
    d = rig.embed("fast")
    response = d.result
    assert response.code == 200
    body = rig.http.json_content(response)
    rig.turn()
    assert len(body.result["embeddings"][0]) == 384
    assert registered == []  # the attempt becomes the producer only once a client's transport is full
    assert rig.clock.getDelayedCalls() == []


# -- memory: what a parked request holds (issue 11: a flood of them during a long yield) --------------


def test_a_parked_request_holds_under_10_kb_of_the_proxy_and_is_answered_after_the_yield():
    """Each parked request's whole retained cost: channel, request, headers, body, handler, Entry.

    Measured with tracemalloc on the in-memory rig (the rig's own transports
    left out), with a 1 KB body.  Klein's per-request router state and a
    channel dict past CPython's 30 shared keys made it 13.2 KB; it is about
    7.3 KB since (bench/parked_memory.py measures the process's RSS).
    """
    import gc
    import tracemalloc

    from inmemory import Rig as MemoryRig

    rig = MemoryRig()
    body = json.dumps({"model": "all-minilm", "input": "x" * 950}).encode()
    raw = (
        b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    def park(count: int) -> list:
        peers = []
        for _ in range(count):
            peer = rig.raw()
            peer.send(raw)
            rig.turn()
            peers.append(peer)
        return peers

    for peer in park(5):  # the first requests build what later ones reuse
        assert peer.data.startswith(b"HTTP/1.1 200 ")
    rig.proxy.state.hold("test")
    peers = park(50)  # the lot's lists, heap and dicts grown
    count = 200
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        peers += park(count)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(rig.proxy.lot) == 250
    rig_only = [tracemalloc.Filter(False, pattern) for pattern in ("*/iosim.py", "*/inmemory.py", tracemalloc.__file__)]
    retained = sum(stat.size_diff for stat in after.filter_traces(rig_only).compare_to(
        before.filter_traces(rig_only), "filename"
    ))
    per_request = retained / count
    assert 3000 < per_request < 10 * 1024, per_request
    rig.proxy.state.release("test")
    rig.run(1.0)
    for peer in peers:
        assert peer.data.startswith(b"HTTP/1.1 200 ") and b"x-yield-parked-seconds" in peer.data.lower()
        assert peer.closed
    assert rig.clock.getDelayedCalls() == []


def test_every_path_enters_through_klein_and_a_parked_request_keeps_nothing_of_klein(monkeypatch):
    """The Klein app is the one entry (canonical and odd paths alike); once routed, a parked request holds
    none of Klein's per-request objects (its request adapter and MapAdapter, its notifyFinish watchers)."""
    import gc

    from klein import Klein
    from klein._app import KleinRequest
    from werkzeug.routing import MapAdapter

    from inmemory import Rig as MemoryRig
    from yieldproxy.edge.request import ProxyRequest
    from yieldproxy.proxy.resource import _RoutedRequest

    routed = []
    real = Klein.execute_endpoint

    def execute_endpoint(self, endpoint, request, *args, **kwargs):
        routed.append(request.path)  # Klein's router matched it to a route of the app, which runs now
        return real(self, endpoint, request, *args, **kwargs)

    monkeypatch.setattr(Klein, "execute_endpoint", execute_endpoint)
    rig = MemoryRig()
    body = json.dumps({"model": "all-minilm", "input": "x"}).encode()
    paths = (b"/api/embed", b"/api/%65mbed", b"//api/embed", b"/api/embed/")

    def send(path: bytes):
        peer = rig.raw()
        peer.send(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (path, len(body), body)
        )
        rig.turn()
        return peer

    for path in paths:
        peer = send(path)
        assert peer.data.startswith(b"HTTP/1.1 200 "), (path, peer.data[:200])
    assert routed == list(paths)

    rig.proxy.state.hold("test")
    peers = [send(path) for path in paths * 5]
    assert len(rig.proxy.lot) == 20
    gc.collect()
    live = gc.get_objects()
    assert [o for o in live if isinstance(o, (KleinRequest, _RoutedRequest, MapAdapter))] == []
    parked = [o for o in live if isinstance(o, ProxyRequest) and not o.finished]
    assert len(parked) == 20 and all(r.notifications == [] for r in parked)
    rig.proxy.state.release("test")
    rig.run(1.0)
    for peer in peers:
        assert peer.data.startswith(b"HTTP/1.1 200 ") and peer.closed


def _pool_rig():
    from helpers import pool_config
    from inmemory import Rig as MemoryRig

    config = pool_config(
        {"name": "a", "models": ("all-minilm",), "model_map": {"all-minilm": "all-minilm:latest"}},
        {"name": "b", "models": ("other-model",)},
    )
    return MemoryRig(config)


def test_a_lone_surrogate_in_a_renamed_body_is_sent_as_the_client_escaped_it_and_frees_its_slot():
    """JSON accepts an escaped lone surrogate; renaming the model must not choke on it (it did: an HTML 500,
    and the member's slot was never given back)."""
    rig = _pool_rig()
    answer = rig.result(rig.post("/api/embed", data=b'{"model":"all-minilm","input":["\\ud800"]}'))
    assert answer.code == 200, answer.body
    assert rig.sim.texts_embedded == {"\ud800": 1}
    assert rig.proxy.scheduler.drainer("a").inflight == 0


def test_a_bug_while_making_an_attempt_is_a_json_500_logged_once_and_gives_its_slot_back(monkeypatch):
    rig = _pool_rig()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(attempts, "body_for", broken)
    with capturedLogs() as events:
        answer = rig.result(rig.post("/api/embed", json={"model": "all-minilm", "input": ["x"]}))
    assert answer.code == 500 and answer.header("content-type")[0].startswith("application/json")
    assert "the proxy failed" in answer.json()["error"]
    assert rig.proxy.scheduler.drainer("a").inflight == 0
    assert rig.sample("yieldproxy_requests_total", **{"class": "passthrough", "code": "500"}) == 1
    assert any(event.get("log_failure") or event.get("failure") for event in events)  # its traceback
