"""Parked requests drain into the verified fallback as its slots free, while the GPU is yielded.

The proxy app runs whole on a Clock: requests go in through ``StubTreq``
(a real Agent and Site in memory), the primary is the simulated Ollama's
resource behind the proxy's own upstream client on in-memory connections
(``inmemory.MemoryUpstream``), and the fallback is a fake backend whose
answers the test holds and lets go one by one.  So the drain order, the cap,
failures, clients leaving, the GPU coming back and verification going stale
are each a few clock steps.  The same flow over real sockets is in
``test_fallback.py`` (the finding's burst) and ``test_fallback_real.py``.
"""

from __future__ import annotations

import json

import attrs
import pytest
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from helpers import TEST_MODELS, clock_cooperator, config_with
from inmemory import EmbedResource, MemoryUpstream
from yieldproxy.config import Config, FallbackConfig
from yieldproxy.lot.parking import ParkingLot
from yieldproxy.lot.replay import Replayer
from yieldproxy.lot.state import YieldState
from yieldproxy.observe.metrics import Metrics
from yieldproxy.proxy.handler import ProxyApp
from yieldproxy.schedule.scheduler import Scheduler
from yieldproxy.service import build_heart
from yieldproxy.tools.sim import SimOllama, expected_embedding
from yieldproxy.upstream.fallback import Fallback
from yieldproxy.upstream.translation import BackendError, Embeddings

MODEL = "all-minilm"
BATCH = {"class": "batch"}


class Twin:
    """A fallback backend that answers like the sim, one held answer at a time, and counts."""

    api = "openai"
    url = "http://twin.invalid/v1"

    def __init__(self):
        self.calls: list[str] = []
        self.held: list[tuple[str, Deferred]] = []
        self.hold = True
        #: Texts it fails on (all of them when it holds ``"*"``).
        self.failing: set[str] = set()
        self.inflight = 0
        self.peak = 0

    async def embed(self, request, model):
        text = request.inputs[0]
        self.calls.append(text)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            if self.hold:
                d = Deferred()
                self.held.append((text, d))
                await d
            if text in self.failing or "*" in self.failing:
                raise BackendError("status_500", "answered 500: out of memory")
            return Embeddings(tuple(tuple(expected_embedding(t, model)) for t in request.inputs), 3)
        finally:
            self.inflight -= 1

    def close(self):
        return succeed(None)


@attrs.define(eq=False)
class Rig:
    clock: Clock
    metrics: Metrics
    state: YieldState
    lot: ParkingLot
    scheduler: Scheduler
    replayer: Replayer
    fallback: Fallback
    twin: Twin
    sim: SimOllama
    http: StubTreq
    #: The proxy's connections to the primary (the sim), in memory.
    wire: MemoryUpstream
    #: Its connections to the fallback (the twin), in memory.
    twin_wire: MemoryUpstream
    #: The fallback's in-flight count after every step, to check the cap.
    seen_inflight: list[int] = attrs.field(factory=list, repr=False)

    def embed(self, text: str, cls: str | None = None, model: str = MODEL, turn: bool = True) -> Deferred:
        """POST one embedding; with ``turn=False`` only deliver it (no clock step runs)."""
        headers = {b"x-yield-class": [cls.encode()]} if cls else None
        body = json.dumps({"model": model, "input": [text]}).encode()
        d = self.http.post("http://proxy.invalid/api/embed", data=body, headers=headers)
        if turn:
            self.turn()
        else:
            self.http.flush()
        return d

    def turn(self, seconds: float = 0.0) -> None:
        """Let everything due run: the in-memory connections and the clock."""
        for _ in range(4):
            self.http.flush()
            self.wire.flush()
            self.twin_wire.flush()
            self.clock.advance(0)
            self.seen_inflight.append(self.fallback.inflight)
        if seconds:
            self.clock.advance(seconds)
            self.turn()

    def answer(self, count: int = 1) -> list[str]:
        """Let the fallback's oldest held answers go; the texts they were for."""
        done = []
        for _ in range(count):
            text, d = self.twin.held.pop(0)
            d.callback(None)
            done.append(text)
            self.turn()
        return done

    def answer_all(self) -> None:
        while self.twin.held:
            self.answer()

    def result(self, d: Deferred) -> tuple[int, dict, dict]:
        """Status, headers and JSON body of a finished response."""
        response = d.result if not isinstance(d.result, Deferred) else None
        assert response is not None, "no response yet"
        body = self.http.json_content(response)
        self.turn()
        headers = {k.decode().lower(): v[0].decode() for k, v in response.headers.getAllRawHeaders()}
        return response.code, headers, body.result

    def finished(self, d: Deferred) -> bool:
        return d.called and not isinstance(d.result, Deferred)

    def sample(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def fallback_total(self, outcome: str, cls: str = "batch") -> float:
        return self.sample("yieldproxy_fallback_total", **{"class": cls, "outcome": outcome})

    def replay_total(self, outcome: str, cls: str = "batch") -> float:
        return self.sample("yieldproxy_replay_total", **{"class": cls, "outcome": outcome})


def make_rig(config: Config | None = None, verify: bool = True, **fallback) -> Rig:
    clock = Clock()
    fc = attrs.evolve(
        FallbackConfig(),
        # The twin's answers are held for as long as a test likes: no attempt timeout in the way.
        **{"enabled": True, "url": Twin.url, "api": "openai", "models": {MODEL: MODEL}, "probe_texts": ("probe",),
           "concurrency": 2, "timeout_seconds": 3600.0, **fallback},
    )
    config = attrs.evolve(config or config_with(classes={"batch": {"policy": "fallback"}}), fallback=fc)
    metrics = Metrics()
    cooperator = clock_cooperator(clock)
    sim = SimOllama(clock, models=TEST_MODELS)
    upstream = wire = MemoryUpstream(sim.resource(), clock)
    twin = Twin()
    twin_wire = MemoryUpstream(EmbedResource(twin), clock)
    # Verification embeds the probe on both sides: the primary is another twin, answering at once.
    primary = Twin()
    primary.hold = False
    heart = build_heart(
        clock, config, metrics, cooperator, lambda spec: (twin_wire if spec.fallback else upstream, None),
        (primary, twin),
    )
    state, lot, scheduler, fallback = heart.state, heart.lot, heart.scheduler, heart.fallback
    replayer = heart.scheduler.drainer(None)
    app = ProxyApp(clock, config, scheduler, metrics, on_attempt=fallback.attempt_ended)
    http = StubTreq(app.resource())
    rig = Rig(clock, metrics, state, lot, scheduler, replayer, fallback, twin, sim, http, wire, twin_wire)
    if verify:
        twin.hold = False
        fallback.verify()
        twin.hold = True
        twin.calls.clear()
        assert fallback.why_not(MODEL) is None
    return rig


def served_by(headers: dict) -> str:
    return headers.get("x-yield-served-by", "primary")


def test_a_burst_drains_into_the_fallback_in_order_never_above_its_cap():
    rig = make_rig(concurrency=2)
    rig.state.hold("api", "game")
    texts = [f"burst {i}" for i in range(40)]
    pending = [rig.embed(t) for t in texts]
    # Two at the fallback at once, 38 in line for it.
    assert rig.twin.calls == texts[:2] and len(rig.lot) == 38
    assert rig.fallback.status()["waiting"] == 38 and rig.fallback.inflight == 2
    # Each answer frees a slot, and the next in line takes it: arrival order, two at a time.
    while rig.twin.held:
        rig.answer()
    assert rig.twin.calls == texts
    assert rig.twin.peak == 2 and max(rig.seen_inflight) == 2
    for text, d in zip(texts, pending):
        code, headers, body = rig.result(d)
        assert code == 200 and served_by(headers) == "fallback"
        assert body["embeddings"][0] == pytest.approx(expected_embedding(text, MODEL), abs=1e-9)
    # The parked ones say how long they waited, as every parked answer does.
    _, headers, _ = rig.result(pending[-1])
    assert float(headers["x-yield-parked-seconds"]) >= 0
    assert "x-yield-parked-seconds" not in rig.result(pending[0])[1]
    assert rig.sim.texts_embedded == {}  # nothing reached the yielded GPU
    assert rig.state.yielded and len(rig.lot) == 0
    # Each request once in the fallback's count, the parked ones once among the replay outcomes.
    assert rig.fallback_total("ok") == 40 and rig.fallback_total("skipped_busy") == 0
    assert rig.replay_total("fallback") == 38 and rig.replay_total("ok") == 0
    assert rig.sample("yieldproxy_requests_total", code="200", **BATCH) == 40
    assert rig.sample("yieldproxy_parked_requests", **BATCH) == 0
    rig.state.release("api")
    rig.turn()
    assert rig.clock.getDelayedCalls() == []


def test_the_fallback_takes_the_lots_drain_order_among_what_it_may_serve():
    config = config_with(classes={"batch": {"policy": "fallback"}, "interactive": {"policy": "fallback"}})
    rig = make_rig(config, concurrency=1, classes=("batch", "interactive"))
    rig.state.hold("api", "game")
    blocker = rig.embed("blocker")  # takes the only slot
    arrivals = [
        ("b1", "batch", MODEL), ("b2", "batch", "nomic-embed-text"), ("i1", "interactive", MODEL),
        ("b3", "batch", MODEL), ("i2", "interactive", MODEL), ("i3", "interactive", MODEL),
        ("i4", "interactive", MODEL), ("b4", "batch", MODEL), ("i5", "interactive", MODEL),
    ]
    pending = {text: rig.embed(text, cls, model) for text, cls, model in arrivals}
    assert len(rig.lot) == 9
    rig.answer_all()
    # Interactive first (priority 2), batch gets its turn after being passed over three
    # times (min_share 0.25), FIFO within each class; b2's model is not mapped, so the
    # fallback passes it by and it stays parked, in its place, for the primary.
    assert rig.twin.calls == ["blocker", "i1", "i2", "i3", "b1", "i4", "i5", "b3", "b4"]
    assert [e.cls for e in rig.lot.entries()] == ["batch"] and not rig.finished(pending["b2"])
    assert rig.fallback_total("skipped_unsupported") == 1
    rig.state.release("api")
    rig.turn()
    code, headers, body = rig.result(pending["b2"])
    assert code == 200 and served_by(headers) == "primary" and "x-yield-parked-seconds" in headers
    assert rig.sim.texts_embedded == {"b2": 1}
    assert rig.replay_total("ok") == 1 and rig.replay_total("fallback") == 3
    assert rig.replay_total("fallback", cls="interactive") == 5
    rig.result(blocker)
    assert rig.clock.getDelayedCalls() == []


def test_a_fallback_failure_puts_the_request_back_in_its_place_for_the_primary():
    rig = make_rig(concurrency=1)
    rig.state.hold("api", "game")
    texts = ["a", "b", "c", "d"]
    pending = dict(zip(texts, (rig.embed(t) for t in texts)))
    rig.twin.failing = {"b"}
    rig.answer(2)  # "a" is answered, "b" fails
    assert rig.fallback_total("failed_parked") == 1
    # "b" is back in the lot, ahead of "d" (its original place), and the caller has seen nothing.
    assert not rig.finished(pending["b"])
    parked = rig.lot.entries()
    assert [e.seq for e in parked] == sorted(e.seq for e in parked) and len(parked) == 2
    # It is not offered to the fallback again: "c" went next, then "d"; "b" stays parked.
    rig.answer_all()
    assert rig.twin.calls == ["a", "b", "c", "d"]
    assert len(rig.lot) == 1 and rig.fallback.status()["waiting"] == 0
    rig.state.release("api")
    rig.turn()
    code, headers, body = rig.result(pending["b"])
    assert code == 200 and served_by(headers) == "primary"
    assert body["embeddings"][0] == pytest.approx(expected_embedding("b", MODEL), abs=1e-9)
    assert rig.sim.texts_embedded == {"b": 1}
    # One outcome per request in each count.
    assert (rig.fallback_total("ok"), rig.fallback_total("failed_parked")) == (3, 1)
    assert (rig.replay_total("fallback"), rig.replay_total("ok")) == (2, 1)
    assert rig.clock.getDelayedCalls() == []


def test_a_request_back_from_a_fallback_failure_is_not_refused_by_a_full_lot():
    config = config_with(classes={"batch": {"policy": "fallback", "max_parked": 2}})
    rig = make_rig(config, concurrency=1)
    rig.state.hold("api", "game")
    pending = {t: rig.embed(t) for t in ("a", "b", "c")}  # "a" at the fallback, "b" and "c" fill the lot
    rig.answer()  # "b" goes to the fallback...
    pending["d"] = rig.embed("d")  # ...and "d" takes its place: the lot is full again
    rig.twin.failing = {"b"}
    rig.answer()  # "b" fails: it was accepted, so it goes back in, past the ceiling
    assert not rig.finished(pending["b"]) and len(rig.lot) == 2
    assert rig.sample("yieldproxy_rejected_total", reason="queue_full", **BATCH) == 0
    rig.answer_all()
    rig.state.release("api")
    rig.turn()
    assert {t: (rig.result(d)[0], served_by(rig.result(d)[1])) for t, d in pending.items()} == {
        "a": (200, "fallback"), "b": (200, "primary"), "c": (200, "fallback"), "d": (200, "fallback"),
    }


def test_a_failing_fallback_is_paused_not_hammered_and_the_lot_waits_for_the_primary():
    config = config_with(
        classes={"batch": {"policy": "fallback"}},
        upstream={"retry_backoff_seconds": 1.0, "retry_backoff_max_seconds": 4.0},
    )
    rig = make_rig(config, concurrency=2)
    rig.twin.failing = {"*"}
    rig.twin.hold = False
    rig.state.hold("api", "game")
    pending = [rig.embed(f"t{i}") for i in range(12)]
    # It fails at once. After the first failure the next try goes at once (a stale
    # connection, often); then each try waits a growing pause: 1 s, 2 s, 4 s, 4 s.
    calls_by_time = []
    for _ in range(12):
        calls_by_time.append(len(rig.twin.calls))
        rig.turn(1)
    assert calls_by_time == [2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6]
    # Nobody got an error; each failed one waits for the primary, untouched by the fallback again.
    assert not any(rig.finished(d) for d in pending)
    assert rig.fallback_total("failed_parked") == len(rig.twin.calls)
    assert len(set(rig.twin.calls)) == len(rig.twin.calls)
    rig.state.release("api")
    rig.turn()
    for i, d in enumerate(pending):
        code, headers, body = rig.result(d)
        assert code == 200 and served_by(headers) == "primary"
    assert rig.fallback_total("failed_parked") + rig.fallback_total("skipped_busy") == 12
    assert rig.replay_total("ok") == 12
    rig.turn(10)
    assert rig.clock.getDelayedCalls() == []


def test_when_the_gpu_returns_mid_drain_the_rest_goes_to_the_primary():
    rig = make_rig(concurrency=2)
    rig.state.hold("api", "game")
    texts = [f"t{i}" for i in range(10)]
    pending = dict(zip(texts, (rig.embed(t) for t in texts)))
    rig.answer(2)  # t0, t1 answered; t2, t3 now at the fallback
    rig.state.release("api")
    rig.turn()
    # The six left in line went to the primary; the fallback took no new one.
    assert sorted(rig.sim.texts_embedded) == texts[4:]
    assert rig.twin.calls == texts[:4] and len(rig.lot) == 0
    # The two it was serving finish there.
    rig.answer_all()
    for text, d in pending.items():
        code, headers, body = rig.result(d)
        assert code == 200
        assert served_by(headers) == ("fallback" if text in texts[:4] else "primary")
        assert body["embeddings"][0] == pytest.approx(expected_embedding(text, MODEL), abs=1e-9)
    # Those the fallback never got to count as skipped_busy, once; the replay outcomes say who served.
    assert (rig.fallback_total("ok"), rig.fallback_total("skipped_busy")) == (4, 6)
    assert (rig.replay_total("fallback"), rig.replay_total("ok")) == (2, 6)
    assert rig.fallback.inflight == 0 and rig.replayer.inflight == 0
    assert rig.clock.getDelayedCalls() == []


def test_verification_going_stale_mid_drain_stops_the_fallback():
    rig = make_rig(concurrency=1, verify_interval_seconds=60, max_verification_age_seconds=100)
    rig.state.hold("api", "game")
    pending = [rig.embed(f"t{i}") for i in range(5)]
    rig.turn(50)
    rig.answer(2)  # t0, t1 answered at 50 s; t2 at the fallback
    rig.turn(51)  # 101 s: the verification is too old
    assert "more than fallback.max_verification_age_seconds" in rig.fallback.why_not(MODEL)
    rig.answer()  # t2 was sent while it was fresh: its answer is used
    assert rig.twin.calls == ["t0", "t1", "t2"] and rig.twin.held == []
    # The rest wait for the primary; the fallback takes none while it is stale.
    assert len(rig.lot) == 2
    rig.turn(30)
    assert rig.twin.calls == ["t0", "t1", "t2"]
    rig.state.release("api")
    rig.turn()
    assert [served_by(rig.result(d)[1]) for d in pending] == ["fallback"] * 3 + ["primary"] * 2
    assert (rig.fallback_total("ok"), rig.fallback_total("skipped_unverified")) == (3, 2)
    assert rig.fallback_total("skipped_busy") == 0


def test_a_client_leaving_while_the_fallback_serves_it_is_counted_abandoned():
    rig = make_rig(concurrency=1)
    rig.state.hold("api", "game")
    first, second, third = (rig.embed(t) for t in ("a", "b", "c"))
    rig.answer()  # "a" done; "b" (parked) now at the fallback
    assert rig.twin.calls == ["a", "b"]
    second.cancel()
    second.addErrback(lambda failure: None)
    rig.turn()
    # Its slot went to "c" at once; it is counted once, as abandoned, with code 499.
    assert rig.twin.calls == ["a", "b", "c"] and rig.fallback.inflight == 1
    assert rig.fallback_total("abandoned") == 1 and rig.replay_total("abandoned") == 1
    assert rig.sample("yieldproxy_requests_total", code="499", **BATCH) == 1
    rig.answer_all()
    assert rig.result(third)[0] == 200
    assert rig.fallback_total("ok") == 2 and rig.replay_total("fallback") == 1


def test_a_client_leaving_while_served_at_arrival_is_counted_once():
    rig = make_rig(concurrency=1)
    rig.state.hold("api", "game")
    d = rig.embed("a")
    assert rig.twin.calls == ["a"] and len(rig.lot) == 0
    d.cancel()
    d.addErrback(lambda failure: None)
    rig.turn()
    assert rig.fallback_total("abandoned") == 1 and rig.fallback.inflight == 0
    assert rig.sample("yieldproxy_requests_total", code="499", **BATCH) == 1
    assert rig.replay_total("abandoned") == 0  # it never parked


def test_a_newcomer_does_not_overtake_the_line():
    rig = make_rig(concurrency=1)
    rig.state.hold("api", "game")
    rig.embed("a")  # served at once
    rig.embed("b")  # in line
    # "a" is answered, and "c" arrives before the drainer's next step: the slot is
    # free, but "b" is first in line, so "c" queues behind it.
    rig.twin.held.pop(0)[1].callback(None)
    rig.embed("c", turn=False)
    assert rig.twin.calls == ["a"] and rig.fallback.status()["waiting"] == 2
    rig.turn()
    assert rig.twin.calls == ["a", "b"]
    rig.answer()
    assert rig.twin.calls == ["a", "b", "c"]
    # While the fallback is paused after failures, newcomers wait in line too, then go in order.
    rig.twin.failing = {"c", "d"}
    rig.embed("d")
    rig.answer(2)  # "c" fails, "d" goes at once (after a first failure) and fails: a pause
    rig.twin.failing = set()
    rig.embed("e")
    rig.embed("f")
    assert rig.twin.calls == ["a", "b", "c", "d"] and rig.fallback.status()["waiting"] == 2
    rig.turn(0.5)
    assert rig.twin.calls == ["a", "b", "c", "d", "e"]
    rig.answer_all()
    assert rig.twin.calls == ["a", "b", "c", "d", "e", "f"]


def test_in_line_for_the_fallback_is_not_refused_for_a_long_declared_yield():
    rig = make_rig(concurrency=1)
    rig.state.hold("api", "game", expected_seconds=3600)  # past batch's 600 s hold bound
    served_now = rig.embed("a")
    in_line = rig.embed("b")
    # Not refused as over_budget: the fallback will serve it long before the GPU is back.
    assert not rig.finished(in_line) and len(rig.lot) == 1
    assert rig.sample("yieldproxy_rejected_total", reason="over_budget", **BATCH) == 0
    rig.answer_all()
    assert rig.result(served_now)[0] == 200 and rig.result(in_line)[0] == 200
    # One the fallback may not serve is still refused at once, honestly.
    refused = rig.embed("c", model="nomic-embed-text")
    code, headers, body = rig.result(refused)
    assert code == 503 and "expected back" in body["error"]


def test_a_full_lot_refuses_at_once_and_counts_it_busy():
    config = config_with(classes={"batch": {"policy": "fallback", "max_parked": 2}})
    rig = make_rig(config, concurrency=1)
    rig.state.hold("api", "game")
    pending = [rig.embed(t) for t in ("a", "b", "c", "d")]
    code, headers, body = rig.result(pending[3])
    assert code == 503 and "parked queue full" in body["error"] and "retry-after" in headers
    assert rig.fallback_total("skipped_busy") == 1
    assert rig.sample("yieldproxy_rejected_total", reason="queue_full", **BATCH) == 1
    rig.answer_all()
    assert [rig.result(d)[0] for d in pending[:3]] == [200, 200, 200]
    assert rig.fallback_total("ok") == 3


def test_unverified_or_not_yielded_the_fallback_takes_nothing_from_the_lot():
    rig = make_rig(verify=False)
    rig.state.hold("api", "game")
    pending = [rig.embed(t) for t in ("a", "b")]
    assert rig.twin.calls == [] and len(rig.lot) == 2
    assert rig.fallback_total("skipped_unverified") == 2
    rig.state.release("api")
    rig.turn()
    assert [served_by(rig.result(d)[1]) for d in pending] == ["primary", "primary"]
    assert rig.fallback_total("skipped_unverified") == 2  # once each, not again as they left
