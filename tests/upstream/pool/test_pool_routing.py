"""The pool core on a Clock: eligibility, the choice at admission, per-member counts, the drain (issue 12)."""

from __future__ import annotations

import pytest
from twisted.internet.defer import Deferred

from helpers import Core, config_with, make_pool_core
from yieldproxy.lot.parking import Entry, Refused


def admit(core: Core, cls="batch", path="/api/embed", model="all-minilm", method="POST") -> tuple[Entry, Deferred]:
    entry = Entry(cls=cls, routing=core.scheduler.routing(method, path, cls, model))
    d = core.scheduler.admit(entry)
    return entry, d


def went(d: Deferred) -> bool:
    results = []
    d.addBoth(lambda r: results.append(r) or r)
    return bool(results)


def where(entry: Entry) -> str:
    return entry.released_to


def finish(core: Core, entry: Entry, failed: bool = False) -> None:
    core.scheduler.finished(failed=failed, seconds=0.01, member=entry.released_to)
    core.run()


THREE = (
    {"name": "a", "models": ("all-minilm",)},
    {"name": "b", "models": ("all-minilm", "llama3*")},
    {"name": "c", "api": "openai", "models": ("all-minilm",), "classes": ("batch",)},
)


# -- eligibility ------------------------------------------------------------------------------


def test_eligible_members_serve_the_route_the_class_and_the_model():
    scheduler = make_pool_core(*THREE).scheduler
    # Ollama's own route: the OpenAI-compatible member only translated (test_pool_translated.py).
    assert scheduler.routing("POST", "/api/embed", "batch", "all-minilm").eligible == ("a", "b", "c")
    assert scheduler.routing("POST", "/api/embed", "batch", "all-minilm").translated == {"c"}
    # A route all three serve in one dialect.
    assert scheduler.routing("POST", "/v1/embeddings", "batch", "all-minilm").eligible == ("a", "b", "c")
    # Ollama's names: all-minilm is all-minilm:latest; patterns match.
    assert scheduler.routing("POST", "/v1/embeddings", "batch", "all-minilm:latest").eligible == ("a", "b", "c")
    assert scheduler.routing("POST", "/api/chat", "interactive", "llama3:8b").eligible == ("b",)
    # c may serve batch requests only.
    assert scheduler.routing("POST", "/v1/chat/completions", "interactive", "all-minilm").eligible == ("a", "b")


def test_a_model_nobody_serves_goes_where_the_route_does_so_a_server_answers_in_its_own_words():
    scheduler = make_pool_core(*THREE).scheduler
    assert scheduler.routing("POST", "/api/generate", "interactive", "mistral").eligible == ("a", "b")
    # A route none of the servers knows: every member the class allows.
    assert scheduler.routing("POST", "/custom", "batch", None).eligible == ("a", "b", "c")


def test_routing_is_one_shared_value_per_route_class_and_model():
    scheduler = make_pool_core(*THREE).scheduler
    first = scheduler.routing("POST", "/api/embed", "batch", "all-minilm")
    assert scheduler.routing("POST", "/api/embed", "batch", "all-minilm") is first
    assert first.kind == "embedding" and first.model == "all-minilm"
    assert scheduler.routing("POST", "/api/chat", "interactive", "llama3").kind == "generation"


def test_discovered_models_decide_once_a_list_came():
    core = make_pool_core({"name": "a"}, {"name": "b"})
    scheduler = core.scheduler
    a, b = scheduler.members
    # Nothing known yet: both may serve it.
    assert scheduler.routing("POST", "/api/embed", "batch", "bge-m3").eligible == ("a", "b")
    b.catalogue.update(("bge-m3:latest",))
    a.catalogue.update(("all-minilm:latest",))
    assert scheduler.routing("POST", "/api/embed", "batch", "bge-m3").eligible == ("b",)
    assert scheduler.routing("POST", "/api/embed", "batch", "all-minilm").eligible == ("a",)


# -- the choice at admission --------------------------------------------------------------------


def test_least_in_flight_then_config_order():
    core = make_pool_core({"name": "a"}, {"name": "b"}, {"name": "c"})
    entries = [admit(core)[0] for _ in range(5)]
    assert [where(e) for e in entries] == ["a", "b", "c", "a", "b"]
    finish(core, entries[2])  # c has none in flight now
    assert where(admit(core)[0]) == "c"


def test_a_yielded_member_is_passed_over_and_nothing_parks():
    core = make_pool_core({"name": "a"}, {"name": "b"})
    core.state.hold("api", "game", scope="a")
    entries = [admit(core) for _ in range(4)]
    assert all(went(d) for _, d in entries)
    assert {where(e) for e, _ in entries} == {"b"} and len(core.lot) == 0
    assert core.scheduler.state_name == "available"


def test_all_yielded_parks_and_one_resumed_drains_at_its_own_cap():
    core = make_pool_core({"name": "a", "replay_concurrency": 3}, {"name": "b", "replay_concurrency": 1})
    core.state.hold("api", "game")
    entries = [admit(core) for _ in range(10)]
    assert not any(went(d) for _, d in entries) and len(core.lot) == 10
    assert core.scheduler.state_name == "yielded"
    assert core.scheduler.waiting_for("a") == core.scheduler.waiting_for("b") == 10
    # The desktop comes back; the server stays held.
    core.state.hold("api", "still busy", scope="b")
    core.state.release("api")
    core.run()
    assert [where(e) for e, d in entries if went(d)] == ["a", "a", "a"]
    assert core.scheduler.drainer("a").inflight == 3 and core.scheduler.state_name == "draining"
    # Each answer frees a slot, and the next in line takes it.
    finish(core, entries[0][0])
    assert went(entries[3][1]) and where(entries[3][0]) == "a" and not went(entries[4][1])
    # The other comes back: it drains at its cap of one beside.
    core.state.release("api", "b")
    core.run()
    assert went(entries[4][1]) and where(entries[4][0]) == "b" and not went(entries[5][1])
    assert core.scheduler.waiting_for("a") == core.scheduler.waiting_for("b") == len(core.lot) == 5


def test_no_overtaking_a_new_request_joins_the_tail_while_its_member_drains():
    core = make_pool_core({"name": "a", "replay_concurrency": 1}, {"name": "b", "replay_concurrency": 1})
    core.state.hold("api")
    parked = [admit(core) for _ in range(3)]
    core.state.release("api")
    core.run()
    assert sum(went(d) for _, d in parked) == 2
    # Both members have a request in line for them: a newcomer waits behind it.
    entry, d = admit(core)
    assert not went(d) and entry.was_parked


def test_a_model_served_by_one_member_parks_while_that_one_is_yielded():
    core = make_pool_core({"name": "a", "models": ("llama3",)}, {"name": "b", "models": ("all-minilm",)})
    core.state.hold("api", "game", scope="a")
    chat, waiting = admit(core, "interactive", "/api/chat", "llama3")
    embed, now = admit(core)
    assert not went(waiting) and went(now) and where(embed) == "b"
    assert core.scheduler.waiting_for("a") == 1 and core.scheduler.waiting_for("b") == 0
    core.state.release("api", "a")
    core.run()
    assert went(waiting) and where(chat) == "a"


def test_a_standby_member_serves_only_while_no_always_member_may():
    core = make_pool_core({"name": "gpu"}, {"name": "cpu", "use": "when_others_yielded"})
    entry, d = admit(core)
    assert where(entry) == "gpu"
    # A hold of all leaves the CPU copy alone: it takes over.
    core.state.hold("api", "game")
    assert not core.state.yielded_for("cpu")
    entry, d = admit(core)
    assert went(d) and where(entry) == "cpu"
    core.state.release("api")
    assert where(admit(core)[0]) == "gpu"


def test_the_standby_drains_the_lot_only_while_the_always_ones_are_held():
    core = make_pool_core({"name": "gpu", "replay_concurrency": 2}, {"name": "cpu", "use": "when_others_yielded",
                                                                      "replay_concurrency": 1})
    core.state.hold("api", "game")
    core.state.hold("api", "cpu busy", scope="cpu")
    parked = [admit(core) for _ in range(4)]
    core.state.release("api", "cpu")
    core.run()
    assert [where(e) for e, d in parked if went(d)] == ["cpu"]
    core.state.release("api")
    core.run()
    # The GPU is back: it drains the rest at its cap; the CPU copy takes no more.
    assert [where(e) for e, d in parked if went(d)] == ["cpu", "gpu", "gpu"]
    finish(core, parked[0][0])
    assert not went(parked[3][1])
    finish(core, parked[1][0])
    assert [where(e) for e, d in parked if went(d)] == ["cpu", "gpu", "gpu", "gpu"]


def test_a_failed_attempt_goes_back_and_another_member_takes_it():
    core = make_pool_core({"name": "a"}, {"name": "b"})
    entry, d = admit(core)
    assert where(entry) == "a"
    # The attempt on a failed (retryable): back to its place, b first.
    finish(core, entry, failed=True)
    entry.attempts += 1
    entry.failed_on = "a"
    again = core.scheduler.admit(entry)
    core.run()
    assert went(again) and where(entry) == "b"


def test_the_member_it_failed_on_takes_it_when_no_other_is_available():
    core = make_pool_core({"name": "a"}, {"name": "b"})
    core.state.hold("api", scope="b")
    entry, d = admit(core)
    finish(core, entry, failed=True)
    entry.attempts += 1
    entry.failed_on = "a"
    again = core.scheduler.admit(entry)
    core.run()
    assert went(again) and where(entry) == "a"


def test_over_budget_counts_from_the_soonest_member_back():
    config = config_with(classes={"interactive": {"hold_seconds": 15}})
    core = make_pool_core({"name": "a"}, {"name": "b"}, config=config)
    core.state.hold("api", expected_seconds=600, scope="a")
    core.state.hold("api", expected_seconds=10, scope="b")
    # b is back within the bound: it parks.
    entry, d = admit(core, "interactive", "/api/chat", "m")
    assert not went(d)
    core.state.hold("api", expected_seconds=600, scope="b")
    with pytest.raises(Refused) as refused:
        admit(core, "interactive", "/api/chat", "m")
    assert refused.value.reason == "over_budget"


def test_unreachable_member_is_passed_over_until_a_check_answers():
    from twisted.internet.defer import Deferred as D

    core = make_pool_core({"name": "a"}, {"name": "b"})
    a = core.scheduler.member("a")

    class Control:
        def __init__(self):
            self.calls = []

        def request(self, method, path, body=None, timeout=10.0):
            d = D()
            self.calls.append((path, d))
            return d

    control = a.control = Control()
    a.refused()
    assert not a.available() and a.state_name() == "unreachable"
    assert [where(admit(core)[0]) for _ in range(3)] == ["b", "b", "b"]
    core.run(0.6)
    assert [p for p, _ in control.calls] == ["/api/version"]
    control.calls[0][1].errback(ConnectionRefusedError())
    core.run(1.1)
    assert len(control.calls) == 2  # checked again, a longer wait later
    control.calls[1][1].callback(object())
    assert a.available() and a.health.reachable
    a.stop()
    assert core.clock.getDelayedCalls() == []


def test_per_member_counts_follow_parking_and_leaving():
    core = make_pool_core({"name": "a", "models": ("x",)}, {"name": "b", "models": ("x", "y")})
    core.state.hold("api")
    x = [admit(core, model="x") for _ in range(3)]
    y = [admit(core, model="y") for _ in range(2)]
    assert (core.scheduler.waiting_for("a"), core.scheduler.waiting_for("b")) == (3, 5)
    x[0][1].cancel()  # its client went away
    assert (core.scheduler.waiting_for("a"), core.scheduler.waiting_for("b")) == (2, 4)
    core.state.release("api")
    core.run()
    assert len(core.lot) == 0 and core.scheduler.waiting_for("a") == core.scheduler.waiting_for("b") == 0
    assert all(went(d) for _, d in x[1:] + y)


def test_a_pool_of_one_reads_as_the_one_upstream_did():
    from helpers import make_core

    core = make_core()
    scheduler = core.scheduler
    assert scheduler.names == ("default",)
    entry = Entry(cls="batch")
    core.scheduler.admit(entry)
    assert entry.released_to == "default" and entry.eligible == ("default",)
    core.state.hold("api")
    assert core.scheduler.state_name == "yielded"
    assert scheduler.status()[0]["state"] == "yielded"


def test_a_drainer_walks_only_the_requests_its_member_may_take(monkeypatch):
    """A thousand requests parked for a yielded member cost the other member's drain nothing per release."""
    from yieldproxy.schedule.scheduler import Scheduler

    looked = []
    may_take = Scheduler.may_take
    monkeypatch.setattr(Scheduler, "may_take", lambda self, name, entry: looked.append(name) or may_take(self, name, entry))
    core = make_pool_core(
        {"name": "big", "models": ("llama3",)}, {"name": "small", "models": ("all-minilm",), "replay_concurrency": 2},
    )
    core.state.hold("api", "game", scope="big")
    waiting = [admit(core, "batch", "/api/embed", "llama3")[1] for _ in range(1000)]
    core.state.hold("api", "busy", scope="small")
    embeds = [admit(core) for _ in range(10)]
    looked.clear()
    core.state.release("api", "small")
    core.run()
    finished = set()
    while len(finished) < len(embeds):
        running = [e for e, d in embeds if went(d) and id(e) not in finished]
        assert running, "the drain stopped"
        for entry in running:
            finished.add(id(entry))
            finish(core, entry)
    assert looked and len(looked) < 50, len(looked)
    assert not any(went(d) for d in waiting) and core.scheduler.waiting_for("big") == 1000


def test_a_standby_member_does_not_look_through_the_lot_while_the_always_ones_drain_it(monkeypatch):
    from yieldproxy.schedule.scheduler import Scheduler

    looked = []
    may_take = Scheduler.may_take
    monkeypatch.setattr(Scheduler, "may_take", lambda self, name, entry: looked.append(name) or may_take(self, name, entry))
    core = make_pool_core({"name": "gpu", "replay_concurrency": 1}, {"name": "cpu", "use": "when_others_yielded"})
    core.state.hold("api")
    core.state.hold("api", scope="cpu")
    parked = [admit(core) for _ in range(500)]
    core.state.release("api", "cpu")
    core.state.release("api")
    core.run()
    looked.clear()
    # New arrivals join the tail while the GPU drains: the CPU copy's drainer is woken each time.
    for _ in range(100):
        admit(core)
    core.run()
    assert looked.count("cpu") == 0
    assert sum(went(d) for _, d in parked) == 1


def test_the_twin_check_decides_at_each_choice_and_release():
    """The hook the twin verification plugs into: an embedding goes only where it says, re-asked each time."""
    verified = {"twin": False}
    core = make_pool_core(
        {"name": "ref"}, {"name": "twin"},
        twin_ok=lambda member, entry: entry.kind != "embedding" or member.name == entry.eligible[0] or verified[member.name],
    )
    scheduler = core.scheduler
    core.state.hold("api", "game", scope="ref")
    chat, now = admit(core, "interactive", "/api/chat", "all-minilm")
    embed, waiting = admit(core)
    assert went(now) and chat.released_to == "twin"
    assert not went(waiting) and core.scheduler.waiting_for("twin") == 1
    verified["twin"] = True
    scheduler.kick()
    core.run()
    assert went(waiting) and embed.released_to == "twin"


def test_a_standby_member_takes_no_more_than_its_cap_arrivals_included():
    """A CPU copy serving through a game is not handed every arrival at once: the rest wait in line for it."""
    core = make_pool_core({"name": "gpu"}, {"name": "cpu", "use": "when_others_yielded", "replay_concurrency": 2})
    core.state.hold("api", "game")
    arrivals = [admit(core) for _ in range(5)]
    assert [where(e) for e, d in arrivals if went(d)] == ["cpu", "cpu"]
    assert core.scheduler.drainer("cpu").inflight == 2 and len(core.lot) == 3
    finish(core, arrivals[0][0])
    core.run()
    assert [where(e) for e, d in arrivals if went(d)] == ["cpu", "cpu", "cpu"]
    # An always member's arrivals are not capped (as a single upstream's never were).
    core.state.release("api")
    core.run()
    assert all(went(d) for _, d in arrivals)


def test_a_long_line_a_member_may_not_take_is_asked_about_once_per_kind_of_request():
    """Parking kicks every drainer, and a drainer looks along its line: a thousand embeddings its twin
    check refuses cost it one question per kind of request (routing, failed member), not one each."""
    asked = []

    def only_the_reference_embeds(member, entry):
        asked.append(member.name)
        return entry.kind != "embedding" or member.name == "ref"

    core = make_pool_core({"name": "ref"}, {"name": "twin"}, twin_ok=only_the_reference_embeds)
    core.state.hold("api", "game", scope="ref")
    for _ in range(200):
        admit(core)
    core.run()
    assert len(core.lot) == 200
    asked.clear()
    core.scheduler.drainer("twin").kick()
    assert len(asked) <= 4, len(asked)


def _park_seconds(core: Core, count: int) -> float:
    """The least CPU seconds one park took over ``count`` parks (the least: the machine is shared)."""
    import time

    best = float("inf")
    for _ in range(count):
        began = time.process_time()
        admit(core)
        best = min(best, time.process_time() - began)
    return best


def test_parking_costs_the_same_with_a_long_line_a_member_may_not_take():
    """Issue 16 §5: parking stays O(1) per request in every case.  While the reference games, an
    unverified twin's line fills with embeddings it may not take; every park wakes its drainer,
    which must not look along that whole line (an index per kind of request says it at once)."""
    core = make_pool_core(
        {"name": "ref"}, {"name": "twin"}, config=config_with(parking={"max_parked": 30_000}),
        twin_ok=lambda member, entry: entry.kind != "embedding" or member.name == "ref",
    )
    core.state.hold("api", "game", scope="ref")
    for _ in range(500):
        admit(core)
    short = _park_seconds(core, 200)
    for _ in range(20_000):
        admit(core)
    long = _park_seconds(core, 200)
    assert len(core.lot) == 20_900
    # With the walk, a park at 20,900 parked cost about ten times one at 500; with the index, the same.
    assert long < 3 * short + 0.00005, (short, long)
