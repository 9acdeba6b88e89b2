"""The VRAM handover: unload when the GPU is yielded, preload before the lot is replayed.

Clock-driven against a small fake of Ollama's control routes for the
sequencing, then twice against the simulated backend over real sockets:
its ``/api/ps`` and model table are the judge.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.python.failure import Failure

from helpers import config_with, make_core, start_stack, wait_for
from yieldproxy.config import HandoverConfig
from yieldproxy.lot.parking import Entry
from yieldproxy.names import canonical_model as canonical
from yieldproxy.service import subscribe_handover
from yieldproxy.upstream.control import Answer, ControlTimeout
from yieldproxy.upstream.vram import Handover, listed_models

TIMEOUT = 30


class FakeOllama:
    """``/api/ps``, load and unload, answered from a model table on the test's Clock."""

    def __init__(self, clock, loaded=(), load_seconds=0.0, embedding_only=(), missing=()):
        self.clock = clock
        self.loaded = {canonical(m) for m in loaded}
        self.load_seconds = load_seconds
        self.embedding_only = {canonical(m) for m in embedding_only}
        self.missing = {canonical(m) for m in missing}
        self.hang = False
        self.calls: list[tuple] = []

    def request(self, method, path, body=None, timeout=10.0):
        self.calls.append((method, path, body))
        if self.hang:
            return Deferred().addTimeout(
                timeout, self.clock, onTimeoutCancel=lambda result, t: Failure(ControlTimeout(f"{path}: no answer"))
            )
        if path == "/api/ps":
            models = [{"name": m, "model": m, "size_vram": 1} for m in sorted(self.loaded)]
            return succeed(Answer(200, json.dumps({"models": models}).encode()))
        model = canonical(body["model"])
        if model in self.missing:
            return succeed(Answer(404, b'{"error": "model not found"}'))
        if path == "/api/generate" and model in self.embedding_only:
            return succeed(Answer(400, b'{"error": "model does not support generate"}'))
        if body.get("keep_alive") == 0:
            self.loaded.discard(model)
            return succeed(Answer(200, b'{"done_reason": "unload"}'))
        if not self.load_seconds:
            self.loaded.add(model)
            return succeed(Answer(200, b'{"done_reason": "load"}'))
        d = Deferred()

        def loaded():
            self.loaded.add(model)
            if not d.called:
                d.callback(Answer(200, b'{"done_reason": "load"}'))

        self.clock.callLater(self.load_seconds, loaded)
        return d


def handover_core(fake_options=None, **config):
    core = make_core()
    fake = FakeOllama(core.clock, **(fake_options or {}))
    handover = Handover(
        core.clock, core.state, core.replayer, fake, core.metrics, HandoverConfig(**config), release=core.scheduler.member(None)
    )
    subscribe_handover(core.state, handover)
    handover.startService()
    return core, fake, handover


def park(core, released):
    entry = Entry(cls="batch")
    core.scheduler.admit(entry).addCallback(lambda e: released.append(e.seq))
    return entry


def finish_all(core, released, count):
    """Let every released request finish, until ``count`` have been released."""
    for _ in range(200):
        core.run(0.05)
        while core.replayer.inflight:
            core.scheduler.finished(seconds=0.01)
        if len(released) >= count:
            break
    core.run(0.05)


def steps(core, step, outcome):
    return core.sample("yieldproxy_handover_total", upstream="default", step=step, outcome=outcome)


def test_loaded_models_reads_api_ps():
    assert set(listed_models({"models": [{"name": "llama3.2:latest"}, {"model": "all-minilm"}, "junk"]})) == {
        "llama3.2:latest",
        "all-minilm:latest",
    }
    assert listed_models({}) == {} and listed_models([]) == {}
    assert canonical("library/llama3.2:3b") == "llama3.2:3b"  # library is Ollama's default namespace
    # An unload names each model as /api/ps lists it (a case-sensitive disk finds it only so).
    assert listed_models({"models": [{"name": "hf.co/Me/Model:Q4"}]}) == {"hf.co/me/model:q4": "hf.co/Me/Model:Q4"}
    assert canonical("registry.local:5000/m") == "registry.local:5000/m:latest"


def test_unload_waits_for_requests_in_flight_then_unloads_every_model():
    core, fake, handover = handover_core(
        {"loaded": ["llama3.2", "all-minilm"], "embedding_only": ["all-minilm"]},
        unload_on_yield=True, unload_wait_seconds=30,
    )
    released = []
    park(core, released)  # goes at once: one request in flight
    assert core.replayer.inflight == 1
    core.state.hold("api", "game")
    assert handover.step == "waiting_inflight"
    core.run(1)
    assert fake.calls == []
    core.scheduler.finished(seconds=1)
    core.run(0.3)
    assert fake.calls == [
        ("GET", "/api/ps", None),
        ("POST", "/api/generate", {"model": "all-minilm:latest", "keep_alive": 0}),
        ("POST", "/api/embed", {"model": "all-minilm:latest", "keep_alive": 0}),
        ("POST", "/api/generate", {"model": "llama3.2:latest", "keep_alive": 0}),
        ("GET", "/api/ps", None),
    ]
    assert fake.loaded == set() and handover.step is None
    assert steps(core, "wait_inflight", "ok") == 1 and steps(core, "unload", "ok") == 1
    assert core.sample("yieldproxy_handover_seconds_sum", upstream="default", step="wait_inflight") == pytest.approx(1.0)
    core.state.release("api")
    handover.stopService()
    assert core.clock.getDelayedCalls() == []


def test_unload_goes_ahead_after_the_bounded_wait():
    core, fake, handover = handover_core({"loaded": ["llama3.2"]}, unload_on_yield=True, unload_wait_seconds=2)
    released = []
    park(core, released)
    core.state.hold("api", "game")
    core.run(1.9)
    assert fake.calls == []
    core.run(0.3)
    assert steps(core, "wait_inflight", "timeout") == 1
    assert steps(core, "unload", "ok") == 1 and fake.loaded == set()
    core.scheduler.finished(seconds=3)
    core.state.release("api")
    core.run(0.1)
    assert core.clock.getDelayedCalls() == []


def test_a_yield_that_ends_before_the_unload_stops_it():
    core, fake, handover = handover_core({"loaded": ["llama3.2"]}, unload_on_yield=True)
    released = []
    park(core, released)
    core.state.hold("api", "short")
    core.run(0.5)
    core.state.release("api")
    core.run(1)
    assert fake.calls == [] and fake.loaded == {"llama3.2:latest"}
    assert steps(core, "wait_inflight", "cancelled") == 1
    core.scheduler.finished(seconds=1)
    assert core.clock.getDelayedCalls() == []


def test_an_unload_that_cannot_confirm_is_a_timeout():
    core, fake, handover = handover_core({"loaded": ["llama3.2"]}, unload_on_yield=True, unload_timeout_seconds=3)
    real_request = fake.request

    def stuck(method, path, body=None, timeout=10.0):
        if method == "POST":  # "unloaded", yet /api/ps keeps listing it
            fake.calls.append((method, path, body))
            return succeed(Answer(200, b"{}"))
        return real_request(method, path, body, timeout)

    fake.request = stuck
    core.state.hold("api", "game")
    core.run(3.5)
    assert steps(core, "unload", "timeout") == 1
    assert handover.step is None
    core.state.release("api")
    assert core.clock.getDelayedCalls() == []


def test_preload_holds_the_release_until_the_models_are_listed():
    core, fake, handover = handover_core({"load_seconds": 2}, preload_models=("llama3.2",))
    released = []
    core.state.hold("api", "game")
    parked = [park(core, released) for _ in range(3)]
    core.state.release("api")
    assert core.scheduler.state_name == "draining" and handover.step == "preloading"
    core.run(1.9)
    assert released == []
    late = park(core, released)  # arrives during the preload: joins the tail, not the GPU
    core.run(0.05)
    assert released == [] and late.was_parked
    core.run(0.2)
    assert released == [e.seq for e in [*parked, late]]
    assert fake.calls == [
        ("POST", "/api/generate", {"model": "llama3.2"}),
        ("GET", "/api/ps", None),
    ]
    assert steps(core, "preload", "ok") == 1
    assert core.sample("yieldproxy_handover_seconds_sum", upstream="default", step="preload") >= 2
    finish_all(core, released, 4)
    assert core.scheduler.state_name == "available"
    assert core.clock.getDelayedCalls() == []


def test_a_failed_preload_releases_the_lot_anyway():
    core, fake, handover = handover_core({"missing": ["nope"]}, preload_models=("nope",))
    released = []
    core.state.hold("api", "game")
    entry = park(core, released)
    core.state.release("api")
    core.run(0.05)
    assert released == [entry.seq]
    assert steps(core, "preload", "error") == 1
    finish_all(core, released, 1)
    assert core.clock.getDelayedCalls() == []


def test_a_slow_preload_is_bounded():
    core, fake, handover = handover_core(preload_models=("llama3.2",), preload_timeout_seconds=5)
    fake.hang = True
    released = []
    core.state.hold("api", "game")
    entry = park(core, released)
    core.state.release("api")
    core.run(4.9)
    assert released == []
    core.run(0.2)
    assert released == [entry.seq]
    assert steps(core, "preload", "timeout") == 1
    finish_all(core, released, 1)
    assert core.clock.getDelayedCalls() == []


def test_a_new_yield_cancels_the_preload_and_the_next_end_starts_it_again():
    core, fake, handover = handover_core({"load_seconds": 2}, preload_models=("llama3.2",))
    released = []
    core.state.hold("api", "game")
    parked = [park(core, released) for _ in range(2)]
    core.state.release("api")
    core.run(1)
    core.state.hold("api", "second game")
    assert steps(core, "preload", "cancelled") == 1 and handover.step is None
    core.run(3)
    assert released == [] and core.scheduler.state_name == "yielded"
    core.state.release("api")
    assert handover.step == "preloading"
    core.run(2.2)
    assert released == [e.seq for e in parked]
    assert steps(core, "preload", "ok") == 1
    finish_all(core, released, 2)
    assert core.clock.getDelayedCalls() == []


def test_an_outage_is_no_handover():
    core, fake, handover = handover_core(
        {"loaded": ["llama3.2"]}, unload_on_yield=True, preload_models=("llama3.2",)
    )
    released = []
    core.state.hold("outage", "upstream failing (refused)")
    entry = park(core, released)
    core.run(1)
    core.state.release("outage")
    core.run(0.05)
    assert fake.calls == [] and released == [entry.seq]
    finish_all(core, released, 1)
    assert core.clock.getDelayedCalls() == []


def test_stopping_gives_up_a_pending_preload():
    core, fake, handover = handover_core({"load_seconds": 60}, preload_models=("llama3.2",))
    released = []
    core.state.hold("api", "game")
    entry = park(core, released)
    core.state.release("api")
    core.run(1)
    handover.stopService()  # shutdown: the lot must be free to drain
    core.run(0.05)
    assert released == [entry.seq]
    finish_all(core, released, 1)
    core.run(60)
    assert core.clock.getDelayedCalls() == []


# -- against the simulated backend ------------------------------------------------------


def embed(stack, text):
    return treq.post(
        stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": text}, persistent=False
    ).addTimeout(TIMEOUT, reactor)


@pytest_twisted.ensureDeferred
async def test_unload_on_yield_empties_the_sims_memory():
    config = config_with(handover={"unload_on_yield": True})
    stack = await start_stack(reactor, config, watchers=True)
    try:
        assert (await embed(stack, "warm up")).code == 200
        chat = await treq.post(
            stack.proxy_url + "/api/generate", json={"model": "llama3.2", "prompt": "hi", "stream": False},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert chat.code == 200
        assert stack.sim.loaded_models() == ["all-minilm:latest", "llama3.2:latest"]
        stack.proxy.state.hold("api", "game")
        await wait_for(reactor, lambda: stack.sample("yieldproxy_handover_total", upstream="default", step="unload", outcome="ok") == 1)
        assert stack.sim.loaded_models() == []
        unloads = [r for r in stack.sim.history if r.path == "/api/generate" and r.received_at and r.outcome == "ok"]
        assert {r.model for r in unloads} >= {"all-minilm:latest", "llama3.2:latest"}
        ps = [r for r in stack.sim.history if r.path == "/api/ps"]
        assert len(ps) >= 2  # read before, confirmed after
        stack.proxy.state.release("api")
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_preload_finishes_before_the_first_replay_reaches_the_sim():
    """A whole handover: unload on yield, park, preload on resume, and only then replay."""
    config = config_with(handover={"unload_on_yield": True, "preload_models": ("all-minilm",)})
    stack = await start_stack(reactor, config, watchers=True, load_seconds=0.5)
    try:
        assert (await embed(stack, "warm up")).code == 200
        stack.proxy.state.hold("api", "game")
        await wait_for(reactor, lambda: stack.sim.loaded_models() == [])
        pending = [embed(stack, f"parked {i}") for i in range(8)]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 8)
        seen_before = len(stack.sim.history)
        stack.proxy.state.release("api")
        assert stack.proxy.scheduler.state_name == "draining"
        responses = await gatherResults(pending)
        assert [r.code for r in responses] == [200] * 8
        later = list(stack.sim.history)[seen_before:]
        preload = [r for r in later if r.path == "/api/generate"]
        replays = [r for r in later if r.path == "/api/embed"]
        assert len(preload) == 1 and preload[0].outcome == "ok" and len(replays) == 8
        assert preload[0].finished_at - preload[0].received_at >= 0.5  # it paid the load
        assert min(r.received_at for r in replays) >= preload[0].finished_at
        assert stack.sample("yieldproxy_handover_total", upstream="default", step="preload", outcome="ok") == 1
        assert stack.proxy.scheduler.state_name == "available"
    finally:
        await stack.stop()
