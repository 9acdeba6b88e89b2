"""The floor: the least a Klein + Twisted pass-through can cost, for the benchmarks.

Not a benchmark itself: ``_common.start_floor`` starts it in its own process,
in front of the same backend as the proxy, so ``latency.py`` can report what
the proxy costs as a ratio of what any Twisted proxy built the obvious way
costs: a Klein app that copies each request to a ``twisted.web.client.Agent``
on a persistent pool and streams the answer back.  No parking, no metrics, no
request log, no retries, no limits, no form parsing (``parsePOSTFormSubmission=False``,
as the proxy); TCP_NODELAY both ways, hop-by-hop headers dropped, the
upstream's ``Content-Length`` kept.  It prints one line::

    ready floor=PORT pid=PID

then serves until SIGTERM.  ``--client lean`` puts :mod:`yieldproxy.edge.h1client`
in place of the Agent (the same Klein front), to show what that client saves.
"""

from __future__ import annotations

import argparse
import os
import sys

HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host",
     b"content-length")
)


def agent_floor(reactor, host: str, port: int):
    """The Klein + Agent pass-through: the ~30 lines the issue asks for."""
    from klein import Klein
    from twisted.internet.defer import Deferred, succeed
    from twisted.internet.endpoints import TCP4ClientEndpoint
    from twisted.internet.protocol import Protocol
    from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
    from twisted.web.http import PotentialDataLoss
    from twisted.web.http_headers import Headers

    class NoDelayEndpoint:
        def __init__(self, wrapped):
            self.wrapped = wrapped

        def connect(self, factory):
            def nodelay(protocol):
                protocol.transport.setTcpNoDelay(True)
                return protocol
            return self.wrapped.connect(factory).addCallback(nodelay)

    class Fixed:
        def endpointForURI(self, uri):
            return endpoint

    class Body:
        def __init__(self, data):
            self.data, self.length = data, len(data)

        def startProducing(self, consumer):
            consumer.write(self.data)
            return succeed(None)

        def stopProducing(self):
            pass

    class Relay(Protocol):
        def __init__(self, request, done):
            self.request, self.done = request, done

        def dataReceived(self, data):
            self.request.write(data)

        def connectionLost(self, reason):
            self.done.callback(None) if reason.check(ResponseDone, PotentialDataLoss) else self.done.errback(reason)

    endpoint = NoDelayEndpoint(TCP4ClientEndpoint(reactor, host, port))
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 64
    agent = Agent.usingEndpointFactory(reactor, Fixed(), pool=pool)
    base = b"http://%s:%d" % (host.encode(), port)
    app = Klein()

    @app.route("/", branch=True, strict_slashes=False)
    def forward(request):
        headers = Headers()
        for name, values in request.requestHeaders.getAllRawHeaders():
            if name.lower() not in HOP_BY_HOP:
                headers.setRawHeaders(name, values)
        body = request.content.read()
        d = agent.request(request.method, base + request.uri, headers, Body(body) if body else None)

        def relay(response):
            request.setResponseCode(response.code, response.phrase)
            for name, values in response.headers.getAllRawHeaders():
                if name.lower() not in HOP_BY_HOP:
                    request.responseHeaders.setRawHeaders(name, values)
            if isinstance(response.length, int):
                request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % response.length])
            done = Deferred()
            response.deliverBody(Relay(request, done))
            return done

        return d.addCallback(relay)

    return app, pool.closeCachedConnections


def lean_floor(reactor, host: str, port: int):
    """The same Klein front, forwarding with :mod:`yieldproxy.edge.h1client` instead of the Agent."""
    from klein import Klein

    from yieldproxy.edge.h1client import H1Pool

    response_skip = HOP_BY_HOP - {b"content-length"}  # the raw Content-Length is relayed as it is

    class Relay:
        __slots__ = ("request",)

        def __init__(self, request):
            self.request = request

        def response_started(self, response):
            request = self.request
            request.setResponseCode(response.code, response.phrase)
            headers = request.responseHeaders
            seen = set()  # the upstream's Server and Date replace the site's own; repeats are kept
            for name, value in response.headers:
                lower = name.lower()
                if lower in response_skip:
                    continue
                if lower in seen:
                    headers.addRawHeader(name, value)
                else:
                    seen.add(lower)
                    headers.setRawHeaders(name, [value])

        def body_received(self, data):
            self.request.write(data)

    pool = H1Pool(reactor, host, port, max_connections=64)
    app = Klein()

    @app.route("/", branch=True, strict_slashes=False)
    def forward(request):
        headers = [
            (name, value)
            for name, values in request.requestHeaders.getAllRawHeaders()
            if name.lower() not in HOP_BY_HOP
            for value in values
        ]
        d = pool.request(request.method, request.uri, headers, request.content.read(), Relay(request))
        return d.addCallback(lambda response: None)

    return app, pool.close


class _NoDelayChannel:
    """Mixed into the site's channel class: TCP_NODELAY on every client connection."""

    def connectionMade(self):
        super().connectionMade()
        self.transport.setTcpNoDelay(True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--upstream-port", type=int, required=True, help="the backend on 127.0.0.1")
    p.add_argument("--client", choices=("agent", "lean"), default="agent",
                   help="agent: twisted.web.client.Agent (the floor); lean: yieldproxy.edge.h1client")
    args = p.parse_args(argv)

    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor
    from twisted.web.http import HTTPChannel
    from twisted.web.server import Site

    build = agent_floor if args.client == "agent" else lean_floor
    app, close = build(reactor, "127.0.0.1", args.upstream_port)

    class FloorSite(Site):
        protocol = type("NoDelayChannel", (_NoDelayChannel, HTTPChannel), {})
        noisy = False

        def log(self, request):
            pass  # no access log: the floor is the pass-through alone

    # No form parsing: a pass-through forwards bodies as they are (the proxy's site does the same).
    site = FloorSite(app.resource(), reactor=reactor, parsePOSTFormSubmission=False)
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    print(f"ready floor={port.getHost().port} pid={os.getpid()} client={args.client}", flush=True)
    reactor.addSystemEventTrigger("before", "shutdown", close)
    reactor.run()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
