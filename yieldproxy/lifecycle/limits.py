"""The process's open-file budget: enough descriptors for every connection the config allows.

At start :func:`fit_fd_limit` raises the soft limit as far as the config
needs (never past the hard limit), and when even the hard limit is too low
it lowers the proxy's connection cap to what fits, instead of failing later
under load: docs/security.md (*The open-file limit*).
"""

from __future__ import annotations

import resource
from typing import Callable

import attrs
from twisted.logger import Logger

from ..config import CONNECTION_HEADROOM, Config, proxy_max_connections
from ..edge.capacity import MAX_REFUSING

log = Logger()

#: Descriptors for everything but connections: the reactor's own, log files, the
#: state file, command probes, connections being refused, bursts of accepts.
RESERVE = 128 + 2 * MAX_REFUSING
#: The proxy keeps at least this many connections, however low the limit.
MIN_CONNECTIONS = 16


@attrs.frozen
class FdBudget:
    """What the limit was, what it is now, and the connection cap that fits in it."""

    #: Descriptors the config needs (see :func:`fd_budget`).
    need: int
    soft_before: int
    soft: int
    hard: int
    #: The proxy listener's connection cap that fits (the configured one when it does).
    max_connections: int
    warnings: tuple[str, ...] = ()
    #: ``parking.max_parked``: the configured one, or the default sized to the connections that fit.
    max_parked: int = 0
    #: What was sized to the limit, where the operator had set nothing (an info line, no warning).
    sized: str = ""


def _text(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def fd_budget(
    config: Config,
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> FdBudget:
    """Raise the soft ``RLIMIT_NOFILE`` towards what ``config`` needs (docs/security.md, *The open-file
    limit*: two descriptors a proxy connection, and the rest); the cap that fits."""
    cap = proxy_max_connections(config)
    fallback = config.fallback.concurrency + 2 if config.fallback.enabled else 0
    others = config.admin.max_connections + config.upstream.max_connections + fallback + RESERVE
    need = 2 * cap + others
    soft_before, hard = getrlimit(resource.RLIMIT_NOFILE)
    soft = soft_before
    warnings = []
    infinite = resource.RLIM_INFINITY
    if soft != infinite and soft < need:
        target = need if hard == infinite else min(need, hard)
        if target > soft:
            try:
                setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as e:
                warnings.append(f"could not raise the open-file limit from {soft} to {target}: {e}")
    explicit = config.explicit
    # The connection cap is the operator's when proxy.max_connections is set, or follows from
    # parking.max_parked when that is; with neither set, both are defaults sized here.
    asked = bool(config.proxy.max_connections) or "parking.max_parked" in explicit
    parked_asked = "parking.max_parked" in explicit
    parked = config.parking.max_parked
    sized = ""
    if soft != infinite and soft < need:
        fitted = max(MIN_CONNECTIONS, (soft - others) // 2)
        if asked:
            key = "proxy.max_connections" if config.proxy.max_connections else "parking.max_parked"
            warnings.append(
                f"the open-file limit is {soft} (hard limit {_text(hard)}), below the {need} this config needs "
                f"({cap} client connections, each with its upstream connection, + {others} for the admin "
                f"listener, the upstream pool and the process); taking at most {fitted} client connections "
                f"instead of {cap}. Raise the limit (LimitNOFILE= in the systemd unit, ulimit -n) or lower "
                f"{key}"
            )
        else:
            sized = f"at most {fitted} client connections (not {cap})"
        cap = min(cap, fitted)
    if cap < parked and not parked_asked:
        # The default parked ceiling, within the connections the limit allows (room kept for
        # requests in flight and passthrough calls); never below a class's own explicit ceiling.
        fitted_parked = max(1, cap - min(CONNECTION_HEADROOM, cap // 2))
        floor = max((c.max_parked for c in config.classes.values()), default=0)
        parked = max(fitted_parked, floor)
        sized += f"{', ' if sized else ''}{parked} parked requests (not {config.parking.max_parked})"
    if cap < parked:
        key = "parking.max_parked" if parked_asked else "classes.*.max_parked"
        warnings.append(
            f"at most {cap} client connections at once, fewer than {key} "
            f"({parked}): the parked queue can never fill"
        )
    return FdBudget(need, soft_before, soft, hard, cap, tuple(warnings), parked, sized)


def fit_fd_limit(
    config: Config,
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> Config:
    """:func:`fd_budget`, logged; ``config`` with the connection cap that fits."""
    budget = fd_budget(config, getrlimit, setrlimit)
    if budget.soft != budget.soft_before:
        log.debug(
            "open-file limit raised from {before} to {after} (hard limit {hard})",
            before=budget.soft_before, after=budget.soft, hard=_text(budget.hard),
        )
    if budget.sized:
        log.debug(
            "the open-file limit is {soft} (hard limit {hard}): the defaults are sized to it, {sized}; "
            "raise LimitNOFILE= (ulimit -n) for more, or set proxy.max_connections and parking.max_parked",
            soft=_text(budget.soft), hard=_text(budget.hard), sized=budget.sized,
        )
    for warning in budget.warnings:
        log.warn("{warning}", warning=warning)
    if budget.max_connections != proxy_max_connections(config):
        config = config.sized(**{"proxy.max_connections": budget.max_connections})
    if budget.max_parked != config.parking.max_parked:
        config = config.sized(**{"parking.max_parked": budget.max_parked})
    return config
