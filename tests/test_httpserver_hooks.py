"""The private Twisted hooks the HTTP hardening relies on are still called, each by the request that needs it.

``httpserver.ProxyChannel`` overrides or reads parts of
:class:`twisted.web.http.HTTPChannel` that are not public API (its docstring
lists them), ``forward.Attempt`` reads the channel's ``_waitingForTransport`` and
``proxyresource.py`` the request's ``_disconnected``.  If a Twisted release renames one, an override is simply never
called again and the hardening it carries silently stops; this file fails
loudly instead, naming the hook.  Each case feeds a channel, in memory, the
request that must go through the hook, and checks both that the hook ran and
that the answer is the one the hook exists for.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.web import http
from twisted.web.resource import Resource

from yieldproxy.httpserver import ProxyChannel, ProxySite

#: The HTTPChannel methods ProxyChannel overrides that Twisted does not document.
PRIVATE_OVERRIDES = (
    "_maybeChooseTransferDecoder",
    "_failChooseTransferDecoder",
    "_respondToBadRequestAndDisconnect",
    "_finishRequestBody",
)
#: The HTTPChannel attributes ProxyChannel reads that Twisted does not document.
PRIVATE_ATTRIBUTES = ("_receivedHeaderSize", "_receivedHeaderCount", "_handlingRequest", "_path", "_networkProducer")


class _Ok(Resource):
    isLeaf = True

    def render(self, request):
        return b"ok"


class _Transport(StringTransport):
    """A transport that can shut its write side, as TCP's can (the channel lingers then)."""

    def loseWriteConnection(self):
        self.write_closed = True

    def abortConnection(self):
        self.loseConnection()


class _Probe:
    """A channel in memory that records which private hooks it went through, and what it wrote."""

    def __init__(self, **site_options):
        calls = self.calls = []
        self.reads: set[str] = set()

        def spy(name):
            def hook(channel, *args, **kwargs):
                calls.append(name)
                return getattr(ProxyChannel, name)(channel, *args, **kwargs)

            return hook

        reads = self.reads

        class Spy(ProxyChannel):
            def __getattribute__(self, name):
                if name in PRIVATE_ATTRIBUTES:
                    reads.add(name)
                return super().__getattribute__(name)

        for name in PRIVATE_OVERRIDES:
            setattr(Spy, name, spy(name))
        self.clock = Clock()
        site = ProxySite(_Ok(), site_options.pop("max_body_bytes", 1000), reactor=self.clock, **site_options)
        site.protocol = Spy
        self.channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
        self.transport = _Transport()
        self.channel.makeConnection(self.transport)

    def send(self, raw: bytes) -> None:
        self.channel.dataReceived(raw)

    def answer(self) -> tuple[int, dict]:
        head, _, body = self.transport.value().partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), json.loads(body)

    def went_through(self, *names: str) -> None:
        for name in names:
            seen = name in self.calls or name in self.reads
            assert seen, (
                f"Twisted's HTTPChannel no longer goes through {name}: the hardening in "
                f"yieldproxy/httpserver.py that relies on it is dead (see its module docstring)"
            )


def test_twisted_still_has_every_private_name_the_channel_uses():
    for name in PRIVATE_OVERRIDES:
        assert callable(getattr(http.HTTPChannel, name, None)), f"HTTPChannel.{name} is gone"
    channel = http.HTTPChannel()
    channel.makeConnection(StringTransport())
    for name in ("_receivedHeaderSize", "_receivedHeaderCount", "_handlingRequest", "_networkProducer"):
        assert hasattr(channel, name), f"HTTPChannel has no {name} any more"


def test_a_transfer_coding_other_than_chunked_goes_through_the_decoder_hooks():
    probe = _Probe()
    probe.send(b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: identity\r\n\r\n")
    probe.went_through("_maybeChooseTransferDecoder", "_failChooseTransferDecoder", "_respondToBadRequestAndDisconnect")
    status, body = probe.answer()
    assert status == 400 and "Transfer-Encoding must be chunked" in body["error"]["message"]
    # The OpenAI shape: the request line's path was read from the channel.
    probe.went_through("_path")


def test_conflicting_lengths_go_through_twisteds_own_failure_hook():
    probe = _Probe()
    probe.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
    probe.went_through("_failChooseTransferDecoder", "_respondToBadRequestAndDisconnect")
    status, body = probe.answer()
    assert status == 400 and body == {"error": "invalid or conflicting Content-Length / Transfer-Encoding"}


@pytest.mark.parametrize(
    "headers, hook",
    [
        ([b"X-Big: " + b"a" * 8000] * 3, "_receivedHeaderSize"),
        ([b"X-Many-%d: 1" % i for i in range(120)], "_receivedHeaderCount"),
    ],
)
def test_too_many_or_too_large_headers_are_measured_with_the_channels_own_counts(headers, hook):
    probe = _Probe()
    probe.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n")
    probe.went_through(hook)
    status, body = probe.answer()
    assert status == 431 and body["error"].startswith(("request headers larger", "more than"))


def test_the_end_of_a_refused_chunked_body_goes_through_finish_request_body():
    probe = _Probe(max_body_bytes=10)
    probe.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
    # The chunk past the limit and the body's end in one read: the decoder ends the body
    # while the channel is already refusing it.
    probe.send(b"14\r\n" + b"x" * 20 + b"\r\n0\r\n\r\n")
    probe.went_through("_finishRequestBody")
    status, _ = probe.answer()
    assert status == 413
    # The refusal lingers (write side shut, the rest read and dropped) through the channel's producer.
    probe.went_through("_networkProducer")
    assert probe.transport.write_closed


def test_a_slow_request_is_timed_with_the_channels_handling_flag():
    probe = _Probe()
    probe.send(b"GET /api/tags HTTP/1.1\r\n")
    probe.clock.advance(30)
    probe.went_through("_handlingRequest")
    status, body = probe.answer()
    assert status == 408 and "not received in full" in body["error"]


def test_a_full_client_transport_shows_in_the_channels_waiting_flag():
    """forward.Attempt reads ``HTTPChannel._waitingForTransport`` to know the client's transport is full.

    The relay then registers itself as the client's producer and counts what
    waits in memory against the client buffer bounds; were the flag gone or
    never set, a slow client would be buffered without bound, silently.
    """
    probe = _Probe()
    probe.send(b"GET /api/tags HTTP/1.1\r\nHost: localhost\r\n\r\n")
    channel = probe.channel
    assert getattr(channel, "_waitingForTransport", None) is False, "HTTPChannel has no _waitingForTransport any more"
    # What a TCP transport does when its send buffer fills, and when it drains.
    channel.pauseProducing()
    assert channel._waitingForTransport is True, "a paused HTTPChannel no longer sets _waitingForTransport"
    channel.resumeProducing()
    assert channel._waitingForTransport is False


def test_a_request_still_says_when_its_client_went_away():
    """proxyresource.py reads ``Request._disconnected`` to tell a handler's end from a client's leaving."""
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure
    from twisted.web.test.requesthelper import DummyChannel

    request = http.Request(DummyChannel())
    assert request._disconnected is False, "twisted.web.http.Request._disconnected is gone: see proxyresource.py"
    request.connectionLost(Failure(ConnectionDone()))
    assert request._disconnected is True


def test_the_strict_chunked_decoder_still_replaces_twisteds_and_reads_its_state():
    """StrictChunkedDecoder subclasses Twisted's private ``_ChunkedTransferDecoder`` (its states and ``_buffer``).

    If Twisted stops building a ``_ChunkedTransferDecoder`` for a chunked
    request, or renames its state methods, a bare LF or an endless chunk size
    would again be waited on until the read timeout.
    """
    from yieldproxy.httpserver import StrictChunkedDecoder

    for name in ("_dataReceived_CHUNK_LENGTH", "_dataReceived_TRAILER"):
        assert callable(getattr(http._ChunkedTransferDecoder, name, None)), f"_ChunkedTransferDecoder.{name} is gone"
    probe = _Probe()
    probe.send(b"POST /api/embed HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert type(probe.channel._transferDecoder) is StrictChunkedDecoder
    probe.send(b"3\r\nabc\r\n0\n\n")
    status, body = probe.answer()
    assert status == 400 and "bare LF" in body["error"]


def test_a_bare_lf_in_a_head_is_seen_in_the_line_receivers_buffer():
    """ProxyChannel reads ``LineReceiver._buffer`` (the unfinished line) to refuse a head in bare LFs."""
    probe = _Probe()
    probe.send(b"GET /api/tags HTTP/1.1\nHost: localhost\n\n")
    status, body = probe.answer()
    assert status == 400 and "bare LF" in body["error"]


def test_a_listening_port_can_be_paused_and_its_accept_batch_bounded():
    """Connections pauses its ports (``stopReading``) and bounds ``tcp.Port.numberAccepts`` while refusing a flood."""
    from twisted.internet import reactor, tcp
    from twisted.internet.protocol import Factory

    port = reactor.listenTCP(0, Factory(), interface="127.0.0.1")
    try:
        assert isinstance(port, tcp.Port)
        assert isinstance(port.numberAccepts, int), "twisted.internet.tcp.Port.numberAccepts is gone: see Connections"
        assert callable(port.stopReading) and callable(port.startReading)
    finally:
        port.stopListening()
