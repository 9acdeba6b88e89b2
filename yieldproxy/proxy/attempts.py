"""The attempt loop: a gated request waits for the scheduler, runs on the member it is released to, and acts on the verdict.

Each attempt runs on the member the scheduler or a member's drainer chose; a
retryable failure sends the request back to its place in the lot, where
another eligible member may take it; once bytes reach the client it never
moves.  What to do after a failure is :func:`yieldproxy.upstream.verdict.verdict`'s
decision; this gathers its facts and does what it says.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ..config import Config
from ..lot.parking import Entry, HandedOver, Refused
from ..observe.metrics import Metrics
from ..schedule.scheduler import Scheduler
from ..upstream.attempt import (
    Attempt,
    ClientBuffers,
    ClientTooSlow,
    RelayBroken,
    RetryableFailure,
    UpstreamAnswer,
    write_answer,
)
from ..upstream.pool.member import Member
from ..upstream.pool.members import answer_headers, served_outcome
from ..upstream.served import MANAGEMENT_PATHS
from ..upstream.translated_attempt import TranslatedAttempt
from ..upstream.translation import parse_request
from ..upstream.verdict import Facts, Reason, Verdict, gateway_status, judged_later, reported, slows_replay, verdict
from .back_in_line import BACK_IN_LINE, back_in_line
from .calls import body_for, failed_call_on, managed, unloads
from .facts import HANDED_OVER, RequestFacts
from .outcome import Outcomes
from .target import Target

log = Logger()

#: :meth:`AttemptLoop._act`'s answer when the request goes round again.
_RETRY = object()


def _bound_spent(entry: Entry, now: float) -> str:
    """"its hold bound (...) is spent" when a request's wait bound is spent at ``now``, else ""."""
    if entry.deadline is None or entry.first_parked is None or now < entry.deadline:
        return ""
    if entry.bound_by_caller:
        return f"your X-Yield-Max-Wait ({entry.max_wait:g}s) is spent"
    return f"its hold bound ({entry.deadline - entry.first_parked:g}s for {entry.cls} requests) is spent"


@attrs.define(eq=False)
class AttemptLoop:
    """Serves a gated request to its end: admitted, tried, retried or answered, its outcome said on its facts."""

    _clock: IReactorTime
    _config: Config
    _scheduler: Scheduler
    _metrics: Metrics
    _outcomes: Outcomes
    #: Answers waiting in memory for slow clients (proxy.slow_client_buffer_*).
    _buffers: ClientBuffers
    #: Told of every attempt as it ends: ``(member, entry, outcome)`` (the ``[fallback]`` counts its own).
    _on_attempt: Callable[[Member, Entry, str], None]

    async def run(self, request: Any, facts: RequestFacts, target: Target, entry: Entry, body: bytes):
        """The request's life once admitted: its outcome is written once, here, however it ends."""
        facts.cls, facts.entry = entry.cls, entry
        #: The members that answered this request "busy" (:meth:`_busy_elsewhere`).
        busy_on: set[str] = set()
        try:
            while True:
                facts.attempts = entry.tries
                try:
                    await self._scheduler.admit(entry)
                except Refused as refused:
                    refusal = self._scheduler.explain(refused, entry)
                    answer = self._outcomes.refuse(
                        request, facts, entry.api, refusal.status, refusal.reason, refusal.message,
                        refusal.retry_after, attempts=entry.tries,
                    )
                    facts.replay = refusal.reason if refusal.reason in ("expired", "shutdown") else "rejected"
                    return answer
                except HandedOver as handed:
                    # Taken by the process that replaces this one, or parked here again (:class:`HandedOver` says when).
                    facts.outcome = HANDED_OVER
                    taken = handed.take(request, entry, body)
                    if taken is None or await taken:
                        entry.fire("taken")
                        return None
                    facts.outcome = None
                    continue
                answered = await self._attempt(request, facts, target, entry, body, busy_on)
                if answered is not _RETRY:
                    return answered
        except CancelledError:
            facts.gone()
            raise
        finally:
            self._outcomes.close(request, facts)

    async def _attempt(self, request: Any, facts: RequestFacts, target: Target, entry: Entry, body: bytes, busy_on):
        """One attempt on the member the request was released to: its answer, or :data:`_RETRY`."""
        member = self._scheduler.member(entry.released_to)
        facts.served_by = member.log_name
        facts.attempts = entry.tries + 1
        extra = []
        if entry.was_parked:
            extra.append((b"x-yield-parked-seconds", b"%.3f" % entry.parked_seconds))
        began = self._clock.seconds()
        attempt: Attempt | TranslatedAttempt | None = None
        failure = None
        outcome = "error"
        # Only the upstream's failures slow the replay down, not a client leaving.
        failed = False
        try:
            # Built inside the slot's try: whatever fails here still gives the slot back.
            if entry.routing is not None and member.name in entry.routing.translated:
                attempt = self._translated_attempt(request, target, entry, body, member, extra)
            else:
                attempt = Attempt(
                    self._clock, member.upstream, request, body_for(member, entry.model, body),
                    self._attempt_timeout(entry.cls), extra, buffers=self._buffers, target=target.raw,
                    judge=member.server.judge, stall_timeout=self._config.upstream.stall_timeout_seconds,
                )
            status = await attempt.run()
            if isinstance(attempt, TranslatedAttempt):
                facts.translated_by = attempt.translated_by
            outcome = "ok"
        except RetryableFailure as retryable:
            # An answer that may yet be the caller's (relayed unless a hold or a probe explains it)
            # does not slow the replay down.
            failed = slows_replay(retryable.reason)
            failure = retryable
            outcome = retryable.reason
        except RelayBroken as broken:
            failed = True
            outcome = broken.reason
            return await self._outcomes.broken(request, facts, entry.api, broken, entry.tries + 1)
        except ClientTooSlow as slow:
            outcome = "slow_client"
            return await self._outcomes.drop_slow_client(request, facts, slow, entry.tries + 1)
        except CancelledError:
            outcome = "abandoned"
            raise
        finally:
            # The upstream is done with this attempt: its replay slot is free,
            # whether or not the client has read the whole answer yet.
            elapsed = self._clock.seconds() - began
            self._scheduler.finished(failed=failed, seconds=elapsed, member=entry.released_to)
            self._outcomes.child(self._metrics.upstream_attempt_seconds, member.name, entry.cls).observe(elapsed)
            # A 5xx that may yet be the caller's is counted once judged (below): ``ok`` when relayed.
            later = failure is not None and judged_later(failure.reason, member.spec.fallback)
            if not later:
                self._attempt_ended(member, entry, outcome)
        if failure is not None:
            facts.attempts = entry.tries
            ended = "abandoned"
            try:
                answered = await self._after_failure(request, facts, target, entry, body, failure, member, busy_on, extra)
                ended = failure.reason if answered is _RETRY else "ok"
            finally:
                if later:
                    self._attempt_ended(member, entry, ended)
            return answered
        # Only a 2xx shows that the upstream serves the model (a 404 for a model it lacks does not, nor an
        # unload, which loads nothing): its record of served models is the evidence of its outage verdicts
        # (upstream/served.py).
        ran = 200 <= status < 300 and not unloads(request.method, target.path, body)
        member.health.served(failed_call_on(target, entry, body, member) if ran else None, began)
        if 200 <= status < 300 and target.path in MANAGEMENT_PATHS:
            managed(member, target.path, body_for(member, entry.model, body))
        self._outcomes.child(self._metrics.upstream_seconds, entry.cls).observe(elapsed)
        assert attempt is not None  # it ran: it was made
        if not attempt.client_has_all():
            await attempt.client_drained()
        facts.say(status, served_outcome(member.spec), entry.tries + 1)
        return None

    def _attempt_ended(self, member: Member, entry: Entry, outcome: str) -> None:
        """Count an attempt by how it ended (``yieldproxy_upstream_attempts_total``) and tell who listens."""
        self._outcomes.child(self._metrics.upstream_attempts_total, member.name, outcome).inc()
        self._on_attempt(member, entry, outcome)

    def _translated_attempt(self, request: Any, target: Target, entry: Entry, body: bytes, member: Member, extra):
        """The attempt on a member that serves this embedding route only translated (upstream/translated_attempt.py).

        The body was read the same way at admission (proxy/admission.py), so it reads again.
        """
        wanted = parse_request(target.path, body)
        own = member.catalogue.own_name(wanted.model) or wanted.model
        spec = member.spec
        return TranslatedAttempt(
            self._clock, member.upstream, member.server, request, wanted, own, entry.api,
            spec.attempt_timeout_seconds or self._attempt_timeout(entry.cls), [*extra, *answer_headers(spec, own)],
            member=member.name, relay_errors=not spec.fallback,
            prefixed=member if len(member.server.url_prefixes) > 1 else None,
        )

    def _attempt_timeout(self, cls: str) -> float:
        """The class's own attempt timeout, or the upstream default."""
        own = self._config.classes[cls].attempt_timeout_seconds if cls in self._config.classes else 0
        return own or self._config.upstream.attempt_timeout_seconds

    async def _after_failure(
        self, request: Any, facts: RequestFacts, target: Target, entry: Entry, body: bytes,
        failure: RetryableFailure, member: Member, busy_on: set[str], extra,
    ):
        """A failed attempt: retry it (:data:`_RETRY`), or answer the caller now, as the verdict says.

        The verdict (yieldproxy/upstream/verdict.py; its rows: docs/architecture.md,
        "The verdict on a failed attempt") is the policy; this gathers the facts it rests on, asks for the ones it
        asks for (the pool, when an answer said busy; the outage judge, the
        member's health, which may probe), and does what it returns: the
        counts, the log lines and the answer.
        """
        answer = failure.answer
        facts_of_it = Facts(
            failure.reason, failure.words, answer.code if answer is not None else None,
            standby=member.spec.fallback, held=member.held(),
            attempts=entry.attempts, unreadable=entry.unreadable, max_attempts=self._config.upstream.max_attempts,
        )
        decided = verdict(facts_of_it)
        if decided is Verdict.ASK_POOL:
            facts_of_it = attrs.evolve(facts_of_it, elsewhere=self._busy_elsewhere(entry, member, busy_on))
            decided = verdict(facts_of_it)
        if decided is Verdict.ASK_JUDGE:
            reason = reported(facts_of_it)
            if reason != failure.reason:
                failure = RetryableFailure(reason, failure.detail, answer, failure.words)
            self._metrics.upstream_failures_total.labels(entry.cls, reason).inc()
            # The verdict is waited for within the caller's budget, as any wait (a probe may take a minute):
            # past it, none (None: the verdict counts it out of time).
            entry.start_waiting(self._clock.seconds(), self._config.classes[entry.cls].hold_seconds)
            assert entry.deadline is not None  # set just now, or when it first waited
            judged = member.health.report(reason, failed_call_on(target, entry, body, member))
            judged.addTimeout(max(0.0, entry.deadline - self._clock.seconds()), self._clock, lambda value, timeout: None)
            outage = await judged
            decided = verdict(attrs.evolve(
                facts_of_it, reason=reason, outage=bool(outage), held=member.held(), reachable=member.health.reachable,
                others_reachable=any(not self._scheduler.member(n).unreachable for n in entry.eligible if n != member.name),
                out_of_time=outage is None or self._clock.seconds() >= entry.deadline,
            ))
        return self._act(decided, request, facts, target, entry, body, failure, member, extra)

    def _busy_elsewhere(self, entry: Entry, member: Member, busy_on: set[str]) -> bool:
        """``member`` answered busy: whether another eligible member that has not answered it busy may take it
        now, as its drainer decides with this one failed on (a standby takes nothing while this one is
        available: busy is not unavailable)."""
        busy_on.add(member.name)
        entry.failed_on = member.name
        return any(
            n not in busy_on and self._scheduler.usable(self._scheduler.member(n), entry) and self._scheduler.may_take(n, entry)
            for n in entry.eligible
        )

    def _act(
        self, decided: Verdict, request: Any, facts: RequestFacts, target: Target, entry: Entry, body: bytes,
        failure: RetryableFailure, member: Member, extra,
    ):
        """Do what the verdict on a failed attempt says: :data:`_RETRY`, or the answer said and written."""
        reason = BACK_IN_LINE.get(decided)
        if reason is not None:
            # Back to its place in the lot, not counted against max_attempts; another member may take it.
            back_in_line(reason, self._metrics, entry, member, failure, lambda: failed_call_on(target, entry, body, member))
            return _RETRY
        if decided is Verdict.RELAY:
            assert failure.answer is not None  # only an answer is relayed
            return self._relay(request, facts, entry, member, failure.answer, extra)
        # Another eligible member takes it first, when one is available.
        entry.failed_on = member.name
        entry.attempts += 1
        if decided is Verdict.UNREACHABLE:
            # Never reached since start: a wrong URL or a backend not started
            # yet. Waiting cannot help; say so at once.
            return self._gave_up(request, facts, entry, failure, "the upstream has not answered since the proxy started")
        alone = self._failing_alone(entry, member)
        log.info(
            "{cls} attempt {n} failed ({reason}){alone}: {detail}",
            cls=entry.cls, n=entry.attempts, reason=failure.reason, detail=failure.detail,
            alone=f"; {alone}, retried within the class's bound" if alone else "",
        )
        if failure.reason == Reason.BAD_ANSWER:
            entry.unreadable += 1
        if decided is not Verdict.RETRY:
            why = f"{alone}: gave up after {entry.attempts} attempts" if alone else None
            if entry.attempts < self._config.upstream.max_attempts and _bound_spent(entry, self._clock.seconds()):
                spent = _bound_spent(entry, self._clock.seconds())
                why = f"{why} as {spent}" if why else f"upstream failed {entry.attempts} times, giving up as {spent}"
            return self._gave_up(request, facts, entry, failure, why, relay=decided is Verdict.GIVE_UP_RELAY)
        self._metrics.retries_total.labels(entry.cls).inc()
        return _RETRY

    def _failing_alone(self, entry: Entry, member: Member) -> str | None:
        """"model X fails alone on upstream Y (evidence)" when the outage watcher judged the request's model
        failing alone there (upstream/failing.py), else None: what its log lines and its 502/504 say."""
        if not entry.model:
            return None
        own = member.catalogue.own_name(entry.model) or entry.model
        note = member.health.failing.get(own, self._clock.seconds())
        if note is None:
            return None
        return f"model {entry.model} fails alone on upstream {member.name} ({note.evidence})"

    def _relay(
        self, request: Any, facts: RequestFacts, entry: Entry, member: Member, answer: UpstreamAnswer, extra=()
    ) -> bytes:
        """The upstream's whole error answer is the caller's: relay it as it came (the upstream answered)."""
        member.health.served()
        facts.say(answer.code, "ok", entry.tries + 1)
        return write_answer(request, answer, extra)

    def _gave_up(
        self, request: Any, facts: RequestFacts, entry: Entry, failure: RetryableFailure, why: str | None = None,
        relay: bool = False,
    ):
        """The request gives up: the upstream's own answer when ``relay`` (its GPU words say more than ours
        would: :attr:`Verdict.GIVE_UP_RELAY`), else a 502 or a 504 saying why."""
        if relay:
            assert failure.answer is not None  # the verdict relays only an answer
            log.info(
                "{cls} request gave up after {n} failed attempts ({reason}); relaying the upstream's answer",
                cls=entry.cls, n=entry.attempts, reason=failure.reason,
            )
            facts.say(failure.answer.code, "upstream_error", entry.tries)
            return write_answer(request, failure.answer)
        why = why or f"upstream failed {entry.attempts} times, giving up"
        return self._outcomes.refuse(
            request, facts, entry.api, gateway_status(failure.reason), "upstream_error", f"{why}: {failure.detail}",
            attempts=entry.tries,
        )
