"""The fallback as a service: verification on a timer, and serving verified models during a yield."""

from __future__ import annotations

import collections
import functools
from typing import Callable, Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..config import FallbackConfig
from ..metrics import Metrics, fallback_families
from ..names import canonical_model
from ..parking import Entry, ParkingLot, Refused
from ..replay import Replayer
from ..translate import BackendError, EmbedRequest, Untranslatable, client_response, parse_request
from ..vectors import Verification, compare
from .backend import EmbedBackend

log = Logger()

#: The fallback's name as a drain target (``Entry.offers``, ``Entry.released_to``).
TARGET = "fallback"
#: After a verification that could not run (a side unreachable, an error
#: answer), try again this soon rather than a whole interval later.
RETRY_AFTER_ERROR_SECONDS = 60.0


class NotNow(Exception):
    """Verification needs the primary, and the GPU is yielded."""


@attrs.define(eq=False, slots=False)
class Fallback(Service):
    """Verification on a timer while the service runs, and the use of a verified fallback during a yield.

    It serves a request at its arrival when a slot is free and nobody is in
    line, else from the lot through its own drainer as slots free; the lot's
    entries it may serve carry its offer (``entry.offers[TARGET]``: the
    mapped model).
    """

    _clock: IReactorTime
    _config: FallbackConfig
    _primary: EmbedBackend
    _backend: EmbedBackend
    _metrics: Metrics
    #: True while the GPU is yielded (the gate's view).
    _yielded: Callable[[], bool]
    #: Each class's policy; only ``fallback`` classes are served here.
    _policies: Mapping[str, str]
    #: The lot it serves parked requests from, and what builds its drainer
    #: there: a :class:`Replayer` capped at ``fallback.concurrency``, given
    #: ``target``, ``accepts`` and ``is_open`` (:func:`fallback_drainer`).
    #: Without them it only verifies (``check``).
    _lot: ParkingLot | None = None
    _new_drainer: Callable[..., Replayer] | None = None
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
    _drainer: Replayer | None = attrs.field(init=False, default=None)
    #: Parked requests in line for the fallback, by mapped model.
    _in_line: collections.Counter = attrs.field(init=False, factory=collections.Counter)

    name = "fallback"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._keys = {canonical_model(name): name for name in self._config.models}
        if self._lot is not None and self._new_drainer is not None:
            self._drainer = self._new_drainer(target=TARGET, accepts=self.may_take, is_open=self._takes_work)
            self._lot.when_parked(self._drainer.kick)
            self._lot.when_out(self._left_lot)

    @property
    def inflight(self) -> int:
        """Requests at the fallback now (taken at arrival or from the lot)."""
        return self._drainer.inflight if self._drainer is not None else 0

    def when_idle(self) -> Deferred:
        """A Deferred that fires once no request is at the fallback (at once if none is)."""
        return self._drainer.when_idle() if self._drainer is not None else succeed(None)

    @property
    def waiting(self) -> int:
        """Parked requests in line for the fallback (offered to it, not yet taken)."""
        return sum(self._in_line.values())

    def may_take(self, entry: Entry) -> bool:
        """The drainer's choice: a parked request in line for the fallback whose model is still verified."""
        model = (entry.offers or {}).get(TARGET)
        return model is not None and self.usable(model)

    def _takes_work(self) -> bool:
        """Open while the GPU is yielded and some request in line has a usable model.

        The second half is cheap and spares the drainer a walk through the
        lot when nothing there is for it (every arrival wakes it).
        """
        return self._yielded() and any(n and self.usable(model) for model, n in self._in_line.items())

    # -- may it be used? ------------------------------------------------------

    def mapped(self, model: str) -> str | None:
        """The primary model name under which ``model`` is mapped, or None."""
        if model in self._config.models:
            return model
        return self._keys.get(canonical_model(model))

    def usable(self, model: str) -> bool:
        """:meth:`why_not` is None, without building the sentence (the drainer asks per parked entry)."""
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

    # -- serving ----------------------------------------------------------------------

    async def serve(self, request, entry: Entry, body: bytes) -> bool:
        """At arrival: answer ``request`` from the fallback, if it may; False means "admit it as usual".

        Only during a yield, for a class whose policy is ``fallback``, an
        embedding request for a mapped and verified model.  With a slot free
        and nobody in line for the fallback it is served at once.  Otherwise
        it is offered to the fallback (``entry.offers``) and parks in line:
        the fallback's drainer lets it out when its turn comes, and the
        request comes to :meth:`serve_released`.  A failure here returns
        False before anything is written; the request then parks for the
        primary, which answers it when the GPU is back.
        """
        if self._drainer is None:
            return False
        wanted = self._may_offer(request, entry, body)
        if wanted is None:
            return False
        model = self.mapped(wanted.model)
        assert model is not None and self._drainer is not None and self._lot is not None  # _may_offer said so
        if self._drainer.draining or not self._drainer.can_start():
            # Busy, pausing after failures, or others are in line: take its place in the line.
            try:
                self._lot.check_room(entry)
            except Refused:
                self._count(entry.cls, "skipped_busy")  # the gate refuses it at once
                return False
            entry.offers = {**(entry.offers or {}), TARGET: model}
            self._in_line[model] += 1
            return False
        self._drainer.started()
        return await self._answer(request, entry, model, wanted)

    async def serve_released(self, request, entry: Entry, body: bytes) -> bool:
        """A parked request the fallback's drainer let out: answer it; False puts it back in its place.

        The drainer took its slot as it let it out.  After a failure the
        request waits for the primary: it is not offered to the fallback
        again (a request the fallback cannot answer must not keep the line).
        """
        assert entry.offers is not None  # it was let out as an offer to the fallback
        model = entry.offers.pop(TARGET)
        self._in_line[model] -= 1
        # Read again as at arrival: the offer keeps no copy of the body (parked_bytes holds).
        wanted = parse_request(request.path.decode("latin-1"), body)
        return await self._answer(request, entry, model, wanted)

    def _may_offer(self, request, entry: Entry, body: bytes) -> EmbedRequest | None:
        """The request, read, if the fallback may serve it in this yield; else count why not."""
        cls = entry.cls
        if (
            not self._yielded()
            or self._policies.get(cls) != "fallback"
            or cls not in self._config.classes
        ):
            return None
        path = request.path.decode("latin-1")
        try:
            wanted = parse_request(path, body)
        except Untranslatable as e:
            self._skip(cls, "skipped_unsupported", None, str(e))
            return None
        model = self.mapped(wanted.model)
        if model is None:
            self._skip(cls, "skipped_unsupported", None, f"model {wanted.model!r} is not in fallback.models")
            return None
        why = self.why_not(model)
        if why is not None:
            self._skip(cls, "skipped_unverified", model, why)
            return None
        return wanted

    async def _answer(self, request, entry: Entry, model: str, wanted: EmbedRequest) -> bool:
        """Send one request to the fallback in a slot already taken; write the answer, or return False."""
        cls = entry.cls
        began = self._clock.seconds()
        drainer = self._drainer
        assert drainer is not None  # a fallback that serves has its drainer
        try:
            result = await self._backend.embed(wanted, self._config.models[model])
        except CancelledError:
            drainer.finished(abandoned=True)
            self._count(cls, "abandoned")
            raise
        except Exception as e:
            drainer.finished(failed=True, started=began)
            detail = e.detail if isinstance(e, BackendError) else repr(e)
            log.warn(
                "fallback failed for a {cls} request ({model}), parking it for the primary: {detail}",
                cls=cls, model=model, detail=detail,
            )
            self._count(cls, "failed_parked")
            return False
        drainer.finished(started=began)
        answer = client_response(wanted, result, self._clock.seconds() - began)
        request.setResponseCode(200)
        headers = request.responseHeaders
        headers.setRawHeaders(b"content-type", [b"application/json; charset=utf-8"])
        headers.setRawHeaders(b"content-length", [b"%d" % len(answer)])
        headers.setRawHeaders(b"x-yield-served-by", [b"fallback"])
        headers.setRawHeaders(b"x-yield-fallback-model", [self._config.models[model].encode("utf-8")])
        if entry.was_parked:
            headers.setRawHeaders(b"x-yield-parked-seconds", [b"%.3f" % entry.parked_seconds])
        request.write(answer)
        self._count(cls, "ok")
        return True

    def _left_lot(self, entry: Entry) -> None:
        """A request in line for the fallback left the lot another way: it was not served for a reason.

        (The GPU came back and the primary took it, it expired, its client
        left, the proxy stopped.)  Counted as why: the model's verification
        had gone stale, or no slot came in time.
        """
        if entry.released_to == TARGET:
            return
        model = (entry.offers or {}).pop(TARGET, None)
        if model is not None:
            self._in_line[model] -= 1
            self._count(entry.cls, "skipped_busy" if self.usable(model) else "skipped_unverified")

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
        if self._drainer is not None:
            self._drainer.kick()  # a model may have become usable for requests in line
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
        """Stop verifying and taking requests from the lot (the proxy's drain is over by then)."""
        super().stopService()
        if self._drainer is not None:
            self._drainer.stop()
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._verifying is not None:
            self._verifying.cancel()

    def state_changed(self, yielded: bool) -> None:
        """The yield state moved: the drainer opens or closes; a due verification runs once the GPU is back."""
        self._skip_logged.clear()
        if self._drainer is not None:
            self._drainer.kick()
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

    def status(self) -> dict:
        """The ``fallback`` entry of ``/status``: for each model, may it be used, and if not, why."""
        now = self._clock.seconds()
        models = {}
        for model, fallback_model in self._config.models.items():
            why = self.why_not(model)
            v = self.verifications.get(model)
            models[model] = {
                "fallback_model": fallback_model,
                "usable": why is None,
                "why_not": why,
                "verification": None if v is None else v.as_json(now),
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


def fallback_drainer(
    reactor, config, metrics: Metrics, state, lot: ParkingLot, cooperator
) -> Callable[..., Replayer]:
    """What builds the fallback's drainer on ``lot``: the requests in line for it, as its slots free.

    Capped at ``fallback.concurrency``, it pauses after failures as the
    primary's replayer does; the :class:`Fallback` gives it its ``target``,
    its choice of entries (``accepts``) and when it is open (``is_open``).
    """
    return functools.partial(
        Replayer, reactor, lot, state, metrics, cooperator,
        concurrency=config.fallback.concurrency,
        backoff_seconds=config.upstream.retry_backoff_seconds,
        backoff_max_seconds=config.upstream.retry_backoff_max_seconds,
    )


# -- yieldproxy check-fallback ------------------------------------------------------------------
