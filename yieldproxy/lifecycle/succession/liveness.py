"""Whether the old process is gone, read from what cannot lie: its pidfd, and how the link ended.

A new process must tell "the old process ended the handover" (it keeps
everything: let go) from "the old process died" (no one else has what it
holds: take over).  The parent's pid from ``getppid`` cannot tell them
apart: it stays the dying parent's until the kernel reparents its children,
after it has closed the parent's descriptors, so the link's end is read
while the parent still looks alive.  Two facts can:

* the link's end: the old process says ``abort`` before every end it
  chooses (link.py's farewell), so an end without it is its process's end;
* the old process's pidfd (``pidfd_open``, Linux 5.3), opened while it is
  this process's parent: it becomes readable when, and only when, that
  process has exited, whatever its pid reads meanwhile.

:func:`fate` decides from them; :class:`Peer` waits for the pidfd.
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFDSet, IReadDescriptor
from zope.interface import implementer

#: Seconds a link's end without a farewell waits for the pidfd to confirm the exit: the kernel closes an
#: exiting process's descriptors a moment before it marks it exited.
CONFIRM_SECONDS = 5.0


class Fate(enum.Enum):
    """What a new process before its commit makes of the link's end."""

    #: The old process ended the handover (or this one did): it keeps everything, this one lets go.
    LET_GO = "let_go"
    #: The old process is gone: what this one holds has no other owner, it takes over.
    TAKE_OVER = "take_over"
    #: The end alone does not say: the pidfd's answer decides.
    ASK_PIDFD = "ask_pidfd"


def fate(farewell_read: bool, ended_here: bool, pidfd: bool) -> Fate:
    """The link ended before the commit: ``farewell_read`` (an ``abort`` came), ``ended_here`` (this
    process closed it), ``pidfd`` (the old process's pidfd is open here)."""
    if farewell_read or ended_here:
        return Fate.LET_GO
    # No farewell: the old process's end.  Its pidfd confirms it where there is one.
    return Fate.ASK_PIDFD if pidfd else Fate.TAKE_OVER


@implementer(IReadDescriptor)
class _Readable:
    """The pidfd in the reactor: readable once the process has exited."""

    def __init__(self, reactor: Any, fd: int, done: Deferred[bool]):
        self._reactor = reactor
        self._fd = fd
        self._done = done

    def fileno(self) -> int:
        return self._fd

    def doRead(self) -> None:
        self._reactor.removeReader(self)
        if not self._done.called:
            self._done.callback(True)

    def connectionLost(self, reason: Any) -> None:
        """Removed from the reactor."""

    def logPrefix(self) -> str:
        return "predecessor-exit"


@attrs.define(eq=False)
class Peer:
    """The old process, by a pidfd opened while it was this process's parent (None where there is none)."""

    pid: int
    pidfd: int | None = None

    @classmethod
    def open(cls, pid: int) -> "Peer":
        """Open ``pid``'s pidfd; checked against ``getppid`` after it is open (while this process is its child,
        its pid cannot be another's): a pid that is no longer the parent's gets none."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return cls(pid)
        if os.getppid() != pid:
            os.close(fd)
            return cls(pid, None)
        os.set_inheritable(fd, False)
        return cls(pid, fd)

    def exited_now(self) -> bool:
        """Whether the pidfd already says the process has exited (no pidfd: False)."""
        if self.pidfd is None:
            return False
        readable, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(readable)

    def exited(self, reactor: Any, within: float = CONFIRM_SECONDS) -> Deferred[bool]:
        """Fires True once the process has exited, False if it is still there after ``within`` seconds."""
        done: Deferred[bool] = Deferred()
        if self.pidfd is None or self.exited_now():
            done.callback(self.pidfd is not None)
            return done
        watcher = _Readable(reactor, self.pidfd, done)
        if IReactorFDSet.providedBy(reactor):
            reactor.addReader(watcher)
        timer = reactor.callLater(within, lambda: None if done.called else done.callback(self.exited_now()))

        def settled(result: bool) -> bool:
            if timer.active():
                timer.cancel()
            if IReactorFDSet.providedBy(reactor):
                reactor.removeReader(watcher)
            return result

        return done.addCallback(settled)

    def close(self) -> None:
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
