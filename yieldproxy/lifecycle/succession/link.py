"""The unix socket between the running process and its successor, as a Twisted protocol.

Frames (wire.py) go both ways; descriptors go beside them with
``IUNIXTransport.sendFileDescriptor`` (Twisted sends each with one byte of
the frame that follows) and come in through ``fileDescriptorReceived``,
before the bytes they came with.  A frame that says ``"fds": n`` takes the
next ``n`` received descriptors.  The transport names a descriptor by its number
only when it writes it out, maybe turns later: a number closed meanwhile would
be the next socket's, sent in its place.  So a descriptor given to
:meth:`Link.send` is the link's, closed once everything written so far is out
(:meth:`Link.resumeProducing`) or the link has ended, never before.  The link is its transport's *pull*
producer, so it knows when what was sent has left this process
(:meth:`Link.flushed`); and how it ended (:attr:`Link.ended_here`, the
``farewell`` said before every end this side chooses) is what the other
side reads this process's fate from (liveness.py).  So the link's end is told
only after every frame the other process wrote before it is read, even when a
write that fails ends the transport first, or a frame this side could not
handle ended it (:meth:`Link._read_what_is_left`): a ``committed`` the other
process got out is never left unread, whatever ends the link.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IFileDescriptorReceiver, IPullProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from zope.interface import implementer

from .wire import BadFrame, Decoder, encode

log = Logger()

class LinkClosed(Exception):
    """The other end of the link is gone."""


#: ``on_message(message, blob, fds)``: the descriptors are the receiver's to close.
OnMessage = Callable[[dict[str, Any], bytes, list[int]], None]


@implementer(IFileDescriptorReceiver, IPullProducer)
class Link(Protocol):
    """One end of the handover's socket."""

    def __init__(self, on_message: OnMessage, farewell: dict[str, Any] | None = None):
        self._on_message = on_message
        #: Sent before every end this side chooses (:meth:`close`): an end without it is this process's death.
        self._farewell = farewell
        #: This side ended the link (:meth:`close`, or a frame it could not handle), rather than the other process.
        self.ended_here = False
        #: The owner ended the link (:meth:`close`, :meth:`drop`): nothing more is read (it has moved on).
        self._reads_no_more = False
        #: A frame could not be read: nothing after it can be.
        self._unreadable = False
        self._decoder = Decoder()
        self._fds: collections.deque[int] = collections.deque()
        #: Fires (with None) when the other end is gone, or this end closed.
        self.closed: Deferred[None] = Deferred()
        #: Frames given to the transport that it has not written out yet (see :meth:`resumeProducing`).
        self._unsent = False
        #: :meth:`flushed`'s waiters, fired once the transport has written everything out.
        self._flush_waiters: list[Deferred[None]] = []
        #: A copy of the transport's socket, kept to read what is left when the transport ends (adopt_link).
        self._sock: socket.socket | None = None
        #: Descriptors given to the transport to send: the link's, closed once written out (or at the end).
        self._in_flight: list[int] = []

    def connectionMade(self) -> None:
        # Its pull producer: told each time the transport has written out everything it was given.
        self.transport.registerProducer(self, False)  # type: ignore[union-attr]

    @property
    def open(self) -> bool:
        """Whether a frame sent now can still leave: not once the transport has ended, even while the frames
        read at the end are handled (:attr:`closed` fires after them)."""
        transport: Any = self.transport
        return not self.closed.called and transport is not None and getattr(transport, "connected", False)

    def send(self, message: dict[str, Any], blob: bytes = b"", fds: tuple[int, ...] | list[int] = ()) -> None:
        """Send a frame with ``fds`` beside it; the ``fds`` are the link's from this call on (closed once
        written out, or at once if nothing is sent: the caller never closes them).

        Nothing is sent once the link has ended."""
        transport: Any = self.transport  # a unix transport
        if not self.open:
            _close_all(fds)
            return
        frame = encode({**message, "fds": len(fds)}, blob)
        if len(frame) < len(fds):  # each descriptor travels with one byte of the frame
            _close_all(fds)
            raise ValueError("a frame too short for its descriptors")
        self._in_flight.extend(fds)
        for fd in fds:
            transport.sendFileDescriptor(fd)
        self._unsent = True
        transport.write(frame)

    def send_now(self, message: dict[str, Any]) -> None:
        """Send a frame into the socket at once, not at the reactor's next turn (a process about to end:
        its reactor's end drops what a transport still buffers)."""
        self.send(message)
        transport = self.transport
        if transport is not None and getattr(transport, "connected", False):
            transport.doWrite()  # type: ignore[attr-defined]  # a FileDescriptor

    def flushed(self, clock: Any = None) -> Deferred[None]:
        """Fires once every frame sent so far is in the socket (the other process reads it even if this
        one dies next); fails with :class:`LinkClosed` if the link ends before all of it is (an end this
        side chose with :meth:`close` writes it all out first: that one fires it)."""
        done: Deferred[None] = Deferred()
        if not self.open:
            done.errback(LinkClosed("the other process is gone"))
            return done
        if self._unsent:
            # At once, not at the reactor's next turn (a no-op when nothing waits to be written).
            self.transport.doWrite()  # type: ignore[union-attr]  # a FileDescriptor
        if not self._unsent:
            done.callback(None)
        else:
            self._flush_waiters.append(done)
        return done

    # -- the transport's pull-producer interface ---------------------------------------------------

    def resumeProducing(self) -> None:
        """The transport has written out everything it was given: the descriptors it sent are named by no
        send any more."""
        self._unsent = False
        in_flight, self._in_flight = self._in_flight, []
        _close_all(in_flight)
        waiters, self._flush_waiters = self._flush_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def stopProducing(self) -> None:
        """The transport is going away: :meth:`connectionLost` follows."""

    def fileDescriptorReceived(self, descriptor: int) -> None:
        self._fds.append(descriptor)

    def dataReceived(self, data: bytes) -> None:
        if self._unreadable:
            return
        try:
            for message, blob in self._decoder.feed(data):
                count = message.get("fds", 0)
                if not isinstance(count, int) or count < 0 or count > len(self._fds):
                    raise BadFrame(f"a frame that says it carries {count!r} descriptors, {len(self._fds)} came")
                fds = [self._fds.popleft() for _ in range(count)]
                self._on_message(message, blob, fds)
        except BadFrame as e:
            self._unreadable = True
            log.error("reload: the other process sent a bad frame ({why}); closing the link", why=str(e))
            self._end()
        except Exception:
            log.failure("reload: handling a frame from the other process failed; closing the link")
            self._end()  # what follows that frame is still read, to the end (:meth:`_read_what_is_left`)

    def connectionLost(self, reason=None) -> None:
        self._read_what_is_left()
        waiters, self._flush_waiters = self._flush_waiters, []
        # An end this side chose, reached cleanly, came once everything was written out (:meth:`close`: the
        # transport closes only then); any other end may have left some of it unsent.
        written = self.ended_here and reason is not None and reason.check(ConnectionDone) is not None
        for waiter in waiters:
            if written:
                waiter.callback(None)
            else:
                waiter.errback(LinkClosed("the other process is gone"))
        in_flight, self._in_flight = self._in_flight, []
        _close_all(in_flight)  # the transport is gone: what it did not send, it never will
        _close_all(self._fds)
        self._fds.clear()
        if not self.closed.called:
            self.closed.callback(None)

    def _read_what_is_left(self) -> None:
        """Before the end is told: every frame the other process wrote before it ended is read.

        A transport ends on a write that fails (the other end closed: EPIPE) whatever waits unread: the
        reactor's readiness of the socket was read before those last frames came (or their read is left for
        later); or on a frame this side could not handle, with the frames behind it unread.  The link's own
        copy of the socket (:func:`adopt_link`) still reads them, so the end comes after every frame, the
        other process's last words (``aborting``, ``abort``, ``committed``) included; what it writes later
        fails there (EPIPE: the transport shut the socket down, both ways, before telling its end), never left
        unread here.  Not after an end the owner chose (:meth:`close`, :meth:`drop`): it reads no more."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            if self._reads_no_more:
                return
            sock.setblocking(False)
            self.dataReceived(b"")  # frames in whole already, behind one that could not be handled
            while not self._reads_no_more:
                try:
                    data, fds, _flags, _address = socket.recv_fds(sock, 1 << 16, 64)
                except OSError:  # nothing more (EAGAIN), or the other end's reset once all was read
                    break
                for fd in fds:
                    self.fileDescriptorReceived(fd)
                if not data:
                    break
                self.dataReceived(data)
        finally:
            sock.close()

    def close(self) -> None:
        """Say the farewell, then close once what was sent is written out (a transport with a producer
        registered does not close); :attr:`closed` fires then, and nothing more is read."""
        self._reads_no_more = True
        self._end()

    def _end(self) -> None:
        """:meth:`close`, reading on to the end (a frame this side could not handle ended the link)."""
        transport: Any = self.transport  # a unix transport: a consumer, whose producer this link is
        if not self.closed.called and not self.ended_here:
            self.ended_here = True
            if self._farewell is not None:
                self.send(self._farewell)
        if transport is not None:
            transport.unregisterProducer()
            transport.loseConnection()

    def drop(self) -> None:
        """End the link at once, this side's choice, dropping what the transport has not written out yet (it
        never leaves: :meth:`flushed`'s waiters fail); no farewell."""
        transport: Any = self.transport
        self.ended_here = self._reads_no_more = True
        if transport is not None and not self.closed.called:
            transport.unregisterProducer()
            transport.abortConnection()


def _close_all(fds: Any) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def adopt_link(reactor, sock: socket.socket, on_message: OnMessage, farewell: dict[str, Any] | None = None) -> Link:
    """Run ``sock`` (one end of a ``socketpair``) as a :class:`Link` on ``reactor``; ``sock`` is the link's now
    (kept to read what is left at the end: the transport runs on a copy of it)."""
    link = Link(on_message, farewell)
    sock.setblocking(False)
    transport = reactor.adoptStreamConnection(sock.fileno(), socket.AF_UNIX, Factory.forProtocol(lambda: link))
    assert transport is not None and transport.protocol is link
    link._sock = sock
    return link
