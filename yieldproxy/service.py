"""The composition root: every part of one proxy, made and connected in one place, and the service that runs them.

:func:`build` takes the reactor (or a Clock) and the config, makes each part
once with everything it uses, in dependency order, and returns them in a
frozen :class:`Proxy`; no part is changed by another after it is made.
Tests use it with a Clock, ``tap.py`` with the real reactor.

What runs is a child of :class:`YieldProxyService`, started in order and
stopped in the reverse order, each child after the one before it has
stopped (docs/architecture.md):

1. the admin listener (it answers until the very end);
2. the upstream clients' connection pools (closed once nothing uses them);
3. the fallback's verification (when enabled);
4. the history sampling;
5. the drain (drain.py: parked requests answered or released, in-flight ones
   given ``proxy.shutdown_timeout_seconds``);
6. the watchers, then the VRAM handover (their holds stay when they stop);
7. the proxy listener (the first to stop: no new connections).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.internet.interfaces import IReactorFDSet, IReactorTime
from twisted.internet.task import Cooperator
from twisted.logger import Logger

from .admin import AdminApp
from .config import Config
from .control import UpstreamControl
from .drain import Drain
from .fallback import EmbedBackend, Fallback, fallback_drainer
from .forward import Upstream
from .gate import Gate
from .handover import Handover
from .health import UpstreamHealth
from .history import History, snapshot_reader
from .listener import CannotListen, Listener
from .metrics import Metrics, connection_families, hold_families, oldest_parked_family, source_label
from .names import BUILTIN_SOURCES
from .parking import ParkingLot
from .proxy import ProxyApp
from .replay import Replayer
from .state import YieldState, transition_logger
from .watchers import CommandWatcher, OutageWatcher, SignalWatcher, StateFileWatcher, UpstreamProbe

__all__ = ["Proxy", "YieldProxyService", "CannotListen", "build", "build_core", "one_step_cooperator"]

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
    """Every part of one proxy, as :func:`build` made them."""

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
    watchers: tuple[Service, ...]
    #: The VRAM handover, when ``handover.unload_on_yield`` or ``preload_models`` is set.
    handover: Handover | None
    #: The verified CPU fallback, when ``fallback.enabled``.
    fallback: Fallback | None
    #: What runs all of the above: start it, and stop it, as twistd does.
    service: YieldProxyService


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
    state.on_transition(transition_logger(gate.describe))
    return state, lot, replayer, gate


def build(
    reactor,
    config: Config,
    token: str | None = None,
    cooperator: Cooperator | None = None,
    metrics: Metrics | None = None,
    read_token: str | None = None,
    upstream: Upstream | None = None,
    history_interval: float = 1.0,
) -> Proxy:
    """Make and connect every part of a proxy on ``reactor`` (a real reactor or a Clock); nothing runs yet.

    ``upstream`` replaces the client of ``proxy.upstream`` (tests on a Clock
    give one that reaches an in-memory resource).  Start ``proxy.service``
    to listen and run the watchers; stop it to drain and close.
    """
    metrics = metrics or Metrics()
    cooperator = cooperator or one_step_cooperator(reactor)

    # The clock-driven heart, and what it reports.
    state, lot, replayer, gate = build_core(reactor, config, metrics, cooperator)
    known_sources = frozenset((*BUILTIN_SOURCES, *config.admin.known_sources))
    state.on_hold_taken(lambda hold: metrics.yields_total.labels(source_label(hold.source, known_sources)).inc())
    state.on_yield_ended(lambda source, seconds: metrics.yield_seconds.observe(seconds))
    metrics.watch(
        lambda: [*hold_families(state.holds, reactor.seconds()), oldest_parked_family(lot.oldest_ages())]
    )

    # The upstream: its client for requests, its control calls, what is known of its health.
    upstream = upstream or Upstream(reactor, config.proxy.upstream, config.upstream.max_connections)
    control = UpstreamControl(reactor, config.proxy.upstream)
    health = UpstreamHealth(config.proxy.upstream)
    clients: list[Any] = [upstream]

    fallback = None
    if config.fallback.enabled:
        fc = config.fallback
        backend = Upstream(reactor, fc.url, fc.concurrency + 1)
        clients.append(backend)
        fallback = Fallback(
            reactor, fc,
            EmbedBackend(reactor, upstream, fc.primary_api, fc.timeout_seconds, openai_prefix="/v1"),
            EmbedBackend(reactor, backend, fc.api, fc.timeout_seconds),
            metrics, lambda: state.yielded, {k: v.policy for k, v in config.classes.items()},
            lot, fallback_drainer(reactor, config, metrics, state, lot, cooperator),
        )
        state.observe(fallback.state_changed)
        metrics.watch(fallback.metric_families)

    # What takes holds by itself, and what acts on them.
    watchers = tuple(_watchers(reactor, config, state, metrics, health, control))
    handover = None
    if config.handover.unload_on_yield or config.handover.preload_models:
        handover = Handover(reactor, state, replayer, control, metrics, config.handover)
    history = History(
        reactor, snapshot_reader(gate, lot, replayer, config.classes), tuple(config.classes),
        interval=history_interval,
    )
    state.observe(history.state_changed)

    # The two HTTP apps.
    proxy_app = ProxyApp(reactor, config, gate, upstream, health, metrics, fallback)
    admin_app = AdminApp(
        reactor, config, state, gate, lot, replayer, metrics, token=token, read_token=read_token,
        history=history, sections=_status_sections(watchers, handover, fallback), fallback=fallback,
    )
    metrics.watch(lambda: connection_families({"proxy": proxy_app.connections, "admin": admin_app.connections}))

    # What runs, in start order (it stops in the reverse order).
    drain = Drain(
        reactor, state, gate, lot, replayer, (replayer, *([fallback] if fallback is not None else [])),
        timeout=config.proxy.shutdown_timeout_seconds,
    )
    service = YieldProxyService([
        Listener(reactor, "admin.listen", config.admin.listen, admin_app.site()),
        ClientPools(clients),
        *([fallback] if fallback is not None else []),
        history,
        drain,
        *watchers,
        *([handover] if handover is not None else []),
        Listener(reactor, "proxy.listen", config.proxy.listen, proxy_app.site()),
    ])
    return Proxy(
        reactor, config, metrics, state, lot, replayer, gate, upstream, health, proxy_app, admin_app, history,
        watchers, handover, fallback, service,
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


def _status_sections(watchers, handover, fallback) -> dict[str, Callable[[], Any]]:
    """The ``/status`` sections of the parts beside the core: each read when ``/status`` is."""
    sections: dict[str, Callable[[], Any]] = {
        "watchers": lambda: {w.name.split(":", 1)[1]: w.status() for w in watchers},
        "fallback": fallback.status if fallback is not None else lambda: {"enabled": False},
    }
    if handover is not None:
        sections["handover"] = handover.status
    return sections


class ClientPools(Service):
    """The upstream clients' connection pools, closed when the proxy stops (after the drain: it uses them)."""

    name = "clients"

    def __init__(self, clients: Sequence[Any]):
        self._clients = tuple(clients)

    def stopService(self) -> Deferred:
        super().stopService()
        return gatherResults([maybeDeferred(client.close) for client in self._clients], consumeErrors=True)


class YieldProxyService(MultiService):
    """Runs the proxy's parts: started in order, stopped one at a time in the reverse order.

    :class:`~twisted.application.service.MultiService` stops every child at
    once; a graceful stop cannot: the proxy listener must be closed before
    the drain starts, and the admin listener must answer until the drain
    ends.  So each child is stopped once the one after it has stopped, and a
    child that fails to stop is logged and the next one stops anyway.
    """

    def __init__(self, children: Sequence[Service]):
        super().__init__()
        for child in children:
            child.setServiceParent(self)

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

    def stopService(self) -> Deferred:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop_in_turn())

    async def _stop_in_turn(self) -> None:
        for child in reversed(list(self)):
            try:
                await maybeDeferred(child.stopService)
            except Exception:
                log.failure("stopping {name} failed", name=child.name)
