"""The pool: which members a request may go to, and which one takes it now.

**Eligible** (decided once per request, at admission, and kept on its
:class:`~yieldproxy.lot.parking.Entry`): the members whose api serves the
request's route natively (in the dialect of the first that knows it; any
member for a route none knows), that may serve its class (``classes``), and
that serve its model (``models``, ``model_map`` or the discovered list); when
no member is known to serve the model, every member the route and class
allow, so a server answers in its own words.  Whether a member is available
is not part of it: that changes while the request waits.

**Translated embeddings**: an embedding request on one of the routes
:mod:`yieldproxy.upstream.translation` reads (Ollama's ``/api/embed`` and
``/api/embeddings``, OpenAI's ``/v1/embeddings``) is also eligible for a
member whose api does not serve that route natively, when the member is
known to serve the model (its ``models``, ``model_map`` or discovered list:
never on a guess) and its class, and the body can be translated faithfully
(:func:`yieldproxy.upstream.translation.parse_request`).  Its attempt goes to the
member's own embedding route (:attr:`~yieldproxy.servers.Server.embed_path`,
the route its twin verification uses) and the answer comes back in the
caller's shape (:mod:`yieldproxy.upstream.translated_attempt`).  Such members are listed in
:attr:`~yieldproxy.lot.parking.Routing.translated`.  Like any member other than
the model's reference, it serves only as a verified twin; and it is the
reference only when no member serving the model speaks every translated
route natively (:func:`reference_rank`): a CPU copy on Infinity is checked
against the GPU's Ollama, never the other way round.

**The choice at admission** (:meth:`Pool.choose`): among the eligible
members that are available and have no eligible request waiting in the lot
(no overtaking), the least in flight, then the first in config order; a
standby member (``use = "when_others_yielded"``) only while no eligible
``always`` member is available, and below its cap (a CPU copy is not handed
a whole burst).  None: the request parks.

**The drain**: each member has its own drainer (a
:class:`~yieldproxy.lot.replay.Replayer` with its ``replay_concurrency``) that
lets out the next parked entry it may take (:meth:`Pool.may_take`), in the
lot's drain order, while the member is available; it is woken when the
member becomes available, when an entry it could take parks, and when a
slot frees.  An entry whose attempt failed on a member goes to another
eligible one first, when one is available.

Embedding requests go only to a model's reference or a verified twin
(issue 12): that check is :attr:`Pool.twin_ok`, applied at each choice and
release since a verification can go stale; the twin verification
(:mod:`.twins`, made from the members before the pool, in
``service.build_heart``) gives it.  Without it (one upstream, clock-only
pools) every eligible member serves; the ``[fallback]``'s verification is
the check for its member.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Cooperator
from twisted.logger import Logger

from ...clock import same
from ...config import Config
from ...lot.parking import STANDBY_ONLY, Entry, ParkingLot, Routing
from ...lot.replay import Replayer
from ...lot.state import YieldState
from ...names import PASSTHROUGH
from ...observe.metrics import Metrics
from ...servers import ModelCall, Server, native_apis, server
from ..health import Judge, UpstreamHealth
from ..served import ServedRecord
from ..translation import EMBED_ROUTES
from .member import Member
from .members import MemberSpec, PoolShape, member_server
from .models import ModelCatalogue

log = Logger()

#: Eligibility decisions kept (by method, path, class and model); past this the cache starts over.
_CACHE_LIMIT = 4096
#: Last path segments of the routes that return embeddings.
_EMBEDDING_ROUTES = frozenset({"embed", "embeddings", "embedding", "embed_all", "embed_sparse"})
#: The embedding routes a member may serve translated, with the dialect the caller speaks on each.
TRANSLATED_ROUTES = {path: ("openai" if name == "v1" else "ollama") for path, name in EMBED_ROUTES.items()}


def serves_natively(api: str, path: str) -> bool:
    """True when ``api`` serves the translated route ``path`` itself, in the caller's dialect."""
    route = server(api).route("POST", path)
    return route is not None and route.dialect == TRANSLATED_ROUTES[path]


@functools.cache
def reference_rank(api: str) -> int:
    """0 for an api that serves every translated route natively (Ollama's), else 1.

    A model's reference is the first member serving it of the lowest rank
    (:mod:`.twins`): a member that would answer some embedding route only
    translated is the yardstick only when no member of rank 0 serves the model.
    """
    return 0 if all(serves_natively(api, path) for path in TRANSLATED_ROUTES) else 1


def route_kind(path: str | None, cls: str) -> str:
    """``embedding``, ``generation`` or ``other`` (:data:`yieldproxy.lot.parking.ROUTE_KINDS`)."""
    if cls == PASSTHROUGH or path is None:
        return "other"
    return "embedding" if path.rsplit("/", 1)[-1] in _EMBEDDING_ROUTES else "generation"


class _Taker:
    """``may_take(name, entry)`` as the lot's ``accepts``: its answer depends only on the entry's
    routing and the member its last attempt failed on, so the lot asks once per kind of entry
    (``by_routing``, lot/parking.py) and a long line it refuses costs a few calls, not one each."""

    by_routing = True
    __slots__ = ("_may_take", "_name")

    def __init__(self, may_take: Callable[[str, Entry], bool], name: str):
        self._may_take = may_take
        self._name = name

    def __call__(self, entry: Entry) -> bool:
        return self._may_take(self._name, entry)


def any_member(member: Member, entry: Entry) -> bool:
    """The twin check of a pool without twin verification (one upstream): every eligible member may serve."""
    return True


@attrs.define(eq=False)
class Pool:
    """The members of the pool, with their drainers, and the routing choices between them."""

    _clock: IReactorTime
    _state: YieldState
    _lot: ParkingLot
    #: The members, in config order, each with its drainer (:func:`make_members`; ``service.build_heart``).
    members: tuple[Member, ...]
    #: ``twin_ok(member, entry)``: may ``member`` serve ``entry`` now (an embedding: the
    #: model's reference or a verified twin).  See the module docstring.
    twin_ok: Callable[[Member, Entry], bool] = any_member
    #: What its number of members decides (members.py's :func:`~.members.pool_shape`).
    shape: PoolShape = attrs.field(kw_only=True)
    _by_name: dict[str, Member] = attrs.field(init=False)
    _apis: tuple[str, ...] = attrs.field(init=False)
    _cache: dict = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self._by_name = {m.name: m for m in self.members}
        self._apis = tuple(m.spec.api for m in self.members if not m.spec.fallback)

    def forget_routings(self) -> None:
        """A member's model list changed: the cached eligibility decisions are dropped."""
        self._cache.clear()

    # -- what a request may use -----------------------------------------------------------

    def member(self, name: str | None) -> Member:
        """The member ``name`` (None: the first)."""
        return self.members[0] if name is None else self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def names_members(self) -> bool:
        """Whether what is said of the pool names its members (:attr:`PoolShape.names_members`)."""
        return self.shape.names_members

    def routing(
        self, method: str | None, path: str | None, cls: str, model: str | None, translatable: bool = True
    ) -> Routing:
        """Where a request may go: the members eligible for it (see the module docstring), in config order.

        ``translatable``: False when the body cannot be translated into
        another server's embedding request (no member then gets it translated).
        One shared value per route, class, model and that flag (cached,
        dropped when a member's model list changes).
        """
        key = (method, path, cls, model, translatable)
        found = self._cache.get(key)
        if found is None:
            eligible, translated = self._eligible(method, path, cls, model, translatable)
            standby_only = bool(eligible) and all(self._by_name[n].spec.standby for n in eligible)
            found = Routing(eligible, model, route_kind(path, cls), standby_only, frozenset(translated))
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = found
        return found

    def translates(self, method: str | None, path: str | None, cls: str) -> bool:
        """Whether a request on this route may be served translated (its body then needs checking)."""
        return (
            cls != PASSTHROUGH and (method or "POST") == "POST"
            and path in TRANSLATED_ROUTES
        )

    def _eligible(self, method, path, cls, model, translatable=True) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The eligible members, and those of them that get the request translated."""
        # The [fallback] member serves nothing natively: translated embeddings only (members.py).
        members: Iterable[Member] = [m for m in self.members if not m.spec.fallback]
        others: list[Member] = []
        if path is not None:
            native = native_apis(self._apis, method or "POST", path)
            if native:
                members = [m for m in members if m.spec.api in native]
            if model and translatable and self.translates(method, path, cls):
                others = [
                    m for m in self.members
                    if (m.spec.fallback or (m.spec.api not in native and not serves_natively(m.spec.api, path)))
                    and cls in m.spec.classes and m.catalogue.serves(model)
                ]
                if others and not native:
                    members = []
        members = [m for m in members if cls in m.spec.classes]
        if model:
            serving = [m for m in members if m.catalogue.serves(model)]
            if serving or others:
                members = serving
        if others:
            chosen = {m.name for m in (*members, *others)}
            return tuple(m.name for m in self.members if m.name in chosen), tuple(m.name for m in others)
        return tuple(m.name for m in members), ()

    def usable(self, member: Member, entry: Entry) -> bool:
        """Available now, and (for an embedding) the model's reference or a verified twin."""
        return member.available() and self.twin_ok(member, entry)

    def choose(self, entry: Entry) -> Member | None:
        """The member ``entry`` goes to at once, or None: it parks (see the module docstring)."""
        best = None
        spare = None
        always_usable = False
        for name in entry.eligible:
            member = self._by_name[name]
            if not self.usable(member, entry):
                continue
            if member.spec.standby:
                # A standby copy (a CPU) takes no more than its cap, arrivals included, and none
                # while its drainer pauses after failures: the rest wait in the lot, in line for it
                # (its drainer lets them out as slots free).
                full = not member.drainer.can_start()
                if not full and not self._someone_waits(name) and (spare is None or member.inflight < spare.inflight):
                    spare = member
                continue
            always_usable = True
            if not self._someone_waits(name) and (best is None or member.inflight < best.inflight):
                best = member
        if best is not None:
            return best
        return spare if not always_usable else None

    def _someone_waits(self, name: str) -> bool:
        """A parked request ``name`` may take now waits (a new one must not overtake it).

        Counted first (O(1)); looked for only when a twin check may refuse some of them.
        """
        if not self._lot.waiting_for(name):
            return False
        if self.twin_ok is any_member:
            return True
        return self._lot.peek(self._by_name[name].drainer.accepts, name) is not None

    def all_held(self, entry: Entry) -> bool:
        """True when a hold applies to every member that may serve ``entry``: it waits for a yield to end.

        (Not merely for its turn, or for a preload: class policies and the
        hold budget apply only then.)
        """
        return all(self._state.yielded_for(name) for name in self.may_serve(entry))

    def none_coming_back(self, entry: Entry) -> bool:
        """At shutdown: every member that may serve ``entry`` is held or standby (a standby member
        takes no parked work once the proxy stops: what waits for it is answered at once)."""
        return all(self._state.yielded_for(name) or self._by_name[name].spec.standby for name in self.may_serve(entry))

    def may_serve(self, entry: Entry) -> tuple[str, ...]:
        """The eligible members the twin check lets serve ``entry`` (all eligible ones when it lets none).

        An embedding's twin that is not verified is no way out of a yield of
        its reference (it cannot be verified while the reference is held):
        the request waits for the reference, under its class's policy and
        hold bound.
        """
        if entry.kind != "embedding" or self.twin_ok is any_member:
            return entry.eligible
        names = tuple(name for name in entry.eligible if self.twin_ok(self._by_name[name], entry))
        return names or entry.eligible

    def may_take(self, name: str, entry: Entry) -> bool:
        """Whether ``name``'s drainer may let ``entry`` out of the lot now.

        A standby member only while no ``always`` member it is eligible for
        is usable; the member its last attempt failed on only while no other
        member (of the same use) is.
        """
        if name not in entry.eligible:
            return False
        member = self._by_name[name]
        if entry.failed_on == name and member.spec.fallback:
            return False  # a request the fallback failed waits for the others (its errors are never shown)
        if not self.twin_ok(member, entry):
            return False
        standby = member.spec.standby
        if standby or entry.failed_on == name:
            for other_name in entry.eligible:
                if other_name == name:
                    continue
                other = self._by_name[other_name]
                if (not other.spec.standby or (standby and entry.failed_on == name)) and self.usable(other, entry):
                    return False
        return True

    def passthrough_member(self, method: str, path: str, model: str | None) -> Member:
        """Where a request that runs no model goes: the first member whose api serves the route
        (the first serving ``model`` when it names one), available ones first."""
        native = native_apis(self._apis, method, path)
        serving = [m for m in self.members if not m.spec.fallback]
        candidates = [m for m in serving if m.spec.api in native] or serving
        if model:
            serving = [m for m in candidates if m.catalogue.serves(model)]
            candidates = serving or candidates
        for member in candidates:
            if member.available():
                return member
        return candidates[0]

    def members_serving(self, method: str, path: str) -> list[Member]:
        """Every member whose api serves ``method path`` natively, in config order."""
        native = native_apis(self._apis, method, path)
        return [m for m in self.members if m.spec.api in native and not m.spec.fallback]

    # -- the state of the pool --------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return sum(m.inflight for m in self.members)

    @property
    def release_held(self) -> bool:
        """Some member's release is held (a model preload after its yield)."""
        return any(m.drainer.release_held for m in self.members)

    @property
    def concurrency(self) -> int:
        """The replay slots of the available members (all of them when none is)."""
        caps = [m.drainer.concurrency for m in self.members if m.available()]
        return sum(caps) or sum(m.drainer.concurrency for m in self.members)

    def state_name(self, lot_empty: bool) -> str:
        """``yielded`` when no ``always`` member is available or handing over, ``unreachable`` when
        that is so because none of them has answered since the start (none held), ``draining``
        when the lot is not empty or a release is held, else ``available``."""
        always = [m for m in self.members if not m.spec.standby]
        coming = [
            m for m in always
            if not self._state.yielded_for(m.name) and not m.never_answered and not m.not_ready
        ]
        if not coming:
            if all(m.never_answered and not self._state.yielded_for(m.name) for m in always):
                return "unreachable"
            return "yielded"
        return "available" if lot_empty and not self.release_held else "draining"

    def status(self, shown: Callable[[float], float] = same) -> list[dict]:
        """The ``upstreams`` section of ``/status``: one row per member, in config order (times given to ``shown``)."""
        now = self._clock.seconds()
        return [
            {
                "name": m.name,
                "url": m.spec.url,
                "api": m.spec.api,
                "use": m.spec.use,
                "state": m.state_name(),
                "holds": [h.as_json(shown) for h in self._state.holds_for(m.name)],
                "inflight": m.inflight,
                "waiting": self._waiting(m),
                "replay_concurrency": m.drainer.concurrency,
                "classes": list(m.spec.classes),
                "models": m.catalogue.names(),
                "models_discovered": not m.catalogue.static and m.catalogue.discovered is not None,
                # What its outage verdicts rest on (upstream/served.py), and the models judged failing alone (upstream/failing.py).
                "served_models": [e.model for e in m.health.record.recent()],
                "failing_models": m.health.failing.as_json(now, shown),
            }
            for m in self.members
        ]

    def metric_rows(self) -> list[tuple[str, bool, int, int, int, str, tuple[str, ...]]]:
        """``(upstream, available, inflight, holds, waiting, state, hold sources)`` per member, for
        :func:`~yieldproxy.observe.metrics.pool_families` (one that never answered is not available there, though
        with no other upstream the proxy still sends it requests to fail at once)."""
        rows = []
        for m in self.members:
            holds = self._state.holds_for(m.name)
            rows.append((
                m.name, m.available() and not m.never_answered, m.inflight, len(holds),
                self._waiting(m), m.state_name(), tuple(sorted({h.source for h in holds})),
            ))
        return rows

    def _waiting(self, member: Member) -> int:
        """Parked requests ``member`` may take (for an embedding: as the reference or a verified twin;
        a standby member only what no always member may take), whether or not it is available now."""
        return self._lot.takeable(member.name, _Taker(self.may_take, member.name))

    def kick(self) -> None:
        """Wake every drainer (one of them may have work now)."""
        for member in self.members:
            member.drainer.kick()

    def stop(self) -> None:
        """The proxy stops: every drainer for good, every check."""
        for member in self.members:
            member.drainer.stop()
            member.stop()

    def drainer_open(self, name: str) -> bool:
        """Whether ``name``'s drainer has anything to look for, in O(members) (it walks its line only then)."""
        member = self._by_name[name]
        if not (self._lot.waiting_for(name) and member.available()):
            return False
        if (
            member.spec.standby and self.twin_ok is any_member
            and all(m.available() for m in self.members if not m.spec.standby)
        ):
            # Every always member takes what it may: a standby one only what none of them may.
            return self._lot.waiting_for(STANDBY_ONLY) > 0
        return True

    def member_changed(self, name: str, yielded: bool) -> None:
        """A member was taken or given back: its backoff starts afresh, and every drainer looks again
        (a standby member's turn depends on the others)."""
        if not yielded:
            self._by_name[name].drainer.reset_backoff()
        self.kick()


def _drainer_open(pool: Callable[[], Pool], name: str) -> bool:
    return pool().drainer_open(name)


def make_members(
    clock: IReactorTime, state: YieldState, lot: ParkingLot, metrics: Metrics, cooperator: Cooperator,
    config: Config, specs: Sequence[MemberSpec], shape: PoolShape,
    clients: Callable[[MemberSpec], tuple[Any, Any]] | None,
    pool: Callable[[], Pool], judges: Callable[[str], Judge | None] | None = None,
) -> tuple[Member, ...]:
    """Each member of ``specs`` with its drainer, health and catalogue (for ``service.build_heart``).

    ``shape`` is what their number decides (:func:`~.members.pool_shape`).
    ``pool()`` is the pool they will form (made after them): its routing
    decides what each drainer takes and when it is open, read when asked.
    ``clients(spec)`` gives each its request and control clients (None: neither).
    ``judges(name)`` gives a member's health the judge of its failures (its
    outage watcher's; None, or no ``judges``: no failure is forgiven).
    """
    up, replay = config.upstream, config.replay
    members = []
    for index, spec in enumerate(specs):
        upstream, control = clients(spec) if clients is not None else (None, None)
        described = member_server(spec.api, base_url=spec.fallback)
        # What it serves is kept only for calls an outage probe can make again (upstream/served.py).
        record = ServedRecord(clock, functools.partial(_probeable, described))
        drainer = Replayer(
            clock, lot, state, metrics, cooperator,
            concurrency=spec.replay_concurrency,
            rate=replay.rate if spec.rate is None else spec.rate,
            backoff_seconds=up.retry_backoff_seconds,
            backoff_max_seconds=up.retry_backoff_max_seconds,
            cautious=spec.fallback,
            # It lets out what its member may take, while its member is available.
            target=spec.name,
            accepts=_Taker(lambda name, entry: pool().may_take(name, entry), spec.name),
            is_open=functools.partial(_drainer_open, pool, spec.name),
            # With one member, its drainer ending its drain is the proxy's "now available" (its log line).
            says_drained=not shape.names_members,
        )
        members.append(
            Member(
                spec, index, clock, state, described,
                UpstreamHealth(spec.url, judge=judges(spec.name) if judges is not None else None, record=record),
                ModelCatalogue(spec.models, spec.model_map),
                drainer, upstream, control,
                recheck_seconds=up.health_interval_seconds, recheck_max_seconds=up.health_max_interval_seconds,
                check_timeout_seconds=up.health_timeout_seconds,
                on_reachable=lambda: pool().kick(),
                not_ready_max_seconds=up.not_ready_max_seconds,
                # The scope of its outage watcher's hold (and of its own stuck-loading one).
                outage_scope=shape.hold_scope(spec.name),
                log_name=shape.log_name(spec.name),
            )
        )
    return tuple(members)


def _probeable(server: Server, call: ModelCall) -> bool:
    """Whether an outage probe can make a call of ``call``'s kind on ``server`` (it has a minimal call)."""
    return server.minimal_call(call) is not None
