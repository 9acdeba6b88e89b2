"""The admin listener under a flood: no bytes a client sends keep a whole request out (issue 31, class 2).

The admin listener keeps places for whole requests, so that a flood of slow
connections cannot lock the operator out.  A request is whole when the
request reader has read its end, the body its head announces included, and a
whole request that finds every place taken gets the place of the connection
that has made the least progress (edge/capacity.py).  These cases drive the
admin API's own site on a Clock, with connections from several loopback
addresses sending generated heads and body framings (chunked, Content-Length,
partial chunks, trailers, pipelining, malformed), and check that the
operator's ``POST /resume``, arriving at any moment of the flood, is answered
200.  The same over real sockets is ``test_a_flood_of_heads_that_announce_a_body_does_not_lock_the_operator_out``.
"""

from __future__ import annotations

import os
import threading

import pytest
import pytest_twisted
import treq
from hypothesis import HealthCheck, example, given, settings, strategies as st
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from helpers import config_with, in_thread, start_stack, wait_for
from inmemory import Rig
from rawhttp import port_of, request_bytes
from test_edge import _flood
from yieldproxy.admin.api import ADMIN_QUICK_SECONDS
from yieldproxy.edge.capacity import OVER_CAPACITY_WAIT, Connections
from yieldproxy.edge.site import ProxySite

TOKEN = "s3cret-operator-token"
TIMEOUT = 60
EXAMPLES = int(os.environ.get("YIELDPROXY_FUZZ_EXAMPLES", "60"))
FLOOD = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))

RESUME = request_bytes(
    b"POST", b"/resume",
    [(b"Authorization", b"Bearer " + TOKEN.encode()), (b"Content-Type", b"application/json")],
    b'{"source": "api"}',
)


class _Socket(StringTransport):
    """A server-side transport in memory: its protocol can be swapped (the room hands a connection over), and a
    close reaches the protocol on the next turn, as the reactor delivers it."""

    def __init__(self, clock, host: str):
        super().__init__(peerAddress=IPv4Address("TCP", host, 40000))
        self.clock = clock
        self.protocol = None
        self.gone = False
        self.write_closed = False

    def loseConnection(self):
        if not self.disconnecting:
            super().loseConnection()
            self.clock.callLater(0, self._lost)

    def abortConnection(self):
        self.loseConnection()

    def loseWriteConnection(self):
        self.write_closed = True

    def _lost(self):
        if not self.gone:
            self.gone = True
            self.protocol.connectionLost(Failure(ConnectionDone()))

    def send(self, data: bytes) -> None:
        if not self.gone and not self.disconnecting and data:
            self.protocol.dataReceived(data)


def _connect(site, clock, host: str) -> _Socket:
    transport = _Socket(clock, host)
    protocol = site.buildProtocol(transport.getPeer())
    transport.protocol = protocol
    protocol.makeConnection(transport)
    return transport


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"


_HEAD = request_bytes(b"POST", b"/resume", [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"chunked")],
                      length=False)
_LENGTH_HEAD = request_bytes(b"POST", b"/yield", [(b"Content-Type", b"application/json"), (b"Content-Length", b"40")],
                             length=False)
_WHOLE = request_bytes(b"GET", b"/status")

#: What a flooding connection sends: every way a request can look whole, or nearly, without being whole; and
#: whole ones (answered 401: the flood has no token), pipelined or not; and malformed ones.
PATTERNS = {
    "nothing": b"",
    "a byte": b"P",
    "a request line": b"POST /resume HTTP/1.1\r\n",
    "a head without its end": _HEAD[:-2],
    "chunked, no chunk": _HEAD,
    "chunked, a partial chunk": _HEAD + b"10\r\n{\"source\":",
    "chunked, a chunk without its CRLF": _HEAD + b"2\r\n{}",
    "chunked, the last chunk without the end": _HEAD + b"2\r\n{}\r\n0\r\n",
    "chunked, a trailer begun": _HEAD + b"2\r\n{}\r\n0\r\nX-Trailer: 1\r\n",
    "chunked, a size line begun": _HEAD + b"2\r\n{}\r\n1",
    "length, no body": _LENGTH_HEAD,
    "length, part of the body": _LENGTH_HEAD + b'{"source": "flood"',
    "length, one byte short": _LENGTH_HEAD + b"x" * 39,
    "whole": _WHOLE,
    "whole, chunked": _HEAD + _chunked(b"{}"),
    "whole, and the next begun": _WHOLE + b"G",
    "whole, and the next a chunked head": _WHOLE + _HEAD,
    "two whole": _WHOLE + _WHOLE,
    "malformed": b"POST /resume HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: identity\r\n\r\n",
    "a bare LF": b"GET /status HTTP/1.1\nHost: 127.0.0.1\n\n",
}

_flooder = st.tuples(
    st.sampled_from(sorted(PATTERNS)),
    st.sampled_from(["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]),
    st.integers(1, 4),  # the pieces its bytes come in
    st.sampled_from([0.0, 0.01, 0.1, 0.3]),  # seconds before the next connection
)


def _rig(max_connections: int, per_peer: int) -> Rig:
    return Rig(
        config_with(admin={"max_connections": max_connections, "max_connections_per_peer": per_peer}), token=TOKEN,
    )


def _run_flood(rig: Rig, site, flooders, at: int) -> _Socket:
    """Connect ``flooders`` in order, the operator's ``POST /resume`` as the ``at``-th; the operator's socket."""
    clock = rig.clock
    operator = None
    pending: list[tuple[_Socket, list[bytes]]] = []
    for i, flooder in enumerate([*flooders, None]):
        if i == at:
            operator = _connect(site, clock, "127.0.0.1")
            operator.send(RESUME)
        if flooder is None:
            break
        pattern, host, pieces, pause = flooder
        data = PATTERNS[pattern]
        step = max(1, -(-len(data) // pieces))
        parts = [data[j:j + step] for j in range(0, len(data), step)]
        transport = _connect(site, clock, host)
        if parts:
            transport.send(parts.pop(0))
        pending.append((transport, parts))
        # The rest of each connection's bytes come later, a piece per pause.
        for other, rest in pending:
            if rest:
                other.send(rest.pop(0))
        clock.advance(pause)
    assert operator is not None
    return operator


@FLOOD
@given(
    flooders=st.lists(_flooder, min_size=1, max_size=60),
    at=st.integers(0, 60),
    cap=st.integers(1, 12),
    per_peer=st.integers(1, 8),
)
@example(flooders=[("chunked, no chunk", f"127.0.0.{2 + i % 4}", 1, 0.01) for i in range(40)], at=40, cap=8, per_peer=4)
@example(flooders=[("length, no body", f"127.0.0.{2 + i % 4}", 1, 0.0) for i in range(30)], at=30, cap=4, per_peer=4)
@example(flooders=[("whole, and the next a chunked head", "127.0.0.1", 1, 0.0) for _ in range(30)], at=30, cap=4,
         per_peer=4)
def test_under_any_flood_the_operators_whole_request_is_answered(flooders, at, cap, per_peer):
    """Whatever the flood sends, from whatever addresses, an arriving whole ``POST /resume`` with the token is
    answered 200 within the second a whole request may wait for a place."""
    rig = _rig(cap, per_peer)
    site = rig.proxy.admin_app.site()
    operator = _run_flood(rig, site, flooders, min(at, len(flooders)))
    waited = 0.0
    while b"\r\n\r\n" not in operator.value() and waited < OVER_CAPACITY_WAIT + ADMIN_QUICK_SECONDS:
        rig.clock.advance(0.05)
        waited += 0.05
    answer = operator.value()
    assert answer.startswith(b"HTTP/1.1 200 "), (answer[:200], rig.proxy.admin_app.connections)


class _App(Resource):
    """Answers at once, but holds ``/held`` (a whole request being served: never cut)."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.held = []

    def render(self, request):
        if request.path == b"/held":
            self.held.append(request)
            return NOT_DONE_YET
        return b"{}"


def test_a_connection_cut_for_a_whole_request_is_the_longest_silent_of_those_without_a_whole_request():
    """Every place taken: a whole request gets the place of the connection that has made the least progress, the
    one silent longest among those still reading a request (its request gets a 408, and it is closed); a whole
    request being served is never cut, nor one that made progress since."""
    clock = Clock()
    connections = Connections(3, "admin.max_connections", reserved=1, quick_seconds=0.5)
    app = _App()
    site = ProxySite(app, 1000, request_read_timeout=5.0, read_from_accept=True, connections=connections, reactor=clock)
    served = _connect(site, clock, "127.0.0.2")
    served.send(request_bytes(b"GET", b"/held"))
    older = _connect(site, clock, "127.0.0.2")
    older.send(_HEAD)
    clock.advance(0.1)
    newer = _connect(site, clock, "127.0.0.3")
    newer.send(_HEAD)
    clock.advance(0.1)
    older.send(b"1")  # the older one makes progress: the newer is now the longest silent
    also_served = _connect(site, clock, "127.0.0.4")  # past the cap: a whole request let into the room kept
    also_served.send(request_bytes(b"GET", b"/held"))
    assert len(app.held) == 2 and connections.open == 4
    operator = _connect(site, clock, "127.0.0.1")
    operator.send(RESUME)
    clock.advance(0)
    clock.advance(0)
    assert newer.value().startswith(b"HTTP/1.1 408 ") and newer.gone
    assert not older.disconnecting and older.value() == b""
    assert served.value() == b"" and also_served.value() == b"" and not served.disconnecting
    assert operator.value().startswith(b"HTTP/1.1 200 ") and connections.shed == 1
    # The operator's connection closed after its answer: its place is free, and nothing more is cut for the next.
    second = _connect(site, clock, "127.0.0.1")
    second.send(RESUME)
    clock.advance(0)
    assert second.value().startswith(b"HTTP/1.1 200 ") and older.value() == b"" and connections.shed == 1
    assert len(app.held) == 2


def test_what_may_be_cut_for_a_whole_request():
    """Never a whole request being served (parked, or in flight); a connection still reading its request, or
    one whose answer its client has not taken (not all in the socket yet, or the client too slow)."""
    clock = Clock()
    connections = Connections(10, "admin.max_connections", reserved=1, quick_seconds=0.5)
    app = _App()
    site = ProxySite(app, 1000, request_read_timeout=5.0, read_from_accept=True, connections=connections, reactor=clock)
    reading = _connect(site, clock, "127.0.0.2")
    reading.send(_HEAD)
    assert reading.protocol.shed_rank() == 0.0
    clock.advance(1)
    served = _connect(site, clock, "127.0.0.2")
    served.send(request_bytes(b"GET", b"/held"))
    connection = served.protocol
    assert connection.shed_rank() is None
    app.held[0].write(b"part of the answer")
    assert connection.state.value == "writing" and connection.shed_rank() is None

    class Unread:
        """A writer whose socket has not taken everything (a client that reads nothing)."""

        unsent, blocked = True, False

    writer, connection.writer = connection.writer, Unread()
    assert connection.shed_rank() == 1.0
    connection.writer = writer


@pytest.mark.parametrize(
    "payload",
    [_HEAD, _LENGTH_HEAD, _HEAD + b"2\r\n{}\r\n0\r\n"],
    ids=["chunked-no-chunk", "length-no-body", "chunked-no-end"],
)
@pytest_twisted.ensureDeferred
async def test_a_flood_of_heads_that_announce_a_body_does_not_lock_the_operator_out(payload):
    """Connections from five loopback addresses that each send a head announcing a body and no (whole) body,
    and reconnect when closed: with ``admin.token_file`` set, the operator's POST /resume is answered 200, 10/10.

    Before, such a head passed the "whole" test of the room kept for whole requests, and enough of them held
    every place of it for the read timeout: the operator got 503s."""
    token = "flood-test-token"
    stack = await start_stack(reactor, config_with(admin={"max_connections": 16}), token=token)
    port = port_of(stack.admin_url)
    stop = threading.Event()
    floods = [
        in_thread(reactor, _flood, port, 16, stop, f"127.0.0.{i}", payload, timeout=TIMEOUT + 30) for i in range(2, 7)
    ]
    try:
        await wait_for(reactor, lambda: stack.proxy.admin_app.connections.refused > 50, timeout=20)
        statuses = []
        for _ in range(10):
            answer = await treq.post(
                stack.admin_url + "/resume", json={"source": "api"}, persistent=False,
                headers={"Authorization": f"Bearer {token}"},
            ).addTimeout(10, reactor)
            await answer.content()
            statuses.append(answer.code)
        assert statuses == [200] * 10, statuses
    finally:
        stop.set()
        made = [await flood for flood in floods]
        await stack.stop()
    assert sum(made) > 5 * 16, made  # the flood went on: its connections were closed and made again
