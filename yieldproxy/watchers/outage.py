"""Outage detection: a crashed or restarting upstream is held like a yield, not failed.

The gate reports every upstream attempt's result.  When attempts fail the
way a dead or GPU-less Ollama fails (refused, connect, reset, gpu_error,
status_503), nobody else holds the GPU, and the upstream *has answered at
least once since the proxy started*, this watcher takes an ``outage`` hold:
requests park instead of failing.  It then probes ``upstream.health_path``
with a growing interval (``health_interval_seconds`` doubling up to
``health_max_interval_seconds``) and ends the hold on the first 200; the lot
is replayed, paced, as after any yield.

An upstream that has never answered is a configuration error (wrong URL or
port), not an outage: its callers keep getting a fast 502.

The interval is not reset when a probe passes, only when real traffic
succeeds: an Ollama whose ``/api/version`` answers while its GPU fails
(``gpu_error``) is then probed less and less often instead of flapping fast.
"""

from __future__ import annotations

from typing import Callable

import attrs
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ..metrics import Metrics
from ..state import YieldState

log = Logger()

SOURCE = "outage"
#: Failures that mean "the upstream (or its GPU) is down", not "this request was slow or odd".
OUTAGE_REASONS = frozenset({"refused", "connect", "reset", "gpu_error", "status_503"})


@attrs.define(eq=False, slots=False)
class OutageWatcher(Service):
    """Takes and ends the ``outage`` hold from attempt results and health probes."""

    _clock: IReactorTime
    _state: YieldState
    #: The gate's ``upstream_listeners``, joined while running.
    _listeners: list
    #: Probes the health path once: a Deferred firing with the HTTP status.
    _check: Callable[[], Deferred]
    _metrics: Metrics
    interval: float = 0.5
    max_interval: float = 10.0
    #: For log lines.
    upstream: str = "the upstream"
    #: True once the upstream has answered (a request, or a health probe) since start.
    reachable: bool = False
    _next_interval: float = attrs.field(init=False)
    _timer: IDelayedCall | None = None
    _probe: Deferred | None = None
    _held_since: float | None = None
    _said_unreachable: bool = False

    name = "watcher:outage"

    def __attrs_post_init__(self) -> None:
        self._next_interval = self.interval

    def startService(self) -> None:
        super().startService()
        self._listeners.append(self.upstream_result)
        # One probe at start, so an outage before the first request is an outage too.
        self._run_probe()

    def stopService(self) -> None:
        """Stop listening and probing; an outage hold stays (the upstream is still down)."""
        super().stopService()
        if self.upstream_result in self._listeners:
            self._listeners.remove(self.upstream_result)
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._probe is not None:
            self._probe.cancel()

    def status(self) -> dict:
        return {
            "reachable": self.reachable,
            "probing": self._timer is not None or self._probe is not None,
            "next_interval_seconds": self._next_interval,
        }

    def upstream_result(self, reason: str | None) -> None:
        """A gate listener: one attempt's failure reason, or None for an answer.  Never raises."""
        try:
            self._result(reason)
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("outage watcher step failed")

    def _result(self, reason: str | None) -> None:
        held = self._state.hold_of(SOURCE) is not None
        if reason is None:
            self._answered()
            if not held:
                # Traffic flows: the next outage starts with quick probes again.
                self._next_interval = self.interval
            return
        if reason not in OUTAGE_REASONS or held:
            return
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
            return
        if any(h.source != SOURCE for h in self._state.holds):
            # The GPU is yielded already: failures are expected and the requests are parked anyway.
            return
        self._held_since = self._clock.seconds()
        self._state.hold(SOURCE, f"upstream failing ({reason})")
        self._schedule()

    def _answered(self) -> None:
        if not self.reachable:
            self.reachable = True
            if self._said_unreachable:
                log.info("{upstream} answers: outage detection is armed", upstream=self.upstream)

    def _schedule(self) -> None:
        """The next health probe, after the current interval; the interval then doubles."""
        if self._timer is not None or self._probe is not None or not self.running:
            return
        delay = self._next_interval
        self._next_interval = min(self.max_interval, self._next_interval * 2)
        self._timer = self._clock.callLater(delay, self._probe_step)

    def _probe_step(self) -> None:
        self._timer = None
        if self._state.hold_of(SOURCE) is None:
            return  # ended from outside (POST /resume {"source": "outage"}): stop probing
        self._run_probe()

    def _run_probe(self) -> None:
        try:
            d = self._probe = self._check()
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("outage watcher: the health probe could not start")
            self._probe = None
            self._schedule_if_held()
            return
        d.addCallbacks(self._probed, self._probe_failed)
        d.addErrback(lambda f: log.failure("outage watcher: handling a probe failed", f))

    def _probed(self, code: int) -> None:
        self._probe = None
        if code != 200:
            log.debug("health probe: {upstream} answered {code}", upstream=self.upstream, code=code)
            self._schedule_if_held()
            return
        self._answered()
        if self._state.hold_of(SOURCE) is not None:
            began = self._held_since if self._held_since is not None else self._clock.seconds()
            log.info(
                "{upstream} answers its health probe again after {seconds:.1f}s: ending the outage hold",
                upstream=self.upstream,
                seconds=self._clock.seconds() - began,
            )
            self._held_since = None
            self._state.release(SOURCE)

    def _probe_failed(self, failure) -> None:
        self._probe = None
        if failure.check(CancelledError) and not self.running:
            return
        log.debug("health probe failed: {error}", error=failure.getErrorMessage())
        self._schedule_if_held()

    def _schedule_if_held(self) -> None:
        if self._state.hold_of(SOURCE) is not None:
            self._schedule()
