"""The graceful stop's middle: settle the parked and in-flight requests, within a bound.

Its steps and their order among the stop's: docs/architecture.md (*Start and
stop*).  Each wait is on an event, not a poll: the lot and the replayers fire
their waiters when they empty (:meth:`ParkingLot.when_empty`,
:meth:`~yieldproxy.lot.replay.Replayer.when_idle`), as Twisted's
``ClientService`` fires its own.  Last it waits (at most :data:`FLUSH_SECONDS`)
for the answers still buffered in the proxy's transports (why: edge/capacity.py, ``Connections.flushed``).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ..lot.parking import ParkingLot
from ..lot.state import YieldState
from ..schedule.scheduler import Scheduler

log = Logger()

#: The longest the stop waits for answers written already to reach their sockets (a client that reads
#: nothing holds its connection no longer than this).
FLUSH_SECONDS = 5.0


class Outgoing(Protocol):
    """A listener's connections (edge/capacity.py's Connections): what they still have to write, waited for."""

    def flushed(self) -> Deferred[None]: ...


class InFlight(Protocol):
    """Where admitted requests go (the primary's replayer, the fallback): what is in flight there."""

    @property
    def inflight(self) -> int: ...

    def when_idle(self) -> Deferred[None]: ...


@attrs.define(eq=False, slots=False)
class Drain(Service):
    """Settles the parked and in-flight requests when the proxy stops."""

    _clock: IReactorTime
    _state: YieldState
    #: The scheduler (schedule/scheduler.py): it stops admitting, and its drainers stop once the drain is over.
    _scheduler: Scheduler
    _lot: ParkingLot
    #: Every target requests may be in flight at (the members' drainers first).
    _targets: Sequence[InFlight]
    #: ``proxy.shutdown_timeout_seconds``.
    timeout: float = 30.0
    #: The proxy listener's connections: the answers written to them are waited for (see the module docstring).
    outgoing: Sequence[Outgoing] = ()

    name = "drain"  # type: ignore[assignment]  # Twisted types Service.name as None

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]  # Twisted leaves it unannotated
        return Deferred.fromCoroutine(self._drain())

    async def _drain(self) -> None:
        self._scheduler.stop_admitting()
        # A parked request whose every upstream is held cannot be served before the proxy is gone.
        count = self._scheduler.refuse_held_parked("the proxy is shutting down while the GPU is yielded")
        if count:
            log.info("shutdown: answered {count} parked requests with 503", count=count)
        try:
            await Deferred.fromCoroutine(self._settled()).addTimeout(self.timeout, self._clock)
        except TimeoutError:
            left = self._scheduler.refuse_all_parked("the proxy is shutting down")
            log.warn(
                "shutdown: {inflight} requests still in flight after {timeout:g}s; {left} parked answered with 503",
                inflight=sum(target.inflight for target in self._targets), timeout=self.timeout, left=left,
            )
        self._scheduler.stop()
        self._state.stop()
        if self.outgoing:
            try:
                await DeferredList([o.flushed() for o in self.outgoing]).addTimeout(FLUSH_SECONDS, self._clock)
            except TimeoutError:
                log.warn("shutdown: answers still unwritten after {timeout:g}s; their connections end with the process",
                         timeout=FLUSH_SECONDS)

    def settled(self) -> bool:
        """Nothing parked, nothing in flight."""
        return not self._lot and not any(target.inflight for target in self._targets)

    async def _settled(self) -> None:
        """Wait for each to empty in turn, until all are empty at once (a failed attempt may park again)."""
        while not self.settled():
            await self._lot.when_empty()
            for target in self._targets:
                await target.when_idle()
