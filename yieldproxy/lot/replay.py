"""The paced, capped release of the parking lot into one pool member, as a Cooperator task.

When the GPU comes back, a burst of parked requests must not hit it at once:
a drainer lets the next entry out while fewer than ``concurrency`` requests
are in flight and no faster than ``rate`` starts a second, and backs off
after a retryable upstream failure, so a restarting backend is not hammered.
Which entry goes is the scheduler's to say (``has_work``, ``release``:
docs/architecture.md, "The scheduler").
"""

from __future__ import annotations

from typing import Callable

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import CooperativeTask, Cooperator, TaskDone, TaskStopped
from twisted.logger import Logger

from ..observe.metrics import Metrics
from .parking import ParkingLot
from .state import YieldState

log = Logger()


@attrs.define(eq=False)
class Replayer:
    """Releases the lot to one member, under a concurrency cap and a start rate."""

    _clock: IReactorTime
    _lot: ParkingLot
    _state: YieldState
    _metrics: Metrics
    _cooperator: Cooperator
    concurrency: int = 4
    rate: float = 0.0
    backoff_seconds: float = 0.5
    backoff_max_seconds: float = 10.0
    #: Whether its member takes work now and a parked entry waits that it may take (the scheduler's answer).
    has_work: Callable[[], bool] = attrs.field(kw_only=True)
    #: Let the next entry its member may take out of the lot, to it (the scheduler's act).
    release: Callable[[], object] = attrs.field(kw_only=True)
    #: Log the end of a drain ("lot drained: now available"): with one member, the end of its drainer's
    #: drain is the proxy-wide state's (``PoolShape.names_members``, upstream/pool/members.py, decides).
    says_drained: bool = attrs.field(kw_only=True, default=False)
    #: After a failure, one request at a time until an answer comes back (the ``[fallback]`` member's rule).
    cautious: bool = False
    #: Requests sent to the target and not yet done (direct and replayed alike).
    inflight: int = 0
    _task: CooperativeTask | None = None
    _waiting: Deferred | None = None
    _timer: IDelayedCall | None = None
    _next_start: float = 0.0
    _backoff_until: float = 0.0
    _failures_in_a_row: int = 0
    _last_failure: float = float("-inf")
    _stopped: bool = False
    #: Waiting for nothing to be in flight (see :meth:`when_idle`).
    _idle_waiters: list[Deferred] = attrs.Factory(list)

    def can_start(self) -> bool:
        """True when a request may go to the target this instant: a free slot, no pause or pacing."""
        now = self._clock.seconds()
        return self.inflight < self._cap() and now >= max(self._next_start, self._backoff_until)

    def _cap(self) -> int:
        """The slots open now: a :attr:`cautious` target's, after a failure, one until an answer
        comes back (a failing CPU copy is tried by one request at a time, not by a wave)."""
        return 1 if self.cautious and self._failures_in_a_row else self.concurrency

    def kick(self) -> None:
        """Start the release task if there is work and none is running."""
        if self._stopped or self._task is not None or not self.has_work():
            return
        self._task = self._cooperator.cooperate(self._release())
        self._task.whenDone().addBoth(self._task_ended)

    def when_idle(self) -> Deferred:
        """A Deferred that fires once nothing is in flight to the target (at once if nothing is).

        For the waits that must not poll: the shutdown's drain, the VRAM
        handover's wait before it unloads.  Cancelling it only stops waiting.
        """
        if self.inflight == 0:
            return succeed(None)
        waiter: Deferred = Deferred(canceller=self._idle_waiters.remove)
        self._idle_waiters.append(waiter)
        return waiter

    def started(self) -> None:
        """A request went to the target (directly or from the lot)."""
        self.inflight += 1

    def finished(self, failed: bool = False, started: float | None = None, abandoned: bool = False) -> None:
        """A request's upstream exchange ended; free its slot.

        ``started`` is when its attempt began: an answer to an attempt sent
        before the latest failure says nothing about the upstream now (it was
        already on its way), so it does not end the backoff.  Neither does an
        exchange its client ``abandoned``.
        """
        self.inflight -= 1
        now = self._clock.seconds()
        if failed:
            self._last_failure = now
            # Concurrent requests failing together are one failure of the upstream,
            # not many: the pause grows once per wave, not once per request.
            if now >= self._backoff_until:
                self._failures_in_a_row += 1
                # The first failure retries at once: it is often a stale pooled connection.
                if self._failures_in_a_row > 1:
                    delay = min(
                        self.backoff_max_seconds,
                        self.backoff_seconds * 2 ** (self._failures_in_a_row - 2),
                    )
                    self._backoff_until = now + delay
        elif not abandoned and (started is None or started >= self._last_failure):
            self.reset_backoff()
        self._wake()
        if self.inflight == 0 and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def reset_backoff(self) -> None:
        """Forget past failures: an answer came back, or the GPU was declared back."""
        self._failures_in_a_row = 0
        self._backoff_until = 0.0
        if self._timer is not None:
            # A release task sleeping out the old pause looks again now.
            self._wake()

    def stop(self) -> None:
        """Stop releasing for good (shutdown)."""
        self._stopped = True
        if self._task is not None:
            try:
                self._task.stop()
            except (TaskDone, TaskStopped):
                pass
        self._forget_wait()

    def _wake(self) -> None:
        """End the release task's wait: a slot freed or a pause ran out."""
        waiting = self._forget_wait()
        if waiting is not None:
            waiting.callback(None)

    def _forget_wait(self) -> Deferred | None:
        """Drop the pending wait and its timer, without firing it.

        A stopped task must not be woken: the Cooperator already completed it,
        and firing (or cancelling) what it waited on would complete it twice.
        """
        if self._timer is not None and self._timer.active():  # clock.cancel, inline: every request's end runs it
            self._timer.cancel()
        self._timer = None
        waiting, self._waiting = self._waiting, None
        return waiting

    def _sleep(self, seconds: float) -> Deferred:
        """Wait until a slot frees or ``seconds`` pass (0: only a free slot wakes it)."""
        self._waiting = Deferred()
        if seconds > 0:
            self._timer = self._clock.callLater(seconds, self._wake)
        return self._waiting

    def _release(self):
        while self.has_work() and not self._stopped:
            if self.inflight >= self._cap():
                yield self._sleep(0)
                continue
            now = self._clock.seconds()
            wait = max(self._next_start, self._backoff_until) - now
            if wait > 0:
                yield self._sleep(wait)
                continue
            if self.rate > 0:
                self._next_start = now + 1.0 / self.rate
            self.started()
            # ``has_work`` just saw an entry for its member, and nothing ran since.
            self.release()
            yield None

    def _task_ended(self, result) -> None:
        self._task = None
        self._forget_wait()
        if self.says_drained and not self._lot and not self._state.yielded and not self._stopped:
            # The task only runs while draining, so this is the end of a drain:
            # the last of the three state changes gets its log line too.
            log.info(
                "lot drained: now available, in flight {inflight} (draining lasted {lasted:.1f}s)",
                inflight=self.inflight,
                lasted=self._clock.seconds() - self._state.last_change,
            )
        self.kick()
