"""One upstream of the pool as it runs: whether it takes requests now, and what it has in flight.

A member is *available* when no hold applies to it (its own, or one of all
members), it is not handing over (a model preload after its yield holds its
drainer), and it is not known unreachable.  Unreachable is for pools of
several only: a member whose attempts are refused before it ever answered
(a wrong address, a server not started yet) is passed over and checked
again on a growing interval, while the others serve; a pool of one answers
such attempts 502 at once, as a single upstream always did.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ..health import UpstreamHealth
from ..names import OUTAGE_SOURCE
from ..replay import Replayer
from ..state import YieldState
from .members import MemberSpec
from .models import ModelCatalogue

log = Logger()

#: What ``/status`` says of a member (and the ``state`` label of its metrics).
MEMBER_STATES = ("available", "yielded", "outage", "handing_over", "unreachable")


@attrs.define(eq=False)
class Member:
    """A pool member: its spec, its client, its health, its models and its drainer."""

    spec: MemberSpec
    #: Its place in config order (ties in the choice go to the first).
    index: int
    _clock: IReactorTime
    _state: YieldState
    #: What the pool knows of its kind of server (:mod:`.apis`).
    server: Any
    health: UpstreamHealth
    catalogue: ModelCatalogue
    #: Releases the lot into it, under its ``replay_concurrency``; its in-flight count.
    drainer: Replayer
    #: Its client for requests (:class:`~yieldproxy.forward.Upstream`); None in clock-only tests.
    upstream: Any = None
    #: Its control-plane client (:class:`~yieldproxy.control.UpstreamControl`); None in clock-only tests.
    control: Any = None
    #: The first and the longest wait between checks of an unreachable member.
    recheck_seconds: float = 0.5
    recheck_max_seconds: float = 10.0
    #: Called when it becomes available again after being unreachable (the pool wakes its drainers).
    on_reachable: Callable[[], None] = lambda: None
    #: Attempts were refused before it ever answered (see the module docstring).
    _refusing: bool = False
    _recheck: IDelayedCall | None = None
    _recheck_delay: float = 0.0
    _checking: Deferred | None = None
    _stopped: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def inflight(self) -> int:
        return self.drainer.inflight

    @property
    def unreachable(self) -> bool:
        """Attempts were refused and it has not answered since the proxy started."""
        return self._refusing and not self.health.reachable

    def held(self) -> bool:
        """Some hold applies to it (its own, or one of every member)."""
        return self._state.yielded_for(self.spec.name)

    def available(self) -> bool:
        """True when it takes requests now."""
        return not (self._state.yielded_for(self.spec.name) or self.drainer.release_held or self.unreachable)

    def state_name(self) -> str:
        """One of :data:`MEMBER_STATES`."""
        if self._state.yielded_for(self.spec.name):
            holds = self._state.holds_for(self.spec.name)
            return "outage" if holds and all(h.source == OUTAGE_SOURCE for h in holds) else "yielded"
        if self.drainer.release_held:
            return "handing_over"
        if self.unreachable:
            return "unreachable"
        return "available"

    # -- unreachable ------------------------------------------------------------------

    def refused(self) -> None:
        """An attempt could not connect, and it never answered: pass it over until a check gets an answer."""
        if self._refusing and self._recheck is not None:
            return
        if not self._refusing:
            log.warn(
                "upstream {name} ({url}) refuses connections and has not answered since the start: "
                "passing it over, the other upstreams serve; checking it again every few seconds",
                name=self.name, url=self.spec.url,
            )
        self._refusing = True
        self._recheck_delay = self.recheck_seconds
        self._schedule_recheck()

    def stop(self) -> None:
        """The proxy stops: no more checks."""
        self._stopped = True
        if self._recheck is not None and self._recheck.active():
            self._recheck.cancel()
        self._recheck = None
        if self._checking is not None:
            self._checking.cancel()

    def _schedule_recheck(self) -> None:
        if self._stopped:
            return
        if self._recheck is None or not self._recheck.active():
            self._recheck = self._clock.callLater(self._recheck_delay, self._check)
            self._recheck_delay = min(self.recheck_max_seconds, self._recheck_delay * 2)

    def _check(self) -> None:
        self._recheck = None
        if not self.unreachable:
            self._reachable()
            return
        if self.control is None:
            self._schedule_recheck()
            return
        d = self._checking = self.control.request("GET", self.spec.health_path, timeout=self.recheck_max_seconds)

        def answered(answer) -> None:
            self.health.answered()  # any answer: it is there (its health is the outage watcher's business)
            self._reachable()

        def failed(failure) -> None:
            if self._refusing:
                self._schedule_recheck()

        def done(result):
            self._checking = None
            return result

        d.addBoth(done).addCallbacks(answered, failed)

    def _reachable(self) -> None:
        if self._refusing:
            self._refusing = False
            log.info("upstream {name} ({url}) answers: taking requests", name=self.name, url=self.spec.url)
            self.on_reachable()
