"""Twin verification: which members may serve a model's embeddings besides its reference.

Two copies of "the same" embedding model do not always give the same vectors, and
vectors from another model poison a vector store without any error.  So a pool's
embedding request for a model goes only to its *reference* or to a *twin* whose vectors
:class:`TwinVerifier` found equal to the reference's (yieldproxy/upstream/vectors.py),
recently, while both were available.  It is the one verifier of "same vectors": the
``[fallback]``'s pairs are a :class:`~.contract.Contract` it is given, run in the same pass.
Which member is the reference, which models, when and how: docs/pool.md, "Embeddings and twins".
"""

from __future__ import annotations

import collections
import json
from typing import Callable, Sequence

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from ...clock import cancel, same
from ...config import VerificationConfig
from ...lot.parking import Entry
from ...names import canonical_model
from ..control import backend_errors
from ..translation import (
    BackendError,
    EmbedRequest,
    Embeddings,
    backend_request,
    parse_response,
)
from ..vectors import Verification, compare
from ..verdict import Reason
from .contract import Contract
from .member import Member
from .routing import reference_rank

log = Logger()

#: ``yieldproxy_twin_verifications_total`` results.
RESULTS = ("ok", "mismatch", "error")
#: What ``/status`` says of a (member, model) pair.
TWIN_STATES = ("reference", "verified", "mismatch", "error", "stale", "unverified")
#: After a verification that could not run (a side's error or timeout), try again this soon.
RETRY_AFTER_ERROR_SECONDS = 60.0
#: While a pair waits for both sides to be available, look again this often (no request is sent).
POSTPONED_RECHECK_SECONDS = 5.0
#: At most this many models are verified (a pattern like ``*`` would let requests name any number).
MAX_MODELS = 256
#: Answers with the probe texts' vectors may be large (10 texts of 4096 floats are about 1 MB).
MAX_ANSWER_BYTES = 32 * 1024 * 1024


class Postponed(Exception):
    """A side of a verification became unavailable between its calls: the pair waits, no call is sent."""


@attrs.frozen
class TwinCheck:
    """The last verification of one twin for one model."""

    reference: str
    result: str
    at: float
    worst_cosine: float | None = None
    dimension: int | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.result == "ok"


@attrs.define(eq=False, slots=False)
class TwinVerifier(Service):
    """Verifies every twin of every known embedding model, on a timer; :meth:`twin_ok` is the pool's check."""

    _clock: IReactorTime
    _members: Sequence[Member]
    _config: VerificationConfig
    #: Pairs given with terms of their own (the ``[fallback]``'s, the one-upstream form: it meets no
    #: found twins in one config), verified in the same pass.
    contract: Contract | None = None
    #: Find the pool's own pairs (a pool of several upstreams); False: only the contract's.
    _find_twins: bool = True
    #: Told when a pair becomes verified (:meth:`when_verified`: the scheduler's drainers look again).
    _verified_listeners: list[Callable[[], None]] = attrs.Factory(list)
    #: The last verification of each pair, by (member name, canonical model).
    checks: dict[tuple[str, str], TwinCheck] = attrs.field(init=False, factory=dict)
    #: The models verified: canonical name -> the name first seen.
    _models: dict[str, str] = attrs.field(init=False, factory=dict)
    #: When each pair is next due (absent: now).
    _due_at: dict[tuple[str, str], float] = attrs.field(init=False, factory=dict)
    #: Each model's reference by canonical name (None: no member is known to serve it); dropped on list changes.
    _references: dict[str, str | None] = attrs.field(init=False, factory=dict)
    #: Models named by requests with fewer than two members serving them (nothing to verify).
    _untwinned: set[str] = attrs.field(init=False, factory=set)
    _canonical: dict[str, str] = attrs.field(init=False, factory=dict)
    _counts: collections.Counter = attrs.field(init=False, factory=collections.Counter)
    _timer: IDelayedCall | None = attrs.field(init=False, default=None)
    _verifying: Deferred | None = attrs.field(init=False, default=None)
    _again: bool = attrs.field(init=False, default=False)
    _postponed: bool = attrs.field(init=False, default=False)
    _full_logged: bool = attrs.field(init=False, default=False)
    #: The models verified because the config names them (``verification.models``, ``model_map``): never dropped.
    _pinned: set[str] = attrs.field(init=False, factory=set)
    _by_name: dict[str, Member] = attrs.field(init=False)

    name = "twins"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._by_name = {m.name: m for m in self._members}
        if not self._find_twins:
            return
        for model in self._config.models:
            self._models.setdefault(self._key(model), model)
        for member in self._members:
            for model in member.catalogue.model_map:
                self._models.setdefault(self._key(model), model)
        self._pinned = set(self._models)

    # -- the pool's check ----------------------------------------------------------------

    def when_verified(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when a pair becomes verified (a model may have become usable for requests in line)."""
        self._verified_listeners.append(listener)

    def _tell_verified(self) -> None:
        for listener in self._verified_listeners:
            listener()

    def twin_ok(self, member: Member, entry: Entry) -> bool:
        """May ``member`` serve ``entry`` now: anything but an embedding, or the model's reference or a fresh twin
        (the contract's twin: only a model it maps whose verification holds)."""
        contract = self.contract
        if contract is not None and member.name == contract.twin:
            mapped = contract.mapped(entry.model) if entry.model else None
            return mapped is not None and contract.usable(mapped, self._clock.seconds())
        if entry.kind != "embedding" or not self._find_twins:
            return True
        model = entry.model
        if not model:
            return bool(entry.eligible) and member.name == entry.eligible[0]
        key = self._key(model)
        reference = self._reference(key, model)
        if reference is None:
            # No member is known to serve it (lists not read yet): the first eligible one answers alone.
            return bool(entry.eligible) and member.name == entry.eligible[0]
        if member.name == reference:
            return True
        check = self.checks.get((member.name, key))
        if (
            check is not None and check.result == "ok" and check.reference == reference
            and self._clock.seconds() - check.at <= self._config.max_verification_age_seconds
        ):
            return True
        if key not in self._models:
            self._track(key, model)
        return False

    def _key(self, model: str) -> str:
        """The canonical name (``all-minilm`` is ``all-minilm:latest``), remembered: the check runs per choice."""
        key = self._canonical.get(model)
        if key is None:
            if len(self._canonical) >= 4 * MAX_MODELS:
                self._canonical.clear()
            key = self._canonical[model] = canonical_model(model)
        return key

    def _reference(self, key: str, model: str) -> str | None:
        """The first member serving ``model`` of the lowest :func:`reference_rank` (config order), or None."""
        if key in self._references:
            return self._references[key]
        ranked = sorted(self._members, key=lambda m: reference_rank(m.spec.api))  # stable: config order
        found = next((m.name for m in ranked if m.catalogue.serves(model)), None)
        if len(self._references) >= 4 * MAX_MODELS:
            self._references.clear()
        self._references[key] = found
        return found

    def _twins(self, key: str, model: str) -> list[Member]:
        """The members serving ``model`` other than its reference and the contract's twin, in config order."""
        reference = self._reference(key, model)
        if reference is None:
            return []
        given = self.contract.twin if self.contract is not None else None
        return [m for m in self._members if m.name not in (reference, given) and m.catalogue.serves(model)]

    def _track(self, key: str, model: str) -> None:
        """An embedding request named ``model`` for a twin: verify its twins from now on."""
        if key in self._untwinned:
            return
        if not self._twins(key, model):
            if len(self._untwinned) >= 4 * MAX_MODELS:
                self._untwinned.clear()
            self._untwinned.add(key)
            return
        if len(self._models) >= MAX_MODELS and not self._forget_oldest_named():
            if not self._full_logged:
                self._full_logged = True
                log.warn(
                    "twin verification: {n} models are verified already; the twins of {model} are not "
                    "verified, so its embeddings go to its reference only",
                    n=len(self._models), model=model,
                )
            return
        self._models[key] = model
        self._soon()

    def _forget_oldest_named(self) -> bool:
        """Make room: forget the model requests named first (names from requests are anyone's to
        invent; one still in use is tracked again at its next request). False: all are configured."""
        oldest = next((key for key in self._models if key not in self._pinned), None)
        if oldest is None:
            return False
        del self._models[oldest]
        for pair in [pair for pair in self.checks if pair[1] == oldest]:
            del self.checks[pair]
            self._due_at.pop(pair, None)
        return True

    def lists_changed(self) -> None:
        """A member's model list changed: references and twins may have moved."""
        self._references.clear()
        self._untwinned.clear()
        self._soon()

    # -- the timer -------------------------------------------------------------------------
    # A callLater chain, not a fixed loop (periodic.py): it wakes when the next pair is
    # due, at once when a new model is seen, and every few seconds while a pair waits
    # for both sides to be available.

    def startService(self) -> None:
        super().startService()
        self._schedule(0)

    def stopService(self) -> None:
        super().stopService()
        cancel(self._timer)
        self._timer = None
        if self._verifying is not None:
            self._verifying.cancel()

    def _soon(self) -> None:
        """Run a pass now (or right after the one running)."""
        if not self.running:
            return
        if self._verifying is not None:
            self._again = True
        else:
            self._schedule(0)

    def _schedule(self, delay: float) -> None:
        if self._timer is not None and self._timer.active():
            if self._timer.getTime() <= self._clock.seconds() + delay:
                return
            self._timer.cancel()
        self._timer = self._clock.callLater(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.running and self._verifying is None:
            self._start_pass()

    def _start_pass(self) -> None:
        """One pass over what is due; wrapped, so one exception cannot end the chain."""
        running = Deferred.fromCoroutine(self.verify_due())
        if not running.called:  # still running: stopService() cancels it
            self._verifying = running

        def failed(failure) -> None:
            self._answer_contract(failure)
            if not failure.check(CancelledError):
                log.failure("twin verification failed unexpectedly; it runs again soon", failure)

        def done(_) -> None:
            self._verifying = None
            delay = self._next_delay()
            if self.running and delay is not None:
                self._schedule(delay)

        running.addErrback(failed).addBoth(done)

    def wake(self) -> None:
        """A side may have come back (the yield ended): a postponed contract runs now."""
        if self.contract is not None and self.contract.postponed:
            self._soon()

    def _next_delay(self) -> float | None:
        """Until the next pair is due (None: none is; a new model or list wakes it)."""
        if self._again:
            self._again = False
            return 0.0
        now = self._clock.seconds()
        delays = [
            due - now
            for key, model in self._models.items()
            for twin in self._twins(key, model)
            if (due := self._due_at.get((twin.name, key), now)) > now
        ]
        if self.contract is not None:
            delays += [due - now for due in self.contract.due_at.values() if due > now]
        if self._postponed:  # overdue pairs wait for both sides: look again a little later
            delays.append(POSTPONED_RECHECK_SECONDS)
        return min(delays) if delays else None

    # -- verification ----------------------------------------------------------------------

    @property
    def settled(self) -> bool:
        """Nothing is running, and no pair is due whose reference and twin are both available now."""
        if self._verifying is not None:
            return False
        now = self._clock.seconds()
        contract = self.contract
        if contract is not None and contract.due(now) and contract.may_run():
            return False
        for key, model in self._models.items():
            reference = self._by_name.get(self._reference(key, model) or "")
            if reference is None or not reference.available():
                continue
            for twin in self._twins(key, model):
                if twin.available() and self._due_at.get((twin.name, key), now) <= now:
                    return False
        return True

    async def verify_due(self) -> None:
        """Verify every pair that is due and whose two sides are available; postpone the others."""
        self._postponed = False
        for key, model in list(self._models.items()):
            reference = self._by_name.get(self._reference(key, model) or "")
            if reference is None:
                continue
            expected: Embeddings | None = None
            for twin in self._twins(key, model):
                now = self._clock.seconds()
                if self._due_at.get((twin.name, key), now) > now:
                    continue
                if not (reference.available() and twin.available()):
                    self._postponed = True
                    continue
                if expected is None:
                    try:
                        expected = await self._embed(reference, model)
                    except Postponed:
                        self._postponed = True
                        continue
                    except BackendError as e:
                        failed = TwinCheck(reference.name, "error", now, reason=f"{reference.name}: {e.detail}")
                        self._record(twin, key, model, failed)
                        continue
                if not twin.available():  # it was taken while the reference answered
                    self._postponed = True
                    continue
                try:
                    got = await self._embed(twin, model)
                except Postponed:
                    self._postponed = True
                    continue
                except BackendError as e:
                    at = self._clock.seconds()
                    failed = TwinCheck(reference.name, "error", at, reason=f"{twin.name}: {e.detail}")
                    self._record(twin, key, model, failed)
                    continue
                texts = self._config.probe_texts
                v = compare(
                    model, model, texts, expected.vectors, got.vectors, self._config.min_cosine, self._clock.seconds(),
                    sides=(reference.name, twin.name),
                )
                reason = v.reason
                dimension = len(got.vectors[0]) if got.vectors else None
                self._record(
                    twin, key, model,
                    TwinCheck(reference.name, "ok" if v.ok else "mismatch", v.at, v.worst_cosine, dimension, reason),
                )
        await self._verify_contract()

    # -- the contract's pairs ----------------------------------------------------------------

    def verify_contract(self) -> Deferred[dict[str, Verification]]:
        """Verify every model of the contract now; fires with ``{model: Verification}`` (those it reached
        before ``may_run`` said no).  A call while that runs waits for the run instead of starting another."""
        contract = self.contract
        assert contract is not None
        waiter: Deferred = Deferred()
        contract.waiters.append(waiter)  # before the run starts: it may end at once
        if not contract.running:
            now = self._clock.seconds()
            contract.due_at.update((model, now) for model in contract.models)
            if self._verifying is None:
                cancel(self._timer)
                self._timer = None
                self._start_pass()
            else:
                self._again = True
        return waiter

    async def _verify_contract(self) -> None:
        """Each due model of the contract, while it may run; then answer those who asked."""
        contract = self.contract
        if contract is None:
            return
        due = contract.due(self._clock.seconds())
        if not due and not contract.waiters:
            return
        contract.results = {}
        for model in due:
            if not contract.may_run():
                if not contract.postponed:
                    log.info("fallback verification stopped: the GPU was yielded; it runs again once it is back")
                contract.postponed = self._postponed = True
                break
            contract.postponed = False
            self._record_contract(contract, await self._contract_pair(contract, model))
        self._answer_contract(contract.results)

    async def _contract_pair(self, contract: Contract, model: str) -> Verification:
        """The contract's twin against its reference for ``model``, through its two sides."""
        texts = contract.terms.probe_texts
        probe = EmbedRequest("embed", model, texts)
        twin_model = contract.models[model]
        now = self._clock.seconds
        reference, twin = contract.sides
        try:
            expected = await reference.embed(probe, model)
        except BackendError as e:
            return Verification(model, twin_model, False, now(), reason=f"primary: {e.detail}")
        try:
            got = await twin.embed(probe, twin_model)
        except BackendError as e:
            return Verification(model, twin_model, False, now(), reason=f"fallback: {e.detail}")
        return compare(model, twin_model, texts, expected.vectors, got.vectors, contract.terms.min_cosine, now())

    def _record_contract(self, contract: Contract, v: Verification) -> None:
        contract.verifications[v.model] = v
        if contract.results is not None:
            contract.results[v.model] = v
        interval = contract.terms.interval
        if not v.ok and not v.rows:  # a side did not answer (not a mismatch): try again sooner
            interval = min(interval, RETRY_AFTER_ERROR_SECONDS)
        contract.due_at[v.model] = v.at + interval
        if v.ok:
            log.info(
                "fallback verified for {model} (as {fallback_model} on {url}): worst cosine {worst:.6f} over {n} texts",
                model=v.model, fallback_model=v.fallback_model, url=contract.sides[1].url, worst=v.worst_cosine,
                n=len(v.rows),
            )
            self._tell_verified()  # a model may have become usable for requests in line
        else:
            log.warn(
                "fallback NOT verified for {model} (as {fallback_model} on {url}), its requests will park "
                "instead: {reason}",
                model=v.model, fallback_model=v.fallback_model, url=contract.sides[1].url, reason=v.reason,
            )

    def _answer_contract(self, result) -> None:
        """Hand the contract's run (its results or its failure) to everyone who asked for it."""
        contract = self.contract
        if contract is None:
            return
        contract.results = None
        waiters, contract.waiters = contract.waiters, []
        for waiter in waiters:
            if waiter.called:  # its caller gave up (cancelled)
                continue
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)

    def _embed(self, member: Member, model: str) -> Deferred[Embeddings]:
        """The probe texts' vectors from ``member`` (its own name for ``model``, its embed route and shape)."""
        if member.control is None:
            raise BackendError("error", f"{member.name} has no client")
        own = member.catalogue.own_name(model) or model
        probe = EmbedRequest("embed", own, tuple(self._config.probe_texts))
        shape = member.server.embed_shape
        _, body = backend_request(probe, shape, own)
        return Deferred.fromCoroutine(self._call(member, probe, shape, json.loads(body)))

    async def _call(self, member: Member, probe: EmbedRequest, shape: str, body: dict) -> Embeddings:
        with backend_errors(member.spec.url, passing=(Postponed,)):
            path = member.server.embed_path
            answer = await self._post(member, path, body)
            if answer.code == 404:
                answer = await self._under_another_prefix(member, path, body) or answer
        embeddings = parse_response(probe, shape, answer.code, answer.body)
        if len(embeddings.vectors) != len(probe.inputs):
            raise BackendError(
                Reason.BAD_ANSWER, f"{len(embeddings.vectors)} vectors for {len(probe.inputs)} probe texts"
            )
        return embeddings

    def _post(self, member: Member, path: str, body: dict) -> Deferred:
        return member.control.request(
            "POST", path, body, timeout=self._config.timeout_seconds, max_body=MAX_ANSWER_BYTES,
        )

    async def _under_another_prefix(self, member: Member, tried: str, body: dict):
        """After a 404 at ``tried``: the answer under another API prefix its server may be mounted under
        (:meth:`Member.prefixes_after_404`), which the member then keeps for every call; None if none
        answers. Each call waits for the member to be available, as every verification call does
        (:class:`Postponed` if it is not)."""
        for prefix in member.prefixes_after_404(tried):
            if not member.available():
                raise Postponed(member.name)
            answer = await self._post(member, member.server.with_prefix(prefix).embed_path, body)
            if answer.code != 404:
                member.found_prefix(prefix)
                return answer
        return None

    def _record(self, twin: Member, key: str, model: str, check: TwinCheck) -> None:
        pair = (twin.name, key)
        before = self.checks.get(pair)
        self.checks[pair] = check
        self._counts[(twin.name, check.result)] += 1
        interval = self._config.verify_interval_seconds
        if check.result == "error":  # no answer is no verdict: try again sooner
            interval = min(interval, RETRY_AFTER_ERROR_SECONDS)
        self._due_at[pair] = check.at + interval
        if check.ok:
            if before is None or not before.ok:
                log.info(
                    "upstream {twin} verified as a twin of {reference} for {model}: worst cosine {worst:.6f}; "
                    "it serves {model}'s embeddings",
                    twin=twin.name, reference=check.reference, model=model, worst=check.worst_cosine,
                )
            self._tell_verified()
        elif before is None or before.result != check.result or before.reason != check.reason:
            log.warn(
                "upstream {twin} NOT verified as a twin of {reference} for {model} ({result}): {reason}; "
                "{model}'s embeddings do not go to it",
                twin=twin.name, reference=check.reference, model=model, result=check.result, reason=check.reason,
            )

    # -- reports ---------------------------------------------------------------------------

    def state_of(self, name: str, key: str, reference: str) -> str:
        """One of :data:`TWIN_STATES` for member ``name`` and a model (canonical ``key``)."""
        if name == reference:
            return "reference"
        check = self.checks.get((name, key))
        if check is None or check.reference != reference:
            return "unverified"
        if check.ok and self._clock.seconds() - check.at > self._config.max_verification_age_seconds:
            return "stale"
        return "verified" if check.ok else check.result

    def status(self, name: str, shown: Callable[[float], float] = same) -> dict[str, dict]:
        """The ``twins`` of member ``name``'s ``/status`` row: per model it serves, its state and last check
        (its time given to ``shown``)."""
        now = self._clock.seconds()
        member = self._by_name[name]
        out = {}
        for key, model in self._models.items():
            reference = self._reference(key, model)
            if reference is None or not member.catalogue.serves(model):
                continue
            check = self.checks.get((name, key)) if name != reference else None
            out[model] = {
                "state": self.state_of(name, key, reference),
                "reference": reference,
                "verified_at": None if check is None else shown(check.at),
                "age_seconds": None if check is None else max(0.0, now - check.at),
                "worst_cosine": None if check is None else check.worst_cosine,
                "dimension": None if check is None else check.dimension,
                "reason": None if check is None or not check.reason else check.reason,
            }
        return out

    def with_twins(self, rows: list[dict], shown: Callable[[float], float] = same) -> list[dict]:
        """``/status``'s ``upstreams`` rows with each one's ``twins``."""
        return [{**row, "twins": self.status(row["name"], shown)} for row in rows]

    def metric_families(self):
        """``yieldproxy_twin_verified``, ``_twin_min_cosine`` and ``_twin_verifications_total``, read at scrape time."""
        verified = GaugeMetricFamily(
            "yieldproxy_twin_verified",
            "1 while this upstream may serve this model's embeddings as a twin of its reference (its last "
            "verification passed and is recent enough), else 0.",
            labels=["upstream", "model"],
        )
        worst = GaugeMetricFamily(
            "yieldproxy_twin_min_cosine",
            "The lowest cosine between this upstream's vectors and the reference's over the probe texts, "
            "at its last verification.",
            labels=["upstream", "model"],
        )
        total = CounterMetricFamily(
            "yieldproxy_twin_verifications",
            "Twin verifications by upstream and result: ok, mismatch (vectors differ), error (no usable answer).",
            labels=["upstream", "result"],
        )
        for key, model in self._models.items():
            reference = self._reference(key, model)
            for twin in self._twins(key, model):
                serves = self.state_of(twin.name, key, reference) == "verified"
                verified.add_metric([twin.name, model], 1 if serves else 0)
                check = self.checks.get((twin.name, key))
                if check is not None and check.worst_cosine is not None:
                    worst.add_metric([twin.name, model], check.worst_cosine)
        for member in self._members:
            for result in RESULTS:
                total.add_metric([member.name, result], self._counts[(member.name, result)])
        return [verified, worst, total]


__all__ = ["RESULTS", "TWIN_STATES", "TwinCheck", "TwinVerifier"]
