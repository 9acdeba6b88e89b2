"""Nagle off: one helper, :func:`yieldproxy.edge.tcp.set_no_delay`, on every connection that carries HTTP."""

from __future__ import annotations

import socket

import pytest_twisted
from twisted.internet.testing import StringTransport
from twisted.web.resource import Resource

from yieldproxy.edge.h1client import H1Connection, H1Pool
from yieldproxy.edge.site import ProxySite
from yieldproxy.edge.tcp import set_no_delay


class _Recording(StringTransport):
    def __init__(self, fails: bool = False):
        super().__init__()
        self.no_delay: list[bool] = []
        self._fails = fails

    def setTcpNoDelay(self, enabled: bool) -> None:
        if self._fails:
            raise OSError("socket already closed")
        self.no_delay.append(enabled)


def test_set_no_delay_on_tcp_only_and_never_raising():
    tcp = _Recording()
    set_no_delay(tcp)
    assert tcp.no_delay == [True]
    set_no_delay(StringTransport())  # no setTcpNoDelay (unix, in memory): left alone
    set_no_delay(None)
    set_no_delay(_Recording(fails=True))  # closed meanwhile: no error


@pytest_twisted.ensureDeferred
async def test_nagle_is_off_on_both_ends_of_a_real_hop():
    """The proxy's listener and its upstream client, on real sockets: each side's socket has TCP_NODELAY."""
    from twisted.internet import reactor

    class Ok(Resource):
        isLeaf = True

        def render(self, request):
            return b"ok"

    site = ProxySite(Ok(), 1000, reactor=reactor)
    accepted = []
    build = site.buildProtocol
    site.buildProtocol = lambda addr: accepted.append(build(addr)) or accepted[-1]
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    pool = H1Pool(reactor, "127.0.0.1", port.getHost().port)
    try:
        response = await pool.request(b"GET", b"/", timeout=10.0).addTimeout(20, reactor)
        assert response.code == 200
        (channel,) = accepted
        assert channel.transport.getHandle().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        (conn,) = pool._idle
        assert conn.transport.getHandle().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        await pool.close()
        await port.stopListening()


def test_the_upstream_client_turns_nagle_off_on_each_connection():
    transport = _Recording()
    H1Connection(pool=None).makeConnection(transport)
    assert transport.no_delay == [True]
