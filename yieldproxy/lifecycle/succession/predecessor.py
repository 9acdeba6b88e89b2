"""The running process's side of a reload: start a successor, hand everything over in two phases, finish, go.

A reload starts a fresh process with this one's command line (the installed
code, so an upgrade underneath is what runs next).  A config it refuses comes
back as one line (:class:`ReloadRefused`) and this process keeps running.
Otherwise the handover has one commit point, so that each connection, each
parked request and the holds have one owner at every instant: before it, this
process owns everything and sends copies it keeps paused (connections.py); at
it, it stops accepting, diverts what it reads (:func:`~.connections.divert`)
and sends ``commit``; the new process acts on ``committed`` once that frame
has left it (:meth:`~.link.Link.flushed`).  A new process that ends before
the commit costs nothing: :meth:`Predecessor._take_back` takes everything
back.  After the commit this process finishes what is in flight and passes
on what still comes, then stops.

The two phases, and what a death or a stop at each moment does:
docs/operating.md (*Reload: a new process takes everything over*).
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import attrs
from twisted.internet.defer import Deferred, TimeoutError, succeed
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger

from ... import __version__
from ...edge.sockets import family_of
from ...periodic import every
from ...states import Machine, Moves
from ..sdnotify import monotonic_usec
from . import moments
from .connections import Exported, divert, export_idle, export_parked, export_unhandled, idle_connections, serve_here
from .link import Link, adopt_link
from .signals import blocked_in_children
from .takeover import ENV
from .wire import BATCH_FDS, PROTOCOL, Carried, cut, encode, pack

if TYPE_CHECKING:
    from ...edge.capacity import Connections
    from ...edge.listener import Listener
    from ...lot.parking import ParkingLot
    from ...schedule.scheduler import Scheduler

log = Logger()

#: How often the exit of a successor not yet serving is looked for.
CHILD_POLL_SECONDS = 0.05
#: How often the winding-down process looks for connections gone idle (and written out).
WIND_DOWN_STEP = 0.05
#: The longest the old process stays after a handover, finishing what is in flight (each request
#: has its own bounds well below this).
WIND_DOWN_MAX_SECONDS = 3600.0
#: Rounds of the prepare phase at most: each sends what parked or went idle during the last one.
PREPARE_ROUNDS = 4
#: A round that sent no more than this many is the last before the commit (whose own tail is smaller still).
SMALL_ROUND = BATCH_FDS
#: Seconds a stopping process waits for the new process it told to stop to be gone (its copies of the
#: listening sockets closed) before it ends it.
ABORT_SECONDS = 10.0
#: Seconds a process stopped during a reload waits for the new process, which had committed and stops too
#: (its own stop answers what it took, within its proxy.shutdown_timeout_seconds).
STOP_BOTH_SECONDS = 120.0


class ReloadRefused(Exception):
    """The new process refused to start (its config, its options): the one line it gave."""


class ReloadFailed(Exception):
    """The new process did not take over; this one keeps everything and goes on."""


class ReloadBusy(Exception):
    """A reload is under way already, or this process has handed over."""


class ReloadUnavailable(Exception):
    """This process cannot start a successor (how it was started does not allow it): the reason."""


class Phase(enum.Enum):
    """Where this process is in handing over (see the module docstring)."""

    IDLE = "idle"
    STARTING = "starting"
    PREPARING = "preparing"
    COMMITTING = "committing"
    HANDED_OVER = "handed_over"


IDLE, STARTING, PREPARING, COMMITTING = Phase.IDLE, Phase.STARTING, Phase.PREPARING, Phase.COMMITTING
HANDED_OVER = Phase.HANDED_OVER

#: What each event of a reload does to this process's phase; any other is a bug (:class:`~yieldproxy.states.Unexpected`).
PHASE_MOVES: Moves[Phase, str] = Moves("a handover's old process", {
    # A reload is asked for: the successor is started.
    (IDLE, "reload"): STARTING,
    # The successor said ``ready``: the lot goes over, round after round.
    (STARTING, "ready"): PREPARING,
    # ``commit`` is sent: accepting paused, what is read is diverted.
    (PREPARING, "commit"): COMMITTING,
    # ``committed`` is read: what this process held is the successor's.
    (COMMITTING, "committed"): HANDED_OVER,
    # The successor will not commit: everything it was sent is served here again.
    (PREPARING, "taken_back"): IDLE,
    (COMMITTING, "taken_back"): IDLE,
    # The reload failed, whatever it had reached (taken back already: nothing moves).
    **{(phase, "failed"): IDLE for phase in Phase},
})


class _Successor:
    """The successor as a child process: :attr:`ended` fires with how it exited, while it is watched.

    Started with :class:`subprocess.Popen` (vfork, descriptors closed by
    ``close_range``), not ``spawnProcess``, whose fork and descriptor walk
    held this process's reactor for seconds with thousands of connections
    open (bench/handover.py), and with the handover's signals blocked
    (signals.py).  Its exit is polled while it is watched (Twisted reaps only
    the processes it started itself).
    """

    def __init__(self, reactor, command: Sequence[str], env: dict[str, str], fd: int):
        with blocked_in_children():
            self.popen = subprocess.Popen(list(command), env=env, pass_fds=(fd,), close_fds=True)
        self.pid = self.popen.pid
        self.ended: Deferred[Any] = Deferred()
        self._watch = LoopingCall(self._poll)
        self._watch.clock = reactor
        self._watch.start(CHILD_POLL_SECONDS, now=False)

    def _poll(self) -> None:
        code = self.popen.poll()
        if code is not None:
            self.forget()
            self.ended.callback(f"status {code}" if code >= 0 else f"signal {-code}")

    def forget(self) -> None:
        """Stop watching (it took over: its exit is its own business now)."""
        if self._watch.running:
            self._watch.stop()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM): its own stop answers what it took, as any stop does."""
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                self.popen.kill()


def _within(d: Deferred, seconds: float, clock) -> Deferred:
    """``d``'s result, or a TimeoutError after ``seconds``, without cancelling ``d`` itself."""
    waiter: Deferred = Deferred()

    def settle(result: Any) -> Any:
        if not waiter.called:
            waiter.callback(result)
        return result

    d.addCallback(settle)
    return waiter.addTimeout(seconds, clock)


@attrs.define(eq=False, repr=False)
class Predecessor(Machine[Phase, str]):
    """Hands this process over to a successor (see the module docstring); its phase is driven by
    :data:`PHASE_MOVES`."""

    moves = PHASE_MOVES

    _reactor: Any
    #: The command that starts a successor (this process's own command line).
    command: Sequence[str]
    environ: dict[str, str]
    #: ``proxy`` and ``admin``: the listeners.
    _listeners: dict[str, Listener]
    #: ``proxy`` and ``admin``: each listener's open connections (their idle ones go over).
    _connections: dict[str, Connections]
    _lot: ParkingLot
    #: The scheduler: what is in flight; after the handover, if the new process is gone, what is left here
    #: is refused (503).
    _scheduler: Scheduler
    #: ``snapshot()``: the holds and twins the successor restores (a JSON-able dict).
    _snapshot: Callable[[], dict[str, Any]]
    #: Ends this process (the reactor's stop, from tap.py).
    _stop: Callable[[], None]
    #: ``notify(*lines)``: systemd's notify socket (sdnotify), or nothing.
    _notify: Callable[..., Any] = lambda *lines: None
    #: Seconds the successor has to start and say ``ready``, and then each time to say it took a batch.
    timeout: float = 60.0
    #: Why this process cannot reload at all (None: it can).
    unavailable: str | None = None
    #: Told of every change of :attr:`phase` (the succession's signals, pidfile, holds).
    _on_phase: Callable[[Phase], None] = lambda phase: None
    #: Whether the process before this one (two reloads in a row) may still send it connections.
    _predecessor_alive: Callable[[], bool] = lambda: False
    #: Its named state (:data:`PHASE_MOVES`), read as :attr:`phase`.
    state: Phase = attrs.field(default=IDLE, init=False)
    _link: Link | None = None
    _waiting: dict[str, Deferred] = attrs.Factory(dict)
    #: The frames (ids) carrying what was handed over that the successor has not said it has yet (their
    #: descriptors are the link's: :meth:`~.link.Link.send`).
    _unacked: set[int] = attrs.Factory(set)
    #: Waiting for the successor to have every frame sent so far.
    _taken_waiters: list[Deferred] = attrs.Factory(list)
    _frames: int = 0
    _wind_down: LoopingCall | None = None
    _successor_pid: int | None = None
    #: The new process while a reload is under way.
    _child: _Successor | None = None
    #: Fires (with why) when this process is told to stop during a reload.
    _stop_asked: Deferred | None = None
    #: This process was told to stop while a reload was under way.
    _stopping: bool = False
    #: A SIGTERM or SIGINT came during the reload (set by the signal handler itself: :meth:`stop_signalled`),
    #: before the stop it starts reaches this object.
    _stop_signalled: bool = False
    #: Stopped during the reload after the new process committed: it was asked to stop too, and this one
    #: waits for it (it is still systemd's main process).
    _stopping_both: bool = False
    #: Fires when the reload under way ends, whichever way.
    _reload_over: Deferred | None = None
    #: When the successor last said anything (a large lot is waited for while it keeps taking it).
    _last_heard: float = 0.0
    #: What went over before the commit, still held (paused) here: parked requests with their waiters...
    _pending_parked: list[tuple[Exported, Deferred[bool]]] = attrs.Factory(list)
    #: ...and connections.
    _pending_connections: list[Exported] = attrs.Factory(list)
    #: Requests read while the commit's outcome is awaited: sent on after it, or answered here.
    _queued: list[Any] = attrs.Factory(list)
    #: Requests read after the commit, to send on at the reactor's next turn.
    _outgoing: list[Any] = attrs.Factory(list)
    _undivert: Callable[[], None] | None = None
    #: Holds the lot's release from the commit on (for good once handed over).
    _frozen: Deferred | None = None
    _parked_flush: Any = None
    sent_parked: int = 0
    sent_connections: int = 0

    def __attrs_post_init__(self) -> None:
        # After the handover a request that parks again (a failed attempt) goes over as it parks.
        when_parked = getattr(self._lot, "when_parked", None)
        if when_parked is not None:
            when_parked(self._parked_again)

    @property
    def phase(self) -> Phase:
        """Where this process is in handing over: its named state (:data:`PHASE_MOVES`)."""
        return self.state

    @property
    def handed_over(self) -> bool:
        return self.state is HANDED_OVER

    @property
    def successor_pid(self) -> int | None:
        return self._successor_pid

    def _go(self, event: str) -> None:
        """Move as :data:`PHASE_MOVES` says on ``event``; the succession is told of a new phase."""
        old = self.state
        phase = self.fire(event)
        if phase is old:
            return
        try:
            self._on_phase(phase)
        except Exception:
            log.failure("reload: reacting to the handover's {phase} failed", phase=phase.value)

    async def reload(self) -> dict[str, Any]:
        """Start a successor and hand over to it; the outcome, or :class:`ReloadRefused`/``Failed``/``Busy``."""
        if self.unavailable is not None:
            raise ReloadUnavailable(self.unavailable)
        if self.handed_over:
            raise ReloadBusy(f"this process (pid {os.getpid()}) has handed over to pid {self._successor_pid} already")
        if self.state is not IDLE:
            raise ReloadBusy("a reload is under way already")
        if self._stopping:
            raise ReloadBusy("this process is stopping")
        self._go("reload")
        self._reload_over = Deferred()
        self._stop_asked = Deferred()
        began = self._reactor.seconds()
        self._notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}")
        try:
            return await self._reload(began)
        except BaseException:
            self._go("failed")
            self._notify("READY=1", f"STATUS=serving (version {__version__}; the last reload failed)")
            raise
        finally:
            over, self._reload_over = self._reload_over, None
            over.callback(None)

    async def _reload(self, began: float) -> dict[str, Any]:
        self.sent_parked = self.sent_connections = 0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # systemd's watchdog is the successor's to feed once it is the main process: not bound to this pid.
        environ = {k: v for k, v in self.environ.items() if k != "WATCHDOG_PID"}
        try:
            self._send_listeners(ours)
            child = _Successor(self._reactor, self.command, {**environ, ENV: str(theirs.fileno())}, theirs.fileno())
        except OSError as e:
            ours.close()
            raise ReloadFailed(f"cannot start the new process ({self.command[0]}): {e}") from None
        finally:
            theirs.close()
        self._child = child
        self._successor_pid = child.pid
        self._waiting = {kind: Deferred() for kind in ("ready", "refused", "committed", "aborting")}
        self._last_heard = self._reactor.seconds()
        # Every end of the link this process chooses says ``abort`` first: an end without it is its death, and
        # the new process then takes over what it holds (liveness.py).
        link = self._link = adopt_link(self._reactor, ours, self._message, farewell={"type": "abort"})
        moments.reached("started")
        try:
            ready = await self._wait(self._waiting["ready"])
            if ready.get("protocol") != PROTOCOL:
                raise ReloadFailed(
                    f"the new process speaks handover protocol {ready.get('protocol')!r}, not {PROTOCOL}"
                )
        except BaseException:
            self._give_up(kill=not self._stopping)
            raise
        handing = self._reactor.seconds()
        self._go("ready")
        moments.reached("preparing")
        try:
            await self._prepare(link)
            if self._stop_signalled:
                raise ReloadFailed("this process was told to stop")
            paused_at = self._reactor.seconds()
            self._commit(link)
            await self._wait(self._waiting["committed"], committing=True)
            committed_at = self._reactor.seconds()
        except Exception as e:
            if not isinstance(e, (ReloadFailed, ReloadRefused)):
                log.failure("reload: handing over failed")
            aborting = self._waiting["aborting"]
            self._give_up(kill=not (self._stopping or self._stop_signalled) and not aborting.called)
            parked, connections = self._take_back()
            raise ReloadFailed(
                f"{e}; this process took back the {parked} parked requests and {connections} connections it had "
                f"sent"
            ) from None
        self._handed_over(child, link, ready.get("version"), ready.get("listeners"))
        now = self._reactor.seconds()
        outcome = {
            "reloaded": True,
            "old_pid": os.getpid(),
            "old_version": __version__,
            "pid": ready.get("pid"),
            "version": ready.get("version"),
            "parked_handed_over": self.sent_parked,
            "connections_handed_over": self.sent_connections,
            "seconds": round(now - began, 3),
            # From "ready" to "committed": while the lot goes over (this process serving meanwhile).
            "handover_seconds": round(committed_at - handing, 3),
            # From the commit to "committed": while no process accepted a connection.
            "paused_seconds": round(committed_at - paused_at, 3),
        }
        log.info(
            "reload: handed over to pid {pid} (version {version}): {parked} parked requests, {connections} idle "
            "connections, in {seconds:.3f}s (the handover itself {handover:.3f}s, accepting paused {paused:.3f}s); "
            "finishing {inflight} requests in flight here, then exiting",
            pid=outcome["pid"], version=outcome["version"], parked=self.sent_parked,
            connections=self.sent_connections, seconds=outcome["seconds"], handover=outcome["handover_seconds"],
            paused=outcome["paused_seconds"], inflight=self._scheduler.inflight,
        )
        if self._stopping_both:
            # Told to stop before it named the new process: a stop is a stop, of both.
            log.warn("reload: this process was told to stop during the reload: pid {pid} stops too", pid=child.pid)
            child.terminate()
            self._end_wind_down()
        return outcome

    # -- the two phases -----------------------------------------------------------------------

    async def _prepare(self, link: Link) -> None:
        """Send the lot, round after round, each waited for until the successor holds it all, until a round is
        small (what comes next is the commit's tail).  The idle connections go with the tail: until then their
        clients are served here (one sent now would wait, unread, until the commit)."""
        for _ in range(PREPARE_ROUNDS):
            sent = await self._send_lot(link)
            await self._wait(self._all_taken())
            if sent <= SMALL_ROUND:
                return

    async def _send_lot(self, link: Link) -> int:
        """The lot, a batch at a time, in line order, the reactor turning between batches."""
        entries = self._lot.entries()
        sent = 0
        for start in range(0, len(entries), BATCH_FDS):
            if self._stop_asked is None or self._stop_asked.called or not link.open:
                break
            # One that left meanwhile (its client went, its time ran out, a release) is passed over.
            sent += self._send_parked(link, entries[start:start + BATCH_FDS], pending=True)
            await deferLater(self._reactor, 0, lambda: None)
        return sent

    def _commit(self, link: Link) -> None:
        """The commit, in one reactor turn (see the module docstring)."""
        for listener in self._listeners.values():
            listener.pause()
        self._frozen = Deferred()
        for member in self._scheduler.members:
            member.hold_release_until(self._frozen)
        self._undivert = divert((listener.factory for listener in self._listeners.values()), self._diverted)
        self._go("commit")
        self._send_parked(link, None, pending=True)
        self._send_connections(link, pending=True)
        link.send({"type": "commit", **self._snapshot()})

    def _handed_over(self, child: _Successor, link: Link, version: Any, taken: Any) -> None:
        """``committed``: what this process held for the successor is the successor's."""
        moments.reached("committed")
        # A stop that came during the reload, even this very moment, is a stop of both: the new process is
        # asked to stop too (and this one, still systemd's main process, waits for it).
        self._stopping_both = self._stopping or self._stop_signalled
        for exported, waiter in self._pending_parked:
            exported.let_go()
            waiter.callback(True)
        for exported in self._pending_connections:
            exported.let_go()
        self._pending_parked.clear()
        self._pending_connections.clear()
        self._go("committed")
        if not self._stopping_both:
            child.forget()
        for listener in self._listeners.values():
            if not isinstance(taken, list) or listener.key in taken:
                listener.release()  # the successor's now
            else:
                # It listens elsewhere now: closed here (what waits in the backlog is accepted, and goes over).
                listener.close()
        queued, self._queued = self._queued, []
        self._outgoing.extend(queued)
        self._flush_outgoing()
        # What parked again while the outcome was awaited (a failed attempt); the link ended (``committed`` read at
        # its end), it stays, answered here (:meth:`_successor_gone`).
        if link.open:
            self._send_parked(link, None, pending=False)
        if not self._stopping_both:
            self._notify(f"MAINPID={child.pid}", "READY=1", f"STATUS=serving (version {version})")
        link.closed.addCallback(self._successor_gone)
        self._start_wind_down()

    def _take_back(self) -> tuple[int, int]:
        """The successor will not commit: everything it was sent is served here again, as it was."""
        parked = len(self._pending_parked)
        connections = len(self._pending_connections)
        pending, self._pending_parked = self._pending_parked, []
        for exported, waiter in pending:
            exported.resume()
            waiter.callback(False)  # its waiter parks it again, in its place
        for exported in self._pending_connections:
            exported.resume()
        self._pending_connections.clear()
        self._stop_diverting()
        if self._frozen is not None:
            frozen, self._frozen = self._frozen, None
            frozen.callback(None)
        for listener in self._listeners.values():
            listener.resume()
        self._go("taken_back")
        queued, self._queued = self._queued, []
        for request in queued:
            serve_here(request)
        return parked, connections

    def _stop_diverting(self) -> None:
        """The sites' requests go to their own resources again (:func:`~.connections.divert`)."""
        undivert, self._undivert = self._undivert, None
        if undivert is not None:
            undivert()

    def _give_up(self, kill: bool) -> None:
        """The successor will not take over: it is told to let go (``abort``) or ended (``kill``: nothing of
        ours is lost with it), and the link closes.

        It is still watched until its exit is seen: that reaps it (forgotten, it would stay a zombie)."""
        if self._link is not None:
            self._link.close()  # with its farewell: abort
        if kill and self._child is not None:
            self._child.kill()
        self._unacked.clear()  # it will not say it has them now
        self._fire_taken()

    # -- the link ---------------------------------------------------------------------------

    def _send_listeners(self, sock: socket.socket) -> None:
        """The first frame, sent before the successor starts: the listening sockets, by key and endpoint."""
        items, fds = [], []
        for listener in self._listeners.values():
            port = listener.port
            if port is None:
                continue
            items.append({"key": listener.key, "description": listener.description, "family": family_of(port)})
            fds.append(os.dup(port.fileno()))  # type: ignore[attr-defined]  # a TCP or UNIX port: a descriptor
        frame = encode(
            {"type": "listeners", "protocol": PROTOCOL, "pid": os.getpid(), "version": __version__,
             "listeners": items, "fds": len(fds)}
        )
        try:
            socket.send_fds(sock, [frame], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _message(self, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        self._last_heard = self._reactor.seconds()
        kind = message["type"]
        if kind == "took":
            self._unacked.discard(int(message.get("id") or 0))
            if not self._unacked:
                self._fire_taken()
            return
        waiting = self._waiting.get(kind)
        if waiting is not None and not waiting.called:
            waiting.callback(message)

    def _all_taken(self) -> Deferred:
        """Fires once the successor has said it has every frame sent so far."""
        if not self._unacked:
            return succeed(None)
        waiter: Deferred = Deferred()
        self._taken_waiters.append(waiter)
        return waiter

    def _fire_taken(self) -> None:
        waiters, self._taken_waiters = self._taken_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    async def _wait(self, what: Deferred, committing: bool = False) -> Any:
        """``what``'s result, unless the handover fails first: the successor refuses, stops, exits or says
        nothing for :attr:`timeout`, or this process is told to stop.

        ``committing``: ``commit`` was sent, so only the link's end decides (it comes after every frame the
        successor sent, ``committed`` included): neither its exit nor this process's stop does, and a
        successor silent too long is killed, its link's end awaited.
        """
        assert self._link is not None and self._child is not None
        link, child = self._link, self._child
        outcome: Deferred[Any] = Deferred()

        def settle(result: tuple[str, Any]) -> Any:
            """Fire the wait with the first of what may come; pass each result on (later waits read it again)."""
            if not outcome.called:
                outcome.callback(result)
            return result[1]

        what.addCallback(lambda value: settle(("ok", value)))
        self._waiting["refused"].addCallback(lambda m: settle(("refused", m)))
        self._waiting["aborting"].addCallback(lambda m: settle(("aborting", m)))
        link.closed.addCallback(lambda _: settle(("closed", None)))
        if not committing:
            child.ended.addCallback(lambda status: settle(("ended", status)))
            if self._stop_asked is not None:
                self._stop_asked.addCallback(lambda why: settle(("stopping", why)))
        killed = False
        while True:
            try:
                kind, value = await _within(outcome, self.timeout, self._reactor)
                break
            except TimeoutError:
                if killed or self._reactor.seconds() - self._last_heard < self.timeout:
                    continue
                if not committing:
                    raise ReloadFailed(f"the new process said nothing for {self.timeout:g}s") from None
                log.error("reload: the new process (pid {pid}) said nothing for {seconds:g}s after the commit; "
                          "ending it", pid=child.pid, seconds=self.timeout)
                child.kill()
                killed = True
        if kind == "ok":
            return value
        if kind == "stopping":
            raise ReloadFailed("this process was told to stop")
        status = value if kind == "ended" else "still running"
        if kind in ("ended", "closed"):
            # Each comes after every frame it sent, read here once the link has ended (its last words say why,
            # a refusal or an ``aborting``), and the exit's status says more.
            with contextlib.suppress(TimeoutError):
                if kind == "ended":
                    await _within(link.closed, 5, self._reactor)
                else:
                    status = await _within(child.ended, 5, self._reactor)
        refused: Any = self._waiting["refused"]
        if refused.called:
            raise ReloadRefused(str(refused.result.get("error", "refused")))
        aborting: Any = self._waiting["aborting"]
        if aborting.called:
            raise ReloadFailed(
                f"the new process (pid {child.pid}) stopped before it took over ({aborting.result.get('why')})"
            )
        if kind == "ended":
            raise ReloadFailed(f"the new process (pid {child.pid}) exited ({status}) before it took over")
        raise ReloadFailed(f"the new process (pid {child.pid}) ended the handover ({status}) before it took over")

    def _send(self, link: Link, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        self._frames += 1
        self._unacked.add(self._frames)
        link.send({**message, "id": self._frames}, blob, fds)

    # -- what is handed over -------------------------------------------------------------------

    def _send_parked(self, link: Link, entries: list | None, pending: bool) -> int:
        """Parked requests (``entries``, default every one), with their connections; each leaves this lot.

        ``pending`` (before the commit): each stays here, paused, its waiter waiting for the commit's
        outcome.  Otherwise (after it) each is gone from here as it is sent."""
        records: list[tuple[Any, bytes]] = []

        def take(request, entry, body: bytes) -> Deferred[bool] | None:
            """Called by the request's waiter (proxy/attempts.py) with what only it holds: the request and its body."""
            exported = export_parked(request, body)
            if exported is None:
                return None  # the client went away meanwhile: nothing to send on
            carried = Carried(started_at=request.facts.started_at, standing=entry.standing(self._reactor.seconds()))
            records.append(exported.record(**carried.as_json()))
            if not pending:
                exported.let_go()
                return None
            waiter: Deferred[bool] = Deferred()
            self._pending_parked.append((exported, waiter))
            return waiter

        began = time.monotonic()
        for entry in self._lot.entries() if entries is None else entries:
            self._lot.hand_over(entry, take)
        if records:
            log.debug("reload: took {count} parked requests out in {ms:.1f} ms", count=len(records),
                      ms=(time.monotonic() - began) * 1000)
        self._send_records(link, "parked", records)
        self.sent_parked += len(records)
        return len(records)

    def _send_connections(self, link: Link, pending: bool) -> int:
        """Every connection of both listeners waiting for its next request (keep-alive) that can go now."""
        records: list[tuple[Any, bytes]] = []
        for name, connections in self._connections.items():
            for channel in idle_connections(connections):
                exported = export_idle(channel)
                if exported is None:
                    continue
                records.append(exported.record(listener=name))
                if pending:
                    self._pending_connections.append(exported)
                else:
                    exported.let_go()
        self._send_records(link, "connections", records)
        self.sent_connections += len(records)
        return len(records)

    def _send_records(self, link: Link, kind: str, records: list[tuple[Any, bytes]]) -> None:
        for batch in cut(records):
            fds = [record.pop("fd") for record, _ in batch]
            packed, blob = pack(batch)
            self._send(link, {"type": kind, "records": packed}, blob, fds)

    def _diverted(self, request) -> None:
        """A request read after the commit (connections.divert): the successor's to answer, with its connection."""
        if self.state is COMMITTING:
            self._queued.append(request)  # the commit's outcome first
        elif self.state is HANDED_OVER and self._link is not None and self._link.open:
            self._outgoing.append(request)
            if len(self._outgoing) == 1:
                # At the reactor's next turn: what the client pipelined behind it is buffered by then.
                self._reactor.callLater(0, self._flush_outgoing)
        else:
            serve_here(request)  # no successor to take it (it is gone): answered here

    def _flush_outgoing(self) -> None:
        requests, self._outgoing = self._outgoing, []
        link = self._link
        if link is None or not link.open:
            for request in requests:
                serve_here(request)
            return
        records: list[tuple[Any, bytes]] = []
        listener_of = {id(listener.factory): name for name, listener in self._listeners.items()}
        for request in requests:
            exported = export_unhandled(request)
            if exported is None:
                continue  # the client went away
            name = listener_of.get(id(request.site), "proxy")
            records.append(exported.record(listener=name))
            exported.let_go()
        self._send_records(link, "connections", records)
        self.sent_connections += len(records)

    def relay(self, message: dict[str, Any], blob: bytes, fds: list[int]) -> bool:
        """After the handover, what this process's own predecessor still sends (two reloads in a row) goes
        straight on to the successor; False when there is none to take it."""
        link = self._link
        if not self.handed_over or link is None or not link.open:
            return False
        self._send(link, {"type": message["type"], "records": message.get("records", [])}, blob, fds)
        return True

    def _parked_again(self) -> None:
        """A request parked (lot.when_parked): after the handover, it goes over at the reactor's next turn."""
        if self.handed_over and self._parked_flush is None:
            self._parked_flush = self._reactor.callLater(0, self._send_parked_again)

    def _send_parked_again(self) -> None:
        self._parked_flush = None
        link = self._link
        if self.handed_over and link is not None and link.open:
            self._send_parked(link, None, pending=False)

    def _successor_gone(self, _: object) -> None:
        """The new process is gone after the handover (it stopped, or died): nothing more can go to it, so what
        is left here is answered 503 with Retry-After, and idle connections are closed."""
        if self._wind_down is None:
            return
        self._unacked.clear()
        self._stop_diverting()
        self._scheduler.stop_admitting()
        refused = self._scheduler.refuse_all_parked(f"the new process (pid {self._successor_pid}) is gone")
        log.warn("reload: the new process (pid {pid}) is gone; this process (pid {me}) answers what is left here "
                 "({refused} parked) with 503 and stops", pid=self._successor_pid, me=os.getpid(), refused=refused)

    def _start_wind_down(self) -> None:
        """After the handover: every :data:`WIND_DOWN_STEP` (the first a step from now), a winding-down step;
        one that raises is logged and the next goes on (:func:`~yieldproxy.periodic.every`)."""
        since = self._reactor.seconds()
        self._wind_down = every(self._reactor, WIND_DOWN_STEP, lambda: self._wind_down_step(since),
                                "reload: winding down", now=False)

    def _wind_down_step(self, since: float) -> None:
        """After the handover: send what went idle; stop once nothing is left here, or once overdue (even if
        looking raises: a process that cannot tell what is left still goes)."""
        if self._reactor.seconds() - since > WIND_DOWN_MAX_SECONDS:
            try:
                left = self._wind_down_sweep()
            except Exception:
                log.failure("reload: winding down failed")
                left = -1
            self._wound_down(left)
            return
        if self._wind_down_sweep() or self._predecessor_alive():
            return
        self._wound_down(0)

    def _wind_down_sweep(self) -> int:
        """Send what went idle (or close it, the successor gone); how many requests and connections are left."""
        link = self._link
        if link is not None and link.open:
            self._send_parked(link, None, pending=False)
            self._send_connections(link, pending=False)
        else:
            for connections in self._connections.values():
                for channel in idle_connections(connections):
                    channel.loseConnection()
        return (
            len(self._lot) + self._scheduler.inflight + sum(c.open for c in self._connections.values())
            + len(self._outgoing)
        )

    def _wound_down(self, left: int) -> None:
        """The winding down is over (``left``: what is still here, -1 when not known): this process stops."""
        if left:
            log.warn("reload: still {left} requests or connections here after {seconds:g}s; stopping anyway",
                     left="some" if left < 0 else left, seconds=WIND_DOWN_MAX_SECONDS)
        self._end_wind_down()
        log.info("reload: nothing left in this process (pid {pid}): it stops", pid=os.getpid())
        try:
            self._stop()
        except Exception:
            log.failure("reload: stopping this process failed")

    def _end_wind_down(self) -> None:
        """No more winding down: this process stops (the link's end is its own doing, not the successor's)."""
        wind_down, self._wind_down = self._wind_down, None
        if wind_down is not None and wind_down.running:
            wind_down.stop()
        if self._link is not None:
            self._link.close()

    # -- a stop ----------------------------------------------------------------------------------

    def stop_signalled(self) -> None:
        """A SIGTERM or SIGINT has come (called by the signal handler itself: it only notes it): a reload under
        way does not commit, or if it has, the new process stops too."""
        self._stop_signalled = True

    def stop(self) -> Deferred[None]:
        """This process stops (its winding down is over, or it was told to).

        During a reload, a stop is a stop of both (docs/operating.md, *The two phases*); the Deferred fires
        once the new process is gone (its copies of the listening sockets closed).  After the handover, only
        this process stops."""
        if self._reload_over is None:
            self._end_wind_down()
            return succeed(None)
        self._stopping = True
        child, over = self._child, self._reload_over
        if self.state is not COMMITTING:
            if self._link is not None and not self._link.closed.called:
                self._link.send({"type": "abort"})
            log.warn("reload: this process stops while pid {pid} was taking over: that one lets go and stops too",
                     pid=self._successor_pid)
            if self._stop_asked is not None and not self._stop_asked.called:
                self._stop_asked.callback("stopping")
        # ``over`` as it was: the reload may end in this very call (the stop ends its wait at once).
        return Deferred.fromCoroutine(self._stopped_with(child, over))

    async def _stopped_with(self, child: _Successor | None, over: Deferred) -> None:
        done: Deferred[None] = Deferred()

        def ended(result: Any) -> Any:
            done.callback(None)
            return result

        over.addBoth(ended)
        await done
        if child is None or (self.handed_over and not self._stopping_both):
            return
        bound = STOP_BOTH_SECONDS if self.handed_over else ABORT_SECONDS
        try:
            await _within(child.ended, bound, self._reactor)
        except TimeoutError:
            log.warn("reload: pid {pid} did not stop within {seconds:g}s; ending it", pid=child.pid,
                     seconds=bound)
            child.kill()

