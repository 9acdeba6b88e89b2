"""The whole proxy in memory on one Clock: its own two sites in front, a resource behind, no socket.

:class:`Rig` builds the proxy with ``service.build`` on a
:class:`~twisted.internet.task.Clock` and connects callers, in memory, to the
very sites its listeners would serve (``proxy_app.site()`` and
``admin_app.site()``: the hardened ``ProxySite`` with its body limit, Host
policy, connection caps and timers, all on the test's clock).  The upstream
is the simulated Ollama's resource, or a test's own, behind a plain ``Site``.
Time moves only when the test moves it, so "nothing happened" is a fact about
a clock that was advanced, not a guess after a sleep.

:meth:`Rig.raw` writes exact bytes on such a connection (the listener's HTTP
parser sees them as a socket would deliver them), and the upstream may be
``rawhttp.RecordingBackend``, connected in memory too, which keeps the exact
bytes the proxy sent.

A pool (``members=``, as :func:`helpers.start_pool_stack` takes them) is
built on a :class:`~twisted.internet.testing.MemoryReactorClock`: every
member's clients (requests and control calls: health, outage probes, model
lists, twin checks) connect through it, and :meth:`Rig.turn` connects each
such connection in memory to the server at its port (a port nobody serves
is refused).  A single upstream with ``watchers`` gets the same for its
control calls.

What is about the wire (raw framing over TCP, slow or vanishing TCP peers,
real clients and processes) stays in the real-socket tests.
"""

from __future__ import annotations

import json as jsonlib
from typing import Any
from urllib.parse import urlsplit

import attrs
import treq
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.web.client import Agent
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Site
from zope.interface import implementer

from helpers import with_test_models
from yieldproxy.config import Config, MemberConfig
from yieldproxy.service import build
from yieldproxy.tools.sim import SimOllama
from yieldproxy.upstream.attempt import Upstream
from yieldproxy.upstream.translation import BackendError, client_response, parse_request

#: A bound on the rounds of one :meth:`Rig.turn`: more means something loops without end.
_MAX_ROUNDS = 10_000


class _Endpoints:
    """Every URI on the agent's memory reactor: its ``tcpClients`` list is where :class:`SiteAgent` picks them up."""

    def __init__(self, memory: MemoryReactorClock):
        self._memory = memory

    def endpointForURI(self, uri):
        return TCP4ClientEndpoint(self._memory, uri.host, uri.port)


@implementer(IStreamClientEndpoint)
class SiteAgent:
    """An ``IAgent`` whose every connection is an in-memory one to ``site``, pumped by :meth:`flush`.

    As ``treq.testing.RequestTraversalAgent``, but to a given ``Site`` (a
    listener's own ``ProxySite``, with its limits and timers) instead of a
    plain one around a resource, and :meth:`flush` says whether anything
    moved.  The HTTP client runs on a memory reactor of its own; the
    connections are pumped on ``clock``, so zero-delay calls run between
    the bytes.
    """

    def __init__(self, site, clock: Clock):
        self._site = site
        self._clock = clock
        self._memory = MemoryReactorClock()
        self._agent = Agent.usingEndpointFactory(self._memory, _Endpoints(self._memory))
        self._pumps: list[iosim.IOPump] = []
        self._next_port = 40000

    def request(self, method, uri, headers=None, bodyProducer=None) -> Deferred:
        d = self._agent.request(method, uri, headers, bodyProducer)
        while self._memory.tcpClients:
            _host, port, factory, _timeout, _bind = self._memory.tcpClients.pop(0)
            self._connect(factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", port)), port)
        return d

    def connect(self, factory) -> Deferred:
        """As an ``IStreamClientEndpoint``: a protocol of ``factory`` connected in memory to the site."""
        client = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 11434))
        self._connect(client, 11434)
        return succeed(client)

    def raw(self, site=None) -> "RawPeer":
        """A connection to ``site`` (by default this agent's) for a test that writes the bytes itself."""
        peer = RawPeer()
        self._connect(peer, 11434, site)
        return peer

    def _connect(self, client, port: int, site=None) -> None:
        self._next_port += 1
        client_address = IPv4Address("TCP", "127.0.0.1", self._next_port)
        server_address = IPv4Address("TCP", "127.0.0.1", port)
        server = (site or self._site).buildProtocol(client_address)
        if server is None:
            server = _Refused()
        server_transport = iosim.FakeTransport(server, isServer=True, hostAddress=server_address, peerAddress=client_address)
        client_transport = iosim.FakeTransport(client, isServer=False, hostAddress=client_address, peerAddress=server_address)
        self._pumps.append(
            iosim.connect(server, server_transport, client, client_transport, greet=False, clock=self._clock)
        )

    def flush(self) -> bool:
        """Deliver what the connections hold, both ways, and their closes; True if anything moved."""
        moved = False
        for pump in list(self._pumps):
            if pump.flush():
                moved = True
            if pump.clientIO.disconnected and pump.serverIO.disconnected:
                self._pumps.remove(pump)
        return moved


class _Refused(Protocol):
    """Where a factory's ``buildProtocol`` returned None: the connection is closed at once, as Twisted does."""

    def connectionMade(self) -> None:
        self.transport.loseConnection()


class RawPeer(Protocol):
    """The client end of a raw in-memory connection: the bytes a test writes, what came back, and the close."""

    def __init__(self):
        self.data = b""
        self.closed = False

    def send(self, data: bytes) -> None:
        self.transport.write(data)

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason) -> None:
        self.closed = True


class MemoryUpstream(Upstream):
    """The proxy's upstream client (:class:`yieldproxy.upstream.attempt.Upstream`) reaching ``upstream`` in memory.

    ``upstream`` is a resource (served by a plain ``Site``) or a protocol
    factory of its own (``rawhttp.RecordingBackend``, which keeps the exact
    bytes the proxy sent).  Its connections are made by a :class:`SiteAgent`
    (as an endpoint), so that :meth:`Rig.turn` knows when the upstream side
    has settled.
    """

    def __init__(self, upstream, clock: Clock):
        factory = Site(upstream, reactor=MemoryReactorClock()) if IResource.providedBy(upstream) else upstream
        self.wire = SiteAgent(factory, clock)
        super().__init__(clock, "http://upstream.invalid", idle_timeout=None, endpoint=self.wire)

    def flush(self) -> bool:
        return self.wire.flush()


class EmbedResource(Resource):
    """An embedding server in memory whose vectors come from a test's fake, ``backend.embed(request, model)``.

    It answers Ollama's ``/api/embed`` and ``/api/embeddings`` and OpenAI's
    ``/v1/embeddings`` (or ``/embeddings``, under an OpenAI base URL) in each
    route's shape; the fake's :class:`~yieldproxy.upstream.translation.BackendError` is
    a 500, and an answer the fake holds back is held back on the wire too.
    """

    isLeaf = True

    def __init__(self, backend):
        super().__init__()
        self._backend = backend

    def render_POST(self, request):
        path = request.path.decode("latin-1")
        if not path.startswith(("/api/", "/v1/")):
            path = "/v1" + path  # an OpenAI base URL's route
        wanted = parse_request(path, request.content.read())
        d = Deferred.fromCoroutine(self._backend.embed(wanted, wanted.model))

        def answer(code: int, body: bytes) -> None:
            if request._disconnected:
                return
            request.setResponseCode(code)
            request.setHeader(b"content-type", b"application/json")
            request.write(body)
            request.finish()

        def failed(failure: Failure) -> None:
            failure.trap(BackendError)
            answer(500, jsonlib.dumps({"error": failure.value.detail}).encode())

        d.addCallback(lambda result: answer(200, client_response(wanted, result))).addErrback(failed)
        return NOT_DONE_YET


@implementer(IBodyProducer)
class BytesProducer:
    """A request body already in memory, written in one go (``FileBodyProducer`` would
    cooperate through the global reactor's Cooperator, off the test's clock)."""

    def __init__(self, body: bytes):
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer) -> Deferred:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


@attrs.frozen
class Answer:
    """One complete HTTP answer as a caller saw it."""

    code: int
    headers: Headers
    body: bytes
    #: The length its head announced (``Content-Length``, which the client keeps out of ``headers``),
    #: or ``twisted.web.iweb.UNKNOWN_LENGTH``.
    length: Any = None

    def json(self) -> Any:
        return jsonlib.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8")

    def header(self, name: str) -> list[str] | None:
        """Every value of header ``name``, or None when it is absent (as ``getRawHeaders``)."""
        values = self.headers.getRawHeaders(name.encode("ascii"))
        return None if values is None else [v.decode("latin-1") for v in values]


class Rig:
    """A proxy built by ``service.build`` on a Clock, its two sites and its upstream driven in memory.

    :param config: the proxy's config; without ``watchers``,
        ``upstream.detect_outages`` is turned off, as :func:`helpers.start_stack` does.
    :param upstream: a resource, or a protocol factory such as
        ``rawhttp.RecordingBackend``, to use as the upstream instead of a new
        :class:`~yieldproxy.tools.sim.SimOllama` (then :attr:`sim` is None).
    :param reactor: the clock, a :class:`~twisted.internet.testing.MemoryReactorClock`
        to start and stop ``proxy.service`` itself (its listeners listen on it);
        a new Clock by default (a MemoryReactorClock with ``watchers`` or ``members``).
    :param holds: a :class:`~yieldproxy.lifecycle.holdstore.HoldStore` that keeps the holds across rigs (a restart).
    :param wall: the wall clock (``build``'s ``wall``): the Clock itself by default, a stepping one to test steps.
    :param members: a pool instead of one upstream: dicts of ``[[upstreams]]``
        keys, each with a ``name``; a member's own sim options under its
        ``sim`` key (merged over ``sim_options``), or its own resource under
        ``upstream``.  Their sims are :attr:`sims`, by name.
    :param sim_options: the SimOllama's options (``latency``, ``chunk_delay``...).
    """

    proxy_url = "http://127.0.0.1:11434"
    admin_url = "http://127.0.0.1:11436"

    def __init__(
        self, config: Config | None = None, upstream=None, token=None, read_token=None, watchers: bool = False,
        reactor: Clock | None = None, holds=None, members=None, wall=None, **sim_options,
    ):
        if reactor is None:
            reactor = MemoryReactorClock() if watchers or members else Clock()
        self.clock = reactor
        #: The servers a member's clients reach, by port (connections made on a MemoryReactorClock).
        self._routes: dict[int, SiteAgent] = {}
        self.sims: dict[str, SimOllama] = {}
        config = config or Config()
        if members:
            self.sim = None
            self.upstream = None
            config = self._pool(config, members, sim_options)
        else:
            self.sim = SimOllama(self.clock, **with_test_models(sim_options)) if upstream is None else None
            self.upstream = MemoryUpstream(upstream if upstream is not None else self.sim.resource(), self.clock)
        if not watchers:
            config = config.with_overrides(**{"upstream.detect_outages": False})
            if members:
                # As helpers.start_pool_stack: each member's own key too.
                config = attrs.evolve(
                    config, upstreams=tuple(attrs.evolve(m, detect_outages=False) for m in config.upstreams)
                )
        self.proxy = build(
            self.clock, config, token=token, read_token=read_token, upstream=self.upstream, holds=holds, wall=wall,
        )
        if self.upstream is not None:
            # The single upstream's control calls (health, outage probes) reach it too.
            self._routes[urlsplit(self.proxy.scheduler.members[0].spec.url).port or 80] = self.upstream.wire
        self.proxy_agent = SiteAgent(self.proxy.proxy_app.site(), self.clock)
        self.admin_agent = SiteAgent(self.proxy.admin_app.site(), self.clock)

    def _pool(self, config: Config, members, sim_options) -> Config:
        """The members' servers, each on a port of its own; ``config`` with their ``[[upstreams]]``."""
        tables = []
        for i, member in enumerate(members):
            member = dict(member)
            resource = member.pop("upstream", None)
            options = with_test_models({**sim_options, **member.pop("sim", {})})
            if resource is None:
                sim = self.sims[member["name"]] = SimOllama(self.clock, **options)
                resource = sim.resource()
            port = 20000 + i
            self._routes[port] = SiteAgent(Site(resource, reactor=MemoryReactorClock()), self.clock)
            tables.append(MemberConfig(**{"url": f"http://127.0.0.1:{port}", **member}))
        config = attrs.evolve(config, upstreams=tuple(tables))
        if not config.verification.models:
            # As helpers.start_pool_stack: all-minilm's twins are verified.
            config = attrs.evolve(config, verification=attrs.evolve(config.verification, models=("all-minilm",)))
        return config

    def _connect_pending(self) -> bool:
        """Connect what the proxy's clients asked of the memory reactor to the server at that port; True if any."""
        clients = getattr(self.clock, "tcpClients", None)
        if not clients:
            return False
        while clients:
            _host, port, factory, _timeout, _bind = clients.pop(0)
            connector = self.clock.connectors.pop(0)
            wire = self._routes.get(port)
            if wire is None:
                factory.clientConnectionFailed(connector, Failure(ConnectionRefusedError(f"nothing at port {port}")))
            else:
                wire._connect(factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", port)), port)
        return True

    def direct(self, name: str, method: str, path: str, json: Any = None) -> Deferred:
        """A call straight to member ``name``'s server (not through the proxy): a Deferred of its :class:`Answer`."""
        port = next(p for p, m in zip(self._routes, self.proxy.scheduler.members) if m.name == name)
        client = treq.client.HTTPClient(self._routes[port], data_to_body_producer=BytesProducer)
        kwargs: dict[str, Any] = {}
        if json is not None:
            kwargs = {"data": jsonlib.dumps(json).encode(), "headers": {"Content-Type": "application/json"}}
        d = client.request(method, f"http://127.0.0.1:{port}{path}", **kwargs)
        d.addCallback(lambda response: treq.content(response).addCallback(
            lambda body: Answer(response.code, response.headers, body)
        ))
        self.turn()
        return d

    def start(self) -> None:
        """Start ``proxy.service`` (its listeners listen on the memory reactor) and run what is due."""
        self.proxy.service.startService()
        self.turn()

    def settle(self, seconds: float = 5.0) -> None:
        """As :func:`helpers.start_pool_stack` waits after the start: the members' model lists read, then the
        twins verified (or, a member that never answers, not within ``seconds``: the others were meanwhile)."""
        lists_read = lambda: all(  # noqa: E731
            m.catalogue.static or m.catalogue.discovered is not None or not m.available() for m in self.proxy.scheduler.members
        )
        try:
            self.until(lambda: lists_read() and (self.proxy.twins is None or self.proxy.twins.settled), seconds)
        except AssertionError:
            pass

    def stop(self, seconds: float = 120.0) -> None:
        """Stop ``proxy.service``, moving the clock until it has stopped (at most ``seconds``)."""
        stopped = self.proxy.service.stopService()
        self.until(lambda: answered(stopped), seconds)
        self.result(stopped)

    def until(self, predicate, seconds: float) -> None:
        """Move the clock from one due call to the next until ``predicate()`` holds; fail after ``seconds``."""
        end = self.clock.seconds() + seconds
        self.turn()
        while not predicate():
            due = [call.getTime() for call in self.clock.getDelayedCalls() if call.active()]
            next_time = min(due, default=None)
            assert next_time is not None and next_time <= end, f"not so after {seconds:g} s of the clock"
            self.clock.rightNow = max(self.clock.rightNow, next_time)
            self.turn()

    # -- time -------------------------------------------------------------------------

    def _due_now(self) -> bool:
        now = self.clock.seconds()
        return any(call.active() and call.getTime() <= now for call in self.clock.getDelayedCalls())

    def turn(self) -> None:
        """Run everything that is due now, until nothing moves: the connections both ways, the zero-delay calls."""
        for _ in range(_MAX_ROUNDS):
            moved = self.proxy_agent.flush()
            moved = self.admin_agent.flush() or moved
            if self.upstream is not None:
                moved = self.upstream.flush() or moved
            moved = self._connect_pending() or moved
            for wire in self._routes.values():
                moved = wire.flush() or moved
            due = self._due_now()
            self.clock.advance(0)
            if not (moved or due):
                return
        raise AssertionError(f"still busy after {_MAX_ROUNDS} rounds")

    def run(self, seconds: float) -> None:
        """Move the clock ``seconds`` on, stopping at each due call's time to run it and what follows from it."""
        end = self.clock.seconds() + seconds
        self.turn()
        while True:
            due = [call.getTime() for call in self.clock.getDelayedCalls() if call.active()]
            next_time = min(due, default=None)
            if next_time is None or next_time > end:
                break
            self.clock.rightNow = max(self.clock.rightNow, next_time)
            self.turn()
        self.clock.rightNow = max(self.clock.rightNow, end)
        self.turn()

    # -- requests -----------------------------------------------------------------------

    def open(self, method: str, url: str, json: Any = None, data: bytes | None = None, headers=None) -> Deferred:
        """Send a request (to the admin site if ``url`` is under :attr:`admin_url`); a Deferred of treq's response.

        Each request is a new caller: its own connection and an empty cookie
        jar.  The body is left to the caller (``treq.collect`` to watch it arrive).
        """
        d = self.send(method, url, json=json, data=data, headers=headers)
        self.turn()
        return d

    def send(self, method: str, url: str, json: Any = None, data: bytes | None = None, headers=None) -> Deferred:
        """:meth:`open` without running what follows: for callers that send from a callback (a burst's workers)."""
        agent = self.admin_agent if url.startswith(self.admin_url) else self.proxy_agent
        client = treq.client.HTTPClient(agent, data_to_body_producer=BytesProducer)
        kwargs: dict[str, Any] = {"headers": headers}
        if json is not None:
            kwargs["data"] = jsonlib.dumps(json).encode()
            kwargs["headers"] = {"Content-Type": "application/json", **(headers or {})}
        elif data is not None:
            kwargs["data"] = data
        return client.request(method, url, **kwargs)

    def request(self, method: str, url: str, json: Any = None, data: bytes | None = None, headers=None) -> Deferred:
        """:meth:`open`, and read the whole body: a Deferred of its :class:`Answer`."""
        d = self.open(method, url, json=json, data=data, headers=headers)
        d.addCallback(lambda response: treq.content(response).addCallback(
            lambda body: Answer(response.code, response.headers, body, response.length)
        ))
        self.turn()
        return d

    def call(self, method: str, url: str, json: Any = None, data: bytes | None = None, headers=None) -> Answer:
        """:meth:`request`, answered without the clock moving (else the test fails)."""
        return self.result(self.request(method, url, json=json, data=data, headers=headers))

    def raw(self, site=None) -> RawPeer:
        """A connection to the proxy listener's site (or to ``site``, one of its own) that the test writes bytes on."""
        return self.proxy_agent.raw(site)

    def post(self, path: str, json: Any = None, **kwargs) -> Deferred:
        """POST ``json`` to the proxy at ``path``; a Deferred of its :class:`Answer`."""
        return self.request("POST", self.proxy_url + path, json=json, **kwargs)

    def result(self, d: Deferred) -> Any:
        """``d``'s result now: raises its failure, and fails the test if it has none yet."""
        results: list = []
        d.addBoth(lambda r: results.append(r) or r)
        assert results, "no answer yet"
        if isinstance(results[0], Failure):
            d.addErrback(lambda f: None)
            results[0].raiseException()
        return results[0]

    def sample(self, name: str, **labels) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def answered(d: Deferred) -> bool:
    """True once ``d`` has its result (``called`` is also true while it waits on another Deferred)."""
    results: list = []
    d.addBoth(lambda r: results.append(r) or r)
    return bool(results)
