"""The old process's winding down after a handover, on a Clock: a step that raises does not end it.

Once it has handed over, the old process looks every ``WIND_DOWN_STEP`` for
what went idle and stops once nothing is left (or after
``WIND_DOWN_MAX_SECONDS``).  A step that raises (a bug, a collaborator's
error) must not end the winding down: the process would stay for good.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from yieldproxy.lifecycle.succession.predecessor import WIND_DOWN_MAX_SECONDS, WIND_DOWN_STEP, Predecessor


class Lot:
    """A lot that is empty, but whose count raises at the steps ``failing`` names (counted from 0)."""

    def __init__(self, failing: set[int]):
        self.failing = failing
        self.counted = 0

    def __len__(self) -> int:
        step, self.counted = self.counted, self.counted + 1
        if step in self.failing:
            raise RuntimeError(f"the lot's count fails at step {step}")
        return 0

    def entries(self) -> list:
        return []


class Scheduler:
    members: tuple = ()
    inflight = 0


def winding_down(failing: set[int]) -> tuple[Predecessor, Clock, list[str]]:
    clock = Clock()
    stopped: list[str] = []
    predecessor = Predecessor(
        clock, ["yieldproxy"], {}, {}, {}, Lot(failing), Scheduler(), lambda: {}, lambda: stopped.append("stopped"),
    )
    predecessor._start_wind_down()
    return predecessor, clock, stopped


def test_a_step_that_raises_is_logged_and_the_next_step_stops_the_process():
    predecessor, clock, stopped = winding_down({0})
    with capturedLogs() as events:
        clock.advance(0)
        assert stopped == []  # it waits one step first
        clock.advance(WIND_DOWN_STEP)
        assert stopped == []
        clock.advance(WIND_DOWN_STEP)
    assert stopped == ["stopped"]
    failures = [formatEvent(e) for e in events if e.get("log_failure")]
    assert len(failures) == 1 and "winding down" in failures[0], failures
    assert predecessor._wind_down is None  # over: no further step


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=40)))
def test_whichever_steps_raise_the_process_stops_at_the_first_step_that_does_not(failing):
    """Empty from the start: the first step that does not raise stops the process, exactly once."""
    _predecessor, clock, stopped = winding_down(failing)
    first_clean = next(step for step in range(42) if step not in failing)
    for step in range(45):
        clock.advance(WIND_DOWN_STEP)
        assert stopped == (["stopped"] if step >= first_clean else []), (step, failing)
    assert not clock.getDelayedCalls()


def test_steps_that_always_raise_still_end_after_the_longest_wind_down():
    """Every step raises: the process stops all the same once WIND_DOWN_MAX_SECONDS have passed."""
    _predecessor, clock, stopped = winding_down(set(range(10 ** 6)))
    clock.pump([WIND_DOWN_STEP] * int(WIND_DOWN_MAX_SECONDS / WIND_DOWN_STEP - 2))
    assert stopped == []
    clock.pump([WIND_DOWN_STEP] * 4)
    assert stopped == ["stopped"]
    assert not clock.getDelayedCalls()
