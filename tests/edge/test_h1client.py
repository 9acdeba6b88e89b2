"""The lean upstream client (yieldproxy/edge/h1client.py, edge/h1parse.py): parser, pool, timeouts, cancellation, stale retries.

The parser and the pool are driven without a reactor: connections are
``StringTransport``s handed out by a test endpoint, time is a ``Clock``.
Real sockets (the sim, and small servers that misbehave on purpose) check
what is about the wire: keep-alive reuse, an upstream closing idle
connections, chunked streaming, large bodies, backpressure.
"""

from __future__ import annotations

import json
import os

import pytest
import pytest_twisted
from twisted.internet import error as ierror
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from yieldproxy.edge.h1client import (
    SMALL_BODY,
    BadResponse,
    Collector,
    ConnectFailed,
    H1Pool,
    PoolClosed,
    ResponseIncomplete,
    ResponseNeverReceived,
    ResponseTimeout,
)
from yieldproxy.edge.h1parse import ParseError, ResponseParser

# -- helpers ----------------------------------------------------------------------------------


def _header(response, name: bytes) -> bytes | None:
    """The first value of header ``name`` (any case) of a response, or None."""
    return next((value for key, value in response.headers if key.lower() == name.lower()), None)


class Events:
    """Records what the parser reports."""

    def __init__(self):
        self.heads: list[tuple] = []
        self.body = b""
        self.pieces = 0
        self.ends: list[bool] = []

    def on_head(self, version, code, phrase, headers, length):
        self.heads.append((version, code, phrase, headers, length))

    def on_body(self, data):
        self.body += data
        self.pieces += 1

    def on_end(self, keep_alive):
        self.ends.append(keep_alive)


def parse(data: bytes, head_request: bool = False, cuts=None) -> tuple[Events, ResponseParser]:
    """Feed ``data`` to a fresh parser, whole or cut at the given offsets."""
    events = Events()
    parser = ResponseParser(events)
    parser.start(head_request)
    offsets = [0, *sorted(set(cuts or [])), len(data)]
    for a, b in zip(offsets, offsets[1:]):
        if a < b and not events.ends:
            parser.feed(data[a:b])
    return events, parser


def every_split(data: bytes):
    """``data`` cut in two at every offset."""
    return [[i] for i in range(1, len(data))]


@implementer(IStreamClientEndpoint)
class Endpoint:
    """Hands out StringTransport connections when the test says so (or at once, with ``auto``)."""

    def __init__(self, auto: bool = True):
        self.auto = auto
        self.attempts: list[tuple[Factory, Deferred]] = []
        self.made: list[tuple[Protocol, StringTransport]] = []

    def connect(self, factory):
        d = Deferred()
        self.attempts.append((factory, d))
        if self.auto:
            self.accept()
        return d

    def accept(self):
        factory, d = self.attempts.pop(0)
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.made.append((protocol, transport))
        d.callback(protocol)
        return protocol, transport

    def refuse(self, error=None):
        _, d = self.attempts.pop(0)
        d.errback(error or ierror.ConnectionRefusedError())


def make_pool(**kw) -> tuple[H1Pool, Endpoint, Clock]:
    clock = Clock()
    endpoint = kw.pop("endpoint", None) or Endpoint()
    pool = H1Pool(clock, "127.0.0.1", 11434, endpoint=endpoint, **kw)
    return pool, endpoint, clock


def ok(body: bytes = b"hello", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n%sContent-Length: %d\r\n\r\n%s" % (extra, len(body), body)


def lose(protocol, clean: bool = True) -> None:
    protocol.connectionLost(Failure(ierror.ConnectionDone() if clean else ierror.ConnectionLost()))


# -- the parser ---------------------------------------------------------------------------------


def test_content_length_response_split_anywhere():
    data = ok(b"0123456789") + b""
    for cuts in [[]] + every_split(data):
        events, parser = parse(data, cuts=cuts)
        assert events.heads[0][:3] == (b"HTTP/1.1", 200, b"OK")
        assert events.heads[0][3] == [(b"Content-Type", b"text/plain"), (b"Content-Length", b"10")]
        assert events.heads[0][4] == 10
        assert events.body == b"0123456789"
        assert events.ends == [True] and not parser.extra


def test_chunked_response_with_extensions_and_trailers_split_anywhere():
    data = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    for cuts in [[]] + every_split(data):
        events, parser = parse(data, cuts=cuts)
        assert events.heads[0][4] is None
        assert events.body == b"hello" + b"abcdefghijklmnopqrstuvwxyz"
        assert events.ends == [True] and not parser.extra


@pytest.mark.parametrize(
    "coding, codings",
    [
        (b"gzip, chunked", b"gzip"),
        (b"GZip ,  Chunked", b"GZip"),
        (b"deflate, gzip, chunked", b"deflate, gzip"),
        (b"gzip,, chunked", b"gzip"),
        (b"chunked", None),
    ],
)
def test_other_transfer_codings_stay_on_the_body_only_the_chunks_are_removed(coding, codings):
    data = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n3\r\n\x1f\x8b\x08\r\n0\r\n\r\n"
    for cuts in [[]] + every_split(data):
        events, parser = parse(data, cuts=cuts)
        assert events.body == b"\x1f\x8b\x08" and events.ends == [True]
        assert parser.codings == codings


def test_a_transfer_coding_after_chunked_is_read_until_close_and_kept():
    data = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b\x08"
    events, parser = parse(data)
    assert parser.codings == b"gzip" and events.heads[0][4] is None
    assert parser.feed_eof(clean=True) and events.body == b"\x1f\x8b\x08" and events.ends == [False]


@pytest.mark.parametrize(
    "coding",
    [b"chunked, gzip", b"chunked, chunked", b"gzip, chunked, chunked", b"chunked\r\nTransfer-Encoding: chunked",
     b"gz/ip, chunked", b",", b"\"gzip\", chunked"],
)
def test_chunked_twice_or_not_last_or_a_bad_coding_is_refused(coding):
    with pytest.raises(ParseError):
        parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n0\r\n\r\n")


def test_read_until_close_ends_with_a_clean_close_only():
    data = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nsome body"
    events, parser = parse(data)
    assert events.body == b"some body" and events.ends == []
    assert parser.feed_eof(clean=True)
    assert events.ends == [False]  # never reused
    events, parser = parse(data)
    assert not parser.feed_eof(clean=False)  # a reset may have cut it
    assert events.ends == []


def test_head_204_304_have_no_body_whatever_their_headers_say():
    events, parser = parse(ok(b"x" * 50)[: -50], head_request=True)
    # The body's length is 0 (the Content-Length header, kept in the headers, is the GET's).
    assert events.ends == [True] and events.body == b"" and events.heads[0][4] == 0
    assert (b"Content-Length", b"50") in events.heads[0][3]
    for code in (b"204 No Content", b"304 Not Modified"):
        events, parser = parse(b"HTTP/1.1 %s\r\nContent-Length: 7\r\n\r\n" % code)
        assert events.ends == [True] and events.body == b""


def test_interim_responses_are_skipped():
    data = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ok(b"done")
    for cuts in [[]] + every_split(data):
        events, _ = parse(data, cuts=cuts)
        assert [h[1] for h in events.heads] == [200]
        assert events.body == b"done"


def test_repeated_headers_kept_in_order_and_obs_fold_joined():
    data = (
        b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-Long: one\r\n  two\r\nSet-Cookie: b=2\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    events, _ = parse(data)
    assert events.heads[0][3] == [
        (b"Set-Cookie", b"a=1"), (b"X-Long", b"one two"), (b"Set-Cookie", b"b=2"), (b"Content-Length", b"0"),
    ]
    assert events.ends == [True]


@pytest.mark.parametrize(
    "head, keep_alive",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        # HTTP/1.0 is never kept alive, whatever it says (issue 16.5).
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", False),
        # Transfer-Encoding and Content-Length both: chunked wins, the connection is not reused.
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello", True),
    ],
)
def test_connection_reuse_rules(head, keep_alive):
    events, _ = parse(head)
    assert events.ends == [keep_alive]


def test_bytes_after_the_response_are_flagged():
    events, parser = parse(ok(b"ab") + b"HTTP/1.1 200 OK")
    assert events.ends == [True] and parser.extra


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 099 Low\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nNo colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nName : x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded-first\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\nY: b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\rY\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\0b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 20 + b"\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"a" * 5000,
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000,
        b"HTTP/1.1 100 Continue\r\n\r\n" * 40,
    ],
)
def test_malformed_responses_are_bad_response(data):
    with pytest.raises(ParseError):
        parse(data)
    # The same, a byte at a time.
    with pytest.raises(ParseError):
        parse(data, cuts=range(1, len(data)))


# -- the pool, on StringTransports ------------------------------------------------------------------


def test_request_goes_out_in_one_write_with_host_and_length():
    pool, endpoint, clock = make_pool()
    written = []
    d = pool.request(b"POST", b"/api/embed?x=1", [(b"Content-Type", b"application/json"), (b"X-A", b"1")], b"{}")
    protocol, transport = endpoint.made[0]
    written.append(transport.value())
    assert written == [
        b"POST /api/embed?x=1 HTTP/1.1\r\nHost: 127.0.0.1:11434\r\nContent-Type: application/json\r\n"
        b"X-A: 1\r\nContent-Length: 2\r\n\r\n{}"
    ]
    protocol.dataReceived(ok(b"[1]"))
    response = result(d)
    assert (response.code, response.body, _header(response, b"content-type")) == (200, b"[1]", b"text/plain")
    assert clock.getDelayedCalls() != []  # the idle timer of the pooled connection
    pool.close()
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    "headers, target",
    [
        ([(b"X-Evil", b"a\r\nHost: other")], b"/"),
        ([(b"X-Evil\r\nHost", b"other")], b"/"),
        ([(b"X-Evil", b"a\nb")], b"/"),
        ([(b"X-Evil", b"a\0b")], b"/"),
        ([], b"/a b"),
        ([], b"/a\r\nHost: x"),
        ([], b""),
    ],
)
def test_header_or_target_injection_is_refused(headers, target):
    pool, endpoint, _ = make_pool()
    with pytest.raises(ValueError):
        pool.request(b"GET", target, headers)
    assert endpoint.attempts == [] and endpoint.made == []


class Checks:
    """successResultOf & co. without a TestCase."""

    @staticmethod
    def result(d):
        out = []

        def keep(value):
            out.append(value)
            return None if isinstance(value, Failure) else value

        d.addBoth(keep)
        assert out, "the Deferred has not fired"
        if isinstance(out[0], Failure):
            out[0].raiseException()
        return out[0]

    @staticmethod
    def failure(d, *types):
        out = []
        d.addBoth(out.append)
        assert out, "the Deferred has not fired"
        assert isinstance(out[0], Failure), f"succeeded with {out[0]!r}"
        assert out[0].check(*types), out[0]
        return out[0].value


result, failure = Checks.result, Checks.failure


def no_result(d):
    fired = []

    def seen(r):
        fired.append(r)
        return r

    d.addBoth(seen)
    assert not fired, f"fired with {fired!r}"


def test_keep_alive_reuses_the_most_recent_idle_connection():
    pool, endpoint, clock = make_pool()
    d1 = pool.request(b"GET", b"/1")
    d2 = pool.request(b"GET", b"/2")
    (p1, t1), (p2, t2) = endpoint.made
    p1.dataReceived(ok(b"one"))
    p2.dataReceived(ok(b"two"))
    assert result(d1).body == b"one" and result(d2).body == b"two"
    assert pool.stats() == {"open": 2, "idle": 2, "waiting": 0}
    t1.clear()
    t2.clear()
    d3 = pool.request(b"GET", b"/3")
    assert len(endpoint.made) == 2, "no new connection"
    assert t2.value().startswith(b"GET /3 ") and t1.value() == b"", "LIFO: the last one freed"
    p2.dataReceived(ok(b"three"))
    assert result(d3).body == b"three" and not result(d3).retried
    pool.close()
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    "answer",
    [
        ok(b"x", extra=b"Connection: close\r\n"),
        b"HTTP/1.0 200 OK\r\n\r\nuntil close",
        ok(b"x") + b"garbage",
        # An HTTP/1.0 answer, even one that says keep-alive (issue 16.5).
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx",
    ],
)
def test_no_reuse_after_close_until_close_or_extra_bytes(answer):
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(answer)
    if b"until close" in answer:
        no_result(d)
        lose(protocol)
    else:
        assert transport.disconnecting
        lose(protocol)
    assert result(d).code == 200
    assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
    pool.request(b"GET", b"/again")
    assert len(endpoint.made) == 2
    assert clock.getDelayedCalls() == []


def test_idle_connections_close_after_the_idle_timeout():
    pool, endpoint, clock = make_pool(idle_timeout=5.0)
    d = pool.request(b"GET", b"/")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok())
    result(d)
    clock.advance(4.9)
    assert not transport.disconnecting and pool.stats()["idle"] == 1
    clock.advance(0.2)
    assert transport.disconnecting and pool.stats()["idle"] == 0
    lose(protocol)
    assert pool.stats()["open"] == 0 and clock.getDelayedCalls() == []


def test_bounded_pool_queues_requests_in_order():
    pool, endpoint, clock = make_pool(max_connections=1)
    d1 = pool.request(b"GET", b"/1")
    d2 = pool.request(b"GET", b"/2")
    d3 = pool.request(b"GET", b"/3")
    assert len(endpoint.made) == 1 and pool.stats()["waiting"] == 2
    d2.cancel()  # a waiting request that leaves is dropped from the line
    failure(d2, CancelledError)
    protocol, transport = endpoint.made[0]
    transport.clear()
    protocol.dataReceived(ok(b"1"))
    assert result(d1).body == b"1"
    assert transport.value().startswith(b"GET /3 "), "the next in line goes on the freed connection"
    protocol.dataReceived(ok(b"3"))
    assert result(d3).body == b"3" and len(endpoint.made) == 1
    pool.close()
    assert clock.getDelayedCalls() == []


def test_cancel_mid_response_aborts_and_never_pools_the_connection():
    pool, endpoint, clock = make_pool()
    got = []

    class Handler:
        def response_started(self, response):
            got.append(response.code)

        def body_received(self, data):
            got.append(data)

    d = pool.request(b"GET", b"/", handler=Handler(), timeout=10)
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok(b"0123456789")[:-5])
    assert got == [200, b"01234"]
    d.cancel()
    failure(d, CancelledError)
    assert transport.disconnected, "aborted"
    protocol.dataReceived(b"56789")  # late bytes are dropped
    lose(protocol, clean=False)
    assert got == [200, b"01234"]
    assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
    assert clock.getDelayedCalls() == []


def test_stop_producing_on_the_response_abandons_the_request_once_the_connection_is_gone():
    pool, endpoint, clock = make_pool()
    responses = []

    class Handler:
        def response_started(self, response):
            responses.append(response)

        def body_received(self, data):
            pass

    d = pool.request(b"GET", b"/", handler=Handler())
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok(b"abcdef")[:-3])
    # As a client's connectionLost does to its registered producer: the
    # request must not fail from within that call, but when the upstream
    # connection is gone (the server's own cancel comes first).
    responses[0].stopProducing()
    assert transport.disconnected
    no_result(d)
    lose(protocol, clean=False)
    failure(d, CancelledError)
    assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
    # Before any byte on a reused connection, a stopped request is not retried either.
    d = pool.request(b"GET", b"/warm")
    endpoint.made[1][0].dataReceived(ok())
    result(d)
    d = pool.request(b"GET", b"/", handler=Handler())
    responses.clear()
    protocol, transport = endpoint.made[1]
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
    responses[0].stopProducing()
    lose(protocol)
    failure(d, CancelledError)
    assert len(endpoint.made) == 2


def test_timeout_before_the_head_aborts_but_not_once_the_body_flows():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"POST", b"/slow", body=b"{}", timeout=3.0)
    protocol, transport = endpoint.made[0]
    clock.advance(2.9)
    no_result(d)
    clock.advance(0.2)
    error = failure(d, ResponseTimeout)
    assert error.reason == "timeout" and error.request_sent
    assert transport.disconnected
    lose(protocol, clean=False)

    d = pool.request(b"GET", b"/stream", timeout=3.0)
    protocol, transport = endpoint.made[1]
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
    clock.advance(60)
    no_result(d)
    protocol.dataReceived(b"0\r\n\r\n")
    assert result(d).body == b"a"
    pool.close()
    assert clock.getDelayedCalls() == []


def test_timeout_while_connecting_keeps_the_connection_for_later():
    endpoint = Endpoint(auto=False)
    pool, _, clock = make_pool(endpoint=endpoint)
    d = pool.request(b"GET", b"/", timeout=1.0)
    clock.advance(1.0)
    assert not failure(d, ResponseTimeout).request_sent
    endpoint.accept()
    assert pool.stats() == {"open": 1, "idle": 1, "waiting": 0}
    pool.close()
    assert clock.getDelayedCalls() == []


def test_connect_failures_are_classified():
    endpoint = Endpoint(auto=False)
    pool, _, clock = make_pool(endpoint=endpoint)
    d = pool.request(b"GET", b"/")
    endpoint.refuse()
    assert failure(d, ConnectFailed).reason == "refused"
    d = pool.request(b"GET", b"/")
    endpoint.refuse(ierror.TimeoutError())
    error = failure(d, ConnectFailed)
    assert error.reason == "connect" and not error.request_sent
    assert pool.stats()["open"] == 0


def test_a_fresh_connection_closing_before_answering_is_reported_not_retried():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/")
    protocol, _ = endpoint.made[0]
    lose(protocol, clean=False)
    error = failure(d, ResponseNeverReceived)
    assert (error.reason, error.request_sent, error.reused, error.retried) == ("reset", True, False, False)
    assert len(endpoint.made) == 1


def test_a_connection_closing_mid_response_is_incomplete():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/")
    protocol, _ = endpoint.made[0]
    protocol.dataReceived(ok(b"0123456789")[:-3])
    lose(protocol)
    assert failure(d, ResponseIncomplete).reason == "reset"


def _stale(pool, endpoint, method=b"GET", replayable=None, answer_first=True):
    """One request answered on a connection, then the next on the pooled one meets a closed connection."""
    d = pool.request(b"GET", b"/warm")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok())
    result(d)
    d = pool.request(method, b"/again", body=b"{}" if method == b"POST" else b"", replayable=replayable)
    assert len(endpoint.made) == 1, "sent on the pooled connection"
    return d, protocol


@pytest.mark.parametrize("clean", [True, False])
def test_stale_pooled_connection_idempotent_request_is_retried_once_on_a_fresh_one(clean):
    pool, endpoint, clock = make_pool()
    d, stale = _stale(pool, endpoint)
    lose(stale, clean=clean)
    assert len(endpoint.made) == 2, "a fresh connection"
    fresh, transport = endpoint.made[1]
    assert transport.value().startswith(b"GET /again ")
    fresh.dataReceived(ok(b"second try"))
    response = result(d)
    assert response.body == b"second try" and response.retried


def test_stale_connection_post_is_not_retried_unless_replayable():
    pool, endpoint, clock = make_pool()
    d, stale = _stale(pool, endpoint, method=b"POST")
    lose(stale)
    error = failure(d, ResponseNeverReceived)
    assert error.reused and not error.retried and len(endpoint.made) == 1

    pool, endpoint, clock = make_pool()
    d, stale = _stale(pool, endpoint, method=b"POST", replayable=True)
    lose(stale)
    fresh, transport = endpoint.made[1]
    assert transport.value().endswith(b"\r\n\r\n{}")
    fresh.dataReceived(ok(b"done"))
    assert result(d).retried


def test_stale_retry_happens_once_only_and_never_after_a_response_byte():
    pool, endpoint, clock = make_pool()
    d, stale = _stale(pool, endpoint)
    lose(stale)
    fresh, _ = endpoint.made[1]
    lose(fresh)  # the fresh one fails too: that is the upstream failing, reported
    error = failure(d, ResponseNeverReceived)
    assert error.retried and len(endpoint.made) == 2

    pool, endpoint, clock = make_pool()
    d, stale = _stale(pool, endpoint)
    stale.dataReceived(b"HTTP/1.1 200 OK\r\n")
    lose(stale)
    assert isinstance(failure(d, ResponseIncomplete), ResponseIncomplete) and len(endpoint.made) == 1


def test_stale_retry_makes_room_in_a_full_pool():
    pool, endpoint, clock = make_pool(max_connections=2)
    d1, d2 = pool.request(b"GET", b"/1"), pool.request(b"GET", b"/2")
    (p1, _), (p2, _) = endpoint.made
    p1.dataReceived(ok())
    p2.dataReceived(ok())
    result(d1), result(d2)
    d = pool.request(b"GET", b"/3")  # on p2 (LIFO)
    lose(p2)
    assert len(endpoint.made) == 3
    endpoint.made[2][0].dataReceived(ok(b"3"))
    assert result(d).retried
    assert pool.stats()["open"] <= 2


def test_replayable_false_never_resends_even_an_idempotent_request():
    """The proxy's hop: a stale connection is the caller's failure to count, never a silent second send."""
    pool, endpoint, clock = make_pool()
    d, stale = _stale(pool, endpoint, method=b"GET", replayable=False)
    lose(stale)
    error = failure(d, ResponseNeverReceived)
    assert error.reused and error.request_sent and not error.retried
    assert len(endpoint.made) == 1, "sent once"


def test_an_unbounded_pool_opens_a_connection_per_request_and_keeps_max_idle():
    """``max_connections=None``: nothing waits for a connection; ``max_idle`` bounds what is kept (the warmest)."""
    pool, endpoint, clock = make_pool(max_connections=None, max_idle=2)
    pending = [pool.request(b"GET", b"/%d" % i) for i in range(5)]
    assert len(endpoint.made) == 5 and pool.stats()["waiting"] == 0
    for (protocol, _), d in zip(endpoint.made, pending):
        protocol.dataReceived(ok())
        assert result(d).code == 200
    # The last two freed are kept; each older one was closed as a newer one came back.
    assert pool.stats()["idle"] == 2
    assert [t.disconnecting for _, t in endpoint.made] == [True, True, True, False, False]
    for protocol, transport in endpoint.made[:3]:
        lose(protocol)
    assert pool.stats() == {"open": 2, "idle": 2, "waiting": 0}
    pool.close()
    assert clock.getDelayedCalls() == []


def test_max_idle_zero_keeps_no_connection():
    pool, endpoint, clock = make_pool(max_connections=None, max_idle=0)
    d = pool.request(b"GET", b"/")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok())
    assert result(d).code == 200 and transport.disconnecting
    lose(protocol)
    assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0} and clock.getDelayedCalls() == []


def test_pause_and_resume_reach_the_upstream_transport_only_during_the_exchange():
    pool, endpoint, clock = make_pool()
    responses = []

    class Handler:
        def response_started(self, response):
            responses.append(response)
            response.pauseProducing()

        def body_received(self, data):
            pass

    d = pool.request(b"GET", b"/", handler=Handler())
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
    assert transport.producerState == "paused"
    responses[0].resumeProducing()
    assert transport.producerState == "producing"
    responses[0].pauseProducing()
    protocol.dataReceived(b"cd")
    result(d)
    assert transport.producerState == "producing", "a pooled connection is never left paused"
    responses[0].pauseProducing()  # the exchange is over: no effect on the pooled connection
    assert transport.producerState == "producing"


def test_a_handler_that_raises_fails_the_request_and_drops_the_connection():
    pool, endpoint, clock = make_pool()

    class Handler:
        def response_started(self, response):
            pass

        def body_received(self, data):
            raise ZeroDivisionError()

    d = pool.request(b"GET", b"/", handler=Handler())
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok(b"x"))
    failure(d, ZeroDivisionError)
    assert transport.disconnected and pool.stats()["idle"] == 0


def test_bad_response_aborts_the_connection():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/", timeout=5)
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(b"SSH-2.0-OpenSSH\r\n\r\n")
    error = failure(d, BadResponse)
    assert error.reason == "bad_response" and transport.disconnected
    assert clock.getDelayedCalls() == []


def test_idle_connection_closed_by_the_upstream_leaves_the_pool():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok())
    result(d)
    lose(protocol)
    assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
    d = pool.request(b"GET", b"/")
    assert len(endpoint.made) == 2
    endpoint.made[1][0].dataReceived(ok())
    assert not result(d).retried
    assert clock.getDelayedCalls() != []
    pool.close()
    assert clock.getDelayedCalls() == []


def test_bytes_on_an_idle_connection_close_it():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok())
    result(d)
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.disconnecting
    lose(protocol)
    assert pool.stats()["idle"] == 0 and clock.getDelayedCalls() == []


def test_close_refuses_new_requests_and_closes_busy_connections_when_done():
    pool, endpoint, clock = make_pool(max_connections=1)
    d1 = pool.request(b"GET", b"/1")
    d2 = pool.request(b"GET", b"/2")
    closed = pool.close()
    failure(d2, PoolClosed)
    failure(pool.request(b"GET", b"/3"), PoolClosed)
    result(closed)
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(ok())
    assert result(d1).code == 200 and transport.disconnecting
    assert clock.getDelayedCalls() == []


def test_the_response_names_the_transfer_codings_its_body_still_carries():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/")
    protocol, transport = endpoint.made[0]
    protocol.dataReceived(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n\x1f\x8b\r\n0\r\n\r\n")
    response = result(d)
    assert response.codings == b"gzip" and response.body == b"\x1f\x8b" and response.length is None
    assert pool.stats()["idle"] == 1  # framed by its chunks: reusable
    d = pool.request(b"GET", b"/")
    protocol.dataReceived(ok())
    assert result(d).codings is None
    pool.close()
    assert clock.getDelayedCalls() == []


def test_connections_and_exchanges_go_through_named_states():
    """IDLE -> BUSY -> IDLE | CLOSING -> LOST for a connection; NEW -> WAITING | CONNECTING -> SENT
    -> DONE (or STOPPING first) for an exchange (the module docstring's machine)."""
    pool, endpoint, clock = make_pool(max_connections=1, endpoint=Endpoint(auto=False))
    d1 = pool.request(b"GET", b"/1")
    d2 = pool.request(b"GET", b"/2")
    assert len(endpoint.attempts) == 1 and pool.stats()["waiting"] == 1  # /1 CONNECTING, /2 WAITING
    waiting = pool._waiting[0]
    assert waiting.state == "WAITING"
    protocol, transport = endpoint.accept()
    assert protocol.state == "BUSY" and protocol.exchange.state == "SENT"
    exchange = protocol.exchange
    protocol.dataReceived(ok())
    result(d1)
    assert exchange.state == "DONE"
    # The freed connection went straight to the one waiting.
    assert protocol.state == "BUSY" and protocol.exchange is waiting and waiting.state == "SENT"
    protocol.dataReceived(ok(extra=b"Connection: close\r\n"))
    result(d2)
    assert protocol.state == "CLOSING" and transport.disconnecting
    protocol.dataReceived(b"late")  # dropped, nothing raised
    lose(protocol)
    assert protocol.state == "LOST"
    # A request whose consumer stops it: STOPPING until its connection is gone.
    d3 = pool.request(b"GET", b"/3")
    assert pool.stats()["open"] == 1 and len(endpoint.attempts) == 1
    protocol, transport = endpoint.accept()
    protocol.dataReceived(ok(b"0123456789")[:-3])
    stopping = protocol.exchange
    stopping.response.stopProducing()
    assert stopping.state == "STOPPING" and protocol.state == "CLOSING" and transport.disconnected
    no_result(d3)
    lose(protocol, clean=False)
    failure(d3, CancelledError)
    assert stopping.state == "DONE" and protocol.state == "LOST"
    assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
    assert clock.getDelayedCalls() == []


def test_collector_keeps_at_most_its_limit():
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/", handler=Collector(limit=4))
    endpoint.made[0][0].dataReceived(ok(b"0123456789"))
    assert result(d).body == b"0123"


def test_large_body_is_written_apart_from_the_head():
    pool, endpoint, clock = make_pool()
    body = b"x" * (256 * 1024)
    pool.request(b"POST", b"/", body=body)
    _, transport = endpoint.made[0]
    assert transport.value().endswith(b"\r\n\r\n" + body)
    assert b"Content-Length: 262144\r\n" in transport.value()


# -- real sockets --------------------------------------------------------------------------------

TIMEOUT = 20


def _reactor():
    from twisted.internet import reactor

    return reactor


def within(d: Deferred) -> Deferred:
    """``d``, failing the test after TIMEOUT seconds (a request's own timeout covers only the head)."""
    return d.addTimeout(TIMEOUT, _reactor())


class Scripted(Protocol):
    """A server connection that answers each request per its factory's script.

    ``script(n, head)`` (n counts requests on this connection from 0) returns
    the bytes to answer, ``"close"`` or ``"reset"``.
    """

    def connectionMade(self):
        self.buf = b""
        self.n = 0
        self.factory.connections += 1

    def dataReceived(self, data):
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self.factory.requests.append(head.split(b"\r\n")[0])
            action = self.factory.script(self.n, head)
            self.n += 1
            if action == "close":
                self.transport.loseConnection()
                return
            if action == "reset":
                self.transport.abortConnection()
                return
            self.transport.write(action)


async def scripted_server(script):
    from twisted.internet.endpoints import TCP4ServerEndpoint

    factory = Factory.forProtocol(Scripted)
    factory.script = script
    factory.connections = 0
    factory.requests = []
    port = await TCP4ServerEndpoint(_reactor(), 0, interface="127.0.0.1").listen(factory)
    return factory, port


@pytest_twisted.ensureDeferred
async def test_real_keep_alive_reuse_against_the_sim():
    from yieldproxy.tools.sim import SimOllama, expected_embedding

    reactor = _reactor()
    sim = SimOllama(reactor)
    port = await sim.listen()
    pool = H1Pool(reactor, "127.0.0.1", port)
    try:
        for text in ("a", "b", "c", "d"):
            body = json.dumps({"model": "all-minilm", "input": text}).encode()
            response = await within(pool.request(
                b"POST", b"/api/embed", [(b"Content-Type", b"application/json")], body, timeout=TIMEOUT
            ))
            assert response.code == 200
            vector = json.loads(response.body)["embeddings"][0]
            assert vector == pytest.approx(expected_embedding(text, "all-minilm"))
        assert pool.stats()["open"] == 1, "one connection for all four"
    finally:
        await pool.close()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_real_upstream_closing_idle_connections():
    """The server closes after each answer: the pool notices while idle and connects afresh, no retry."""
    from helpers import wait_for

    reactor = _reactor()
    factory, port = await scripted_server(lambda n, head: ok(b"fine"))

    class CloseAfterAnswer(Scripted):
        def dataReceived(self, data):
            super().dataReceived(data)
            self.transport.loseConnection()

    factory.protocol = CloseAfterAnswer
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    try:
        for _ in range(3):
            response = await within(pool.request(b"POST", b"/api/embed", body=b"{}", timeout=TIMEOUT))
            assert response.body == b"fine" and not response.retried
            await wait_for(reactor, lambda: pool.stats()["open"] == 0, timeout=TIMEOUT)
        assert factory.connections == 3
    finally:
        await pool.close()
        await port.stopListening()


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest_twisted.ensureDeferred
async def test_real_stale_connection_race_is_retried_once_when_allowed(how):
    """The server drops the second request on a connection unanswered (the idle-close race)."""
    reactor = _reactor()
    factory, port = await scripted_server(lambda n, head: ok(b"answer %d" % n) if n == 0 else how)
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    try:
        first = await within(pool.request(b"GET", b"/1", timeout=TIMEOUT))
        assert first.body == b"answer 0"
        second = await within(pool.request(b"GET", b"/2", timeout=TIMEOUT))
        assert second.body == b"answer 0" and second.retried, "answered on a fresh connection"
        assert factory.connections == 2
        # A POST meeting the same is reported (reused, not retried), unless the caller allows it.
        with pytest.raises(ResponseNeverReceived) as caught:
            await within(pool.request(b"POST", b"/3", body=b"{}", timeout=TIMEOUT))
        assert caught.value.reused and not caught.value.retried
        await within(pool.request(b"GET", b"/warm", timeout=TIMEOUT))  # a new pooled connection
        replayed = await within(pool.request(b"POST", b"/4", body=b"{}", timeout=TIMEOUT, replayable=True))
        assert replayed.retried and replayed.code == 200
        assert factory.requests.count(b"POST /4 HTTP/1.1") == 2
    finally:
        await pool.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_real_an_idle_connection_the_upstream_closed_is_never_written_to():
    """The upstream closed a pooled connection and the reactor has not seen it yet: the request goes elsewhere.

    The close reaches the kernel while the reactor is held, so the pool
    still lists the connection as idle when the POST comes: a peek at the
    socket finds the end, and the POST goes once, on a new connection, with
    no failure and no retry (nothing had been written to the dead one).
    """
    import select
    import socket

    reactor = _reactor()
    factory, port = await scripted_server(lambda n, head: ok(b"answer"))
    servers = []

    class Kept(Scripted):
        def connectionMade(self):
            super().connectionMade()
            servers.append(self)

    factory.protocol = Kept
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    try:
        first = await within(pool.request(b"GET", b"/1", timeout=TIMEOUT))
        assert first.body == b"answer" and pool.stats()["idle"] == 1
        # Close the server's side under the reactor's feet, and wait (without turning the reactor,
        # so the pool has not seen it) until the FIN has reached the idle connection's socket.
        servers[0].transport.getHandle().shutdown(socket.SHUT_RDWR)
        [idle] = pool._idle
        readable, _, _ = select.select([idle.transport.getHandle()], [], [], TIMEOUT)
        assert readable, "the FIN never arrived"
        d = pool.request(b"POST", b"/2", body=b"{}", timeout=TIMEOUT, replayable=False)
        second = await within(d)
        assert second.body == b"answer" and not second.retried
        assert factory.connections == 2
        assert factory.requests == [b"GET /1 HTTP/1.1", b"POST /2 HTTP/1.1"], "the POST reached the upstream once"
    finally:
        await pool.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_real_a_request_goes_out_at_once_on_a_connection_with_nothing_waiting():
    """No write buffered for the reactor's next turn (two epoll_ctl calls and a turn per request).

    It also fails loudly if Twisted moves the (public) transport attributes ``write_now`` relies on.  Once a
    large body was left to the transport (it may still hold some of it), the connection's writes all go
    through the transport, so a later request cannot pass those bytes.
    """
    reactor = _reactor()
    factory, port = await scripted_server(lambda n, head: ok(b"answer %d" % n))
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    try:
        first = await within(pool.request(b"GET", b"/1", timeout=TIMEOUT))
        assert first.body == b"answer 0"
        (conn,) = pool._idle
        transport = conn.transport
        for name in ("dataBuffer", "connected", "disconnecting"):
            assert hasattr(transport, name), f"Twisted moved {name}: h1client.write_now falls back to write()"
        assert callable(transport.writeSomeData)
        buffered = []
        real_write = transport.write
        transport.write = lambda data: buffered.append(data) or real_write(data)
        d = pool.request(b"POST", b"/2", body=b"{}", timeout=TIMEOUT)
        assert buffered == [] and transport.dataBuffer == b""
        assert (await within(d)).body == b"answer 1"
        large = await within(pool.request(b"POST", b"/3", body=b"x" * (SMALL_BODY + 1), timeout=TIMEOUT))
        assert large.body == b"answer 2" and buffered
        buffered.clear()
        assert (await within(pool.request(b"POST", b"/4", body=b"{}", timeout=TIMEOUT))).body == b"answer 3"
        assert buffered, "a request after a body left to the transport was sent around it"
        assert factory.requests == [b"GET /1 HTTP/1.1", b"POST /2 HTTP/1.1", b"POST /3 HTTP/1.1", b"POST /4 HTTP/1.1"]
    finally:
        await pool.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_real_chunked_stream_arrives_piece_by_piece():
    from yieldproxy.tools.sim import SimOllama

    reactor = _reactor()
    sim = SimOllama(reactor, chunk_delay=0.05, chunks=6, models=("llama3",))
    port = await sim.listen()
    pool = H1Pool(reactor, "127.0.0.1", port)
    arrivals = []

    class Handler:
        def response_started(self, response):
            self.response = response

        def body_received(self, data):
            arrivals.append((reactor.seconds(), data))

    try:
        body = json.dumps({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}).encode()
        d = pool.request(b"POST", b"/api/chat", [], body, Handler(), timeout=TIMEOUT)
        response = await within(d)
        assert _header(response, b"transfer-encoding") == b"chunked" and response.length is None
        lines = [json.loads(line) for line in b"".join(data for _, data in arrivals).splitlines()]
        assert lines[-1]["done"] is True and all(not line["done"] for line in lines[:-1])
        # Lines 50 ms apart arrive apart (a loaded machine may merge a few, not all).
        assert len(arrivals) >= 2 and arrivals[-1][0] - arrivals[0][0] >= 0.1, "streamed, not buffered"
    finally:
        await pool.close()
        await sim.stop()


async def _site_server(resource):
    from twisted.internet.endpoints import TCP4ServerEndpoint
    from twisted.web.server import Site

    return await TCP4ServerEndpoint(_reactor(), 0, interface="127.0.0.1").listen(Site(resource))


@pytest_twisted.ensureDeferred
async def test_real_large_bodies_both_ways_with_length_and_chunked():
    from twisted.web.resource import Resource

    class Echo(Resource):
        isLeaf = True

        def render_POST(self, request):
            data = request.content.read()
            if request.args.get(b"chunked"):
                for i in range(0, len(data), 1 << 20):
                    request.write(data[i : i + (1 << 20)])
                return b""
            return data

    reactor = _reactor()
    port = await _site_server(Echo())
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    body = bytes(range(256)) * (5 * 4096)  # 5 MiB
    try:
        for target in (b"/echo", b"/echo?chunked=1"):
            response = await within(pool.request(b"POST", target, [], body, timeout=TIMEOUT))
            assert response.code == 200 and response.body == body
        assert pool.stats()["open"] == 1
    finally:
        await pool.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_real_backpressure_pauses_the_upstream_socket():
    from twisted.web.resource import Resource

    from helpers import wait_for

    total = 64 * 1024 * 1024

    class Big(Resource):
        isLeaf = True

        def render_GET(self, request):
            request.setHeader(b"content-length", b"%d" % total)
            return b"z" * total

    reactor = _reactor()
    port = await _site_server(Big())
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    received = [0]

    class Slow:
        def response_started(self, response):
            self.response = response
            response.pauseProducing()

        def body_received(self, data):
            received[0] += len(data)

    def reading_from_the_server() -> bool:
        """The reactor reads a TCP socket connected to the server (public IReactorFDSet and ITCPTransport only)."""
        from twisted.internet.interfaces import ITCPTransport

        server = port.getHost().port
        return any(ITCPTransport.providedBy(r) and r.getPeer().port == server for r in reactor.getReaders())

    handler = Slow()
    try:
        d = pool.request(b"GET", b"/big", handler=handler, timeout=TIMEOUT)
        await wait_for(reactor, lambda: hasattr(handler, "response"))
        # Paused: the socket is out of the reactor's readers, so nothing more can be read
        # from it, however long the test would wait.
        assert not reading_from_the_server(), "the upstream socket is still read while paused"
        assert received[0] < total
        handler.response.resumeProducing()
        assert reading_from_the_server()
        await within(d)
        assert received[0] == total
    finally:
        await pool.close()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_real_refused_connection():
    from helpers import free_port

    pool = H1Pool(_reactor(), "127.0.0.1", free_port())
    with pytest.raises(ConnectFailed) as caught:
        await within(pool.request(b"GET", b"/", timeout=TIMEOUT))
    assert caught.value.reason == "refused"
    await pool.close()


# -- fuzz ----------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

#: Examples per fuzz test; raise it for a longer hunt: YIELDPROXY_FUZZ_EXAMPLES=6000 pytest tests/edge/test_h1client.py -k fuzz
FUZZ = settings(
    max_examples=int(os.environ.get("YIELDPROXY_FUZZ_EXAMPLES", "400")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _alphabet(alphabet: bytes, min_size: int, max_size: int):
    return st.binary(min_size=min_size, max_size=max_size).map(lambda b: bytes(alphabet[x % len(alphabet)] for x in b))


def _feed_all(data: bytes, cuts, head_request: bool, clean: bool) -> Events:
    """Feed as a connection would (nothing after the end), then the close; only ParseError may escape."""
    events = Events()
    parser = ResponseParser(events)
    parser.start(head_request)
    offsets = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    for a, b in zip(offsets, offsets[1:]):
        if events.ends:
            break
        if a < b:
            parser.feed(data[a:b])
    if not events.ends:
        parser.feed_eof(clean)
    assert len(events.ends) <= 1
    return events


@pytest.mark.timeout(300)
@FUZZ
@given(st.binary(max_size=3000), st.lists(st.integers(0, 4000), max_size=12), st.booleans(), st.booleans())
def test_fuzz_any_bytes_only_parse_error(data, cuts, head_request, clean):
    try:
        _feed_all(data, cuts, head_request, clean)
    except ParseError:
        pass


headers_st = st.lists(
    st.tuples(_alphabet(TCHAR, 1, 12), _alphabet(bytes(range(0x20, 0x7F)) + b"\t", 0, 30)).filter(
        lambda nv: nv[0].lower() not in (b"content-length", b"transfer-encoding", b"connection")
    ),
    max_size=6,
)


@st.composite
def responses(draw):
    """A valid response, its body, and whether the connection may be reused."""
    code = draw(st.sampled_from([200, 201, 204, 304, 404, 500, 502, 503]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    headers = draw(headers_st)
    body = draw(st.binary(max_size=2000))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    close = draw(st.booleans())
    head_request = draw(st.booleans())
    interim = draw(st.booleans())
    lines = [b"%s %d Reason Phrase" % (version, code)]
    lines += [name + b": " + value.strip(b" \t") for name, value in headers]
    no_body = head_request or code in (204, 304)
    keep = (version == b"HTTP/1.1") and not close
    if close:
        lines.append(b"Connection: close")
    elif version == b"HTTP/1.0" and draw(st.booleans()):
        lines.append(b"Connection: keep-alive")  # never kept alive all the same
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        sizes = draw(st.lists(st.integers(1, 300), max_size=10))
        chunks, i = [], 0
        for size in sizes:
            piece = body[i : i + size]
            if not piece:
                break
            ext = draw(st.sampled_from([b"", b";a=b", b"; x"]))
            chunks.append(b"%x%s\r\n%s\r\n" % (len(piece), ext, piece))
            i += len(piece)
        if i < len(body):
            chunks.append(b"%x\r\n%s\r\n" % (len(body) - i, body[i:]))
        trailers = draw(st.sampled_from([b"", b"X-T: 1\r\n"]))
        payload = b"".join(chunks) + b"0\r\n" + trailers + b"\r\n"
    else:
        payload = body
        if not no_body:
            keep = False
    if no_body:
        payload, body = b"", b""
    prefix = b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b""
    data = prefix + b"\r\n".join(lines) + b"\r\n\r\n" + payload
    return data, body, keep, head_request, framing == "close" and not no_body


@pytest.mark.timeout(300)
@FUZZ
@given(responses(), st.lists(st.integers(0, 5000), max_size=12))
def test_fuzz_valid_responses_parse_whole_however_cut(response, cuts):
    data, body, keep, head_request, until_close = response
    events = _feed_all(data, cuts, head_request, clean=True)
    assert events.body == body
    assert len(events.heads) == 1
    assert events.ends == [keep]


@pytest.mark.timeout(300)
@FUZZ
@given(responses(), st.lists(st.tuples(st.integers(0, 5000), st.binary(max_size=3)), min_size=1, max_size=4),
       st.lists(st.integers(0, 5000), max_size=8))
def test_fuzz_mutated_responses_only_parse_error(response, mutations, cuts):
    data = bytearray(response[0])
    for position, replacement in mutations:
        position %= len(data) + 1
        data[position : position + 1] = replacement
    try:
        _feed_all(bytes(data), cuts, response[3], clean=True)
    except ParseError:
        pass


@pytest.mark.timeout(300)
@FUZZ
@given(st.lists(st.binary(max_size=400), max_size=8), st.booleans())
def test_fuzz_a_connection_fed_anything_ends_in_one_outcome(pieces, clean):
    pool, endpoint, clock = make_pool()
    d = pool.request(b"GET", b"/", timeout=5)
    protocol, _ = endpoint.made[0]
    for piece in pieces:
        protocol.dataReceived(piece)  # never raises
    lose(protocol, clean)
    clock.advance(10)
    outcome = []
    d.addBoth(outcome.append)
    assert len(outcome) == 1
    assert not isinstance(outcome[0], Failure) or outcome[0].check(BadResponse, ResponseNeverReceived,
                                                                   ResponseIncomplete, ResponseTimeout)
    assert clock.getDelayedCalls() == []
