"""The commit moment: a connection held by the new process has one owner whatever lands around ``committed``.

The new process owns what it holds once ``committed`` has left it (the old
process reads it even if the new one dies next), and the old process lets
go of its copies only on reading it.  So the one rule that makes two owners
impossible: the new process makes nothing again before ``committed`` is out.
A stop of the new process while ``committed`` waits to be written (the old
process not reading yet) must not make what it holds again: it waits for
the outcome, and if it cannot wait, drops ``committed`` unsent.

Each sequence below plays the old process on a raw socket (the new one is a
real :class:`TakeOver` on the reactor, its ``committed`` held up behind
frames the old end has not read): whatever the order of the commit, the new
process's stop, the old process reading, ending the handover or saying
nothing, the new process made the connections again if and only if the old
process read ``committed``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket

import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import sleep, wait_for
from test_succession_liveness import NewProcess, Standin
from yieldproxy.lifecycle.succession import takeover as takeover_module
from yieldproxy.lifecycle.succession.link import LinkClosed, adopt_link
from yieldproxy.lifecycle.succession.predecessor import HANDED_OVER, Predecessor
from yieldproxy.lifecycle.succession.takeover import ABORTED, COMMITTED, SENDING, SERVING, WAITING
from yieldproxy.lifecycle.succession.wire import Decoder, encode, pack

#: Connections the old process hands over before the commit.
HELD = 3
#: Frames the new process sends ahead of ``committed`` that the old end has not read (its socket full).
FILLERS = 20


class Listener:
    """A listener as the takeover sees it: its factory serves the connections made again."""

    key = "proxy.listen"
    factory = object()

    def resume(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class OldEnd:
    """The old process's side, played on the raw socket: what it read, whether it read ``committed``."""

    def __init__(self, new: NewProcess):
        self.new = new
        self.kinds: list[str] = []
        self.ended = False

    def read(self) -> None:
        """Whatever is in the socket now (without blocking)."""
        if not self.ended:
            with contextlib.suppress(ConnectionResetError):  # the new process ended the link unread
                self.kinds.extend(self.new.said())

    async def read_all(self) -> None:
        """Read until the new process has nothing more to write (or the link has ended)."""
        link = self.new.takeover._link
        for _ in range(2000):
            self.read()
            if link is None or link.closed.called or not link._unsent:
                self.read()
                return
            await sleep(reactor, 0.005)
        raise AssertionError("the new process's frames never all came out")

    def end(self) -> None:
        """End the handover as the old process's stop does before the commit: ``abort``, then close unread."""
        self.new.old.sendall(encode({"type": "abort", "fds": 0}))
        self.new.old.close()
        self.ended = True


def hand_over_connections(new: NewProcess) -> list[socket.socket]:
    """``HELD`` idle connections go over, as before the commit; the client ends kept to close later."""
    clients, fds, records = [], [], []
    for _ in range(HELD):
        client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        clients.append(client)
        fds.append(server.detach())
        records.append(({"family": socket.AF_UNIX, "listener": "proxy"}, b""))
    packed, blob = pack(records)
    frame = encode({"type": "connections", "records": packed, "id": 1, "fds": len(fds)}, blob)
    socket.send_fds(new.old, [frame], fds)
    for fd in fds:
        os.close(fd)
    return clients


def fill(new: NewProcess) -> None:
    """The old end reads nothing for now: the new process's writes wait (its ``committed`` would too)."""
    new.old.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for _ in range(FILLERS):
        new.takeover._link.send({"type": "filler", "pad": "x" * 60000})
    assert new.takeover._link._unsent


#: Every order of what lands around the commit: ``commit`` the old process's commit reaches the new one;
#: ``stop`` the new process is stopped; and what the old process does meanwhile, ``read`` (all the new one
#: writes), ``end`` (the handover, with ``abort``, closing its end unread) or ``silent`` (reads nothing for
#: longer than a stop waits).  Unless it ended the handover, the old process reads what is left at the end.
SEQUENCES = {
    "-".join(order): order + (() if "end" in order else ("read",))
    for old in ("read", "end", "silent")
    for order in itertools.permutations(("commit", "stop", old))
}


@pytest.mark.parametrize("sequence", SEQUENCES.values(), ids=SEQUENCES.keys())
@pytest_twisted.ensureDeferred
async def test_the_new_process_makes_again_what_it_held_only_if_the_old_one_read_committed(monkeypatch, sequence):
    monkeypatch.setattr(takeover_module, "CLOSE_SECONDS", 0.3)
    made: list[int] = []

    def make_again(reactor, site, fd, family, data=b"", feed=None, connection=None):
        made.append(fd)
        os.close(fd)

    monkeypatch.setattr(takeover_module, "make_again", make_again)
    standin = Standin()
    new = NewProcess(standin)
    new.takeover._listeners["proxy"] = Listener()
    old = OldEnd(new)
    clients: list[socket.socket] = []
    stopped = None
    try:
        await wait_for(reactor, lambda: "ready" in new.said())
        clients = hand_over_connections(new)
        await wait_for(reactor, lambda: len(new.takeover._held) == HELD, timeout=5)
        old.read()
        fill(new)
        for step in sequence:
            if step == "commit":
                with contextlib.suppress(OSError):  # a new process stopped already may have closed its end
                    new.old.sendall(encode({"type": "commit", "holds": [], "twins": [], "fds": 0}))
                await wait_for(reactor, lambda: new.takeover.state is not WAITING, timeout=5)
                if stopped is None and old.kinds.count("filler") < FILLERS and not old.ended:
                    assert new.takeover.state is SENDING and made == []  # ``committed`` waits behind the fillers
            elif step == "stop":
                was_sending = new.takeover.state is SENDING
                stopped = new.takeover.stop()
                if was_sending:
                    # Not known out yet: nothing is made again, whatever the stop answers later.
                    assert made == [] and new.takeover.state is SENDING
            elif step == "read":
                await old.read_all()
            elif step == "end":
                old.end()
            elif step == "silent":
                await sleep(reactor, 0.5)
        assert stopped is not None
        await wait_for(reactor, lambda: stopped.called, timeout=10)
        old.read()
        read_committed = "committed" in old.kinds
        assert bool(made) == read_committed, (sequence, old.kinds[-3:], made, new.takeover.state)
        if read_committed:
            assert len(made) == HELD and new.takeover.state is SERVING
        else:
            assert new.takeover.state is ABORTED
        assert new.takeover.state is not COMMITTED
    finally:
        for client in clients:
            client.close()
        if not old.ended:
            new.old.close()
        standin.end()


@pytest.mark.parametrize("peer", ["reads", "closes"])
@pytest_twisted.ensureDeferred
async def test_a_frame_waiting_to_be_written_is_flushed_once_written_even_if_the_link_is_closed_meanwhile(peer):
    """:meth:`Link.flushed` says whether the frames left this process: a :meth:`Link.close` meanwhile writes
    them out first (flushed), an end by the other side before they are out does not (LinkClosed)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    link = adopt_link(reactor, ours, lambda message, blob, fds: None)
    outcome: list[str] = []
    try:
        for _ in range(FILLERS):
            link.send({"type": "filler", "pad": "x" * 60000})
        link.send({"type": "last"})
        link.flushed(reactor).addCallbacks(lambda _: outcome.append("flushed"),
                                           lambda failure: outcome.append(failure.trap(LinkClosed).__name__))
        assert outcome == []
        if peer == "closes":
            theirs.close()
            await wait_for(reactor, lambda: outcome != [], timeout=5)
            assert outcome == ["LinkClosed"]
            return
        link.close()
        frames, kinds = Decoder(), []
        theirs.setblocking(False)
        while "last" not in kinds:
            try:
                data = theirs.recv(65536)
            except BlockingIOError:
                await sleep(reactor, 0.005)
                continue
            kinds.extend(message["type"] for message, _ in frames.feed(data))
        await wait_for(reactor, lambda: link.closed.called, timeout=5)
        assert outcome == ["flushed"]
    finally:
        theirs.close()


@pytest_twisted.ensureDeferred
async def test_a_link_that_ends_on_a_failed_write_reads_the_other_sides_last_frames_first():
    """The reactor's readiness of the socket says "writable" only (read before the last frames came); the other
    process writes its last frame and closes; the write fails (EPIPE) and the transport ends.  The link still
    reads that frame before its end is told (here the reading is paused, for the reactor to see no more)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    said: list[str] = []
    link = adopt_link(reactor, ours, lambda message, blob, fds: said.append(message["type"]))
    at_the_end: list[list[str]] = []
    link.closed.addCallback(lambda _: at_the_end.append(list(said)))
    try:
        link.transport.stopReading()
        theirs.sendall(encode({"type": "took", "id": 1, "fds": 0}) + encode({"type": "aborting", "why": "stop", "fds": 0}))
        theirs.close()
        link.send({"type": "parked", "records": []})  # a write under way, which fails
        await wait_for(reactor, lambda: link.closed.called, timeout=5)
        assert at_the_end == [["took", "aborting"]]
    finally:
        theirs.close()


#: When the other process writes ``committed``, against this side's end on a frame it could not handle:
#: ``with`` the frame (in one write), ``after`` this side ended the link (its farewell behind frames the other
#: process has not read yet, so the transport is not gone), at the ``last`` moment (as the link's own copy of
#: the socket closes, once it has read all it found), or once the link has ``ended`` here; and how many frames
#: this side has waiting to be written out then.
WHEN = {
    f"{when}-{behind}-behind": (when, behind)
    for when, behind in [
        ("with", 0), ("with", FILLERS), ("after", FILLERS), ("last", 0), ("last", FILLERS), ("ended", 0),
    ]
}


class _ClosingThen:
    """A socket that runs ``then`` as it closes, before it is closed."""

    def __init__(self, sock: socket.socket, then):
        self._sock, self._then = sock, then

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def close(self) -> None:
        self._then()
        self._sock.close()


@pytest.mark.parametrize(("when", "behind"), WHEN.values(), ids=WHEN.keys())
@pytest_twisted.ensureDeferred
async def test_a_link_ended_by_a_frame_it_could_not_handle_reads_every_committed_that_got_out(when, behind):
    """A bug handling a frame ends the link from this side, during the commit too.  The other process owns
    everything once its ``committed`` got into this side's socket; this side lets go only on reading it.  So
    whenever ``committed`` is written, this side reads it before its end is told if and only if the write got
    in (after the end, it fails there)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    said: list[str] = []

    def handle(message, blob, fds) -> None:
        said.append(message["type"])
        if message["type"] == "took":
            raise RuntimeError("a bug handling a frame")

    link = adopt_link(reactor, ours, handle, farewell={"type": "abort"})
    at_the_end: list[list[str]] = []
    link.closed.addCallback(lambda _: at_the_end.append(list(said)))
    bug, committed = encode({"type": "took", "id": 1, "fds": 0}), encode({"type": "committed", "fds": 0})
    theirs.setblocking(False)
    got_in: list[bool] = []

    def write(data: bytes) -> bool:
        try:
            return theirs.send(data) == len(data)
        except (BrokenPipeError, ConnectionResetError):
            return False

    async def drain() -> None:
        """The other process reads all this side writes, until its end."""
        for _ in range(4000):
            try:
                if not theirs.recv(65536):
                    return
            except BlockingIOError:
                await sleep(reactor, 0.005)
            except ConnectionResetError:
                return
        raise AssertionError("the link never ended")

    try:
        for _ in range(behind):
            link.send({"type": "filler", "pad": "x" * 60000})
        if when == "with":
            got_in.append(write(bug + committed))
        elif when == "last":
            link._sock = _ClosingThen(link._sock, lambda: got_in.append(write(committed)))
            assert write(bug)
        else:
            assert write(bug)
            await wait_for(reactor, lambda: link.ended_here, timeout=5)
            if when == "ended":
                await drain()
                await wait_for(reactor, lambda: link.closed.called, timeout=5)
            got_in.append(write(committed))
        await drain()
        await wait_for(reactor, lambda: link.closed.called, timeout=5)
        assert at_the_end[0][0] == "took"
        assert ("committed" in at_the_end[0]) is got_in[0]
        assert got_in[0] is (when in ("with", "after"))
    finally:
        theirs.close()
        if not link.closed.called:
            link.drop()



class _Diverted:
    """A request read after the commit, as the old process's :meth:`Predecessor._flush_outgoing` sees it: sent on
    with its connection, or answered here (rendered by its site's resource)."""

    def __init__(self):
        self.site = type("Site", (), {"resource": "the proxy"})()
        self.rendered: list[str] = []

    @property
    def channel(self):
        raise AssertionError("sent on a link that has ended: its connection let go, the request never answered")

    @property
    def content(self):
        return self.channel

    def render(self, resource) -> None:
        self.rendered.append(resource)


@pytest_twisted.ensureDeferred
async def test_what_the_old_process_would_send_on_as_it_reads_the_links_last_frames_is_answered_here():
    """``committed`` read at the link's end (the new process got it out, then the link failed): the old process
    hands over, but nothing it would send on now can leave, so a request it read meanwhile is answered here."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    request = _Diverted()
    old = Predecessor(reactor, [], {}, {}, {}, object(), object(), dict, lambda: None)
    old.state = HANDED_OVER

    def handle(message, blob, fds) -> None:
        old._outgoing.append(request)
        old._flush_outgoing()

    link = old._link = adopt_link(reactor, ours, handle)
    try:
        link.transport.stopReading()  # the last frame is read at the link's end
        theirs.sendall(encode({"type": "committed", "fds": 0}))
        theirs.close()
        link.send({"type": "took", "id": 1})  # fails (EPIPE): the transport ends
        await wait_for(reactor, lambda: link.closed.called, timeout=5)
        assert request.rendered == ["the proxy"]
    finally:
        theirs.close()
