"""What a connection writes, and when the client has it: an answer in one send, and the client's pace heard.

A connection (connection.py) writes through one writer for its whole life,
which knows what Twisted's transport does not say in public: whether bytes
written still wait to go out (:attr:`~SocketWriter.unsent`: a stop waits for
them, a reload hands over only a connection with none), and whether the
client reads too slowly (:attr:`~SocketWriter.blocked`: the request's
producer is paused, and a client that stays so is dropped).

* :class:`SocketWriter`, on a TCP transport, which buffers every write until
  the reactor's next turn finds the socket writable (two ``epoll_ctl`` calls
  and a turn before the ``send``: more CPU than the rest of a small answer's
  way).  What is written in a turn goes out in one ``writeSomeData`` when the
  answer or the turn ends; only what the socket does not take is handed to
  the transport, and later writes go through it, in order, until it says
  it sent all (``resumeProducing``: the writer is its pull producer); past
  :data:`BUFFER_BYTES` handed, the writer is blocked.
* :class:`TransportWriter`, on anything else (TLS, a test's transport):
  writes go to the transport as they come, and its own backpressure is the
  writer's.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet import tcp

#: Bytes handed to the transport, not yet sent, past which the client is too slow for now (the transport's
#: own ``bufferSize``).
BUFFER_BYTES = 64 * 1024


class SocketWriter:
    """Writes to a TCP transport (see the module docstring)."""

    __slots__ = ("_transport", "_clock", "_on_blocked", "_on_drained", "_out", "_flush_call", "_handed", "blocked")

    def __init__(self, transport: Any, clock: Any, on_blocked: Callable[[], None], on_drained: Callable[[], None]):
        self._transport = transport
        self._clock = clock
        self._on_blocked = on_blocked
        self._on_drained = on_drained
        #: Written, not yet sent (sent together at :meth:`flush`).
        self._out: list[bytes] = []
        self._flush_call: Any = None
        #: Bytes handed to the transport since it last sent everything it had.
        self._handed = 0
        #: The client reads too slowly for now: more than :data:`BUFFER_BYTES` wait in the transport.
        self.blocked = False
        transport.registerProducer(self, False)

    @property
    def unsent(self) -> bool:
        """Bytes written that the socket has not taken yet."""
        return bool(self._out) or self._handed > 0

    def write(self, data: bytes) -> None:
        """Send ``data`` with whatever else is written this turn (at :meth:`flush`, or the turn's end)."""
        self._out.append(data)
        if self._flush_call is None:
            self._flush_call = self._clock.callLater(0, self.flush)

    def flush(self) -> None:
        """Send what waits: at once when the transport holds nothing, else through it (after what it holds)."""
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()
        out = self._out
        if not out:
            return
        self._out = []
        data = out[0] if len(out) == 1 else b"".join(out)
        transport = self._transport
        if not self._handed and transport.connected and not transport.disconnecting:
            sent = transport.writeSomeData(data)
            if isinstance(sent, int) and sent > 0:
                if sent == len(data):
                    return
                data = data[sent:]
        transport.write(data)
        self._handed += len(data)
        if not self.blocked and self._handed > BUFFER_BYTES:
            self.blocked = True
            self._on_blocked()

    def release(self) -> None:
        """Nothing more will be written: send what waits, and stop being the transport's producer (a transport
        with a producer registered does not close)."""
        self.flush()
        self._transport.unregisterProducer()

    def drop(self) -> None:
        """The connection is gone: what waits goes nowhere."""
        self._out = []
        call, self._flush_call = self._flush_call, None
        if call is not None and call.active():
            call.cancel()

    # -- the transport's pull-producer interface -------------------------------------------------

    def resumeProducing(self) -> None:
        """The transport has sent everything it was handed."""
        self._handed = 0
        if self.blocked:
            self.blocked = False
            self._on_drained()

    def pauseProducing(self) -> None:
        """Not called on a pull producer."""

    def stopProducing(self) -> None:
        """The transport is going away: its protocol's ``connectionLost`` follows."""


class TransportWriter:
    """Writes to any other transport as the writes come (see the module docstring)."""

    __slots__ = ("_transport", "_on_blocked", "_on_drained", "blocked")

    #: Not known of such a transport: taken as sent.
    unsent = False

    def __init__(self, transport: Any, on_blocked: Callable[[], None], on_drained: Callable[[], None]):
        self._transport = transport
        self._on_blocked = on_blocked
        self._on_drained = on_drained
        self.blocked = False
        transport.registerProducer(self, True)

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def flush(self) -> None:
        """Everything went to the transport already."""

    def release(self) -> None:
        self._transport.unregisterProducer()

    def drop(self) -> None:
        """Nothing waits here."""

    # -- the transport's push-producer interface -------------------------------------------------

    def pauseProducing(self) -> None:
        """The transport's buffer is full: the client reads too slowly for now."""
        self.blocked = True
        self._on_blocked()

    def resumeProducing(self) -> None:
        self.blocked = False
        self._on_drained()

    def stopProducing(self) -> None:
        """The transport is going away: its protocol's ``connectionLost`` follows."""


def writer_for(transport: Any, clock: Any, on_blocked: Callable[[], None], on_drained: Callable[[], None]) -> Any:
    """The writer of a connection on ``transport``."""
    if isinstance(transport, tcp.Connection):
        return SocketWriter(transport, clock, on_blocked, on_drained)
    return TransportWriter(transport, on_blocked, on_drained)
