"""The yield state: holds from several sources, leases, expected ends."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher

from yieldproxy.lot.state import MAX_HOLD_SECONDS, TooManyHolds, YieldState
from yieldproxy.names import check_source


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


# -- bounded sources (issue 10, finding 7) --------------------------------------------


def test_source_names_are_checked():
    for good in ("api", "game-launcher", "trainer.2", "GPU_0", "a" * 64):
        assert check_source(good) == good
    for bad in ("", "a" * 65, "evil\nGPU available: source=api", "two words", "-dash-first", "é", 5, None):
        with pytest.raises(ValueError):
            check_source(bad)
    state = YieldState(Clock())
    with pytest.raises(ValueError):
        state.hold("line\nforged")
    assert not state.yielded


def test_holds_from_callers_are_bounded_but_the_watchers_are_never_refused():
    clock = Clock()
    state = YieldState(clock, max_holds=3)
    for source in ("a", "b", "c"):
        state.hold(source)
    with pytest.raises(TooManyHolds):
        state.hold("d")
    state.hold("b", "renewed")  # renewing an existing hold is always fine
    for watcher in ("outage", "file", "signal", "command"):
        state.hold(watcher)
    assert [h.source for h in state.holds] == ["a", "b", "c", "outage", "file", "signal", "command"]
    state.release("a")
    state.hold("d")
    assert state.caller_holds() == 3


def test_hold_durations_are_bounded_to_a_week():
    state = YieldState(Clock())
    state.hold("a", expected_seconds=MAX_HOLD_SECONDS, for_seconds=MAX_HOLD_SECONDS)
    for key in ("expected_seconds", "for_seconds"):
        with pytest.raises(ValueError):
            state.hold("b", **{key: MAX_HOLD_SECONDS + 1})
        with pytest.raises(ValueError):
            state.hold("b", **{key: 1e308})
    assert [h.source for h in state.holds] == ["a"]


def test_each_hold_change_is_one_short_log_line():
    """The lines for the 200th hold are as short as for the 2nd: no list of every other source."""
    clock = Clock()
    state = YieldState(clock, max_holds=500)
    lines = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        for n in range(200):
            state.hold(f"broker-{n:03d}", "game")
        for n in range(199):
            state.release(f"broker-{n:03d}")
    finally:
        globalLogPublisher.removeObserver(observer)
    taken = [line for line in lines if line.startswith("hold taken")]
    ended = [line for line in lines if line.startswith("hold ended")]
    assert len(taken) == 199 and len(ended) == 199
    assert taken[-1] == "hold taken: source=broker-199 reason='game', also held by 199 other sources"
    assert ended[-1] == "hold ended: source=broker-198, still held by 1 other source"
    assert max(len(line) for line in lines) < 150


def test_yields_total_counts_unknown_sources_as_other():
    from yieldproxy.config import Config
    from yieldproxy.service import build

    config = Config()
    config = config.with_overrides(**{"admin.known_sources": ("trainer",)})
    proxy = build(Clock(), config)
    for n in range(50):
        proxy.state.hold(f"made-up-{n}")
        proxy.state.release(f"made-up-{n}")
    for source in ("trainer", "api", "outage"):
        proxy.state.hold(source)
    registry = proxy.metrics.registry
    assert registry.get_sample_value("yieldproxy_yields_total", {"source": "other"}) == 50
    for source in ("trainer", "api", "outage"):
        assert registry.get_sample_value("yieldproxy_yields_total", {"source": source}) == 1
    labels = {s.labels["source"] for m in registry.collect() if m.name == "yieldproxy_yields" for s in m.samples}
    assert labels == {"other", "trainer", "api", "outage"}
