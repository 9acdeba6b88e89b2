"""The lot, the gate and the replayer, driven by a Clock: no sockets, milliseconds each."""

from __future__ import annotations

import pytest
from twisted.internet.defer import CancelledError

from helpers import config_with, make_core
from yieldproxy.parking import Entry, Refused


def park(core, cls="batch", size=10, max_wait=None, attempts=0):
    """Admit an entry and collect what happens to it."""
    entry = Entry(cls=cls, size=size, max_wait=max_wait)
    entry.attempts = attempts
    outcome = {"entry": entry}
    try:
        d = core.gate.admit(entry)
    except Refused as refusal:
        outcome["refused"] = refusal
        return outcome
    outcome["deferred"] = d

    def released(e):
        outcome["released_at"] = core.clock.seconds()
        return e

    def failed(f):
        outcome["failure"] = f.value
        return None

    d.addCallbacks(released, failed)
    return outcome


def released(outcomes):
    return [o for o in outcomes if "released_at" in o]


def finish(core, outcome, failed=False):
    """The upstream exchange of a released entry ended."""
    assert "released_at" in outcome
    core.gate.finished(failed=failed, seconds=0.01)


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
    assert core.gate.state_name == "yielded"
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
    assert core.gate.state_name == "draining"
    # Each finished request frees exactly one slot, taken by the next in line.
    for expected in range(4, 11):
        finish(core, released(outcomes)[expected - 4])
        core.run(0.01)
        assert len(released(outcomes)) == expected
        assert core.replayer.inflight <= 3
    for o in released(outcomes)[7:]:
        finish(core, o)
    assert core.gate.state_name == "available"
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
    core.run(14.9, step=0.1)
    assert "failure" not in o
    core.run(0.2, step=0.1)
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
    core.run(16, step=1)
    assert "failure" in outcomes["interactive"] and "failure" not in outcomes["batch"]
    core.run(600, step=1)
    assert "failure" in outcomes["batch"] and "failure" not in outcomes["long"]
    core.run(3000, step=10)
    assert "failure" in outcomes["long"]


def test_caller_max_wait_shortens_the_hold_never_lengthens_it():
    core = make_core()
    core.state.hold("api")
    short = park(core, cls="batch", max_wait=2)
    longer = park(core, cls="interactive", max_wait=100)
    core.run(2.1, step=0.1)
    assert "X-Yield-Max-Wait" in short["failure"].message
    assert "failure" not in longer
    core.run(13, step=0.1)
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
    core.gate.finished(failed=True)
    head.attempts = 1
    seen = []
    core.gate.admit(head).addCallback(seen.append)
    assert core.lot.peek() is head
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
    d = core.gate.admit(entry)
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
    core.gate.finished(failed=True)
    entry.attempts = 1
    core.gate.admit(entry).addCallback(seen.append)
    core.run(0.01)
    assert len(seen) == 1
    # ...the second in a row pauses the release for retry_backoff_seconds.
    core.gate.finished(failed=True)
    entry.attempts = 2
    core.gate.admit(entry).addCallback(seen.append)
    core.run(0.9)
    assert len(seen) == 1
    core.run(0.2)
    assert len(seen) == 2
    # A declared resume ends the pause at once...
    core.gate.finished(failed=True)
    entry.attempts = 3
    core.gate.admit(entry).addCallback(seen.append)
    core.run(0.01)
    assert len(seen) == 2
    core.state.hold("api")
    core.state.release("api")
    core.run(0.01)
    assert len(seen) == 3
    # ...and a success ends the streak.
    core.gate.finished(failed=False)
    assert park(core)["released_at"] is not None


def test_policy_reject_refuses_during_a_yield_only():
    core = make_core(config_with(classes={"interactive": {"policy": "reject"}}))
    assert "released_at" in park(core, cls="interactive")
    core.gate.finished()
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
    assert core.gate.refuse_all_parked("shutting down") == 3
    assert all(o["failure"].status == 503 and o["failure"].reason == "shutdown" for o in outcomes)
    assert len(core.lot) == 0
    core.gate.shutting_down = True
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
        core.gate.finished(failed=True, seconds=0.0)
        entry.attempts = attempt
        core.gate.admit(entry).addCallback(seen.append)
        core.run(0.001)
    assert len(seen) == 1  # the second failure started a 1 s pause
    core.gate.finished(failed=False, seconds=0.6)  # early's answer: sent before the failures
    core.run(0.5)
    assert len(seen) == 1
    core.run(0.6)
    assert len(seen) == 2
    assert "released_at" in early


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
    core.gate.finished(failed=True)
    entry = o["entry"]
    entry.attempts = 1
    again = []
    core.gate.admit(entry).addErrback(lambda f: again.append(f.value))
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


def test_a_parked_entry_costs_the_lot_about_half_a_kilobyte():
    """Entry, parked Deferred, canceller, queue and deadline slots: no timer or closure per entry.

    (A DelayedCall per entry and a closure as canceller made it 1.3 KB.)
    """
    import gc
    import tracemalloc

    core = make_core()
    core.state.hold("api")
    kept = [core.gate.admit(Entry(cls="batch", size=10)) for _ in range(100)]  # lists and dicts grown
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept += [core.gate.admit(Entry(cls="batch", size=10)) for _ in range(2000)]
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    per_entry = sum(stat.size_diff for stat in after.compare_to(before, "lineno")) / 2000
    assert per_entry < 600, per_entry
    core.gate.refuse_all_parked("test over")
    assert core.clock.getDelayedCalls() == []
