"""The composition root: every part of one proxy, made and connected in one place, and the service that runs them.

:func:`build` takes the reactor (or a Clock) and the config, makes each part
once with everything it uses, in dependency order, and returns them in a
frozen :class:`Proxy`; no part is changed by another after it is made.
Tests use it with a Clock, ``tap.py`` with the real reactor.  What runs is a
child of :class:`YieldProxyService`, started in order and stopped in the
reverse order, one at a time: docs/architecture.md lists the children and why
each stops where it does.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.internet.interfaces import IReactorFDSet, IReactorTime
from twisted.internet.task import Cooperator
from twisted.logger import Logger

from .admin.api import AdminApp
from .clock import WallClock, same, wall_clock
from .config import Config
from .edge.listener import CannotListen, Listener
from .lifecycle.drain import Drain
from .lifecycle.holdstore import HoldStore, keep_holds
from .lifecycle.succession import Setup, Succession
from .lot.parking import ParkingLot
from .lot.replay import Replayer
from .lot.state import YieldState, transition_logger
from .names import BUILTIN_SOURCES
from .observe.history import History, snapshot_reader
from .observe.metrics import (
    Metrics,
    connection_families,
    hold_families,
    oldest_parked_family,
    pool_families,
    source_label,
)
from .proxy.handler import ProxyApp
from .schedule.scheduler import Scheduler, any_member
from .servers import ModelCall
from .upstream.attempt import Upstream
from .upstream.control import UpstreamControl
from .upstream.fallback import EmbedBackend, Fallback, fallback_contract
from .upstream.health import Judge, UpstreamHealth
from .upstream.pool.members import FALLBACK_MEMBER, MemberSpec, member_specs, pool_shape
from .upstream.pool.models import ModelDiscovery
from .upstream.pool.routing import make_members
from .upstream.pool.twins import TwinVerifier
from .upstream.served import SECTION, RecordKeeper
from .upstream.vram import Handover
from .watchers import CommandWatcher, OutageWatcher, SignalWatcher, StateFileWatcher, UpstreamProbe

__all__ = [
    "Proxy", "YieldProxyService", "CannotListen", "build", "build_heart", "one_step_cooperator", "subscribe_handover",
]

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
    #: The first member's drainer (with ``proxy.upstream``: its replayer).
    replayer: Replayer
    #: The scheduler (schedule/scheduler.py): admission, the choice of member, release; its members
    #: (``[[upstreams]]``, or ``proxy.upstream`` as the member ``default``) and their drainers.
    scheduler: Scheduler
    #: The first member's client (with ``proxy.upstream``: its client).
    upstream: Upstream
    #: Whether the first member answered since start, and the outage verdicts on its failures.
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
    #: Which members may serve which embedding models (several upstreams; None: one upstream).
    twins: TwinVerifier | None = None
    #: What each upstream served (upstream/served.py): kept with the holds, carried over by a reload.
    records: RecordKeeper | None = None


Clients = Callable[[MemberSpec], tuple[Any, Any]]


@attrs.frozen
class Heart:
    """The clock-driven heart :func:`build_heart` makes."""

    state: YieldState
    lot: ParkingLot
    #: The scheduler: admission, the choice of member, release; the members and their drainers.
    scheduler: Scheduler
    #: The ``[fallback]``'s verification and counts (its member is ``scheduler.member("fallback")``).
    fallback: Fallback | None = None
    #: The twin verification of a pool of several upstreams (with ``twins``).
    twins: TwinVerifier | None = None
    #: The one verifier of "same vectors": ``twins``, or the one that runs only the ``[fallback]``'s contract.
    verifier: TwinVerifier | None = None


def build_heart(
    reactor, config: Config, metrics: Metrics, cooperator: Cooperator | None = None, clients: Clients | None = None,
    fallback_backends: tuple[Any, Any] | None = None, twins: bool = False,
    twin_ok: Callable[[Any, Any], bool] | None = None, judges: Callable[[str], Judge | None] | None = None,
) -> Heart:
    """The yield state, the lot, the members and the scheduler: the clock-driven heart, made and wired.

    ``clients(spec)`` gives each member its request and control clients
    (None: clock-only, none).  With an enabled ``[fallback]``,
    ``fallback_backends`` are its verification's two sides (the primary's
    and the fallback's :class:`~yieldproxy.upstream.fallback.EmbedBackend`).  With
    ``twins``, a pool of several upstreams gets its twin verification (not
    started); ``twin_ok`` replaces the twin check (tests).
    """
    if cooperator is None:
        cooperator = one_step_cooperator(reactor)
    specs = member_specs(config)
    # What their number decides, decided once (members.py): read below, never counted again.
    shape = pool_shape(specs)
    state = YieldState(
        reactor, max_holds=config.admin.max_holds,
        members=[spec.name for spec in specs], standby={spec.name for spec in specs if spec.standby},
        names_members=shape.names_members,
    )
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
    contract = None
    if fallback_backends is not None:
        # The fallback's verification: its terms, run by the one verifier below.
        contract = fallback_contract(config.fallback, specs[0].name, *fallback_backends, lambda: not state.yielded)
    # In dependency order: the members, the one verifier of "same vectors" over them, the scheduler
    # (it makes each member's drainer), then what each follows of the others (no constructor subscribes itself).
    members = make_members(reactor, state, config, specs, shape, clients, judges)
    verifier = None
    find_twins = twins and not shape.one_upstream
    if find_twins or contract is not None:
        # Embeddings go to a model's reference or its verified twins (the fallback: under its contract).
        verifier = TwinVerifier(reactor, members, config.verification, contract=contract, find_twins=find_twins)
    if verifier is not None and find_twins:
        for member in members:
            member.catalogue.when_changed(verifier.lists_changed)
        metrics.watch(verifier.metric_families)
    if twin_ok is None:
        twin_ok = verifier.twin_ok if verifier is not None else any_member
    scheduler = Scheduler(reactor, state, lot, members, metrics, config, cooperator, twin_ok, shape=shape)
    if verifier is not None:
        # A pair newly verified: the drainers look again at what is parked.
        verifier.when_verified(scheduler.kick)
    fallback = None
    if verifier is not None and contract is not None:
        drainer = scheduler.drainer(FALLBACK_MEMBER)
        fallback = Fallback(
            reactor, config.fallback, verifier, metrics, lambda: state.yielded,
            {k: v.policy for k, v in config.classes.items()}, inflight=lambda: drainer.inflight,
        )
        scheduler.when_arrived(fallback.arrived)
        state.observe(fallback.state_changed)
        lot.when_out(fallback.left_lot)
        metrics.watch(fallback.metric_families)
    for subscribe, listener in scheduler.follow():
        subscribe(listener)
    for member in members:
        for subscribe, listener in member.follow():
            subscribe(listener)
    # The whole pool's in flight, read when scraped rather than set twice per request.
    metrics.inflight_requests.set_function(lambda: scheduler.inflight)
    state.observe(lambda yielded: metrics.yield_active.set(1 if yielded else 0))
    state.on_transition(transition_logger(scheduler.describe))
    return Heart(state, lot, scheduler, fallback, verifier if find_twins else None, verifier)


def build(
    reactor,
    config: Config,
    token: str | None = None,
    cooperator: Cooperator | None = None,
    metrics: Metrics | None = None,
    read_token: str | None = None,
    upstream: Upstream | None = None,
    history_interval: float = 1.0,
    succession: Setup | None = None,
    holds: HoldStore | None = None,
    wall: Callable[[], float] | None = None,
) -> Proxy:
    """Make and connect every part of a proxy on ``reactor`` (a real reactor or a Clock); nothing runs yet.

    ``upstream`` replaces the first member's client (with ``proxy.upstream``:
    its client; tests on a Clock give one that reaches an
    in-memory resource).  Start ``proxy.service`` to listen and run the
    watchers; stop it to drain and close.  ``succession`` (tap.py gives
    one) lets it reload by handing over to a new process (lifecycle/succession/),
    and, in a process a reload started, take over its predecessor's.
    ``holds`` (tap.py gives one) keeps the holds across restarts and
    crashes (lifecycle/holdstore.py); without it, a hold lasts as long as the process.
    Every bound runs on ``reactor``'s clock; ``wall`` gives the wall-clock time for what people read
    (clock.py), by default the holds file's, else :func:`~yieldproxy.clock.wall_clock`'s.
    """
    metrics = metrics or Metrics()
    cooperator = cooperator or one_step_cooperator(reactor)
    # The holds file's wall clock, when there is one: it adopts the offset of the last run on this boot.
    walls = holds.wall if holds is not None and wall is None else wall_clock(reactor, wall)
    specs = member_specs(config)
    first = specs[0].name
    fc = config.fallback

    def client(spec: MemberSpec) -> Any:
        """Each member's client for requests (its connection pool)."""
        if upstream is not None and spec.name == first:
            return upstream
        # The fallback's cap is its concurrency, and one connection more for its verification.
        return Upstream(reactor, spec.url, fc.concurrency + 1 if spec.fallback else config.upstream.max_connections)

    made = {spec.name: (client(spec), UpstreamControl(reactor, spec.url)) for spec in specs}
    fallback_backends = None
    if fc.enabled:
        # Its verification embeds the probe texts on both sides, through the members' own clients.
        fallback_backends = (
            EmbedBackend(reactor, made[first][0], fc.primary_api, fc.timeout_seconds, openai_prefix="/v1"),
            EmbedBackend(reactor, made[FALLBACK_MEMBER][0], fc.api, fc.timeout_seconds),
        )

    # Each member's outage watcher (made below, from the member's health) judges its failures:
    # the health is made with a judge that asks it.
    outage_watchers: dict[str, OutageWatcher] = {}

    def judges(name: str) -> Judge | None:
        """A member's judge: its outage watcher's, or None for a member that detects no outages."""
        if not next(spec for spec in specs if spec.name == name).detect_outages:
            return None

        def judge(reason: str, call: ModelCall | None = None) -> Deferred[bool]:
            return outage_watchers[name].judge(reason, call)

        return judge

    # The clock-driven heart, and what it reports.
    heart = build_heart(
        reactor, config, metrics, cooperator, lambda spec: made[spec.name], fallback_backends, twins=True, judges=judges,
    )
    state, lot, scheduler, fallback, twins = heart.state, heart.lot, heart.scheduler, heart.fallback, heart.twins
    replayer = scheduler.drainer(None)
    known_sources = frozenset((*BUILTIN_SOURCES, *config.admin.known_sources))
    state.on_hold_taken(lambda hold: metrics.yields_total.labels(source_label(hold.source, known_sources)).inc())
    state.on_yield_ended(lambda source, seconds: metrics.yield_seconds.observe(seconds))
    metrics.watch(
        lambda: [
            *hold_families(state.holds, reactor.seconds()), oldest_parked_family(lot.oldest_ages()),
            *pool_families(scheduler.metric_rows()),
        ]
    )

    # The upstreams: each member's client for requests, its control calls, what is known of its health.
    upstream, health = scheduler.members[0].upstream, scheduler.members[0].health
    client_pools: list[Any] = [m.upstream for m in scheduler.members]

    # What takes holds by itself, and what acts on them.
    watchers = tuple(_watchers(reactor, config, state, metrics, scheduler))
    outage_watchers.update((w.member, w) for w in watchers if isinstance(w, OutageWatcher))
    handovers = tuple(_handovers(reactor, config, state, metrics, scheduler))
    handover = handovers[0] if len(handovers) == 1 and scheduler.shape.one_upstream else None
    discovery = tuple(_discovery(reactor, config, scheduler))
    history = History(
        reactor, snapshot_reader(scheduler, lot, config.classes, metrics), tuple(config.classes),
        interval=history_interval, upstreams=scheduler.names, wall=walls,
    )
    state.observe(history.state_changed)

    # What each upstream served: the evidence of its outage verdicts, kept with the holds (upstream/served.py).
    records = RecordKeeper.of(
        reactor, ((m.name, m.spec.url, m.health.record) for m in scheduler.members),
        (lambda: holds.save(state.holds)) if holds is not None else None,
    )

    # The two HTTP apps (``POST /reload`` reaches the succession, made once the listeners are).
    reloaders: list[Succession] = []
    proxy_app = ProxyApp(
        reactor, config, scheduler, metrics,
        on_attempt=fallback.attempt_ended if fallback is not None else lambda member, entry, outcome: None,
    )
    admin_app = AdminApp(
        reactor, config, state, scheduler, lot, metrics, token=token, read_token=read_token,
        history=history, sections=_status_sections(watchers, handovers, fallback, scheduler, twins, walls),
        fallback=fallback, reload=(lambda: reloaders[0].reload()) if succession is not None else None, wall=walls,
    )
    metrics.watch(lambda: connection_families({"proxy": proxy_app.connections, "admin": admin_app.connections}))

    # What runs, in start order (it stops in the reverse order).
    drain = Drain(
        reactor, state, scheduler, lot, scheduler.drainers,
        timeout=config.proxy.shutdown_timeout_seconds, outgoing=(proxy_app.connections,),
    )
    inherited = succession.inheritance if succession is not None else None
    listeners = {
        name: Listener(
            reactor, key, endpoint, site,
            inherited=inherited.listening(key, endpoint) if inherited is not None else None,
        )
        for name, key, endpoint, site in (
            ("admin", "admin.listen", config.admin.listen, admin_app.site()),
            ("proxy", "proxy.listen", config.proxy.listen, proxy_app.site()),
        )
    }
    if succession is not None:
        reloaders.append(Succession(
            reactor, succession, listeners, {"proxy": proxy_app.connections, "admin": admin_app.connections},
            proxy_app, lot, scheduler, state, twins, records,
        ))
        # Once the holds have gone to a new process (or before they have come to this one), a hold change
        # asked of this one is refused: the admin API's 503, the signal watcher's line.
        admin_app.holds_elsewhere = reloaders[0].holds_elsewhere
        for watcher in watchers:
            if isinstance(watcher, SignalWatcher):
                watcher.holds_elsewhere = reloaders[0].holds_elsewhere
    service = YieldProxyService([
        listeners["admin"],
        ClientPools(client_pools),
        # The one verifier of "same vectors": a pool's twins, or the fallback's contract (its start starts it).
        *([fallback] if fallback is not None else [twins] if twins is not None else []),
        *discovery,
        history,
        # Stops after the drain: the last answers are in the record it writes.
        records,
        drain,
        *watchers,
        *handovers,
        listeners["proxy"],
        # Last: it takes over (a process a reload started) once everything else runs.
        *reloaders,
    ])
    if holds is not None:
        holds.keep_section(SECTION, records.section, lambda section: records.restore(section, f"holds file {holds.path}"))
        # Last: a restored hold sets off everything a new one does.
        keep_holds(state, holds, config.state.restart_hold_seconds)
    return Proxy(
        reactor, config, metrics, state, lot, replayer, scheduler, upstream, health, proxy_app, admin_app, history,
        watchers, handover, fallback, service, twins, records,
    )


def _watchers(reactor, config: Config, state, metrics, scheduler: Scheduler) -> list[Service]:
    """The watchers ``config.watchers``, each member's keys and outage detection enable, not started.

    The global ones hold every member (scope ``*``); a member's own hold it
    alone, but its outage hold is of the scope ``scheduler.shape`` gives it (``*``
    with one upstream: members.py's ``PoolShape.hold_scope``).
    """
    w, up = config.watchers, config.upstream
    # inotify needs a reactor that watches file descriptors; a Clock only polls.
    real = reactor if IReactorFDSet.providedBy(reactor) else None
    watchers: list[Service] = []
    if w.state_file:
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
    for member in scheduler.members:
        spec, scope = member.spec, scheduler.shape.hold_scope(member.name)
        if spec.state_file:
            watchers.append(
                StateFileWatcher(
                    reactor, state, metrics, spec.state_file, w.state_file_poll_seconds,
                    inotify_reactor=real, scope=spec.name,
                )
            )
        if spec.command:
            watchers.append(
                CommandWatcher(
                    reactor, state, metrics, spec.command,
                    interval=w.command_interval_seconds, timeout=w.command_timeout_seconds, scope=spec.name,
                )
            )
        if spec.detect_outages:
            probe = UpstreamProbe(
                member.control, member.health, spec.health_path,
                health_timeout=up.health_timeout_seconds, model_timeout=up.model_probe_timeout_seconds,
                server=member.server,
            )
            own = member.catalogue.own_name(spec.probe_model) if spec.probe_model else None
            watchers.append(
                OutageWatcher(
                    reactor, state, member.health, probe, metrics,
                    interval=up.health_interval_seconds, max_interval=up.health_max_interval_seconds,
                    # The operator's probe model, under the member's own name for it (its model_map).
                    probe_model=own or spec.probe_model, probe_path=spec.probe_path,
                    probeable=member.health.record.probeable,
                    scope=scope, member=member.name,
                )
            )
    return watchers


def _handovers(reactor, config: Config, state, metrics, scheduler: Scheduler) -> list[Handover]:
    """A VRAM handover for each member whose yields unload or preload models (api ollama)."""
    handovers = []
    for member in scheduler.members:
        spec = member.spec
        if spec.hands_over:
            settings = attrs.evolve(
                config.handover, unload_on_yield=spec.unload_on_yield, preload_models=spec.preload_models
            )
            handover = Handover(
                reactor, state, scheduler.drainer(member.name), member.control, metrics, settings, member=member.name,
                per_member=not scheduler.shape.one_upstream, release=member,
            )
            subscribe_handover(state, handover)
            handovers.append(handover)
    return handovers


def subscribe_handover(state: YieldState, handover: Handover) -> None:
    """What a VRAM handover follows of the yield state: holds taken, its member taken and given back."""
    state.on_hold_taken(handover.hold_taken)
    state.observe_members(handover.member_changed)


def _discovery(reactor, config: Config, scheduler: Scheduler) -> list[ModelDiscovery]:
    """A model-list reader for each member without ``models``, in pools of several upstreams (one upstream
    has no choice to make, verifies no twin and translates nothing: it only relays); and for every member whose
    server may be mounted under an API prefix (Infinity's ``--url-prefix``), one that finds the prefix
    where its list answers, even where its models are given in config: every call the proxy makes to it
    (verification, translated embeddings) goes under that prefix."""
    if scheduler.shape.one_upstream:
        return []
    readers = []
    for member in scheduler.members:
        reads_models = not member.catalogue.static
        prefixed = len(member.server.url_prefixes) > 1
        if not (reads_models or prefixed):
            continue
        readers.append(
            ModelDiscovery(
                reactor, member.catalogue, member.control, member.name, member.server.models_path,
                member.server.parse_models, interval=config.upstream.models_refresh_seconds,
                timeout=config.upstream.health_timeout_seconds,
                other_paths=_prefixed_models_paths(member.server),
                on_found=_prefix_finder(member) if prefixed else lambda path: None,
                read_models=reads_models,
            )
        )
    return readers


def _prefix_finder(member) -> Callable[[str], None]:
    """Keeps the API prefix whose model list answered as the member's (:meth:`Member.found_prefix`)."""
    by_path = {member.server.with_prefix(prefix).models_path: prefix for prefix in member.server.url_prefixes}

    def found(path: str) -> None:
        prefix = by_path.get(path)
        if prefix is not None:
            member.found_prefix(prefix)

    return found


def _prefixed_models_paths(server) -> tuple[str, ...]:
    """Its model list under each other API prefix it may be mounted under (Infinity's ``/v1``)."""
    paths = dict.fromkeys(server.with_prefix(prefix).models_path for prefix in server.url_prefixes)
    paths.pop(server.models_path, None)
    return tuple(paths)


def _status_sections(
    watchers, handovers, fallback, scheduler: Scheduler, twins=None, wall: WallClock | None = None,
) -> dict[str, Callable[[], Any]]:
    """The ``/status`` sections of the parts beside the core: each read when ``/status`` is, its times on
    the wall clock (``wall``)."""

    def shown() -> Callable[[float], float]:
        return same if wall is None else wall.shown()

    sections: dict[str, Callable[[], Any]] = {
        "upstreams": (
            (lambda: scheduler.status(shown())) if twins is None
            else lambda: twins.with_twins(scheduler.status(shown()), shown())
        ),
        "watchers": lambda: {w.name.split(":", 1)[1]: w.status() for w in watchers},
        "fallback": (lambda: fallback.status(shown())) if fallback is not None else lambda: {"enabled": False},
    }
    if handovers and scheduler.shape.one_upstream:
        sections["handover"] = handovers[0].status
    elif handovers:
        sections["handover"] = lambda: {h.member: h.status() for h in handovers}
    return sections


class ClientPools(Service):
    """The upstream clients' connection pools, closed when the proxy stops (after the drain: it uses them)."""

    name = "clients"  # type: ignore[assignment]  # Twisted types Service.name as None

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
