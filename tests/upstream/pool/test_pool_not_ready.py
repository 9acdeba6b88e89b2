"""A member whose server says it is not ready (llama.cpp loading its model): passed over, not failed.

On a Clock: the pool core (a member's not-ready state, its checks, the
bound that makes it an outage), and the proxy app in memory in front of the
llama.cpp sim (an attempt judged not ready is not counted, the request is
replayed on the member once its health reads up).  The real-socket cousin is
in tests/upstream/pool/test_pool_servers.py.
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred, succeed
from twisted.web.resource import Resource

from helpers import config_with, make_pool_core, pool_config
from inmemory import Rig, answered
from yieldproxy.lot.parking import Entry
from yieldproxy.names import LOADING_SOURCE, OUTAGE_SOURCE
from yieldproxy.servers import NOT_READY, server
from yieldproxy.tools.sim.llamacpp import LOADING_BODY
from yieldproxy.upstream.control import Answer, UpstreamControl

LOADING = json.dumps(LOADING_BODY).encode()
MODEL = "qwen2.5-0.5b-instruct"


class Health:
    """A control client whose health answers are given by the test; records every call."""

    def __init__(self):
        self.calls: list[tuple[str, Deferred]] = []

    def request(self, method, path, body=None, timeout=10.0):
        d: Deferred = Deferred()
        self.calls.append((path, d))
        return d

    def answer(self, code: int, body: bytes = b"") -> None:
        """Answer the last call."""
        self.calls[-1][1].callback(Answer(code, body))


def admit(core, model="m", path="/v1/chat/completions", cls="interactive") -> tuple[Entry, Deferred]:
    entry = Entry(cls=cls, routing=core.scheduler.routing("POST", path, cls, model))
    return entry, core.scheduler.admit(entry)


def went(d: Deferred) -> bool:
    results: list = []
    d.addBoth(lambda r: results.append(r) or r)
    return bool(results)


def two(config=None, judges=None):
    core = make_pool_core(
        {"name": "llama", "api": "llamacpp", "models": ("m",)}, {"name": "b", "api": "openai", "models": ("m",)},
        config=config, judges=judges,
    )
    llama = core.scheduler.member("llama")
    health = llama.control = Health()
    return core, llama, health


# -- the pool core ----------------------------------------------------------------------------


def test_a_not_ready_member_is_passed_over_and_its_health_checked_until_it_reads_up():
    core, llama, health = two()
    assert [admit(core)[0].released_to for _ in range(1)] == ["llama"]
    core.scheduler.finished(failed=False, seconds=0.01, member="llama")
    llama.health.not_ready("upstream answered 503: Loading model")
    assert not llama.available() and llama.state_name() == "not_ready"
    assert ("llama", False) == core.scheduler.metric_rows()[0][:2]
    # Another available member takes new requests at once; nothing parks, no hold anywhere.
    assert [admit(core)[0].released_to for _ in range(3)] == ["b", "b", "b"]
    assert core.state.holds_for("llama") == [] and len(core.lot) == 0
    # Its health path, on a growing interval, while it still loads.
    core.run(0.5)
    assert [p for p, _ in health.calls] == ["/health"]
    health.answer(503, LOADING)
    core.run(0.9)
    assert len(health.calls) == 1  # the next wait is longer: 1 s
    core.run(0.1)
    assert len(health.calls) == 2
    health.answer(503, LOADING)
    assert llama.state_name() == "not_ready"
    core.run(2)
    health.answer(200, b'{"status":"ok"}')
    assert llama.available() and llama.state_name() == "available"
    assert core.scheduler.metric_rows()[0][:2] == ("llama", True)
    core.run(60)
    assert len(health.calls) == 3  # no more checks once it is up
    core.scheduler.stop()
    assert core.clock.getDelayedCalls() == []


def test_a_request_only_the_not_ready_member_may_serve_waits_and_goes_to_it_once_its_health_reads_up():
    core = make_pool_core({"name": "llama", "api": "llamacpp", "models": ("m",)}, {"name": "b", "models": ("x",)})
    llama = core.scheduler.member("llama")
    health = llama.control = Health()
    llama.health.not_ready("Loading model")
    entry, d = admit(core)
    assert not went(d) and core.scheduler.waiting_for("llama") == 1
    core.run(0.5)
    health.answer(200, b'{"status":"ok"}')
    core.run()
    assert went(d) and entry.released_to == "llama"


def test_a_member_not_ready_past_the_bound_is_treated_as_down_until_its_health_reads_up():
    core, llama, health = two(config_with(upstream={"not_ready_max_seconds": 5.0, "health_max_interval_seconds": 2.0}))
    llama.health.not_ready("Loading model")
    for _ in range(2):
        core.run(2)
        if health.calls and not health.calls[-1][1].called:
            health.answer(503, LOADING)
    assert llama.state_name() == "not_ready"
    core.run(1.1)
    # Stuck loading: the outage machinery takes over (an outage hold on it alone), the other serves.
    assert llama.state_name() == "outage"
    assert [h.source for h in core.state.holds_for("llama")] == [LOADING_SOURCE] and core.state.holds_for("b") == []
    assert admit(core)[0].released_to == "b"
    # Its health is still checked; once it reads up, the hold ends.
    for _ in range(3):
        if health.calls and not health.calls[-1][1].called:
            health.answer(503, LOADING)
        core.run(2)
    assert llama.state_name() == "outage"
    health.answer(200, b'{"status":"ok"}')
    assert llama.state_name() == "available" and core.state.holds_for("llama") == []
    core.scheduler.stop()
    assert core.clock.getDelayedCalls() == []


def test_a_member_whose_health_reads_up_while_its_model_route_loads_cannot_dodge_the_bound():
    """Each "loading" answer used to start the bound afresh once the health had read up: it never ended."""
    from yieldproxy.servers import ModelCall

    core, llama, health = two(config_with(upstream={"not_ready_max_seconds": 5.0, "health_max_interval_seconds": 2.0}))
    call = ModelCall("/v1/chat/completions", "m")
    began = core.clock.seconds()
    for _ in range(40):
        llama.health.not_ready("upstream answered 503: Loading model", call)
        if llama.state_name() == "outage":
            break
        assert llama.state_name() == "not_ready"
        core.run(0.5)
        if health.calls[-1][0] == "/health":
            health.answer(200, b'{"status":"ok"}')  # its health says up: let back in (until the bound)
        else:
            health.answer(503, LOADING)  # its model route does not
        if llama.state_name() == "outage":
            break
        assert llama.state_name() == "available"
    assert llama.state_name() == "outage"
    assert 5.0 <= core.clock.seconds() - began < 6.0
    assert [h.source for h in core.state.holds_for("llama")] == [LOADING_SOURCE]
    assert core.state.hold_of(OUTAGE_SOURCE, "llama") is None  # its own key, not the outage watcher's
    assert admit(core)[0].released_to == "b"
    # Its health still reads up, which ends nothing now: a model call of the kind that loaded does.
    core.run(0.5)
    path, _ = health.calls[-1]
    assert path == "/v1/chat/completions"
    health.answer(503, LOADING)
    core.run(1.0)
    assert llama.state_name() == "outage" and health.calls[-1][0] == "/v1/chat/completions"
    health.answer(200, b'{"choices":[{"message":{"content":"h"}}]}')
    assert llama.state_name() == "available" and core.state.holds == []
    # A model call answered: the next "loading" starts a bound of its own.
    llama.served()
    llama.health.not_ready("Loading model", call)
    assert llama.state_name() == "not_ready"
    core.scheduler.stop()
    assert core.clock.getDelayedCalls() == []


def test_a_served_model_call_ends_the_run_so_a_later_load_gets_the_whole_bound():
    from yieldproxy.servers import ModelCall

    core, llama, health = two(config_with(upstream={"not_ready_max_seconds": 5.0}))
    call = ModelCall("/v1/chat/completions", "m")
    llama.health.not_ready("Loading model", call)
    core.run(0.5)
    health.answer(200, b'{"status":"ok"}')
    llama.health.served()  # a request was answered: it has loaded
    core.run(4.0)
    llama.health.not_ready("Loading model", call)
    core.run(4.0)
    assert llama.state_name() == "not_ready" and core.state.holds == []
    core.scheduler.stop()
    assert core.clock.getDelayedCalls() == []


def test_ollama_never_answers_not_ready_so_a_pool_of_one_is_unchanged():
    ollama = server("ollama")
    for code, body in ((503, LOADING), (503, b'{"error":"server busy, please try again.  maximum pending requests exceeded"}'),
                       (500, b'{"error":"llama runner process has terminated"}'), (502, b"")):
        assert ollama.judge(code, body) != NOT_READY
    assert ollama.judge_health(503, LOADING) != NOT_READY
    assert server("llamacpp").judge(503, LOADING) == NOT_READY


def test_a_pool_of_one_ollama_counts_503_attempts_as_it_always_did():
    """Ollama's failures are failed tries (3 of them here, then its own answer); the upstream stays available."""
    rig = Rig(config_with(upstream={"max_attempts": 3, "retry_backoff_seconds": 0.1}))
    member = rig.proxy.scheduler.members[0]
    rig.sim.set_mode("error500")
    d = rig.post("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    rig.run(5)
    answer = rig.result(d)
    assert answer.code == 500 and rig.sim.requests_total["/api/chat"] == 3
    assert member.state_name() == "available" and not member.not_ready


# -- the proxy app in memory, in front of the llama.cpp sim ----------------------------------------


def llama_rig(load_seconds: float, **upstream) -> tuple[Rig, object]:
    """A pool of one llama.cpp member, its requests and its health checks reaching the sim in memory."""
    from yieldproxy.tools.sim import SimOllama

    config = pool_config(
        {"name": "llama", "api": "llamacpp", "url": "http://upstream.invalid"},
        config=config_with(
            upstream={"health_interval_seconds": 0.5, "health_max_interval_seconds": 2.0, **upstream},
            classes={"interactive": {"hold_seconds": 60}},
        ),
    )
    from twisted.internet.task import Clock

    clock = Clock()
    sim = SimOllama(clock, api="llamacpp", models=(MODEL,), load_seconds=load_seconds)
    rig = Rig(config, upstream=sim.resource(), reactor=clock)
    member = rig.proxy.scheduler.members[0]
    member.control = UpstreamControl(clock, "http://upstream.invalid", endpoint=rig.upstream.wire)
    return rig, sim


def completion(rig, headers=None) -> Deferred:
    return rig.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    headers=headers)


def test_an_attempt_judged_not_ready_is_not_counted_and_is_replayed_once_the_health_reads_up():
    rig, sim = llama_rig(30.0)
    member = rig.proxy.scheduler.members[0]
    d = completion(rig)
    # One attempt, 503 "Loading model": not counted, the member not ready, the request parked.
    assert not answered(d) and member.state_name() == "not_ready" and len(rig.proxy.lot) == 1
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="llama", outcome="status_503") == 1
    assert rig.sample("yieldproxy_upstream_available", upstream="llama") == 0
    rig.run(20)
    # Parked, not retried: only its health path was asked meanwhile.
    assert not answered(d) and sim.requests_total["/v1/chat/completions"] == 1 and sim.requests_total["/health"] >= 3
    status = rig.call("GET", rig.admin_url + "/status").json()
    assert status["upstreams"][0]["state"] == "not_ready" and status["upstreams"][0]["holds"] == []
    rig.run(12)
    answer = rig.result(d)
    assert answer.code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert member.state_name() == "available" and rig.proxy.state.holds == []
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="llama", outcome="ok") == 1
    assert rig.sample("yieldproxy_forgiven_attempts_total", **{"class": "interactive"}) == 0
    assert rig.sample("yieldproxy_upstream_available", upstream="llama") == 1
    assert sim.requests_total["/v1/chat/completions"] == 2


def test_a_request_waits_for_a_loading_member_only_up_to_its_max_wait_and_is_told_why():
    rig, sim = llama_rig(30.0)
    d = completion(rig, headers={"X-Yield-Max-Wait": "3"})
    rig.run(3.5)
    answer = rig.result(d)
    assert answer.code == 503
    error = answer.json()["error"]
    assert "loading its model" in error["message"] and error["code"] == "expired"
    assert sim.requests_total["/v1/chat/completions"] == 1


def test_a_member_stuck_loading_gets_an_outage_hold_and_serves_once_it_has_loaded():
    rig, sim = llama_rig(30.0, not_ready_max_seconds=10.0)
    member = rig.proxy.scheduler.members[0]
    d = completion(rig)
    rig.run(10.5)
    assert member.state_name() == "outage" and not answered(d)
    assert [h.source for h in rig.proxy.state.holds] == [LOADING_SOURCE]
    rig.run(22)
    answer = rig.result(d)
    assert answer.code == 200 and rig.proxy.state.holds == [] and member.state_name() == "available"


class HealthLies(Resource):
    """A llama.cpp-like server whose ``/health`` says ok while its model route answers "Loading model"."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.loaded = False
        self.calls: list[str] = []

    def render(self, request):
        path = request.path.decode()
        self.calls.append(path)
        request.setHeader(b"content-type", b"application/json")
        if path == "/health":
            return b'{"status":"ok"}'
        if self.loaded:
            return json.dumps(
                {"object": "chat.completion", "model": MODEL,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
            ).encode()
        request.setResponseCode(503)
        return LOADING


def test_a_server_whose_health_says_up_while_its_model_route_loads_reads_outage_at_the_bound():
    from twisted.internet.task import Clock

    backend = HealthLies()
    config = pool_config(
        {"name": "llama", "api": "llamacpp", "url": "http://upstream.invalid"},
        config=config_with(
            upstream={"health_interval_seconds": 0.5, "health_max_interval_seconds": 2.0, "not_ready_max_seconds": 10.0},
            classes={"interactive": {"hold_seconds": 120}},
        ),
    )
    clock = Clock()
    rig = Rig(config, upstream=backend, reactor=clock)
    member = rig.proxy.scheduler.members[0]
    member.control = UpstreamControl(clock, "http://upstream.invalid", endpoint=rig.upstream.wire)
    d = completion(rig)
    rig.run(10.5)
    # Let back in at each health check, told "loading" at each attempt: the bound still ran out.
    assert backend.calls.count("/v1/chat/completions") > 3 and backend.calls.count("/health") > 3
    assert member.state_name() == "outage" and not answered(d)
    assert [h.source for h in rig.proxy.state.holds] == [LOADING_SOURCE]
    status = rig.call("GET", rig.admin_url + "/status").json()
    assert status["upstreams"][0]["state"] == "outage"
    # Held: only the minimal model call asks whether it loaded; its health's "ok" ends nothing.
    tried = backend.calls.count("/v1/chat/completions")
    rig.run(20)
    assert member.state_name() == "outage" and not answered(d)
    assert backend.calls.count("/v1/chat/completions") > tried
    backend.loaded = True
    rig.run(3)
    answer = rig.result(d)
    assert answer.code == 200 and rig.proxy.state.holds == [] and member.state_name() == "available"
    assert rig.sample("yieldproxy_forgiven_attempts_total", **{"class": "interactive"}) == 0


# -- the outage watcher's probes ---------------------------------------------------------------------


def test_a_probe_answered_not_ready_takes_no_outage_hold_and_makes_the_member_not_ready():
    """Once the member had answered, a failure's probe reading "Loading model" was an outage; it is not."""
    from yieldproxy.servers import ModelCall
    from yieldproxy.watchers.outage import OutageWatcher, UpstreamProbe

    class Control:
        def __init__(self):
            self.asked: list[str] = []

        def request(self, method, path, body=None, timeout=None):
            self.asked.append(path)
            return succeed(Answer(503, LOADING))

    # Each member's health judges with its outage watcher, as service.build wires them.
    watchers: dict[str, OutageWatcher] = {}
    core, llama, _ = two(judges=lambda name: lambda reason, call=None: watchers[name].judge(reason, call))
    control = Control()
    probe = UpstreamProbe(control, llama.health, "/health", server=llama.server)
    watcher = watchers["llama"] = OutageWatcher(
        core.clock, core.state, llama.health, probe, core.metrics, scope="llama", member="llama",
    )
    llama.health.answered()  # it answered before (a model list, a request)
    watcher.startService()
    # The probe at start reads its health: not ready, no hold.
    assert control.asked == ["/health"] and llama.state_name() == "not_ready" and core.state.holds == []
    # A failure whose probe is a model call that answers "Loading model" (the model it served before):
    # forgiven, still no hold.
    llama.health.record.served(ModelCall("/v1/chat/completions", "m"))
    d = llama.health.report("status_503", ModelCall("/v1/chat/completions", "m"))
    assert verdict_of(d) is True and core.state.holds == [] and llama.state_name() == "not_ready"
    assert core.sample("yieldproxy_outage_probes_total", upstream="llama", probe="health", result="not_ready") == 1
    watcher.stopService()
    core.scheduler.stop()


def verdict_of(d: Deferred):
    results: list = []
    d.addBoth(results.append)
    assert results, "the verdict is still pending"
    return results[0]



def test_the_lot_goes_to_the_member_at_once_when_its_health_reads_up_with_no_backoff_from_the_loading_answers():
    rig, sim = llama_rig(0.3, retry_backoff_seconds=1.0, retry_backoff_max_seconds=8.0, max_attempts=1)
    member = rig.proxy.scheduler.members[0]
    rig.run(1)
    # A real failure first (a reset: one failure in a row on the member's drainer)...
    sim.set_mode("reset")
    assert rig.result(completion(rig)).code == 502
    # ...then the restarted server loads its model again, and the next attempt reads "Loading model".
    sim.set_mode("ok")
    d = completion(rig)
    assert member.state_name() == "not_ready" and not answered(d)
    # Its health reads up at the first check (0.5 s): the request goes at once, not after a 1 s backoff.
    rig.run(0.5)
    assert member.state_name() == "available"
    rig.run(0.05)
    assert answered(d) and rig.result(d).code == 200
