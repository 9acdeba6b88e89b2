"""What a hang-up (SIGHUP) means: a reload for a service, the end for a program run in a terminal.

A reload's new process has no terminal of its own, so a hang-up taken as a
reload would leave the proxy serving, detached, after its terminal closed.
:func:`terminal_of` decides once, at start, which kind of process this one
is; the rule, and why ``$INVOCATION_ID`` alone is no sign of systemd:
docs/operating.md (*In a terminal or as a service*).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Callable, Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

__all__ = ["HangupStops", "terminal_of", "why_no_reload"]

log = Logger()

#: The standard streams by descriptor, as they are named in the reload's refusal.
STREAMS = ((0, "stdin"), (1, "stdout"), (2, "stderr"))


def terminal_of(
    environ: Mapping[str, str], daemonizes: bool, reloaded: bool, isatty: Callable[[int], bool] = os.isatty,
) -> str | None:
    """The name of the first standard stream that is a terminal, when this process is a terminal program
    (see the module docstring); None when it is a service, whose SIGHUP reloads."""
    if daemonizes or reloaded or environ.get("NOTIFY_SOCKET"):
        return None
    for fd, name in STREAMS:
        try:
            if isatty(fd):
                return name
        except OSError:
            continue
    return None


def why_no_reload(stream: str, pid: int) -> str:
    """The one line a reload of a terminal program is refused with: why, and how to restart it."""
    return (
        f"this proxy (pid {pid}) runs in a terminal (its {stream}): a reload would leave a new process running "
        "detached from it; restart it instead (Ctrl-C, then start it again), or run it as a service "
        "(systemd, or twistd without -n) to reload (docs/operating.md)"
    )


@attrs.define(eq=False, slots=False)
class HangupStops(Service):
    """SIGHUP ends a proxy run in a terminal as SIGTERM does: the graceful stop.

    Its handler stays in until the stop begins; then the stop's own
    (watchers/signals.py ``StopSignals``, given SIGHUP too) logs a second
    hang-up instead of cutting the stop short.
    """

    _reactor: IReactorFromThreads
    #: Begins the graceful stop (the reactor's ``stop``).
    _stop: Callable[[], None]
    _previous: Any = None
    _stopping: bool = False

    name = "hangup"  # type: ignore[assignment]  # Twisted types Service.name as None

    def startService(self) -> None:
        super().startService()
        try:
            self._previous = signal.signal(signal.SIGHUP, self._on_signal)
        except (ValueError, OSError) as e:
            log.warn("cannot catch SIGHUP: closing the terminal ends this process at once ({error})", error=e)

    def stopService(self) -> None:
        super().stopService()
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGHUP) == self._on_signal:
                signal.signal(signal.SIGHUP, self._previous if self._previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        """The Python-level handler: the stop begins in the reactor thread."""
        self._reactor.callFromThread(self.hung_up)

    def hung_up(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("SIGHUP: the terminal hung up; stopping (pid {pid}) as SIGTERM does", pid=os.getpid())
        self._stop()
