"""The unix socket between the running process and its successor, as a Twisted protocol.

Frames (wire.py) go both ways; descriptors go beside them with
``IUNIXTransport.sendFileDescriptor`` (Twisted sends each with one byte of
the frame that follows) and come in through ``fileDescriptorReceived``,
before the bytes they came with.  A frame that says ``"fds": n`` takes the
next ``n`` received descriptors.
"""

from __future__ import annotations

import collections
import os
import socket
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IFileDescriptorReceiver
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from zope.interface import implementer

from .wire import BadFrame, Decoder, encode

log = Logger()

#: ``on_message(message, blob, fds)``: the descriptors are the receiver's to close.
OnMessage = Callable[[dict[str, Any], bytes, list[int]], None]


@implementer(IFileDescriptorReceiver)
class Link(Protocol):
    """One end of the handover's socket."""

    def __init__(self, on_message: OnMessage):
        self._on_message = on_message
        self._decoder = Decoder()
        self._fds: collections.deque[int] = collections.deque()
        #: Fires (with None) when the other end is gone, or this end closed.
        self.closed: Deferred[None] = Deferred()

    def send(self, message: dict[str, Any], blob: bytes = b"", fds: tuple[int, ...] | list[int] = ()) -> None:
        """Send a frame with ``fds`` beside it (kept open by the caller until the peer says it has them)."""
        frame = encode({**message, "fds": len(fds)}, blob)
        if len(frame) < len(fds):  # each descriptor travels with one byte of the frame
            raise ValueError("a frame too short for its descriptors")
        for fd in fds:
            self.transport.sendFileDescriptor(fd)  # type: ignore[union-attr]  # a unix transport
        self.transport.write(frame)  # type: ignore[union-attr]

    def fileDescriptorReceived(self, descriptor: int) -> None:
        self._fds.append(descriptor)

    def dataReceived(self, data: bytes) -> None:
        try:
            for message, blob in self._decoder.feed(data):
                count = message.get("fds", 0)
                if not isinstance(count, int) or count < 0 or count > len(self._fds):
                    raise BadFrame(f"a frame that says it carries {count!r} descriptors, {len(self._fds)} came")
                fds = [self._fds.popleft() for _ in range(count)]
                self._on_message(message, blob, fds)
        except BadFrame as e:
            log.error("reload: the other process sent a bad frame ({why}); closing the link", why=str(e))
            self.transport.loseConnection()  # type: ignore[union-attr]
        except Exception:
            log.failure("reload: handling a frame from the other process failed; closing the link")
            self.transport.loseConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason=None) -> None:
        while self._fds:
            try:
                os.close(self._fds.popleft())
            except OSError:
                pass
        if not self.closed.called:
            self.closed.callback(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.loseConnection()


def adopt_link(reactor, sock: socket.socket, on_message: OnMessage) -> Link:
    """Run ``sock`` (one end of a ``socketpair``) as a :class:`Link` on ``reactor``; ``sock`` is closed here."""
    link = Link(on_message)
    sock.setblocking(False)
    transport = reactor.adoptStreamConnection(sock.fileno(), socket.AF_UNIX, Factory.forProtocol(lambda: link))
    sock.close()
    assert transport is not None and transport.protocol is link
    return link
