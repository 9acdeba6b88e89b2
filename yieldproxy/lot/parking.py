"""The parking lot: a FIFO of cancellable Deferreds per class, with ceilings and deadlines.

An entry waits here until it is released (its Deferred fires with the entry),
expires past its hold bound, is abandoned by its client (its Deferred was
cancelled), is handed over to a new process, or is answered at shutdown.
Order is by arrival sequence number, so a request that failed mid-flight
and comes back keeps its place.  What the lot leaves to the scheduler:
docs/architecture.md, "The scheduler".  Where an entry is, is one named state
moved by :data:`ENTRY_MOVES` (yieldproxy/states.py); the Deferred is what
:attr:`Stay.PARKED` holds.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any, Callable

import attrs
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ..observe.metrics import Metrics
from ..states import Machine, Moves, Named

log = Logger()


def hold_bound(class_seconds: float, max_wait: float | None) -> tuple[float, bool]:
    """The longest a request may wait, and whether its caller set it: its class's hold bound, or the
    caller's ``X-Yield-Max-Wait`` when that is shorter.  The one computation of it: the scheduler's budget
    against a declared yield, and the deadline the lot gives an entry when it first parks."""
    if max_wait is not None and max_wait < class_seconds:
        return max_wait, True
    return class_seconds, False


class Stay(Named):
    """Where an entry is (:attr:`Entry.state`)."""

    #: Admitted by nobody yet.
    NEW = "new"
    #: In the lot: its Deferred waits for a release.
    PARKED = "parked"
    #: Let out to a member (by its drainer, or by the scheduler at once): its attempt runs there.
    RELEASED = "released"
    #: Out of the lot with its client, for a reload's new process to take on (lifecycle/succession/): it ends there
    #: once that process has it, or parks here again, in its place, when it will not.
    HANDED = "handed"
    #: Out of the lot for good: expired, abandoned, refused at shutdown, or taken on by a new process.
    LEFT = "left"


NEW, PARKED, RELEASED, HANDED, LEFT = Stay.NEW, Stay.PARKED, Stay.RELEASED, Stay.HANDED, Stay.LEFT

#: What each event does to an entry (yieldproxy/states.py): any other is a bug (:class:`Unexpected`).
ENTRY_MOVES: Moves[Stay, str] = Moves("a parked request", {
    # It parks, or goes at once to the member the scheduler chose.
    (NEW, "park"): PARKED,
    (NEW, "go"): RELEASED,
    # A drainer lets it out; it expires, its client leaves, the proxy stops; or it is handed over.
    (PARKED, "release"): RELEASED,
    (PARKED, "expire"): LEFT,
    (PARKED, "abandon"): LEFT,
    (PARKED, "refuse"): LEFT,
    (PARKED, "hand"): HANDED,
    # Its attempt failed: back to its place in the lot.
    (RELEASED, "park"): PARKED,
    # The new process has it (or its client went meanwhile); or it will not have it: parked again here.
    (HANDED, "taken"): LEFT,
    (HANDED, "park"): PARKED,
})


@attrs.frozen
class Standing:
    """What a request has earned in line: its class and bound, its tries, its time parked.

    The one record of a parked request that outlives its entry: written by
    :meth:`Entry.standing`, carried across a reload (lifecycle/succession/wire.py),
    and parked again from (:meth:`Entry.resumed`) in the new process, so each
    field is copied in one place.  Each field is :class:`Entry`'s of its name
    (``parked_seconds`` counts the stay it is in up to when it was written).
    Times are the reactor's clock.
    """

    cls: str
    max_wait: float | None = None
    attempts: int = 0
    forgiven: int = 0
    parked_seconds: float = 0.0
    first_parked: float | None = None
    deadline: float | None = None
    bound_by_caller: bool = False
    failed_on: str | None = None


@attrs.define(eq=False)
class Entry(Machine[Stay, str]):
    """One request as the scheduler and the lot see it."""

    moves = ENTRY_MOVES

    cls: str
    size: int = 0
    #: The API family of the route, for error bodies: ``ollama`` or ``openai``.
    api: str = "ollama"
    #: The caller's own budget from X-Yield-Max-Wait (seconds), if any.
    max_wait: float | None = None
    #: Its place in arrival order, given by the lot it is admitted to (:meth:`ParkingLot.number`):
    #: kept when it comes back after a failed attempt.
    seq: int = -1
    #: Failed attempts counted against ``upstream.max_attempts``.
    attempts: int = 0
    #: Failed attempts a recognised outage explained (not counted against the request).
    forgiven: int = 0
    #: Counted attempts whose answer could not be read (``bad_answer``): retried once at most.
    unreadable: int = 0
    #: Total seconds spent parked so far (over every stay in the lot).
    parked_seconds: float = 0.0
    #: True once it has been in the lot; its outcome then counts as a replay.
    was_parked: bool = False
    #: Absolute time by which it must have left the lot (set when it first waits: :meth:`start_waiting`).
    deadline: float | None = None
    #: When it was first parked, or first waited for an outage verdict (its hold bound counts from here).
    first_parked: float | None = None
    #: True when the caller's X-Yield-Max-Wait, not the class bound, set the deadline.
    bound_by_caller: bool = False
    parked_at: float | None = None
    #: The pool member whose drainer let it out of the lot last, or the member the scheduler
    #: sent it to (None: not let out yet, or let out with no target named).
    released_to: str | None = None
    #: Its model, route kind and eligible pool members, decided once at admission: the
    #: scheduler's ``Routing`` (yieldproxy/schedule/routing.py), carried here and never read by the lot.
    routing: Any = None
    #: The member its last attempt failed on: another eligible one takes it first.
    failed_on: str | None = None
    #: The path it asked for and its client's address (an ``IAddress``), for people who read the lot
    #: (:meth:`ParkingLot.waiting`): references to what its request holds anyway, never decided on.
    route: str | None = None
    client: Any = None
    #: Where it is, moved only by :meth:`fire` (:data:`ENTRY_MOVES`).
    state: Stay = attrs.field(default=NEW, init=False)
    #: What it waits on while :attr:`Stay.PARKED`.
    _deferred: Deferred[Entry] | None = None
    #: The lot it is parked in (its Deferred's canceller reaches the lot through it).
    _lot: ParkingLot | None = None

    def __lt__(self, other: "Entry") -> bool:
        return self.seq < other.seq

    def standing(self, now: float) -> Standing:
        """What it has earned in line at ``now`` (its stay in the lot counted up to then)."""
        parked = self.parked_seconds + (now - self.parked_at if self.parked_at is not None else 0.0)
        return Standing(
            cls=self.cls, max_wait=self.max_wait, attempts=self.attempts, forgiven=self.forgiven,
            parked_seconds=parked, first_parked=self.first_parked, deadline=self.deadline,
            bound_by_caller=self.bound_by_caller, failed_on=self.failed_on,
        )

    @classmethod
    def resumed(
        cls, standing: Standing, *, size: int, api: str, routing: Any, route: str | None = None, client: Any = None,
    ) -> "Entry":
        """An entry that takes up ``standing`` where another process left it, for ``routing`` here: it
        counts as parked (its outcome is a replay), and ``failed_on`` stays only if that member may serve it."""
        failed_on = standing.failed_on if standing.failed_on in routing.eligible else None
        return cls(
            cls=standing.cls, size=size, api=api, max_wait=standing.max_wait, routing=routing,
            attempts=standing.attempts, forgiven=standing.forgiven, parked_seconds=standing.parked_seconds,
            was_parked=True, deadline=standing.deadline, first_parked=standing.first_parked,
            bound_by_caller=standing.bound_by_caller, failed_on=failed_on, route=route, client=client,
        )

    def start_waiting(self, now: float, class_seconds: float) -> None:
        """Its wait starts counting against its bound (:func:`hold_bound`), unless it already does: at its
        first park, or earlier when a failed attempt of it first waits for the outage verdict."""
        if self.deadline is None:
            self.first_parked = now
            bound, self.bound_by_caller = hold_bound(class_seconds, self.max_wait)
            self.deadline = now + bound

    @property
    def eligible(self) -> tuple[str, ...]:
        """The pool members that may serve it, in config order (none until admission decides)."""
        return self.routing.eligible if self.routing is not None else ()

    @property
    def model(self) -> str | None:
        return self.routing.model if self.routing is not None else None

    @property
    def kind(self) -> str:
        return self.routing.kind if self.routing is not None else "other"

    @property
    def tries(self) -> int:
        """Every failed attempt so far, counted or forgiven."""
        return self.attempts + self.forgiven

    def _cancelled(self, d: Deferred[Entry]) -> None:
        """Canceller of the parked Deferred: the client went away.

        A bound method, not a closure per entry: one small object less for
        every parked request.
        """
        if self._lot is not None:
            self._lot._abandon(self)


@attrs.frozen
class Waiting:
    """One parked request as a reader sees it, a copy: a row of the admin API's ``GET /parked``, whose
    fields docs/admin-api.md says (``eligible`` is its ``upstreams``, ``tries`` its ``attempts``,
    ``waited``, ``bound`` and ``remaining`` its ``*_seconds``, ``bound_by_caller`` its ``bound_by``)."""

    position: int
    class_position: int
    cls: str
    route: str | None
    model: str | None
    eligible: tuple[str, ...]
    #: An ``IAddress``, or None.
    client: Any
    waited: float
    bound: float
    bound_by_caller: bool
    remaining: float
    tries: int


class Refused(Exception):
    """The request was not parked, or left the lot without being released.

    ``reason`` is a metric label (``queue_full``, ``over_budget``, ``expired``,
    ``shutdown``, ...); ``message`` is the sentence the caller reads.  The lot
    refuses without ``retry_after``: the scheduler, which knows the yield and the
    service time, explains it to the caller (:meth:`advised`).
    """

    def __init__(self, reason: str, message: str, status: int = 503, retry_after: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status
        self.retry_after = retry_after

    def advised(self, retry_after: float, cause: str | None = None) -> "Refused":
        """The same refusal with the caller's ``Retry-After`` and, for an expiry, what kept it waiting."""
        message = f"{self.message}: {cause}" if cause else self.message
        return Refused(self.reason, message, self.status, retry_after)


class HandedOver(Exception):
    """The entry left the lot with its client for the process that replaces this one (lifecycle/succession/): it
    ends there, so here it gets no answer at all.

    Whoever waits on the entry (the proxy app, which holds its request and
    body) calls :attr:`take` with them, at once: that sends them on.  It
    returns None when the request is gone from here at once, else a Deferred
    that fires True once the new process has it, or False when it will not
    (the request then parks here again, in its place).
    """

    def __init__(self, take: Callable[..., Any]):
        super().__init__("handed over to the process that replaces this one")
        #: ``take(request, entry, body)``.
        self.take = take


@attrs.define(eq=False)
class ParkingLot:
    """FIFO of parked entries with global and per-class ceilings."""

    _clock: IReactorTime
    _metrics: Metrics
    max_parked: int
    max_parked_bytes: int
    class_max_parked: dict[str, int] = attrs.Factory(dict)
    reject_status: int = 503
    #: Higher-priority classes drain first...
    priorities: dict[str, int] = attrs.Factory(dict)
    #: ...but a waiting class gets at least this share of releases.
    min_shares: dict[str, float] = attrs.Factory(dict)
    #: One FIFO per class, each in arrival (sequence) order.
    _queues: dict[str, list[Entry]] = attrs.Factory(dict)
    #: Releases that went to another class while this one waited.
    _passed_over: dict[str, int] = attrs.Factory(dict)
    _count: int = 0
    _bytes: int = 0
    #: Called after any entry joins, so the drainers can be woken.
    _parked_listeners: list[Callable[[], None]] = attrs.Factory(list)
    #: Called with each entry that leaves the lot, whichever way.
    _out_listeners: list[Callable[[Entry], None]] = attrs.Factory(list)
    #: Deadlines of parked entries, soonest first, as (deadline, seq, entry).
    #: An entry that left stays until it comes up (it is skipped then), until
    #: the lot empties, or until the heap is rebuilt (see :meth:`park`).
    _deadlines: list[tuple[float, int, Entry]] = attrs.Factory(list)
    #: One timer for the whole lot, at the soonest deadline: a DelayedCall
    #: per parked request cost about half a kilobyte each.
    _timer: IDelayedCall | None = None
    _timer_at: float = math.inf
    _expiring: bool = False
    #: Waiting for the lot to empty (see :meth:`when_empty`).
    _empty_waiters: list[Deferred[None]] = attrs.Factory(list)

    #: The next arrival's :attr:`Entry.seq`.
    _next_seq: int = 0
    #: The next place of a request adopted from the process this one replaced (lifecycle/succession/): ahead of
    #: every arrival here (it arrived before them), after those adopted before it.
    _next_adopted: int = -(2**62)

    def __attrs_post_init__(self) -> None:
        self._metrics.parked_capacity.set(self.max_parked)
        self._metrics.parked_bytes_capacity.set(self.max_parked_bytes)

    def number(self, entry: Entry) -> None:
        """Give ``entry`` its place in arrival order, once (the scheduler does it at admission)."""
        if entry.seq == -1:
            entry.seq = self._next_seq
            self._next_seq += 1

    def number_adopted(self, entry: Entry) -> None:
        """Give ``entry``, adopted from the process this one replaced, its place: ahead of this lot's arrivals."""
        entry.seq = self._next_adopted
        self._next_adopted += 1

    def when_parked(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after any entry joins (a drainer's wake-up)."""
        self._parked_listeners.append(listener)

    def when_out(self, listener: Callable[[Entry], None]) -> None:
        """Call ``listener(entry)`` as an entry leaves, whichever way (before its Deferred fires).

        ``entry.released_to`` names the target a release went to; it is None
        for the primary and for every way out but a release.
        """
        self._out_listeners.append(listener)

    def when_empty(self) -> Deferred[None]:
        """A Deferred that fires once nothing is parked (at once if nothing is); cancel it to stop waiting.

        Fired after the last entry's own Deferred, when its request has moved on.
        """
        if not self._count:
            return succeed(None)
        waiter: Deferred[None] = Deferred(canceller=self._empty_waiters.remove)
        self._empty_waiters.append(waiter)
        return waiter

    def _tell_empty(self) -> None:
        if not self._count and self._empty_waiters:
            waiters, self._empty_waiters = self._empty_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def entries(self) -> list[Entry]:
        """Every parked entry, in arrival order (for status and tests)."""
        return sorted(e for queue in self._queues.values() for e in queue)

    def waiting(self, offset: int = 0, limit: int = 50) -> list[Waiting]:
        """The parked entries from ``offset`` (in arrival order), at most ``limit`` of them, as readers see them.

        Walks the classes' lines merged by arrival, up to ``offset + limit``
        entries: the cost is bounded by the page asked for, not the lot.
        """
        now = self._clock.seconds()
        seen: dict[str, int] = {}
        page: list[Waiting] = []
        for position, entry in enumerate(heapq.merge(*self._queues.values()), start=1):
            seen[entry.cls] = seen.get(entry.cls, 0) + 1
            if position <= offset:
                continue
            if len(page) >= limit:
                break
            first = entry.first_parked if entry.first_parked is not None else now
            deadline = entry.deadline if entry.deadline is not None else now
            page.append(Waiting(
                position=position, class_position=seen[entry.cls], cls=entry.cls, route=entry.route,
                model=entry.model, eligible=entry.eligible, client=entry.client, waited=max(0.0, now - first),
                bound=deadline - first, bound_by_caller=entry.bound_by_caller,
                remaining=max(0.0, deadline - now), tries=entry.tries,
            ))
        return page

    @property
    def parked_bytes(self) -> int:
        return self._bytes

    def count_by_class(self) -> dict[str, int]:
        return {cls: len(queue) for cls, queue in self._queues.items() if queue}

    def oldest_ages(self) -> dict[str, float]:
        """Age of the oldest parked entry per class (for the stuck-request alert)."""
        now = self._clock.seconds()
        return {
            cls: now - queue[0].parked_at
            for cls, queue in self._queues.items()
            if queue and queue[0].parked_at is not None
        }

    def check_room(self, entry: Entry) -> None:
        """Raise :class:`Refused` when parking ``entry`` would pass a ceiling."""
        cls_cap = self.class_max_parked.get(entry.cls, 0)
        if self._count >= self.max_parked:
            why = f"parked queue full ({self.max_parked} requests parked)"
        elif self._bytes + entry.size > self.max_parked_bytes:
            why = f"parked queue full ({self._bytes} of {self.max_parked_bytes} bytes held)"
        elif cls_cap and len(self._queues.get(entry.cls, ())) >= cls_cap:
            why = f"parked queue full for {entry.cls} requests ({cls_cap} parked)"
        else:
            return
        raise Refused("queue_full", why, self.reject_status)

    def park(self, entry: Entry, hold_seconds: float, check_room: bool = True) -> Deferred[Entry]:
        """Hold ``entry`` until released; its Deferred fires with the entry.

        The hold bound counts from the first time the entry was parked, so a
        request that comes back after a failed attempt is not held twice as
        long.  Cancelling the Deferred (the client went away) removes it at once.
        """
        if check_room:
            self.check_room(entry)
        self.number(entry)
        now = self._clock.seconds()
        entry.start_waiting(now, hold_seconds)
        assert entry.deadline is not None  # set now, or when it first waited
        entry.fire("park")
        entry.was_parked = True
        entry.parked_at = now
        entry.released_to = None
        entry._lot = self
        entry._deferred = Deferred(canceller=entry._cancelled)
        if not self._expiring and len(self._deadlines) > 2 * self._count + 64:
            # Mostly entries that left: keep the heap to about the parked count.
            self._deadlines = [item for item in self._deadlines if item[2].state is PARKED]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry))
        self._arm()
        bisect.insort(self._queues.setdefault(entry.cls, []), entry)
        self._account(entry, +1)
        d = entry._deferred
        for listener in self._parked_listeners:
            listener()
        return d

    def release_first(self, heads: dict[str, Entry], target: str | None = None) -> Entry | None:
        """Let out, of ``heads`` (one parked entry per class: the first of each a target may take), the one
        the drain order picks (class priority and share, FIFO within a class), and fire it.

        ``target`` is written on the entry (``released_to``) before its Deferred fires, so the
        request knows where it goes.  Only the classes in ``heads`` were passed over.
        """
        cls = self._next_class(heads)
        if cls is None:
            return None
        for other in heads:
            if other != cls:
                self._passed_over[other] = self._passed_over.get(other, 0) + 1
        self._passed_over[cls] = 0
        entry = heads[cls]
        entry.released_to = target
        self._let_out(entry, "release").callback(entry)
        self._tell_empty()
        return entry

    def _next_class(self, heads: dict[str, Entry]) -> str | None:
        """Highest priority first, unless a waiting class has been passed over its share."""
        if not heads:
            return None
        starving = [cls for cls in heads if self._passed_over.get(cls, 0) >= self._patience(cls)]
        candidates = starving or list(heads)
        return min(candidates, key=lambda c: (-self.priorities.get(c, 0) if not starving else 0, heads[c].seq))

    def _patience(self, cls: str) -> float:
        """How many releases in a row may go to other classes while ``cls`` waits."""
        share = self.min_shares.get(cls, 0.0)
        return math.inf if share <= 0 else math.ceil(1 / share) - 1

    def refuse_all(
        self, make_refusal: Callable[[Entry], Refused], which: Callable[[Entry], bool] | None = None
    ) -> int:
        """Answer every parked entry (``which`` allows) with a refusal (shutdown); returns how many."""
        entries = [entry for entry in self.entries() if which is None or which(entry)]
        for entry in entries:
            self._fail(entry, make_refusal(entry))
        return len(entries)

    def _arm(self) -> None:
        """Point the lot's one timer at the soonest deadline of an entry still parked."""
        if self._expiring:
            return  # :meth:`_expire_due` re-arms when it is done
        heap = self._deadlines
        while heap and heap[0][2].state is not PARKED:
            heapq.heappop(heap)
        soonest = heap[0][0] if heap else math.inf
        if self._timer is not None:
            if soonest == self._timer_at:
                return
            if self._timer.active():  # clock.cancel, inline: every park runs it
                self._timer.cancel()
            self._timer = None
        self._timer_at = soonest
        if heap:
            self._timer = self._clock.callLater(max(0.0, soonest - self._clock.seconds()), self._expire_due)

    def _expire_due(self) -> None:
        """The timer fired: every entry whose deadline has come leaves, soonest first."""
        self._timer = None
        # Up to the deadline the timer was set for, whatever rounding did to the clock.
        limit = max(self._timer_at, self._clock.seconds())
        self._timer_at = math.inf
        self._expiring = True
        try:
            while self._deadlines and self._deadlines[0][0] <= limit:
                _, _, entry = heapq.heappop(self._deadlines)
                if entry.state is PARKED:
                    self._expire(entry)
        finally:
            self._expiring = False
        self._arm()

    def _expire(self, entry: Entry) -> None:
        """Past its hold bound: refused (the scheduler adds what kept it: a yield, an outage, or a busy GPU)."""
        deadline, first_parked = entry.deadline, entry.first_parked
        assert deadline is not None and first_parked is not None  # set when it was parked
        if entry.bound_by_caller:
            why = f"wait longer than your X-Yield-Max-Wait ({entry.max_wait:g}s)"
        else:
            why = f"parked past the hold bound ({deadline - first_parked:g}s for {entry.cls} requests)"
        self._fail(entry, Refused("expired", why, 503), "expire")

    def _fail(self, entry: Entry, error: Exception, event: str = "refuse") -> None:
        """``entry`` leaves the lot on ``event``, its Deferred failed with ``error``."""
        self._let_out(entry, event).errback(error)
        self._tell_empty()

    def hand_over(self, entry: Entry, take: Callable[..., Deferred[bool] | None]) -> None:
        """Take ``entry`` out without an answer: its Deferred fails with :class:`HandedOver`, whose waiter
        gives ``take`` the request (it goes, with its client's connection, to the process that replaced
        this one)."""
        if entry.state is not PARKED:
            return
        self._fail(entry, HandedOver(take), "hand")

    def _abandon(self, entry: Entry) -> None:
        """Canceller: the client went away while parked."""
        if entry.state is not PARKED:
            return
        # A canceller that does not fire the Deferred gets CancelledError fired for it.
        self._fail(entry, CancelledError("client went away while parked"), "abandon")

    def _let_out(self, entry: Entry, event: str) -> Deferred[Entry]:
        """``entry`` leaves the lot on ``event``, the listeners told: the Deferred it waited on, for the caller to fire."""
        self._leave(entry)
        entry.fire(event)
        d = entry._deferred
        assert d is not None
        entry._deferred = None
        self._tell_out(entry)
        return d

    def _tell_out(self, entry: Entry) -> None:
        """Tell the listeners an entry left, before its request moves on; one failing must not stop the rest."""
        for listener in self._out_listeners:
            try:
                listener(entry)
            except Exception:
                log.failure("lot listener failed")

    def _leave(self, entry: Entry) -> None:
        remove_from(self._queues[entry.cls], entry)
        queue = self._queues[entry.cls]
        if not queue:
            self._passed_over.pop(entry.cls, None)
        now = self._clock.seconds()
        stayed = now - entry.parked_at if entry.parked_at is not None else 0.0
        entry.parked_seconds += stayed
        entry.parked_at = None
        self._account(entry, -1)
        if not self._count:
            # Nothing parked: every deadline left is stale, and no timer is needed.
            self._deadlines.clear()
            self._timer_at = math.inf
            if self._timer is not None and self._timer.active():  # clock.cancel, inline: most releases run it
                self._timer.cancel()
            self._timer = None
        self._metrics.park_seconds.labels(entry.cls).observe(stayed)

    def _account(self, entry: Entry, sign: int) -> None:
        self._count += sign
        self._bytes += sign * entry.size
        self._metrics.parked_requests.labels(entry.cls).set(len(self._queues.get(entry.cls, ())))
        self._metrics.parked_bytes.set(self._bytes)


def remove_from(line: list[Entry], entry: Entry) -> None:
    """Take ``entry`` out of a line kept in arrival order."""
    index = bisect.bisect_left(line, entry)
    assert line[index] is entry
    del line[index]
