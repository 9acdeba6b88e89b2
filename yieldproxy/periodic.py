"""Periodic work on an injected clock, whose steps cannot end the loop.

A bare :class:`~twisted.internet.task.LoopingCall` stops for good at the
first exception (or failed Deferred) of a step, silently as far as the
service is concerned; its default clock is the global reactor.  Every
fixed-interval loop of the proxy (history sampling, the state-file poll,
the command probe) runs through :func:`every` instead: the clock is the one
given, and a failing step is logged and the loop goes on.

Schedules whose delay changes from one run to the next (the outage probe's
backoff, the fallback's sooner retry after an error) are ``callLater``
chains in their own modules: they are no loop of one interval.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

log = Logger()


def every(clock: IReactorTime, seconds: float, step: Callable[[], Any], what: str, now: bool = True) -> LoopingCall:
    """Call ``step()`` now (``now=False``: once ``seconds`` have passed) and then every ``seconds`` on ``clock``,
    until the returned loop is stopped.

    A step that returns a Deferred is not called again before it fires (a
    slow probe never overlaps the next run).  A step that raises or fails
    is logged as "``what`` failed" and the loop goes on.
    """

    def guarded() -> Deferred[Any]:
        return maybeDeferred(step).addErrback(failed)

    def failed(failure: Failure) -> None:
        log.failure("{what} failed; it runs again in {seconds:g}s", failure, what=what, seconds=seconds)

    loop = LoopingCall(guarded)
    loop.clock = clock
    loop.start(seconds, now=now)
    return loop
