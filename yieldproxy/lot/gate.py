"""The gate: decides, for each request, go now (and to which upstream), park, or refuse with reasons.

It ties the yield state, the parking lot and the pool (its members and
their drainers, upstream/pool/routing.py) together, the pool as :class:`Upstreams`
(what the gate asks of it: the lot imports nothing of the upstream's), and is the only place that knows
a class's policy and hold bound.  It also keeps the
recent upstream service time, from which honest ``Retry-After`` values come,
so it explains every refusal the lot makes (:meth:`Gate.explain`): when to
come back and, for a request that expired in the lot, what kept it waiting.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ..config import ClassConfig
from ..names import LOADING_SOURCE, OUTAGE_SOURCE
from ..observe.metrics import Metrics
from .parking import RELEASED, Entry, ParkingLot, Refused, Routing, hold_bound
from .replay import Replayer
from .state import YieldState

log = Logger()

#: Weight of the newest sample in the service-time average.
_EWMA_WEIGHT = 0.1


def _whole_seconds(seconds: float) -> int:
    """Retry-After is whole seconds, at least 1; rounding noise must not add one."""
    return max(1, math.ceil(seconds - 1e-6))


class Upstream(Protocol):
    """What the gate reads of one upstream of the pool (upstream/pool/member.py's ``Member``)."""

    @property
    def name(self) -> str: ...
    @property
    def drainer(self) -> Replayer: ...
    @property
    def not_ready(self) -> bool: ...
    def state_name(self) -> str: ...


class Upstreams(Protocol):
    """What the gate asks of the pool (upstream/pool/routing.py's ``Pool``): where a request may go, and the pool's state."""

    @property
    def members(self) -> Sequence[Upstream]: ...
    #: Whether what is said of the pool names its members (upstream/pool/members.py's ``PoolShape``).
    @property
    def names_members(self) -> bool: ...
    @property
    def inflight(self) -> int: ...
    @property
    def release_held(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...
    #: Whether a member may serve an entry's embeddings (the pool's twin check; its ``Member`` is the argument).
    @property
    def twin_ok(self) -> Callable[[Any, Entry], bool]: ...
    def member(self, name: str | None) -> Upstream: ...
    def routing(self, method: str | None, path: str | None, cls: str, model: str | None) -> Routing: ...
    def choose(self, entry: Entry) -> Upstream | None: ...
    def all_held(self, entry: Entry) -> bool: ...
    def none_coming_back(self, entry: Entry) -> bool: ...
    def may_serve(self, entry: Entry) -> tuple[str, ...]: ...
    def state_name(self, lot_empty: bool) -> str: ...


@attrs.define(eq=False)
class Gate:
    """Admission for parkable requests."""

    _clock: IReactorTime
    _state: YieldState
    _lot: ParkingLot
    #: The upstreams, their availability and their drainers (the pool).
    pool: Upstreams
    _metrics: Metrics
    _classes: Mapping[str, ClassConfig]
    reject_status: int = 503
    #: Recent upstream service time (seconds), an exponentially weighted average.
    service_seconds: float = 0.5
    #: Set when the proxy stops (:meth:`stop_admitting`): every request is refused from then on.
    shutting_down: bool = False
    #: Told of each new request's admission: ``(entry, member it went to at once or None,
    #: the reason it was refused or None)`` (the ``[fallback]`` counts why it did not serve one).
    on_arrival: Callable[[Entry, str | None, str | None], None] = lambda entry, member, refused: None

    @property
    def yielded(self) -> bool:
        return self._state.yielded

    @property
    def state_name(self) -> str:
        """``yielded``, ``draining`` or ``available``: the proxy as a whole (:meth:`Pool.state_name`).

        A held release (a model preload after the yield) reads as draining:
        the GPU is back and the proxy is working its way to serving the lot.
        """
        return self.pool.state_name(not self._lot)

    def describe(self) -> str:
        """The state, what is parked and what is in flight, for the state log line (state.transition_logger)."""
        counts = self._lot.count_by_class()
        parked = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v) or "none"
        return f"now {self.state_name}, parked {parked}, in flight {self.pool.inflight}"

    def admit(self, entry: Entry) -> Deferred[Entry]:
        """A Deferred that fires with ``entry`` when it may go upstream, ``entry.released_to`` naming where.

        It goes at once to a member :meth:`Pool.choose` picks; else it parks
        until a member's drainer lets it out.  It fails with :class:`Refused`
        when the request is turned away, at once or after waiting
        (:meth:`explain` words it for the caller).  A request coming back
        after a failed attempt (``entry.tries > 0``, or a failed turn at
        another target after parking) keeps its place in line and is not
        checked against the ceilings again: it was accepted already.
        """
        if self.shutting_down:
            raise Refused("shutdown", "the proxy is shutting down", 503, self.retry_after())
        returning = entry.tries > 0 or entry.was_parked
        try:
            admitted = self._admit(entry, returning)
        except Refused as refusal:
            if not returning:
                self.on_arrival(entry, None, refusal.reason)
            raise
        if not returning:
            self.on_arrival(entry, entry.released_to if admitted.called else None, None)
        return admitted

    def _admit(self, entry: Entry, returning: bool) -> Deferred[Entry]:
        pool = self.pool
        self._lot.number(entry)
        if entry.routing is None:
            entry.routing = pool.routing(None, None, entry.cls, None)
            if not entry.eligible:
                self._metrics.rejected_total.labels(entry.cls, "no_upstream").inc()
                raise Refused(
                    "no_upstream", f"no upstream of the pool may serve {entry.cls} requests (upstreams.*.classes)",
                    self.reject_status, self.retry_after(),
                )
        if not returning:
            member = pool.choose(entry)
            if member is not None:
                entry.released_to = member.name
                entry.move(RELEASED)
                member.drainer.started()
                return succeed(entry)
        cls = self._classes[entry.cls]
        if pool.all_held(entry):
            if cls.policy == "reject":
                self._metrics.rejected_total.labels(entry.cls, "policy").inc()
                raise Refused(
                    "policy",
                    f"policy rejects {entry.cls} requests during a yield",
                    self.reject_status,
                    self.retry_after(),
                )
            self._check_budget(entry, cls)
        try:
            return self._lot.park(entry, cls.hold_seconds, check_room=not returning)
        except Refused as refusal:
            self._metrics.rejected_total.labels(entry.cls, refusal.reason).inc()
            raise

    def number_adopted(self, entry: Entry) -> None:
        """Place a request adopted from the process this one replaced (lifecycle/succession/) ahead of every arrival here."""
        self._lot.number_adopted(entry)

    def explain(self, refusal: Refused, entry: Entry | None = None) -> Refused:
        """``refusal`` as the caller reads it: with ``Retry-After``, and for an expiry, what kept it waiting.

        The lot refuses without either (it knows neither the yield nor the
        service time), so whoever answers a refusal of :meth:`admit` asks
        here, as it happens: an expiry's cause is the state at that moment.
        """
        if refusal.reason == "expired":
            return refusal.advised(self.retry_after(), self.why_still_waiting(entry))
        if refusal.retry_after is None:
            return refusal.advised(self.retry_after())
        return refusal

    def stop_admitting(self) -> None:
        """The proxy is stopping: refuse every request from now on, new or coming back."""
        self.shutting_down = True

    def finished(self, failed: bool = False, seconds: float | None = None, member: str | None = None) -> None:
        """The upstream exchange of an admitted request ended (at ``member``: ``entry.released_to``)."""
        if seconds is not None and not failed:
            self.service_seconds += _EWMA_WEIGHT * (seconds - self.service_seconds)
        started = None if seconds is None else self._clock.seconds() - seconds
        self.pool.member(member).drainer.finished(failed, started)

    def why_still_waiting(self, entry: Entry | None = None) -> str:
        """What keeps the lot waiting right now, for the message of a request that expires in it.

        In a pool, what kept each upstream ``entry`` may go to from taking
        it (held, unreachable, not a verified twin...): the pool as a whole
        may be far from yielded.
        """
        # With one member the message speaks of the GPU and the upstream.
        if entry is not None and self.pool.names_members:
            return self._why_no_member(entry)
        if self._state.yielded:
            sources = sorted({hold.source for hold in self._state.holds})
            if sources == [OUTAGE_SOURCE]:
                return "the upstream was failing and had not recovered in time (outage detected by the proxy)"
            if sources == [LOADING_SOURCE]:
                return "the upstream was still loading its model past upstream.not_ready_max_seconds"
            return f"the GPU was still yielded (held by {', '.join(sources)})"
        loading = [m.name for m in self.pool.members if m.not_ready]
        if loading:
            return f"the upstream was still loading its model (not ready: {', '.join(loading)})"
        if self.pool.release_held:
            return "the GPU was back, but the models were still being loaded back onto it"
        return (
            f"the GPU was back, but the requests ahead of this one still held all "
            f"{self.pool.concurrency} replay slots"
        )

    def _why_no_member(self, entry: Entry) -> str:
        reasons = []
        for name in entry.eligible:
            member = self.pool.member(name)
            state = member.state_name()
            if state == "available" and not self.pool.twin_ok(member, entry):
                state = f"not a verified twin for {entry.model}'s embeddings"
            elif state == "available":
                state = "busy with the requests ahead of this one"
            elif state == "not_ready":
                state = "still loading its model (not ready)"
            elif state in ("yielded", "outage"):
                sources = sorted({hold.source for hold in self._state.holds_for(name)})
                state = f"{state} (held by {', '.join(sources)})"
            reasons.append(f"{name} {state}")
        return "no upstream that may serve it was free: " + "; ".join(reasons)

    def retry_after(self) -> int:
        """Seconds a refused caller should wait, from what is known.

        The declared end of the yield when every hold gave one; else, while
        yielded, as long again as the yield has lasted (a yield that has run
        a minute is likely to run another); else the queue ahead of the
        caller times the recent service time, spread over the replay slots.
        """
        now = self._clock.seconds()
        if self._state.yielded:
            end = self._state.expected_end()
            if end is not None:
                return _whole_seconds(end - now)
            since = self._state.yielded_since if self._state.yielded_since is not None else now
            return min(300, _whole_seconds(now - since))
        ahead = len(self._lot)
        return _whole_seconds(ahead * self.service_seconds / self.pool.concurrency)

    def refuse_all_parked(self, why: str) -> int:
        """Answer every parked request with 503 (shutdown, its time is up)."""
        return self._lot.refuse_all(lambda entry: Refused("shutdown", why, 503, self.retry_after()))

    def refuse_held_parked(self, why: str) -> int:
        """Answer with 503 every parked request whose every upstream that may serve it is held (shutdown):
        no yield ends for it before the proxy is gone, so it need not wait out the drain's timeout."""
        return self._lot.refuse_all(
            lambda entry: Refused("shutdown", why, 503, self.retry_after()), self.pool.none_coming_back,
        )

    def _check_budget(self, entry: Entry, cls: ClassConfig) -> None:
        """Refuse at once when the declared yield outlasts what this request may wait.

        Not when a member it may use is not held (a verified standby copy): it
        waits for that one, up to its hold bound as ever.
        """
        # The soonest any member it may use is expected back (an embedding: its reference or a verified twin).
        end = self._state.expected_end(self.pool.may_serve(entry))
        if end is None:
            return
        remaining = end - self._clock.seconds()
        budget, by_caller = hold_bound(cls.hold_seconds, entry.max_wait)
        if remaining <= budget:
            return
        self._metrics.rejected_total.labels(entry.cls, "over_budget").inc()
        if by_caller:
            why = (
                f"wait longer than your X-Yield-Max-Wait: the GPU is expected back in "
                f"{remaining:.0f}s, you allow {entry.max_wait:g}s"
            )
        else:
            why = (
                f"yielded past the hold bound: the GPU is expected back in {remaining:.0f}s, "
                f"{entry.cls} requests are held at most {cls.hold_seconds:g}s"
            )
        raise Refused("over_budget", why, self.reject_status, _whole_seconds(remaining))

