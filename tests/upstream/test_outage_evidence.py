"""Outage evidence no client can manufacture (issue 31, class 1).

A client on the proxy port only can copy a working model under names of its own (``/api/copy``,
``/api/create`` pass through), get each served, then break them (re-create them with settings that make
every load fail, or let them hang).  Whatever it does, the proxy never holds the upstream while the model
in real use serves: the outage probes ask for the model of most standing first (served in the most
distinct minutes, upstream/served.py), a model redefined by a management call loses its standing, the
follow-ups of a held outage reach every model the upstream served, and one model answered 2xx ends an
outage hold.  A real outage (every model failing) is still held, and ends when the GPU is back.

Driven in memory on a Clock (tests/inmemory.py) against the simulated Ollama, whose ``/api/copy``,
``/api/create`` and ``/api/delete`` act on its models (a create with ``parameters.num_gpu`` of 1000 or
more fails every load in Ollama's out-of-memory words).
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings, strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock

from helpers import config_with, knows
from inmemory import Answer, Rig, answered
from yieldproxy.servers.base import ModelCall
from yieldproxy.tools.sim import expected_embedding
from yieldproxy.tools.sim.ollama import FAILING_NUM_GPU
from yieldproxy.upstream.served import ServedRecord, redefined_by

MODEL = "all-minilm"
#: Minutes of real use of MODEL before the client starts (the model it vouches for).
HISTORY_MINUTES = 60


def rig_in_use(**config) -> Rig:
    """A proxy with outage detection, whose upstream served MODEL once a minute for an hour."""
    config.setdefault("upstream", {})
    config["upstream"] = {"health_interval_seconds": 0.5, "health_max_interval_seconds": 10, **config["upstream"]}
    # Enough parallel slots on the sim that a client's hung calls never starve the model in use of one.
    rig = Rig(config_with(**config), watchers=True, reactor=MemoryReactorClock(), parallel=64)
    rig.start()
    rig.until(lambda: rig.proxy.health.reachable, 10)
    for minute in range(HISTORY_MINUTES):
        served(rig, f"real use {minute}")
        rig.run(60)
    return rig


def embed(rig: Rig, text: str, model: str = MODEL) -> Deferred:
    return rig.post("/api/embed", {"model": model, "input": text})


def served(rig: Rig, text: str) -> None:
    """A caller of the model in real use: answered within a second of the clock, its vector right, never parked."""
    d = embed(rig, text)
    rig.until(lambda: answered(d), 1)
    answer: Answer = rig.result(d)
    assert answer.code == 200, answer.body
    assert answer.header("x-yield-parked-seconds") is None
    assert answer.json()["embeddings"][0] == expected_embedding(text, MODEL)


def held(rig: Rig) -> bool:
    return rig.proxy.state.hold_of("outage") is not None


def answer_of(rig: Rig, d: Deferred, seconds: float = 1) -> Answer:
    rig.until(lambda: answered(d), seconds)
    return rig.result(d)


def manage(rig: Rig, method: str, path: str, body: dict) -> Answer:
    d = rig.request(method, rig.proxy_url + path, json=body)
    rig.until(lambda: answered(d), 5)
    return rig.result(d)


def copy(rig: Rig, name: str) -> None:
    assert manage(rig, "POST", "/api/copy", {"source": MODEL, "destination": name}).code == 200


def break_by_create(rig: Rig, name: str) -> None:
    """Re-create ``name`` from the working model with settings that make every load fail."""
    body = {"model": name, "from": MODEL, "parameters": {"num_gpu": FAILING_NUM_GPU}}
    assert manage(rig, "POST", "/api/create", body).code == 200


# -- the attack, as it was found ---------------------------------------------------------------------------


def test_copies_of_a_working_model_served_then_broken_never_hold_the_upstream():
    """Three copies of the working model, each served once, then re-created broken: a request for one of them
    is judged by a probe of the model in real use (it passes), so it fails alone, nobody parks, and the model
    in use is answered at once throughout.  (Before: the copies were the most recently served models, the
    probe asked for one of them, the outage hold was taken and every follow-up probe asked only the broken
    copies: the hold never ended.)"""
    rig = rig_in_use()
    names = ["mine-1", "mine-2", "mine-3"]
    for name in names:
        copy(rig, name)
        assert answer_of(rig, embed(rig, "once", model=name)).code == 200
    for name in names:
        break_by_create(rig, name)
    broken = embed(rig, "x", model="mine-1")
    for i in range(30):
        rig.run(10)
        assert not held(rig)
        served(rig, f"meanwhile {i}")
    assert answered(broken)
    assert rig.result(broken).code == 500
    assert rig.sample("yieldproxy_yields_total", source="outage") == 0
    rig.stop()


def test_copies_that_break_without_a_management_call_never_hold_the_upstream_either():
    """The copies break by themselves (a hung load, a broken file: no call the proxy sees redefines them):
    served once each, they have a point of standing each, the model in real use an hour's worth, so the probe
    asks for the model in use and every copy fails alone."""
    rig = rig_in_use()
    for i, mode in enumerate(["hang", "error500", "error500_unknown", "hang"]):
        name = f"quiet-{i}"
        copy(rig, name)
        answer_of(rig, embed(rig, "once", model=name))
        rig.sim.set_model_mode(name, mode)
    asks = [embed(rig, "x", model=f"quiet-{i}") for i in range(4)]
    for i in range(70):
        rig.run(10)
        assert not held(rig)
        served(rig, f"meanwhile {i}")
    assert all(answered(d) for d in asks)
    assert rig.sample("yieldproxy_yields_total", source="outage") == 0
    rig.stop()


def test_every_served_model_is_probed_in_turn_so_no_set_of_broken_ones_keeps_a_hold():
    """Whatever put the hold in place, the follow-up probes reach every model the upstream served (the one of
    most standing first, four at a time), so a hold taken while the model in use works ends within a few
    steps.  Here the client did all it can: six copies kept warm for ninety minutes (more standing than the
    model in use's hour), the model in use re-created as it was (a no-op that costs it its standing), then
    the copies broken without a call the proxy sees.  The hold is taken, ends at the second step, and is
    not taken again."""
    rig = rig_in_use()
    names = [f"long-{i}" for i in range(6)]
    for name in names:
        copy(rig, name)
    for _minute in range(90):
        for name in names:
            answer_of(rig, embed(rig, "kept warm", model=name))
        rig.run(60)
    assert manage(rig, "POST", "/api/create", {"model": MODEL, "from": MODEL}).code == 200
    for name in names:
        rig.sim.set_model_mode(name, "error500")
    broken = embed(rig, "x", model="long-0")
    rig.until(lambda: held(rig), 10)
    outage = next(s for s in rig.proxy.watchers if s.name == "watcher:outage")
    assert outage.status()["outage_probes"][-1] == "/api/embed with model all-minilm"
    rig.until(lambda: not held(rig), 30)
    # The copies whose probes failed while the model in use passed fail alone from now on: their failures are
    # judged by a probe of the model in use, and the hold is not taken again.  (The broken caller's retries
    # are in line first: a few seconds on, the lot is empty.)
    rig.run(5)
    for i in range(30):
        served(rig, f"after {i}")
        rig.run(10)
        assert not held(rig)
    assert answered(broken) and rig.result(broken).code == 500
    assert rig.sample("yieldproxy_yields_total", source="outage") == 1
    rig.stop()


def test_a_model_answered_2xx_ends_an_outage_hold_at_once_if_its_call_began_after_the_hold():
    """One model that answers disproves an outage of the whole upstream, whatever the probes ask; an answer
    that was on its way when the GPU failed (its call began before the hold) says nothing of the GPU now."""
    rig = rig_in_use()
    rig.sim.set_mode("error500")
    waiting = embed(rig, "during the outage")
    rig.until(lambda: held(rig), 10)
    rig.proxy.health.served(ModelCall("/api/embed", "anything"), rig.clock.seconds() - 5)
    assert held(rig)
    rig.proxy.health.served(ModelCall("/api/embed", "anything"), rig.clock.seconds())
    assert not held(rig)
    rig.sim.set_mode("ok")
    assert answer_of(rig, waiting, 10).code == 200
    rig.stop()


def test_on_a_proxy_that_served_nothing_yet_a_clients_broken_models_hold_for_a_minute_at_most():
    """Nothing served yet, no probe model: several models failing is an outage (it may well be one), but any
    client can make several of its own fail, so such a hold lasts a minute at most; the calls let out then
    decide: the working model is served, and from then on the broken ones fail alone.  (Before: the follow-ups
    asked only the broken models, and the hold never ended.)"""
    rig = Rig(config_with(upstream={"health_interval_seconds": 0.5, "health_max_interval_seconds": 10}),
              watchers=True, reactor=MemoryReactorClock(), parallel=64)
    rig.start()
    rig.until(lambda: rig.proxy.health.reachable, 10)
    for i in range(3):
        break_by_create(rig, f"fresh-{i}")
    asks = [embed(rig, "x", model=f"fresh-{i}") for i in range(3)]
    rig.until(lambda: held(rig), 10)
    waiting = embed(rig, "parked meanwhile")
    rig.until(lambda: not held(rig), 75)
    assert answer_of(rig, waiting, 10).code == 200
    for i in range(20):
        rig.run(10)
        assert not held(rig)
        served(rig, f"after {i}")
    assert all(answered(d) for d in asks)
    rig.stop()


# -- the class: any sequence of management calls and requests a client can send ---------------------------------

COPIES = 4
ops = st.one_of(
    st.tuples(st.just("copy"), st.integers(0, COPIES - 1)),
    st.tuples(st.just("adopt"), st.integers(0, COPIES - 1)),
    st.tuples(st.just("serve"), st.integers(0, COPIES - 1)),
    st.tuples(st.just("create_broken"), st.integers(0, COPIES - 1)),
    st.tuples(st.just("delete"), st.integers(0, COPIES - 1)),
    st.tuples(st.just("quietly"), st.integers(0, COPIES - 1), st.sampled_from(["hang", "error500", "error500_unknown", "ok"])),
    st.tuples(st.just("ask"), st.integers(0, COPIES - 1)),
    st.tuples(st.just("wait"), st.sampled_from([1, 10, 61, 130])),
    st.tuples(st.just("real"),),
)


def play(rig: Rig, op: tuple) -> None:
    """One step of a client's sequence (answers not awaited: a request may hang, fail or be served)."""
    kind = op[0]
    name = f"copy-{op[1]}" if len(op) > 1 and isinstance(op[1], int) else ""
    if kind == "copy":
        rig.request("POST", rig.proxy_url + "/api/copy", json={"source": MODEL, "destination": name})
    elif kind == "adopt":
        # A copy of the working model, served once: the client's own name, as recently served as can be.
        manage(rig, "POST", "/api/copy", {"source": MODEL, "destination": name})
        answer_of(rig, embed(rig, "adopted", model=name), 5)
    elif kind == "create_broken":
        rig.request("POST", rig.proxy_url + "/api/create",
                    json={"model": name, "from": MODEL, "parameters": {"num_gpu": FAILING_NUM_GPU}})
    elif kind == "delete":
        rig.request("DELETE", rig.proxy_url + "/api/delete", json={"model": name})
    elif kind == "quietly":
        rig.sim.set_model_mode(name, op[2])
    elif kind in ("serve", "ask"):
        embed(rig, kind, model=name)
    elif kind == "wait":
        rig.run(op[1])
    else:
        # Real traffic: answered, never held by an outage (it may wait a moment behind a broken model's retry,
        # which keeps its place in line).
        answer = answer_of(rig, embed(rig, "real traffic"), 15)
        assert answer.code == 200 and answer.json()["embeddings"][0] == expected_embedding("real traffic", MODEL)
    rig.run(0.5)


#: The issue's attack: three copies served, then re-created broken, then one asked for.
ATTACK = [("adopt", 0), ("adopt", 1), ("adopt", 2), *(("create_broken", i) for i in range(3)), ("ask", 0), ("wait", 130)]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=25))
@example(ATTACK + [("real",)])
@example([("adopt", i) for i in range(4)] + [("quietly", i, "hang") for i in range(4)] + [("ask", 3), ("wait", 130), ("real",)])
def test_no_sequence_of_management_calls_and_requests_holds_the_upstream_while_the_model_in_use_serves(sequence):
    """At every moment of any sequence, no outage hold while the model in real use serves, and it is answered.  Then a real outage (every model failing) is held, and ends when the GPU is back."""
    rig = rig_in_use()
    for op in sequence:
        play(rig, op)
        assert not held(rig), op
    rig.run(300)
    assert not held(rig)
    assert answer_of(rig, embed(rig, "after the sequence"), 15).code == 200
    # A real outage is still one: every model fails, the hold is taken and kept while it lasts.
    rig.sim.set_mode("error500")
    waiting = embed(rig, "during the outage")
    rig.until(lambda: held(rig), 130)
    rig.run(60)
    assert held(rig) and not answered(waiting)
    rig.sim.set_mode("ok")
    rig.until(lambda: not held(rig), 60)
    rig.until(lambda: answered(waiting), 10)
    assert rig.result(waiting).code == 200
    rig.stop()


# -- the record: standing, and redefinition -------------------------------------------------------------------------


def test_a_burst_of_new_names_never_outranks_a_model_in_real_use():
    clock = MemoryReactorClock()
    record = ServedRecord(clock)
    for _ in range(30):
        record.served(ModelCall("/api/embed", MODEL))
        clock.advance(60)
    for i in range(200):
        record.served(ModelCall("/api/embed", f"burst-{i}"))
        record.served(ModelCall("/api/embed", f"burst-{i}"))
    assert record.calls()[0].model == MODEL
    assert knows(record, MODEL)


def test_a_redefined_model_loses_its_standing_and_a_deleted_one_leaves():
    clock = MemoryReactorClock()
    record = ServedRecord(clock)
    for _ in range(5):
        record.served(ModelCall("/api/embed", MODEL))
        record.served(ModelCall("/api/embed", "other"))
        clock.advance(60)
    record.served(ModelCall("/api/embed", "other"))
    record.redefined("OTHER:latest")
    assert [c.model for c in record.calls()] == [MODEL, "other"]
    record.deleted(MODEL)
    assert not knows(record, MODEL)


def test_the_models_a_management_call_redefines_are_read_as_ollama_reads_them():
    assert redefined_by("/api/create", b'{"model": "a", "name": "b"}') == ("a", None)
    assert redefined_by("/api/create", b'{"Name": "b"}') == ("b", None)
    assert redefined_by("/api/copy", b'{"source": "a", "DESTINATION": "c"}') == ("c", None)
    assert redefined_by("/api/pull", b'{"model": "p"}') == ("p", None)
    assert redefined_by("/api/delete", b'{"model": "d"}') == (None, "d")
    assert redefined_by("/api/embed", b'{"model": "e"}') == (None, None)
    assert redefined_by("/api/create", b"not json") == (None, None)


def test_standing_is_kept_across_restarts_and_an_older_record_reads_back():
    """The holds file keeps each model's standing (a restart does not hand a burst of new names the lead), and
    a record written before standing was kept reads back with a point a model, two for one in use."""
    clock = MemoryReactorClock()
    record = ServedRecord(clock)
    for _ in range(20):
        record.served(ModelCall("/api/embed", MODEL))
        clock.advance(60)
    record.served(ModelCall("/api/embed", "newer"))
    again = ServedRecord(clock)
    assert again.restore(record.as_json()) == 2
    assert [c.model for c in again.calls()] == [MODEL, "newer"]
    old = [
        {"model": "a:latest", "path": "/api/embed", "name": "a", "first": 0, "last": 10, "served": 3, "in_use": True},
        {"model": "b:latest", "path": "/api/embed", "name": "b", "first": 0, "last": 20, "served": 1},
    ]
    older = ServedRecord(clock)
    assert older.restore(old) == 2
    assert [c.model for c in older.calls()] == ["a", "b"]
    assert ServedRecord(clock).restore([{**old[1], "standing": "lots"}]) == 0
