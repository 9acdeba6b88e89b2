"""A listener's connections: their cap, the room kept for whole requests, and the receiving budget.

:class:`Connections` counts one listener's open connections from their own
``connectionMade``/``connectionLost`` (so the count cannot drift) and bounds
the bytes of request bodies being received at once; :class:`OverCapacity`
answers a connection past the cap.  The rules, and why no client that stalls
on purpose keeps a request out: docs/security.md (*Connections*, *Bodies
being received*, *The admin API under a flood*).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.logger import Logger

from .reader import DEFAULT_LIMITS, NEED_DATA, PAUSED, EndOfMessage, Limits, RequestReader
from .refusal import ErrorBody, Refusal, plain_error_body, shut_write, wire_answer

log = Logger()

#: Seconds a connection over the cap waits for its request line (to answer in its API's shape).
OVER_CAPACITY_WAIT = 1.0
#: Retry-After, in seconds, of the 503 for a connection over the cap.
OVER_CAPACITY_RETRY_AFTER = 2
#: Connections being refused at once (each holds a descriptor for a second or two);
#: at it the listener stops accepting until one is done, and the next clients wait in the backlog.
MAX_REFUSING = 64
#: Connections a listener keeps past its cap for requests that come whole at once (the admin
#: listener's, see :class:`OverCapacity`); they fit in the open-file budget's reserve (lifecycle/limits.py).
QUICK_ROOM = 8
#: Seconds between two log lines about refused connections.
REFUSAL_LOG_INTERVAL = 10.0
#: Bytes of a request head at most (the reader's limit): a connection over the cap reads no more.
MAX_HEADER_BYTES = 16384
#: Bytes a connection past the cap may send in all (head and body) to be let in as a whole request.
MAX_QUICK_BYTES = 2 * MAX_HEADER_BYTES
#: A body up to this size is small: the last quarter of the receiving budget is kept for such bodies.
SMALL_BODY_BYTES = 64 * 1024
#: Seconds without a byte after which a body being received is stalled: it gives its budget to a body arriving.
RECEIVING_STALL_SECONDS = 1.0
#: Bytes per second, on average since its first byte, below which a body being received is stalled all the
#: same (one that sends a byte now and then to look alive).
RECEIVING_MIN_PACE = 64 * 1024


def _peer_host(address) -> str | None:
    """The host of a peer address (None for a unix socket's: no cap per address there)."""
    return getattr(address, "host", None)


@attrs.define(eq=False)
class Connections:
    """The open connections of one listener, and its cap (see the module docstring)."""

    #: Connections at once; the config key named in the refusal.
    limit: int
    key: str = "proxy.max_connections"
    open: int = 0
    #: Connections answered 503 (or closed unanswered) because of the cap, since start.
    refused: int = 0
    #: Idle keep-alive connections closed to make room, since start.
    reclaimed: int = 0
    refusing: int = 0
    #: Bytes of request bodies being received at once (None: not bounded); see :meth:`take_receiving`.
    max_receiving_bytes: int | None = None
    #: Bytes of request bodies being received now (what has arrived of each, not what it announced).
    receiving: int = 0
    #: What a small body is, and when a body being received is stalled: the constants' (see :meth:`take_receiving`).
    small_body_bytes: int = SMALL_BODY_BYTES
    stall_seconds: float = RECEIVING_STALL_SECONDS
    min_pace: float = RECEIVING_MIN_PACE
    #: Connections cut to make a place for a whole request (admin listener), since start.
    shed: int = 0
    #: Connections one peer address may hold (None: no cap per address); past it, as past the cap.
    per_peer: int | None = None
    #: Connections past ``limit`` kept for requests that come whole within ``quick_seconds`` (see
    #: :class:`OverCapacity`); 0 with ``quick_seconds`` None: no such room (the proxy listener).
    reserved: int = 0
    quick_seconds: float | None = None
    _peers: dict = attrs.Factory(dict)
    _peer_of: dict = attrs.Factory(dict)
    _idle: dict = attrs.Factory(dict)
    _last_log: float | None = None
    _refused_since_log: int = 0
    #: The listeners serving these connections (edge/listener.py), held back while too many are being refused.
    _listeners: list = attrs.Factory(list)
    _held_back: bool = False
    #: Connections accepted that have not sent a byte yet (not reclaimable, but a reload hands them over).
    _fresh: dict = attrs.Factory(dict)
    #: Connections past the cap whose whole request came in time, waiting (first come, first served) for
    #: room in :attr:`reserved` (see :class:`OverCapacity`).
    _waiting: dict = attrs.Factory(dict)
    #: Every open channel (a stop waits for the answers still to be written to them: :meth:`flushed`).
    _channels: dict = attrs.Factory(dict)
    #: The channels holding bytes in the receiving budget (:meth:`take_receiving`).
    _receivers: dict = attrs.Factory(dict)
    #: The channels cut to make a place for a whole request, until their connection is gone (:meth:`shed_for`).
    _shedding: dict = attrs.Factory(dict)
    #: The channels a stop waits to see written out and closed, and its waiter (:meth:`flushed`).
    _flushing: dict = attrs.Factory(dict)
    _flushed: list = attrs.Factory(list)

    def opened(self, channel) -> None:
        """A channel's connection is made: counted whatever it does next, and never idle (so never reclaimed):
        its request is coming, and closing it would leave its client without an answer."""
        self.open += 1
        self._channels[channel] = None
        self._fresh[channel] = None
        if self.per_peer is not None:
            host = _peer_host(channel.transport.getPeer())
            if host is not None:
                self._peer_of[channel] = host
                self._peers[host] = self._peers.get(host, 0) + 1

    def closed(self, channel) -> None:
        """A channel's connection is gone: its descriptor is free again."""
        self.open -= 1
        self._channels.pop(channel, None)
        self._receivers.pop(channel, None)
        self._shedding.pop(channel, None)
        if self._flushing and self._flushing.pop(channel, 1) is None and not self._flushing:
            self._done_flushing()
        if self._waiting:
            next(iter(self._waiting)).room_freed()
        self._idle.pop(channel, None)
        self._fresh.pop(channel, None)
        if self._peer_of:
            host = self._peer_of.pop(channel, None)
            if host is not None:
                left = self._peers[host] - 1
                if left:
                    self._peers[host] = left
                else:
                    del self._peers[host]

    def flushed(self) -> Deferred[None]:
        """Fires once every connection holding answer bytes not yet written to its socket has written them
        and closed (each is closed: its transport's ``loseConnection`` writes them first).

        The stop's last step: the process ends right after, and the reactor's end drops what a transport
        still buffers, so an answer written just before (the drain's 503s) would reach its client as a bare
        close.  Connections with nothing left to write are not waited for, nor one whose request is still
        being served (its answer is not done)."""
        waiter: Deferred[None] = Deferred()
        self._flushed.append(waiter)
        for channel in list(self._channels):
            if channel.unsent and not channel.serving:
                self._flushing[channel] = None
        for channel in list(self._flushing):
            channel.loseConnection()
        if not self._flushing:
            self._done_flushing()
        return waiter

    def _done_flushing(self) -> None:
        waiters, self._flushed = self._flushed, []
        for waiter in waiters:
            if not waiter.called:
                waiter.callback(None)

    def peer_full(self, address) -> bool:
        """``address`` holds its share of the listener already (``per_peer``)."""
        if self.per_peer is None:
            return False
        host = _peer_host(address)
        return host is not None and self._peers.get(host, 0) >= self.per_peer

    def make_room(self) -> bool:
        """Room for a request that came whole at once: the room kept for such requests, or an idle connection's."""
        return self.open < self.limit + self.reserved or self.reclaim_idle()

    def wait_for_room(self, waiter, now: float) -> None:
        """``waiter`` (an :class:`OverCapacity`) has a whole request and no room: its ``room_freed`` is called,
        first come first served, when a connection closes; and a connection is cut for it (:meth:`shed_for`)."""
        self._waiting[waiter] = None
        self.shed_for(now)

    def shed_for(self, now: float) -> None:
        """Cut connections that hold a place without a whole request in it, one per whole request waiting.

        The one cut is the one that has made the least progress (``channel.shed_rank()``: the time of its
        last progress, None for one that may not be cut: its whole request is being served).
        """
        while len(self._shedding) < len(self._waiting):
            victim, oldest = None, None
            for channel in self._channels:
                if channel in self._shedding:
                    continue
                rank = getattr(channel, "shed_rank", None)
                progress = rank() if rank is not None else None
                if progress is not None and (oldest is None or progress < oldest):
                    victim, oldest = channel, progress
            if victim is None or oldest is None:
                return
            self._shedding[victim] = None
            self.shed += 1
            log.info(
                "cut a connection that made no progress for {seconds:.1f}s to let a whole request in ({key})",
                seconds=max(0.0, now - oldest), key=self.key,
            )
            victim.shed()

    def stop_waiting(self, waiter) -> None:
        self._waiting.pop(waiter, None)
        if self._waiting and self.open < self.limit + self.reserved:
            next(iter(self._waiting)).room_freed()

    def first_in_line(self, waiter) -> bool:
        """No request that came whole before ``waiter``'s is still waiting for room."""
        return not self._waiting or next(iter(self._waiting)) is waiter

    def idle(self, channel) -> None:
        """``channel`` waits for its next request: the cap may reclaim it (oldest first)."""
        self._idle[channel] = None

    def busy(self, channel) -> None:
        """``channel`` is no longer fresh or idle: a request is coming in."""
        self._idle.pop(channel, None)
        self._fresh.pop(channel, None)

    def idle_channels(self) -> list:
        """The connections waiting for a request, the first or the next (a reload hands them over)."""
        return [*self._fresh, *self._idle]

    def full(self) -> bool:
        """At the cap: a new connection needs room made, or is refused."""
        return self.open >= self.limit

    def reclaim_idle(self) -> bool:
        """Close the oldest idle keep-alive connection, if there is one."""
        while self._idle:
            channel = next(iter(self._idle))
            del self._idle[channel]
            if not channel.reclaimable:
                continue
            self.reclaimed += 1
            channel.loseConnection()
            return True
        return False

    def take_receiving(self, channel, size: int, large: bool, now: float) -> bool:
        """Count ``size`` more bytes of ``channel``'s body being received, if they fit; False if they do not.

        When they do not, the stalled bodies (no byte for ``stall_seconds``, or under ``min_pace`` bytes a
        second on average since their first) are cut, the slowest first, each answered 408, until they fit.
        A large body (over :data:`SMALL_BODY_BYTES`) may fill three quarters of ``max_receiving_bytes``, the
        last quarter is kept for small ones; a body alone always fits (docs/security.md).
        """
        limit = self.max_receiving_bytes
        if limit is not None and self.receiving:
            room = limit - limit // 4 if large else limit
            if self.receiving + size > room:
                self._cut_stalled(channel, self.receiving + size - room, now)
                if self.receiving and self.receiving + size > room:
                    return False
        self.receiving += size
        self._receivers[channel] = None
        return True

    def _cut_stalled(self, needing, short: int, now: float) -> None:
        """Cut stalled bodies (not ``needing``'s), the slowest first, until ``short`` bytes are free."""
        stalled = []
        for channel in self._receivers:
            if channel is needing:
                continue
            pace, silent = channel.receiving_pace(now)
            if silent >= self.stall_seconds or pace < self.min_pace:
                stalled.append((pace, -silent, id(channel), channel))
        stalled.sort()
        for _pace, _silent, _id, channel in stalled:
            if short <= 0:
                return
            held = channel.receiving_held
            channel.cut_stalled()
            short -= held

    def give_back_receiving(self, channel, size: int) -> None:
        self.receiving -= size
        self._receivers.pop(channel, None)

    def listening(self, listener) -> None:
        """``listener`` accepts these connections: it is held back (``hold_back``/``let_in``) under a flood."""
        if listener not in self._listeners:
            self._listeners.append(listener)
            if self._held_back:
                listener.hold_back()

    def stopped_listening(self, listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def refusing_started(self) -> None:
        """A connection is being refused: at :data:`MAX_REFUSING`, stop accepting until one is done."""
        self.refusing += 1
        if self.refusing >= MAX_REFUSING and not self._held_back:
            self._held_back = True
            for listener in self._listeners:
                listener.hold_back()

    def refusing_ended(self) -> None:
        self.refusing -= 1
        if self._held_back and self.refusing < MAX_REFUSING:
            self._held_back = False
            for listener in self._listeners:
                listener.let_in()

    def note_refusal(self, clock) -> None:
        """Count a refused connection; log it, at most once every few seconds."""
        self.refused += 1
        self._refused_since_log += 1
        now = clock.seconds()
        if self._last_log is None or now - self._last_log >= REFUSAL_LOG_INTERVAL:
            log.warn(
                "connection cap reached ({key} = {limit}): refused {count} connection(s) with 503",
                key=self.key, limit=self.limit, count=self._refused_since_log,
            )
            self._last_log = now
            self._refused_since_log = 0


class OverCapacity(Protocol):
    """A connection past the cap: a 503 with Retry-After in its API's shape, then closed.

    It waits up to :data:`OVER_CAPACITY_WAIT` for the request line, to answer in its route's shape, then
    shuts its side and drops what still comes for a moment (so the client reads the answer, not a reset).
    With ``promote`` (the admin listener), a request that comes whole (the reader has read its end) within
    ``quick_seconds`` goes to a channel built by ``promote(address)`` when there is room kept for it, or
    waits in line for it (docs/security.md, *The admin API under a flood*).
    """

    #: Set by ``makeConnection``: a TCP (or unix) transport.
    transport: Any

    def __init__(
        self, connections: Connections, clock, promote: Callable[[Any], Any] | None = None,
        error_body: ErrorBody = plain_error_body, limits: Limits = DEFAULT_LIMITS,
    ):
        self._connections = connections
        self._clock = clock
        self._promote = promote
        self._error_body = error_body
        self._head = b""
        #: Reads what came: its request line names the shape of the 503, and (``promote``) its end tells a
        #: whole request from one that only looks whole.
        self._reader = RequestReader(limits)
        self._timer = None
        self._answered = False
        #: The next try for room, after a connection closed (:meth:`room_freed`).
        self._retry = None
        #: Its whole request waits for room kept (:meth:`Connections.wait_for_room`).
        self._in_line = False

    def connectionMade(self):
        self._connections.refusing_started()
        wait = OVER_CAPACITY_WAIT
        if self._promote is not None:
            wait = self._connections.quick_seconds or wait
        self._timer = self._clock.callLater(wait, self._answer)

    def dataReceived(self, data):
        if self._answered:
            return
        self._head += data
        if self._in_line:
            if len(self._head) > MAX_QUICK_BYTES:
                self._answer()
            return
        if self._promote is not None:
            whole = self._whole(data)
            if whole is None:
                self._answer()  # malformed, or more than a quick request: refused as usual
            elif whole:
                if self._connections.first_in_line(self) and self._connections.make_room() and self._hand_over():
                    return
                if getattr(self.transport, "protocol", None) is not self:
                    self._answer()  # a wrapping transport (TLS) cannot be handed over: refused as usual
                    return
                # In line for the room kept, for a while: every request before it is answered in turn, and a
                # connection that holds a place without a whole request is cut for it.
                self._in_line = True
                self._stop_timer()
                self._timer = self._clock.callLater(OVER_CAPACITY_WAIT, self._answer)
                self._connections.wait_for_room(self, self._clock.seconds())
        elif self._line_read(data) or len(self._head) > MAX_HEADER_BYTES:
            self._answer()

    def _line_read(self, data: bytes) -> bool:
        """Whether the request line is read (or will never be): time to answer, in its route's shape."""
        reader = self._reader
        reader.feed(data)
        if reader.request_line is None and reader.next_event() is NEED_DATA:
            return reader.request_line is not None
        return True

    def _whole(self, data: bytes) -> bool | None:
        """Whether the request is whole now (its end read by the request reader); None: it never will be here."""
        if len(self._head) > MAX_QUICK_BYTES:
            return None
        reader = self._reader
        reader.feed(data)
        while True:
            event = reader.next_event()
            if event is NEED_DATA:
                return False
            if type(event) is EndOfMessage:
                return True
            if event is PAUSED or type(event) is Refusal:
                return None

    def room_freed(self) -> None:
        """A connection closed: try for room once the reactor is through with that close."""
        if self._retry is None and not self._answered:
            self._retry = self._clock.callLater(0, self._try_room)

    def _try_room(self) -> None:
        self._retry = None
        if not self._answered and self._connections.make_room():
            self._hand_over()

    def _hand_over(self) -> bool:
        """Give the connection, and what it sent, to a channel of the site; False if its transport cannot switch."""
        transport = self.transport
        if getattr(transport, "protocol", None) is not self:
            return False  # a wrapping transport (TLS) delivers to another attribute: refused as usual
        self._answered = True
        self._stop_timer()
        self._connections.stop_waiting(self)
        self._connections.refusing_ended()
        channel = self._promote(transport.getPeer())
        channel.one_request = True
        transport.protocol = channel
        channel.makeConnection(transport)
        channel.dataReceived(self._head)
        return True

    def _answer(self) -> None:
        if self._answered:
            return
        self._answered = True
        self._stop_timer()
        self._connections.stop_waiting(self)
        self._connections.note_refusal(self._clock)
        refusal = Refusal(
            503,
            f"too many connections to this listener ({self._connections.key} = {self._connections.limit}); "
            "try again shortly",
            "too_many_connections",
            retry_after=OVER_CAPACITY_RETRY_AFTER,
        )
        transport = self.transport
        transport.write(wire_answer(refusal, self._error_body, self._reader.request_line))
        if shut_write(transport):
            self._timer = self._clock.callLater(OVER_CAPACITY_WAIT, transport.abortConnection)

    def _stop_timer(self) -> None:
        for name in ("_timer", "_retry"):
            timer = getattr(self, name)
            setattr(self, name, None)
            if timer is not None and timer.active():
                timer.cancel()

    def connectionLost(self, reason):
        self._stop_timer()
        self._connections.stop_waiting(self)
        self._connections.refusing_ended()


