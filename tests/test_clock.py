"""Elapsed time for every bound, the wall clock only where a time is shown (clock.py), in memory.

The reactor's switch is tested on a real reactor instance driven by hand with
made-up clocks; the conversions on a Clock (elapsed) beside a wall clock that
steps both ways.  tests/test_clock_real.py steps ``time.time`` in a real
twistd.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.selectreactor import SelectReactor
from twisted.internet.task import Clock

from helpers import embedded
from inmemory import Rig, answered
from yieldproxy.clock import WallClock, cancel, is_monotonic, run_on_monotonic, wall_clock
from yieldproxy.lifecycle.holdstore import HoldStore, keep_holds
from yieldproxy.lot.state import YieldState
from yieldproxy.tools.cli import format_status

MODEL = "all-minilm"
#: A wall clock that is not the elapsed one: the Clock starts at 0, the wall at this (2026).
EPOCH = 1_790_000_000.0


class SteppingWall:
    """A wall clock that follows a Clock, and steps when told (an NTP step, a resumed VM)."""

    def __init__(self, clock: Clock, at: float = EPOCH):
        self._clock, self.offset = clock, at - clock.seconds()

    def __call__(self) -> float:
        return self._clock.seconds() + self.offset

    def step(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def made_up_reactor():
    """A real reactor (its DelayedCall heap, ``timeout`` and ``runUntilCurrent``), not installed, on made-up clocks."""
    reactor = SelectReactor()
    clocks = {"wall": EPOCH, "monotonic": 100.0}
    reactor.seconds = lambda: clocks["wall"]  # as time.time is, until the switch
    yield reactor, clocks
    reactor.waker.connectionLost(None)


# -- the reactor's switch --------------------------------------------------------------------


def test_a_switched_reactor_fires_no_timer_early_after_a_forward_step_nor_late_after_a_backward_one(made_up_reactor):
    reactor, clocks = made_up_reactor
    run_on_monotonic(reactor, lambda: clocks["monotonic"])
    fired = []
    reactor.callLater(600, fired.append, "600 s lease")
    reactor.callLater(5, fired.append, "5 s lease")
    clocks["wall"] += 15 * 60  # the wall clock jumps 15 minutes forward
    reactor.runUntilCurrent()
    assert fired == [] and reactor.timeout() == 5
    clocks["monotonic"] += 5
    clocks["wall"] -= 3600  # and an hour back
    reactor.runUntilCurrent()
    assert fired == ["5 s lease"]
    clocks["monotonic"] += 594.9
    reactor.runUntilCurrent()
    assert fired == ["5 s lease"] and reactor.timeout() == pytest.approx(0.1)
    clocks["monotonic"] += 0.1
    reactor.runUntilCurrent()
    assert fired == ["5 s lease", "600 s lease"] and reactor.getDelayedCalls() == []


def test_calls_pending_at_the_switch_keep_the_time_they_had_left(made_up_reactor):
    reactor, clocks = made_up_reactor
    fired = []
    soon = reactor.callLater(10, fired.append, "soon")
    later = reactor.callLater(100, fired.append, "later")
    reactor.runUntilCurrent()  # one in the heap, as a running reactor keeps them...
    moved_later = reactor.callLater(50, fired.append, "moved")
    moved_later.reset(200)  # ...one reset later, one just made
    clocks["wall"] += 4
    assert run_on_monotonic(reactor, lambda: clocks["monotonic"]) == 3
    assert is_monotonic(reactor) and reactor.seconds() == 100.0
    assert [c.getTime() for c in (soon, later, moved_later)] == [106.0, 196.0, 296.0]
    clocks["wall"] += 10_000  # the old clock means nothing now
    reactor.runUntilCurrent()
    assert fired == []
    clocks["monotonic"] = 106.0
    reactor.runUntilCurrent()
    assert fired == ["soon"]
    clocks["monotonic"] = 296.0
    reactor.runUntilCurrent()
    assert fired == ["soon", "later", "moved"]
    # A second switch does nothing.
    assert run_on_monotonic(reactor, lambda: 0.0) == 0 and reactor.seconds() == 296.0


def test_only_a_reactor_is_switched_and_a_clock_is_shown_as_it_is():
    clock = Clock()
    with pytest.raises(TypeError, match="needs a Twisted reactor"):
        run_on_monotonic(clock)
    assert not is_monotonic(clock)
    clock.advance(42)
    wall = wall_clock(clock)
    assert wall.now() == 42 and wall.offset() == 0 and wall.at(7) == 7


def test_beside_a_switched_reactor_the_wall_clock_is_time_time(made_up_reactor):
    import time

    reactor, clocks = made_up_reactor
    run_on_monotonic(reactor, lambda: clocks["monotonic"])
    assert wall_clock(reactor).now is time.time


def test_the_offset_is_kept_through_the_jitter_of_two_readings_and_follows_a_step():
    """A time shown twice reads the same twice: only a step (more than 50 ms) moves it."""
    clock = Clock()
    clock.advance(1000)
    jitter = iter([0.0, 0.004, -0.003, 0.01, 900.0, 900.002])
    wall = WallClock(clock, lambda: EPOCH + next(jitter))
    shown = [wall.at(10.0) for _ in range(4)]
    assert shown == [EPOCH - 990.0] * 4
    assert wall.at(10.0) == EPOCH - 990.0 + 900 and wall.at(10.0) == EPOCH - 990.0 + 900


# -- what people read: /status, the CLI, the page, the history -------------------------------------


def test_status_shows_wall_clock_times_and_a_step_moves_them_but_ends_no_lease_and_expires_nothing():
    clock = Clock()
    wall = SteppingWall(clock)
    rig = Rig(reactor=clock, wall=wall)
    answer = rig.call("POST", rig.admin_url + "/yield", json={
        "source": "broker", "reason": "game", "for_seconds": 600, "expected_seconds": 300,
    })
    assert answer.code == 200
    [hold] = answer.json()["holds"]
    assert (hold["since"], hold["expires_at"], hold["expected_end"]) == (EPOCH, EPOCH + 600, EPOCH + 300)
    rig.run(100)
    d = rig.post("/api/embed", {"model": MODEL, "input": ["parked"]})  # its bound (600 s) ends after the lease
    wall.step(15 * 60)  # forward
    status = rig.call("GET", rig.admin_url + "/status").json()
    # Every time moved with the step: what is left and how long it has lasted are as they were.
    [hold] = status["holds"]
    assert status["now"] == EPOCH + 100 + 900 and status["started_at"] == EPOCH + 900
    assert (hold["since"], hold["expires_at"]) == (EPOCH + 900, EPOCH + 900 + 600)
    assert status["expected_end"] == EPOCH + 900 + 300 and status["expected_remaining_seconds"] == 200
    assert [h["since"] for row in status["upstreams"] for h in row["holds"]] == [EPOCH + 900]
    assert "HELD FOR" in format_status(status) and "1m 40s" in format_status(status)
    assert not answered(d) and rig.proxy.lot.count_by_class() == {"batch": 1}
    wall.step(-3600)  # and back
    rig.run(499.9)
    assert rig.proxy.state.holds and not answered(d)
    rig.run(0.1)  # the lease ends on elapsed time, where it would have without either step
    assert rig.result(d).code == 200 and embedded(rig.sim) == {"parked": 1}


def test_the_page_says_as_of_what_wall_clock_time():
    clock = Clock()
    wall = SteppingWall(clock, at=1_790_000_000.0)  # 2026-09-21 14:13:20 UTC
    rig = Rig(reactor=clock, wall=wall)
    assert b"(as of 14:13:20 UTC)" in rig.call("GET", rig.admin_url + "/").body
    wall.step(-3600)
    assert b"(as of 13:13:20 UTC)" in rig.call("GET", rig.admin_url + "/").body


def test_the_history_is_shown_on_the_wall_clock_and_moves_whole_with_a_step():
    clock = Clock()
    wall = SteppingWall(clock)
    rig = Rig(reactor=clock, wall=wall)
    history = rig.proxy.history
    history.startService()
    for _ in range(3):
        clock.advance(1)
    first = rig.call("GET", rig.admin_url + "/history").json()
    assert [s["t"] for s in first["samples"]] == [EPOCH, EPOCH + 1, EPOCH + 2, EPOCH + 3]
    assert first["now"] == EPOCH + 3 and first["wall_offset"] == EPOCH
    # The page asks for what is newer than the last t it has: exactly that, no more, no less.
    newer = rig.call("GET", rig.admin_url + f"/history?since={first['samples'][-1]['t']}").json()
    assert newer["samples"] == []
    clock.advance(1)
    wall.step(-3600)
    after = rig.call("GET", rig.admin_url + f"/history?since={EPOCH + 2 - 3600}").json()
    # Every sample moved back with the clock, in order; the offset says it changed (the page starts afresh).
    assert after["wall_offset"] == EPOCH - 3600
    assert [s["t"] for s in after["samples"]] == [EPOCH + 3 - 3600, EPOCH + 4 - 3600]
    whole = rig.call("GET", rig.admin_url + "/history").json()
    assert [s["t"] for s in whole["samples"]] == [EPOCH + t - 3600 for t in range(5)]
    history.stopService()


# -- the holds file: wall-clock times in it, elapsed ones in the proxy -------------------------------


def document(path) -> dict:
    return json.loads(path.read_text())


def test_the_holds_file_has_wall_clock_times_and_reads_back_exactly_on_the_same_boot(tmp_path):
    """On one boot the monotonic clock is the machine's: a start reads the writer's offset, whatever the wall did."""
    path = tmp_path / "holds.json"
    monotonic = Clock()  # one clock for both processes, as CLOCK_MONOTONIC is for one boot
    monotonic.advance(1000)
    wall = SteppingWall(monotonic)
    state = YieldState(monotonic)
    keep_holds(state, HoldStore(monotonic, path, wall=WallClock(monotonic, wall), boot="boot-1"), 600)
    state.hold("broker", "game", for_seconds=600, expected_seconds=300)
    written = document(path)
    assert (written["boot_id"], written["monotonic_at"], written["written_at"]) == ("boot-1", 1000, EPOCH)
    assert [(h["since"], h["expires_at"], h["expected_end"]) for h in written["holds"]] == [
        (EPOCH, EPOCH + 600, EPOCH + 300)
    ]
    state.stop()
    # Down for 100 s, during which the wall clock went an hour back.
    monotonic.advance(100)
    wall.step(-3600)
    state = YieldState(monotonic)
    keep_holds(state, HoldStore(monotonic, path, wall=WallClock(monotonic, wall), boot="boot-1"), 600)
    [hold] = state.holds
    assert (hold.since, hold.expires_at, hold.expected_end) == (1000, 1600, 1300)
    monotonic.advance(499.9)
    assert state.holds
    monotonic.advance(0.1)
    assert state.holds == []


@pytest.mark.parametrize("step", [-3600, 0, 15 * 60])
def test_after_a_reboot_a_lease_has_at_most_what_it_had_left_when_written(tmp_path, step):
    """Another boot: the wall clock is all there is; one that went back stretches no lease."""
    path = tmp_path / "holds.json"
    before = Clock()
    before.advance(5000)  # a long uptime
    wall = SteppingWall(before)
    state = YieldState(before)
    keep_holds(state, HoldStore(before, path, wall=WallClock(before, wall), boot="boot-1"), 600)
    state.hold("broker", "game", for_seconds=600)
    before.advance(100)
    state.hold("dead-man", "broker's switch", for_seconds=5)  # the file is written with 500 s left on the lease
    # Rebooted: 60 s later by the old wall clock, then the wall clock steps.
    after = Clock()
    after.advance(20)
    later = SteppingWall(after, at=EPOCH + 100 + 60 + step)
    state = YieldState(after)
    keep_holds(state, HoldStore(after, path, wall=WallClock(after, later), boot="boot-2"), 600)
    left = {h.source: h.expires_at - after.seconds() for h in state.holds}
    if step < 0:
        assert left == {"broker": 500, "dead-man": 5}  # as when written: the time since is unknown, not negative
    elif step == 0:
        assert left == {"broker": 440}  # the 60 s the wall clock says passed
    else:
        assert left == {}  # the wall clock says 960 s passed: the leases ran out


def test_the_next_process_on_this_boot_shows_the_times_the_last_one_showed(tmp_path):
    """Its own reading of the offset differs by the jitter of two clock reads: it adopts the file's instead."""
    path = tmp_path / "holds.json"
    monotonic = Clock()
    monotonic.advance(1000.123456)
    first = WallClock(monotonic, lambda: monotonic.seconds() + EPOCH + 0.0007)
    state = YieldState(monotonic)
    keep_holds(state, HoldStore(monotonic, path, wall=first, boot="boot-1"), 600)
    state.hold("broker", "game", for_seconds=600)
    shown = state.holds[0].as_json(first.shown())
    state.stop()
    monotonic.advance(3.3)
    second = WallClock(monotonic, lambda: monotonic.seconds() + EPOCH + 0.0003)  # across a millisecond
    state = YieldState(monotonic)
    keep_holds(state, HoldStore(monotonic, path, wall=second, boot="boot-1"), 600)
    assert state.holds[0].as_json(second.shown()) == shown


def test_cancel_ends_a_pending_call_and_leaves_any_other_as_it_is():
    """clock.cancel: a pending call is cancelled; None, a call that ran and one cancelled already are no error."""
    clock = Clock()
    ran: list[str] = []
    pending = clock.callLater(5, ran.append, "pending")
    fired = clock.callLater(1, ran.append, "fired")
    gone = clock.callLater(2, ran.append, "gone")
    gone.cancel()
    clock.advance(1)
    for call in (pending, fired, gone, None):
        cancel(call)
    assert not pending.active() and not fired.active() and not gone.active()
    clock.advance(10)
    assert ran == ["fired"] and clock.getDelayedCalls() == []
