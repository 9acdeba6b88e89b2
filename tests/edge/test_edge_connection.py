"""The listener's connection (yieldproxy/edge/connection.py): its states, and the resources each owns.

Every case runs one connection in memory on a Clock (a StringTransport that
can shut its write side, as TCP's can), feeding it bytes as a socket would.
The wire-level behaviour with real clients and sockets is in test_hostile,
test_edge, test_fuzz and test_limits.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from yieldproxy.edge.capacity import SMALL_BODY_BYTES, Connections
from yieldproxy.edge.connection import (
    BODY,
    CLOSED,
    FRESH,
    HANDLING,
    HEAD,
    IDLE,
    LINGER,
    MOVES,
    PORTABLE,
    READING,
    SERVING,
    WRITING,
    State,
)
from yieldproxy.edge.site import ProxySite
from yieldproxy.errors import listener_error_body

PEER = IPv4Address("TCP", "127.0.0.1", 50000)


class _Ok(Resource):
    isLeaf = True

    def render(self, request):
        return b"ok"


class _Held(Resource):
    """Answers only when the test says so (a parked request)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests = []

    def render(self, request):
        self.requests.append(request)
        return NOT_DONE_YET


class _Transport(StringTransport):
    """A transport that can shut its write side, as TCP's can (the connection lingers then)."""

    write_closed = False
    aborted = False

    def loseWriteConnection(self):
        self.write_closed = True

    def abortConnection(self):
        self.aborted = True
        self.loseConnection()


class Wire:
    """One connection of a site, in memory, on a Clock."""

    def __init__(self, resource=None, connections=None, clock=None, **site_options):
        self.clock = clock if clock is not None else Clock()
        self.resource = resource if resource is not None else _Ok()
        self.site = ProxySite(
            self.resource, site_options.pop("max_body_bytes", 1000), reactor=self.clock, connections=connections,
            error_body=listener_error_body,
            **site_options,
        )
        self.connection = self.site.buildProtocol(PEER)
        self.transport = _Transport(peerAddress=PEER)
        self.connection.makeConnection(self.transport)

    def send(self, raw: bytes) -> None:
        self.connection.dataReceived(raw)

    def lose(self) -> None:
        self.connection.connectionLost(Failure(ConnectionDone()))

    def answers(self) -> list[tuple[int, bytes]]:
        out, answers = self.transport.value(), []
        while out:
            head, _, rest = out.partition(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            answers.append((status, rest[:length]))
            out = rest[length:]
        return answers

    def answer(self) -> tuple[int, dict]:
        status, body = self.answers()[-1]
        return status, json.loads(body)


# -- the table ------------------------------------------------------------------------------

#: The moves a connection may make: every move of MOVES that changes its state.
TRANSITIONS = {state: frozenset(new for new in MOVES.next[state].values() if new is not state) for state in State}


def test_every_state_is_in_the_table_and_only_closed_is_a_dead_end():
    assert set(TRANSITIONS) == set(State)
    for state, targets in TRANSITIONS.items():
        assert targets <= set(State)
        assert (not targets) == (state is CLOSED), state
        assert state is CLOSED or CLOSED in targets, f"{state} cannot be closed"


def test_every_state_can_be_reached_from_fresh():
    seen, todo = {FRESH}, [FRESH]
    while todo:
        for target in TRANSITIONS[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    assert seen == set(State)


def test_only_a_served_request_goes_back_to_waiting():
    """Idle comes only after an answer is written (or as it was, taken over in a reload); nothing leaves
    linger or closing but the close."""
    assert [s for s, targets in TRANSITIONS.items() if IDLE in targets] == [FRESH, WRITING]
    assert TRANSITIONS[LINGER] == TRANSITIONS[State.CLOSING] == {CLOSED}
    assert PORTABLE == {FRESH, IDLE, HANDLING}
    assert READING.isdisjoint(SERVING)


def test_a_move_outside_the_table_is_a_bug_that_says_so():
    wire = Wire()
    with pytest.raises(RuntimeError, match="a connection cannot take 'answered' in state FRESH"):
        wire.connection.fire("answered")  # an answer done before any request
    assert wire.connection.state is FRESH


# -- what the reader refuses reaches the client in JSON ---------------------------------------


def test_a_transfer_coding_other_than_chunked_is_a_400_in_the_routes_shape():
    wire = Wire()
    wire.send(b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: identity\r\n\r\n")
    status, body = wire.answer()
    assert status == 400 and "Transfer-Encoding must be chunked" in body["error"]["message"]
    assert wire.connection.state is LINGER and wire.transport.write_closed


def test_conflicting_lengths_are_a_400():
    wire = Wire()
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
    status, body = wire.answer()
    assert status == 400 and body == {"error": "invalid or conflicting Content-Length / Transfer-Encoding"}


@pytest.mark.parametrize(
    "headers", [[b"X-Big: " + b"a" * 8000] * 3, [b"X-Many-%d: 1" % i for i in range(120)]], ids=["large", "many"]
)
def test_too_many_or_too_large_headers_are_a_431(headers):
    wire = Wire()
    wire.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n")
    status, body = wire.answer()
    assert status == 431 and body["error"].startswith(("request headers larger", "more than"))


def test_a_bare_lf_in_a_head_or_a_chunk_line_is_a_400_at_once():
    wire = Wire()
    wire.send(b"GET /api/tags HTTP/1.1\nHost: localhost\n\n")
    status, body = wire.answer()
    assert status == 400 and "bare LF" in body["error"]
    wire = Wire()
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\n\n")
    status, body = wire.answer()
    assert status == 400 and "bare LF" in body["error"]


def test_the_end_of_a_refused_chunked_body_changes_nothing_and_the_refusal_lingers():
    wire = Wire(max_body_bytes=10)
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
    # The chunk past the limit and the body's end in one read.
    wire.send(b"14\r\n" + b"x" * 20 + b"\r\n0\r\n\r\n")
    assert [status for status, _ in wire.answers()] == [413]
    assert wire.connection.state is LINGER and wire.transport.write_closed
    wire.send(b"more of the body, dropped")
    assert [status for status, _ in wire.answers()] == [413]
    wire.clock.advance(wire.site.linger_seconds)
    assert wire.transport.aborted


def test_a_slow_request_gets_408_at_its_read_deadline():
    wire = Wire()
    wire.send(b"GET /api/tags HTTP/1.1\r\n")
    assert wire.connection.state is HEAD
    wire.clock.advance(29.9)
    assert wire.transport.value() == b""
    wire.clock.advance(0.1)
    status, body = wire.answer()
    assert status == 408 and "not received in full" in body["error"]


# -- the channel interface: backpressure and the client's leaving ------------------------------


def test_a_full_client_transport_shows_in_write_blocked_and_pauses_the_producer():
    """attempt.Attempt reads ``write_blocked`` to know the client's transport is full (then it registers
    as the client's producer and counts what waits in memory against the client buffer bounds)."""
    held = _Held()
    wire = Wire(held)
    wire.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")
    request = held.requests[0]
    request.write(b"first")
    assert wire.connection.state is WRITING and wire.connection.answer_started

    class Producer:
        paused = resumed = 0

        def pauseProducing(self):
            self.paused += 1

        def resumeProducing(self):
            self.resumed += 1

        def stopProducing(self):
            pass

    producer = Producer()
    request.registerProducer(producer, True)
    # What a transport does when its send buffer fills, and when it drains (to its push producer).
    wire.connection.writer.pauseProducing()
    assert wire.connection.write_blocked and producer.paused == 1
    wire.connection.writer.resumeProducing()
    assert not wire.connection.write_blocked and producer.resumed == 1
    # A client that reads nothing for the slow-reader bound is dropped.
    wire.connection.writer.pauseProducing()
    wire.clock.advance(wire.site.timeOut)
    assert wire.transport.aborted


def test_a_request_says_when_its_client_went_away():
    """proxy/resource.py reads ``gone`` to tell a handler's end from a client's leaving."""
    held = _Held()
    wire = Wire(held)
    wire.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")
    request = held.requests[0]
    assert not request.gone and wire.connection.state is HANDLING
    wire.lose()
    assert request.gone and wire.connection.state is CLOSED


def test_pipelined_requests_are_read_ahead_while_one_is_served_and_answered_in_turn():
    held = _Held()
    wire = Wire(held)
    wire.send(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\nGET /b HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert len(held.requests) == 1 and wire.connection.read_ahead.startswith(b"GET /b")
    for n, letter in enumerate((b"A", b"B")):
        request = held.requests[n]
        request.setHeader(b"content-length", b"1")
        request.write(letter)
        request.finish()
        assert len(held.requests) == 2 and held.requests[1].path == b"/b"
    assert wire.connection.state is IDLE and not wire.connection.read_ahead
    assert wire.answers() == [(200, b"A"), (200, b"B")]


def test_an_http_1_0_request_is_answered_in_http_1_0_and_closed():
    wire = Wire()
    wire.send(b"GET /api/tags HTTP/1.0\r\nHost: localhost\r\n\r\n")
    out = wire.transport.value()
    assert out.startswith(b"HTTP/1.0 200 ") and b"chunked" not in out.lower()
    assert wire.connection.state is State.CLOSING and wire.transport.disconnecting


def test_a_keepalive_connection_is_closed_silently_at_its_deadline_and_refills_idle_on_each_answer():
    connections = Connections(10)
    wire = Wire(connections=connections, timeout=30)
    assert wire.connection.state is FRESH and not wire.connection.reclaimable
    wire.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert wire.connection.state is IDLE and wire.connection.reclaimable
    wire.clock.advance(29)
    wire.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")
    wire.clock.advance(29)
    assert not wire.transport.disconnecting
    wire.clock.advance(1)
    assert wire.transport.disconnecting and [s for s, _ in wire.answers()] == [200, 200]


# -- the receiving budget: what is received, given back whatever ends the body -----------------


def _budget_wire(connections, **options):
    return Wire(_Held(), connections=connections, max_body_bytes=10 * 1024 * 1024, **options)


@pytest.mark.parametrize("ending", ["client closes", "client cuts the body", "read timeout"])
def test_a_body_that_never_finishes_leaves_the_receiving_budget_when_its_connection_ends(ending):
    connections = Connections(10, max_receiving_bytes=1024 * 1024)
    wire = _budget_wire(connections)
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 500000\r\n\r\n" + b"x" * 1000)
    assert wire.connection.state is BODY and connections.receiving == 1000
    if ending == "read timeout":
        wire.clock.advance(30)
        assert wire.answer()[0] == 408
    else:
        wire.lose()
    assert connections.receiving == 0
    assert connections.open == (1 if ending == "read timeout" else 0)


def test_the_budget_weighs_what_arrives_not_what_is_announced():
    """A handful of connections announcing large bodies and sending nothing no longer refuse every body."""
    connections = Connections(20, max_receiving_bytes=1024 * 1024)
    for _ in range(8):
        wire = _budget_wire(connections)
        wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 900000\r\n\r\n")
    body = b"y" * (200 * 1024)
    wire = _budget_wire(connections)
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert wire.connection.state is HANDLING and wire.resource.requests[0].content.read() == body
    assert connections.receiving == 0


def test_a_body_past_the_budget_is_refused_503_and_its_bytes_given_back():
    connections = Connections(10, max_receiving_bytes=100 * 1024)
    first = _budget_wire(connections)
    first.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2000000\r\n\r\n" + b"a" * 70_000)
    second = _budget_wire(connections)
    second.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2000000\r\n\r\n" + b"b" * 70_000)
    status, body = second.answer()
    assert status == 503 and "max_receiving_bytes" in body["error"]
    assert second.connection.state is LINGER and connections.receiving == 70_000
    first.lose()
    assert connections.receiving == 0


_SMALL = b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1024\r\n\r\n" + b"s" * 1024

#: Sizes of uploads that stall: just under and over the small line, a bit of the budget, most of it.
_STALLED_SIZES = st.one_of(
    st.sampled_from([SMALL_BODY_BYTES - 1, SMALL_BODY_BYTES, SMALL_BODY_BYTES + 1, 200 * 1024, 700 * 1024]),
    st.integers(2, 1024 * 1024),
)
_stalled_upload = st.tuples(
    _STALLED_SIZES,
    st.sampled_from(["length", "chunked", "chunks"]),  # how its body is framed
    st.integers(1, 3),  # bytes it holds back
    st.booleans(),  # whether it sends a byte now and then, to look alive
    st.sampled_from([0.0, 0.01, 0.2]),  # seconds before the next upload starts
)


def _stalled_bytes(size: int, framing: str, held_back: int) -> bytes:
    """A request whose body is ``size`` bytes, all but the last ``held_back`` of them sent."""
    body = b"u" * (size - held_back)
    if framing == "length":
        return b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % size + body
    head = b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    if framing == "chunked":
        return head + b"%x\r\n" % size + body
    half = len(body) // 2
    return head + b"%x\r\n%s\r\n" % (half, body[:half]) + b"%x\r\n" % (size - half) + body[half:]


@settings(max_examples=int(os.environ.get("YIELDPROXY_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(uploads=st.lists(_stalled_upload, min_size=1, max_size=40))
@example(uploads=[(SMALL_BODY_BYTES - 1, "length", 1, False, 0.0)] * 20)
@example(uploads=[(700 * 1024, "chunked", 1, True, 0.0)] + [(SMALL_BODY_BYTES - 1, "chunks", 1, True, 0.01)] * 8)
def test_stalled_uploads_never_keep_a_body_out(uploads):
    """Any mix of uploads that hold back their end (large, small, one byte under the small line, framed by
    Content-Length or in chunks, some sending a byte now and then to look alive): once they have stalled, every
    small request arriving is received whole, and the budget is never passed.

    Before, bodies one byte under the small line filled the quarter kept for small bodies too, and every small
    request got 503 while they stayed open."""
    clock = Clock()
    limit = 1024 * 1024
    connections = Connections(1000, max_receiving_bytes=limit)
    open_uploads = []
    for size, framing, held_back, alive, pause in uploads:
        held_back = min(held_back, size - 1)
        wire = _budget_wire(connections, clock=clock)
        wire.send(_stalled_bytes(size, framing, held_back))
        assert connections.receiving <= limit
        if wire.connection.state is BODY:
            open_uploads.append((wire, held_back - 1 if alive else 0))
        clock.advance(pause)

    def trickle() -> None:
        """The uploads that look alive send one more byte of what they held back (never the last)."""
        for i, (wire, left) in enumerate(open_uploads):
            if left > 0 and wire.connection.state is BODY:
                wire.send(b"u")
                open_uploads[i] = (wire, left - 1)

    for _ in range(8):  # two seconds: twice the stall bound
        clock.advance(0.25)
        trickle()
    for _ in range(5):
        small = _budget_wire(connections, clock=clock)
        small.send(_SMALL)
        assert small.connection.state is HANDLING, small.transport.value()[:200]
        assert small.resource.requests[-1].content.read() == b"s" * 1024
        assert connections.receiving <= limit
        trickle()
        clock.advance(0.25)


def test_an_upload_that_keeps_its_pace_keeps_its_budget_and_a_stalled_one_is_cut_408():
    """The budget is cut from the bodies that stalled, the slowest first, never from one that keeps sending at
    pace; with every body in the budget at pace, a body past it is refused 503 as before."""
    clock = Clock()
    connections = Connections(100, max_receiving_bytes=1024 * 1024)
    steady = _budget_wire(connections, clock=clock)
    steady.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 900000\r\n\r\n" + b"a" * 300_000)
    stalled = _budget_wire(connections, clock=clock)
    stalled.send(_stalled_bytes(SMALL_BODY_BYTES - 1, "length", 1))
    for _ in range(10):
        clock.advance(0.1)
        steady.send(b"a" * 20_000)  # 200 KB/s: at pace
    assert connections.receiving == 500_000 + SMALL_BODY_BYTES - 2
    # A body that needs more room than is left: the stalled one is cut (408), the steady one keeps going.
    newcomer = _budget_wire(connections, clock=clock)
    newcomer.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 600000\r\n\r\n" + b"n" * 250_000)
    assert stalled.answer()[0] == 408 and stalled.connection.state is LINGER
    assert steady.connection.state is BODY and newcomer.connection.state is BODY
    assert connections.receiving == 750_000
    # Every body left is at pace: one more is refused, as the budget always did.
    clock.advance(0.1)
    steady.send(b"a" * 10_000)
    newcomer.send(b"n" * 10_000)
    late = _budget_wire(connections, clock=clock)
    late.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 600000\r\n\r\n" + b"l" * 300_000)
    assert late.answer()[0] == 503 and steady.connection.state is BODY and newcomer.connection.state is BODY
    assert connections.receiving == 770_000 and stalled.connection.state is LINGER


# -- the client shuts its side (a half-close) ------------------------------------------------


def test_a_half_closed_connection_answers_what_came_whole_in_order_then_closes():
    """``shutdown(SHUT_WR)`` after two whole requests and part of a third: two answers, then the close."""
    wire = Wire()
    get = b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n"
    wire.send(get + get + b"GET /b HT")
    wire.connection.readConnectionLost()
    assert [status for status, _ in wire.answers()] == [200, 200]
    assert wire.connection.state is State.CLOSING and wire.transport.disconnecting


def test_a_half_closed_connection_with_its_request_parked_waits_for_its_answer():
    """The request is the app's (parked): the half-close does not end it; its answer is written, then the close."""
    wire = Wire(_Held())
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}")
    wire.connection.readConnectionLost()
    wire.clock.advance(60)
    assert wire.connection.state is HANDLING and not wire.transport.disconnecting
    request = wire.resource.requests[0]
    finished = request.notifyFinish()
    request.write(b"late")
    request.finish()
    assert finished.called and finished.result is None  # the request was not told its client left
    assert wire.transport.value().startswith(b"HTTP/1.1 200 ") and b"late" in wire.transport.value()
    assert wire.connection.state is State.CLOSING and wire.transport.disconnecting


@pytest.mark.parametrize("sent", [b"", b"GET /a HTTP/1.1\r\nHost: loc", b"POST /a HTTP/1.1\r\nHost: l\r\nContent-Length: 9\r\n\r\n{"])
def test_a_half_close_before_a_whole_request_closes_without_an_answer(sent):
    connections = Connections(10, max_receiving_bytes=1024)
    wire = Wire(connections=connections)
    wire.send(sent)
    wire.connection.readConnectionLost()
    assert wire.transport.value() == b"" and wire.transport.disconnecting
    wire.lose()
    assert connections.open == 0 and connections.receiving == 0


def test_a_declared_oversized_body_is_refused_before_it_is_read():
    wire = Wire(max_body_bytes=10)
    wire.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n")
    assert [s for s, _ in wire.answers()] == [413]
    assert b"100 Continue" not in wire.transport.value()
    assert wire.connection.state is LINGER


def test_a_socket_writer_sends_an_answer_at_once_and_knows_what_the_transport_still_holds():
    """The answer in one send when the transport holds nothing; past what the socket takes, the rest through the
    transport (in order), unsent until the transport says it has sent it all, blocked past BUFFER_BYTES."""
    from twisted.internet import tcp

    from yieldproxy.edge.writer import BUFFER_BYTES, SocketWriter

    class Socket(tcp.Connection):
        def __init__(self, takes: int):
            self.takes, self.sent, self.handed, self.producer = takes, [], [], None
            self.connected, self.disconnecting = 1, False

        def registerProducer(self, producer, streaming):
            assert not streaming
            self.producer = producer
            producer.resumeProducing()

        def unregisterProducer(self):
            self.producer = None

        def writeSomeData(self, data):
            taken = data[: self.takes]
            self.sent.append(taken)
            return len(taken)

        def write(self, data):
            self.handed.append(data)

    clock = Clock()
    events = []
    socket = Socket(takes=1 << 20)
    writer = SocketWriter(socket, clock, lambda: events.append("blocked"), lambda: events.append("drained"))
    writer.write(b"head")
    writer.write(b"body")
    assert socket.sent == [] and writer.unsent
    writer.flush()
    assert socket.sent == [b"headbody"] and socket.handed == [] and not writer.unsent
    # The socket takes part: the rest goes through the transport, and so does what comes next.
    socket.takes = 3
    writer.write(b"x" * (BUFFER_BYTES + 10))
    clock.advance(0)  # the turn's end sends what waits
    assert socket.sent[-1] == b"xxx" and socket.handed == [b"x" * (BUFFER_BYTES + 7)]
    assert writer.unsent and writer.blocked and events == ["blocked"]
    writer.write(b"after")
    writer.flush()
    assert socket.handed[-1] == b"after" and len(socket.sent) == 2  # no send around what the transport holds
    socket.producer.resumeProducing()  # the transport sent everything it was handed
    assert not writer.unsent and not writer.blocked and events == ["blocked", "drained"]
    writer.write(b"next answer")
    writer.release()
    assert socket.sent[-1] == b"nex" and socket.producer is None


def test_a_stop_waits_for_what_a_connection_still_has_to_write():
    connections = Connections(10)
    held = Wire(_Held(), connections=connections)
    held.send(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    idle = Wire(connections=connections)
    idle.send(b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert connections.flushed().called  # nothing unsent anywhere (a test's transport takes every write)
    assert not idle.transport.disconnecting and not held.transport.disconnecting
    assert held.connection.state is HANDLING
