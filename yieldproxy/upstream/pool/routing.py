"""The pool's members made from their specs, and which api serves which embedding route natively.

Which member a request goes to is the scheduler's decision (yieldproxy/schedule/); the rules
are docs/pool.md's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from twisted.internet.interfaces import IReactorTime

from ...config import Config
from ...lot.state import YieldState
from ...servers import ModelCall, Server, server
from ..health import Judge, UpstreamHealth
from ..served import ServedRecord
from ..translation import EMBED_ROUTES
from .member import Member
from .members import MemberSpec, PoolShape, member_server
from .models import ModelCatalogue

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


def make_members(
    clock: IReactorTime, state: YieldState, config: Config, specs: Sequence[MemberSpec], shape: PoolShape,
    clients: Callable[[MemberSpec], tuple[Any, Any]] | None = None, judges: Callable[[str], Judge | None] | None = None,
) -> tuple[Member, ...]:
    """Each member of ``specs`` with its health and catalogue (for ``service.build_heart``).

    ``shape`` is what their number decides (:func:`~.members.pool_shape`).
    ``clients(spec)`` gives each its request and control clients (None: neither).
    ``judges(name)`` gives a member's health the judge of its failures (its
    outage watcher's; None, or no ``judges``: no failure is forgiven).
    """
    up = config.upstream
    members = []
    for index, spec in enumerate(specs):
        upstream, control = clients(spec) if clients is not None else (None, None)
        described = member_server(spec.api, base_url=spec.fallback)
        # What it serves is kept only for calls an outage probe can make again (upstream/served.py).
        record = ServedRecord(clock, functools.partial(_probeable, described))
        members.append(
            Member(
                spec, index, clock, state, described,
                UpstreamHealth(spec.url, judge=judges(spec.name) if judges is not None else None, record=record),
                ModelCatalogue(spec.models, spec.model_map),
                upstream, control,
                recheck_seconds=up.health_interval_seconds, recheck_max_seconds=up.health_max_interval_seconds,
                check_timeout_seconds=up.health_timeout_seconds,
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
