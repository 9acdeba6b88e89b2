"""Shared test helpers: a Clock-driven core, and timeouts for real-socket awaits."""

from __future__ import annotations

import signal
import socket

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import Clock, Cooperator
from zope.interface import implementer

from yieldproxy.config import ClassConfig, Config, ParkingConfig, ReplayConfig
from yieldproxy.gate import Gate
from yieldproxy.metrics import Metrics
from yieldproxy.parking import Entry, ParkingLot
from yieldproxy.replay import Replayer
from yieldproxy.service import build_core, one_step_cooperator
from yieldproxy.state import YieldState


def clock_cooperator(clock: Clock) -> Cooperator:
    """A Cooperator that runs its steps on ``clock``, so tests advance it by hand."""
    return one_step_cooperator(clock)


@attrs.define(eq=False)
class Core:
    """State, lot, replayer and gate on one Clock, wired as ``service.build`` does."""

    clock: Clock
    metrics: Metrics
    state: YieldState
    lot: ParkingLot
    replayer: Replayer
    gate: Gate

    def run(self, seconds: float = 0.0, step: float = 0.001) -> None:
        """Advance the clock by ``seconds`` in small steps, running due calls."""
        self.clock.advance(0)
        remaining = seconds
        while remaining > 1e-12:
            self.clock.advance(min(step, remaining))
            remaining -= step
        self.clock.advance(0)

    def sample(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def make_core(config: Config | None = None, **replay) -> Core:
    config = config or Config()
    if replay:
        config = attrs.evolve(config, replay=attrs.evolve(config.replay, **replay))
    clock = Clock()
    metrics = Metrics()
    state, lot, replayer, gate = build_core(clock, config, metrics, clock_cooperator(clock))
    return Core(clock, metrics, state, lot, replayer, gate)


def config_with(**sections) -> Config:
    """A Config with some sections' keys replaced: ``config_with(parking={"max_parked": 2})``."""
    config = Config()
    changes = {}
    for name, keys in sections.items():
        if name == "classes":
            classes = dict(config.classes)
            for cls, cls_keys in keys.items():
                classes[cls] = attrs.evolve(classes[cls], **cls_keys)
            changes["classes"] = classes
        else:
            changes[name] = attrs.evolve(getattr(config, name), **keys)
    return attrs.evolve(config, **changes)


__all__ = ["Core", "make_core", "config_with", "Entry", "ClassConfig", "ParkingConfig", "ReplayConfig", "MemoryEndpoint"]


@implementer(IStreamClientEndpoint)
class MemoryEndpoint:
    """Connects clients to a server in memory (``twisted.test.iosim``); :meth:`flush` moves the bytes.

    The upstream pool's connections in a Clock test, as ``StubTreq`` does for
    the client side: ``Upstream(clock, url, endpoint=MemoryEndpoint(site))``.
    Give the server ``Site`` a reactor of its own (its channel timers), so the
    test's clock ends with no delayed calls.
    """

    def __init__(self, server_factory):
        self._server_factory = server_factory
        self._pumps: list = []
        #: Connections made so far.
        self.connections = 0

    def connect(self, factory):
        from twisted.internet.address import IPv4Address
        from twisted.test import iosim

        client_address = IPv4Address("TCP", "127.0.0.1", 40000 + self.connections)
        server_address = IPv4Address("TCP", "127.0.0.1", 11434)
        self.connections += 1
        server = self._server_factory.buildProtocol(client_address)
        client = factory.buildProtocol(server_address)
        pump = iosim.connect(
            server, iosim.FakeTransport(server, True, server_address, client_address),
            client, iosim.FakeTransport(client, False, client_address, server_address),
            greet=False,
        )
        self._pumps.append(pump)
        return succeed(client)

    def flush(self) -> None:
        """Deliver what either side wrote, until nothing moves; forget closed connections."""
        for pump in list(self._pumps):
            pump.flush()
        self._pumps = [p for p in self._pumps if not (p.clientIO.disconnected and p.serverIO.disconnected)]


# -- real sockets ---------------------------------------------------------------


@attrs.define(eq=False)
class Stack:
    """A simulated backend and a proxy (both listeners) on free 127.0.0.1 ports."""

    reactor: object
    sim: object
    proxy: object
    proxy_url: str
    admin_url: str
    _ports: list
    #: A test's own backend in place of the sim, if any.
    echo: object = None
    #: Watchers and handover, when started with ``watchers=True``.
    services: list = attrs.Factory(list)

    async def stop(self) -> None:
        for service in reversed(self.services):
            if service.running:
                service.stopService()
        for port in self._ports:
            await port.stopListening()
        self.proxy.replayer.stop()
        if getattr(self.proxy, "fallback", None) is not None:
            await self.proxy.fallback.stop()
        await self.proxy.upstream.close()
        if self.sim is not None:
            await self.sim.stop()

    def sample(self, name: str, **labels) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def start_stack(
    reactor, config: Config | None = None, upstream: str | None = None, token=None, watchers: bool = False,
    read_token=None, **sim_options,
) -> Stack:
    """Start a SimOllama (unless ``upstream`` is given) and a proxy in front of it.

    With ``watchers``, the watchers and handover the config enables run too
    (as ``YieldProxyService`` would start them).
    """
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from yieldproxy.service import build
    from yieldproxy.sim import SimOllama

    sim = None
    if upstream is None:
        sim = SimOllama(reactor, **sim_options)
        port = await sim.listen()
        upstream = f"http://127.0.0.1:{port}"
    config = (config or Config()).with_overrides(**{"proxy.upstream": upstream})
    proxy = build(reactor, config, token=token, read_token=read_token)
    ports = []
    for site in (proxy.proxy_app.site(), proxy.admin_app.site()):
        ports.append(await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site))
    urls = [f"http://127.0.0.1:{p.getHost().port}" for p in ports]
    stack = Stack(reactor, sim, proxy, urls[0], urls[1], ports)
    if watchers:
        from yieldproxy.watchers import build_watchers

        stack.services = build_watchers(reactor, proxy)
        for service in stack.services:
            service.startService()
    return stack


async def sleep(reactor, seconds: float) -> None:
    from twisted.internet.task import deferLater

    await deferLater(reactor, seconds)


async def wait_for(reactor, predicate, timeout: float = 10.0, step: float = 0.01) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    waited = 0.0
    while not predicate():
        if waited >= timeout:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        await sleep(reactor, step)
        waited += step


def in_thread(reactor, function, *args, timeout: float = 120.0, **kwargs):
    """Run a blocking client call in a thread; the Deferred fails after ``timeout``."""
    from twisted.internet.threads import deferToThreadPool

    return deferToThreadPool(reactor, reactor.getThreadPool(), function, *args, **kwargs).addTimeout(timeout, reactor)



def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for child processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildOutput(ProcessProtocol):
    """Keeps a child's output; ``ended`` fires with its exit code.

    twistd stopped by SIGTERM re-raises the signal after a clean shutdown, so
    its status reflects the signal (systemd counts that as a clean stop):
    ``ended`` then fires with ``"SIGTERM"``.
    """

    def __init__(self):
        self.output = b""
        self.ended: Deferred = Deferred()

    def outReceived(self, data):
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason):
        status = reason.value
        self.ended.callback("SIGTERM" if status.signal == signal.SIGTERM else status.exitCode)


def required_tool(*names: str, install: str) -> str:
    """The path of the first of ``names`` on PATH; skip without it, but fail under CI (which installs it)."""
    import os
    import shutil

    import pytest

    for name in names:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(f"{names[0]} is not installed ({install}); CI must install it")
    pytest.skip(f"{names[0]} is not installed ({install}); set CI=1 to make this a failure")
