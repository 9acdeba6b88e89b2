"""The running process's side of a reload: start a successor, hand everything over, finish what is in flight, go.

A reload (SIGHUP, ``POST /reload``, ``yieldproxy reload``) starts a fresh
process with this one's command line: the *installed* code, so an upgrade
underneath is what runs next.  That process reads and validates the config
as any start does; a refusal comes back as one line (:class:`ReloadRefused`)
and this one keeps running, nothing dropped.  Otherwise, once it says
``ready``:

1. this process stops accepting (its listening sockets are the successor's
   already, adopted and paused: arrivals wait in the backlog) and stops
   letting requests out of its lot;
2. it sends its holds and its twins' verifications, then ``accept`` (the
   successor accepts from then on: the pause clients see is this round
   trip, not the lot's transfer), then every parked request with its
   client's connection (wire.py; each is placed there ahead of whatever
   the successor accepted meanwhile), every idle keep-alive connection,
   and ``done``, answered ``serving``;
3. it goes on with what is in flight here: those answers complete here,
   nothing is sent upstream twice.  A connection that becomes idle, and a
   request that parks again (a failed attempt), go to the successor as
   they come; once nothing is left, this process stops.

If the successor fails before ``serving`` (it exits, or says nothing for
:attr:`Predecessor.timeout`), this process keeps everything it had not sent
yet, accepts and releases again, and logs one line; what it had sent (and
what the successor had accepted) is lost with the successor.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any, Callable, Sequence

import attrs
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger

from .. import __version__
from .link import Link, adopt_link
from .sockets import duplicate, family_of, let_go
from .takeover import ENV
from .wire import BATCH_FDS, PROTOCOL, Carried, cut, encode, pack, request_bytes

log = Logger()

#: How often the exit of a successor not yet serving is looked for.
CHILD_POLL_SECONDS = 0.05
#: How often the winding-down process looks for connections gone idle and requests parked again.
WIND_DOWN_STEP = 0.05
#: The longest the old process stays after a handover, finishing what is in flight (each request
#: has its own bounds well below this).
WIND_DOWN_MAX_SECONDS = 3600.0


class ReloadRefused(Exception):
    """The new process refused to start (its config, its options): the one line it gave."""


class ReloadFailed(Exception):
    """The new process did not take over; this one keeps everything and goes on."""


class ReloadBusy(Exception):
    """A reload is under way already, or this process has handed over."""


class ReloadUnavailable(Exception):
    """This process cannot start a successor (how it was started does not allow it): the reason."""


class _Successor:
    """The successor as a child process: :attr:`ended` fires with how it exited, while it is watched.

    Started with :class:`subprocess.Popen` (vfork, descriptors closed by
    ``close_range``), not ``spawnProcess``, whose fork and descriptor walk
    held this process's reactor for seconds with thousands of connections
    open (bench/handover.py).  Its exit is polled while the handover waits
    on it (Twisted reaps only the processes it started itself).
    """

    def __init__(self, reactor, command: Sequence[str], env: dict[str, str], fd: int):
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
            try:
                self.popen.terminate()
            except OSError:
                pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.kill()
            except OSError:
                pass


def _within(d: Deferred, seconds: float, clock) -> Deferred:
    """``d``'s result, or :class:`TimeoutError` after ``seconds``; ``d`` itself is left running (waited on again)."""
    waiter: Deferred = Deferred()

    def settle(result: Any) -> Any:
        if not waiter.called:
            waiter.callback(result)
        return result

    d.addCallback(settle)
    return waiter.addTimeout(seconds, clock)


@attrs.define(eq=False)
class Predecessor:
    """Hands this process over to a successor (see the module docstring)."""

    _reactor: Any
    #: The command that starts a successor (this process's own command line).
    command: Sequence[str]
    environ: dict[str, str]
    #: ``proxy`` and ``admin``: the listeners.
    _listeners: dict[str, Any]
    #: ``proxy`` and ``admin``: each listener's open connections (their idle ones go over).
    _connections: dict[str, Any]
    _lot: Any
    _pool: Any
    #: ``snapshot()``: the holds and twins the successor restores (a JSON-able dict).
    _snapshot: Callable[[], dict[str, Any]]
    #: Ends this process (the reactor's stop, from tap.py).
    _stop: Callable[[], None]
    #: ``notify(*lines)``: systemd's notify socket (sdnotify), or nothing.
    _notify: Callable[..., Any] = lambda *lines: None
    #: Seconds the successor has to start and say ``ready``, and then to take everything.
    timeout: float = 60.0
    #: Why this process cannot reload at all (None: it can).
    unavailable: str | None = None
    _busy: bool = False
    _handed_over: bool = False
    _link: Link | None = None
    _waiting: dict[str, Deferred] = attrs.Factory(dict)
    #: Descriptors sent, by frame id, until the successor says it has them.
    _unacked: dict[int, list[int]] = attrs.Factory(dict)
    _frames: int = 0
    _wind_down: LoopingCall | None = None
    _successor_pid: int | None = None
    #: The new process while a reload is under way.
    _child: _Successor | None = None
    #: This process is stopping: a new process still taking over is asked to stop too, not killed.
    _stopping: bool = False
    #: When the successor last said it took a batch (a large lot is waited for while it keeps taking).
    _last_took: float = 0.0
    sent_parked: int = 0
    sent_connections: int = 0

    @property
    def handed_over(self) -> bool:
        return self._handed_over

    async def reload(self) -> dict[str, Any]:
        """Start a successor and hand over to it; the outcome, or :class:`ReloadRefused`/``Failed``/``Busy``."""
        if self.unavailable is not None:
            raise ReloadUnavailable(self.unavailable)
        if self._handed_over:
            raise ReloadBusy(f"this process (pid {os.getpid()}) has handed over to pid {self._successor_pid} already")
        if self._busy:
            raise ReloadBusy("a reload is under way already")
        self._busy = True
        began = self._reactor.seconds()
        self._notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            return await self._reload(began)
        except BaseException:
            self._notify("READY=1", f"STATUS=serving (version {__version__}; the last reload failed)")
            raise
        finally:
            self._busy = False
            self._child = None

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
        process = self._child = child
        self._successor_pid = process.pid
        self._waiting = {kind: Deferred() for kind in ("ready", "refused", "accepting", "serving")}
        link = self._link = adopt_link(self._reactor, ours, self._message)
        try:
            ready = await self._first(child, link, "ready")
        except BaseException:
            self._give_up(process, child, link)
            raise
        if ready.get("protocol") != PROTOCOL:
            self._give_up(process, child, link)
            raise ReloadFailed(f"the new process speaks handover protocol {ready.get('protocol')!r}, not {PROTOCOL}")
        # From here on, what is sent is the successor's.
        handing = self._reactor.seconds()
        frozen: Deferred[None] = Deferred()
        for member in self._pool.members:
            member.drainer.hold_release_until(frozen)
        for listener in self._listeners.values():
            listener.pause()
        try:
            link.send({"type": "state", **self._snapshot()})
            # The successor accepts from now on: its holds are right, and every parked request that comes
            # next is placed ahead of what it accepts (parking.number_adopted).
            link.send({"type": "accept"})
            # Its answer first: the lot's descriptors must not hold up those two small frames.
            await self._first(child, link, "accepting")
            paused = self._reactor.seconds() - handing
            await self._send_lot(link)
            self._send_idle(link)
            link.send({"type": "done"})
            serving = await self._first(child, link, "serving")
        except BaseException as e:
            log.error(
                "reload: the new process (pid {pid}) failed while taking over ({why}); {sent} parked requests and "
                "{connections} connections already sent went with it; this process keeps the rest and goes on",
                pid=process.pid, why=str(e), sent=self.sent_parked, connections=self.sent_connections,
            )
            self._give_up(process, child, link)
            for listener in self._listeners.values():
                listener.resume()
            frozen.callback(None)
            raise ReloadFailed(str(e)) from None
        self._handed_over = True
        child.forget()
        for listener in self._listeners.values():
            listener.release()
        self._notify(f"MAINPID={process.pid}", "READY=1", f"STATUS=serving (version {serving.get('version')})")
        outcome = {
            "reloaded": True,
            "old_pid": os.getpid(),
            "old_version": __version__,
            "pid": serving.get("pid"),
            "version": serving.get("version"),
            "parked_handed_over": self.sent_parked,
            "connections_handed_over": self.sent_connections,
            "seconds": round(self._reactor.seconds() - began, 3),
            # From "ready" to "serving": while this process accepts no connection and the lot goes over.
            "handover_seconds": round(self._reactor.seconds() - handing, 3),
            # From "ready" to "accepting": while neither process accepted a connection.
            "paused_seconds": round(paused, 3),
        }
        log.info(
            "reload: handed over to pid {pid} (version {version}): {parked} parked requests, {connections} idle "
            "connections, in {seconds:.3f}s (the handover itself {handover:.3f}s, accepting paused {paused:.3f}s); "
            "finishing {inflight} requests in flight here, then exiting",
            pid=outcome["pid"], version=outcome["version"], parked=self.sent_parked,
            connections=self.sent_connections, seconds=outcome["seconds"], handover=outcome["handover_seconds"],
            paused=outcome["paused_seconds"],
            inflight=self._pool.inflight,
        )
        self._wind_down = LoopingCall(self._wind_down_step, self._reactor.seconds())
        self._wind_down.clock = self._reactor
        self._wind_down.start(WIND_DOWN_STEP, now=False).addErrback(
            lambda f: log.failure("reload: winding down failed", f)
        )
        return outcome

    # -- the link ---------------------------------------------------------------------------

    def _send_listeners(self, sock: socket.socket) -> None:
        """The first frame, sent before the successor starts: the listening sockets, by key and endpoint."""
        items, fds = [], []
        for listener in self._listeners.values():
            port = listener.port
            if port is None:
                continue
            items.append({"key": listener.key, "description": listener.description, "family": family_of(port)})
            fds.append(os.dup(port.fileno()))
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
        kind = message["type"]
        if kind == "took":
            self._last_took = self._reactor.seconds()
            for fd in self._unacked.pop(int(message.get("id") or 0), []):
                os.close(fd)
            return
        waiting = self._waiting.get(kind)
        if waiting is not None and not waiting.called:
            waiting.callback(message)

    async def _first(self, child: _Successor, link: Link, kind: str) -> dict[str, Any]:
        """Wait for the successor's ``kind`` frame; a refusal, its exit or silence fails the wait."""
        outcome: Deferred[Any] = Deferred()

        def settle(result: tuple[str, Any]) -> Any:
            """Fire the wait with the first of what may come; pass each result on (later waits read it again)."""
            if not outcome.called:
                outcome.callback(result)
            return result[1]

        self._waiting[kind].addCallback(lambda m: settle(("ok", m)))
        self._waiting["refused"].addCallback(lambda m: settle(("refused", m)))
        child.ended.addCallback(lambda status: settle(("ended", status)))
        link.closed.addCallback(lambda _: settle(("closed", None)))
        while True:
            try:
                what, value = await _within(outcome, self.timeout, self._reactor)
                break
            except TimeoutError:
                # A large lot on a busy machine may take longer: wait on while the successor keeps taking it.
                if kind != "serving" or self._reactor.seconds() - self._last_took >= self.timeout:
                    raise ReloadFailed(f"the new process said nothing for {self.timeout:g}s") from None
        if what == "ok":
            return value
        if what == "refused":
            raise ReloadRefused(str(value.get("error", "refused")))
        if what == "ended":
            raise ReloadFailed(f"the new process exited ({value}) before it took over; its own lines say why")
        # The link closed first: the exit is on its way (its status says more).
        try:
            status = await _within(child.ended, 5, self._reactor)
        except TimeoutError:
            status = "still running"
        refused: Any = self._waiting["refused"]
        if refused.called:
            raise ReloadRefused(str(refused.result.get("error", "refused")))
        raise ReloadFailed(f"the new process closed the handover ({status}) before it took over")

    def _give_up(self, process, child: _Successor, link: Link) -> None:
        """The successor will not take over: end it (nothing of ours is lost with it); its exit is reaped as it comes."""
        link.close()
        if not self._stopping:
            child.kill()
        # Still watched until its exit is seen: that reaps it (forgotten now, it would stay a zombie).
        for fds in self._unacked.values():
            for fd in fds:
                os.close(fd)
        self._unacked.clear()

    def _send(self, link: Link, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        self._frames += 1
        self._unacked[self._frames] = fds
        link.send({**message, "id": self._frames}, blob, fds)

    # -- what is handed over -------------------------------------------------------------------

    async def _send_lot(self, link: Link) -> None:
        """The lot, a batch at a time, in line order, the reactor turning between batches (whatever is in
        flight here goes on meanwhile)."""
        entries = self._lot.entries()
        for start in range(0, len(entries), BATCH_FDS):
            # One that left meanwhile (its client went, its time ran out) is passed over by hand_over.
            self._send_parked(link, entries[start:start + BATCH_FDS])
            await deferLater(self._reactor, 0, lambda: None)
        # What parked meanwhile (an attempt that failed here) goes too.
        self._send_parked(link)

    def _send_parked(self, link: Link, entries: list | None = None) -> None:
        """Parked requests (``entries``, default every one), with their connections; each leaves this lot
        without an answer."""
        records: list[tuple[Any, bytes]] = []

        def take(request, entry, body: bytes) -> None:
            """Called by the request's waiter (proxy.py) with what only it holds: the request and its body."""
            channel = request.channel
            transport = getattr(channel, "transport", None)
            if transport is None:
                return  # the client went away meanwhile: nothing to send on
            now = self._reactor.seconds()
            data = request_bytes(request.method, request.uri, request.requestHeaders.getAllRawHeaders(), body)
            # What the client sent after it (pipelined requests), read here already and held by the channel
            # until this request is answered: it goes over behind it (the rest is still in the socket).
            data += channel.read_ahead
            carried = Carried(
                cls=entry.cls, started_at=request.started_at, max_wait=entry.max_wait, attempts=entry.attempts,
                forgiven=entry.forgiven,
                parked_seconds=entry.parked_seconds + (now - entry.parked_at if entry.parked_at is not None else 0.0),
                first_parked=entry.first_parked, deadline=entry.deadline, bound_by_caller=entry.bound_by_caller,
                failed_on=entry.failed_on,
            )
            fd, family = duplicate(transport)
            # Gone from here without a word: no cancel, no answer, no shutdown of the socket.
            request.handler = None
            let_go(transport)
            records.append(({**carried.as_json(), "family": family, "fd": fd}, data))

        began = time.monotonic()
        for entry in self._lot.entries() if entries is None else entries:
            self._lot.hand_over(entry, take)
        if records:
            log.debug("reload: took {count} parked requests out in {ms:.1f} ms", count=len(records),
                      ms=(time.monotonic() - began) * 1000)
        for batch in cut(records):
            fds = [record.pop("fd") for record, _ in batch]
            packed, blob = pack(batch)
            self._send(link, {"type": "parked", "records": packed}, blob, fds)
            self.sent_parked += len(batch)

    def _send_idle(self, link: Link) -> None:
        """Every connection waiting for its next request (keep-alive), of both listeners."""
        records: list[tuple[Any, bytes]] = []
        for name, connections in self._connections.items():
            for channel in connections.idle_channels():
                transport = channel.transport
                if transport is None or transport.disconnecting:
                    continue
                fd, family = duplicate(transport)
                let_go(transport)
                records.append(({"listener": name, "family": family, "fd": fd}, b""))
        for batch in cut(records):
            fds = [record.pop("fd") for record, _ in batch]
            self._send(link, {"type": "connections", "records": [record for record, _ in batch]}, b"", fds)
            self.sent_connections += len(batch)

    def _wind_down_step(self, since: float) -> None:
        """After the handover: send what parked again or went idle; stop once nothing is left here."""
        link = self._link
        if link is not None and not link.closed.called:
            self._send_parked(link)
            self._send_idle(link)
        left = len(self._lot) + self._pool.inflight + sum(c.open for c in self._connections.values())
        overdue = self._reactor.seconds() - since > WIND_DOWN_MAX_SECONDS
        if left and not overdue:
            return
        if left:
            log.warn("reload: still {left} requests or connections here after {seconds:g}s; stopping anyway",
                     left=left, seconds=WIND_DOWN_MAX_SECONDS)
        self.stop()
        log.info("reload: nothing left in this process (pid {pid}): it stops", pid=os.getpid())
        try:
            self._stop()
        except Exception:
            log.failure("reload: stopping this process failed")

    def stop(self) -> None:
        """This process stops (its winding down is over, or it was told to): no more looking, no link.

        Told to stop in the middle of a reload, it asks its new process to stop too (SIGTERM): a stop is a
        stop, and the new process must not live on alone, holding the port; what it took already is
        answered by its own stop (503 with Retry-After), as this process answers the rest."""
        if self._child is not None and not self._handed_over and not self._stopping:
            self._stopping = True
            log.warn("reload: this process stops while pid {pid} was taking over: that one stops too",
                     pid=self._child.pid)
            self._child.terminate()
        if self._wind_down is not None and self._wind_down.running:
            self._wind_down.stop()
        if self._link is not None:
            self._link.close()
