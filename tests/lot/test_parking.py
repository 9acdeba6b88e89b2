"""The lot, the scheduler and the replayer, driven by a Clock: no sockets, milliseconds each."""

from __future__ import annotations

import attrs
import pytest
from twisted.internet.defer import CancelledError

from helpers import clock_cooperator, config_with, make_core
from yieldproxy.lot.parking import Entry, Refused, Standing
from yieldproxy.lot.replay import Replayer
from yieldproxy.schedule.routing import Routing


def park(core, cls="batch", size=10, max_wait=None, attempts=0):
    """Admit an entry and collect what happens to it, refusals as the caller reads them (``scheduler.explain``)."""
    entry = Entry(cls=cls, size=size, max_wait=max_wait)
    entry.attempts = attempts
    outcome = {"entry": entry}
    try:
        d = core.scheduler.admit(entry)
    except Refused as refusal:
        outcome["refused"] = core.scheduler.explain(refusal)
        return outcome
    outcome["deferred"] = d

    def released(e):
        outcome["released_at"] = core.clock.seconds()
        return e

    def failed(f):
        outcome["failure"] = core.scheduler.explain(f.value) if f.check(Refused) else f.value
        return None

    d.addCallbacks(released, failed)
    return outcome


def released(outcomes):
    return [o for o in outcomes if "released_at" in o]


def heads(lot, accepts=None):
    """Each waiting class's first entry (that ``accepts`` allows): what a member's line hands ``release_first``."""
    found = {}
    for entry in lot.entries():
        if entry.cls not in found and (accepts is None or accepts(entry)):
            found[entry.cls] = entry
    return found


def next_out(lot, accepts=None):
    """The entry ``release_first`` would let out now (of those ``accepts`` allows), nothing released."""
    first = heads(lot, accepts)
    cls = lot._next_class(first)
    return first[cls] if cls is not None else None


def release(lot, accepts=None, target=None):
    """Let out the next entry (of those ``accepts`` allows) in the lot's drain order, to ``target``."""
    return lot.release_first(heads(lot, accepts), target)


def finish(core, outcome, failed=False):
    """The upstream exchange of a released entry ended."""
    assert "released_at" in outcome
    core.scheduler.finished(failed=failed, seconds=0.01)


def test_a_standing_is_every_field_a_parked_request_has_earned_written_and_taken_up_in_one_place():
    """What a reload carries (lifecycle/succession/wire.py) is one record: an entry taken up from it writes
    the same record again, every field set (a field added to one side only fails here)."""
    earned = {
        "cls": "long", "max_wait": 30.0, "attempts": 2, "forgiven": 3, "parked_seconds": 12.5,
        "first_parked": 100.0, "deadline": 700.0, "bound_by_caller": True, "failed_on": "gpu-b",
    }
    assert set(earned) == {f.name for f in attrs.fields(Standing)}
    standing = Standing(**earned)
    routing = Routing(eligible=("gpu-a", "gpu-b"), model="m", kind="embedding")
    entry = Entry.resumed(standing, size=10, api="openai", routing=routing)
    assert (entry.size, entry.api, entry.routing, entry.was_parked) == (10, "openai", routing, True)
    assert entry.standing(now=0.0) == standing
    # Parked since 110: the stay it is in counts up to when it is written.
    entry.parked_at = 110.0
    assert entry.standing(now=114.0).parked_seconds == 16.5
    # A member that may not serve it here is no longer the one it "failed on".
    elsewhere = Entry.resumed(standing, size=10, api="ollama", routing=Routing(eligible=("gpu-a",)))
    assert elsewhere.failed_on is None

def test_available_and_empty_goes_at_once():
    core = make_core()
    o = park(core)
    assert "released_at" in o and not o["entry"].was_parked
    assert core.replayer.inflight == 1
    finish(core, o)
    assert core.replayer.inflight == 0
    assert core.clock.getDelayedCalls() == []


def test_yielded_parks_and_releases_in_fifo_order_on_resume():
    core = make_core(concurrency=100)
    core.state.hold("api", "game")
    outcomes = [park(core) for _ in range(10)]
    core.run(1)
    assert released(outcomes) == []
    assert core.scheduler.state_name == "yielded"
    assert core.sample("yieldproxy_parked_requests", **{"class": "batch"}) == 10
    assert core.sample("yieldproxy_yield_active") == 1
    core.state.release("api")
    core.run(0.01)
    order = [o["entry"].seq for o in released(outcomes)]
    assert order == sorted(order) and len(order) == 10
    assert all(o["entry"].was_parked for o in outcomes)
    assert core.sample("yieldproxy_parked_requests", **{"class": "batch"}) == 0
    assert core.sample("yieldproxy_park_seconds_count", **{"class": "batch"}) == 10
    for o in outcomes:
        finish(core, o)
    assert core.clock.getDelayedCalls() == []


def test_replay_never_exceeds_the_concurrency_cap():
    core = make_core(concurrency=3)
    core.state.hold("api")
    outcomes = [park(core) for _ in range(10)]
    core.state.release("api")
    core.run(0.01)
    assert len(released(outcomes)) == 3
    assert core.replayer.inflight == 3
    assert core.scheduler.state_name == "draining"
    # Each finished request frees exactly one slot, taken by the next in line.
    for expected in range(4, 11):
        finish(core, released(outcomes)[expected - 4])
        core.run(0.01)
        assert len(released(outcomes)) == expected
        assert core.replayer.inflight <= 3
    for o in released(outcomes)[7:]:
        finish(core, o)
    assert core.scheduler.state_name == "available"
    assert core.clock.getDelayedCalls() == []


def test_replay_rate_paces_the_starts():
    core = make_core(concurrency=100, rate=10.0)
    core.state.hold("api")
    outcomes = [park(core) for _ in range(5)]
    core.state.release("api")
    core.run(0.45)
    times = [o["released_at"] for o in released(outcomes)]
    assert len(times) == 5
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(gap == pytest.approx(0.1, abs=0.002) for gap in gaps)
    # The first goes at once: the pace is between starts, not before the first.
    assert times[0] == pytest.approx(0.0, abs=0.002)


def test_arrivals_during_the_drain_join_the_tail():
    core = make_core(concurrency=1)
    core.state.hold("api")
    first = [park(core) for _ in range(3)]
    core.state.release("api")
    core.run(0.01)
    late = park(core)
    assert "released_at" not in late and late["entry"].was_parked
    for i in range(3):
        finish(core, first[i])
        core.run(0.01)
    assert "released_at" in late
    assert late["released_at"] >= first[2]["released_at"]


def test_a_new_yield_stops_the_release_and_keeps_the_order():
    core = make_core(concurrency=1)
    core.state.hold("api")
    outcomes = [park(core) for _ in range(4)]
    core.state.release("api")
    core.run(0.01)
    assert len(released(outcomes)) == 1
    core.state.hold("game")
    finish(core, outcomes[0])
    core.run(1)
    assert len(released(outcomes)) == 1
    assert [e.seq for e in core.lot.entries()] == [o["entry"].seq for o in outcomes[1:]]
    core.state.release("game")
    for o in outcomes[1:]:
        core.run(0.01)
        finish(core, o)
    assert len(released(outcomes)) == 4


def test_hold_bound_expires_with_a_503_and_retry_after():
    core = make_core()
    core.state.hold("api", "game")
    o = park(core, cls="interactive")
    core.run(14.9)
    assert "failure" not in o
    core.run(0.2)
    refusal = o["failure"]
    assert isinstance(refusal, Refused)
    assert refusal.status == 503 and refusal.reason == "expired"
    assert "hold bound" in refusal.message
    # While the yield lasts with no declared end, the hint is as long as it has lasted.
    assert 15 <= refusal.retry_after <= 16
    assert len(core.lot) == 0
    assert core.sample("yieldproxy_park_seconds_count", **{"class": "interactive"}) == 1


def test_each_class_has_its_own_hold_bound():
    core = make_core()
    core.state.hold("api")
    outcomes = {cls: park(core, cls=cls) for cls in ("interactive", "batch", "long")}
    core.run(16)
    assert "failure" in outcomes["interactive"] and "failure" not in outcomes["batch"]
    core.run(600)
    assert "failure" in outcomes["batch"] and "failure" not in outcomes["long"]
    core.run(3000)
    assert "failure" in outcomes["long"]


def test_caller_max_wait_shortens_the_hold_never_lengthens_it():
    core = make_core()
    core.state.hold("api")
    short = park(core, cls="batch", max_wait=2)
    longer = park(core, cls="interactive", max_wait=100)
    core.run(2.1)
    assert "X-Yield-Max-Wait" in short["failure"].message
    assert "failure" not in longer
    core.run(13)
    assert "hold bound" in longer["failure"].message


def test_full_lot_answers_at_once_with_the_configured_status():
    core = make_core(config_with(parking={"max_parked": 3, "reject_status": 429}))
    core.state.hold("api", expected_seconds=42)
    outcomes = [park(core) for _ in range(3)]
    assert all("deferred" in o for o in outcomes)
    over = park(core)
    refusal = over["refused"]
    assert refusal.status == 429 and refusal.reason == "queue_full"
    assert refusal.retry_after == 42  # the declared end of the yield
    assert core.sample("yieldproxy_rejected_total", **{"class": "batch", "reason": "queue_full"}) == 1


def test_byte_ceiling_and_class_ceiling():
    core = make_core(config_with(parking={"max_parked_bytes": 100}, classes={"batch": {"max_parked": 2}}))
    core.state.hold("api")
    assert "deferred" in park(core, size=60)
    assert "refused" in park(core, cls="interactive", size=50)
    assert "deferred" in park(core, size=10)
    assert park(core, size=10)["refused"].message.startswith("parked queue full for batch")
    assert "deferred" in park(core, cls="interactive", size=10)


def test_disconnected_client_leaves_the_lot_at_once_and_is_never_released():
    core = make_core(concurrency=10)
    core.state.hold("api")
    outcomes = [park(core) for _ in range(3)]
    outcomes[1]["deferred"].cancel()
    assert isinstance(outcomes[1]["failure"], CancelledError)
    assert len(core.lot) == 2
    assert core.lot.parked_bytes == 20
    core.state.release("api")
    core.run(0.01)
    assert "released_at" not in outcomes[1]
    assert [o["entry"].seq for o in released(outcomes)] == [outcomes[0]["entry"].seq, outcomes[2]["entry"].seq]


def test_failed_attempt_goes_back_to_its_original_place():
    core = make_core(concurrency=1)
    core.state.hold("api")
    outcomes = [park(core) for _ in range(3)]
    core.state.release("api")
    core.run(0.01)
    head = outcomes[0]["entry"]
    # Its attempt fails as the GPU is taken again: it re-parks ahead of the others.
    core.state.hold("api")
    core.scheduler.finished(failed=True)
    head.attempts = 1
    seen = []
    core.scheduler.admit(head).addCallback(seen.append)
    assert next_out(core.lot) is head
    assert [e.seq for e in core.lot.entries()] == sorted(o["entry"].seq for o in outcomes)
    core.state.release("api")
    core.run(0.01)
    assert seen == [head]


def test_returning_entry_is_not_refused_by_a_full_lot():
    core = make_core(config_with(parking={"max_parked": 1}))
    core.state.hold("api")
    park(core)
    entry = Entry(cls="batch")
    entry.attempts = 1
    d = core.scheduler.admit(entry)
    assert len(core.lot) == 2
    d.cancel()


def test_backoff_after_repeated_failures():
    core = make_core(config_with(upstream={"retry_backoff_seconds": 1.0}), concurrency=1)
    core.state.hold("api")
    o = park(core)
    core.state.release("api")
    core.run(0.01)
    entry = o["entry"]
    seen = []
    # The first failure retries at once (often a stale pooled connection)...
    core.scheduler.finished(failed=True)
    entry.attempts = 1
    core.scheduler.admit(entry).addCallback(seen.append)
    core.run(0.01)
    assert len(seen) == 1
    # ...the second in a row pauses the release for retry_backoff_seconds.
    core.scheduler.finished(failed=True)
    entry.attempts = 2
    core.scheduler.admit(entry).addCallback(seen.append)
    core.run(0.9)
    assert len(seen) == 1
    core.run(0.2)
    assert len(seen) == 2
    # A declared resume ends the pause at once...
    core.scheduler.finished(failed=True)
    entry.attempts = 3
    core.scheduler.admit(entry).addCallback(seen.append)
    core.run(0.01)
    assert len(seen) == 2
    core.state.hold("api")
    core.state.release("api")
    core.run(0.01)
    assert len(seen) == 3
    # ...and a success ends the streak.
    core.scheduler.finished(failed=False)
    assert park(core)["released_at"] is not None


def test_policy_reject_refuses_during_a_yield_only():
    core = make_core(config_with(classes={"interactive": {"policy": "reject"}}))
    assert "released_at" in park(core, cls="interactive")
    core.scheduler.finished()
    core.state.hold("api", expected_seconds=30)
    refusal = park(core, cls="interactive")["refused"]
    assert refusal.reason == "policy" and refusal.retry_after == 30
    assert "policy rejects interactive" in refusal.message


def test_declared_yield_longer_than_the_budget_is_refused_at_once():
    core = make_core()
    core.state.hold("api", expected_seconds=60)
    refusal = park(core, cls="interactive")["refused"]
    assert refusal.reason == "over_budget" and refusal.retry_after == 60
    refusal = park(core, cls="batch", max_wait=10)["refused"]
    assert "X-Yield-Max-Wait" in refusal.message
    assert "deferred" in park(core, cls="batch")


def test_shutdown_refuses_parked_requests_with_503():
    core = make_core()
    core.state.hold("api")
    outcomes = [park(core) for _ in range(3)]
    assert core.scheduler.refuse_all_parked("shutting down") == 3
    assert all(o["failure"].status == 503 and o["failure"].reason == "shutdown" for o in outcomes)
    assert len(core.lot) == 0
    core.scheduler.stop_admitting()
    assert park(core)["refused"].reason == "shutdown"


def test_an_answer_sent_before_the_failure_does_not_end_the_backoff():
    """Answers already on their way when the upstream broke say nothing about it now."""
    core = make_core(config_with(upstream={"retry_backoff_seconds": 1.0}), concurrency=10)
    early = park(core)  # goes at once; its answer comes back after the failures
    core.run(0.5)
    failing = park(core)
    entry = failing["entry"]
    seen = []
    for attempt in (1, 2):
        core.scheduler.finished(failed=True, seconds=0.0)
        entry.attempts = attempt
        core.scheduler.admit(entry).addCallback(seen.append)
        core.run(0.001)
    assert len(seen) == 1  # the second failure started a 1 s pause
    core.scheduler.finished(failed=False, seconds=0.6)  # early's answer: sent before the failures
    core.run(0.5)
    assert len(seen) == 1
    core.run(0.6)
    assert len(seen) == 2
    assert "released_at" in early


# -- draining into several targets: a predicate over entries, one drain order ----------------------


def test_a_target_takes_the_next_entry_it_may_serve_in_the_lots_drain_order():
    core = make_core()
    core.state.hold("api")
    # Arrival order: b0 i1 b2 i3 b4 i5 i6 i7; the target may serve the even-numbered ones and i5.
    classes = ["batch", "interactive", "batch", "interactive", "batch", "interactive", "interactive", "interactive"]
    outcomes = [park(core, cls=cls) for cls in classes]
    entries = [o["entry"] for o in outcomes]
    mine = {entries[i].seq for i in (0, 2, 4, 5)}

    def accepts(entry):
        return entry.seq in mine

    order = []
    while (entry := release(core.lot, accepts, "other")) is not None:
        order.append(entries.index(entry))
        assert entry.released_to == "other" and outcomes[order[-1]]["released_at"] is not None
    # Interactive first (i5, its only one), then batch in FIFO order.
    assert order == [5, 0, 2, 4]
    # The rest kept their places, in arrival order, for the primary.
    assert [entries.index(e) for e in core.lot.entries()] == [1, 3, 6, 7]
    assert next_out(core.lot, accepts) is None
    core.state.release("api")
    core.run(0.01)
    assert [entries.index(o["entry"]) for o in released(outcomes) if o["entry"].released_to == "default"] == [1, 3, 6, 7]


def test_min_share_counts_only_the_classes_a_target_could_serve():
    core = make_core()
    core.state.hold("api")
    batch = [park(core, cls="batch")["entry"] for _ in range(2)]
    inter = [park(core, cls="interactive")["entry"] for _ in range(10)]
    # A target that serves only interactive requests does not pass batch over: batch
    # (min_share 0.25) is not "starving" when the primary comes to drain.
    for _ in range(4):
        release(core.lot, lambda e: e.cls == "interactive", "other")
    assert next_out(core.lot) is inter[4]  # priority decides, as if those releases never happened
    # The primary's own releases count as before: after three interactive, batch's turn.
    order = [release(core.lot) for _ in range(4)]
    assert order == [inter[4], inter[5], inter[6], batch[0]]


def test_every_way_out_of_the_lot_is_told_once_with_its_target():
    core = make_core(concurrency=10)
    told = []
    core.lot.when_out(lambda entry: told.append((entry.seq, entry.released_to)))
    core.lot.when_out(lambda entry: 1 / 0)  # a failing listener does not stop the others
    core.state.hold("api")
    a, b, c, d = (park(core, cls="interactive" if i == 2 else "batch") for i in range(4))
    release(core.lot, lambda e: e is a["entry"], "other")
    b["deferred"].cancel()
    core.run(16)  # c (interactive) expires
    core.state.release("api")
    core.run(0.01)
    assert told == [(a["entry"].seq, "other"), (b["entry"].seq, None), (c["entry"].seq, None), (d["entry"].seq, "default")]
    assert d["entry"].released_to == "default" and "released_at" in d


def test_a_drainer_per_target_with_its_own_cap_and_its_own_opening():
    core = make_core(concurrency=4)
    open_ = [True]
    def batch(entry):
        return entry.cls == "batch"

    other = Replayer(
        core.clock, core.lot, core.state, core.metrics, clock_cooperator(core.clock), concurrency=2,
        has_work=lambda: open_[0] and next_out(core.lot, batch) is not None,
        release=lambda: release(core.lot, batch, "other"),
    )
    core.lot.when_parked(other.kick)  # as service.build_heart wires each drainer
    core.state.hold("api")
    outcomes = [park(core, cls=cls) for cls in ["interactive", "batch", "batch", "batch", "interactive"]]
    core.run(0.01)
    # The other target took two batch requests (its cap); the primary, yielded, none.
    taken = released(outcomes)
    assert [o["entry"].cls for o in taken] == ["batch", "batch"]
    assert all(o["entry"].released_to == "other" for o in taken)
    assert other.inflight == 2 and core.replayer.inflight == 0
    assert core.sample("yieldproxy_inflight_requests") == 0  # the primary's gauge
    other.finished()
    core.run(0.01)
    assert len(released(outcomes)) == 3 and other.inflight == 2
    # Closed, it takes no more; the primary drains the rest when the GPU is back.
    open_[0] = False
    other.finished()
    other.finished()
    core.run(0.01)
    assert len(released(outcomes)) == 3
    core.state.release("api")
    core.run(0.01)
    assert len(released(outcomes)) == 5
    assert [o["entry"].released_to for o in outcomes] == ["default", "other", "other", "other", "default"]
    assert core.replayer.inflight == 2 and other.inflight == 0
    other.stop()
    for _ in range(2):
        core.scheduler.finished()
    core.run(0.01)


# -- one timer for the whole lot ----------------------------------------------------------------


def lot_timers(core) -> int:
    """DelayedCalls the lot holds (the replayer's and others' are not counted)."""
    return sum(1 for call in core.clock.getDelayedCalls() if getattr(call.func, "__self__", None) is core.lot)


def test_the_lot_holds_one_timer_however_many_are_parked():
    core = make_core(concurrency=1000)
    core.state.hold("api")
    outcomes = [park(core, cls=cls) for _ in range(50) for cls in ("interactive", "batch", "long")]
    assert len(core.lot) == 150
    assert lot_timers(core) == 1
    assert len(core.clock.getDelayedCalls()) == 1
    outcomes[0]["deferred"].cancel()
    assert lot_timers(core) == 1
    core.state.release("api")
    core.run(0.01)
    assert len(released(outcomes)) == 149 and len(core.lot) == 0
    assert lot_timers(core) == 0
    for o in released(outcomes):
        finish(core, o)
    assert core.clock.getDelayedCalls() == []


def test_each_entry_expires_at_its_own_deadline_whatever_the_order_of_arrival():
    core = make_core()
    core.state.hold("api")
    # Deadlines out of arrival order: 600 s, 15 s, 2 s (the caller's), 7 s (the caller's), 15 s.
    batch = park(core, cls="batch")
    interactive = park(core, cls="interactive")
    short = park(core, cls="batch", max_wait=2)
    middle = park(core, cls="long", max_wait=7)
    core.clock.advance(1)
    late_interactive = park(core, cls="interactive")  # 15 s from t=1
    expected = {id(short): 2, id(middle): 7, id(interactive): 15, id(late_interactive): 16, id(batch): 600}
    seen = {}
    for step in range(1, 610):
        core.clock.advance(1) if step > 1 else None
        for o in (batch, interactive, short, middle, late_interactive):
            if "failure" in o and id(o) not in seen:
                seen[id(o)] = core.clock.seconds()
    assert seen == expected
    assert all(o["failure"].reason == "expired" for o in (batch, interactive, short, middle, late_interactive))
    assert core.clock.getDelayedCalls() == []


def test_entries_that_left_neither_expire_nor_keep_the_timer():
    core = make_core(concurrency=100)
    core.state.hold("api")
    gone = park(core, cls="interactive", max_wait=1)
    stays = park(core, cls="interactive")
    gone["deferred"].cancel()
    core.clock.advance(1)
    assert isinstance(gone["failure"], CancelledError)
    assert "failure" not in stays
    core.clock.advance(14)
    assert stays["failure"].reason == "expired"
    assert core.clock.getDelayedCalls() == []


def test_a_returning_entry_keeps_its_first_deadline_under_the_lot_timer():
    core = make_core(concurrency=1)
    core.state.hold("api")
    o = park(core, cls="interactive")
    core.clock.advance(10)
    core.state.release("api")
    core.run(0.01)
    assert "released_at" in o
    # Its attempt fails; it comes back with 5 s of its 15 s hold bound left.
    core.state.hold("api")
    core.scheduler.finished(failed=True)
    entry = o["entry"]
    entry.attempts = 1
    again = []
    core.scheduler.admit(entry).addErrback(lambda f: again.append(f.value))
    core.clock.advance(4.9)
    assert again == []
    core.clock.advance(0.2)
    assert again and again[0].reason == "expired"
    assert core.clock.getDelayedCalls() == []


def test_stale_deadlines_do_not_pile_up_while_requests_pass_through_the_lot():
    core = make_core(concurrency=1000)
    core.state.hold("api")
    keep = park(core, cls="batch")  # keeps the lot from ever emptying
    for _ in range(2000):
        park(core, cls="batch")["deferred"].cancel()
    assert len(core.lot) == 1
    assert len(core.lot._deadlines) <= 2 * len(core.lot) + 65
    keep["deferred"].cancel()
    assert core.lot._deadlines == [] and core.clock.getDelayedCalls() == []


_PER_ENTRY = """
import gc, tracemalloc
from helpers import make_core
from yieldproxy.lot.parking import Entry

core = make_core()
core.state.hold("api")
kept = [core.scheduler.admit(Entry(cls="batch", size=10)) for _ in range(100)]  # lists and dicts grown
gc.collect()
tracemalloc.start()
before = tracemalloc.take_snapshot()
kept += [core.scheduler.admit(Entry(cls="batch", size=10)) for _ in range(2000)]
gc.collect()
after = tracemalloc.take_snapshot()
tracemalloc.stop()
print(sum(stat.size_diff for stat in after.compare_to(before, "lineno")) / 2000)
core.scheduler.refuse_all_parked("test over")
assert core.clock.getDelayedCalls() == []
"""


def test_a_parked_entry_costs_the_lot_about_half_a_kilobyte():
    """Entry, parked Deferred, canceller, queue and deadline slots: no timer or closure per entry.

    (A DelayedCall per entry and a closure as canceller made it 1.3 KB.)  Measured in a
    process of its own: inside the whole suite the allocator's state left by earlier tests
    added about 50 B per entry that the lot does not hold (601 B against 553 B alone).
    """
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]))
    result = subprocess.run(
        [sys.executable, "-c", _PER_ENTRY], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    per_entry = float(result.stdout)
    assert per_entry < 600, per_entry


# -- waiting for the lot to empty and the replayer to go idle (the graceful stop, the handover) ---------


def fired(d) -> bool:
    results = []
    d.addBoth(lambda r: results.append(r) or r)
    return bool(results)


def test_when_empty_and_when_idle_fire_on_the_event_not_before():
    core = make_core(concurrency=1)
    assert fired(core.lot.when_empty()) and fired(core.replayer.when_idle())
    core.state.hold("api", "game")
    outcomes = [park(core) for _ in range(2)]
    empty, idle = core.lot.when_empty(), core.replayer.when_idle()
    assert fired(idle) and not fired(empty)  # parked is not in flight
    core.state.release("api")
    core.run(0.01)
    # One released into the only slot, one still parked.
    idle = core.replayer.when_idle()
    assert not fired(empty) and not fired(idle)
    finish(core, outcomes[0])
    # Nothing was in flight for a moment: the waiter fired (whoever waits checks again).
    assert fired(idle) and not fired(empty)
    core.run(0.01)
    # The first's end let the second out: the lot is empty, the slot busy again.
    assert fired(empty) and core.replayer.inflight == 1
    idle = core.replayer.when_idle()
    assert not fired(idle)
    finish(core, outcomes[1])
    assert fired(idle)
    assert core.clock.getDelayedCalls() == []


def test_a_cancelled_wait_is_forgotten():
    core = make_core()
    core.state.hold("api", "game")
    o = park(core)
    waiting = core.lot.when_empty()
    waiting.cancel()
    assert core.lot._empty_waiters == []
    o["deferred"].cancel()  # the client leaves: the lot empties with nobody left to tell
    assert len(core.lot) == 0
