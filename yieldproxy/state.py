"""The yield state: who holds the GPU, why, and until when.

The GPU is yielded while *any* source holds it.  Each hold comes from a named
source (``api``, ``signal``, ``file``, ...) so one broker resuming cannot end
another's hold.  A hold may carry a lease (``for_seconds``): it ends by itself
unless renewed, so a broker that dies mid-yield cannot park requests forever.

Sources are names a caller chose, so they are bounded: a conservative
character set and length (:func:`check_source`: nothing that can forge a log
line or a metric label), and at most ``max_holds`` holds at once from callers
(the proxy's own watchers are never refused).
"""

from __future__ import annotations

import re
from typing import Callable

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from .names import WATCHER_SOURCES

log = Logger()

#: Sources of the proxy's own watchers: never refused, whatever ``max_holds`` says.
_NEVER_REFUSED = frozenset(WATCHER_SOURCES)
#: The longest a hold's ``expected_seconds`` or ``for_seconds`` may be: a week.
MAX_HOLD_SECONDS = 7 * 24 * 3600.0
#: Holds from callers (everything but the watchers) at once (``admin.max_holds``).
DEFAULT_MAX_HOLDS = 32
MAX_SOURCE_LENGTH = 64
_SOURCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_source(source: object) -> str:
    """``source`` if it is a valid hold source, else :class:`ValueError` saying why.

    Letters, digits, ``.``, ``_`` and ``-``, starting with a letter or a digit,
    at most 64 characters: safe in a log line, a metric label and a terminal.
    """
    if not isinstance(source, str):
        raise ValueError("source must be a string")
    if not source:
        raise ValueError("source must not be empty")
    if len(source) > MAX_SOURCE_LENGTH:
        raise ValueError(f"source is longer than {MAX_SOURCE_LENGTH} characters")
    if not _SOURCE.fullmatch(source):
        raise ValueError(
            "source may hold only letters, digits, '.', '_' and '-', and must start with a letter or a digit"
        )
    return source


class TooManyHolds(Exception):
    """A new source would take the GPU while ``max_holds`` caller holds exist already."""


@attrs.frozen
class Hold:
    """One source's claim on the GPU."""

    source: str
    reason: str
    since: float
    #: When the source expects to give the GPU back (from its expected_seconds).
    expected_end: float | None = None
    #: When the lease runs out and the hold ends by itself.
    expires_at: float | None = None

    def as_json(self) -> dict:
        return {
            "source": self.source,
            "reason": self.reason,
            "since": self.since,
            "expires_at": self.expires_at,
            "expected_end": self.expected_end,
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
    _holds: dict[str, Hold] = attrs.Factory(dict)
    _leases: dict[str, IDelayedCall] = attrs.Factory(dict)
    _observers: list[Callable[[bool], None]] = attrs.Factory(list)
    #: When the current yield began (first hold taken), for its length.
    yielded_since: float | None = None
    #: How long the last state lasted, for the transition log line.
    last_change: float = attrs.field(default=None)
    _on_yield_ended: list[Callable[[str, float], None]] = attrs.Factory(list)
    _on_hold_taken: list[Callable[[Hold], None]] = attrs.Factory(list)
    _on_transition: list[Callable[[Transition], None]] = attrs.Factory(list)
    #: At most this many holds from callers at once (watcher holds are not counted).
    max_holds: int = DEFAULT_MAX_HOLDS

    def __attrs_post_init__(self) -> None:
        self.last_change = self._clock.seconds()

    @property
    def yielded(self) -> bool:
        return bool(self._holds)

    @property
    def holds(self) -> list[Hold]:
        return sorted(self._holds.values(), key=lambda h: h.since)

    def hold_of(self, source: str) -> Hold | None:
        """``source``'s current hold, if it has one (watchers check before renewing)."""
        return self._holds.get(source)

    def observe(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(yielded)`` whenever the GPU is taken or given back."""
        self._observers.append(callback)

    def on_transition(self, callback: Callable[[Transition], None]) -> None:
        """Call ``callback(transition)`` when the GPU is taken or given back, before the observers.

        For the one log line of each change (:func:`transition_logger`), so it
        comes before what the change sets off.
        """
        self._on_transition.append(callback)

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
    ) -> Hold:
        """Take (or renew) ``source``'s hold.  Renewing keeps its start time.

        :raises ValueError: ``source`` is not a valid source name, or a duration
            is not a positive number of seconds up to :data:`MAX_HOLD_SECONDS`.
        :raises TooManyHolds: ``source`` holds nothing yet and ``max_holds``
            holds from callers exist already.
        """
        check_source(source)
        for name, value in (("expected_seconds", expected_seconds), ("for_seconds", for_seconds)):
            if value is not None and not 0 < value <= MAX_HOLD_SECONDS:
                raise ValueError(f"{name} must be above 0 and at most {MAX_HOLD_SECONDS:g} seconds (a week)")
        now = self._clock.seconds()
        previous = self._holds.get(source)
        if previous is None and source not in _NEVER_REFUSED and self.caller_holds() >= self.max_holds:
            raise TooManyHolds(
                f"{self.caller_holds()} sources hold the GPU already, the most allowed (admin.max_holds); "
                "end one (POST /resume) or renew an existing source's hold"
            )
        expires_at = now + for_seconds if for_seconds is not None else None
        # Only expected_seconds is an estimate; a lease is a dead-man's switch that a
        # broker may renew for hours, so it says nothing about when the yield ends.
        expected_end = now + expected_seconds if expected_seconds is not None else None
        hold = Hold(
            source=source,
            reason=reason or (previous.reason if previous else ""),
            since=previous.since if previous else now,
            expected_end=expected_end,
            expires_at=expires_at,
        )
        was_yielded = self.yielded
        self._holds[source] = hold
        self._set_lease(source, for_seconds)
        if previous is None:
            for callback in list(self._on_hold_taken):
                try:
                    callback(hold)
                except Exception:
                    log.failure("hold-taken callback failed")
        if not was_yielded:
            self.yielded_since = now
            self._changed(True, hold)
        elif previous is None:
            log.info(
                "hold taken: source={source} reason={reason!r}, also held by {others}",
                source=source,
                reason=hold.reason,
                others=_others(len(self._holds) - 1),
            )
        return hold

    def caller_holds(self) -> int:
        """Holds from callers (not the watchers): what ``max_holds`` bounds."""
        return sum(1 for source in self._holds if source not in _NEVER_REFUSED)

    def release(self, source: str) -> bool:
        """End ``source``'s hold; True if it held the GPU."""
        hold = self._holds.pop(source, None)
        self._set_lease(source, None)
        if hold is None:
            return False
        if not self._holds:
            now = self._clock.seconds()
            began = self.yielded_since if self.yielded_since is not None else now
            self.yielded_since = None
            for callback in list(self._on_yield_ended):
                try:
                    callback(source, now - began)
                except Exception:
                    log.failure("yield-ended callback failed")
            self._changed(False, hold)
        else:
            log.info(
                "hold ended: source={source}, still held by {others}",
                source=source,
                others=_others(len(self._holds)),
            )
        return True

    def expected_end(self) -> float | None:
        """When the yield should end: the latest expected end, if every hold gave one."""
        ends = [h.expected_end for h in self._holds.values()]
        if not ends or any(e is None for e in ends):
            return None
        return max(ends)

    def release_all(self) -> None:
        for source in list(self._holds):
            self.release(source)

    def _set_lease(self, source: str, for_seconds: float | None) -> None:
        call = self._leases.pop(source, None)
        if call is not None and call.active():
            call.cancel()
        if for_seconds is not None:
            self._leases[source] = self._clock.callLater(for_seconds, self._lease_ran_out, source)

    def _lease_ran_out(self, source: str) -> None:
        self._leases.pop(source, None)
        log.warn("hold lease ran out without renewal: source={source}", source=source)
        self.release(source)

    def _changed(self, yielded: bool, hold: Hold) -> None:
        now = self._clock.seconds()
        transition = Transition(yielded, hold, now - self.last_change)
        self.last_change = now
        for callback in list(self._on_transition):
            try:
                callback(transition)
            except Exception:
                log.failure("yield-state transition callback failed")
        for callback in list(self._observers):
            try:
                callback(yielded)
            except Exception:
                log.failure("yield-state observer failed")


def transition_logger(describe: Callable[[], str]) -> Callable[[Transition], None]:
    """The one log line of each transition, given to :meth:`YieldState.on_transition`.

    ``describe()`` says what the proxy looks like then ("now draining, parked
    batch=3, in flight 0"): the gate knows that, the state does not.
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


def _others(count: int) -> str:
    """How many others hold the GPU, in words: a log line must not grow with the number of holds."""
    return f"{count} other source" + ("" if count == 1 else "s")
