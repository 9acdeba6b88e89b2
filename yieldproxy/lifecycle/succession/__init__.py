"""Reload and upgrade without losing a request: one process hands over to the next.

The old side is predecessor.py (two phases, one commit point), the new side
takeover.py; :class:`Succession` is the service that ties both into one proxy
(service.py builds it when tap.py gives it a :class:`Setup`): the SIGHUP
handler, the take-over at start, the state that crosses over, the signals and
hold changes the process without the holds must refuse (signals.py), the
pidfile and holds file at the commit (claims.py).  What a reload does and
keeps: docs/operating.md (*Reload: a new process takes everything over*).

Part of lifecycle/ (layer 9): it may import what lifecycle/ may (the proxy's
parked requests and the edge's connections go over through them), and the rest
of lifecycle/.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred, fail, gatherResults
from twisted.logger import Logger

from ... import __version__
from ...lot.state import ALL, Hold, YieldState
from ...upstream.pool.twins import TwinCheck
from ..holdstore import NOT_KEPT
from .claims import ClaimedAtCommit, PidFile
from .predecessor import Phase, Predecessor, ReloadBusy, ReloadFailed, ReloadRefused, ReloadUnavailable
from .signals import HoldSignals, StopNoted, unblock
from .takeover import ABORTED, ENV, Inheritance, TakeOver, refuse
from .wire import Carried

if TYPE_CHECKING:
    from ...edge.capacity import Connections
    from ...edge.listener import Listener
    from ...lot.parking import ParkingLot
    from ...proxy.handler import ProxyApp
    from ...schedule.scheduler import Scheduler
    from ...upstream.pool.twins import TwinVerifier
    from ...upstream.served import RecordKeeper

__all__ = [
    "ENV", "Carried", "ClaimedAtCommit", "Inheritance", "ReloadBusy", "ReloadFailed", "ReloadRefused",
    "ReloadUnavailable", "Setup", "Succession",
    "own_command", "refuse",
]

log = Logger()

#: Holds the successor's own watchers find again for themselves (the file, the command, the outage and
#: loading probes): the same that a restart does not keep (lifecycle/holdstore.py).
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
    #: Why this process cannot reload (how twistd was started): SIGHUP and ``POST /reload`` then only say so.
    #: None: it can.
    unavailable: str | None = None
    #: twistd's pidfile (an absolute path), or None: it names the process that serves (claims.py).
    pidfile: str | None = None
    #: Tells twistd not to remove the pidfile as this process exits (it handed it over).
    keep_pidfile: Callable[[], None] = lambda: None
    #: The holds file of a process a reload started, written from its commit on (claims.ClaimedAtCommit).
    holds: ClaimedAtCommit | None = None


@attrs.define(eq=False, slots=False, repr=False)
class Succession(Service):
    """The proxy's reload: SIGHUP, the admin API's ``/reload``, and the take-over at start."""

    _reactor: Any
    setup: Setup
    #: ``proxy`` and ``admin``: the listeners.
    _listeners: dict[str, Listener]
    #: ``proxy`` and ``admin``: their open connections.
    _connections: dict[str, Connections]
    _proxy_app: ProxyApp
    _lot: ParkingLot
    #: The scheduler: its members; after a handover whose new process is gone, what is left here is refused.
    _scheduler: Scheduler
    _state: YieldState
    _twins: TwinVerifier | None = None
    #: What each upstream served (served.RecordKeeper): the evidence of its outage verdicts crosses over too.
    _records: RecordKeeper | None = None
    _predecessor: Predecessor = attrs.field(init=False)
    _takeover: TakeOver | None = attrs.field(init=False, default=None)
    _previous_handler: Any = None
    _pidfile: PidFile = attrs.field(init=False)
    _hold_signals: HoldSignals = attrs.field(init=False)
    _stops: StopNoted = attrs.field(init=False, factory=StopNoted)

    name = "succession"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._pidfile = PidFile(self.setup.pidfile, self.setup.keep_pidfile)
        self._hold_signals = HoldSignals(self._reactor)
        self._predecessor = Predecessor(
            self._reactor, self.setup.command, self.setup.environ, self._listeners, self._connections, self._lot,
            self._scheduler, self.snapshot, self.setup.stop, self.setup.notify, unavailable=self.setup.unavailable,
            on_phase=self._phase_changed,
            predecessor_alive=lambda: self._takeover is not None and self._takeover.linked,
        )
        if self.setup.inheritance is not None:
            self._takeover = TakeOver(
                self._reactor, self.setup.inheritance, self._listeners, self._proxy_app.adopt, self.restore,
                scheduler=self._scheduler, claim=self._claim, relay=self._predecessor.relay, stop_process=self.setup.stop,
                on_serving=self._serving, holds_from_file=self._holds_from_file,
            )

    def startService(self) -> None:
        super().startService()
        if self.setup.signals:
            try:
                # A plain function (see signals._handler): the previous handler is returned as an enum if it can.
                self._previous_handler = signal.signal(signal.SIGHUP, lambda signum, frame: self._on_sighup(signum, frame))
            except (ValueError, OSError) as e:
                log.error("reload: cannot install the SIGHUP handler: {error}", error=e)
        if self._takeover is not None:
            if self.setup.signals:
                pid = self.setup.inheritance.pid if self.setup.inheritance is not None else None
                self._hold_signals.refuse(
                    lambda: f"while it takes over from pid {pid}, which has the holds until then (send it there)"
                )
            # Once the reactor runs: twistd's SIGTERM and SIGINT handlers are in by then.
            when_running = getattr(self._reactor, "callWhenRunning", None)
            if when_running is not None:
                when_running(self._begin)
            else:
                self._begin()

    def _begin(self) -> None:
        """Every handler is in: the signals that waited since this process's ``exec`` come in now."""
        if self.setup.signals:
            if self._takeover is not None:
                # A stop from now on is noted the instant it comes: a commit that reaches this process before the
                # stop does is not made (the predecessor keeps everything).
                self._stops.watch(self._takeover.stop_signalled)
            unblock()
        if self._takeover is not None and self.running:
            self._takeover.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        link_ended: Deferred[None] | None = None
        if self._takeover is not None:
            link_ended = self._takeover.stop()
        stopped = self._predecessor.stop()
        if self._previous_handler is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGHUP, self._previous_handler)
            self._previous_handler = None
        add_trigger = getattr(self._reactor, "addSystemEventTrigger", None)
        if add_trigger is not None:
            add_trigger("after", "shutdown", self._pidfile.remove_if_mine)
        if link_ended is None:
            return stopped
        return gatherResults([link_ended, stopped], consumeErrors=True).addCallback(lambda _: None)

    # -- who owns the holds --------------------------------------------------------------------

    def holds_elsewhere(self) -> str | None:
        """Why a hold change asked of this process now would not be kept (the admin API refuses it, 503),
        or None: the holds are this process's."""
        predecessor = self._predecessor
        if predecessor.phase in (Phase.COMMITTING, Phase.HANDED_OVER):
            return (f"this process (pid {os.getpid()}) has handed the holds over to pid {predecessor.successor_pid}, "
                    "which answers from now on")
        takeover = self._takeover
        if takeover is not None and not takeover.committed and takeover.state is not ABORTED:
            pid = self.setup.inheritance.pid if self.setup.inheritance is not None else None
            return f"this process (pid {os.getpid()}) takes over from pid {pid}, which has the holds until then"
        return None

    def _phase_changed(self, phase: Phase) -> None:
        """The signals and files that follow the holds, as the handover goes on (predecessor.Phase)."""
        successor = self._predecessor.successor_pid
        if phase is Phase.PREPARING and self.setup.signals:
            # This process still owns the holds: the signal watcher's signals take effect; none is fatal.
            self._hold_signals.refuse(lambda: "during a reload", only_fatal=True)
            self._stops.watch(self._predecessor.stop_signalled)
        elif phase is Phase.COMMITTING and self.setup.signals:
            self._hold_signals.refuse(
                lambda: f"after it handed the holds over to pid {successor} (send it there)"
            )
        elif phase is Phase.HANDED_OVER:
            # The holds are the new process's now: no lease runs out here (and the holds file, which
            # the new process claimed, is not written from here either: lifecycle/holdstore.py).
            self._state.stop()
            self._pidfile.give_up()
            self._stops.unwatch()
        elif phase is Phase.IDLE:
            self._hold_signals.restore()
            self._stops.unwatch()

    def _serving(self) -> None:
        """The take-over is done: this process owns the holds, its signals are its own again."""
        self._hold_signals.restore()
        self._stops.unwatch()

    def _claim(self) -> None:
        """The commit, in the new process: the holds file and the pidfile are its own now."""
        if self.setup.holds is not None:
            self.setup.holds.claim()
        self._pidfile.take()

    def _holds_from_file(self) -> None:
        """The predecessor died before the commit: the holds as it last wrote them (on the safe side: a
        hold it ended after this process started may come back, one it took is not missed)."""
        store = self.setup.holds
        if store is None:
            return
        loaded = store.load()
        if getattr(loaded, "refused", None) is None:
            self._state.restore(h for h in loaded.holds if self._state.hold_of(h.source, h.scope) != h)

    def _on_sighup(self, signum, frame) -> None:
        """The Python-level handler: the reload runs in the reactor thread."""
        self._reactor.callFromThread(self.sighup)

    def sighup(self) -> None:
        log.info("reload: SIGHUP received (pid {pid}, version {version})", pid=os.getpid(), version=__version__)
        self.reload().addErrback(lambda failure: None)

    def reload(self) -> Deferred[dict[str, Any]]:
        """Hand over to a new process (see the package docstring); fails with :class:`ReloadRefused`,
        :class:`ReloadFailed` or :class:`ReloadBusy`, each logged here in one line."""
        d: Deferred[dict[str, Any]]
        if self._takeover is not None and not self._takeover.done:
            d = fail(ReloadBusy("this process is still taking over from the one before it"))
        elif not self.running:
            d = fail(ReloadBusy("this process is stopping"))
        else:
            d = Deferred.fromCoroutine(self._predecessor.reload())

        def failed(failure):
            why = failure.value
            if failure.check(ReloadRefused):
                log.error("reload refused: {why}; still running version {version} (pid {pid}), nothing dropped",
                          why=str(why), version=__version__, pid=os.getpid())
            elif failure.check(ReloadBusy):
                log.warn("reload not started: {why} (pid {pid}, version {version})",
                         why=str(why), pid=os.getpid(), version=__version__)
            elif failure.check(ReloadFailed, ReloadUnavailable):
                log.error("reload failed: {why}; still running version {version} (pid {pid}), nothing dropped",
                          why=str(why), version=__version__, pid=os.getpid())
            else:
                log.failure("reload failed", failure)
            return failure

        d.addErrback(failed)
        # Whoever asked may go away (the admin client's timeout, a ^C: Klein cancels its Deferred): the
        # handover goes on regardless.  Cancelled halfway, it would kill a new process holding part of the lot.
        outcome: Deferred[dict[str, Any]] = Deferred(lambda _: None)
        d.addBoth(lambda result: None if outcome.called else outcome.callback(result))
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
            urls = {m.name: m.spec.url for m in self._scheduler.members}
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
            urls = {m.name: m.spec.url for m in self._scheduler.members}
            for row in message.get("twins", []):
                member, reference = row.get("member"), row.get("reference")
                if urls.get(member) != row.get("url") or urls.get(reference) != row.get("reference_url"):
                    continue  # another server under that name now: verified again here
                self._twins.checks[(member, row["key"])] = TwinCheck(
                    reference=reference, result=row["result"], at=row["at"], worst_cosine=row.get("worst_cosine"),
                    dimension=row.get("dimension"), reason=row.get("reason", ""),
                )
