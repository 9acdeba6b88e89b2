"""Signals while a reload is under way: queued in the kernel or refused with a log line, never fatal.

A new process is born with :data:`HANDOVER_SIGNALS` blocked (the mask is
inherited across ``exec``: :func:`blocked_in_children` is held while it is
started), so one sent in its first moments, before any handler is installed,
waits in the kernel instead of ending it; it unblocks them (:func:`unblock`)
once its handlers are in.  The process that does not own the holds refuses
SIGUSR1 and SIGUSR2 with a log line (:class:`HoldSignals`).  What each signal
does during a reload: docs/operating.md (*Hold changes and signals during a reload*).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Callable, Iterator

import attrs
from twisted.logger import Logger

log = Logger()

#: Blocked from a new process's ``exec`` until its handlers are in.
HANDOVER_SIGNALS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2})
#: The signal watcher's (watchers/signals.py).
HOLD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: A stop (twistd's handlers).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def blocked_in_children() -> Iterator[None]:
    """Block :data:`HANDOVER_SIGNALS` in this thread meanwhile: a child started now is born with them
    blocked.  One sent to this process meanwhile waits, and comes once they are unblocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HANDOVER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock() -> None:
    """The handlers are in: let the signals that waited (and the ones to come) in."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDOVER_SIGNALS)


def _handler(method: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    """A plain function for ``signal.signal``: Python's ``signal.signal`` and ``getsignal`` turn the handler they
    return into an enum when they can, and the failed lookup formats the handler's repr (a bound method's
    includes its object's, which for the succession is the whole proxy: seconds with a large lot)."""

    def handle(signum, frame) -> None:
        method(signum, frame)

    return handle


def _put_back(previous: dict, unless_replaced: Any = None) -> None:
    """Put back each signal's ``previous`` handler (None: the default action), and forget them; with
    ``unless_replaced``, only where that handler is still the one in place."""
    for signum, handler in previous.items():
        with contextlib.suppress(ValueError, OSError):
            if unless_replaced is None or signal.getsignal(signum) is unless_replaced:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    previous.clear()


@attrs.define(eq=False, repr=False)
class HoldSignals:
    """SIGUSR1 and SIGUSR2 refused with a log line (:meth:`refuse`) until :meth:`restore`."""

    #: Needs only ``callFromThread``.
    _reactor: Any
    #: The handlers in place before (the signal watcher's, or the default action).
    _previous: dict = attrs.Factory(dict)
    #: Why they are refused now, in a few words (read as each signal comes).
    _why: Callable[[], str] = lambda: ""
    _handle: Any = None

    def __attrs_post_init__(self) -> None:
        self._handle = _handler(self._on_signal)

    def refuse(self, why: Callable[[], str], only_fatal: bool = False) -> None:
        """Refuse both from now on, saying ``why()``; with ``only_fatal``, only those nothing handles (whose
        default action would end the process)."""
        self._why = why
        for signum in HOLD_SIGNALS:
            current = signal.getsignal(signum)
            if only_fatal and current not in (signal.SIG_DFL, None) and signum not in self._previous:
                continue
            try:
                previous = signal.signal(signum, self._handle)
            except (ValueError, OSError):
                continue  # not the main thread: an embedding application's signals are its own
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        """Put back what handled them before."""
        _put_back(self._previous)

    def _on_signal(self, signum, frame) -> None:
        self._reactor.callFromThread(self._refused, signum)

    def _refused(self, signum: int) -> None:
        name = signal.Signals(signum).name
        previous = self._previous.get(signum)
        if previous in (signal.SIG_DFL, None):
            log.info("{name} received by pid {pid} during a reload: ignored (watchers.signals is off)",
                     name=name, pid=os.getpid())
            return
        log.warn("{name} received by pid {pid} {why}: the signal hold is not {what} here",
                 name=name, pid=os.getpid(), why=self._why(),
                 what="taken" if signum == signal.SIGUSR1 else "ended")


@attrs.define(eq=False, repr=False)
class StopNoted:
    """SIGTERM and SIGINT noted the instant they come (:meth:`watch`), then handled as before (twistd's stop).

    The stop they start reaches the reload a reactor turn or more later; a reload that commits meanwhile must
    know a stop was asked before it names the new process as the one that serves."""

    _previous: dict = attrs.Factory(dict)
    _note: Callable[[], None] = lambda: None
    _handle: Any = None

    def __attrs_post_init__(self) -> None:
        self._handle = _handler(self._on_signal)

    def watch(self, note: Callable[[], None]) -> None:
        self._note = note
        for signum in STOP_SIGNALS:
            if signum in self._previous:
                continue
            with contextlib.suppress(ValueError, OSError):
                self._previous[signum] = signal.signal(signum, self._handle)

    def unwatch(self) -> None:
        """Put back the handlers there were, unless another took over meanwhile (the stop's own)."""
        _put_back(self._previous, unless_replaced=self._handle)

    def _on_signal(self, signum, frame) -> None:
        self._note()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
