"""One model, or one client, can never park everyone (issue 24): an outage of the whole upstream rests on
evidence about its GPU, a model it is known to serve, never on the model a failing request named.

Each case of the issue, with a backend that answers per model (the simulated Ollama's
``set_model_mode`` and ``set_load_seconds``), in memory on a Clock (tests/inmemory.py): a model whose
calls never answer, a model that loads for minutes, a broken model called first after a start and after
a reload, a record filled with spellings of one model, a model that fails alone in GPU words; and what
still is an outage (the model it served fails too, several models fail, the operator's probe model
fails), and that a broken model cannot keep an outage hold.  The record itself (upstream/served.py) and how it is
kept in the holds file are checked at the end.
"""

from __future__ import annotations

import itertools
import json

from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent

from helpers import config_with, knows
from inmemory import Answer, Rig, answered
from rawhttp import LogCapture, counter_total
from yieldproxy.lifecycle.holdstore import HoldStore, keep_holds
from yieldproxy.lifecycle.succession import Setup, Succession
from yieldproxy.lot.state import YieldState
from yieldproxy.servers.base import PROBE_TEXT, ModelCall
from yieldproxy.tools.sim import OOM_ERROR, UNKNOWN_ERROR, expected_embedding
from yieldproxy.upstream.served import IN_USE_AFTER, MAX_MODELS, WRITE_DELAY, RecordKeeper, ServedRecord

MODEL = "all-minilm"
TIMEOUT = 60


def verdict_rig(config=None, reactor=None, **rig) -> Rig:
    """A started proxy with outage detection, in memory, once its watcher has reached the upstream."""
    rig = Rig(config or config_with(), watchers=True, reactor=reactor or MemoryReactorClock(), **rig)
    rig.start()
    rig.until(lambda: rig.proxy.health.reachable, 10)
    return rig


def answer_of(rig: Rig, d: Deferred, seconds: float = TIMEOUT) -> Answer:
    rig.until(lambda: answered(d), seconds)
    return rig.result(d)


def embed(rig: Rig, text: str, model: str = MODEL) -> Deferred:
    return rig.post("/api/embed", {"model": model, "input": text})


def healthy(rig: Rig, text: str) -> None:
    """A caller of the model the upstream serves: answered within a second of the clock, its vector right, never parked."""
    answer = answer_of(rig, embed(rig, text), 1)
    assert answer.code == 200, answer.body
    assert answer.header("x-yield-parked-seconds") is None
    assert answer.json()["embeddings"][0] == expected_embedding(text, MODEL)


def holds_taken(rig: Rig) -> list[bool]:
    """Every yield-state change from now on (True: yielded)."""
    changes: list[bool] = []
    rig.proxy.state.observe(changes.append)
    return changes


def upstream_status(rig: Rig, name: str = "default") -> dict:
    status = rig.call("GET", rig.admin_url + "/status").json()
    return next(u for u in status["upstreams"] if u["name"] == name)


def model_requests(rig: Rig, model: str) -> int:
    """Requests the backend saw for ``model`` (the callers' attempts, and any probe of it)."""
    return sum(1 for r in rig.sim.history if r.model == model)


def alone(rig: Rig, **labels) -> float:
    return counter_total(rig, "yieldproxy_failures_alone", **labels)


def model_probes(rig: Rig, result: str) -> float:
    return rig.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result=result)


def outage_holds(rig: Rig) -> float:
    return rig.sample("yieldproxy_yields_total", source="outage")


# -- a model whose calls never answer, a model that loads for minutes: timeouts judged like failed answers ---


def test_a_model_whose_calls_never_answer_fails_alone_with_a_504_naming_it_and_parks_nobody():
    """A stuck load: every call of ``stuck`` is accepted and never answered.  Its caller times out three
    times (120 s each); each timeout is judged by a probe of the model the upstream served (it passes), so
    it fails alone: a 504 naming the model and the wait, and for those six minutes every caller of the
    served model was answered at once.  (Before: the probe of ``stuck`` timed out too, the outage hold was
    taken after about three minutes, and it never ended: every later probe asked for ``stuck``.)"""
    rig = verdict_rig(config_with(upstream={"max_attempts": 3}))
    states = holds_taken(rig)
    healthy(rig, "served first")
    rig.sim.set_model_mode("stuck", "hang")
    stuck = embed(rig, "never answered", model="stuck")
    for i in range(40):  # 400 s of the clock
        rig.run(10)
        healthy(rig, f"meanwhile {i}")
        if i == 14:
            # /status names the model failing alone, since its first timeout, and why.
            (failing,) = upstream_status(rig)["failing_models"]
            assert (failing["model"], failing["reason"], failing["since"]) == ("stuck:latest", "timeout", 120.0)
            assert failing["evidence"] == "it serves all-minilm: a probe of /api/embed passed"
            assert failing["failures"] == 1
    answer = rig.result(stuck)
    assert answer.code == 504
    message = answer.json()["error"]
    assert "model stuck fails alone on upstream default" in message
    assert "gave up after 3 attempts" in message and "within 120s" in message
    assert states == [] and outage_holds(rig) == 0
    # Its own three attempts reached the backend, never a probe of it: the probes asked for the served model.
    assert model_requests(rig, "stuck") == 3
    assert model_probes(rig, "up") == 3 and model_probes(rig, "down") == 0
    assert alone(rig, reason="timeout", evidence="probe") == 3
    rig.stop()


def test_an_interactive_caller_of_a_stuck_model_gets_the_504_naming_it_not_a_503_blaming_the_slots():
    """An interactive caller (hold bound 15 s) of a model whose calls never answer: its first attempt times
    out, the probe of the served model passes, it is retried; the second times out past its bound, so it
    gives up with the 504 that names the model and the wait.  (Before: the retry went back to the lot with
    its bound spent and expired there at once: a 503 blaming "all 4 replay slots", though nothing was
    ahead of it and nothing was yielded.)"""
    rig = verdict_rig()
    healthy(rig, "served first")
    rig.sim.set_model_mode("stuck", "hang")
    chat = rig.post("/api/chat", {"model": "stuck", "messages": [{"role": "user", "content": "hi"}], "stream": False})
    answer = answer_of(rig, chat, 300)
    assert answer.code == 504, answer.body
    message = answer.json()["error"]
    assert message.startswith("model stuck fails alone on upstream default (it serves all-minilm"), message
    assert "its hold bound (15s for interactive requests) is spent" in message
    assert "within 120s" in message and "replay slots" not in message
    assert outage_holds(rig) == 0
    rig.stop()


def test_the_wait_for_the_outage_verdict_is_bounded_by_the_callers_budget():
    """A failed attempt waits for the outage probe's verdict within the caller's budget, as any wait: with
    ``X-Yield-Max-Wait: 2`` and a probe that takes its whole minute, the caller has its answer 2 s after its
    attempt failed (the upstream's own answer, here its 500), and a timed-out one its 504 that says the
    budget is spent.  (Before: 62 s, the probe's timeout and then its 2 s in the lot.)"""
    rig = verdict_rig()
    healthy(rig, "served first")
    rig.sim.set_model_mode("broken", "error500_unknown")
    rig.sim.set_model_mode(MODEL, "hang")  # the probe of the served model never answers
    began = rig.clock.seconds()
    broken = rig.post("/api/embed", {"model": "broken", "input": "x"}, headers={"X-Yield-Max-Wait": "2"})
    answer = answer_of(rig, broken, 70)
    assert rig.clock.seconds() - began <= 2.01
    assert answer.code == 500 and answer.json() == {"error": UNKNOWN_ERROR}
    rig.stop()
    # A call that times out (a second of attempt timeout), then waits for that probe: its 504 at 2 s.
    config = config_with(classes={"batch": {"attempt_timeout_seconds": 1}})
    rig = verdict_rig(config)
    healthy(rig, "served first")
    rig.sim.set_model_mode("late", "hang")
    rig.sim.set_model_mode(MODEL, "hang")
    began = rig.clock.seconds()
    late = rig.post("/api/embed", {"model": "late", "input": "x"}, headers={"X-Yield-Max-Wait": "2"})
    answer = answer_of(rig, late, 70)
    assert rig.clock.seconds() - began <= 3.01  # its 1 s attempt, then 2 s at most for the verdict
    assert answer.code == 504, answer.body
    assert "your X-Yield-Max-Wait (2s) is spent" in answer.json()["error"]
    rig.stop()


def test_a_model_that_loads_slowly_keeps_only_its_own_callers_waiting_and_says_so():
    """``big`` takes 200 s to load (a 40 GB model from a slow disk), more than an attempt's 120 s: its
    caller's first attempt times out and is judged alone (the served model's probe passes), its second
    waits for the load and gets its vector.  Meanwhile nobody else waits; the log and /status say that
    ``big`` fails alone, and once served it no longer does.  (Before: the probe of ``big`` timed out after
    60 s, at 180 s, and the outage hold parked everyone.)"""
    rig = verdict_rig(config_with(upstream={"max_attempts": 3}))
    states = holds_taken(rig)
    healthy(rig, "served first")
    rig.sim.set_load_seconds("big", 200)
    with LogCapture() as logs:
        big = embed(rig, "worth the wait", model="big")
        for i in range(19):  # to 190 s
            rig.run(10)
            healthy(rig, f"meanwhile {i}")
            assert not answered(big)
        (failing,) = upstream_status(rig)["failing_models"]
        assert (failing["model"], failing["reason"], failing["since"]) == ("big:latest", "timeout", 120.0)
        answer = answer_of(rig, big, 60)
    assert answer.code == 200
    assert answer.json()["embeddings"][0] == expected_embedding("worth the wait", "big")
    assert rig.proxy.clock.seconds() < 240  # its second attempt got it, when the load ended
    assert upstream_status(rig)["failing_models"] == []
    lines = [formatEvent(e) for e in logs.events]
    # The watcher says so once, the request's own log line at each attempt.
    assert [line for line in lines if "its own callers retry within their class's bound" in line] == [
        "http://127.0.0.1:11434: /api/embed with model big failed (timeout) and fails alone (it serves all-minilm: "
        "a probe of /api/embed passed): no outage, nobody else waits; its own callers retry within their class's bound"
    ]
    assert any(
        "batch attempt 1 failed (timeout); model big fails alone on upstream default" in line
        and "retried within the class's bound" in line for line in lines
    ), lines
    assert states == [] and outage_holds(rig) == 0
    rig.stop()


# -- a broken model called first after a start, after a reload, after a flood of spellings -----------------


def broken_first(rig: Rig) -> None:
    """``broken`` answers a 500 in words no list has (a broken model file) and is the first model call here:
    its caller gets that 500 at once, nobody else parks, no hold, and the probe asked for the served model."""
    states = holds_taken(rig)
    rig.sim.set_model_mode("broken", "error500_unknown")
    answer = answer_of(rig, embed(rig, "x", model="broken"), 5)
    assert answer.code == 500 and answer.json() == {"error": UNKNOWN_ERROR}
    assert answer.header("x-yield-parked-seconds") is None
    for i in range(8):
        healthy(rig, f"after it {i}")
    assert states == [] and outage_holds(rig) == 0
    assert model_requests(rig, "broken") == 1
    assert rig.sim.texts_embedded[PROBE_TEXT] == 1
    assert alone(rig, reason="unknown_error", evidence="probe") == 1


def test_a_broken_model_called_first_after_a_restart_fails_alone(tmp_path):
    """The record of what the upstream served is kept in the holds file (written when a model enters it, so
    a crash keeps it too): after a restart, the first model call, of a broken model, is judged by a probe of
    the model served before the restart.  (Before: the record was not kept, and that first failure took
    the outage hold.)"""
    path = tmp_path / "holds.json"
    clock = MemoryReactorClock()
    rig = verdict_rig(reactor=clock, holds=HoldStore(clock, path))
    healthy(rig, "before the restart")
    section = json.loads(path.read_text())["served"]
    assert [(m["model"], m["path"], m["name"]) for m in section["default"]["models"]] == [
        ("all-minilm:latest", "/api/embed", MODEL)
    ]
    # The process dies (no stop): a new one starts with the same holds file.
    clock = MemoryReactorClock()
    rig = verdict_rig(reactor=clock, holds=HoldStore(clock, path))
    assert knows(rig.proxy.health.record, MODEL)
    broken_first(rig)
    rig.stop()


def reload_of(rig: Rig) -> Succession:
    p = rig.proxy
    return Succession(
        rig.clock, Setup(("twistd",), {}, lambda: None), {}, {}, p.proxy_app, p.lot, p.scheduler, p.state, p.twins,
        p.records,
    )


def test_a_broken_model_called_first_after_a_reload_fails_alone():
    """The reload's handover carries the record to the new process (besides the holds file): its first model
    call, of a broken model, is judged by a probe of the model the old process served.  (Before: the new
    process started with an empty record, and that first failure took the outage hold.)"""
    old = verdict_rig()
    healthy(old, "in the old process")
    # What the old process sends in its ``state`` frame, as JSON crosses the wire.
    message = json.loads(json.dumps(reload_of(old).snapshot()))
    new = verdict_rig()
    reload_of(new).restore(message)
    assert knows(new.proxy.health.record, MODEL)
    broken_first(new)
    new.stop()
    old.stop()


def spellings(model: str):
    """Names Ollama reads as ``model`` (its ParseName, case folded): every case of it, with and without a tag."""
    for letters in itertools.product(*((c.lower(), c.upper()) if c.isalpha() else (c,) for c in model)):
        name = "".join(letters)
        for tag in ("", ":latest", ":Latest", ":LATEST"):
            yield name + tag


def test_a_record_filled_with_spellings_of_one_model_keeps_one_entry_and_judges_on_it():
    """A client sends 1,100 spellings of one model, each served: the record keeps one model, not 1,100 calls,
    so a broken model called next is judged by that model's probe.  (Before: 1,024 spellings filled the
    record of served calls; past it no failure was any model's own, and the broken model held everyone.)"""
    rig = verdict_rig(config_with(replay={"concurrency": 8}))
    names = list(itertools.islice(spellings(MODEL), 1100))
    assert len(set(names)) == 1100
    sent = [embed(rig, f"spelled {i}", model=name) for i, name in enumerate(names)]
    rig.until(lambda: all(answered(d) for d in sent), 60)
    assert {rig.result(d).code for d in sent} == {200}
    assert upstream_status(rig)["served_models"] == ["all-minilm:latest"]
    broken_first(rig)
    rig.stop()


def test_a_model_nobody_has_never_enters_the_record():
    """Only a 2xx shows the upstream serves a model: names it answers 404 ("not found") are not kept, so a
    client naming many models cannot fill or skew the record."""
    from test_outage import _OllamaOfOneModel

    rig = verdict_rig(upstream=_OllamaOfOneModel())
    for i in range(50):
        assert answer_of(rig, embed(rig, "x", model=f"nobody-{i}"), 5).code == 404
    assert answer_of(rig, embed(rig, "x"), 5).code == 200
    assert [e.model for e in rig.proxy.health.record.recent()] == ["all-minilm:latest"]
    rig.stop()


# -- a model failing alone in GPU words: a verdict is believed a few seconds ----------------------------------


def test_a_model_failing_alone_in_gpu_words_costs_its_attempts_and_one_probe():
    """``huge`` answers Ollama's out-of-memory 500 on every call (the GPU cannot hold it), while the upstream
    serves ``all-minilm``: its caller gets Ollama's own 500 after upstream.max_attempts, and all its attempts
    cost one probe, believed for a few seconds.  (Before: a probe per attempt, 10 calls for one request.)"""
    rig = verdict_rig()
    healthy(rig, "served first")
    rig.sim.set_model_mode("huge", "error500")
    states = holds_taken(rig)
    before = rig.sim.requests_total["/api/embed"]
    answer = answer_of(rig, embed(rig, "too big", model="huge"), 30)
    assert answer.code == 500 and answer.json() == {"error": OOM_ERROR}
    max_attempts = rig.proxy.config.upstream.max_attempts
    assert rig.sim.requests_total["/api/embed"] - before == max_attempts + 1
    assert model_requests(rig, "huge") == max_attempts
    assert rig.sim.texts_embedded[PROBE_TEXT] == 1
    assert alone(rig, reason="gpu_error", evidence="probe") == max_attempts
    assert states == [] and outage_holds(rig) == 0
    rig.stop()


# -- with nothing known, a single model's failure is its own; several are an outage ----------------------------


def test_with_no_model_known_a_single_models_failure_goes_back_to_its_caller_and_nobody_parks():
    """Nothing served yet and no probe_model: the first model call, of a broken model, gets its 500 at once,
    no probe, no hold; the next caller of another model is served.  (Before: the probe of the broken model
    failed too and, nothing having been served, that was an outage.)"""
    rig = verdict_rig()
    states = holds_taken(rig)
    rig.sim.set_model_mode("broken", "error500_unknown")
    answer = answer_of(rig, embed(rig, "x", model="broken"), 5)
    assert answer.code == 500 and answer.json() == {"error": UNKNOWN_ERROR}
    assert answer.header("x-yield-parked-seconds") is None
    healthy(rig, "another model")
    assert model_probes(rig, "up") + model_probes(rig, "down") == 0
    assert alone(rig, reason="unknown_error", evidence="none") == 1
    (failing,) = upstream_status(rig)["failing_models"]
    assert failing["evidence"] == "no model is known to work on this upstream to probe with"
    assert states == [] and outage_holds(rig) == 0
    rig.stop()


def test_with_no_model_known_several_models_failing_are_an_outage():
    """The GPU is gone before anything was served: the first model's failure is its own (counted), the second
    model's makes several: its probe fails too, the outage hold is taken, and both callers wait it out."""
    config = config_with(upstream={"health_interval_seconds": 0.2, "health_max_interval_seconds": 0.5})
    rig = verdict_rig(config)
    rig.sim.set_mode("error500")
    first = embed(rig, "first")
    rig.run(0.1)
    second = rig.post("/api/generate", {"model": "llama3.2", "prompt": "hi", "stream": False})
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    rig.run(2)
    assert not answered(first) and not answered(second)
    rig.sim.set_mode("ok")
    assert answer_of(rig, first).code == 200
    assert answer_of(rig, second).code == 200
    rig.until(lambda: not rig.proxy.state.yielded, 10)
    assert outage_holds(rig) == 1
    rig.stop()


# -- what is still an outage, and what ends it ---------------------------------------------------------------------


def test_a_broken_model_cannot_keep_an_outage_hold_once_the_gpu_is_back():
    """The GPU fails (every model call gets Ollama's out-of-memory 500) while a caller of a broken model waits:
    its failure is judged by the probe of the served model, which fails too: an outage.  Every follow-up probe
    asks for the served model, so the hold ends as soon as the GPU is back, though the broken model is still
    broken; its caller then gets its own 500.  (Before: the broken model was probed, and while nothing but it
    had failed it was judged alone with the GPU down; with nothing served, its probe kept the hold for ever.)"""
    config = config_with(upstream={"health_interval_seconds": 0.25, "health_max_interval_seconds": 1.0})
    rig = verdict_rig(config)
    healthy(rig, "served first")
    rig.sim.set_model_mode("broken", "error500_unknown")
    rig.sim.set_mode("error500")
    broken = embed(rig, "x", model="broken")
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    assert rig.proxy.state.hold_of("outage").reason == "upstream failing (/api/embed with model all-minilm fails)"
    outage = next(s for s in rig.proxy.watchers if s.name == "watcher:outage")
    assert outage.status()["outage_probes"] == ["/api/embed with model all-minilm"]
    waiting = embed(rig, "during the outage")
    rig.run(5)
    assert not answered(waiting) and not answered(broken)
    rig.sim.set_mode("ok")
    rig.until(lambda: rig.proxy.state.hold_of("outage") is None, 5)
    answer = answer_of(rig, waiting, 10)
    assert answer.code == 200 and answer.header("x-yield-parked-seconds") is not None
    answer = answer_of(rig, broken, 10)
    assert answer.code == 500 and answer.json() == {"error": UNKNOWN_ERROR}
    assert outage_holds(rig) == 1
    rig.stop()


def test_the_operators_probe_model_judges_failures_before_anything_was_served():
    """``upstream.probe_model``: with nothing served yet, a broken model's failure is judged by a probe of the
    operator's model (on the failing call's route): it passes, the caller gets its 500 at once; when the GPU
    goes, the probe of that model fails and the outage hold is taken, ended when it passes again."""
    config = config_with(upstream={"probe_model": MODEL, "health_interval_seconds": 0.25,
                                   "health_max_interval_seconds": 1.0})
    rig = verdict_rig(config)
    rig.sim.set_model_mode("broken", "error500_unknown")
    answer = answer_of(rig, embed(rig, "x", model="broken"), 5)
    assert answer.code == 500 and answer.json() == {"error": UNKNOWN_ERROR}
    assert rig.sim.texts_embedded[PROBE_TEXT] == 1
    assert not rig.proxy.state.yielded
    rig.run(VERDICT_BELIEVED)
    rig.sim.set_mode("error500")
    waiting = embed(rig, "the gpu is gone", model="other")
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    rig.sim.set_mode("ok")
    assert answer_of(rig, waiting).code == 200
    rig.stop()


#: Seconds past which a passing probe is no longer believed (watchers/outage.py VERDICT_SECONDS), and some.
VERDICT_BELIEVED = 11.0


def test_a_members_own_probe_model_and_route():
    """``[[upstreams]] probe_model`` and ``probe_path``: a broken chat model's failure on that member is judged
    by an embedding of the member's probe model, not by a chat call."""
    rig = Rig(
        config_with(), watchers=True,
        members=[{"name": "gpu", "probe_model": MODEL, "probe_path": "/api/embed"}],
    )
    rig.start()
    member = rig.proxy.scheduler.member("gpu")
    rig.until(lambda: member.health.reachable, 10)
    sim = rig.sims["gpu"]
    sim.set_model_mode("broken", "error500_unknown")
    d = rig.post("/api/chat", {"model": "broken", "messages": [{"role": "user", "content": "hi"}], "stream": False})
    answer = answer_of(rig, d, 5)
    assert answer.code == 500 and answer.json() == {"error": UNKNOWN_ERROR}
    assert sim.texts_embedded[PROBE_TEXT] == 1
    assert sim.requests_total["/api/chat"] == 1
    assert not rig.proxy.state.holds
    rig.stop()


# -- the record itself (upstream/served.py) ---------------------------------------------------------------------------


def record(clock=None) -> ServedRecord:
    return ServedRecord(clock or MemoryReactorClock())


def test_the_record_keeps_one_entry_per_model_as_ollama_names_it():
    r = record()
    for name in ("all-minilm", "ALL-MINILM", "all-minilm:Latest", "registry.ollama.ai/library/all-minilm:latest"):
        r.served(ModelCall("/api/embed", name))
    assert len(r) == 1 and knows(r, "All-MiniLM:latest")
    assert r.calls() == [ModelCall("/api/embed", "registry.ollama.ai/library/all-minilm:latest")]
    # A name no model has is never kept.
    r.served(ModelCall("/api/embed", "x" * 300))
    assert len(r) == 1


def test_a_flood_of_new_names_cannot_push_out_the_models_in_use():
    """Past MAX_MODELS a new name evicts the entry of least standing: models served again a minute after their
    first service stay, whatever a flood of names (each served once, as a server that answers any name
    does) does."""
    clock = MemoryReactorClock()
    r = record(clock)
    for model in ("embedder", "chatter"):
        r.served(ModelCall("/api/embed", model))
    clock.advance(IN_USE_AFTER)
    for model in ("embedder", "chatter"):
        r.served(ModelCall("/api/embed", model))
    for i in range(10 * MAX_MODELS):
        clock.advance(0.01)
        r.served(ModelCall("/api/embed", f"flood-{i}"))
    assert len(r) == MAX_MODELS
    assert knows(r, "embedder") and knows(r, "chatter")
    # Oldest first out among the rest: the latest flood names are there.
    assert knows(r, f"flood-{10 * MAX_MODELS - 1}") and not knows(r, "flood-0")
    # The models in use have more standing (served in two minutes), so they are probed first, the most recently
    # served of equals first; excluding a model leaves it out.
    assert [c.model for c in r.calls()[:2]] == ["chatter", "embedder"]
    assert r.calls(excluding="chatter")[0] == ModelCall("/api/embed", "embedder")
    # With every entry in use, the least recently served goes.
    full = record(clock)
    for i in range(MAX_MODELS):
        full.served(ModelCall("/api/embed", f"m{i}"))
    clock.advance(IN_USE_AFTER)
    for i in range(MAX_MODELS):
        full.served(ModelCall("/api/embed", f"m{i}"))
    full.served(ModelCall("/api/embed", "new"))
    assert not knows(full, "m0") and knows(full, "m1") and knows(full, "new")


def test_a_call_no_probe_can_make_again_does_not_enter_the_record():
    r = ServedRecord(MemoryReactorClock(), lambda call: call.path != "/v1/responses")
    r.served(ModelCall("/v1/responses", "gpt"))
    assert len(r) == 0
    r.served(ModelCall("/v1/chat/completions", "gpt"))
    r.served(ModelCall("/v1/responses", "gpt"))
    assert r.calls() == [ModelCall("/v1/chat/completions", "gpt")]


def test_the_record_reads_back_tolerantly_in_the_order_it_was_served():
    clock = MemoryReactorClock()
    clock.advance(100)
    r = record(clock)
    r.served(ModelCall("/api/embed", "here"))
    taken = r.restore([
        {"model": "x", "path": "/api/chat", "name": "older", "first": 10, "last": 20, "served": 3, "in_use": True},
        {"model": "x", "path": "/api/embed", "name": "later", "first": 10, "last": 150, "served": 1},
        "not an entry", {"path": "no slash", "name": "x", "first": 1, "last": 1},
        {"path": "/api/embed", "name": "bad time", "first": "now", "last": 1},
    ])
    assert taken == 2
    # "later" was written at 150, after this clock's 100: clamped to now, so it sorts with what is served here.
    assert [e.model for e in r.recent()] == ["later:latest", "here:latest", "older:latest"]
    assert r.recent()[-1].in_use and r.recent()[-1].served == 3
    assert r.restore("garbage") == 0 and r.restore(None) == 0


def test_the_holds_file_keeps_the_record_beside_the_holds_and_a_bad_record_refuses_nothing(tmp_path):
    """The ``served`` section is the file's own top-level key: written with the holds, read back by its owner;
    a section that is missing or malformed gives an empty record (logged), and the holds are restored."""
    path = tmp_path / "holds.json"
    clock = MemoryReactorClock()
    clock.advance(50)
    store = HoldStore(clock, path)
    mine = record(clock)
    keeper = RecordKeeper.of(clock, [("default", "http://127.0.0.1:11434", mine)], lambda: None)
    store.keep_section("served", keeper.section, lambda section: keeper.restore(section, "holds file"))
    state = YieldState(clock)
    keep_holds(state, store, 600)
    mine.served(ModelCall("/api/embed", MODEL))
    state.hold("broker", "game", for_seconds=600)
    document = json.loads(path.read_text())
    assert [h["source"] for h in document["holds"]] == ["broker"]
    assert document["served"]["default"]["models"][0]["model"] == "all-minilm:latest"

    def restarted(served) -> tuple[YieldState, ServedRecord, LogCapture]:
        if served is not ...:
            document["served"] = served
        else:
            document.pop("served", None)
        path.write_text(json.dumps(document))
        state = YieldState(clock)
        again = record(clock)
        keeper = RecordKeeper.of(clock, [("default", "http://127.0.0.1:11434", again)], lambda: None)
        store = HoldStore(clock, path)
        store.keep_section("served", keeper.section, lambda section: keeper.restore(section, "holds file"))
        with LogCapture() as logs:
            keep_holds(state, store, 600)
        return state, again, logs

    state, again, _ = restarted(document["served"])
    assert knows(again, MODEL) and [h.source for h in state.holds] == ["broker"]
    for bad in (..., "garbage", {"default": {"url": "http://127.0.0.1:11434", "models": "garbage"}},
                {"default": {"url": "http://elsewhere:1", "models": [{"path": "/api/embed", "name": "m", "first": 1, "last": 1}]}}):
        state, again, logs = restarted(bad)
        assert len(again) == 0, bad
        assert [h.source for h in state.holds] == ["broker"]  # the holds file was not refused
        assert state.hold_of("restart") is None
        if bad in ("garbage", {"default": {"url": "http://127.0.0.1:11434", "models": "garbage"}}):
            assert any("served" in str(e.get("log_format", "")) for e in logs.events)


def test_the_record_is_written_at_once_then_at_most_once_every_few_seconds_and_when_the_proxy_stops():
    clock = MemoryReactorClock()
    writes: list[float] = []
    r = record(clock)
    keeper = RecordKeeper.of(clock, [("default", "u", r)], lambda: writes.append(clock.seconds()))
    keeper.startService()
    r.served(ModelCall("/api/embed", "a"))
    assert writes == [0.0]
    for name in ("b", "c", "d"):
        clock.advance(1)
        r.served(ModelCall("/api/embed", name))
    assert writes == [0.0]
    clock.advance(WRITE_DELAY - 3)
    assert writes == [0.0, WRITE_DELAY]
    # Served again (no model enters): nothing to write.
    r.served(ModelCall("/api/embed", "a"))
    clock.advance(WRITE_DELAY)
    assert writes == [0.0, WRITE_DELAY]
    r.served(ModelCall("/api/embed", "e"))
    r.served(ModelCall("/api/embed", "f"))
    assert len(writes) == 3
    clock.advance(1)
    r.served(ModelCall("/api/embed", "g"))
    keeper.stopService()  # what is pending is written
    assert len(writes) == 4 and clock.getDelayedCalls() == []


def test_after_a_reload_the_record_is_the_new_processs_and_the_old_one_writes_it_no_more(tmp_path):
    """Who owns the record at the handover: the new process takes the old one's (the ``state`` frame) and writes
    it; the old process, still finishing its requests in flight, serves a model more and writes nothing (the
    holds file is the new process's), so nothing it does later erases what the new one wrote."""
    path = tmp_path / "holds.json"
    old_clock = MemoryReactorClock()
    old = verdict_rig(reactor=old_clock, holds=HoldStore(old_clock, path, pid=1, running=lambda pid: True))
    healthy(old, "in the old process")
    new_clock = MemoryReactorClock()
    new_clock.advance(10)  # it claims the file after the old one did
    new = verdict_rig(reactor=new_clock, holds=HoldStore(new_clock, path, pid=2, running=lambda pid: True))
    reload_of(new).restore(json.loads(json.dumps(reload_of(old).snapshot())))
    written = lambda: [m["model"] for m in json.loads(path.read_text())["served"]["default"]["models"]]  # noqa: E731
    assert written() == ["all-minilm:latest"]
    assert json.loads(path.read_text())["pid"] == 2
    # The old process answers one more request, of another model: its record changes, the file does not.
    assert answer_of(old, embed(old, "late", model="late"), 5).code == 200
    old_clock.advance(WRITE_DELAY)
    assert knows(old.proxy.health.record, "late")
    assert written() == ["all-minilm:latest"]
    new.stop()
    old.stop()
    assert written() == ["all-minilm:latest"]
