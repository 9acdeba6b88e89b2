"""Wiring: the object graph of one proxy, and the service that runs it.

:func:`build` takes the reactor (or a Clock) and the config and returns every
part, connected; tests use it with a Clock, ``tap.py`` with the real reactor.
:class:`YieldProxyService` listens on both endpoints and stops gracefully:
parked requests are answered (or released, if the GPU is back) and in-flight
ones get a bounded time to finish.
"""

from __future__ import annotations

import attrs
from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IReactorFDSet, IReactorTime
from twisted.internet.task import Cooperator
from twisted.logger import Logger

from .admin import AdminApp
from .control import UpstreamControl
from .config import Config
from .forward import Upstream
from .fallback import Fallback, build_fallback
from .gate import Gate
from .handover import Handover
from .health import UpstreamHealth
from .history import History, snapshot_reader
from .listen_errors import why_cannot_listen
from .metrics import Metrics, connection_families, hold_families, oldest_parked_family, source_label
from .parking import ParkingLot
from .proxy import ProxyApp
from .replay import Replayer
from .names import BUILTIN_SOURCES
from .state import YieldState
from .watchers import CommandWatcher, OutageWatcher, SignalWatcher, StateFileWatcher, UpstreamProbe

log = Logger()


def one_step_cooperator(clock) -> Cooperator:
    """A Cooperator that runs one step per reactor turn, on ``clock``.

    The default runs steps for up to 10 ms in one go, and the requests it
    releases only reach the network when the turn ends: with a high
    ``replay.concurrency`` the first release would wait for the last.
    """
    return Cooperator(
        terminationPredicateFactory=lambda: lambda: True,
        scheduler=lambda step: clock.callLater(0, step),
    )


@attrs.frozen
class Proxy:
    """Every part of one proxy, as :func:`build` connected them."""

    clock: IReactorTime
    config: Config
    metrics: Metrics
    state: YieldState
    lot: ParkingLot
    replayer: Replayer
    gate: Gate
    #: The client of ``proxy.upstream`` (its connection pool).
    upstream: Upstream
    #: Whether the upstream answered since start, and the outage verdicts on its failures.
    health: UpstreamHealth
    proxy_app: ProxyApp
    admin_app: AdminApp
    #: The status page's last hour.
    history: History
    #: The enabled watchers (docs/watchers.md).
    watchers: tuple[Service, ...] = ()
    #: The VRAM handover, when ``handover.unload_on_yield`` or ``preload_models`` is set.
    handover: Handover | None = None
    #: The verified CPU fallback, when ``fallback.enabled``.
    fallback: Fallback | None = None


def build_core(
    reactor, config: Config, metrics: Metrics, cooperator: Cooperator | None = None
) -> tuple[YieldState, ParkingLot, Replayer, Gate]:
    """The yield state, the lot, the replayer and the gate: the clock-driven heart."""
    if cooperator is None:
        cooperator = one_step_cooperator(reactor)
    state = YieldState(reactor, max_holds=config.admin.max_holds)
    lot = ParkingLot(
        reactor,
        metrics,
        max_parked=config.parking.max_parked,
        max_parked_bytes=config.parking.max_parked_bytes,
        class_max_parked={k: v.max_parked for k, v in config.classes.items()},
        reject_status=config.parking.reject_status,
        priorities={k: v.priority for k, v in config.classes.items()},
        min_shares={k: v.min_share for k, v in config.classes.items()},
    )
    replayer = Replayer(
        reactor,
        lot,
        state,
        metrics,
        cooperator,
        concurrency=config.replay.concurrency,
        rate=config.replay.rate,
        backoff_seconds=config.upstream.retry_backoff_seconds,
        backoff_max_seconds=config.upstream.retry_backoff_max_seconds,
    )
    gate = Gate(
        reactor, state, lot, replayer, metrics, config.classes, reject_status=config.parking.reject_status
    )
    return state, lot, replayer, gate


def build(
    reactor,
    config: Config,
    token: str | None = None,
    cooperator: Cooperator | None = None,
    metrics: Metrics | None = None,
    read_token: str | None = None,
    upstream: Upstream | None = None,
) -> Proxy:
    """Connect the parts of a proxy on ``reactor`` (a real reactor or a Clock).

    Each part is made once, here, with everything it uses; none is changed
    by another after it is made.  ``upstream`` replaces the client of
    ``proxy.upstream`` (tests on a Clock give one that reaches an in-memory
    resource).
    """
    metrics = metrics or Metrics()
    cooperator = cooperator or one_step_cooperator(reactor)
    state, lot, replayer, gate = build_core(reactor, config, metrics, cooperator)
    known_sources = frozenset((*BUILTIN_SOURCES, *config.admin.known_sources))
    state.on_hold_taken(lambda hold: metrics.yields_total.labels(source_label(hold.source, known_sources)).inc())
    state.on_yield_ended(lambda source, seconds: metrics.yield_seconds.observe(seconds))
    metrics.watch(
        lambda: [*hold_families(state.holds, reactor.seconds()), oldest_parked_family(lot.oldest_ages())]
    )

    upstream = upstream or Upstream(reactor, config.proxy.upstream, config.upstream.max_connections)
    health = UpstreamHealth(config.proxy.upstream)
    control = UpstreamControl(reactor, config.proxy.upstream)
    fallback = None
    if config.fallback.enabled:
        fallback = build_fallback(reactor, config, upstream, metrics, state, lot, cooperator)
        state.observe(fallback.state_changed)

    watchers = tuple(_watchers(reactor, config, state, metrics, health, control))
    h = config.handover
    handover = None
    if h.unload_on_yield or h.preload_models:
        handover = Handover(reactor, state, replayer, control, metrics, h)
    history = History(reactor, snapshot_reader(gate, lot, replayer, config.classes), tuple(config.classes))
    state.observe(history.state_changed)

    proxy_app = ProxyApp(reactor, config, gate, upstream, health, metrics, fallback)
    sections = {
        "watchers": lambda: {w.name.split(":", 1)[1]: w.status() for w in watchers},
        "fallback": fallback.status if fallback is not None else lambda: {"enabled": False},
    }
    if handover is not None:
        sections["handover"] = handover.status
    admin_app = AdminApp(
        reactor, config, state, gate, lot, replayer, metrics, token=token, read_token=read_token,
        history=history, sections=sections, fallback=fallback,
    )
    metrics.watch(lambda: connection_families({"proxy": proxy_app.connections, "admin": admin_app.connections}))
    return Proxy(
        reactor, config, metrics, state, lot, replayer, gate, upstream, health, proxy_app, admin_app, history,
        watchers=watchers, handover=handover, fallback=fallback,
    )


def _watchers(reactor, config: Config, state, metrics, health, control) -> list[Service]:
    """The watchers ``config.watchers`` and ``upstream.detect_outages`` enable, not started."""
    w, up = config.watchers, config.upstream
    watchers: list[Service] = []
    if w.state_file:
        # inotify needs a reactor that watches file descriptors; a Clock only polls.
        real = reactor if IReactorFDSet.providedBy(reactor) else None
        watchers.append(
            StateFileWatcher(reactor, state, metrics, w.state_file, w.state_file_poll_seconds, inotify_reactor=real)
        )
    if w.signals:
        watchers.append(SignalWatcher(reactor, state, metrics))
    if w.command:
        watchers.append(
            CommandWatcher(
                reactor, state, metrics, w.command,
                interval=w.command_interval_seconds, timeout=w.command_timeout_seconds,
            )
        )
    if up.detect_outages:
        probe = UpstreamProbe(
            control, health, up.health_path,
            health_timeout=up.health_timeout_seconds, model_timeout=up.model_probe_timeout_seconds,
        )
        watchers.append(
            OutageWatcher(
                reactor, state, health, probe, metrics,
                interval=up.health_interval_seconds, max_interval=up.health_max_interval_seconds,
            )
        )
    return watchers


class CannotListen(Exception):
    """A listener could not start; the message is one line naming the key, the endpoint and why."""


class _Listener(StreamServerEndpointService):
    """A listener that fails at once, with :class:`CannotListen`, when it cannot bind.

    twistd calls :meth:`privilegedStartService` before it drops privileges;
    a port in use or a missing socket directory surfaces there.
    """

    def __init__(self, reactor, key: str, endpoint: str, factory):
        super().__init__(serverFromString(reactor, endpoint), factory)
        self.setName(key.split(".")[0])
        self._key = key
        self._endpoint = endpoint
        self._raiseSynchronously = True

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except Exception as e:
            raise CannotListen(f"{self._key} {self._endpoint!r}: cannot listen: {why_cannot_listen(e)}") from e


class YieldProxyService(MultiService):
    """Both listeners, and the graceful stop that keeps the "nothing lost" promise."""

    def __init__(self, reactor, proxy: Proxy):
        super().__init__()
        self._reactor = reactor
        self.proxy = proxy
        self._proxy_listener = _Listener(reactor, "proxy.listen", proxy.config.proxy.listen, proxy.proxy_app.site())
        self._proxy_listener.setServiceParent(self)
        self._admin_listener = _Listener(reactor, "admin.listen", proxy.config.admin.listen, proxy.admin_app.site())
        self._admin_listener.setServiceParent(self)
        #: The enabled watchers and the VRAM handover (docs/watchers.md), started with the rest.
        self.watchers = [*proxy.watchers, *([proxy.handover] if proxy.handover is not None else [])]
        for service in self.watchers:
            service.setServiceParent(self)

    def privilegedStartService(self) -> None:
        """Bind both listeners: twistd calls this before it drops privileges.

        A listener that cannot bind ends the process as twistd itself does
        when it cannot switch user: the reason on one line, exit status 1,
        instead of a 40-line traceback.
        """
        try:
            super().privilegedStartService()
        except CannotListen as e:
            log.critical("{message}", message=str(e))
            raise SystemExit(1) from None

    def startService(self) -> None:
        super().startService()
        if self.proxy.history is not None:
            self.proxy.history.start()
        if self.proxy.fallback is not None:
            self.proxy.fallback.start()

    def stopService(self) -> Deferred:
        """Stop taking requests, settle the parked ones, then let in-flight ones finish."""
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self):
        proxy = self.proxy
        await self._proxy_listener.stopService()
        # Watchers stop first and leave their holds as they are: a yielded GPU
        # stays yielded through the shutdown.  A pending preload stops holding the lot.
        for service in reversed(self.watchers):
            try:
                service.stopService()
            except Exception:
                log.failure("stopping {name} failed", name=service.name)
        proxy.gate.shutting_down = True
        if proxy.state.yielded:
            count = proxy.gate.refuse_all_parked("the proxy is shutting down while the GPU is yielded")
            log.info("shutdown: answered {count} parked requests with 503", count=count)
        timeout = proxy.config.proxy.shutdown_timeout_seconds
        settled = await self._wait_settled(timeout)
        if not settled:
            left = proxy.gate.refuse_all_parked("the proxy is shutting down")
            log.warn(
                "shutdown: {inflight} requests still in flight after {timeout}s; "
                "{left} parked answered with 503",
                inflight=proxy.replayer.inflight, timeout=timeout, left=left,
            )
        proxy.replayer.stop()
        if proxy.fallback is not None:
            await proxy.fallback.stop()
        await proxy.upstream.close()
        Service.stopService(self)
        await self._admin_listener.stopService()
        if proxy.history is not None:
            proxy.history.stop()

    async def _wait_settled(self, timeout: float) -> bool:
        """Poll until nothing is parked or in flight (at the fallback too), up to ``timeout`` seconds."""
        proxy = self.proxy
        waited = 0.0
        step = 0.05
        while proxy.lot or proxy.replayer.inflight or (proxy.fallback is not None and proxy.fallback.inflight):
            if waited >= timeout:
                return False
            d = Deferred()
            self._reactor.callLater(step, d.callback, None)
            await d
            waited += step
        return True
