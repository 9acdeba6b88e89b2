"""The yield state: holds from several sources, leases, expected ends."""

from __future__ import annotations

from twisted.internet.task import Clock

from yieldproxy.state import YieldState


def test_yielded_while_any_source_holds():
    clock = Clock()
    state = YieldState(clock)
    changes = []
    state.observe(changes.append)
    state.hold("api", "game")
    state.hold("file", "transcode")
    assert state.yielded and [h.source for h in state.holds] == ["api", "file"]
    assert state.release("api") is True
    assert state.yielded and changes == [True]
    assert state.release("api") is False
    state.release("file")
    assert not state.yielded and changes == [True, False]


def test_lease_ends_the_hold_unless_renewed():
    clock = Clock()
    state = YieldState(clock)
    state.hold("broker", "game", for_seconds=10)
    clock.advance(8)
    state.hold("broker", for_seconds=10)  # renewal keeps reason and start
    hold = state.holds[0]
    assert hold.reason == "game" and hold.since == 0 and hold.expires_at == 18
    clock.advance(9)
    assert state.yielded
    clock.advance(1)
    assert not state.yielded
    assert clock.getDelayedCalls() == []


def test_resume_cancels_the_lease_timer():
    clock = Clock()
    state = YieldState(clock)
    state.hold("broker", for_seconds=60)
    state.release("broker")
    assert clock.getDelayedCalls() == []


def test_expected_end_is_known_only_when_every_hold_gives_one():
    clock = Clock()
    state = YieldState(clock)
    assert state.expected_end() is None
    state.hold("a", expected_seconds=30)
    state.hold("b", expected_seconds=50, for_seconds=10)
    assert state.expected_end() == 50
    # A lease is a dead-man's switch a broker may renew for hours, not an estimate.
    state.hold("c", for_seconds=60)
    assert state.expected_end() is None


def test_yield_length_is_reported_once_per_whole_yield():
    clock = Clock()
    state = YieldState(clock)
    ended = []
    taken = []
    state.on_yield_ended(lambda source, seconds: ended.append((source, seconds)))
    state.on_hold_taken(lambda hold: taken.append(hold.source))
    state.hold("a")
    clock.advance(5)
    state.hold("b")
    state.hold("b")  # a renewal is not a new hold
    clock.advance(5)
    state.release("a")
    clock.advance(2)
    state.release("b")
    assert taken == ["a", "b"]
    assert ended == [("b", 12)]


def test_a_failing_observer_does_not_stop_the_others():
    clock = Clock()
    state = YieldState(clock)
    seen = []

    def broken(yielded):
        raise RuntimeError("boom")

    state.observe(broken)
    state.observe(seen.append)
    state.hold("a")
    assert seen == [True]
