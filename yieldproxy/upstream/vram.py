"""The VRAM handover: free the GPU's memory when it is yielded, load models back after.

Parking requests keeps Ollama from *using* the GPU during a yield, but its
loaded models sit in VRAM until their keep-alive runs out.  On a yield that
handed the GPU to someone (a hold from any source but ``outage``: an outage is
the upstream's own trouble), ``handover.unload_on_yield`` unloads them; when it
ends, ``handover.preload_models`` loads models back before the first parked
request is replayed (through :meth:`Member.hold_release_until`).  The steps,
their bounds and metrics: docs/watchers.md ("The VRAM handover").
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..config import HandoverConfig
from ..lot.replay import Replayer
from ..lot.state import DEFAULT_MEMBER, Hold, YieldState
from ..names import TROUBLE_SOURCES, canonical_model
from ..observe.metrics import Metrics
from .control import ControlTimeout
from .pool.member import Member

log = Logger()


def listed_models(body: Any) -> dict[str, str]:
    """Model key (:func:`~yieldproxy.names.canonical_model`) -> the name as ``/api/ps`` lists it (what an unload call names: Ollama finds
    a model's files by its name, and on a case-sensitive disk only as it was written)."""
    models = body.get("models") if isinstance(body, dict) else None
    names: dict[str, str] = {}
    for entry in models or []:
        if isinstance(entry, dict):
            name = entry.get("model") or entry.get("name")
            if isinstance(name, str) and name:
                names.setdefault(canonical_model(name), name)
    return names


class HandoverError(Exception):
    """The upstream answered a handover call with something unexpected."""


@attrs.define(eq=False, slots=False)
class Handover(Service):
    """Unloads models when a yield starts, preloads some when it ends."""

    _clock: IReactorTime
    _state: YieldState
    _replayer: Replayer
    #: An :class:`~yieldproxy.upstream.control.UpstreamControl` (or anything with its ``request``).
    _control: Any
    _metrics: Metrics
    config: HandoverConfig = attrs.Factory(HandoverConfig)
    #: How often ``/api/ps`` is read while waiting for models to come or go.
    poll_seconds: float = 0.25
    #: The step running now (for ``/status``): waiting_inflight, unloading, preloading, or None.
    step: str | None = None
    _unloading: Deferred | None = None
    _preloading: Deferred | None = None
    #: True once a non-outage hold was taken in the current yield.
    _handed_over: bool = False
    #: The pool member whose models it unloads and loads (its yields, its drainer, its control client).
    member: str = DEFAULT_MEMBER
    #: That member as it runs: it takes no work until the preload is done (:meth:`Member.hold_release_until`).
    release: Member = attrs.field(kw_only=True)

    name = "handover"  # type: ignore[assignment]  # Twisted types Service.name as None

    #: Named after its member (``handover:NAME``): one of several upstreams' (the pool's shape
    #: decides: ``PoolShape.one_upstream``, upstream/pool/members.py; ``service.build`` gives it).
    per_member: bool = False

    def __attrs_post_init__(self) -> None:
        if self.per_member:
            self.name = f"handover:{self.member}"

    def member_changed(self, member: str, yielded: bool) -> None:
        """A member was taken or given back (``YieldState.observe_members``; ``service.build`` subscribes it)."""
        if member == self.member:
            self._state_changed(yielded)

    def stopService(self) -> None:
        """Give up any step in progress: a pending preload no longer holds the lot."""
        super().stopService()
        for d in (self._unloading, self._preloading):
            if d is not None:
                d.cancel()

    def status(self) -> dict:
        return {
            "step": self.step,
            "unload_on_yield": self.config.unload_on_yield,
            "preload_models": list(self.config.preload_models),
        }

    # -- triggers -------------------------------------------------------------------

    def hold_taken(self, hold: Hold) -> None:
        if not self.running or hold.source in TROUBLE_SOURCES or not self._state.applies(hold, self.member):
            return
        self._handed_over = True
        if self._preloading is not None:
            self._preloading.cancel()
        if self.config.unload_on_yield and self._unloading is None:
            d = self._unloading = Deferred.fromCoroutine(self._unload())
            d.addBoth(self._unload_ended)

    def _state_changed(self, yielded: bool) -> None:
        if not self.running:
            return
        if yielded:
            if self._preloading is not None:
                self._preloading.cancel()
            return
        if self._unloading is not None:
            log.info("handover: the yield ended before the unload finished; stopping it")
            self._unloading.cancel()
        handed_over, self._handed_over = self._handed_over, False
        if handed_over and self.config.preload_models:
            d = self._preloading = Deferred.fromCoroutine(self._preload())
            d.addBoth(self._preload_ended)
            self.release.hold_release_until(d)

    def _unload_ended(self, result):
        self._unloading = None
        if isinstance(result, Failure) and not result.check(CancelledError):
            log.failure("handover: unload failed", result)
        return None

    def _preload_ended(self, result):
        self._preloading = None
        return result

    # -- the steps ---------------------------------------------------------------

    async def _unload(self) -> list[str]:
        """Wait for in-flight requests, then unload every loaded model and check it is gone."""
        began = self._clock.seconds()
        self.step = "waiting_inflight"
        try:
            try:
                finished = await self._wait_inflight(self.config.unload_wait_seconds)
            except CancelledError:
                self._record("wait_inflight", "cancelled", began)
                raise
            self._record(
                "wait_inflight", "ok" if finished else "timeout", began,
                "" if finished else f"; {self._replayer.inflight} still in flight, unloading anyway "
                "(Ollama frees a model's memory when its last request ends)",
            )
            self.step = "unloading"
            began = self._clock.seconds()
            deadline = began + self.config.unload_timeout_seconds
            models: list[str] = []
            try:
                listed = await self._ps_listed(deadline)
                models = sorted(listed.values())
                for model in models:
                    await self._load_call(model, deadline, unload=True)
                await self._wait_ps(lambda loaded: not (loaded & set(listed)), deadline)
            except CancelledError:
                self._record("unload", "cancelled", began)
                raise
            except Exception as e:
                self._record("unload", _outcome(e), began, f" ({', '.join(models) or 'nothing loaded'}): {e}")
                return []
            self._record("unload", "ok", began, f": {', '.join(models) or 'nothing was loaded'}")
            return models
        finally:
            self.step = None

    async def _preload(self) -> None:
        """Load :attr:`HandoverConfig.preload_models` and wait until ``/api/ps`` lists them."""
        began = self._clock.seconds()
        deadline = began + self.config.preload_timeout_seconds
        wanted = {canonical_model(m) for m in self.config.preload_models}
        self.step = "preloading"
        log.info(
            "handover: loading {models} before the parked requests are replayed",
            models=", ".join(self.config.preload_models),
        )
        try:
            for model in self.config.preload_models:
                await self._load_call(model, deadline, unload=False)
            await self._wait_ps(lambda loaded: wanted <= loaded, deadline)
        except CancelledError:
            self._record("preload", "cancelled", began)
            raise
        except Exception as e:
            self._record("preload", _outcome(e), began, f": {e}; replaying the parked requests anyway")
            return
        finally:
            self.step = None
        self._record("preload", "ok", began, f": {', '.join(sorted(wanted))}")

    # -- helpers -----------------------------------------------------------------

    async def _wait_inflight(self, seconds: float) -> bool:
        """Wait until nothing is in flight (the replayer says when); False if ``seconds`` pass first."""
        try:
            await self._replayer.when_idle().addTimeout(seconds, self._clock)
        except TimeoutError:
            return False
        return True

    def _remaining(self, deadline: float) -> float:
        remaining = deadline - self._clock.seconds()
        if remaining <= 0:
            raise ControlTimeout("ran out of time")
        return remaining

    async def _ps_listed(self, deadline: float) -> dict[str, str]:
        answer = await self._control.request("GET", "/api/ps", timeout=self._remaining(deadline))
        if answer.code != 200:
            raise HandoverError(f"GET /api/ps answered {answer.code}")
        try:
            return listed_models(answer.json())
        except ValueError:
            raise HandoverError("GET /api/ps answered something that is not JSON") from None

    async def _wait_ps(self, done, deadline: float) -> None:
        """Poll ``/api/ps`` until ``done(loaded)``; :class:`ControlTimeout` at the deadline."""
        while True:
            loaded = set(await self._ps_listed(deadline))
            if done(loaded):
                return
            if self._clock.seconds() + self.poll_seconds >= deadline:
                raise ControlTimeout(f"/api/ps still lists {', '.join(sorted(loaded)) or 'nothing'}")
            await deferLater(self._clock, self.poll_seconds)

    async def _load_call(self, model: str, deadline: float, unload: bool) -> None:
        """Load (or, with ``keep_alive: 0``, unload) ``model``.

        ``/api/generate`` first; a model that cannot generate (an embedding
        model) answers 400, and ``/api/embed`` with no input does the same job.
        """
        body: dict[str, Any] = {"model": model}
        if unload:
            body["keep_alive"] = 0
        for path in ("/api/generate", "/api/embed"):
            answer = await self._control.request("POST", path, body, timeout=self._remaining(deadline))
            if answer.code == 200:
                return
            if answer.code != 400:
                break
        raise HandoverError(
            f"{'unloading' if unload else 'loading'} {model}: upstream answered {answer.code}: "
            f"{answer.body[:200].decode('utf-8', 'replace').strip()}"
        )

    def _record(self, step: str, outcome: str, began: float, detail: str = "") -> None:
        """Log and count one finished step."""
        seconds = self._clock.seconds() - began
        self._metrics.handover_seconds.labels(self.member, step).observe(seconds)
        self._metrics.handover_total.labels(self.member, step, outcome).inc()
        emit = log.info if outcome in ("ok", "cancelled") else log.warn
        emit(
            "handover: {step} {outcome} in {seconds:.2f}s{detail}",
            step=step,
            outcome=outcome,
            seconds=seconds,
            detail=detail,
        )


def _outcome(e: Exception) -> str:
    return "timeout" if isinstance(e, ControlTimeout) else "error"
