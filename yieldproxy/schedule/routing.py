"""Where a request may go: its :class:`Routing`, decided once at admission from the members' specs.

The rules (route, class, model, translated embeddings) are docs/pool.md's "Eligible"
and "A CPU copy for embeddings"; a member's availability is not part of a routing,
since it changes while the request waits.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from ..names import PASSTHROUGH
from ..servers import native_apis
from ..upstream.pool.member import Member
from ..upstream.pool.routing import TRANSLATED_ROUTES, serves_natively

#: What an entry's route does: ``embedding`` routes are the ones whose answers a vector store keeps (a
#: member serves them only as the model's reference or a verified twin), ``generation`` the others.
ROUTE_KINDS = ("embedding", "generation", "other")
#: Eligibility decisions kept (by method, path, class and model); past this the cache starts over.
_CACHE_LIMIT = 4096
#: Last path segments of the routes that return embeddings.
_EMBEDDING_ROUTES = frozenset({"embed", "embeddings", "embedding", "embed_all", "embed_sparse"})


@attrs.frozen
class Routing:
    """What decides where a request may go: its model, its route's kind, the members eligible for it.

    One shared value for every request with the same route, class and model, so a parked
    request carries one reference, not three.
    """

    #: The pool members that may serve it, in config order.
    eligible: tuple[str, ...] = ()
    #: The model its body names (None: none).
    model: str | None = None
    #: :data:`ROUTE_KINDS`.
    kind: str = "other"
    #: Every eligible member is a standby one (``use = "when_others_yielded"``): no ``always`` member
    #: may ever take it (counted as :data:`~.lines.STANDBY_ONLY` in the lines).
    standby_only: bool = False
    #: The eligible members that serve it only in another dialect: an embedding request translated
    #: into their own embedding route and back (upstream/translated_attempt.py).
    translated: frozenset[str] = frozenset()


def route_kind(path: str | None, cls: str) -> str:
    """``embedding``, ``generation`` or ``other`` (:data:`ROUTE_KINDS`)."""
    if cls == PASSTHROUGH or path is None:
        return "other"
    return "embedding" if path.rsplit("/", 1)[-1] in _EMBEDDING_ROUTES else "generation"


@attrs.define(eq=False)
class Eligibility:
    """The members' answer to "who may serve this route, class and model", cached per key."""

    members: tuple[Member, ...]
    _by_name: dict[str, Member] = attrs.field(init=False)
    _apis: tuple[str, ...] = attrs.field(init=False)
    _cache: dict[tuple[str | None, str | None, str, str | None, bool], Routing] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self._by_name = {m.name: m for m in self.members}
        self._apis = tuple(m.spec.api for m in self.members if not m.spec.fallback)

    def forget(self) -> None:
        """A member's model list changed: the cached decisions are dropped."""
        self._cache.clear()

    def routing(
        self, method: str | None, path: str | None, cls: str, model: str | None, translatable: bool = True
    ) -> Routing:
        """The members eligible for a request, in config order (``translatable``: False when its body
        cannot be translated into another server's embedding request)."""
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

    @staticmethod
    def translates(method: str | None, path: str | None, cls: str) -> bool:
        """Whether a request on this route may be served translated (its body then needs checking)."""
        return cls != PASSTHROUGH and (method or "POST") == "POST" and path in TRANSLATED_ROUTES

    def _eligible(
        self, method: str | None, path: str | None, cls: str, model: str | None, translatable: bool = True
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
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
