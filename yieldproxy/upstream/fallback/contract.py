"""The ``[fallback]``'s own part: its verification on a timer, and its contract's counts.

The fallback is served as a pool member (upstream/pool/members.py ``fallback_member``:
a standby member that answers mapped embeddings translated, at most
``fallback.concurrency`` at once, drained from the one lot like any member).
What stays here is what only ``[fallback]`` promises (docs/fallback.md):
its verification against the primary (the pool's twin check for that member,
:meth:`Fallback.twin_ok`), ``POST /fallback/verify`` and ``/status``
``fallback``, and ``yieldproxy_fallback_total`` by what became of each
request of a ``fallback`` class arriving during a yield.
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ...clock import same
from ...config import FallbackConfig
from ...lot.parking import Entry
from ...names import canonical_model
from ...observe.metrics import Metrics, fallback_families
from ..pool.members import FALLBACK_MEMBER
from ..translation import BackendError, EmbedRequest
from ..vectors import Verification, compare
from .backend import EmbedBackend

log = Logger()

#: After a verification that could not run (a side unreachable, an error
#: answer), try again this soon rather than a whole interval later.
RETRY_AFTER_ERROR_SECONDS = 60.0


class NotNow(Exception):
    """Verification needs the primary, and the GPU is yielded."""


@attrs.define(eq=False, slots=False)
class Fallback(Service):
    """Verification on a timer while the service runs; the twin check and the counts of the ``fallback`` member.

    ``service.build`` wires it: :meth:`twin_ok` is the pool's twin check,
    :meth:`arrived` the gate's ``on_arrival``, :meth:`attempt_ended` the
    proxy's ``on_attempt``, :meth:`left_lot` a listener of the lot, and
    :meth:`state_changed` an observer of the yield state.
    """

    _clock: IReactorTime
    _config: FallbackConfig
    _primary: EmbedBackend
    _backend: EmbedBackend
    _metrics: Metrics
    #: True while the GPU is yielded (the gate's view).
    _yielded: Callable[[], bool]
    #: Each class's policy; only ``fallback`` classes are served by it.
    _policies: Mapping[str, str]
    #: Requests at the fallback member now.
    _inflight: Callable[[], int] = lambda: 0
    #: Called when a verification ends (the pool's drainers look again at what is parked).
    _on_verified: Callable[[], None] = lambda: None
    #: The last verification of each mapped model, by its primary name.
    verifications: dict[str, Verification] = attrs.Factory(dict)
    _verifying: Deferred | None = None
    _waiters: list[Deferred] = attrs.Factory(list)
    _timer: IDelayedCall | None = None
    #: A verification came due while the GPU was yielded: run it when it is back.
    _due: bool = False
    #: The last "not used because ..." logged per model, so a yield logs it once.
    _skip_logged: dict[str, str] = attrs.Factory(dict)
    _keys: dict[str, str] = attrs.field(init=False)
    #: Parked requests in line for the fallback: it may serve them, and has not taken them yet.
    _in_line: set[Entry] = attrs.field(init=False, factory=set)

    name = "fallback"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._keys = {canonical_model(name): name for name in self._config.models}

    @property
    def inflight(self) -> int:
        """Requests at the fallback now (taken at arrival or from the lot)."""
        return self._inflight()

    @property
    def waiting(self) -> int:
        """Parked requests in line for the fallback (it may serve them, it has not taken them yet)."""
        return len(self._in_line)

    # -- may it be used? ------------------------------------------------------

    def mapped(self, model: str) -> str | None:
        """The primary model name under which ``model`` is mapped, or None."""
        if model in self._config.models:
            return model
        return self._keys.get(canonical_model(model))

    def usable(self, model: str) -> bool:
        """:meth:`why_not` is None, without building the sentence (the drainer asks per kind of entry)."""
        v = self.verifications.get(model)
        return v is not None and v.ok and self._clock.seconds() - v.at <= self._config.max_verification_age_seconds

    def why_not(self, model: str) -> str | None:
        """Why the fallback may not serve ``model`` now (a mapped primary name), or None if it may."""
        v = self.verifications.get(model)
        if v is None:
            return "never verified" + (" (a verification is running)" if self._verifying else "")
        if not v.ok:
            return f"last verification failed: {v.reason}"
        age = self._clock.seconds() - v.at
        if age > self._config.max_verification_age_seconds:
            return (
                f"last verification is {age:.0f}s old, more than "
                f"fallback.max_verification_age_seconds ({self._config.max_verification_age_seconds:g})"
            )
        return None

    def twin_ok(self, member, entry: Entry) -> bool:
        """The pool's twin check: the ``fallback`` member serves a request only for a mapped model
        whose verification holds now; every other member serves what it is eligible for."""
        if member.name != FALLBACK_MEMBER:
            return True
        model = self.mapped(entry.model) if entry.model else None
        return model is not None and self.usable(model)

    # -- what became of each request it might have served ----------------------------

    def _applies(self, entry: Entry) -> bool:
        """A request of a class the fallback serves, arriving during a yield."""
        cls = entry.cls
        return self._yielded() and self._policies.get(cls) == "fallback" and cls in self._config.classes

    def arrived(self, entry: Entry, went_to: str | None, refused: str | None) -> None:
        """The gate admitted a new request (to ``went_to`` at once, or it parked) or refused it.

        One the fallback did not take at once is counted by why: it cannot
        serve it (``skipped_unsupported``), its model is not verified
        (``skipped_unverified``), or the lot refused it (``skipped_busy``);
        else it waits in line for the fallback (counted when it leaves).
        """
        if went_to == FALLBACK_MEMBER or not self._applies(entry):
            return
        cls = entry.cls
        if FALLBACK_MEMBER not in entry.eligible:
            self._skip(
                cls, "skipped_unsupported", None,
                f"model {entry.model!r} is not in fallback.models, or the request is not an embedding "
                "the fallback can serve with the same meaning",
            )
            return
        model = self.mapped(entry.model or "")
        assert model is not None  # eligible: its model is mapped
        why = self.why_not(model)
        if why is not None:
            self._skip(cls, "skipped_unverified", model, why)
        elif refused is not None:
            self._count(cls, "skipped_busy")  # the gate refused it at once
        elif went_to is None:
            self._in_line.add(entry)

    def left_lot(self, entry: Entry) -> None:
        """A parked request left the lot: one in line for the fallback that another member took
        (the GPU came back), that expired, whose client left or that the stop answered was not
        served for a reason: its model's verification had gone stale, or no slot came in time."""
        if entry not in self._in_line:
            return
        self._in_line.discard(entry)
        if entry.released_to == FALLBACK_MEMBER:
            return  # its attempt counts it
        model = self.mapped(entry.model or "")
        self._count(entry.cls, "skipped_busy" if model is not None and self.usable(model) else "skipped_unverified")

    def attempt_ended(self, member, entry: Entry, outcome: str) -> None:
        """An attempt on a member ended (``ProxyApp``'s ``on_attempt``): the fallback's are counted."""
        if member.name != FALLBACK_MEMBER:
            return
        if outcome == "ok":
            self._count(entry.cls, "ok")
        elif outcome in ("abandoned", "slow_client"):
            self._count(entry.cls, "abandoned")
        else:
            log.warn(
                "fallback failed for a {cls} request ({model}), parking it for the primary: {outcome}",
                cls=entry.cls, model=entry.model, outcome=outcome,
            )
            self._count(entry.cls, "failed_parked")

    def _count(self, cls: str, outcome: str) -> None:
        self._metrics.fallback_total.labels(cls, outcome).inc()

    def _skip(self, cls: str, outcome: str, model: str | None, why: str) -> None:
        """Count a request that parks instead; log why once per model and reason per yield."""
        self._count(cls, outcome)
        key = model or "*"
        if self._skip_logged.get(key) == why:
            return
        self._skip_logged[key] = why
        if model is None:
            log.info("fallback not used for a {cls} request, parking it: {why}", cls=cls, why=why)
        else:
            log.warn("fallback not used for {model}, requests park instead: {why}", model=model, why=why)

    # -- verification ---------------------------------------------------------------------

    def verify(self) -> Deferred:
        """Verify every mapped model now; fires with ``{model: Verification}``.

        Raises :class:`NotNow` while the GPU is yielded.  A call while a
        verification runs waits for that one instead of starting another.
        """
        if self._verifying is None and self._yielded():
            raise NotNow("the GPU is yielded; verification needs the primary and runs once it is back")
        waiter: Deferred = Deferred()
        self._waiters.append(waiter)  # before the run starts: it may end at once
        if self._verifying is None:
            running = Deferred.fromCoroutine(self._verify_all())
            if not running.called:  # still running: later callers share it, stopService() cancels it
                self._verifying = running
            running.addBoth(self._verified)
        return waiter

    def _verified(self, result):
        """Hand the one verification's result to everyone who asked for it."""
        self._verifying = None
        self._on_verified()  # a model may have become usable for requests in line
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if waiter.called:  # its caller gave up (cancelled)
                continue
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)
        return None

    async def _verify_all(self) -> dict[str, Verification]:
        results = {}
        for model, fallback_model in self._config.models.items():
            try:
                v = await self._verify_one(model, fallback_model)
            except NotNow:
                log.info("fallback verification stopped: the GPU was yielded; it runs again once it is back")
                self._due = True
                break
            self.verifications[model] = v
            results[model] = v
            self._skip_logged.pop(model, None)
            if v.ok:
                log.info(
                    "fallback verified for {model} (as {fallback_model} on {url}): "
                    "worst cosine {worst:.6f} over {n} texts",
                    model=model, fallback_model=fallback_model, url=self._backend.url,
                    worst=v.worst_cosine, n=len(v.rows),
                )
            else:
                log.warn(
                    "fallback NOT verified for {model} (as {fallback_model} on {url}), "
                    "its requests will park instead: {reason}",
                    model=model, fallback_model=fallback_model, url=self._backend.url, reason=v.reason,
                )
        return results

    async def _verify_one(self, model: str, fallback_model: str) -> Verification:
        texts = tuple(self._config.probe_texts)
        probe = EmbedRequest("embed", model, texts)
        now = self._clock.seconds
        if self._yielded():
            raise NotNow()
        try:
            primary = await self._primary.embed(probe, model)
        except BackendError as e:
            return Verification(model, fallback_model, False, now(), reason=f"primary: {e.detail}")
        try:
            fallback = await self._backend.embed(probe, fallback_model)
        except BackendError as e:
            return Verification(model, fallback_model, False, now(), reason=f"fallback: {e.detail}")
        return compare(
            model, fallback_model, texts, primary.vectors, fallback.vectors, self._config.min_cosine, now()
        )

    # -- the timer ----------------------------------------------------------------------------
    # A callLater chain, not a fixed loop (periodic.py): its delay varies, sooner after an
    # error, at once when the GPU comes back with a verification due.

    def startService(self) -> None:
        """Verify now, then every ``verify_interval_seconds``."""
        super().startService()
        self._schedule(0)

    def stopService(self) -> None:
        """Stop verifying."""
        super().stopService()
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._verifying is not None:
            self._verifying.cancel()

    def state_changed(self, yielded: bool) -> None:
        """The yield state moved: a due verification runs once the GPU is back."""
        self._skip_logged.clear()
        if not yielded and self._due and self.running:
            self._schedule(0)

    def _schedule(self, delay: float) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = self._clock.callLater(delay, self._tick)

    def _tick(self) -> None:
        """One periodic step; wrapped, so one exception cannot end the loop."""
        self._timer = None
        if not self.running:
            return
        if self._yielded():
            self._due = True
            self._schedule(self._config.verify_interval_seconds)
            return
        self._due = False
        d = self.verify()

        def next_run(results):
            # No rows: a side did not answer (not a mismatch), so try again sooner.
            errored = any(not v.ok and not v.rows for v in results.values())
            interval = self._config.verify_interval_seconds
            if self.running and self._timer is None:
                self._schedule(min(interval, RETRY_AFTER_ERROR_SECONDS) if errored else interval)

        def failed(failure):
            if not failure.check(CancelledError):
                log.failure("fallback verification failed unexpectedly", failure)
            if self.running and self._timer is None:
                self._schedule(min(self._config.verify_interval_seconds, RETRY_AFTER_ERROR_SECONDS))

        d.addCallbacks(next_run, failed)

    # -- reports -------------------------------------------------------------------------------

    def status(self, shown: Callable[[float], float] = same) -> dict:
        """The ``fallback`` entry of ``/status``: for each model, may it be used, and if not, why (times given
        to ``shown``)."""
        now = self._clock.seconds()
        models = {}
        for model, fallback_model in self._config.models.items():
            why = self.why_not(model)
            v = self.verifications.get(model)
            models[model] = {
                "fallback_model": fallback_model,
                "usable": why is None,
                "why_not": why,
                "verification": None if v is None else v.as_json(now, shown),
            }
        return {
            "enabled": True,
            "url": self._backend.url,
            "api": self._backend.api,
            "classes": list(self._config.classes),
            "inflight": self.inflight,
            "waiting": self.waiting,
            "concurrency": self._config.concurrency,
            "verifying": self._verifying is not None,
            "verification_due": self._due,
            "min_cosine": self._config.min_cosine,
            "max_verification_age_seconds": self._config.max_verification_age_seconds,
            "models": models,
        }

    def metric_families(self):
        """``yieldproxy_fallback_verified`` and ``_min_cosine``, computed at scrape time (age counts)."""
        rows = []
        for model in self._config.models:
            v = self.verifications.get(model)
            rows.append((model, self.why_not(model) is None, None if v is None else v.worst_cosine))
        return fallback_families(rows)


# -- yieldproxy check-fallback ------------------------------------------------------------------
