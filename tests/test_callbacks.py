"""yieldproxy/callbacks.py: every listener hears, whatever one does."""

from __future__ import annotations

from twisted.logger import LogLevel, Logger, globalLogPublisher

from yieldproxy.callbacks import call_each


def test_a_listener_that_raises_is_logged_and_the_others_still_hear_and_may_leave_meanwhile():
    heard: list = []
    listeners: list = []

    def leaves(*args):
        listeners.remove(leaves)
        heard.append(("leaves", args))

    def breaks(*args):
        raise RuntimeError("broken")

    listeners.extend([leaves, breaks, lambda *args: heard.append(("last", args))])
    events: list = []
    globalLogPublisher.addObserver(events.append)
    try:
        call_each(Logger(namespace="test"), "test listener failed", listeners, 1, "two")
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert heard == [("leaves", (1, "two")), ("last", (1, "two"))]
    [failed] = [e for e in events if e.get("log_level") == LogLevel.critical]
    assert failed["log_format"] == "test listener failed" and failed["log_failure"].check(RuntimeError)
    assert listeners[0] is breaks
