"""Honest states at a glance: ``yieldproxy_upstream_state``, and an upstream that never answered reads unreachable.

On the in-memory rig (tests/inmemory.py): the proxy's request client and its
control client reach the simulated Ollama through an endpoint the test can
make refuse every connection, as a wrong port or a server not started does.
"""

from __future__ import annotations

from twisted.internet.defer import fail
from twisted.internet.error import ConnectionRefusedError
from twisted.logger import capturedLogs, formatEvent

from helpers import config_with, make_pool_core
from inmemory import Rig
from yieldproxy.names import LOADING_SOURCE, OUTAGE_SOURCE
from yieldproxy.observe.metrics import UPSTREAM_STATES, pool_families
from yieldproxy.tools.cli import format_status
from yieldproxy.upstream.control import UpstreamControl
from yieldproxy.watchers.outage import OutageWatcher, UpstreamProbe

EMBED = {"model": "all-minilm", "input": ["hello"]}


class Refusing:
    """An endpoint that refuses every connection while ``refuse`` is set, else connects as ``connect`` does."""

    def __init__(self, connect):
        self._connect = connect
        self.refuse = True

    def connect(self, factory):
        if self.refuse:
            return fail(ConnectionRefusedError("Connection refused"))
        return self._connect(factory)


def refusing_rig(config=None) -> tuple[Rig, object, Refusing]:
    """The rig, with its upstream (requests and control calls) refusing connections until told not to."""
    rig = Rig(config)
    refusing = Refusing(rig.upstream.wire.connect)
    rig.upstream.wire.connect = refusing.connect
    member = rig.proxy.scheduler.members[0]
    member.control = UpstreamControl(rig.clock, "http://upstream.invalid", endpoint=refusing)
    return rig, member, refusing


def start_watcher(rig, control):
    """The outage watcher service.build makes for a single upstream (``upstream.detect_outages``, the default),
    started: its first probe of the health path is the proxy's first look at the upstream."""
    member = rig.proxy.scheduler.members[0]
    probe = UpstreamProbe(control, member.health, "/api/version", server=member.server)
    watcher = OutageWatcher(rig.clock, rig.proxy.state, member.health, probe, rig.proxy.metrics)
    watcher.startService()
    return watcher


def states(rig, upstream="default") -> dict[str, float]:
    return {state: rig.sample("yieldproxy_upstream_state", upstream=upstream, state=state) for state in UPSTREAM_STATES}


def test_a_single_upstream_that_never_answered_reads_unreachable_everywhere_and_says_so_once():
    rig, member, refusing = refusing_rig()
    with capturedLogs() as events:
        watcher = start_watcher(rig, member.control)
        rig.turn()
    lines = [formatEvent(e) for e in events if "does not answer" in formatEvent(e)]
    assert len(lines) == 1 and "upstream default (http://127.0.0.1:11434)" in lines[0] and "unreachable" in lines[0]
    status = rig.call("GET", rig.admin_url + "/status").json()
    assert status["state"] == "unreachable" and status["upstreams"][0]["state"] == "unreachable"
    assert states(rig) == {s: (1 if s == "unreachable" else 0) for s in UPSTREAM_STATES}
    assert rig.sample("yieldproxy_upstream_available", upstream="default") == 0
    assert format_status(status).splitlines()[0].startswith("state:      unreachable")
    # Its requests still fail at once (502), as a single upstream's always did; nothing parks.
    with capturedLogs() as events:
        answer = rig.result(rig.post("/api/embed", EMBED))
    assert answer.code == 502 and len(rig.proxy.lot) == 0
    assert not [e for e in events if "does not answer" in formatEvent(e)]  # said once
    assert rig.call("GET", rig.admin_url + "/status").json()["state"] == "unreachable"
    # It comes up: the next check finds it, and it reads available without a request.
    refusing.refuse = False
    rig.run(15)
    status = rig.call("GET", rig.admin_url + "/status").json()
    assert status["state"] == "available" and status["upstreams"][0]["state"] == "available"
    assert states(rig)["available"] == 1 and states(rig)["unreachable"] == 0
    assert rig.result(rig.post("/api/embed", EMBED)).code == 200
    watcher.stopService()
    rig.proxy.scheduler.stop()
    rig.turn()
    assert rig.clock.getDelayedCalls() == []


def test_a_single_upstream_whose_first_request_is_refused_reads_unreachable_without_a_start_check():
    rig, member, refusing = refusing_rig()
    assert rig.call("GET", rig.admin_url + "/status").json()["state"] == "available"  # nothing tried yet
    assert rig.result(rig.post("/api/embed", EMBED)).code == 502
    assert rig.call("GET", rig.admin_url + "/status").json()["state"] == "unreachable"
    assert states(rig)["unreachable"] == 1
    rig.proxy.scheduler.stop()
    rig.turn()
    assert rig.clock.getDelayedCalls() == []


def test_an_upstream_that_answers_at_start_reads_available():
    rig = Rig()
    member = rig.proxy.scheduler.members[0]
    watcher = start_watcher(rig, UpstreamControl(rig.clock, "http://upstream.invalid", endpoint=rig.upstream.wire))
    rig.turn()
    assert member.health.reachable and member.state_name() == "available"
    assert rig.call("GET", rig.admin_url + "/status").json()["state"] == "available"
    assert states(rig)["available"] == 1
    watcher.stopService()
    assert rig.clock.getDelayedCalls() == []


def test_the_state_gauge_has_one_state_per_upstream_and_names_who_holds_it():
    core = make_pool_core({"name": "desktop", "models": ("m",)}, {"name": "server", "models": ("m",)})
    core.metrics.watch(lambda: pool_families(core.scheduler.metric_rows()))  # as service.build does
    state = core.state

    def gauge(upstream):
        return {s: core.sample("yieldproxy_upstream_state", upstream=upstream, state=s) for s in UPSTREAM_STATES}

    assert gauge("desktop") == gauge("server") == {s: (1 if s == "available" else 0) for s in UPSTREAM_STATES}
    state.hold("api", "game", scope="desktop")
    assert gauge("desktop")["yielded"] == 1 and sum(gauge("desktop").values()) == 1
    assert core.sample("yieldproxy_upstream_hold_active", upstream="desktop", source="api") == 1
    assert core.metrics.registry.get_sample_value("yieldproxy_upstream_hold_active", {"upstream": "server", "source": "api"}) is None
    state.hold(OUTAGE_SOURCE, "down", scope="server")
    assert gauge("server")["outage"] == 1 and sum(gauge("server").values()) == 1
    assert core.sample("yieldproxy_upstream_hold_active", upstream="server", source=OUTAGE_SOURCE) == 1
    # A stuck load's hold is an outage too; a yield on top of it is a yield.
    state.release(OUTAGE_SOURCE, "server")
    state.hold(LOADING_SOURCE, "still loading", scope="server")
    assert gauge("server")["outage"] == 1
    state.hold("api", "game")  # every always member
    assert gauge("server")["yielded"] == 1 and gauge("server")["outage"] == 0
    state.release("api")
    state.release(LOADING_SOURCE, "server")
    state.release("api", "desktop")
    member = core.scheduler.member("server")
    member.health.not_ready("Loading model")
    assert gauge("server")["not_ready"] == 1 and sum(gauge("server").values()) == 1
    core.scheduler.stop()
    assert core.clock.getDelayedCalls() == []


def test_a_pool_whose_every_always_upstream_never_answered_reads_unreachable_not_yielded():
    core = make_pool_core(
        {"name": "a", "models": ("m",)}, {"name": "b", "models": ("m",)},
        config=config_with(upstream={"detect_outages": False}),
    )
    for member in core.scheduler.members:
        member.health.report("refused")
    assert [m.state_name() for m in core.scheduler.members] == ["unreachable", "unreachable"]
    assert core.scheduler.state_name == "unreachable"
    core.state.hold("api", "game", scope="a")
    assert core.scheduler.state_name == "yielded"
    core.scheduler.stop()
    assert core.clock.getDelayedCalls() == []


def test_an_answer_served_is_an_attempts_result_for_every_listener_and_makes_the_upstream_reachable():
    """UpstreamHealth.served: the answer reaches the result listeners (the outage watcher's quick probes start
    afresh on it) and the upstream reads reachable, as report(None) does; a model call also reaches the model listeners."""
    from yieldproxy.servers.base import ModelCall
    from yieldproxy.upstream.health import UpstreamHealth

    health = UpstreamHealth("http://127.0.0.1:11434")
    results: list = []
    models: list = []
    served: list = []
    health.listen(results.append)
    health.listen_models(lambda call, began: models.append((call.model, began)))
    health.when_served(lambda: served.append(True))
    health.served()
    assert health.reachable and results == [None] and models == [] and served == [True]
    health.served(ModelCall("/api/embed", "all-minilm"), began=3.0)
    assert results == [None, None] and models == [("all-minilm", 3.0)] and served == [True, True]
