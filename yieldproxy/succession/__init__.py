"""Reload and upgrade without losing a request: one process hands over to the next.

SIGHUP, ``POST /reload``, ``yieldproxy reload`` and ``systemctl reload``
all start the same succession (predecessor.py): a new process running the
*installed* code with the same command line reads and validates the config,
takes over the listening sockets, the holds, the twins' verifications and
every parked request with its client's connection (takeover.py), while
this process finishes what is in flight and exits.  A config the new code
refuses comes back as one line, and this process keeps running.

:class:`Succession` is the service that ties both sides into one proxy
(service.py builds it when tap.py gives it a :class:`Setup`): it installs
the SIGHUP handler, runs the take-over when this process was started by a
reload, and snapshots and restores the state that crosses over.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Sequence

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from .. import __version__
from ..holdstore import NOT_KEPT
from ..pool.twins import TwinCheck
from ..state import ALL, Hold, YieldState
from .predecessor import Predecessor, ReloadBusy, ReloadFailed, ReloadRefused, ReloadUnavailable
from .takeover import ENV, Inheritance, TakeOver, refuse
from .wire import Carried

__all__ = [
    "ENV", "Carried", "Inheritance", "ReloadBusy", "ReloadFailed", "ReloadRefused", "ReloadUnavailable", "Setup",
    "Succession",
    "own_command", "refuse",
]

log = Logger()

#: Holds the successor's own watchers find again for themselves (the file, the command, the outage and
#: loading probes): the same that a restart does not keep (holdstore.py).
NOT_CARRIED = NOT_KEPT


def own_command(argv: Sequence[str] | None = None, executable: str | None = None) -> tuple[str, ...]:
    """This process's command line as it was started (``python -m twisted ...`` or ``.../twistd ...``): its
    successor runs the same, with the code installed now."""
    argv = list(sys.orig_argv if argv is None else argv)
    return (executable or sys.executable, *argv[1:])


@attrs.frozen
class Setup:
    """What tap.py gives a proxy that can reload: how to start a successor, how to stop, what it inherited."""

    command: tuple[str, ...]
    environ: dict[str, str]
    #: Ends this process (the reactor's stop).
    stop: Callable[[], None]
    #: What a process started by a reload took from its predecessor (None: a plain start).
    inheritance: Inheritance | None = None
    #: systemd's notify socket (``notify(*lines)``), or nothing.
    notify: Callable[..., Any] = lambda *lines: None
    #: Install the SIGHUP handler (off where the process's signals are not ours).
    signals: bool = True
    #: Why this process cannot reload (twistd not in the foreground, a pidfile): SIGHUP and ``POST /reload``
    #: then only say so.  None: it can.
    unavailable: str | None = None


@attrs.define(eq=False, slots=False)
class Succession(Service):
    """The proxy's reload: SIGHUP, the admin API's ``/reload``, and the take-over at start."""

    _reactor: Any
    setup: Setup
    #: ``proxy`` and ``admin``: the listeners.
    _listeners: dict[str, Any]
    #: ``proxy`` and ``admin``: their open connections.
    _connections: dict[str, Any]
    _proxy_app: Any
    _lot: Any
    _pool: Any
    _state: YieldState
    _twins: Any = None
    #: What each upstream served (served.RecordKeeper): the evidence of its outage verdicts crosses over too.
    _records: Any = None
    _predecessor: Predecessor = attrs.field(init=False)
    _takeover: TakeOver | None = attrs.field(init=False, default=None)
    _previous_handler: Any = None

    name = "succession"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._predecessor = Predecessor(
            self._reactor, self.setup.command, self.setup.environ, self._listeners, self._connections, self._lot,
            self._pool, self.snapshot, self.setup.stop, self.setup.notify, unavailable=self.setup.unavailable,
        )
        if self.setup.inheritance is not None:
            self._takeover = TakeOver(
                self._reactor, self.setup.inheritance, self._listeners, self._proxy_app.adopt, self.restore,
            )

    def startService(self) -> None:
        super().startService()
        if self.setup.signals:
            try:
                self._previous_handler = signal.signal(signal.SIGHUP, self._on_sighup)
            except (ValueError, OSError) as e:
                log.error("reload: cannot install the SIGHUP handler: {error}", error=e)
        if self._takeover is not None:
            self._takeover.start()

    def stopService(self) -> None:
        super().stopService()
        self._predecessor.stop()
        if self._previous_handler is not None:
            try:
                signal.signal(signal.SIGHUP, self._previous_handler)
            except (ValueError, OSError):
                pass
            self._previous_handler = None

    def _on_sighup(self, signum, frame) -> None:
        """The Python-level handler: the reload runs in the reactor thread."""
        self._reactor.callFromThread(self.sighup)

    def sighup(self) -> None:
        log.info("reload: SIGHUP received (pid {pid}, version {version})", pid=os.getpid(), version=__version__)
        self.reload().addErrback(lambda failure: None)

    def reload(self) -> Deferred[dict[str, Any]]:
        """Hand over to a new process (see the package docstring); fails with :class:`ReloadRefused`,
        :class:`ReloadFailed` or :class:`ReloadBusy`, each logged here in one line."""
        if self._takeover is not None and not self._takeover.done:
            d: Deferred[dict[str, Any]] = Deferred()
            d.errback(ReloadBusy("this process is still taking over from the one before it"))
        else:
            d = Deferred.fromCoroutine(self._predecessor.reload())

        def failed(failure):
            why = failure.value
            if failure.check(ReloadRefused):
                log.error("reload refused: {why}; still running version {version} (pid {pid}), nothing dropped",
                          why=str(why), version=__version__, pid=os.getpid())
            elif failure.check(ReloadFailed, ReloadBusy, ReloadUnavailable):
                log.error("reload failed: {why}; still running version {version} (pid {pid}), nothing dropped",
                          why=str(why), version=__version__, pid=os.getpid())
            else:
                log.failure("reload failed", failure)
            return failure

        def handed_over(outcome: dict[str, Any]) -> dict[str, Any]:
            # The holds are the new process's now: no lease runs out here (and the holds file, which
            # the new process claimed, is not written from here either: holdstore.py).
            self._state.stop()
            return outcome

        d.addCallbacks(handed_over, failed)
        # Whoever asked may go away (the admin client's timeout, a ^C: Klein cancels its Deferred): the
        # handover goes on regardless.  Cancelled halfway, it would kill a new process holding part of the lot.
        outcome: Deferred[dict[str, Any]] = Deferred(lambda _: None)

        def tell(result: Any) -> None:
            if not outcome.called:
                outcome.callback(result)

        d.addBoth(tell)
        return outcome

    # -- what crosses over besides the lot --------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The holds (but those the successor's own watchers find again), the twins' last verifications, and
        what each upstream served (the record its outage verdicts rest on)."""
        holds = [
            {**h.as_json(), "scope": h.scope} for h in self._state.holds if h.source not in NOT_CARRIED
        ]
        twins = []
        if self._twins is not None:
            urls = {m.name: m.spec.url for m in self._pool.members}
            for (member, key), check in self._twins.checks.items():
                twins.append({
                    "member": member, "url": urls.get(member), "reference_url": urls.get(check.reference),
                    "key": key, **attrs.asdict(check),
                })
        snapshot: dict[str, Any] = {"holds": holds, "twins": twins}
        if self._records is not None:
            snapshot["served"] = self._records.section()
        return snapshot

    def restore(self, message: dict[str, Any]) -> None:
        """Make this process's holds and twins what the predecessor's were (see :meth:`snapshot`), and add what
        its upstreams served to what this one read from the holds file."""
        if self._records is not None:
            self._records.restore(message.get("served"), "reload")
        wanted: dict[tuple[str, str], Hold] = {}
        for h in message.get("holds", []):
            try:
                hold = Hold(
                    source=h["source"], reason=h.get("reason") or "", since=float(h["since"]),
                    expected_end=h.get("expected_end"), expires_at=h.get("expires_at"), scope=h.get("scope", ALL),
                )
            except (KeyError, TypeError, ValueError) as e:
                log.warn("reload: a hold that came over is not one ({why}): {hold!r}", why=str(e), hold=h)
                continue
            wanted[(hold.source, hold.scope)] = hold
        for hold in self._state.holds:
            if hold.source not in NOT_CARRIED and (hold.source, hold.scope) not in wanted:
                # Ended in the old process after this one read the holds file.
                self._state.release(hold.source, hold.scope)
        # Each as it was (its start, its lease end); one of an upstream gone from the config is dropped, logged.
        self._state.restore(
            h for key, h in wanted.items() if self._state.hold_of(h.source, h.scope) != h
        )
        if self._twins is not None:
            urls = {m.name: m.spec.url for m in self._pool.members}
            for row in message.get("twins", []):
                member, reference = row.get("member"), row.get("reference")
                if urls.get(member) != row.get("url") or urls.get(reference) != row.get("reference_url"):
                    continue  # another server under that name now: verified again here
                self._twins.checks[(member, row["key"])] = TwinCheck(
                    reference=reference, result=row["result"], at=row["at"], worst_cosine=row.get("worst_cosine"),
                    dimension=row.get("dimension"), reason=row.get("reason", ""),
                )
