"""The successor's side: a process started by a reload takes over its predecessor's sockets and lot.

Started with ``$YIELDPROXY_SUCCESSION_FD`` naming its end of a unix socket, it
reads (blocking, before its reactor runs) the predecessor's listening sockets
(:class:`Inheritance`), adopts the ones whose endpoint is unchanged, paused,
and starts as any start does; a config its own start refuses goes back as one
line (:func:`refuse`).  Then :class:`TakeOver` runs its side of the two phases
(predecessor.py); a link that ends without ``abort`` is the predecessor's death
(liveness.py).  What each moment of a death or a stop leaves: docs/operating.md
(*The two phases, and what a death or a stop during a reload does*).
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
import time
from typing import Any, Callable, MutableMapping

import attrs
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from ... import __version__
from ...edge.sockets import nonblocking_cloexec
from ...states import Machine, Moves
from . import moments
from .connections import make_again
from .link import Link, LinkClosed, adopt_link
from .liveness import Fate, Peer, fate
from .wire import BATCH_FDS, PROTOCOL, BadFrame, Carried, Decoder, encode, unpack

log = Logger()

#: The environment variable naming the successor's end of the handover's socket.
ENV = "YIELDPROXY_SUCCESSION_FD"
#: Seconds the successor waits for its predecessor's first frame (it is sent before the successor starts).
FIRST_FRAME_SECONDS = 30.0
#: Seconds a stopping successor waits for its last frames on the link to be out.
CLOSE_SECONDS = 5.0


def _read_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    """One whole frame from a blocking socket, with the descriptors that came with it."""
    decoder = Decoder()
    fds: list[int] = []
    while True:
        data, received, _flags, _address = socket.recv_fds(sock, 1 << 16, 64)
        fds.extend(received)
        if not data:
            raise BadFrame("the running process closed the handover's socket")
        for message, blob in decoder.feed(data):
            return message, blob, fds


@attrs.define(eq=False)
class Inheritance:
    """What a process started by a reload gets from the one it replaces, before it starts."""

    sock: socket.socket
    #: ``key`` (``proxy.listen``, ``admin.listen``) -> (endpoint description, descriptor, family).
    listeners: dict[str, tuple[str, int, int]]
    #: The predecessor's pid and version.
    pid: int
    version: str
    #: The keys of the listening sockets this process took (its endpoint unchanged); the others it bound anew.
    taken: list[str] = attrs.Factory(list)
    #: The predecessor as a process (its pidfd): whether it is gone, read from what cannot lie.
    peer: Peer | None = None

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str], timeout: float = FIRST_FRAME_SECONDS) -> "Inheritance | None":
        """The inheritance ``environ`` names (the variable is removed: this process's own successor gets its own),
        or None for a plain start.  Raises :class:`BadFrame` if the predecessor sent no usable first frame."""
        raw = environ.pop(ENV, None)
        if raw is None:
            return None
        sock = socket.socket(fileno=int(raw))
        sock.settimeout(timeout)
        message, _blob, fds = _read_frame(sock)
        if message.get("type") != "listeners" or message.get("protocol") != PROTOCOL:
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"expected the listeners of protocol {PROTOCOL}, got {message.get('type')!r}")
        listeners = {}
        for item, fd in zip(message.get("listeners", []), fds):
            nonblocking_cloexec(fd)
            listeners[str(item["key"])] = (str(item["description"]), fd, int(item["family"]))
        pid = int(message["pid"])
        return cls(sock, listeners, pid, str(message["version"]), peer=Peer.open(pid))

    def listening(self, key: str, description: str) -> tuple[int, int] | None:
        """The predecessor's socket for ``key`` when its endpoint is ``description`` (unchanged), else None."""
        found = self.listeners.get(key)
        if found is None or found[0] != description:
            return None
        del self.listeners[key]
        self.taken.append(key)
        return found[1], found[2]

    def close_unused(self) -> None:
        """Close the sockets of listeners whose endpoint changed (this process bound its own)."""
        for _description, fd, _family in self.listeners.values():
            os.close(fd)
        self.listeners.clear()


def refuse(environ: MutableMapping[str, str], why: str) -> bool:
    """Tell the predecessor this process will not start (its config or options are refused), in one line.

    True when there was a predecessor to tell (it logs the line and keeps running).
    """
    raw = environ.get(ENV)
    if raw is None:
        return False
    try:
        with socket.socket(fileno=int(raw)) as sock:
            sock.settimeout(5)
            sock.sendall(encode({"type": "refused", "error": why, "fds": 0}))
    except (OSError, ValueError):
        return False
    return True


class Stage(enum.Enum):
    """Where the new process is in taking over (see the module docstring)."""

    #: Holding what comes, untouched, until the commit (the predecessor owns it all).
    WAITING = "waiting"
    #: ``committed`` is sent but not known to have left this process: still holding, untouched (the
    #: predecessor owns it all until it can read ``committed``).
    SENDING = "sending"
    #: Owning everything, for good: making what it held again.
    COMMITTED = "committed"
    #: Everything it held is in: it serves.
    SERVING = "serving"
    #: It let go before the commit (the predecessor keeps everything), and stops.
    ABORTED = "aborted"


WAITING, SENDING, COMMITTED, SERVING, ABORTED = (
    Stage.WAITING, Stage.SENDING, Stage.COMMITTED, Stage.SERVING, Stage.ABORTED
)

#: What each event of a takeover does to the new process's stage; any other is a bug
#: (:class:`~yieldproxy.states.Unexpected`).
#: Only :data:`SENDING` learns whether ``committed`` left: nothing is made again before (a stop waits for it),
#: and what is made again is never let go (no move leads back from :data:`COMMITTED` or :data:`SERVING`).
STAGE_MOVES: Moves[Stage, str] = Moves("a handover's new process", {
    # The predecessor's ``commit`` is read: ``committed`` is sent...
    (WAITING, "commit"): SENDING,
    # ...and has left this process: the predecessor reads it even if this process dies next.
    (SENDING, "owned"): COMMITTED,
    # The link ended before ``committed`` left: the predecessor never reads it; its fate decides (liveness.py).
    (SENDING, "unsent"): WAITING,
    # The predecessor died before the commit (liveness.py): this process takes over with what it holds.
    (WAITING, "orphaned"): COMMITTED,
    # Everything held is made again (said again once a stop made the rest at once: nothing moves).
    (COMMITTED, "all_in"): SERVING,
    (SERVING, "all_in"): SERVING,
    # Let go of everything before the commit; said after it, or again, nothing moves.
    **{(stage, "let_go"): ABORTED if stage is WAITING else stage for stage in Stage},
})


@attrs.define(eq=False)
class _Held:
    """A parked request or a connection come before the commit: its descriptor and bytes, untouched."""

    kind: str
    record: dict[str, Any]
    data: bytes
    fd: int


@attrs.define(eq=False, repr=False)
class TakeOver(Machine[Stage, str]):
    """Takes over what the predecessor hands over (see the module docstring); its stage is driven by
    :data:`STAGE_MOVES`."""

    moves = STAGE_MOVES

    _reactor: Any
    _inheritance: Inheritance
    #: ``proxy`` and ``admin``: the listeners (their sites serve the connections made again).
    _listeners: dict[str, Any]
    #: ``adopt(channel, carried, connection, data)`` of the proxy app.
    _adopt: Callable[[Any, Carried, dict[str, Any], bytes], None]
    #: ``restore(message)``: holds and twins as the predecessor had them.
    _restore: Callable[[dict[str, Any]], None]
    #: The scheduler: its drainers let the lot out once every parked request that came is in it.
    _scheduler: Any = None
    #: At the commit: the holds file and the pidfile become this process's.
    _claim: Callable[[], None] = lambda: None
    #: ``relay(message, blob, fds)``: passes a frame on to this process's own successor, if it has handed
    #: over in its turn (two reloads in a row); False when it has not.
    _relay: Callable[[dict[str, Any], bytes, list[int]], bool] = lambda message, blob, fds: False
    #: Ends this process (told to by the predecessor, or left by it before the commit).
    _stop_process: Callable[[], None] = lambda: None
    #: Told once this process serves (everything it held is in).
    _on_serving: Callable[[], None] = lambda: None
    #: The holds as the holds file has them now (a predecessor that died before the commit sent none).
    _holds_from_file: Callable[[], None] = lambda: None
    started_at: float = attrs.field(factory=time.time)
    adopted: int = 0
    connections: int = 0
    #: Its named state (:data:`STAGE_MOVES`).
    state: Stage = attrs.field(default=WAITING, init=False)
    _link: Link | None = None
    _held: list[_Held] = attrs.Factory(list)
    #: How many of :attr:`_held` (its first ones) are connections.
    _connections_held: int = 0
    #: Holds the lot's release while what was held is made again.
    _adopting: Deferred | None = None
    #: The predecessor said ``abort``: it ended the handover, and keeps everything.
    _abort_read: bool = False
    #: The link's end before the commit is being read (liveness.py): once.
    _deciding: bool = False
    #: While ``committed`` is sent but not known out (:data:`SENDING`): fires once it is known either way.
    _sent: Deferred | None = None
    #: A SIGTERM or SIGINT has come (noted by the signal handler itself, before the stop it starts reaches
    #: :meth:`stop`): a commit that comes meanwhile is not made.
    _stop_signalled: bool = False

    @property
    def done(self) -> bool:
        """Everything the predecessor held is in (or the takeover is over)."""
        return self.state is SERVING or self.state is ABORTED

    @property
    def committed(self) -> bool:
        return self.state is COMMITTED or self.state is SERVING

    def stop_signalled(self) -> None:
        """A SIGTERM or SIGINT has come (called by the signal handler itself: it only notes it)."""
        self._stop_signalled = True

    @property
    def linked(self) -> bool:
        """The predecessor is still there and may send more (two reloads in a row keep this process on)."""
        return self._link is not None and not self._link.closed.called

    def start(self) -> None:
        """Say ``ready`` to the predecessor (this process is up, its listeners adopted and paused)."""
        self._inheritance.close_unused()
        self._link = adopt_link(self._reactor, self._inheritance.sock, self._message)
        self._link.closed.addCallback(self._lost)
        moments.reached("ready")
        self._link.send({
            "type": "ready", "pid": os.getpid(), "version": __version__, "protocol": PROTOCOL,
            "listeners": list(self._inheritance.taken),
        })

    def _message(self, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        kind = message["type"]
        if kind in ("parked", "connections"):
            if self.committed and self._relay(message, blob, fds):
                self._ack(message)
                return
            self._take(kind, message, blob, fds)
            self._ack(message)
            if kind == "parked" and self.state is WAITING:
                moments.reached("held")
        elif kind == "commit":
            self._commit(message)
        elif kind == "abort":
            self._abort_read = True
            if self._abort(f"pid {self._inheritance.pid}, which this process was to replace, stops"):
                self._stop_process()
        else:
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"unknown frame {kind!r}")

    def _take(self, kind: str, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        records = list(unpack(message.get("records", []), blob))
        if len(records) != len(fds):
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"{len(records)} {kind} records with {len(fds)} descriptors")
        held = [_Held(kind, record, data, fd) for (record, data), fd in zip(records, fds)]
        if self.state is WAITING or self.state is SENDING:
            # Not a byte read, not a byte written: the predecessor has them too.  Connections first: their
            # clients (a keep-alive one, one just accepted) are about to send, the parked ones wait anyway.
            if kind == "connections":
                self._held[self._connections_held:self._connections_held] = held
                self._connections_held += len(held)
            else:
                self._held.extend(held)
        elif self.state is ABORTED:
            for item in held:
                os.close(item.fd)
        else:
            for item in held:
                self._make_again(item)

    def _make_again(self, item: _Held) -> None:
        """A connection held (or sent after the commit) made again here, going on with its bytes."""
        try:
            record = dict(item.record)
            family = int(record.pop("family"))
            connection = _connection(record.pop("connection", None))
            if item.kind == "parked":
                carried = Carried.from_json(record)
                make_again(self._reactor, self._listeners["proxy"].factory, item.fd, family, item.data,
                           connection=connection,
                           feed=lambda channel, state, data: self._adopt(channel, carried, state, data))
                self.adopted += 1
            else:
                listener = self._listeners[str(record["listener"])]
                make_again(self._reactor, listener.factory, item.fd, family, item.data, connection=connection)
                self.connections += 1
        except (BadFrame, KeyError, TypeError, ValueError) as e:
            log.error("reload: a {kind} record from pid {pid} is not one ({why}); its connection is closed",
                      kind=item.kind, pid=self._inheritance.pid, why=str(e))
            with contextlib.suppress(OSError):
                os.close(item.fd)

    def _ack(self, message: dict[str, Any]) -> None:
        """The predecessor has frame ``id`` taken (its prepare rounds wait for every frame to be)."""
        assert self._link is not None
        self._link.send({"type": "took", "id": message.get("id")})

    # -- the commit ----------------------------------------------------------------------------

    def _commit(self, message: dict[str, Any]) -> None:
        """``commit``: say ``committed``, and act on it once that has left this process."""
        if self.state is not WAITING:
            return  # stopping already: the predecessor reads no ``committed`` and keeps everything
        assert self._link is not None
        moments.reached("commit")
        if self._stop_signalled:
            # Told to stop before ``committed`` is out: a stop before the commit (the predecessor keeps everything).
            self._abort("this process was told to stop (SIGTERM or SIGINT)")
            return
        self.fire("commit")
        self._link.send({"type": "committed", "pid": os.getpid(), "version": __version__})
        # Assigned first: the outcome may be known at once (``_owned`` or ``_unsent`` then runs in this call).
        sent = self._sent = self._link.flushed(self._reactor)
        sent.addCallbacks(lambda _: self._owned(message), lambda failure: self._unsent(failure, message))

    def _owned(self, message: dict[str, Any]) -> None:
        """``committed`` has left this process: the predecessor reads it even if this process dies next."""
        self._sent = None
        self.fire("owned")
        moments.reached("acting")
        self._act(message)

    def _unsent(self, failure, message: dict[str, Any]) -> None:
        """The link ended before ``committed`` left: the predecessor never reads it.  It is gone (this process
        acts on the commit: no one else has these connections), or ended the handover (it keeps them)."""
        failure.trap(LinkClosed)
        self._sent = None
        self.fire("unsent")  # not acted on: until the predecessor's fate is known, nothing is made again
        self._link_ended("before it read the commit", lambda: self._act(message))

    def _link_ended(self, when: str, take_over: Callable[[], None]) -> None:
        """The link ended before this process owned anything: let go, or ``take_over`` if the predecessor is
        gone (liveness.py).  Decided once (the flush's failure and the link's end both come here)."""
        if self._deciding:
            return
        self._deciding = True
        link, peer = self._link, self._inheritance.peer
        verdict = fate(self._abort_read, link is not None and link.ended_here, peer is not None and peer.pidfd is not None)
        if verdict is Fate.ASK_PIDFD:
            assert peer is not None
            peer.exited(self._reactor).addCallback(
                lambda exited: self._decided(Fate.TAKE_OVER if exited else Fate.LET_GO, when, take_over)
            )
            return
        self._decided(verdict, when, take_over)

    def _decided(self, verdict: Fate, when: str, take_over: Callable[[], None]) -> None:
        pid = self._inheritance.pid
        if self.state is not WAITING:
            return  # stopped meanwhile: a stop is a stop
        if verdict is Fate.LET_GO:
            if self._abort(f"pid {pid} ended the handover {when}"):
                self._stop_process()
            return
        log.warn("reload: the process this one replaces (pid {pid}) died during the handover ({when}); this one "
                 "takes over the {count} connections it held, with the holds the holds file has", pid=pid, when=when,
                 count=len(self._held))
        self.fire("orphaned")
        take_over()

    def _act(self, message: dict[str, Any] | None) -> None:
        """This process owns everything now: the holds first, then accepting, then what it held, made again."""
        if message is not None:
            self._restore(message)
        else:
            self._holds_from_file()
        self._adopting = Deferred()
        if self._scheduler is not None:
            for member in self._scheduler.members:
                member.hold_release_until(self._adopting)
        for listener in self._listeners.values():
            listener.resume()
        # Then the holds file (its write waits on the disk: new connections need not) and the pidfile; a
        # change made meanwhile is written with the claim.
        self._claim()
        self._make_some()

    def _make_some(self) -> None:
        """What was held, a batch at a time (the reactor turning between: arrivals are accepted meanwhile)."""
        batch, self._held = self._held[:BATCH_FDS], self._held[BATCH_FDS:]
        began = time.monotonic()
        for item in batch:
            self._make_again(item)
        if batch:
            log.debug("reload: made {count} connections again in {ms:.1f} ms", count=len(batch),
                      ms=(time.monotonic() - began) * 1000)
        if self._held:
            self._reactor.callLater(0, self._make_some)
            return
        self._serve()

    def _serve(self) -> None:
        old = self.state
        if self.fire("all_in") is old:
            return
        if self._inheritance.peer is not None:
            self._inheritance.peer.close()
        adopting, self._adopting = self._adopting, None
        if adopting is not None:
            adopting.callback(None)
        log.info(
            "reload: took over from pid {pid} (version {old}): {parked} parked requests, {connections} connections; "
            "now serving as pid {me} (version {version})",
            pid=self._inheritance.pid, old=self._inheritance.version, parked=self.adopted,
            connections=self.connections, me=os.getpid(), version=__version__,
        )
        self._on_serving()

    # -- letting go ---------------------------------------------------------------------------

    def _abort(self, why: str) -> bool:
        """Before the commit: let go of everything (the predecessor keeps it) and say so; True if it did."""
        old = self.state
        if self.fire("let_go") is old:
            return False
        for listener in self._listeners.values():
            if listener.key in self._inheritance.taken:
                listener.release()  # not closed: the listening sockets stay the predecessor's
            else:
                listener.close()  # one this process bound itself (its endpoint changed)
        held, self._held = self._held, []
        for item in held:
            os.close(item.fd)
        log.warn("reload: {why} before it took over from pid {pid}: this process (pid {me}) lets go of the {count} "
                 "connections it held (pid {pid} keeps them) and stops", why=why, me=os.getpid(), count=len(held),
                 pid=self._inheritance.pid)
        if self.linked:
            assert self._link is not None
            self._link.send_now({"type": "aborting", "why": why})
            self._link.close()
        return True

    def _lost(self, _: object) -> None:
        """The link ended: before the commit, the predecessor exited, or ended the handover (liveness.py)."""
        if self.state is not WAITING:
            return
        self._link_ended("before the commit", lambda: self._act(None))

    def stop(self) -> Deferred[None]:
        """This process stops: before the commit it lets go of everything; after it, what is still held is
        made again at once (the stop answers it, as it answers what is parked); the link ends.

        While ``committed`` is sent but not known out (:data:`SENDING`), whose it all is is not known yet: the
        stop waits for that, up to :data:`CLOSE_SECONDS`, and then drops ``committed`` unsent (the predecessor
        keeps everything), so that nothing is ever made again here that the predecessor may still serve.

        Fires once the link has ended (what was sent on it, ``aborting`` included, is out: the predecessor
        reads why), or after :data:`CLOSE_SECONDS` if the predecessor reads nothing."""
        if self.state is SENDING and self._sent is not None:
            return self._stop_once_sent(self._sent)
        if self.state is WAITING:
            self._abort("this process was told to stop (SIGTERM or SIGINT)")
        elif self.state is COMMITTED and self._held:
            held, self._held = self._held, []
            for item in held:
                self._make_again(item)
            self._serve()
        ended: Deferred[None] = Deferred()
        if self._link is None or self._link.closed.called:
            ended.callback(None)
            return ended
        self._link.closed.addCallback(lambda _: None if ended.called else ended.callback(None))
        self._link.close()
        timer = self._reactor.callLater(CLOSE_SECONDS, lambda: None if ended.called else ended.callback(None))
        return ended.addCallback(lambda _: timer.cancel() if timer.active() else None)

    def _stop_once_sent(self, sent: Deferred) -> Deferred[None]:
        """:meth:`stop` once ``committed`` is known to have left, or not."""
        link = self._link
        assert link is not None
        settled: Deferred[None] = Deferred()
        sent.addBoth(lambda result: None if settled.called else settled.callback(None))

        def too_late() -> None:
            if settled.called:
                return
            log.warn("reload: this process (pid {me}) stops while its 'committed' has not left it for {seconds:g}s: "
                     "it drops it unsent, and pid {pid} keeps everything", me=os.getpid(), seconds=CLOSE_SECONDS,
                     pid=self._inheritance.pid)
            link.drop()  # what is not written out never will be: the flush fails, ``unsent`` follows

        timer = self._reactor.callLater(CLOSE_SECONDS, too_late)

        def then(_: object) -> Deferred[None]:
            if timer.active():
                timer.cancel()
            return self.stop()

        return settled.addCallback(then)


def _connection(value: Any) -> dict[str, Any] | None:
    """A connection as data from a record (edge/connection.py's ``snapshot``); BadFrame if it is not one."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("state"), str):
        raise BadFrame(f"a connection's record that is not one: {value!r}"[:200])
    return value

