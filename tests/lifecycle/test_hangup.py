"""A hang-up's meaning (lifecycle/hangup.py): a reload for a service, the graceful stop for a terminal program."""

from __future__ import annotations

import os
import signal

from hypothesis import given, strategies as st

from yieldproxy.lifecycle.hangup import STREAMS, HangupStops, terminal_of, why_no_reload


@given(
    notify=st.sampled_from([None, "", "/run/systemd/notify"]),
    invocation=st.booleans(),
    daemonizes=st.booleans(),
    reloaded=st.booleans(),
    ttys=st.sets(st.sampled_from([0, 1, 2])),
)
def test_a_terminal_program_is_one_with_a_terminal_that_no_service_manager_runs(
    notify, invocation, daemonizes, reloaded, ttys,
):
    environ = {**({"NOTIFY_SOCKET": notify} if notify is not None else {}),
               **({"INVOCATION_ID": "0123abcd"} if invocation else {})}
    found = terminal_of(environ, daemonizes=daemonizes, reloaded=reloaded, isatty=lambda fd: fd in ttys)
    service = daemonizes or reloaded or bool(notify) or not ttys
    if service:
        assert found is None
    else:
        # $INVOCATION_ID is no sign of a service: a desktop terminal's shells inherit it.
        assert found == next(name for fd, name in STREAMS if fd in ttys)


def test_a_stream_that_cannot_be_asked_is_no_terminal():
    def isatty(fd: int) -> bool:
        if fd == 0:
            raise OSError(9, "Bad file descriptor")
        return fd == 2

    assert terminal_of({}, daemonizes=False, reloaded=False, isatty=isatty) == "stderr"


def test_the_refusal_is_one_line_that_says_how_to_restart():
    line = why_no_reload("stdout", 4120)
    assert "\n" not in line and "pid 4120" in line and "its stdout" in line and "restart it instead" in line


class Reactor:
    def __init__(self):
        self.calls = []

    def callFromThread(self, f, *args):
        self.calls.append((f, args))


def test_sighup_stops_once_and_the_handler_goes_when_the_stop_begins():
    reactor, stops = Reactor(), []
    before = signal.getsignal(signal.SIGHUP)
    service = HangupStops(reactor, lambda: stops.append(1))
    service.startService()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)
        assert len(reactor.calls) == 2
        for f, args in reactor.calls:
            f(*args)
        assert stops == [1]
    finally:
        service.stopService()
    assert signal.getsignal(signal.SIGHUP) == before


def test_a_handler_put_in_after_it_stays():
    """The stop's own (StopSignals, given SIGHUP) is in before this service stops: it is not taken away."""
    reactor = Reactor()
    before = signal.getsignal(signal.SIGHUP)
    service = HangupStops(reactor, lambda: None)
    service.startService()

    def stopping(signum, frame):
        pass

    try:
        signal.signal(signal.SIGHUP, stopping)
        service.stopService()
        assert signal.getsignal(signal.SIGHUP) is stopping
    finally:
        signal.signal(signal.SIGHUP, before)
