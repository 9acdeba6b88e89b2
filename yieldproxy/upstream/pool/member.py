"""One upstream of the pool as it runs: whether it takes requests now, and why not.

What it knows against itself is one named state, :attr:`Member.condition`,
moved only by events through :data:`CONDITION_MOVES` (yieldproxy/states.py);
the run of "loading" answers that ``upstream.not_ready_max_seconds`` bounds is
data beside it.  Which member takes which request is the scheduler's
(yieldproxy/schedule/): it asks :meth:`Member.available` and is told when a
member takes work again (:meth:`Member.when_back`).  The rules, and why:
docs/pool.md ("Available", "Not ready") and docs/architecture.md ("The scheduler").
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ...clock import cancel
from ...lot.state import YieldState
from ...names import LOADING_SOURCE, TROUBLE_SOURCES
from ...servers import NOT_READY as SAYS_NOT_READY, UP
from ...servers.base import ModelCall
from ...states import Machine, Moves
from ..health import UpstreamHealth
from ..verdict import NOT_CONNECTED
from .members import MemberSpec
from .models import ModelCatalogue

log = Logger()


class Condition(enum.Enum):
    """What a member itself knows against taking requests (:attr:`Member.condition`)."""

    #: Nothing: it takes requests whenever nothing holds it.
    SERVING = "serving"
    #: It could not be reached and had not answered since the start: it reads unreachable
    #: (requests no other member may take still go to it) and is checked again until it answers.
    UNANSWERED = "unanswered"
    #: Attempts were refused before it ever answered: passed over, it reads unreachable, and is
    #: checked again until it answers.
    REFUSING = "refusing"
    #: Its server says it is still loading its model: passed over until its health reads up.
    NOT_READY = "not_ready"
    #: Not ready for ``not_ready_max_seconds``: its own ``loading`` hold, until a model call works
    #: (or someone else ends that hold).
    STUCK = "stuck"


SERVING, UNANSWERED, REFUSING = Condition.SERVING, Condition.UNANSWERED, Condition.REFUSING
NOT_READY, STUCK = Condition.NOT_READY, Condition.STUCK

#: What each event does to a member's condition; any other is a bug (:class:`~yieldproxy.states.Unexpected`).
CONDITION_MOVES: Moves[Condition, str] = Moves("a pool member", {
    # A probe or an attempt could not reach it before it ever answered.
    (SERVING, "unanswered"): UNANSWERED,
    # Attempts refused before it ever answered (said again while refusing: nothing moves).  One that
    # answered "loading" has answered: it is never refusing.
    (SERVING, "refused"): REFUSING,
    (UNANSWERED, "refused"): REFUSING,
    (REFUSING, "refused"): REFUSING,
    # Its server answers that it is still loading its model (it answers, so it is reachable).
    **{(condition, "loading"): NOT_READY for condition in (SERVING, UNANSWERED, REFUSING, STUCK)},
    # Not ready past upstream.not_ready_max_seconds.
    (NOT_READY, "too_long"): STUCK,
    # Its health reads up, or a model call is answered.
    (NOT_READY, "ready"): SERVING,
    (STUCK, "ready"): SERVING,
    # Someone else ended the hold it took when stuck.
    (STUCK, "unheld"): SERVING,
    # A check got an answer from one that never had.
    (UNANSWERED, "answered"): SERVING,
    (REFUSING, "answered"): SERVING,
})


@attrs.define(eq=False)
class Member(Machine[Condition, str]):
    """A pool member: its spec, its clients, its health, its models, its condition and its held release."""

    moves = CONDITION_MOVES

    spec: MemberSpec
    #: Its place in config order (ties in the choice go to the first).
    index: int
    _clock: IReactorTime
    _yields: YieldState
    #: What the pool knows of its kind of server (:mod:`yieldproxy.servers`).
    server: Any
    health: UpstreamHealth
    catalogue: ModelCatalogue
    #: Its client for requests (:class:`~yieldproxy.upstream.attempt.Upstream`); None in clock-only tests.
    upstream: Any = None
    #: Its control-plane client (:class:`~yieldproxy.upstream.control.UpstreamControl`); None in clock-only tests.
    control: Any = None
    #: The first and the longest wait between checks of an unreachable member.
    recheck_seconds: float = 0.5
    recheck_max_seconds: float = 10.0
    #: Bound on one check of its health path (``upstream.health_timeout_seconds``).
    check_timeout_seconds: float = 2.0
    #: How long it may stay not ready before it is treated as down (``upstream.not_ready_max_seconds``).
    not_ready_max_seconds: float = 300.0
    #: The scope of the ``loading`` hold it takes when stuck not ready: its outage watcher's (None: its name).
    outage_scope: str | None = None
    #: How the request log names it on the requests it served (None: it names no upstream:
    #: ``PoolShape.log_name``, members.py).
    log_name: str | None = None
    #: Since when it is :attr:`Condition.NOT_READY` (for its log line).
    _not_ready_since: float = 0.0
    #: Since the first "loading" answer that no answered model call followed: what the bound measures.
    _loading_since: float | None = None
    #: The last "loading" answer: a run of them goes on while they come closer than the bound.
    _last_loading: float = 0.0
    #: The last model call that answered "loading" (its minimal call ends a stuck hold).
    _loading_call: ModelCall | None = None
    _stuck_timer: IDelayedCall | None = None
    _recheck: IDelayedCall | None = None
    _recheck_delay: float = 0.0
    _checking: Deferred | None = None
    _stopped: bool = False
    #: Its API prefix was found (where its model list or a call answered): a 404 is then its server's word.
    _prefix_known: bool = False
    #: Pre-release steps still running (:meth:`hold_release_until`): it takes no work until they end.
    _release_gates: list[Deferred] = attrs.Factory(list)
    #: Told ``(name, fresh)`` when it may take work again (``fresh``: forget its past failures).
    _back: list[Callable[[str, bool], None]] = attrs.Factory(list)
    #: Its named state (:data:`CONDITION_MOVES`), read as :attr:`condition`.
    state: Condition = attrs.field(default=SERVING, init=False)

    @property
    def condition(self) -> Condition:
        """What it knows against itself: its named state (:data:`CONDITION_MOVES`)."""
        return self.state

    def follow(self) -> tuple[tuple[Callable[[Callable[..., None]], None], Callable[..., None]], ...]:
        """What it follows of its health, as (subscribe, listener) pairs: the composition root
        (``service.build_heart``) subscribes them; the constructor subscribes nothing."""
        return (
            (self.health.when_not_ready, self.became_not_ready),
            (self.health.when_served, self.served),
            (self.health.listen, self._attempt_result),
            (self.health.when_unanswered, self._not_there),
        )

    @property
    def name(self) -> str:
        return self.spec.name

    def when_back(self, listener: Callable[[str, bool], None]) -> None:
        """Call ``listener(name, fresh)`` when it may take work again: it answers after being unreachable, it
        is ready after loading (``fresh``: its "loading" answers were no failures), its held release ends."""
        self._back.append(listener)

    def _tell_back(self, fresh: bool) -> None:
        for listener in self._back:
            listener(self.name, fresh)

    @property
    def release_held(self) -> bool:
        """True while a pre-release step keeps it from taking work although it is not held."""
        return bool(self._release_gates)

    def hold_release_until(self, ready: Deferred) -> None:
        """Take no work until ``ready`` fires, either way: for a step that must come between the end of
        its yield and its first request (loading the models back, a reload's adoption).

        A failure of ``ready`` is logged and it takes work anyway: a failed preload must not strand
        the lot.  It consumes ``ready``'s result; cancel it to give up the wait.
        """
        self._release_gates.append(ready)

        def done(result):
            self._release_gates.remove(ready)
            if isinstance(result, Failure) and not result.check(CancelledError):
                log.failure("pre-release step failed; releasing the lot anyway", result)
            self._tell_back(False)
            return None

        ready.addBoth(done)

    @property
    def unreachable(self) -> bool:
        """Passed over: attempts were refused and it has not answered since the proxy started."""
        return self.state is REFUSING and not self.health.reachable

    @property
    def never_answered(self) -> bool:
        """It reads ``unreachable``: it could not be reached, and has not answered since the proxy started."""
        condition = self.state
        return (condition is REFUSING or condition is UNANSWERED) and not self.health.reachable

    @property
    def not_ready(self) -> bool:
        """Its server said it is still loading its model, and its health has not read up since."""
        return self.state is NOT_READY

    def prefixes_after_404(self, tried: str) -> tuple[str, ...]:
        """Where else an embedding call answered 404 at ``tried`` may be asked, the prefixes in order: the
        one it has now if that moved while the call was out (its model-list reader found it), else, while
        its prefix is not known, every other API prefix its server may be mounted under (Infinity's
        ``--url-prefix``). Once the prefix is known, a 404 at it is its server's answer: nowhere else."""
        server = self.server
        prefixes = [p for p in server.url_prefixes if server.with_prefix(p).embed_path != tried]
        now = [p for p in prefixes if server.with_prefix(p).embed_path == server.embed_path]
        if self._prefix_known:
            return tuple(now)
        return (*now, *(p for p in prefixes if p not in now))

    def found_prefix(self, prefix: str) -> None:
        """Its server answered under ``prefix``: every call to it (verification, translated embeddings,
        its model list) goes there from now on."""
        self._prefix_known = True
        if self.server.with_prefix(prefix).embed_path != self.server.embed_path:
            log.info("upstream {member} serves its API under {prefix}", member=self.name, prefix=prefix or "/")
            self.server = self.server.with_prefix(prefix)

    def held(self) -> bool:
        """Some hold applies to it (its own, or one of every member)."""
        return self._yields.yielded_for(self.spec.name)

    def available(self) -> bool:
        """True when it takes requests now: no hold applies to it, and it :meth:`takes_work`."""
        return not self._yields.yielded_for(self.spec.name) and self.takes_work()

    def takes_work(self) -> bool:
        """Nothing it knows of itself keeps it from taking requests: no held release, not not ready, not
        passed over as unreachable (its holds are the yield state's, which the scheduler asks itself)."""
        condition = self.state
        return not (
            self._release_gates or condition is NOT_READY or (condition is REFUSING and not self.health.reachable)
        )

    def state_name(self) -> str:
        """What ``/status`` says of it: one of :data:`~yieldproxy.observe.metrics.UPSTREAM_STATES`."""
        if self._yields.yielded_for(self.spec.name):
            holds = self._yields.holds_for(self.spec.name)
            return "outage" if holds and all(h.source in TROUBLE_SOURCES for h in holds) else "yielded"
        if self._release_gates:
            return "handing_over"
        if self.never_answered:
            return "unreachable"
        if self.state is NOT_READY:
            return "not_ready"
        return "available"

    # -- unreachable ------------------------------------------------------------------

    def _attempt_result(self, reason: str | None) -> None:
        """Every attempt's result (a listener of its health): one that could not connect before it
        ever answered makes it read unreachable."""
        if reason in NOT_CONNECTED and not self.health.reachable:
            self._not_there(reason)

    def _not_there(self, why: str) -> None:
        """It could not be reached and never answered: it reads unreachable until it answers; say so once.

        Only said of a member that has not answered, so never of one not ready (a "loading" answer
        is an answer); one refusing already is checked again already.
        """
        if self.state is not SERVING or self._stopped:
            return
        self.fire("unanswered")
        log.warn(
            "upstream {name} ({url}) does not answer ({why}): it reads unreachable until it answers "
            "(checked again every few seconds); requests sent to it fail until then",
            name=self.name, url=self.spec.url, why=why,
        )
        self._recheck_delay = self.recheck_seconds
        self._schedule_recheck()

    def refused(self) -> None:
        """An attempt could not connect, and it never answered: pass it over until a check gets an answer."""
        condition = self.state
        if condition is REFUSING and self._recheck is not None:
            return
        if condition is SERVING:
            log.warn(
                "upstream {name} ({url}) refuses connections and has not answered since the start: "
                "passing it over, the other upstreams serve; checking it again every few seconds",
                name=self.name, url=self.spec.url,
            )
        self.fire("refused")
        self._recheck_delay = self.recheck_seconds
        self._schedule_recheck()

    # -- not ready ---------------------------------------------------------------------

    def became_not_ready(self, why: str, call: ModelCall | None = None) -> None:
        """Its server says it is still loading its model: pass it over and check its health until it reads up.

        ``call``: the model call that said so (None: its health path, or not known).
        """
        if self._stopped or self._stuck_held():
            return
        now = self._clock.seconds()
        if call is not None:
            self._loading_call = call
        if self._loading_since is None or now - self._last_loading > self.not_ready_max_seconds:
            self._loading_since = now
        self._last_loading = now
        if self.state is not NOT_READY:
            log.warn(
                "upstream {name} ({url}) is not ready ({why}): passing it over, its attempts not counted; "
                "checking its health until it reads up (at most upstream.not_ready_max_seconds={bound:g}s "
                "until a model call is answered)",
                name=self.name, url=self.spec.url, why=why, bound=self.not_ready_max_seconds,
            )
            self.fire("loading")
            self._not_ready_since = now
            self._recheck_delay = self.recheck_seconds
            cancel(self._recheck)  # a refused member's longer wait: look again soon
            self._recheck = None
        if now - self._loading_since >= self.not_ready_max_seconds:
            # Its health read up in between, but its model route still loads: the bound ran out.
            self._stuck_for_too_long()
            return
        if self._stuck_timer is None:
            self._stuck_timer = self._clock.callLater(
                self._loading_since + self.not_ready_max_seconds - now, self._stuck_for_too_long
            )
        self._schedule_recheck()

    def served(self) -> None:
        """A model call was answered: it has loaded; the bound starts afresh at the next "loading" answer."""
        if self._stopped:
            return
        if self._waits_for_health():
            self._ready()
        self._loading_since = None
        self._loading_call = None
        if self._stuck_timer is not None:  # every answer comes here: no call when there is nothing to cancel
            cancel(self._stuck_timer)
            self._stuck_timer = None

    def _stuck_held(self) -> bool:
        """It holds the ``loading`` hold it took when stuck not ready (False once someone else ended it:
        then it serves again)."""
        if self.state is STUCK and self._yields.hold_of(LOADING_SOURCE, self._scope) is None:
            self.fire("unheld")
        return self.state is STUCK

    @property
    def _scope(self) -> str:
        return self.outage_scope if self.outage_scope is not None else self.name

    def _stuck_for_too_long(self) -> None:
        """Not ready for ``not_ready_max_seconds``: treated as down, its ``loading`` hold until a model call works."""
        self._stuck_timer = None
        if self.state is not NOT_READY or self._loading_since is None or self._stopped:
            # Its health reads up meanwhile: the next "loading" answer ends the run (became_not_ready).
            return
        seconds = self._clock.seconds() - self._loading_since
        log.warn(
            "upstream {name} ({url}) is still not ready after {seconds:.0f}s (upstream.not_ready_max_seconds): "
            "treating it as down, a hold (source loading) until {what} works",
            name=self.name, url=self.spec.url, seconds=seconds, what=self._recovery_what(),
        )
        self.fire("too_long")
        self._recheck_delay = self.recheck_seconds
        self._yields.hold(LOADING_SOURCE, f"upstream still loading its model after {seconds:.0f}s", scope=self._scope)
        self._schedule_recheck()

    def _recovery_call(self):
        """The minimal call whose answer ends a stuck hold, or None (its health path does)."""
        if self._loading_call is None:
            return None
        return self.server.minimal_call(self._loading_call)

    def _recovery_what(self) -> str:
        call = self._recovery_call()
        return "its health path" if call is None else f"a call of {call[1]}"

    def _ready(self) -> None:
        """Its health reads up (or a model call was answered): available again (the ``loading`` hold it
        took for a stuck load ends), and it takes work again."""
        was = self.state
        self.fire("ready")
        if was is STUCK:
            self._loading_since = None
            cancel(self._stuck_timer)
            self._stuck_timer = None
            log.info("upstream {name} ({url}) works again: ending its loading hold", name=self.name, url=self.spec.url)
            self._yields.release(LOADING_SOURCE, self._scope)
        else:
            log.info(
                "upstream {name} ({url}) is ready after {seconds:.1f}s: taking requests",
                name=self.name, url=self.spec.url, seconds=self._clock.seconds() - self._not_ready_since,
            )
        # Its "Loading model" answers were no failures of a working server: no backoff after them.
        self._tell_back(True)

    def _waits_for_health(self) -> bool:
        state = self.state
        return state is NOT_READY or state is STUCK and self._stuck_held()

    def stop(self) -> None:
        """The proxy stops: no more checks."""
        self._stopped = True
        cancel(self._stuck_timer)
        cancel(self._recheck)
        self._stuck_timer = self._recheck = None
        if self._checking is not None:
            self._checking.cancel()

    def _schedule_recheck(self) -> None:
        if self._stopped or self._checking is not None:
            return  # a check in flight schedules the next one when it ends
        if self._recheck is None or not self._recheck.active():
            self._recheck = self._clock.callLater(self._recheck_delay, self._check)
            self._recheck_delay = min(self.recheck_max_seconds, self._recheck_delay * 2)

    def _check(self) -> None:
        self._recheck = None
        waits = self._waits_for_health()
        if not self.never_answered and not waits:
            self._reachable()
            return
        if self.control is None:
            self._schedule_recheck()
            return
        model_call = self._recovery_call() if self._stuck_held() else None
        if model_call is not None:
            # Its health said up while its model route loaded: only a model call tells.
            method, path, body = model_call
            d = self._checking = self.control.request(method, path, body, timeout=self.check_timeout_seconds)
        else:
            d = self._checking = self.control.request("GET", self.spec.health_path, timeout=self.check_timeout_seconds)

        def answered(answer) -> None:
            self.health.answered()  # any answer: it is there (an outage is the outage watcher's business)
            if self._waits_for_health():
                # Not ready (or stuck so): only its health reading up (a model call, when stuck on one) ends that.
                if model_call is not None:
                    up = self.server.judge(answer.code, answer.body) != SAYS_NOT_READY
                elif self._stuck_held() and self._recovery_call() is not None:
                    up = False  # a health check sent before it was held stuck: only a model call tells now
                else:
                    up = self.server.judge_health(answer.code, answer.body) == UP
                if up:
                    self._ready()
                else:
                    self._schedule_recheck()
            self._reachable()

        def failed(failure) -> None:
            condition = self.state
            if condition is REFUSING or condition is UNANSWERED or self._waits_for_health():
                self._schedule_recheck()

        def done(result):
            self._checking = None
            return result

        d.addBoth(done).addCallbacks(answered, failed)

    def _reachable(self) -> None:
        if self.state is REFUSING or self.state is UNANSWERED:
            self.fire("answered")
            log.info("upstream {name} ({url}) answers: taking requests", name=self.name, url=self.spec.url)
            self._tell_back(False)
