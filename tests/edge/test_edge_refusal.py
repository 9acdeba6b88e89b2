"""Every answer the edge gives without the app is the same answer (yieldproxy/edge/refusal.py).

The edge refuses in many places: the reader's rules, in a head or in a body;
the read deadline; a stalled body cut for another; a connection cut for a
whole request; the requests the app never sees (CONNECT, a bad Host, a bad
path, a body too large or finding the receiving budget used up); a
connection past the cap.  Each case below drives one of them, in memory on
a Clock, for every method, route and HTTP version, and checks the answer
against the one rule: the route's JSON shape, the request's version once its
line is read, no body after HEAD, a Content-Length that is the body's,
Retry-After exactly on the 503s, ``Connection: close`` exactly when the
connection closes.
"""

from __future__ import annotations

import json
from typing import Callable

import pytest
from hypothesis import example, given, settings, strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.web.resource import Resource

from test_edge_connection import _Transport as ShuttingTransport
from yieldproxy.edge.capacity import OVER_CAPACITY_RETRY_AFTER, Connections, OverCapacity
from yieldproxy.edge.hosts import HostPolicy
from yieldproxy.edge.request import RECEIVING_RETRY_AFTER
from yieldproxy.edge.site import ProxySite
from yieldproxy.errors import listener_error_body

PEER = IPv4Address("TCP", "127.0.0.1", 50000)
METHODS = (b"GET", b"POST", b"HEAD")
TARGETS = (b"/api/embed", b"/v1/embeddings", b"/api/tags?x=1", b"/v1/models?y")
VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")


class _Ok(Resource):
    isLeaf = True

    def render(self, request):
        return b"ok"


class _Transport(ShuttingTransport):
    @property
    def closing(self) -> bool:
        return self.write_closed or self.disconnecting


def _site(clock: Clock, connections: Connections | None = None, **options) -> ProxySite:
    return ProxySite(
        _Ok(), options.pop("max_body_bytes", 1000), reactor=clock, connections=connections,
        error_body=listener_error_body, **options,
    )


def _connect(site: ProxySite) -> _Transport:
    transport = _Transport(peerAddress=PEER)
    transport.protocol = site.buildProtocol(PEER)
    transport.protocol.makeConnection(transport)
    return transport


def _line(method: bytes, target: bytes, version: bytes) -> bytes:
    return b"%s %s %s\r\nHost: localhost\r\n" % (method, target, version)


# Each case: (method, target, version) -> (the transport that was answered, the status, the Retry-After due,
# whether its request line was read).  A case that needs a body sends one whatever the method.


def reader_head(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock))
    transport.protocol.dataReceived(_line(m, t, v) + b"Transfer-Encoding: identity\r\n\r\n")
    return transport, 400, None, True


def reader_body(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock))
    transport.protocol.dataReceived(_line(m, t, v) + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
    return transport, 400, None, True


def read_deadline_in_body(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock, request_read_timeout=5))
    transport.protocol.dataReceived(_line(m, t, v) + b"Content-Length: 10\r\n\r\nabc")
    clock.advance(5)
    return transport, 408, None, True


def read_deadline_before_a_line(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock, request_read_timeout=5))
    transport.protocol.dataReceived(m + b" " + t)
    clock.advance(5)
    return transport, 408, None, False


def stalled_body_cut(m, t, v):
    clock = Clock()
    connections = Connections(10, max_receiving_bytes=100)
    stalled = _connect(_site(clock, connections))
    stalled.protocol.dataReceived(_line(m, t, v) + b"Content-Length: 200\r\n\r\n" + b"x" * 90)
    clock.advance(5)
    arriving = _connect(_site(clock, connections))
    arriving.protocol.dataReceived(_line(b"POST", b"/api/embed", b"HTTP/1.1") + b"Content-Length: 50\r\n\r\n" + b"x" * 50)
    return stalled, 408, None, True


def shed_for_a_whole_request(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock, Connections(10)))
    transport.protocol.dataReceived(_line(m, t, v) + b"Content-Length: 10\r\n\r\nabc")
    transport.protocol.shed()
    return transport, 408, None, True


def _whole(site_options, extra=b""):
    def case(m, t, v):
        clock = Clock()
        transport = _connect(_site(clock, **site_options))
        transport.protocol.dataReceived(_line(m, t, v).replace(b"Host: localhost\r\n", extra) + b"\r\n")
        return transport, 400, None, True
    return case


bad_host = _whole({}, b"Host: \xff\r\n")
two_hosts = _whole({}, b"Host: a\r\nHost: b\r\n")


def bad_path(m, t, v):
    return _whole({})(m, t.replace(b"?", b"%ff?") if b"?" in t else t + b"%ff", v)


def foreign_host(m, t, v):
    transport, _, _, read = _whole({"host_policy": HostPolicy.from_config("proxy.allowed_hosts", ["localhost"])},
                                   b"Host: evil.example\r\n")(m, t, v)
    return transport, 403, None, read


def connect_method(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock))
    transport.protocol.dataReceived(_line(b"CONNECT", t, v) + b"\r\n")
    return transport, 405, None, True


def body_too_large(m, t, v):
    clock = Clock()
    transport = _connect(_site(clock, max_body_bytes=10))
    transport.protocol.dataReceived(_line(m, t, v) + b"Content-Length: 20\r\n\r\n")
    return transport, 413, None, True


def receiving_full(m, t, v):
    clock = Clock()
    connections = Connections(10, max_receiving_bytes=100)
    other = _connect(_site(clock, connections))
    other.protocol.dataReceived(_line(b"POST", b"/api/embed", b"HTTP/1.1") + b"Content-Length: 200\r\n\r\n" + b"x" * 90)
    transport = _connect(_site(clock, connections))
    transport.protocol.dataReceived(_line(m, t, v) + b"Content-Length: 200\r\n\r\n" + b"x" * 50)
    return transport, 503, RECEIVING_RETRY_AFTER, True


def _over_capacity(prefix: bytes, promote: bool):
    def case(m, t, v):
        clock = Clock()
        connections = Connections(1, reserved=0 if not promote else 1, quick_seconds=0.5 if promote else None)
        for _ in range(3):
            holder = Protocol()
            connections.opened(holder)
        refused = OverCapacity(connections, clock, (lambda address: None) if promote else None, listener_error_body)
        transport = _Transport(peerAddress=PEER)
        transport.protocol = refused
        refused.makeConnection(transport)
        # Promoted or not, a request that breaks the reader's rules is refused (a bare LF ends its head).
        refused.dataReceived(prefix + _line(m, t, v) + b"X: 1\n")
        clock.advance(1)
        return transport, 503, OVER_CAPACITY_RETRY_AFTER, True
    return case


CASES: dict[str, Callable] = {
    "reader_head": reader_head,
    "reader_body": reader_body,
    "read_deadline_in_body": read_deadline_in_body,
    "read_deadline_before_a_line": read_deadline_before_a_line,
    "stalled_body_cut": stalled_body_cut,
    "shed_for_a_whole_request": shed_for_a_whole_request,
    "bad_host": bad_host,
    "two_hosts": two_hosts,
    "bad_path": bad_path,
    "foreign_host": foreign_host,
    "connect_method": connect_method,
    "body_too_large": body_too_large,
    "receiving_full": receiving_full,
    "over_capacity": _over_capacity(b"", promote=False),
    "over_capacity_after_an_empty_line": _over_capacity(b"\r\n", promote=False),
    "over_capacity_promoted_but_malformed": _over_capacity(b"", promote=True),
}


def _parse(out: bytes) -> tuple[bytes, int, dict[bytes, list[bytes]], bytes]:
    head, sep, body = out.partition(b"\r\n\r\n")
    assert sep, out
    lines = head.split(b"\r\n")
    version, status, _ = lines[0].split(b" ", 2)
    headers: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    return version, int(status), headers, body


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_refusal_of_the_edge_is_answered_by_the_one_rule(name):
    for method in METHODS:
        for target in TARGETS:
            for version in VERSIONS:
                case = f"{name}: {method.decode()} {target.decode()} {version.decode()}"
                transport, status, retry_after, line_read = CASES[name](method, target, version)
                got_version, got_status, headers, body = _parse(transport.value())
                assert got_status == status, case
                assert got_version == (version if line_read else b"HTTP/1.1"), case
                assert headers[b"content-type"] == [b"application/json; charset=utf-8"], case
                assert headers.get(b"retry-after") == ([b"%d" % retry_after] if retry_after else None), case
                assert (b"connection" in headers) == transport.closing, case
                if transport.closing:
                    assert headers[b"connection"] == [b"close"], case
                # A HEAD is answered with the headers alone (RFC 9110 9.3.2); a refusal that came before
                # its method was read cannot know it.
                if method == b"HEAD" and line_read and name != "connect_method":
                    assert body == b"" and int(headers[b"content-length"][0]) > 0, case
                    continue
                assert headers[b"content-length"] == [b"%d" % len(body)], case
                error = json.loads(body)["error"]
                if line_read and target.startswith(b"/v1/"):
                    assert set(error) == {"message", "type", "code"} and error["message"], case
                else:
                    assert isinstance(error, str) and error, case


def test_a_refused_request_keeps_a_keep_alive_connection_when_its_body_was_not_left_unread():
    """A request the app never sees but that was read whole (a bad Host, CONNECT) leaves an HTTP/1.1
    connection open for the next; one whose body was left unread, or that broke the reader's rules, closes it."""
    for name, keeps in (("bad_host", True), ("connect_method", True), ("body_too_large", False), ("reader_head", False)):
        transport, *_ = CASES[name](b"GET", b"/api/tags", b"HTTP/1.1")
        assert transport.closing is not keeps, name


class _Hosts(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def render(self, request):
        self.seen.append((request.host_is_utf8, request.requestHeaders.getRawHeaders(b"host", [])))
        return b"ok"


@given(hosts=st.lists(st.lists(st.binary(max_size=8), max_size=2), min_size=1, max_size=4))
@example(hosts=[[b"localhost"], [b"localhost"], [b"\xff"], [b"localhost"]])
@example(hosts=[[b"localhost"], [b"caf\xc3\xa9"], [b"a", b"b"]])
@settings(max_examples=300, deadline=None)
def test_every_request_the_resource_sees_has_the_utf8_host_it_says_it_has(hosts):
    """The listener's request says its Host is UTF-8 (``host_is_utf8``: the proxy's Klein entry then does not
    read the header, proxy/resource.py): every one its resource sees, one after another on a connection
    (whose last Host passed is kept), has one Host at most, and it is UTF-8."""
    resource = _Hosts()
    site = ProxySite(resource, 1000, reactor=Clock(), error_body=listener_error_body)
    transport = _connect(site)
    for request_hosts in hosts:
        head = b"".join(b"Host: %s\r\n" % h for h in request_hosts if not set(h) & set(b"\r\n"))
        transport.protocol.dataReceived(b"GET /api/tags HTTP/1.1\r\n" + head + b"\r\n")
    for says, seen in resource.seen:
        assert says is True
        assert len(seen) <= 1
        for host in seen:
            host.decode("utf-8")
