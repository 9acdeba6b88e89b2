"""The yield state: who holds which upstream's GPU, why, and until when.

An upstream (a pool member) is yielded while *any* hold applies to it.  Holds are keyed by
``(source, scope)``: a scope is one member's name, or :data:`ALL` (every member but the standby
ones).  What a source, a scope, a lease and ``max_holds`` mean to a caller: docs/admin-api.md,
"``POST /yield``".  :attr:`YieldState.yielded` is the proxy-wide "the GPU is yielded": every
member that is not standby is held.  Sources are names a caller chose, so they are bounded
(:func:`~yieldproxy.names.check_source`: nothing that can forge a log line or a metric label).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ..callbacks import call_each
from ..clock import cancel, same
from ..names import OWN_SOURCES, check_source, name_set, name_tuple

log = Logger()

#: Sources of the proxy's own holds (its watchers', a stuck member's, the restart hold): never refused, whatever ``max_holds`` says.
_NEVER_REFUSED = frozenset(OWN_SOURCES)
#: The longest a hold's ``expected_seconds`` or ``for_seconds`` may be: a week.
MAX_HOLD_SECONDS = 7 * 24 * 3600.0
#: Holds from callers (everything but the watchers) at once (``admin.max_holds``).
DEFAULT_MAX_HOLDS = 32
#: The scope of a hold that names no member: every member but the standby ones.
ALL = "*"
#: The member made from ``proxy.upstream`` (a config without ``[[upstreams]]``).
DEFAULT_MEMBER = "default"


class TooManyHolds(Exception):
    """A new source would take the GPU while ``max_holds`` caller holds exist already."""


class UnknownScope(ValueError):
    """A hold or a release named an upstream the pool does not have."""


@attrs.frozen
class Hold:
    """One source's claim on one member's GPU, or on all of them."""

    source: str
    reason: str
    since: float
    #: When the source expects to give the GPU back (from its expected_seconds).
    expected_end: float | None = None
    #: When the lease runs out and the hold ends by itself.
    expires_at: float | None = None
    #: The member it holds, or :data:`ALL`.
    scope: str = ALL

    def as_json(self, shown: Callable[[float], float] = same) -> dict[str, Any]:
        """Its JSON, its times given to ``shown`` (the wall clock's, where people read them: clock.py)."""
        return {
            "source": self.source,
            "reason": self.reason,
            "since": shown(self.since),
            "expires_at": None if self.expires_at is None else shown(self.expires_at),
            "expected_end": None if self.expected_end is None else shown(self.expected_end),
            "upstream": None if self.scope == ALL else self.scope,
        }


@attrs.frozen
class Transition:
    """The GPU was taken or given back: by which hold, and how long the state before it lasted."""

    yielded: bool
    #: The hold that began the yield, or the last one to end.
    hold: Hold
    lasted: float


@attrs.define(eq=False)
class YieldState:
    """The set of active holds, with lease timers on an injected clock."""

    _clock: IReactorTime
    _holds: dict[tuple[str, str], Hold] = attrs.Factory(dict)
    _leases: dict[tuple[str, str], IDelayedCall] = attrs.Factory(dict)
    _observers: list[Callable[[bool], None]] = attrs.Factory(list)
    #: When the current yield began (first hold taken), for its length.
    yielded_since: float | None = None
    #: How long the last state lasted, for the transition log line.
    last_change: float = attrs.field(default=None)
    _on_yield_ended: list[Callable[[str, float], None]] = attrs.Factory(list)
    _on_hold_taken: list[Callable[[Hold], None]] = attrs.Factory(list)
    _on_transition: list[Callable[[Transition], None]] = attrs.Factory(list)
    _on_holds_changed: list[Callable[[list[Hold]], object]] = attrs.Factory(list)
    #: At most this many holds from callers at once (watcher holds are not counted).
    max_holds: int = DEFAULT_MAX_HOLDS
    #: The pool's members, in config order (a hold's scope is one of them, or :data:`ALL`).
    members: tuple[str, ...] = attrs.field(default=(DEFAULT_MEMBER,), converter=name_tuple)
    #: Members a hold scoped :data:`ALL` leaves alone (``use = "when_others_yielded"``).
    standby: frozenset[str] = attrs.field(default=frozenset(), converter=name_set)
    #: Each member taken or given back gets its own log line (the pool's shape decides:
    #: ``PoolShape.names_members``, upstream/pool/members.py); False: the proxy-wide lines only.
    names_members: bool = False
    _member_observers: list[Callable[[str, bool], None]] = attrs.Factory(list)
    #: Holds scoped to each member, and holds scoped :data:`ALL`: ``yielded_for`` in O(1).
    _scoped: dict[str, int] = attrs.Factory(dict)
    _all: int = 0
    #: When each member's current yield began, for its log line.
    _member_since: dict[str, float] = attrs.Factory(dict)
    #: The members a hold scoped :data:`ALL` holds (all but the standby ones), in config order.
    _always: tuple[str, ...] = attrs.field(init=False, default=())

    def __attrs_post_init__(self) -> None:
        self.last_change = self._clock.seconds()
        if not self.members or len(set(self.members)) != len(self.members):
            raise ValueError(f"members must be distinct names, got {self.members!r}")
        if not self.standby < set(self.members):
            raise ValueError("standby must be some of the members, not all of them")
        self._always = tuple(m for m in self.members if m not in self.standby)

    @property
    def yielded(self) -> bool:
        """True while every member that is not standby is held: the proxy-wide "GPU yielded"."""
        if self._all:
            return True
        scoped = self._scoped
        return all(scoped.get(m) for m in self._always)

    def yielded_for(self, member: str) -> bool:
        """True while some hold applies to ``member`` (one scoped to it, or to all unless it is standby)."""
        return bool(self._scoped.get(member)) or (self._all > 0 and member not in self.standby)

    def applies(self, hold: Hold, member: str) -> bool:
        """True when ``hold`` holds ``member``."""
        return hold.scope == member or (hold.scope == ALL and member not in self.standby)

    def affected(self, scope: str) -> tuple[str, ...]:
        """The members a hold of ``scope`` holds."""
        return self._always if scope == ALL else (scope,)

    @property
    def holds(self) -> list[Hold]:
        return sorted(self._holds.values(), key=lambda h: h.since)

    def holds_for(self, member: str) -> list[Hold]:
        """The holds that hold ``member``, oldest first."""
        return [h for h in self.holds if self.applies(h, member)]

    def hold_of(self, source: str, scope: str = ALL) -> Hold | None:
        """``source``'s current hold of ``scope``, if it has one (watchers check before renewing)."""
        return self._holds.get((source, scope))

    def check_scope(self, scope: str) -> str:
        """``scope`` if it is :data:`ALL` or a member's name, else :class:`UnknownScope` naming the members."""
        if scope != ALL and scope not in self.members:
            raise UnknownScope(f"unknown upstream {scope!r}; the upstreams are {', '.join(self.members)}")
        return scope

    def observe(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(yielded)`` whenever the GPU is taken or given back (:attr:`yielded` changes)."""
        self._observers.append(callback)

    def observe_members(self, callback: Callable[[str, bool], None]) -> None:
        """Call ``callback(member, yielded)`` whenever one member's :meth:`yielded_for` changes.

        Called after the proxy-wide observers of the same change.
        """
        self._member_observers.append(callback)

    def on_transition(self, callback: Callable[[Transition], None]) -> None:
        """Call ``callback(transition)`` when the GPU is taken or given back, before the observers.

        For the one log line of each change (:func:`transition_logger`), so it
        comes before what the change sets off.
        """
        self._on_transition.append(callback)

    def on_holds_changed(self, callback: Callable[[list[Hold]], object]) -> None:
        """Call ``callback(holds)`` after any hold is taken, renewed, restored or ends, with every hold then.

        For the holds file (lifecycle/holdstore.py): called after the observers of the
        same change, so what they set off is not held up by a write.
        """
        self._on_holds_changed.append(callback)

    def _holds_changed(self) -> None:
        if not self._on_holds_changed:
            return
        holds = self.holds
        call_each(log, "holds-changed callback failed", self._on_holds_changed, holds)

    def on_hold_taken(self, callback: Callable[[Hold], None]) -> None:
        self._on_hold_taken.append(callback)

    def on_yield_ended(self, callback: Callable[[str, float], None]) -> None:
        """Call ``callback(last_source, seconds)`` when the last hold ends."""
        self._on_yield_ended.append(callback)

    def hold(
        self,
        source: str,
        reason: str = "",
        expected_seconds: float | None = None,
        for_seconds: float | None = None,
        scope: str = ALL,
    ) -> Hold:
        """Take (or renew) ``source``'s hold of ``scope``.  Renewing keeps its start time.

        :raises ValueError: ``source`` is not a valid source name, ``scope``
            names no member (:class:`UnknownScope`), or a duration is not a
            positive number of seconds up to :data:`MAX_HOLD_SECONDS`.
        :raises TooManyHolds: ``source`` holds nothing of ``scope`` yet and
            ``max_holds`` holds from callers exist already.
        """
        check_source(source)
        self.check_scope(scope)
        for name, value in (("expected_seconds", expected_seconds), ("for_seconds", for_seconds)):
            if value is not None and not 0 < value <= MAX_HOLD_SECONDS:
                raise ValueError(f"{name} must be above 0 and at most {MAX_HOLD_SECONDS:g} seconds (a week)")
        key = (source, scope)
        now = self._clock.seconds()
        previous = self._holds.get(key)
        if previous is None and source not in _NEVER_REFUSED and self.caller_holds() >= self.max_holds:
            raise TooManyHolds(
                f"{self.caller_holds()} sources hold the GPU already, the most allowed (admin.max_holds); "
                "end one (POST /resume) or renew an existing source's hold"
            )
        expires_at = now + for_seconds if for_seconds is not None else None
        # A lease says nothing about when the yield ends (docs/admin-api.md, "A lease is not an estimate").
        expected_end = now + expected_seconds if expected_seconds is not None else None
        hold = Hold(
            source=source,
            reason=reason or (previous.reason if previous else ""),
            since=previous.since if previous else now,
            expected_end=expected_end,
            expires_at=expires_at,
            scope=scope,
        )
        self._put(hold, previous, for_seconds)
        return hold

    def restore(self, holds: Iterable[Hold]) -> list[Hold]:
        """Put back holds of an earlier run (lifecycle/holdstore.py), each as it was: its start, its ends, its lease.

        A hold whose lease ran out meanwhile is gone; a hold of an upstream
        the pool no longer has is dropped (both logged).  Neither the source
        nor ``max_holds`` is checked again: they were accepted when taken.
        The holds-changed callbacks (the holds file) hear of them once, when
        all are back: thousands of holds are one write, not thousands.
        Returns the holds put back.
        """
        now = self._clock.seconds()
        restored = []
        for hold in sorted(holds, key=lambda h: h.since):
            where = f"source={hold.source}{_upstream(hold.scope)}"
            if hold.expires_at is not None and hold.expires_at <= now:
                log.info(
                    "hold of the last run not restored: {where} reason={reason!r}: its lease ran out {ago:.0f}s ago",
                    where=where, reason=hold.reason, ago=now - hold.expires_at,
                )
                continue
            if hold.scope != ALL and hold.scope not in self.members:
                log.warn(
                    "hold of the last run not restored: {where} reason={reason!r}: no upstream {scope!r} any more",
                    where=where, reason=hold.reason, scope=hold.scope,
                )
                continue
            key = (hold.source, hold.scope)
            lease = hold.expires_at - now if hold.expires_at is not None else None
            log.info(
                "hold of the last run restored: {where} reason={reason!r}{lease}",
                where=where, reason=hold.reason,
                lease="" if lease is None else f", lease ends in {lease:.0f}s unless renewed",
            )
            self._put(hold, self._holds.get(key), lease, tell_holds=False)
            restored.append(hold)
        if restored:
            self._holds_changed()
        return restored

    def _put(self, hold: Hold, previous: Hold | None, lease: float | None, tell_holds: bool = True) -> None:
        """Set ``hold`` (a new one, or ``previous`` renewed), its lease timer, and tell everyone who asked
        (the holds-changed callbacks only with ``tell_holds``)."""
        key = (hold.source, hold.scope)
        source, scope = key
        was_yielded = self.yielded
        before = self._member_states(scope)
        self._holds[key] = hold
        if previous is None:
            self._count(scope, +1)
        self._set_lease(key, lease)
        if previous is None:
            call_each(log, "hold-taken callback failed", self._on_hold_taken, hold)
        if not was_yielded and self.yielded:
            # A new hold's start is now; a restored one's is when it began in the last run.
            self.yielded_since = hold.since
            self._changed(True, hold)
        elif previous is None:
            log.info(
                "hold taken: source={source}{upstream} reason={reason!r}, also held by {others}",
                source=source,
                upstream=_upstream(scope),
                reason=hold.reason,
                others=_others(len(self._holds) - 1),
            )
        self._members_changed(before, hold)
        if tell_holds:
            self._holds_changed()

    def caller_holds(self) -> int:
        """Holds from callers (not the watchers): what ``max_holds`` bounds."""
        return sum(1 for source, _ in self._holds if source not in _NEVER_REFUSED)

    def release(self, source: str, scope: str = ALL) -> bool:
        """End ``source``'s hold of ``scope``; True if it had one."""
        key = (source, scope)
        if key not in self._holds:
            self._set_lease(key, None)
            return False
        was_yielded = self.yielded
        before = self._member_states(scope)
        hold = self._holds.pop(key)
        self._count(scope, -1)
        self._set_lease(key, None)
        if was_yielded and not self.yielded:
            now = self._clock.seconds()
            began = self.yielded_since if self.yielded_since is not None else now
            self.yielded_since = None
            call_each(log, "yield-ended callback failed", self._on_yield_ended, source, now - began)
            self._changed(False, hold)
        else:
            log.info(
                "hold ended: source={source}{upstream}, {still}",
                source=source,
                upstream=_upstream(scope),
                still=f"still held by {_others(len(self._holds))}" if self._holds else "no hold left",
            )
        self._members_changed(before, hold)
        self._holds_changed()
        return True

    def release_source(self, source: str) -> int:
        """End every hold of ``source``, whatever its scope; how many ended."""
        keys = [key for key in self._holds if key[0] == source]
        for _, scope in keys:
            self.release(source, scope)
        return len(keys)

    def expected_end(self, members: Iterable[str] | None = None) -> float | None:
        """When one of ``members`` (default: those not standby) should be back, if known.

        A member's end is the latest expected end of the holds on it, known
        only when every one of them gave one; the soonest of the members',
        known only when each of theirs is (one that might come back any
        moment makes the estimate worthless).  None for a member not held.
        """
        ends = []
        for member in self._always if members is None else members:
            holds = [h.expected_end for h in self._holds.values() if self.applies(h, member)]
            known = [e for e in holds if e is not None]
            if not holds or len(known) < len(holds):
                return None
            ends.append(max(known))
        return min(ends) if ends else None

    def _count(self, scope: str, sign: int) -> None:
        if scope == ALL:
            self._all += sign
        else:
            self._scoped[scope] = self._scoped.get(scope, 0) + sign

    def _member_states(self, scope: str) -> dict[str, bool]:
        """Whether each member a hold of ``scope`` touches is held now (compared after the change)."""
        if not self._member_observers and not self.names_members:
            return {}
        return {member: self.yielded_for(member) for member in self.affected(scope)}

    def _members_changed(self, before: dict[str, bool], hold: Hold) -> None:
        """Tell the member observers of every member whose state this hold's change flipped."""
        now = self._clock.seconds()
        for member, was in before.items():
            is_now = self.yielded_for(member)
            if is_now == was:
                continue
            if self.names_members:
                if is_now:
                    self._member_since[member] = now
                    log.info(
                        "upstream {member} yielded: source={source} reason={reason!r}",
                        member=member, source=hold.source, reason=hold.reason,
                    )
                else:
                    began = self._member_since.pop(member, now)
                    log.info(
                        "upstream {member} available: source={source} ended the last hold on it "
                        "(held for {held:.1f}s)",
                        member=member, source=hold.source, held=now - began,
                    )
            call_each(log, "member observer failed", self._member_observers, member, is_now)

    def stop(self) -> None:
        """The proxy has stopped: no lease runs out any more (nothing is left to release)."""
        for call in self._leases.values():
            cancel(call)
        self._leases.clear()

    def _set_lease(self, key: tuple[str, str], for_seconds: float | None) -> None:
        cancel(self._leases.pop(key, None))
        if for_seconds is not None:
            self._leases[key] = self._clock.callLater(for_seconds, self._lease_ran_out, key)

    def _lease_ran_out(self, key: tuple[str, str]) -> None:
        self._leases.pop(key, None)
        source, scope = key
        log.warn("hold lease ran out without renewal: source={source}{upstream}", source=source, upstream=_upstream(scope))
        self.release(source, scope)

    def _changed(self, yielded: bool, hold: Hold) -> None:
        now = self._clock.seconds()
        transition = Transition(yielded, hold, now - self.last_change)
        self.last_change = now
        call_each(log, "yield-state transition callback failed", self._on_transition, transition)
        call_each(log, "yield-state observer failed", self._observers, yielded)


def transition_logger(describe: Callable[[], str]) -> Callable[[Transition], None]:
    """The one log line of each transition, given to :meth:`YieldState.on_transition`.

    ``describe()`` says what the proxy looks like then ("now draining, parked
    batch=3, in flight 0"): the scheduler knows that, the state does not.
    """

    def log_transition(change: Transition) -> None:
        log.info(
            "GPU {what}: source={source} reason={reason!r}; {details} (previous state lasted {lasted:.1f}s)",
            what="yielded" if change.yielded else "available",
            source=change.hold.source,
            reason=change.hold.reason,
            details=describe(),
            lasted=change.lasted,
        )

    return log_transition


def _upstream(scope: str) -> str:
    """`` upstream=NAME`` for a hold of one member, nothing for a hold of all (a hold of one upstream's own
    watchers is one of all: its lines name no upstream)."""
    return "" if scope == ALL else f" upstream={scope}"


def _others(count: int) -> str:
    """How many others hold the GPU, in words: a log line must not grow with the number of holds."""
    return f"{count} other source" + ("" if count == 1 else "s")
