"""The request reader keeps today's rules: the same bytes through today's listener and through the reader.

Today the proxy listener reads requests with Twisted's ``HTTPChannel`` and
``yieldproxy/httpserver.py``'s hardening on top of it (``ProxyChannel``).  Each
input of :data:`readercases.RULES` is sent to such a channel, in memory (a
``ProxySite`` on a Clock, a ``StringTransport``), a byte at a time and whole,
and its answer compared with the reader's refusal.  Fed a byte at a time,
today's listener gives the reader's status and message, but where the reader
deliberately answers otherwise (the rule records today's answer, and why);
whole, its words sometimes depend on where the bytes were cut (the rule
records those too), the reader's never do.  Valid requests are read by both and must come out the same (method,
target, version, headers, body, whether the connection stays open).

This stops meaning anything once ``ProxyChannel`` no longer reads requests
with ``HTTPChannel`` (issue 25 replaces it with a connection over the
reader): it then skips; the reader's side of each rule is
``tests/test_edge_reader.py``'s.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource

from readercases import POST, RULES, SERVED, read
from yieldproxy.edge.reader import BodyData, ChunkAnnounced, Closed, EndOfMessage, RequestHead

try:
    from yieldproxy.httpserver import ProxyChannel, ProxySite
except ImportError:  # the listener's channel is gone (issue 25): nothing of today's to compare with
    ProxyChannel = ProxySite = None

today_channel = pytest.mark.skipif(
    ProxyChannel is None or not issubclass(ProxyChannel, HTTPChannel),
    reason="the listener no longer reads with Twisted's HTTPChannel",
)


class _Echo(Resource):
    """Answers every request with what the channel read of it, in JSON."""

    isLeaf = True

    def render(self, request):
        return json.dumps({
            "method": request.method.decode("latin-1"),
            "target": request.uri.decode("latin-1"),
            "version": request.clientproto.decode("latin-1"),
            "headers": [
                [name.decode("latin-1").lower(), [v.decode("latin-1") for v in values]]
                for name, values in request.requestHeaders.getAllRawHeaders()
            ],
            "body": request.content.read().decode("latin-1"),
        }).encode()


class _Transport(StringTransport):
    """A transport that can shut its write side, as TCP's can (the channel lingers then)."""

    def loseWriteConnection(self):
        self.write_closed = True

    def abortConnection(self):
        self.loseConnection()


def today(data: bytes, bytewise: bool = False) -> tuple[list, bool]:
    """What today's listener answers ``data`` sent whole (or a byte at a time, up to its first answer):
    (answers, closing), each answer ``(SERVED, what it read)`` or ``(status, message)``; no answer at all
    is ``[("waits",)]``, an exception out of the channel ``[("raises",)]``."""
    site = ProxySite(_Echo(), 10**9, reactor=Clock())
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    transport = _Transport()
    channel.makeConnection(transport)
    try:
        if bytewise:
            for index in range(len(data)):
                channel.dataReceived(data[index : index + 1])
                if transport.value():
                    break
        else:
            channel.dataReceived(data)
    except Exception:
        # Out of dataReceived, into the reactor: a traceback logged, the connection dropped unanswered.
        return [("raises",)], True
    out = transport.value()
    answers = []
    while out:
        head, _, rest = out.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        if 100 <= status < 200:
            out = rest
            continue
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        size = int(fields.get(b"content-length", b"0"))
        body, out = rest[:size], rest[size:]
        answer = json.loads(body)
        if status == 200:
            answers.append((SERVED, answer))
        else:
            message = answer["error"] if isinstance(answer["error"], str) else answer["error"]["message"]
            answers.append((status, message))
    return answers or [("waits",)], bool(transport.disconnecting)


@today_channel
@pytest.mark.parametrize("rule", RULES, ids=[rule.id for rule in RULES])
def test_today_listener_fed_a_byte_at_a_time_answers_each_rule_as_the_reader_or_the_table_says(rule):
    answers, _ = today(rule.data, bytewise=True)
    expected = rule.today or (rule.status, rule.message)
    assert answers[0][: len(expected)] == expected


@today_channel
@pytest.mark.parametrize("rule", RULES, ids=[rule.id for rule in RULES])
def test_today_listener_fed_whole_answers_each_rule_as_the_table_says(rule):
    answers, _ = today(rule.data)
    expected = rule.whole or rule.today or (rule.status, rule.message)
    assert answers[0][: len(expected)] == expected


# Valid requests, one piece each: both read them alike.  (Not pipelined ones: today's listener refuses a
# request that came in the same piece as one it answers at once, as _Echo does, with a bare-LF 400: its
# check looks for a LF in LineReceiver's buffer, which then still holds whole lines.)
VALID = [
    b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1:11434\r\n\r\n",
    POST + b"Content-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\": true}",
    POST + b"Content-Length: 0\r\n\r\n",
    POST + b"Transfer-Encoding: chunked\r\n\r\n3;name=value\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nX-T: 1\r\n\r\n",
    POST + b"Transfer-Encoding: Chunked\r\n\r\n0\r\n\r\n",
    b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Keep-Alive, Close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nx-a: 2\r\nX-B:\r\nX-C:  \t spaced \t \r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Obs: caf\xc3\xa9 \x01\x7f\r\n\r\n",
    b"OPTIONS /x HTTP/1.1\r\nHost: x\r\n\r\n",
    b"get /?a=%20b HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 000012\r\n\r\nhello world!",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(99)) + b"\r\n",
    b"GET /" + b"q" * 16000 + b" HTTP/1.1\r\n\r\n",
]


def _reader_reads(data: bytes) -> list[tuple[dict, bool]]:
    """The requests the reader reads in ``data``, each as _Echo says it and whether its connection stays open."""
    requests = []
    body = b""
    head = None
    for event in read(data).events:
        if type(event) is RequestHead:
            head, body = event, b""
        elif type(event) is BodyData:
            body += event.data
        elif type(event) in (ChunkAnnounced, Closed):
            pass
        elif type(event) is EndOfMessage:
            assert head is not None
            grouped: dict[str, list[str]] = {}
            for name, value in head.headers:
                grouped.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
            requests.append(({
                "method": head.method.decode("latin-1"),
                "target": head.target.decode("latin-1"),
                "version": head.version.decode("latin-1"),
                "headers": sorted([name, values] for name, values in grouped.items()),
                "body": body.decode("latin-1"),
            }, head.keep_alive))
            if not head.keep_alive:
                break  # the connection closes after its answer: nothing more is read
        else:
            raise AssertionError(f"a valid request refused or cut: {event}")
    return requests


@today_channel
@pytest.mark.parametrize("data", VALID, ids=range(len(VALID)))
def test_valid_requests_are_read_alike_by_today_listener_and_the_reader(data):
    answers, closing = today(data)
    served = []
    for answer in answers:
        assert answer[0] == SERVED, answer
        request = dict(answer[1])
        request["headers"] = sorted(request["headers"])
        served.append(request)
    read_by_reader = _reader_reads(data)
    assert served == [request for request, _ in read_by_reader]
    assert closing == (not read_by_reader[-1][1])
