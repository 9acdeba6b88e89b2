"""The signal watcher: SIGUSR1 starts a hold (source ``signal``), SIGUSR2 ends it.

For a broker that can send a signal but not make an HTTP call: ``systemctl
kill -s USR1 yieldproxy`` before the game, ``-s USR2`` after.  The Python
handler only hands the work to the reactor (``callFromThread`` is the one
reactor call that is safe from a signal handler, and it wakes the reactor).

twistd uses SIGUSR1 to reopen its log file when it logs to a file
(``--logfile``); with this watcher on, that job is ours, and the previous
handler comes back when the watcher stops.
"""

from __future__ import annotations

import os
import signal

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from ..metrics import Metrics
from ..names import SIGNAL_SOURCE
from ..state import YieldState

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

    name = "watcher:signal"  # type: ignore[assignment]  # Twisted types Service.name as None

    def startService(self) -> None:
        super().startService()
        for signum in (self.start_signal, self.stop_signal):
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
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
        """Put the previous handlers back; a hold taken by signal stays."""
        super().stopService()
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
            if signum == self.start_signal:
                self._state.hold(SOURCE, f"{signal.Signals(signum).name} received")
            elif signum == self.stop_signal:
                if not self._state.release(SOURCE):
                    log.info("{name} received, but no signal hold to end", name=signal.Signals(signum).name)
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("signal watcher step failed")
