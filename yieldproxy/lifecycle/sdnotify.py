"""systemd's notify protocol (``sd_notify(3)``): ``READY=1``, ``RELOADING=1``, ``MAINPID=``, ``WATCHDOG=1``.

The protocol is one datagram of ``KEY=VALUE`` lines sent to the unix socket
named in ``$NOTIFY_SOCKET`` (a leading ``@`` names one in the abstract
namespace), so it is these few lines rather than a dependency: the
``systemd`` Python bindings need libsystemd's headers to build.  What is
sent when, the watchdog, and nothing without ``$NOTIFY_SOCKET``:
docs/operating.md (*Under systemd*).  Nothing here reads ``os.environ`` or
the global reactor by itself: ``tap.py`` hands over both.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from ..periodic import every

__all__ = ["Notifier", "Ready", "Watchdog", "monotonic_usec", "watchdog_seconds"]

log = Logger()

#: The longest one send may block the reactor (systemd reads its socket at once; a stuck
#: reader must not stall the proxy).
SEND_TIMEOUT_SECONDS = 1.0


def _address(name: str) -> str | bytes | None:
    """The socket address ``$NOTIFY_SOCKET`` names: a path, or an abstract name (leading ``@``).

    None for what this module does not speak (``vsock:``, relative paths).
    """
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    if name.startswith("/"):
        return name
    return None


@attrs.define(eq=False)
class Notifier:
    """Sends state lines to systemd's notify socket, when there is one.

    Never raises: a failed send is logged (once until one succeeds again)
    and reported as False, since the proxy must not fail for want of a
    supervisor.
    """

    #: ``$NOTIFY_SOCKET``, or None: every :meth:`notify` is then a no-op.
    socket_name: str | None = None
    _failing: bool = False
    #: This process's pid, to tell a ``MAINPID=`` naming another process.
    pid: int = attrs.Factory(os.getpid)
    #: True once this process named another one the main process (``MAINPID=``, a reload's
    #: successor): systemd takes no more from this one, so nothing more is sent.
    superseded: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> "Notifier":
        """The notifier ``environ`` describes (``$NOTIFY_SOCKET``; none: a notifier that does nothing)."""
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        """True under a supervisor that listens (``$NOTIFY_SOCKET`` set)."""
        return self.socket_name is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` (``"READY=1"``, ``"STATUS=..."``) as one datagram; True if it was sent.

        False without a notify socket, or when the send failed (logged).
        """
        if self.socket_name is None or self.superseded:
            return False
        if any("\n" in line for line in lines):
            raise ValueError(f"a notify line holds a newline: {lines!r}")
        address = _address(self.socket_name)
        if address is None:
            self._failed(f"$NOTIFY_SOCKET {self.socket_name!r} is neither a path nor an abstract socket (@name)")
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_SECONDS)
                sock.sendto("\n".join(lines).encode("utf-8"), address)
        except OSError as e:
            self._failed(f"cannot notify systemd at {self.socket_name!r}: {e}")
            return False
        if self._failing:
            self._failing = False
            log.info("systemd notify socket {name!r} reachable again", name=self.socket_name)
        if any(line.startswith("MAINPID=") and line != f"MAINPID={self.pid}" for line in lines):
            # Its watchdog and STOPPING=1 would be refused (NotifyAccess=main), or worse, believed.
            self.superseded = True
        return True

    def _failed(self, message: str) -> None:
        """Log the first failure of a run of them: a watchdog every few seconds must not flood the log."""
        if not self._failing:
            self._failing = True
            log.warn("{message}", message=message)


def watchdog_seconds(environ: Mapping[str, str], pid: int) -> float | None:
    """The watchdog interval systemd asks of process ``pid`` (``$WATCHDOG_USEC``), or None.

    None when there is no watchdog, when ``$WATCHDOG_PID`` names another
    process (a child that inherited the environment must not keep a dead
    parent alive), or when either value is not a positive integer.
    """
    usec, for_pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
    if not usec:
        return None
    try:
        if for_pid and int(for_pid) != pid:
            return None
        value = int(usec)
    except ValueError:
        log.warn("ignoring a malformed watchdog setting: WATCHDOG_USEC={usec!r} WATCHDOG_PID={pid!r}",
                 usec=usec, pid=for_pid)
        return None
    return value / 1e6 if value > 0 else None


def monotonic_usec() -> int:
    """``CLOCK_MONOTONIC`` in microseconds, for ``MONOTONIC_USEC=`` beside ``RELOADING=1`` (systemd compares it with that clock)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


@attrs.define(eq=False, slots=False)
class Watchdog(Service):
    """Sends ``WATCHDOG=1`` every ``interval / 2`` seconds on ``clock`` while running.

    The send is a step of the reactor's own loop: a loop that is wedged
    stops sending, and systemd restarts the process after ``WatchdogSec=``.
    """

    _clock: IReactorTime
    _notifier: Notifier
    #: ``WatchdogSec=`` as :func:`watchdog_seconds` read it.
    interval: float
    _loop: LoopingCall | None = None

    name = "watchdog"  # type: ignore[assignment]  # Twisted types Service.name as None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]  # Twisted leaves it unannotated
        self._loop = every(self._clock, self.interval / 2, self._feed, "systemd watchdog: feeding")
        log.info("systemd watchdog: fed every {every:g}s (WatchdogSec={interval:g}s)",
                 every=self.interval / 2, interval=self.interval)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]  # Twisted leaves it unannotated
        loop, self._loop = self._loop, None
        if loop is not None and loop.running:
            loop.stop()

    def _feed(self) -> None:
        """One ``WATCHDOG=1``; a failed send is logged by the notifier, and the loop goes on."""
        self._notifier.notify("WATCHDOG=1")


@attrs.define(eq=False, slots=False)
class Ready(Service):
    """``READY=1`` when it starts, ``STOPPING=1`` when it stops.

    The last child of the process's service: it starts once everything
    before it has, the listeners bound and listening, and it is the first
    to stop, as the graceful stop begins.
    """

    _notifier: Notifier
    #: The ``STATUS=`` line shown by ``systemctl status`` while running.
    status: str = "serving"
    #: False in a process a reload started: its predecessor, still the main process, sends
    #: ``MAINPID=`` and ``READY=1`` for it once it serves.
    ready: bool = True

    name = "ready"  # type: ignore[assignment]  # Twisted types Service.name as None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]  # Twisted leaves it unannotated
        if self.ready:
            self._notifier.notify("READY=1", f"STATUS={self.status}")

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]  # Twisted leaves it unannotated
        self._notifier.notify("STOPPING=1", "STATUS=stopping: answering parked requests, letting in-flight ones finish")
