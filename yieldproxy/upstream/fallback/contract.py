"""The ``[fallback]``'s own part: its contract over the one verifier, and its counts.

The fallback is served as a standby pool member (upstream/pool/members.py
``fallback_member``), verified by the twin verifier (upstream/pool/twins.py)
under the fallback's terms (:func:`fallback_contract`).  What stays here is
what only ``[fallback]`` promises (docs/fallback.md): ``POST /fallback/verify``,
``/status`` ``fallback``, its metrics, and ``yieldproxy_fallback_total``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ...clock import same
from ...config import FallbackConfig
from ...lot.parking import Entry
from ...observe.metrics import Metrics, fallback_families
from ..pool.contract import Contract, Embedder, Terms
from ..pool.members import FALLBACK_MEMBER
from ..pool.twins import RETRY_AFTER_ERROR_SECONDS, TwinVerifier
from ..vectors import Verification

log = Logger()


class NotNow(Exception):
    """Verification needs the primary, and the GPU is yielded."""


def fallback_contract(
    config: FallbackConfig, reference: str, primary: Embedder, backend: Embedder, may_run: Callable[[], bool],
) -> Contract:
    """The fallback's terms for the twin verifier: member ``fallback`` against ``reference`` (the primary)
    for each mapped model, through the two sides' embedding clients, only while ``may_run``."""
    terms = Terms(
        tuple(config.probe_texts), config.min_cosine, config.verify_interval_seconds,
        config.max_verification_age_seconds,
    )
    return Contract(FALLBACK_MEMBER, reference, dict(config.models), terms, (primary, backend), may_run)


@attrs.define(eq=False, slots=False)
class Fallback(Service):
    """The contract of the ``fallback`` member over the twin verifier, and its counts.

    ``service.build_heart`` wires it: :meth:`arrived` is the scheduler's
    ``on_arrival``, :meth:`attempt_ended` the proxy's ``on_attempt``,
    :meth:`left_lot` a listener of the lot, and :meth:`state_changed` an
    observer of the yield state.  Starting it starts the verifier.
    """

    _clock: IReactorTime
    _config: FallbackConfig
    #: The one verifier of "same vectors"; its contract is this fallback's.
    _verifier: TwinVerifier
    _metrics: Metrics
    #: True while the GPU is yielded (the scheduler's view).
    _yielded: Callable[[], bool]
    #: Each class's policy; only ``fallback`` classes are served by it.
    _policies: Mapping[str, str]
    #: Requests at the fallback member now.
    _inflight: Callable[[], int] = lambda: 0
    #: The last "not used because ..." logged per model, so a yield logs it once.
    _skip_logged: dict[str, str] = attrs.Factory(dict)
    #: Parked requests in line for the fallback: it may serve them, and has not taken them yet.
    _in_line: set[Entry] = attrs.field(init=False, factory=set)

    name = "fallback"  # type: ignore[assignment]  # Twisted types Service.name as None

    @property
    def _contract(self) -> Contract:
        contract = self._verifier.contract
        assert contract is not None
        return contract

    @property
    def verifications(self) -> dict[str, Verification]:
        """The last verification of each mapped model, by its primary name."""
        return self._contract.verifications

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
        return self._contract.mapped(model)

    def usable(self, model: str) -> bool:
        """:meth:`why_not` is None, without building the sentence (the drainer asks per kind of entry)."""
        return self._contract.usable(model, self._clock.seconds())

    def why_not(self, model: str) -> str | None:
        """Why the fallback may not serve ``model`` now (a mapped primary name), or None if it may."""
        v = self.verifications.get(model)
        if v is None:
            return "never verified" + (" (a verification is running)" if self._contract.running else "")
        if not v.ok:
            return f"last verification failed: {v.reason}"
        age = self._clock.seconds() - v.at
        if age > self._config.max_verification_age_seconds:
            return (
                f"last verification is {age:.0f}s old, more than "
                f"fallback.max_verification_age_seconds ({self._config.max_verification_age_seconds:g})"
            )
        return None

    # -- what became of each request it might have served ----------------------------

    def _applies(self, entry: Entry) -> bool:
        """A request of a class the fallback serves, arriving during a yield."""
        cls = entry.cls
        return self._yielded() and self._policies.get(cls) == "fallback" and cls in self._config.classes

    def arrived(self, entry: Entry, went_to: str | None, refused: str | None) -> None:
        """The scheduler admitted a new request (to ``went_to`` at once, or it parked) or refused it.

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
            self._count(cls, "skipped_busy")  # the scheduler refused it at once
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

    # -- verification (the twin verifier's) ---------------------------------------------------

    def verify(self) -> Deferred:
        """Verify every mapped model now; fires with ``{model: Verification}``.

        Raises :class:`NotNow` while the GPU is yielded.  A call while a
        verification runs waits for that one instead of starting another.
        """
        if not self._contract.running and self._yielded():
            raise NotNow("the GPU is yielded; verification needs the primary and runs once it is back")
        return self._verifier.verify_contract()

    def startService(self) -> None:
        """Verify now, then every ``verify_interval_seconds`` (the verifier's timer)."""
        super().startService()
        if not self._verifier.running:
            self._verifier.startService()

    def stopService(self) -> None:
        """Stop verifying."""
        super().stopService()
        if self._verifier.running:
            self._verifier.stopService()

    def state_changed(self, yielded: bool) -> None:
        """The yield state moved: a due verification runs once the GPU is back."""
        self._skip_logged.clear()
        if not yielded:
            self._verifier.wake()

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
            "url": self._contract.sides[1].url,
            "api": self._contract.sides[1].api,
            "classes": list(self._config.classes),
            "inflight": self.inflight,
            "waiting": self.waiting,
            "concurrency": self._config.concurrency,
            "verifying": self._contract.running,
            "verification_due": self._contract.postponed,
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


__all__ = ["RETRY_AFTER_ERROR_SECONDS", "Fallback", "NotNow", "fallback_contract"]
