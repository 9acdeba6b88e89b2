"""The scheduler: admission, the choice of member, when a member takes a parked entry, and release.

Its events and effects, and which room owns what: docs/architecture.md ("The scheduler"); the rules
are docs/pool.md's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Cooperator
from twisted.logger import Logger

from ..clock import same
from ..config import ClassConfig, Config
from ..lot.parking import Entry, ParkingLot, Refused, hold_bound
from ..lot.replay import Replayer
from ..lot.state import YieldState
from ..observe.metrics import Metrics
from ..upstream.pool.member import Member
from ..upstream.pool.members import PoolShape
from . import words
from .lines import STANDBY_ONLY, Lines
from .routing import Eligibility, Routing

log = Logger()

#: Weight of the newest sample in the service-time average.
_EWMA_WEIGHT = 0.1


def any_member(member: Member, entry: Entry) -> bool:
    """The twin check of a pool without twin verification (one upstream): every eligible member may serve."""
    return True


@attrs.define(eq=False)
class Scheduler:
    """The one owner of where a request goes and when, over the lot and the pool's members."""

    _clock: IReactorTime
    _state: YieldState
    _lot: ParkingLot
    #: The members, in config order (upstream/pool/routing.py's ``make_members``).
    members: tuple[Member, ...]
    _metrics: Metrics
    _config: Config
    _cooperator: Cooperator
    #: ``twin_ok(member, entry)``: may ``member`` serve ``entry`` now (an embedding: the model's
    #: reference or a verified twin: upstream/pool/twins.py).
    twin_ok: Callable[[Member, Entry], bool] = any_member
    #: What the number of members decides (upstream/pool/members.py's ``pool_shape``).
    shape: PoolShape = attrs.field(kw_only=True)
    #: Recent upstream service time (seconds), an exponentially weighted average.
    service_seconds: float = 0.5
    #: Set when the proxy stops (:meth:`stop_admitting`): every request is refused from then on.
    shutting_down: bool = False
    reject_status: int = attrs.field(init=False)
    _classes: Mapping[str, ClassConfig] = attrs.field(init=False)
    _by_name: dict[str, Member] = attrs.field(init=False)
    _eligibility: Eligibility = attrs.field(init=False)
    _lines: Lines = attrs.Factory(Lines)
    #: Told of each new request's admission (:meth:`when_arrived`).
    _arrivals: list[Callable[[Entry, str | None, str | None], None]] = attrs.Factory(list)
    #: Each member's drainer, by name (made here: they ask this scheduler what to take).
    _drainers: dict[str, Replayer] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.reject_status = self._config.parking.reject_status
        self._classes = self._config.classes
        self._by_name = {m.name: m for m in self.members}
        self._eligibility = Eligibility(self.members)
        up, replay = self._config.upstream, self._config.replay
        self._drainers = {
            m.name: Replayer(
                self._clock, self._lot, self._state, self._metrics, self._cooperator,
                concurrency=m.spec.replay_concurrency,
                rate=replay.rate if m.spec.rate is None else m.spec.rate,
                backoff_seconds=up.retry_backoff_seconds, backoff_max_seconds=up.retry_backoff_max_seconds,
                cautious=m.spec.fallback,
                has_work=functools.partial(self._has_work, m.name),
                release=functools.partial(self._release_to, m.name),
                # With one member, its drainer ending its drain is the proxy's "now available" (its log line).
                says_drained=not self.shape.names_members,
            )
            for m in self.members
        }

    def follow(self) -> tuple[tuple[Callable[[Callable[..., None]], None], Callable[..., None]], ...]:
        """What it follows, as (subscribe, listener) pairs: the composition root subscribes them."""
        return (
            (self._lot.when_out, self._lines.remove),
            (self._state.observe_members, self.member_changed),
            *((m.when_back, self.member_back) for m in self.members),
            *((m.catalogue.when_changed, self._eligibility.forget) for m in self.members),
        )

    def when_arrived(self, listener: Callable[[Entry, str | None, str | None], None]) -> None:
        """Call ``listener(entry, member it went to at once or None, why it was refused or None)`` on each
        new request's admission (the ``[fallback]`` counts why it did not serve one)."""
        self._arrivals.append(listener)

    def _arrived(self, entry: Entry, member: str | None, refused: str | None) -> None:
        for listener in self._arrivals:
            listener(entry, member, refused)

    # -- the members, as the proxy app reads them --------------------------------------------------------

    def member(self, name: str | None) -> Member:
        """The member ``name`` (None: the first)."""
        return self.members[0] if name is None else self._by_name[name]

    def drainer(self, name: str | None) -> Replayer:
        """Member ``name``'s drainer (None: the first's): its in-flight count, pace and backoff."""
        return self._drainers[self.members[0].name if name is None else name]

    @property
    def drainers(self) -> tuple[Replayer, ...]:
        return tuple(self._drainers.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def routing(
        self, method: str | None, path: str | None, cls: str, model: str | None, translatable: bool = True
    ) -> Routing:
        """Which members may serve a request (schedule/routing.py), one shared value per key."""
        return self._eligibility.routing(method, path, cls, model, translatable)

    def passthrough_member(self, method: str, path: str, model: str | None) -> Member:
        return self._eligibility.passthrough_member(method, path, model)

    def members_serving(self, method: str, path: str) -> list[Member]:
        return self._eligibility.members_serving(method, path)

    def waiting_for(self, name: str) -> int:
        """Parked entries member ``name`` is eligible for (schedule/lines.py)."""
        return self._lines.waiting_for(name)

    # -- admission --------------------------------------------------------------------------------------

    def admit(self, entry: Entry) -> Deferred[Entry]:
        """A Deferred that fires with ``entry`` when it may go upstream, ``entry.released_to`` naming where.

        It goes at once to the member :meth:`choose` picks, else parks until a member's drainer lets
        it out; it fails with :class:`Refused` when turned away, at once or after waiting
        (:meth:`explain` words it).  A request coming back after a failed attempt (or a failed turn
        elsewhere after parking) keeps its place and is not checked against the ceilings again.
        """
        if self.shutting_down:
            raise Refused("shutdown", "the proxy is shutting down", 503, self.retry_after())
        returning = entry.tries > 0 or entry.was_parked
        try:
            admitted = self._admit(entry, returning)
        except Refused as refusal:
            if not returning:
                self._arrived(entry, None, refusal.reason)
            raise
        if not returning and self._arrivals:
            self._arrived(entry, entry.released_to if admitted.called else None, None)
        return admitted

    def _admit(self, entry: Entry, returning: bool) -> Deferred[Entry]:
        self._lot.number(entry)
        if entry.routing is None:
            entry.routing = self.routing(None, None, entry.cls, None)
            if not entry.eligible:
                self._metrics.rejected_total.labels(entry.cls, "no_upstream").inc()
                raise Refused(
                    "no_upstream", f"no upstream of the pool may serve {entry.cls} requests (upstreams.*.classes)",
                    self.reject_status, self.retry_after(),
                )
        if not returning:
            member = self.choose(entry)
            if member is not None:
                entry.released_to = member.name
                entry.fire("go")
                self._drainers[member.name].started()
                return succeed(entry)
        cls = self._classes[entry.cls]
        if self.all_held(entry):
            if cls.policy == "reject":
                self._metrics.rejected_total.labels(entry.cls, "policy").inc()
                raise Refused(
                    "policy", f"policy rejects {entry.cls} requests during a yield", self.reject_status,
                    self.retry_after(),
                )
            self._check_budget(entry, cls)
        try:
            parked = self._lot.park(entry, cls.hold_seconds, check_room=not returning)
        except Refused as refusal:
            self._metrics.rejected_total.labels(entry.cls, refusal.reason).inc()
            raise
        self._lines.add(entry)
        for name in entry.eligible:
            # It may be one this drainer can take now.
            self._drainers[name].kick()
        return parked

    def _check_budget(self, entry: Entry, cls: ClassConfig) -> None:
        """Refuse at once when the declared yield outlasts what this request may wait (not when a member
        it may use is not held, a verified standby copy: it waits for that one, up to its bound)."""
        end = self._state.expected_end(self.may_serve(entry))
        if end is None:
            return
        remaining = end - self._clock.seconds()
        budget, by_caller = hold_bound(cls.hold_seconds, entry.max_wait)
        if remaining <= budget:
            return
        self._metrics.rejected_total.labels(entry.cls, "over_budget").inc()
        raise words.over_budget(entry, cls, remaining, by_caller, self.reject_status)

    def number_adopted(self, entry: Entry) -> None:
        """Place a request adopted from the process this one replaced (lifecycle/succession/) ahead of every arrival here."""
        self._lot.number_adopted(entry)

    def stop_admitting(self) -> None:
        """The proxy is stopping: refuse every request from now on, new or coming back."""
        self.shutting_down = True

    def refuse_all_parked(self, why: str, which: Callable[[Entry], bool] | None = None) -> int:
        """Answer every parked request (``which`` allows) with 503 (shutdown, its time is up)."""
        return self._lot.refuse_all(lambda entry: Refused("shutdown", why, 503, self.retry_after()), which)

    def refuse_held_parked(self, why: str) -> int:
        """Answer with 503 every parked request whose every upstream that may serve it is held (shutdown):
        no yield ends for it before the proxy is gone, so it need not wait out the drain's timeout."""
        return self.refuse_all_parked(why, self.none_coming_back)

    # -- the choice of member ------------------------------------------------------------------------------

    def available(self, member: Member) -> bool:
        """``member.available()``, the holds asked of the yield state here (the member does not ask the lot's)."""
        return not self._state.yielded_for(member.name) and member.takes_work()

    def usable(self, member: Member, entry: Entry) -> bool:
        """Available now, and (for an embedding) the model's reference or a verified twin."""
        # available(member), inline: asked of every eligible member of every request.
        if self._state.yielded_for(member.name) or not member.takes_work():
            return False
        return self.twin_ok is any_member or self.twin_ok(member, entry)

    def choose(self, entry: Entry) -> Member | None:
        """The member ``entry`` goes to at once, or None: it parks.

        Among the usable eligible members nobody parked waits for (no overtaking), the least in flight,
        then the first in config order; a standby member only while no ``always`` one is usable, and
        below its cap, and not while its drainer pauses after failures.
        """
        best = None
        spare = None
        always_usable = False
        best_load = spare_load = 0
        for name in entry.eligible:
            member = self._by_name[name]
            if not self.usable(member, entry):
                continue
            drainer = self._drainers[name]
            if member.spec.standby:
                if drainer.can_start() and not self._someone_waits(name) and (spare is None or drainer.inflight < spare_load):
                    spare, spare_load = member, drainer.inflight
                continue
            always_usable = True
            if not self._someone_waits(name) and (best is None or drainer.inflight < best_load):
                best, best_load = member, drainer.inflight
        if best is not None:
            return best
        return spare if not always_usable else None

    def _someone_waits(self, name: str) -> bool:
        """A parked request ``name`` may take now waits: counted first (O(1)), looked for only when a
        twin check may refuse some of them."""
        if not self._lines.waiting_for(name):
            return False
        if self.twin_ok is any_member:
            return True
        return bool(self._lines.heads(name, functools.partial(self.may_take, name)))

    def all_held(self, entry: Entry) -> bool:
        """A hold applies to every member that may serve ``entry``: it waits for a yield to end (class
        policies and the hold budget apply only then)."""
        return all(self._state.yielded_for(name) for name in self.may_serve(entry))

    def none_coming_back(self, entry: Entry) -> bool:
        """At shutdown: every member that may serve ``entry`` is held or standby (a standby member takes
        no parked work once the proxy stops)."""
        return all(self._state.yielded_for(name) or self._by_name[name].spec.standby for name in self.may_serve(entry))

    def may_serve(self, entry: Entry) -> tuple[str, ...]:
        """The eligible members the twin check lets serve ``entry`` (all eligible ones when it lets none:
        an unverified twin is no way out of its reference's yield)."""
        if entry.kind != "embedding" or self.twin_ok is any_member:
            return entry.eligible
        names = tuple(name for name in entry.eligible if self.twin_ok(self._by_name[name], entry))
        return names or entry.eligible

    def may_take(self, name: str, entry: Entry) -> bool:
        """Whether ``name`` may take ``entry`` from the lot now: a standby member only while no ``always``
        member it is eligible for is usable; the member its last attempt failed on only while no other
        (of the same use) is.  Depends only on the entry's routing and ``failed_on`` (schedule/lines.py)."""
        if name not in entry.eligible:
            return False
        member = self._by_name[name]
        if entry.failed_on == name and member.spec.fallback:
            return False  # a request the fallback failed waits for the others (its errors are never shown)
        if not self.twin_ok(member, entry):
            return False
        standby = member.spec.standby
        if standby or entry.failed_on == name:
            for other_name in entry.eligible:
                if other_name == name:
                    continue
                other = self._by_name[other_name]
                if (not other.spec.standby or (standby and entry.failed_on == name)) and self.usable(other, entry):
                    return False
        return True

    # -- release ----------------------------------------------------------------------------------------

    def _has_work(self, name: str) -> bool:
        """Whether ``name``'s drainer has an entry to let out now: its member is available and something
        it may take waits (O(members) until it must look along its line)."""
        member = self._by_name[name]
        if not (self._lines.waiting_for(name) and self.available(member)):
            return False
        if (
            member.spec.standby and self.twin_ok is any_member
            and all(self.available(m) for m in self.members if not m.spec.standby)
        ):
            # Every always member takes what it may: a standby one only what none of them may.
            if not self._lines.waiting_for(STANDBY_ONLY):
                return False
        return bool(self._lines.heads(name, functools.partial(self.may_take, name)))

    def _release_to(self, name: str) -> Entry | None:
        """``name``'s drainer lets out the next entry it may take, in the lot's drain order (its slot is taken)."""
        return self._lot.release_first(self._lines.heads(name, functools.partial(self.may_take, name)), name)

    def finished(self, failed: bool = False, seconds: float | None = None, member: str | None = None) -> None:
        """The upstream exchange of an admitted request ended (at ``member``: ``entry.released_to``)."""
        if seconds is not None and not failed:
            self.service_seconds += _EWMA_WEIGHT * (seconds - self.service_seconds)
        started = None if seconds is None else self._clock.seconds() - seconds
        self.drainer(member).finished(failed, started)

    def kick(self) -> None:
        """Wake every drainer (one of them may have work now)."""
        for drainer in self._drainers.values():
            drainer.kick()

    def member_changed(self, name: str, yielded: bool) -> None:
        """A member was taken or given back: its backoff starts afresh, and every drainer looks again
        (a standby member's turn depends on the others)."""
        self.member_back(name, fresh=not yielded)

    def member_back(self, name: str, fresh: bool) -> None:
        """A member may take work again (upstream/pool/member.py's ``when_back``)."""
        if fresh:
            self._drainers[name].reset_backoff()
        self.kick()

    def stop(self) -> None:
        """The proxy stops: every drainer for good, every member's checks."""
        for member in self.members:
            self._drainers[member.name].stop()
            member.stop()

    # -- the state, and the words for the caller ------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return sum(d.inflight for d in self._drainers.values())

    @property
    def release_held(self) -> bool:
        """Some member's release is held (a model preload after its yield)."""
        return any(m.release_held for m in self.members)

    @property
    def concurrency(self) -> int:
        """The replay slots of the available members (all of them when none is)."""
        caps = [self._drainers[m.name].concurrency for m in self.members if self.available(m)]
        return sum(caps) or sum(d.concurrency for d in self._drainers.values())

    @property
    def state_name(self) -> str:
        """``yielded`` when no ``always`` member is available or handing over, ``unreachable`` when that is
        so because none of them has answered since the start (none held), ``draining`` when the lot is not
        empty or a release is held (the GPU is back, the proxy works its way to the lot), else ``available``."""
        always = [m for m in self.members if not m.spec.standby]
        coming = [
            m for m in always
            if not self._state.yielded_for(m.name) and not m.never_answered and not m.not_ready
        ]
        if not coming:
            if all(m.never_answered and not self._state.yielded_for(m.name) for m in always):
                return "unreachable"
            return "yielded"
        return "available" if not self._lot and not self.release_held else "draining"

    def describe(self) -> str:
        """The state, what is parked and what is in flight, for the state log line (state.transition_logger)."""
        counts = self._lot.count_by_class()
        parked = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v) or "none"
        return f"now {self.state_name}, parked {parked}, in flight {self.inflight}"

    def status(self, shown: Callable[[float], float] = same) -> list[dict[str, Any]]:
        """The ``upstreams`` section of ``/status``: one row per member, in config order (times given to ``shown``)."""
        now = self._clock.seconds()
        return [
            {
                "name": m.name,
                "url": m.spec.url,
                "api": m.spec.api,
                "use": m.spec.use,
                "state": m.state_name(),
                "holds": [h.as_json(shown) for h in self._state.holds_for(m.name)],
                "inflight": self._drainers[m.name].inflight,
                "waiting": self._takeable(m.name),
                "replay_concurrency": self._drainers[m.name].concurrency,
                "classes": list(m.spec.classes),
                "models": m.catalogue.names(),
                "models_discovered": not m.catalogue.static and m.catalogue.discovered is not None,
                # What its outage verdicts rest on (upstream/served.py), and the models judged failing alone.
                "served_models": [e.model for e in m.health.record.recent()],
                "failing_models": m.health.failing.as_json(now, shown),
            }
            for m in self.members
        ]

    def metric_rows(self) -> list[tuple[str, bool, int, int, int, str, tuple[str, ...]]]:
        """``(upstream, available, inflight, holds, waiting, state, hold sources)`` per member, for
        ``observe.metrics.pool_families`` (one that never answered is not available there)."""
        rows = []
        for m in self.members:
            holds = self._state.holds_for(m.name)
            rows.append((
                m.name, m.available() and not m.never_answered, self._drainers[m.name].inflight, len(holds),
                self._takeable(m.name), m.state_name(), tuple(sorted({h.source for h in holds})),
            ))
        return rows

    def _takeable(self, name: str) -> int:
        """Parked requests member ``name`` may take, available or not (for an embedding: as the reference or
        a verified twin; a standby member only what no always member may take)."""
        return self._lines.takeable(name, functools.partial(self.may_take, name))

    def explain(self, refusal: Refused, entry: Entry | None = None) -> Refused:
        """``refusal`` as the caller reads it: with ``Retry-After``, and for an expiry, what kept it waiting
        (the lot refuses without either: it knows neither the yield nor the service time)."""
        if refusal.reason == "expired":
            return refusal.advised(self.retry_after(), self.why_still_waiting(entry))
        if refusal.retry_after is None:
            return refusal.advised(self.retry_after())
        return refusal

    def why_still_waiting(self, entry: Entry | None = None) -> str:
        """What keeps the lot waiting right now, for the message of a request that expires in it (in a
        pool, what kept each member it may go to from taking it)."""
        if entry is not None and self.shape.names_members:
            return words.why_no_member(self._state, self._by_name, entry, self.twin_ok)
        return words.why_the_lot_waits(self._state, self.members, self.release_held, self.concurrency)

    def retry_after(self) -> int:
        """Seconds a refused caller should wait (:func:`.words.retry_after`)."""
        return words.retry_after(
            self._state, self._clock.seconds(), len(self._lot), self.service_seconds, self.concurrency
        )
