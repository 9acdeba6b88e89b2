"""A descriptor sent over the handover's link is the one it names when the transport writes it out.

A unix transport queues a descriptor by its number (``sendFileDescriptor``)
and names that number in a ``sendmsg`` only when it writes the frame out,
maybe turns later.  A number closed meanwhile is the next socket's (an
accept takes the lowest free number): the new process would receive that
socket instead.  So the link owns what it is given to send and closes each
descriptor only once the bytes carrying it are written out, or the link
has ended: here, whatever the old process does meanwhile (it ends the
handover, the new process acknowledges some frames), every number freed is
taken at once by another socket, and the new process still receives
exactly the connections that were sent, with none of them left open in
the old process.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import pytest_twisted
from hypothesis import given, settings, strategies as st
from twisted.internet import reactor
from twisted.internet.error import ConnectionAborted
from twisted.python.failure import Failure

from helpers import sleep, wait_for
from yieldproxy.lifecycle.succession.link import adopt_link
from yieldproxy.lifecycle.succession.predecessor import Predecessor
from yieldproxy.lifecycle.succession.wire import Decoder, pack

#: Frames ahead of the connections that the new process's end has not read yet (its socket full).
FILLERS = 20
#: Frames of connections sent, and connections in each.
FRAMES, PER_FRAME = 3, 4


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def _open_inodes() -> list[int]:
    """The inode of every descriptor open in this process."""
    inodes = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            inodes.append(_inode(int(name)))
    return inodes


def _take_freed(numbers: list[int]) -> list[int]:
    """Every number of ``numbers`` closed by now is the next socket's (an accept meanwhile): those numbers."""
    taken = []
    for fd in numbers:
        try:
            os.fstat(fd)
        except OSError:
            decoy = socket.socket(socket.AF_INET, socket.SOCK_STREAM).detach()  # maybe that very number
            if decoy != fd:
                os.dup2(decoy, fd)
                os.close(decoy)
            taken.append(fd)
    return taken


def _close_all(fds: list[int], pairs: list[tuple[socket.socket, socket.socket]], theirs: socket.socket, link) -> None:
    """The test's own descriptors and sockets, and the link if it has not ended."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    for server, client in pairs:
        server.close()
        client.close()
    theirs.close()
    if not link.closed.called:
        link.drop()


async def _read_until(theirs: socket.socket, last: str) -> tuple[list[str], list[int]]:
    """What the new process's end reads, up to the frame ``last``: the frames' types and the descriptors."""
    decoder, kinds, fds = Decoder(), [], []
    theirs.setblocking(False)
    for _ in range(4000):
        try:
            data, received, _flags, _address = socket.recv_fds(theirs, 1 << 16, 64)
        except BlockingIOError:
            await sleep(reactor, 0.005)
            continue
        fds.extend(received)
        kinds.extend(message["type"] for message, _ in decoder.feed(data))
        if last in kinds or not data:
            return kinds, fds
    raise AssertionError(f"{last!r} never came")


@pytest.mark.parametrize("fillers", [0, FILLERS], ids=["queued", "behind-a-full-socket"])
@pytest.mark.parametrize("acked", [0, 1, FRAMES], ids=["none-acked", "one-acked", "all-acked"])
@pytest_twisted.ensureDeferred
async def test_the_new_process_receives_the_connections_sent_even_if_their_numbers_are_taken_meanwhile(
    fillers, acked,
):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    link = adopt_link(reactor, ours, lambda message, blob, fds: None, farewell={"type": "abort"})
    old = Predecessor(reactor, [], {}, {}, {}, object(), object(), dict, lambda: None)
    old._link = link
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(FRAMES * PER_FRAME)]
    decoys: list[int] = []
    received: list[int] = []
    try:
        for _ in range(fillers):
            link.send({"type": "filler", "pad": "x" * 60000})
        sent: list[int] = []
        for frame in range(FRAMES):
            servers = [server for server, _client in pairs[frame * PER_FRAME:(frame + 1) * PER_FRAME]]
            fds = [os.dup(server.fileno()) for server in servers]
            sent.extend(fds)
            packed, blob = pack([({"family": socket.AF_UNIX, "listener": "proxy"}, b"") for _ in fds])
            old._send(link, {"type": "connections", "records": packed}, blob, fds)
        for frame in range(1, acked + 1):
            old._message({"type": "took", "id": frame, "fds": 0}, b"", [])
        old._give_up(kill=False)  # the old process ends the handover: ``abort``, then the link closes
        # Every number freed now is the next socket's (an accept meanwhile).
        decoys = _take_freed(sent)
        kinds, received = await _read_until(theirs, "abort")
        assert kinds.count("connections") == FRAMES
        assert [_inode(fd) for fd in received] == [_inode(server.fileno()) for server, _client in pairs]
        await wait_for(reactor, lambda: link.closed.called, timeout=5)
        for fd in received:
            os.close(fd)
        received = []
        # None left open here but the connections' own sockets: each sent descriptor closed once out.
        inodes = _open_inodes()
        assert [inodes.count(_inode(server.fileno())) for server, _client in pairs] == [1] * len(pairs)
    finally:
        _close_all(decoys + received, pairs, theirs, link)


#: A step of the sequence: ``send`` a frame with this many connections, the new process ``read``s this many bytes,
#: the transport writes what it can (``write``), or every number freed so far is the next socket's (``reuse``).
STEPS = st.one_of(
    st.tuples(st.just("send"), st.integers(0, 5)),
    st.tuples(st.just("read"), st.integers(1, 1 << 17)),
    st.tuples(st.just("write"), st.just(0)),
    st.tuples(st.just("reuse"), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(STEPS, max_size=30), end=st.sampled_from(["close", "drop"]))
def test_at_every_moment_a_descriptor_sent_is_the_connection_it_was_when_sent(steps, end):
    """Whatever the order of sends, partial writes and reads, and numbers taken again as soon as they are free,
    what the new process receives is, in order, the connections sent (each number closed only once written out),
    up to where the link ended; and the link keeps none open once it has ended."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    theirs.setblocking(False)
    link = adopt_link(reactor, ours, lambda message, blob, fds: None)
    transport = link.transport
    pairs: list[tuple[socket.socket, socket.socket]] = []
    sent: list[int] = []
    taken: list[int] = []
    received: list[int] = []

    def write() -> None:
        """The transport writes what it can, as the reactor would (an end it returns is its end)."""
        why = transport.doWrite()
        transport.stopWriting()
        if why is not None:
            transport.connectionLost(Failure(why))

    def read(size: int) -> None:
        with contextlib.suppress(BlockingIOError, ConnectionResetError):
            _data, fds, _flags, _address = socket.recv_fds(theirs, size, 64)
            received.extend(fds)

    try:
        transport.stopWriting()  # the test's steps write, not the reactor
        for kind, n in steps:
            if kind == "send":
                new = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
                pairs.extend(new)
                fds = [os.dup(server.fileno()) for server, _client in new]
                sent.extend(fds)
                link.send({"type": "connections", "pad": "x" * 30000}, b"", fds)
                transport.stopWriting()
            elif kind == "read":
                read(n)
            elif kind == "write" and transport.connected:
                write()
            elif kind == "reuse":
                taken.extend(_take_freed(sent))
        inodes = [_inode(server.fileno()) for server, _client in pairs]
        assert [_inode(fd) for fd in received] == inodes[:len(received)]
        if end == "close":
            link.close()
            for _ in range(1000):  # everything written out, then the orderly close
                if not transport.connected:
                    break
                read(1 << 17)
                write()
        else:
            link.drop()
            transport.connectionLost(Failure(ConnectionAborted()))  # the reactor's next turn, here
        assert link.closed.called
        for _ in range(1000):
            before = len(received)
            read(1 << 17)
            if len(received) == before:
                break
        assert [_inode(fd) for fd in received] == inodes[:len(received)]
        if end == "close":
            assert len(received) == len(inodes)
        for fd in received:
            os.close(fd)
        received = []
        open_inodes = _open_inodes()
        assert [open_inodes.count(inode) for inode in inodes] == [1] * len(inodes)
    finally:
        _close_all(taken + received, pairs, theirs, link)
