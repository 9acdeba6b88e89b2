"""Who is left serving when the link of a handover ends: read from what cannot lie (lifecycle/succession/liveness.py).

In this process, on a real ``socketpair`` and real child processes standing
for the old process, so that the order the kernel does things in is the
real one: the link's end comes while the dying process's pid still reads as
alive.  A new process before its commit (takeover.TakeOver) lets go only
when the old one said ``abort`` (or it ended the link itself), and takes
over when the old one is gone; the old process's stop during a reload ends
only once the new process has let go (predecessor.Predecessor).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred

from helpers import sleep, wait_for
from yieldproxy.lifecycle.succession import liveness, moments
from yieldproxy.lifecycle.succession.liveness import Fate, Peer, fate
from yieldproxy.lifecycle.succession.predecessor import Predecessor
from yieldproxy.lifecycle.succession.takeover import ABORTED, SERVING, WAITING, Inheritance, TakeOver
from yieldproxy.lifecycle.succession.wire import Decoder, encode


def test_the_moments_the_tests_act_at_are_the_ones_the_code_passes():
    """tests/lifecycle/test_reload_deaths.py acts at every moment moments.MOMENTS names: each is passed once in
    the code, by the process it says, and no other is."""
    package = pathlib.Path(moments.__file__).parent
    passed = {}
    for path in package.glob("*.py"):
        for name in re.findall(r'moments\.reached\("([a-z-]+)"\)', path.read_text()):
            passed.setdefault(name, []).append(path.name)
    side = {"predecessor.py": "old", "takeover.py": "new"}
    assert sorted(passed) == sorted(moments.MOMENTS)
    assert all(len(files) == 1 and side[files[0]] == moments.SIDE[name] for name, files in passed.items()), passed
    assert moments.COMMIT_POINT in moments.MOMENTS


@pytest.mark.parametrize(("farewell_read", "ended_here", "pidfd", "expected"), [
    (True, False, True, Fate.LET_GO),
    (True, False, False, Fate.LET_GO),
    (False, True, True, Fate.LET_GO),
    (False, True, False, Fate.LET_GO),
    (True, True, True, Fate.LET_GO),
    (False, False, True, Fate.ASK_PIDFD),
    (False, False, False, Fate.TAKE_OVER),
])
def test_only_a_farewell_or_an_end_of_its_own_lets_a_new_process_go(farewell_read, ended_here, pidfd, expected):
    assert fate(farewell_read, ended_here, pidfd) is expected


class Standin:
    """A child process standing for the old process: alive until :meth:`die`; its pidfd is this test's."""

    def __init__(self):
        self.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.peer = Peer(self.popen.pid, os.pidfd_open(self.popen.pid))

    def die(self) -> None:
        self.popen.kill()
        self.popen.wait(10)

    def end(self) -> None:
        if self.popen.poll() is None:
            self.die()
        self.peer.close()


class NewProcess:
    """A :class:`TakeOver` with no listeners, as a new process before its commit; ``old`` is the old end."""

    def __init__(self, standin: Standin):
        ours, self.old = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The pid the new process was told: a live process (this test's parent), as a dying parent's pid reads.
        inheritance = Inheritance(ours, {}, os.getppid(), "0", peer=standin.peer)
        self.stopped = 0
        self.serving = 0
        self.holds_read = 0
        self.takeover = TakeOver(
            reactor, inheritance, {}, lambda *a: None, lambda message: None, stop_process=self._stopped,
            on_serving=self._serving, holds_from_file=self._holds,
        )
        self.takeover.start()
        self.frames = Decoder()

    def _stopped(self) -> None:
        self.stopped += 1

    def _serving(self) -> None:
        self.serving += 1

    def _holds(self) -> None:
        self.holds_read += 1

    def said(self) -> list[str]:
        """The frames the new process sent so far (read from the old end, without blocking)."""
        self.old.setblocking(False)
        kinds = []
        try:
            while data := self.old.recv(65536):
                kinds.extend(message["type"] for message, _ in self.frames.feed(data))
        except BlockingIOError:
            pass
        return kinds


@pytest_twisted.ensureDeferred
async def test_a_link_that_ends_while_the_old_process_still_reads_as_alive_then_dies_is_its_death(monkeypatch):
    """The kernel closes a dying process's descriptors before it reparents its children: the link ends while
    the old pid still reads as the parent.  The new process waits for the pidfd and takes over."""
    standin = Standin()
    new = NewProcess(standin)
    try:
        await wait_for(reactor, lambda: "ready" in new.said())
        new.old.close()  # the dying process's descriptors first
        await wait_for(reactor, lambda: new.takeover._deciding, timeout=5)
        assert new.takeover.state is WAITING and new.stopped == 0  # it does not let go on the end alone
        standin.die()  # then the process itself
        await wait_for(reactor, lambda: new.takeover.state is SERVING, timeout=10)
        assert new.serving == 1 and new.holds_read == 1 and new.stopped == 0
    finally:
        standin.end()


@pytest_twisted.ensureDeferred
async def test_a_link_that_ends_without_a_farewell_from_a_live_process_is_let_go_once_the_pidfd_says_it_lives(monkeypatch):
    monkeypatch.setattr(liveness, "CONFIRM_SECONDS", 0.3)
    standin = Standin()
    new = NewProcess(standin)
    try:
        await wait_for(reactor, lambda: "ready" in new.said())
        new.old.close()
        await wait_for(reactor, lambda: new.stopped == 1, timeout=10)
        assert new.takeover.state is ABORTED and new.serving == 0
    finally:
        standin.end()


@pytest_twisted.ensureDeferred
async def test_an_abort_lets_the_new_process_go_even_if_the_old_one_dies_next():
    standin = Standin()
    new = NewProcess(standin)
    try:
        await wait_for(reactor, lambda: "ready" in new.said())
        new.old.sendall(encode({"type": "abort", "fds": 0}))
        new.old.shutdown(socket.SHUT_WR)
        standin.die()
        await wait_for(reactor, lambda: new.stopped == 1, timeout=10)
        assert new.takeover.state is ABORTED and new.serving == 0
        await wait_for(reactor, lambda: "aborting" in new.said(), timeout=5)
    finally:
        standin.end()
        new.old.close()


@pytest_twisted.ensureDeferred
async def test_a_stopped_new_process_ends_only_once_its_aborting_frame_is_out():
    """Its stop's Deferred fires once the link has ended: whatever the old process had not read yet, the
    ``aborting`` frame included, is in the socket by then."""
    standin = Standin()
    new = NewProcess(standin)
    try:
        await wait_for(reactor, lambda: "ready" in new.said())
        # The old end reads nothing for now: fill the new process's side until its writes wait.
        new.old.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        filler = {"type": "took", "id": 0, "pad": "x" * 60000}
        for _ in range(20):
            new.takeover._link.send(filler)
        stopped = new.takeover.stop()
        assert not stopped.called  # its frames are not out yet
        frames = new.said  # read everything: the link ends, the stop fires
        kinds: list[str] = []
        for _ in range(1000):
            kinds.extend(frames())
            if stopped.called:
                break
            await sleep(reactor, 0.01)
        assert stopped.called
        kinds.extend(frames())
        assert kinds[-1] == "aborting", kinds[-3:]
    finally:
        standin.end()
        new.old.close()


#: A new process that says nothing: it reads its end of the link until ``abort``, then exits a moment later.
LETS_GO_SLOWLY = """
import os, sys, time
fd = int(os.environ["YIELDPROXY_SUCCESSION_FD"])
seen = b""
while b'"abort"' not in seen:
    data = os.read(fd, 65536)
    if not data:
        break
    seen += data
time.sleep(0.5)
"""


class Nothing:
    """Neither a lot nor a pool: a reload stopped before it sends anything needs none."""

    members: tuple = ()
    inflight = 0

    def entries(self) -> list:
        return []


@pytest_twisted.ensureDeferred
async def test_a_stop_as_a_reload_starts_ends_once_the_new_process_has_let_go():
    """The stop in the first moments of a reload: no failure, and the old process's stop waits for the new
    one, told to let go, to be gone."""
    predecessor = Predecessor(
        reactor, [sys.executable, "-c", LETS_GO_SLOWLY], dict(os.environ), {}, {}, Nothing(), Nothing(),
        lambda: {}, lambda: None,
    )
    reloading = Deferred.fromCoroutine(predecessor.reload())
    reloading.addErrback(lambda failure: failure.value)
    child = predecessor._child
    assert child is not None
    try:
        stopped = predecessor.stop()
        errors: list = []
        stopped.addErrback(errors.append)
        await wait_for(reactor, lambda: stopped.called, timeout=20)
        assert errors == []
        assert child.popen.poll() is not None, "the old process's stop ended before the new one let go"
        outcome = await reloading
        assert "told to stop" in str(outcome), outcome
    finally:
        if child.popen.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.popen.wait(10)
