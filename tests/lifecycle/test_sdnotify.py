"""systemd's notify protocol (yieldproxy/lifecycle/sdnotify.py) against a fake notify socket: a bound AF_UNIX datagram socket."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest
from twisted.internet.task import Clock
from twisted.logger import formatEvent

from rawhttp import LogCapture
from yieldproxy.lifecycle.sdnotify import Notifier, Ready, Watchdog, monotonic_usec, watchdog_seconds


class FakeNotifySocket:
    """What systemd listens on: a bound unix datagram socket; ``received()`` is every datagram so far."""

    def __init__(self, abstract: bool = False):
        if abstract:
            self._dir = None
            self.name = f"@yieldproxy-test-{os.getpid()}-{id(self)}"
            address: str | bytes = b"\0" + self.name[1:].encode()
        else:
            # A short directory: a unix socket path is at most 107 bytes, pytest's tmp_path can be longer.
            self._dir = tempfile.mkdtemp(prefix="ypn-", dir="/tmp")
            self.name = address = os.path.join(self._dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)

    def received(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(65536).decode())
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request):
    fake = FakeNotifySocket(abstract=request.param == "abstract")
    yield fake
    fake.close()


def test_lines_go_out_as_one_datagram(notify_socket):
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": notify_socket.name})
    assert notifier.enabled
    assert notifier.notify("READY=1", "STATUS=serving")
    assert notifier.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}")
    first, second = notify_socket.received()
    assert first == "READY=1\nSTATUS=serving"
    assert second.startswith("RELOADING=1\nMONOTONIC_USEC=") and int(second.split("=")[-1]) > 0


def test_without_a_notify_socket_nothing_is_sent():
    notifier = Notifier.from_environment({})
    assert not notifier.enabled
    assert notifier.notify("READY=1") is False
    assert Notifier.from_environment({"NOTIFY_SOCKET": ""}).enabled is False


def test_a_line_with_a_newline_is_refused(notify_socket):
    """A newline would forge a second assignment (a STATUS text saying "\\nMAINPID=1")."""
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": notify_socket.name})
    with pytest.raises(ValueError):
        notifier.notify("STATUS=a\nMAINPID=1")
    assert notify_socket.received() == []


def test_a_failing_socket_is_logged_once_per_run_of_failures_and_never_raises(notify_socket, tmp_path):
    gone = Notifier(str(tmp_path / "no-such-socket"))
    with LogCapture() as logs:
        assert [gone.notify("WATCHDOG=1") for _ in range(5)] == [False] * 5
        assert Notifier("vsock:2:1234").notify("READY=1") is False
    lines = [formatEvent(e) for e in logs.events if e.get("log_namespace") == "yieldproxy.lifecycle.sdnotify"]
    assert len(lines) == 2, lines
    assert "no-such-socket" in lines[0] and "vsock:2:1234" in lines[1]
    # Back again: it says so once, and sends.
    gone.socket_name = notify_socket.name
    with LogCapture() as logs:
        assert gone.notify("WATCHDOG=1")
    assert [formatEvent(e) for e in logs.events if e.get("log_namespace") == "yieldproxy.lifecycle.sdnotify"] == [
        f"systemd notify socket {notify_socket.name!r} reachable again"
    ]
    assert notify_socket.received() == ["WATCHDOG=1"]


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        ({"WATCHDOG_USEC": "20000000"}, 20.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "4242"}, 20.0),
        # Another process's watchdog (a parent's environment, inherited): not ours to feed.
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_the_watchdog_interval_is_read_for_this_process_only(environ, expected):
    assert watchdog_seconds(environ, pid=4242) == expected


def test_the_watchdog_is_fed_at_half_the_interval_on_the_clock(notify_socket):
    clock = Clock()
    watchdog = Watchdog(clock, Notifier(notify_socket.name), 10.0)
    watchdog.startService()
    assert notify_socket.received() == ["WATCHDOG=1"]
    clock.advance(4.9)
    assert notify_socket.received() == []
    clock.advance(0.1)
    assert notify_socket.received() == ["WATCHDOG=1"]
    clock.pump([5.0] * 4)
    assert notify_socket.received() == ["WATCHDOG=1"] * 4
    watchdog.stopService()
    clock.advance(60)
    assert notify_socket.received() == []
    assert clock.getDelayedCalls() == []


def test_the_watchdog_keeps_feeding_after_a_failed_send(notify_socket):
    clock = Clock()
    notifier = Notifier("/nonexistent/notify")
    watchdog = Watchdog(clock, notifier, 2.0)
    with LogCapture():
        watchdog.startService()
        clock.advance(1.0)
    notifier.socket_name = notify_socket.name
    with LogCapture():
        clock.advance(1.0)
    assert notify_socket.received() == ["WATCHDOG=1"]
    watchdog.stopService()
    assert clock.getDelayedCalls() == []


def test_ready_on_start_and_stopping_on_stop(notify_socket):
    ready = Ready(Notifier(notify_socket.name), status="serving on 127.0.0.1:11435")
    ready.startService()
    assert notify_socket.received() == ["READY=1\nSTATUS=serving on 127.0.0.1:11435"]
    ready.stopService()
    [stopping] = notify_socket.received()
    assert stopping.startswith("STOPPING=1\nSTATUS=stopping")


def test_after_naming_another_main_process_nothing_more_is_sent(notify_socket):
    """A reload's predecessor sends MAINPID= for its successor; its own watchdog and STOPPING=1 are then not its to send."""
    notifier = Notifier(notify_socket.name, pid=100)
    assert notifier.notify("MAINPID=100", "READY=1")  # its own pid: still the main process
    assert notifier.notify("MAINPID=200", "READY=1", "STATUS=serving (version 2)")
    assert notifier.superseded
    assert notifier.notify("WATCHDOG=1") is False
    ready = Ready(notifier)
    ready.startService()
    ready.stopService()
    assert notify_socket.received() == ["MAINPID=100\nREADY=1", "MAINPID=200\nREADY=1\nSTATUS=serving (version 2)"]


def test_a_process_a_reload_started_leaves_ready_to_its_predecessor(notify_socket):
    ready = Ready(Notifier(notify_socket.name), ready=False)
    ready.startService()
    assert notify_socket.received() == []
    ready.stopService()
    [stopping] = notify_socket.received()
    assert stopping.startswith("STOPPING=1")
