"""Outage detection: a crashed or GPU-less upstream is held like a yield, not failed.

The upstream's health hands every failed attempt of the outage kinds
(:data:`~yieldproxy.upstream.verdict.OUTAGE_REASONS`) to :meth:`OutageWatcher.judge`,
which asks whether a recognised outage explains the failure.  It decides on
evidence about the GPU (a probe chosen by upstream/evidence.py), never on the model
the failing request alone named, so neither one request nor one model failing
again and again can hold the proxy.  A failed probe takes the ``outage`` hold and
forgives the failures waiting on it; a passing one means the model fails alone.
While the hold lasts, :class:`UpstreamProbe` probes with a growing interval and
the first probe that passes, or any model call answered 2xx, ends it.

The specification (what counts as an outage, the evidence table, probes shared and
believed, not ready, an upstream that never answered): docs/watchers.md
(*Outage detection*).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ..clock import cancel
from ..lot.state import ALL, DEFAULT_MEMBER, YieldState
from ..names import OUTAGE_SOURCE, TROUBLE_SOURCES, canonical_model
from ..observe.metrics import Metrics
from ..servers import GPU, NOT_READY, UP
from ..servers.base import ModelCall, Server
from ..servers.ollama import SERVER as OLLAMA
from ..upstream.control import Answer, UpstreamControl
from ..upstream.evidence import ALONE, evidence_for, follow_ups
from ..upstream.health import UpstreamHealth
from ..upstream.verdict import CONNECTION_REASONS, OUTAGE_REASONS

log = Logger()

SOURCE = OUTAGE_SOURCE
#: Probes deciding verdicts at once, at most: past it, a failure of yet another call waits on the
#: first probe in flight (its verdict, or the hold it takes), so a burst of distinct model names (or
#: one model in many spellings) never sends the upstream a model call per name.
MAX_PROBES = 4
#: A probe of a model call answered with a failure (the upstream is there; that call fails).
FAILED_ANSWER = "failed_answer"


#: Seconds a passing probe is believed: a failure judged meanwhile on the same evidence reuses it.
VERDICT_SECONDS = 10.0
#: Seconds a model judged failing alone counts as "failing" for the rule "several models fail".
SEVERAL_WITHIN = 60.0
#: Seconds an outage hold that no model vouches for lasts at most (several models failed before any was served
#: here, and no probe model is named: a client can make several of its own fail): then the lot is let out, and
#: the first model call answered (or failed again) decides.
UNVOUCHED_HOLD_SECONDS = 60.0
#: Follow-up probes of a held outage sent at once, each step (the first that passes ends the hold).
PROBES_PER_STEP = 4


@attrs.define(eq=False)
class _Waiter:
    """One failure waiting for a probe's verdict."""

    deferred: Deferred
    reason: str
    call: ModelCall | None


@attrs.define(eq=False)
class _Pending:
    """One probe deciding verdicts, and the failures waiting on it."""

    #: What it probes (None: the health path).
    target: ModelCall | None
    #: Why that target (evidence.Evidence.why), for the log and the note on a model failing alone.
    why: str = ""
    waiters: list[_Waiter] = attrs.Factory(list)
    probe: Deferred | None = None
    #: The verdict once decided (a probe may decide at once, before anyone waits).
    verdict: bool | None = None
    #: A pass is believed for :data:`VERDICT_SECONDS` (not the probe at start: it judged no failure).
    believed: bool = True
    #: Decided so: the failures judged on it are their calls' own (what was probed passed).
    alone: bool = False
    #: When it started: a model call that began since and was answered 2xx disproves the outage it would confirm.
    started: float = 0.0
    #: Such a call was answered while it ran.
    disproved: bool = False


@attrs.frozen
class UpstreamProbe:
    """One outage probe through the control client: the health path, or the minimal twin of a failed model call.

    Any answer to a model call shows the upstream is reachable (it answered),
    even one that says it is down.  ``server`` is what is known of the
    upstream's kind of server (yieldproxy/servers): its minimal calls and how its
    answers read.
    """

    _control: UpstreamControl
    _health: UpstreamHealth
    health_path: str = "/api/version"
    health_timeout: float = 2.0
    model_timeout: float = 60.0
    server: Server = OLLAMA

    def __call__(self, call: ModelCall | None = None) -> Deferred:
        """A Deferred firing True when the upstream serves ``call`` (None: the health path answers 200)."""
        minimal = self.server.minimal_call(call) if call is not None else None
        if minimal is None:
            d = self._control.request("GET", self.health_path, timeout=self.health_timeout)
            return d.addCallbacks(self._health_answered, self._no_answer)
        method, path, body = minimal
        d = self._control.request(method, path, body, timeout=self.model_timeout)
        return d.addCallbacks(self._model_answered, self._no_answer)

    def _no_answer(self, failure):
        """No answer at all: the upstream's health hears it (one never answered reads unreachable)."""
        if not failure.check(CancelledError):
            self._health.unanswered(failure.getErrorMessage())
        return failure

    def _health_answered(self, answer: Answer) -> bool | str:
        verdict = self.server.judge_health(answer.code, answer.body)
        if verdict == NOT_READY:
            self._health.not_ready(f"its health path answered {answer.code} (loading its model)")
            return NOT_READY
        if verdict != UP or answer.code != 200:
            return False
        self._health.answered()
        return True

    def _model_answered(self, answer: Answer) -> bool | str:
        """Down when it fails: any 5xx (the probe's text is the proxy's, so whatever its words say,
        the upstream cannot serve this kind of call), or its server's GPU words at another status;
        any other answer means the GPU serves (:data:`NOT_READY` when its server says it is still
        loading its model)."""
        self._health.answered()
        judged = self.server.judge(answer.code, answer.body)
        if judged == NOT_READY:
            self._health.not_ready(f"a probe of a model call answered {answer.code} (loading its model)")
            return NOT_READY
        if answer.code >= 500:
            return FAILED_ANSWER
        return FAILED_ANSWER if judged == GPU else True


@attrs.define(eq=False, slots=False)
class OutageWatcher(Service):
    """Judges failed attempts with probes; takes and ends the ``outage`` hold."""

    _clock: IReactorTime
    _state: YieldState
    #: The upstream's health: the watcher judges its failures while running, and marks it reachable;
    #: its record of served models is the evidence, its notes of models failing alone are the watcher's.
    _health: UpstreamHealth
    #: ``check(call)``: probes once; a Deferred firing True when the upstream serves ``call``
    #: (None: the health path), False, :data:`FAILED_ANSWER` or an error when it fails the way an
    #: outage does (an :class:`UpstreamProbe`).
    _check: Callable[[ModelCall | None], Deferred]
    _metrics: Metrics
    interval: float = 0.5
    max_interval: float = 10.0
    #: The operator's probe model (``upstream.probe_model``, or the member's): "" = none named.
    probe_model: str = ""
    #: Its route (``probe_path``): "" = the route it was served on, else the failing call's.
    probe_path: str = ""
    #: ``probeable(call)``: whether a probe can reproduce a call of that kind (its server's minimal call).
    probeable: Callable[[ModelCall], bool] = lambda call: True
    _next_interval: float = attrs.field(init=False)
    _timer: IDelayedCall | None = None
    #: The follow-up probes of a held outage, in flight (one step's, gathered).
    _probe: Deferred | None = None
    #: That step's probes, each (to cancel them when the watcher stops).
    _checks: list = attrs.Factory(list)
    #: The hold rests on no model known to work (:data:`UNVOUCHED_HOLD_SECONDS`).
    _unvouched: bool = False
    #: The model calls whose follow-up probes failed while the hold lasts: failing alone if another passes.
    _failed_follow_ups: dict = attrs.Factory(dict)
    #: What the follow-up probes of a held outage ask, in turn (evidence.follow_ups), and whose turn it is.
    _outage_calls: tuple[ModelCall | None, ...] = ()
    _turn: int = 0
    _held_since: float | None = None
    _said_unreachable: bool = False
    #: Verdicts being decided, by the target probed.
    _pending: dict = attrs.Factory(dict)
    #: Probes that passed lately, by target (a model's canonical name; None: the health path): when.
    _passed: dict = attrs.Factory(dict)
    #: The scope of its ``outage`` hold: its member's name, or ``*`` with one upstream
    #: (``PoolShape.hold_scope``, upstream/pool/members.py; ``service.build`` gives it).
    scope: str = ALL
    #: The pool member it watches: the holds on it are what "yielded" means here.
    member: str = DEFAULT_MEMBER

    name = "watcher:outage"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._next_interval = self.interval
        self._metrics.outage_probes_of(self.member)
        if self.scope != ALL:
            self.name = f"watcher:outage:{self.scope}"

    def _yielded(self) -> bool:
        """Some hold applies to the member (its own outage hold, or a GPU lent away)."""
        return self._state.yielded_for(self.member)

    def _held(self) -> bool:
        """Its own ``outage`` hold is in place."""
        return self._state.hold_of(SOURCE, self.scope) is not None

    @property
    def reachable(self) -> bool:
        """True once the upstream has answered (a request, or a probe) since start."""
        return self._health.reachable

    @property
    def upstream(self) -> str:
        return self._health.url

    def startService(self) -> None:
        super().startService()
        self._health.listen(self.upstream_result)
        self._health.listen_models(self.model_served)
        # One probe at start, so an outage before the first request is an outage too.
        self._start_probe(None, "the start").believed = False

    def stopService(self) -> None:
        """Stop listening, judging and probing; an outage hold stays (the upstream is still down)."""
        super().stopService()
        self._health.forget(self.upstream_result)
        self._health.forget_models(self.model_served)
        cancel(self._timer)
        self._timer = None
        for check in _take(self._checks):
            check.cancel()
        for pending in list(self._pending.values()):
            if pending.probe is not None:
                pending.probe.cancel()
        # Nobody will decide these any more: the attempts count, as without a watcher.
        self._decide_all(False)

    def status(self) -> dict:
        held = self._held()
        return {
            "reachable": self.reachable,
            "probing": self._timer is not None or self._probe is not None or bool(self._pending),
            "next_interval_seconds": self._next_interval,
            "outage_probe": _describe(self._step_calls()[0]) if held and self._outage_calls else None,
            "outage_probes": [_describe(c) for c in self._outage_calls] if held else [],
            "probe_model": self.probe_model or None,
        }

    # -- what the member's health reports ----------------------------------------------

    def upstream_result(self, reason: str | None) -> None:
        """Every attempt's result (a listener of the upstream's health)."""
        if reason is not None:
            return
        self._answered()
        if not self._held():
            # Traffic flows: the next outage starts with quick probes again.
            self._next_interval = self.interval

    def model_served(self, call: ModelCall, began: float | None = None) -> None:
        """A model call was answered 2xx: the upstream serves, so no outage of the whole of it holds.

        Only a call that *began* after the probe started (or the hold was taken) says so: an answer that
        was on its way when the GPU failed says nothing of the GPU now; ``began`` None says nothing.
        """
        if began is None:
            return
        for pending in self._pending.values():
            if began >= pending.started:
                pending.disproved = True
        if self._held() and self._held_since is not None and began >= self._held_since:
            self._end_hold(f"{_describe(call)} was served", call)

    def judge(self, reason: str, call: ModelCall | None = None) -> Deferred:
        """The verdict on one failed attempt: a Deferred firing True when an outage explains it.

        Never raises and never fails; cancelling the Deferred only stops waiting.
        """
        try:
            return self._judge(reason, call)
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("outage watcher: judging a failure failed")
            return succeed(False)

    def _judge(self, reason: str, call: ModelCall | None) -> Deferred:
        if reason not in OUTAGE_REASONS or not self.running:
            return succeed(False)
        if self._yielded():
            # Held already (an outage, or the GPU lent away): the failure is explained.
            return succeed(True)
        if not self.reachable:
            if not self._said_unreachable:
                self._said_unreachable = True
                log.warn(
                    "{upstream} has not answered once since the start ({reason}): that is a "
                    "configuration problem, not an outage, so requests fail at once (502) "
                    "until it answers",
                    upstream=self.upstream,
                    reason=reason,
                )
            return succeed(False)
        if reason in CONNECTION_REASONS:
            # The connection failed: nothing that passed before says the upstream is there now.
            self._passed.clear()
        now = self._clock.seconds()
        evidence = evidence_for(
            reason, call, operator=self._operator_call(call), known=self._known(now),
            others_failing=[f.name for f in self._health.failing.others(
                call.model if call is not None else None, now, SEVERAL_WITHIN,
            )],
        )
        if evidence.action == ALONE:
            self._alone(reason, call, evidence.why, "none")
            return succeed(False)
        target = evidence.call
        pending = self._pending.get(target)
        passed = self._passed.get(_key(target))
        if pending is None and passed is not None and 0 <= now - passed < VERDICT_SECONDS:
            # Believed for a few seconds (unless a probe of it runs now): one failing request costs one
            # probe, not one per attempt.
            self._alone(reason, call, _serves(target, f" {now - passed:.0f}s ago"), "probe")
            return succeed(False)
        if pending is None and len(self._pending) >= MAX_PROBES:
            # Enough probes decide already: this failure takes the verdict of the first one.  Its pass
            # counts the attempt (the upstream serves), its failure holds (which explains this one too).
            pending = next(iter(self._pending.values()))
        if pending is None:
            pending = self._start_probe(target, evidence.why)
        if pending.verdict is not None:
            # The probe decided at once (it fired synchronously).
            if pending.alone:
                self._alone(reason, call, self._passed_why(pending), "probe")
            return succeed(pending.verdict)
        waiter = _Waiter(Deferred(canceller=lambda d: _forget(pending.waiters, d)), reason, call)
        pending.waiters.append(waiter)
        return waiter.deferred

    def _known(self, now: float) -> list[ModelCall]:
        """The models the upstream served, of most standing first, but those judged failing alone lately: a
        model known to fail while another serves says nothing about the GPU (all of them when every one is)."""
        calls = self._health.record.calls()
        failing = self._health.failing
        if not failing:
            return calls
        sound = [c for c in calls if failing.get(c.model, now) is None]
        return sound or calls

    def _operator_call(self, failing: ModelCall | None) -> ModelCall | None:
        """The call that probes the operator's model: on ``probe_path``, else the route the upstream served it
        on, else the failing call's route; None when none is named (or none of those can be probed)."""
        if not self.probe_model:
            return None
        if self.probe_path:
            return ModelCall(self.probe_path, self.probe_model)
        served = next((c for c in self._health.record.calls() if _key(c) == canonical_model(self.probe_model)), None)
        if served is not None:
            return served
        if failing is not None and self.probeable(ModelCall(failing.path, self.probe_model)):
            return ModelCall(failing.path, self.probe_model)
        return None

    def _alone(self, reason: str, call: ModelCall | None, why: str, evidence: str) -> None:
        """A failure judged the call's own: counted, and its model noted as failing alone (logged the first time)."""
        self._metrics.failures_alone_total.labels(self.member, reason, evidence).inc()
        if call is None:
            return
        note = self._health.failing.judged_alone(call, reason, why, self._clock.seconds())
        if note.failures == 1:
            log.warn(
                "{upstream}: {what} failed ({reason}) and fails alone ({why}): no outage, nobody else waits; "
                "its own callers retry within their class's bound",
                upstream=self.upstream, what=_describe(call), reason=reason, why=why,
            )

    def _passed_why(self, pending: _Pending) -> str:
        if pending.disproved:
            return "a model was served meanwhile"
        return _serves(pending.target)

    # -- the probe that decides a verdict -----------------------------------------------------

    def _start_probe(self, target: ModelCall | None, why: str) -> _Pending:
        """Probe ``target`` now; the result decides every verdict waiting on it (its ``verdict`` once decided)."""
        pending = self._pending[target] = _Pending(target, why, started=self._clock.seconds())
        d = self._run_check(target)
        pending.probe = d
        d.addCallback(self._decided, pending)
        d.addErrback(lambda f: log.failure("outage watcher: handling a probe failed", f))
        return pending

    def _decided(self, up: bool | str | None, pending: _Pending) -> None:
        if self._pending.get(pending.target) is pending:
            del self._pending[pending.target]
        pending.probe = None
        confirmed = False
        alone = False
        if up is None:
            forgiven = False  # the watcher stopped: the attempts count, as without it
        elif up == NOT_READY:
            # Loading its model: no outage, and not the requests' fault (its member waits for it to read up).
            self._answered()
            forgiven = True
        elif up and up != FAILED_ANSWER:
            self._answered()
            if pending.believed:
                self._passed[_key(pending.target)] = self._clock.seconds()
            # The upstream serves what was probed: the failures waiting are their calls' own.
            forgiven = False
            alone = True
        elif pending.disproved and not self._yielded():
            # A model was served while the probe ran: the upstream serves; the failures are their calls' own.
            forgiven = False
            alone = True
        elif self._yielded() or not self.reachable:
            # Held already (by this watcher or another source), or never reachable.
            forgiven = self._yielded()
        else:
            confirmed = forgiven = True
            self._take_hold(pending)
        pending.verdict = forgiven
        pending.alone = alone
        for waiter in _take(pending.waiters):
            if alone:
                self._alone(waiter.reason, waiter.call, self._passed_why(pending), "probe")
            waiter.deferred.callback(forgiven)
        if forgiven:
            # Every failure waiting on another probe is explained now too.
            self._decide_all(True)
        if confirmed:
            self._schedule()

    def _take_hold(self, pending: _Pending) -> None:
        """A probe on evidence about the GPU failed too: the ``outage`` hold, probed as evidence.follow_ups says."""
        self._held_since = self._clock.seconds()
        self._passed.clear()
        self._failed_follow_ups = {}
        now = self._clock.seconds()
        self._unvouched = pending.target is not None and not self._health.record and not self.probe_model
        self._outage_calls = follow_ups(
            pending.target, operator=self._operator_call(pending.target), known=self._health.record.calls(),
            failing=[ModelCall(f.path, f.name) for f in self._health.failing.others(None, now, SEVERAL_WITHIN)],
        )
        self._turn = 0
        what = _describe(pending.target)
        log.warn(
            "{upstream} is failing (a probe of {what} failed as well; probed as {why}): holding requests "
            "until it works again",
            upstream=self.upstream, what=what, why=pending.why,
        )
        self._state.hold(SOURCE, f"upstream failing ({what} fails)", scope=self.scope)

    def _decide_all(self, forgiven: bool) -> None:
        for pending in list(self._pending.values()):
            for waiter in _take(pending.waiters):
                waiter.deferred.callback(forgiven)

    def _run_check(self, call: ModelCall | None) -> Deferred:
        """One probe: a Deferred firing True (up), False (down), :data:`FAILED_ANSWER` (down: the call
        was answered with a failure), :data:`NOT_READY`, or None (cancelled); it never fails."""
        kind = "health" if call is None else "model"
        try:
            d = self._check(call)
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("outage watcher: the probe could not start")
            return succeed(False)

        def answered(up):
            if up == NOT_READY:
                self._metrics.outage_probes_total.labels(self.member, kind, NOT_READY).inc()
                return NOT_READY
            if up == FAILED_ANSWER:
                self._metrics.outage_probes_total.labels(self.member, kind, "down").inc()
                return FAILED_ANSWER
            up = bool(up)
            self._metrics.outage_probes_total.labels(self.member, kind, "up" if up else "down").inc()
            return up

        def failed(failure):
            if failure.check(CancelledError) and not self.running:
                return None
            self._metrics.outage_probes_total.labels(self.member, kind, "down").inc()
            log.debug("outage probe of {what} failed: {error}", what=_describe(call), error=failure.getErrorMessage())
            return False

        return d.addCallbacks(answered, failed)

    # -- while the outage hold lasts --------------------------------------------------------------

    def _answered(self) -> None:
        self._health.answered()
        if self._said_unreachable:
            self._said_unreachable = False
            log.info("{upstream} answers: outage detection is armed", upstream=self.upstream)

    def _step_calls(self) -> tuple[ModelCall | None, ...]:
        """The calls the next step probes at once: the next :data:`PROBES_PER_STEP` in turn."""
        calls = self._outage_calls or (None,)
        count = min(PROBES_PER_STEP, len(calls))
        return tuple(calls[(self._turn + i) % len(calls)] for i in range(count))

    def _schedule(self) -> None:
        """The next probe of the held outage, after the current interval; the interval then doubles."""
        if self._timer is not None or self._probe is not None or not self.running:
            return
        delay = self._next_interval
        self._next_interval = min(self.max_interval, self._next_interval * 2)
        self._timer = self._clock.callLater(delay, self._probe_step)

    def _probe_step(self) -> None:
        self._timer = None
        if not self._held():
            return  # ended from outside (POST /resume {"source": "outage"}): stop probing
        if self._unvouched and self._held_since is not None and (
            self._clock.seconds() - self._held_since >= UNVOUCHED_HOLD_SECONDS
        ):
            # Only models nobody vouches for failed (any client can make its own fail): the calls let out decide.
            self._end_hold("no model known to work confirms the outage", None)
            return
        targets = self._step_calls()
        if any(t is not None for t in targets) and any(
            h.source not in TROUBLE_SOURCES for h in self._state.holds_for(self.member)
        ):
            # The GPU is lent away: a model call would load the model onto it. Look again later.
            self._schedule()
            return
        self._checks = checks = [
            self._run_check(t).addCallback(lambda up, t: (up, t), t).addCallback(self._follow_up_ended) for t in targets
        ]
        d = self._probe = _first_pass(checks)
        d.addCallback(self._probed, len(targets))
        d.addErrback(lambda f: log.failure("outage watcher: handling a probe failed", f))

    def _follow_up_ended(self, result: tuple[Any, ModelCall | None]) -> tuple[Any, ModelCall | None]:
        """One follow-up probe ended: a model call that failed is kept, to be noted failing alone if another passes."""
        up, target = result
        if target is not None and up is not None and (not up or up == FAILED_ANSWER):
            self._failed_follow_ups[_key(target)] = target
        return result

    def _probed(self, result: tuple[bool | str | None, ModelCall | None], count: int) -> None:
        self._probe = None
        self._checks = []
        up, target = result
        if up is None:
            return
        if not up or up in (NOT_READY, FAILED_ANSWER):
            # The next calls in turn next time: models that stay broken cannot keep the hold.
            self._turn += count
            if self._held():
                self._schedule()
            return
        self._answered()
        self._end_hold(f"it serves {_describe(target)} again", target)

    def _end_hold(self, why: str, serving: ModelCall | None) -> None:
        """The upstream serves a model: the ``outage`` hold ends (its follow-up probes with it), and the models
        whose probes failed meanwhile fail alone (judged on the next failure by a model that works)."""
        failed, self._failed_follow_ups = self._failed_follow_ups, {}
        if not self._held():
            return
        if serving is not None:
            now = self._clock.seconds()
            for key, call in failed.items():
                if key != _key(serving):
                    self._health.failing.judged_alone(call, FAILED_ANSWER, _serves(serving), now)
        began = self._held_since if self._held_since is not None else self._clock.seconds()
        log.info(
            "{upstream}: {why} after {seconds:.1f}s: ending the outage hold",
            upstream=self.upstream, why=why, seconds=self._clock.seconds() - began,
        )
        self._held_since = None
        self._unvouched = False
        self._outage_calls = ()
        self._turn = 0
        cancel(self._timer)
        self._timer = None
        self._state.release(SOURCE, self.scope)


def _serves(target: ModelCall | None, when: str = "") -> str:
    """The evidence of a probe of ``target`` that passed, in words: "it serves all-minilm: a probe of /api/embed passed"."""
    if target is None:
        return f"its health path answered{when}"
    return f"it serves {target.model}: a probe of {target.path} passed{when}"


def _key(call: ModelCall | None) -> str | None:
    """A probe target's key for :attr:`OutageWatcher._passed`: its model's canonical name (None: the health path)."""
    return None if call is None else canonical_model(call.model)


def _describe(call: ModelCall | None) -> str:
    """A probe's target, for logs and /status."""
    if call is None:
        return "the health path"
    path = getattr(call, "path", None)
    model = getattr(call, "model", None)
    return f"{path} with model {model}" if path else str(call)


def _first_pass(checks: list[Deferred]) -> Deferred:
    """``(up, target)`` of the first of ``checks`` that passes, else of the last to end (each never fails)."""
    done: Deferred = Deferred()
    left = [len(checks)]

    def one(result):
        up, _ = result
        if done.called:
            return None
        left[0] -= 1
        if (up and up not in (NOT_READY, FAILED_ANSWER)) or left[0] == 0:
            done.callback(result)
        return None

    for check in checks:
        check.addCallback(one)
    return done


def _take(waiters: list) -> list:
    """Empty ``waiters`` and return what it held (waiters fired must not be fired again)."""
    taken = list(waiters)
    waiters.clear()
    return taken


def _forget(waiters: list[_Waiter], deferred: Deferred) -> None:
    """Canceller of a verdict: the caller stopped waiting (its client went away)."""
    waiters[:] = [w for w in waiters if w.deferred is not deferred]
