"""The signal watcher: SIGUSR1 starts a hold (source ``signal``), SIGUSR2 ends it.

For a broker that can send a signal but not make an HTTP call (docs/watchers.md,
"Signals").  The Python handler only hands the work to the reactor
(``callFromThread`` is the one reactor call that is safe from a signal handler,
and it wakes the reactor).  The handlers stay installed when the watcher stops,
until the process ends, since the default action of SIGUSR1 and SIGUSR2 is to
end the process; :meth:`SignalWatcher.uninstall` puts the previous ones back,
for an application that hosts the proxy and goes on without it.

:class:`StopSignals` is the other half of a graceful stop: a second SIGTERM
(or SIGINT) while it runs is logged and ignored (docs/operating.md, "Signals").
"""

from __future__ import annotations

import os
import signal
from typing import Callable

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from ..lot.state import YieldState
from ..names import SIGNAL_SOURCE
from ..observe.metrics import Metrics

log = Logger()

SOURCE = SIGNAL_SOURCE


@attrs.define(eq=False, slots=False)
class SignalWatcher(Service):
    """SIGUSR1 -> hold, SIGUSR2 -> release, for source ``signal``."""

    #: Needs only ``callFromThread``.
    _reactor: IReactorFromThreads
    _state: YieldState
    _metrics: Metrics
    start_signal: int = signal.SIGUSR1
    stop_signal: int = signal.SIGUSR2
    _previous: dict = attrs.Factory(dict)
    #: Why the holds are not this process's to change now (a reload: lifecycle/succession/), or None.  Asked as each
    #: signal is handled, not as it comes: one that came just before the holds went over is refused too.
    holds_elsewhere: Callable[[], str | None] | None = None

    name = "watcher:signal"  # type: ignore[assignment]  # Twisted types Service.name as None

    def startService(self) -> None:
        super().startService()
        for signum in (self.start_signal, self.stop_signal):
            try:
                previous = signal.signal(signum, self._on_signal)
                # Started again after a stop: the handler in place is still ours.
                self._previous.setdefault(signum, previous)
            except (ValueError, OSError) as e:
                # ValueError: not the main thread (an embedding application).
                self._metrics.watcher_errors_total.labels(SOURCE).inc()
                log.error(
                    "signal watcher: cannot install a handler for {name}: {error}",
                    name=signal.Signals(signum).name,
                    error=e,
                )
        log.info("signal watcher: SIGUSR1 yields the GPU, SIGUSR2 gives it back (pid {pid})", pid=os.getpid())

    def stopService(self) -> None:
        """Stop, keeping the handlers (see the module's docstring); a hold taken by signal stays."""
        super().stopService()

    def uninstall(self) -> None:
        """Put the previous handlers back (an application that hosts the proxy and goes on without it)."""
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._previous.clear()

    def status(self) -> dict:
        return {"holding": self._state.hold_of(SOURCE) is not None}

    def _on_signal(self, signum, frame) -> None:
        """The Python-level handler: leave everything to the reactor."""
        self._reactor.callFromThread(self.handle, signum)

    def handle(self, signum: int) -> None:
        """Take or end the hold for ``signum``, in the reactor thread.  Never raises."""
        try:
            why = self.holds_elsewhere() if self.holds_elsewhere is not None else None
            if why is not None:
                log.warn("{name} received, but {why}: the signal hold is not {what} here",
                         name=signal.Signals(signum).name, why=why,
                         what="taken" if signum == self.start_signal else "ended")
                return
            if not self.running:
                log.info(
                    "{name} received while the proxy stops: the signal hold is {what} and kept for the next start",
                    name=signal.Signals(signum).name, what="taken" if signum == self.start_signal else "ended",
                )
            if signum == self.start_signal:
                self._state.hold(SOURCE, f"{signal.Signals(signum).name} received")
            elif signum == self.stop_signal:
                if not self._state.release(SOURCE):
                    log.info("{name} received, but no signal hold to end", name=signal.Signals(signum).name)
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("signal watcher step failed")


@attrs.define(eq=False, slots=False)
class StopSignals(Service):
    """Signals during the graceful stop: one log line each, and the stop goes on.

    * A second SIGTERM or SIGINT: twistd's own handler would call
      ``reactor.stop()`` again, which raises and logs a traceback, and
      cutting the stop short would cut in-flight answers.
    * SIGUSR1 or SIGUSR2 when nothing handles them (no signal watcher, no
      ``--logfile``): their default action ends the process, exit 138 or 140,
      and every in-flight client loses its answer.  With the signal watcher
      on, its own handlers stay and take or end the hold.

    The last child of the process's service (``tap.py``), so it is the first
    to stop: its handlers are in place before anything else stops.
    """

    _reactor: IReactorFromThreads
    #: ``proxy.shutdown_timeout_seconds``, for the log line.
    timeout: float
    #: Caught during the stop whatever handles them before.
    stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
    #: Caught during the stop only when their default action (the end of the process) would apply.
    default_signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGUSR2)

    name = "stop-signals"  # type: ignore[assignment]  # Twisted types Service.name as None

    def stopService(self) -> None:
        super().stopService()
        caught = [*self.stop_signals, *(s for s in self.default_signals if signal.getsignal(s) == signal.SIG_DFL)]
        for signum in caught:
            try:
                signal.signal(signum, self._on_signal)
            except (ValueError, OSError) as e:
                log.warn("cannot catch {name} during the stop: {error}", name=signal.Signals(signum).name, error=e)

    def _on_signal(self, signum, frame) -> None:
        """The Python-level handler: leave the logging to the reactor."""
        self._reactor.callFromThread(self.handle, signum)

    def handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum in self.stop_signals:
            log.warn(
                "{name} received while already stopping: ignored; parked requests are answered and in-flight ones "
                "finish within {timeout:g}s (proxy.shutdown_timeout_seconds); SIGKILL stops at once "
                "(the holds are kept)",
                name=name, timeout=self.timeout,
            )
        else:
            log.info("{name} received while stopping: ignored (watchers.signals is off)", name=name)
