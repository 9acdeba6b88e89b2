"""Elapsed time for every bound; the wall clock only where a time is shown to people.

Every bound of the proxy is a timer on the clock it is given, Twisted's ``IReactorTime``.  The real
reactor keeps that time on the wall clock (``ReactorBase.seconds`` is ``time.time``, and each
``DelayedCall``, the poller's timeout and ``runUntilCurrent`` read it), so a wall-clock step would fire
every timer at once, or hold them for an hour.  :func:`run_on_monotonic` gives the reactor
``CLOCK_MONOTONIC`` instead, before anything is scheduled (tap.py calls it first thing); it is one clock
for the whole machine until it boots again, so a reload's two processes read the same one.  Times shown
to people stay wall-clock: :class:`WallClock` converts them where they are shown.  What this promises
across a step: docs/operating.md (*A clock step*).
"""

from __future__ import annotations

import time
from typing import Callable

import attrs
from twisted.internet.base import ReactorBase
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

__all__ = ["BOOT_ID_PATH", "WallClock", "boot_id", "cancel", "is_monotonic", "run_on_monotonic", "same", "wall_clock"]

log = Logger()

#: Where Linux says which boot this is: ``CLOCK_MONOTONIC`` readings compare only within one.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def same(t: float) -> float:
    """A time shown as it is (the elapsed clock is the wall clock: a test's Clock, an unswitched reactor)."""
    return t


def cancel(call: IDelayedCall | None) -> None:
    """Cancel ``call`` if it is still pending; None, or a call that ran or was cancelled, is left as it is."""
    if call is not None and call.active():
        call.cancel()


def run_on_monotonic(reactor: object, monotonic: Callable[[], float] = time.monotonic) -> int:
    """Make ``reactor`` (a Twisted ``ReactorBase``) keep time on ``monotonic``; how many pending calls moved.

    The instance's ``seconds`` is replaced (the module docstring says what reads it).  A
    call already pending (twistd schedules none before the plugin's
    ``makeService``; an embedder's program may have) is put back on the new
    clock with the time it had left on the old one (``DelayedCall.reset``),
    and said in one log line.  Calling it again does nothing.

    :raises TypeError: ``reactor`` is not a ``ReactorBase`` (a test's Clock
        needs no switch: it is driven by hand).
    """
    if not isinstance(reactor, ReactorBase):
        raise TypeError(f"run_on_monotonic needs a Twisted reactor (a ReactorBase), not {type(reactor).__name__}")
    if is_monotonic(reactor):
        return 0
    old = reactor.seconds
    pending = reactor.getDelayedCalls()
    before = old()
    left = [(call, max(0.0, call.getTime() - before)) for call in pending]
    reactor.seconds = monotonic  # the instance's own clock, as DelayedCall takes it
    for call, seconds in left:
        # Its own clock first: reset() counts from it, and moves the call sooner in the reactor's heap.
        call.seconds = monotonic  # type: ignore[attr-defined]  # IDelayedCall does not name it; DelayedCall has it
        call.reset(seconds)
    if left:
        log.info(
            "timers run on the monotonic clock from now on: {count} pending call(s) moved onto it with the time "
            "each had left", count=len(left),
        )
    _MONOTONIC[id(reactor)] = monotonic
    return len(left)


#: The reactors :func:`run_on_monotonic` switched (by id: a reactor lives as long as its process).
_MONOTONIC: dict[int, Callable[[], float]] = {}


def is_monotonic(reactor: object) -> bool:
    """Whether ``reactor`` keeps time on the monotonic clock (:func:`run_on_monotonic` switched it)."""
    clock = _MONOTONIC.get(id(reactor))
    return clock is not None and getattr(reactor, "seconds", None) is clock


#: A change of the wall clock's offset smaller than this is the two clocks read a moment apart, not a step
#: (an NTP daemon slews smaller errors; it steps only larger ones, ntpd from 0.128 s): the offset is kept.
STEP_SECONDS = 0.05


@attrs.define(eq=False)
class WallClock:
    """The wall clock beside the elapsed one: elapsed-clock times as people read them, and back.

    The offset between the two (wall minus elapsed) changes only when the
    wall clock steps (or the machine slept), so it is kept, to the
    millisecond, until it moves by more than :data:`STEP_SECONDS`: a time
    shown twice reads the same twice, and reads the same in the next process
    on this boot, which adopts the offset the holds file was written with.
    """

    #: The clock every bound runs on (the reactor, or a test's Clock).
    elapsed: IReactorTime
    #: The wall clock (``time.time`` in a real process; the same Clock, or a stepping one, in tests).
    now: Callable[[], float]
    _offset: float | None = None

    def offset(self) -> float:
        """Wall minus elapsed: the one kept, or the new one after a step."""
        fresh = self._read()
        if self._offset is None or abs(fresh - self._offset) > STEP_SECONDS:
            self._offset = round(fresh, 3)
        return self._offset

    def adopt(self, offset: float) -> None:
        """Keep ``offset`` (another process's on this boot, from the holds file) if it is this clock's too."""
        if abs(self._read() - offset) <= STEP_SECONDS:
            self._offset = round(offset, 3)

    def _read(self) -> float:
        """Wall minus elapsed, read now: the wall clock between two readings of the elapsed one, close together."""
        for _ in range(3):
            before = self.elapsed.seconds()
            wall = self.now()
            after = self.elapsed.seconds()
            if after - before < 0.001:
                break
        return wall - (before + after) / 2

    def shown(self) -> Callable[[float], float]:
        """A converter from elapsed-clock times to wall-clock ones, with one offset (one answer's times agree),
        to the microsecond."""
        offset = self.offset()
        if offset == 0.0:
            return same
        return lambda t: round(t + offset, 6)

    def at(self, t: float) -> float:
        """The wall-clock time of elapsed-clock time ``t``, with the offset of now."""
        return self.shown()(t)

    def elapsed_at(self, wall: float) -> float:
        """The elapsed-clock time of wall-clock time ``wall``, with the offset of now."""
        return wall - self.offset()


def wall_clock(reactor: IReactorTime, now: Callable[[], float] | None = None) -> WallClock:
    """The wall clock beside ``reactor``: ``now`` if given, else ``time.time`` for a reactor that runs on the
    monotonic clock, else the reactor's own clock (a test's Clock, a reactor left on the wall clock)."""
    if now is None:
        now = time.time if is_monotonic(reactor) else reactor.seconds
    return WallClock(reactor, now)


def boot_id(path: str = BOOT_ID_PATH) -> str | None:
    """This boot's id (Linux), or None where there is none: ``CLOCK_MONOTONIC`` times compare within one boot."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(64).strip()
    except (OSError, ValueError):
        return None
    return text or None
