"""Every Prometheus metric yieldproxy exports, on a registry passed in.

One :class:`Metrics` per application, so building the app twice (as the tests
do) never collides in prometheus_client's default registry.  Names and labels
here are part of the public contract (dashboards and alert rules read them).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..names import CLASS_NAMES, WATCHER_SOURCES

#: Time spent parked: from 10 ms (a short flap) to an hour (a long job's bound).
PARK_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
#: Upstream answer times: embeddings take milliseconds, generations minutes.
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Whole yields: a game session can last hours.
YIELD_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400)
#: VRAM handover steps: an unload takes a second, a large model's load a minute or two.
HANDOVER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]


class _LiveCollector:
    """Gauges read from the live objects at scrape time, so they cannot drift."""

    def __init__(self, read: Callable[[], Iterable[GaugeMetricFamily]]):
        self._read = read

    def collect(self):
        return self._read()


@attrs.define(eq=False, slots=False)
class Metrics:
    """All metric objects of one proxy."""

    registry: CollectorRegistry = attrs.field(factory=CollectorRegistry)

    def __attrs_post_init__(self) -> None:
        gauge = functools.partial(Gauge, registry=self.registry)
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self.yield_active = gauge(
            "yieldproxy_yield_active",
            "1 while the GPU is yielded: any hold on a single upstream; in a pool, every always upstream held.",
        )
        self.parked_requests = gauge(
            "yieldproxy_parked_requests", "Requests parked right now.", ["class"]
        )
        self.parked_bytes = gauge(
            "yieldproxy_parked_bytes", "Request body bytes held by parked requests."
        )
        self.parked_capacity = gauge(
            "yieldproxy_parked_capacity", "The parked-queue ceiling (parking.max_parked)."
        )
        self.parked_bytes_capacity = gauge(
            "yieldproxy_parked_bytes_capacity",
            "The parked-bytes ceiling (parking.max_parked_bytes).",
        )
        self.park_seconds = histogram(
            "yieldproxy_park_seconds",
            "Time a request spent parked, observed when it leaves the lot for any reason.",
            ["class"],
            buckets=PARK_BUCKETS,
        )
        self.replay_total = counter(
            "yieldproxy_replay",
            "Parked requests by how they ended: ok, upstream_error, expired, abandoned, rejected, shutdown, "
            "fallback (served by the CPU fallback from the lot).",
            ["class", "outcome"],
        )
        self.rejected_total = counter(
            "yieldproxy_rejected",
            "Requests refused at once: queue_full, over_budget, policy, too_large, bad_request.",
            ["class", "reason"],
        )
        self.refused_at_once_total = counter(
            "yieldproxy_refused_at_once",
            "Requests the upstream would refuse at once, answered at once in its own words, never parked: "
            "origin (its CORS check), unknown_route, bad_body.",
            ["reason"],
        )
        self.requests_total = counter(
            "yieldproxy_requests",
            "Every request taken, once, by class and the status the client got (499: it went away first).",
            ["class", "code"],
        )
        self.upstream_seconds = histogram(
            "yieldproxy_upstream_seconds",
            "Time from sending a request upstream to the end of its answer.",
            ["class"],
            buckets=UPSTREAM_BUCKETS,
        )
        self.upstream_failures_total = counter(
            "yieldproxy_upstream_failures",
            "Failed upstream attempts: refused, connect, reset, timeout, stall, status_502, status_503, gpu_error, "
            "unknown_error, caller_error, bad_answer.",
            ["class", "reason"],
        )
        self.retries_total = counter(
            "yieldproxy_retries",
            "Failed attempts that went back into the lot to be tried again.",
            ["class"],
        )
        self.forgiven_attempts_total = counter(
            "yieldproxy_forgiven_attempts",
            "Failed attempts not counted against upstream.max_attempts because a recognised outage "
            "explained them (a probe of a model the upstream is known to serve failed too, or the GPU was yielded).",
            ["class"],
        )
        self.outage_probes_total = counter(
            "yieldproxy_outage_probes",
            "Outage probes sent, by probe (health: upstream.health_path; model: a minimal call of the "
            "kind that failed) and result (up, down, not_ready), per upstream.",
            ["upstream", "probe", "result"],
        )
        self.failures_alone_total = counter(
            "yieldproxy_failures_alone",
            "Failed attempts of the outage kind judged the call's own, not an outage (its model fails alone "
            "while the upstream serves others), per upstream, by the failure's reason and the evidence: probe "
            "(a model the upstream is known to serve passed a probe) or none (no model known to probe with).",
            ["upstream", "reason", "evidence"],
        )
        self.client_buffered_bytes = gauge(
            "yieldproxy_client_buffered_bytes",
            "Bytes of answers waiting in the proxy for slow clients to read them "
            "(bounded by proxy.slow_client_buffer_bytes per answer and proxy.slow_client_buffer_total_bytes).",
        )
        self.slow_clients_dropped_total = counter(
            "yieldproxy_slow_clients_dropped",
            "Clients dropped because their unread answer passed a slow-client buffer bound (counted as 499).",
            ["class"],
        )
        self.upstream_attempts_total = counter(
            "yieldproxy_upstream_attempts",
            "Attempts sent to each pool member, by how they ended: ok, a retryable failure's reason (refused, "
            "connect, reset, timeout, stall, status_502, status_503, gpu_error), broken (failed mid-answer), stall, "
            "abandoned, slow_client, error.",
            ["upstream", "outcome"],
        )
        self.upstream_attempt_seconds = histogram(
            "yieldproxy_upstream_attempt_seconds",
            "Time from sending an attempt to a pool member to the end of its answer (or its failure).",
            ["upstream", "class"],
            buckets=UPSTREAM_BUCKETS,
        )
        self.inflight_requests = gauge(
            "yieldproxy_inflight_requests", "Requests sent upstream and not yet answered."
        )
        self.yields_total = counter(
            "yieldproxy_yields",
            "Holds taken on the GPU, by source: yieldproxy's own and admin.known_sources by name, the rest as other.",
            ["source"],
        )
        self.yield_seconds = histogram(
            "yieldproxy_yield_seconds",
            "Length of whole yields (first hold taken to last hold ended).",
            buckets=YIELD_BUCKETS,
        )
        self.fallback_total = counter(
            "yieldproxy_fallback",
            "Requests of a fallback-policy class arriving during a yield, once each, by what became of them at "
            "the fallback: ok (served, at once or from the lot), failed_parked, abandoned, skipped_unverified, "
            "skipped_unsupported, skipped_busy (waited in line and left the lot before a slot came).",
            ["class", "outcome"],
        )
        self.watcher_errors_total = counter(
            "yieldproxy_watcher_errors",
            "Watcher steps that failed (a probe that could not run, timed out or said neither yes nor no; "
            "an unreadable or malformed state file; a signal handler that could not be installed).",
            ["watcher"],
        )
        self.handover_seconds = histogram(
            "yieldproxy_handover_seconds",
            "Time each VRAM handover step took, per upstream: wait_inflight, unload, preload.",
            ["upstream", "step"],
            buckets=HANDOVER_BUCKETS,
        )
        self.handover_total = counter(
            "yieldproxy_handover",
            "VRAM handover steps by upstream and outcome: ok, timeout, error, cancelled.",
            ["upstream", "step", "outcome"],
        )
        for cls in CLASS_NAMES:
            self.parked_requests.labels(cls)
        for watcher in WATCHER_SOURCES:
            self.watcher_errors_total.labels(watcher)

    def outage_probes_of(self, upstream: str) -> None:
        """Show ``upstream``'s outage probe counters at 0 before its first probe (its watcher is made)."""
        for probe in ("health", "model"):
            for result in ("up", "down", "not_ready"):
                self.outage_probes_total.labels(upstream, probe, result)

    def watch(self, read: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        """Register gauges computed at scrape time from live state."""
        self.registry.register(_LiveCollector(read))

    def render(self) -> bytes:
        """The text exposition, synchronously (no thread pool, unlike prometheus_client.twisted)."""
        return generate_latest(self.registry)


#: The ``source`` label of ``yieldproxy_yields_total`` for a source not known by name.
OTHER_SOURCE = "other"


def source_label(source: str, known: Iterable[str]) -> str:
    """The counter label for ``source``: its name when known, else ``other``.

    A counter keeps every label value it ever saw, so a caller that made up a
    new source for each yield would grow ``/metrics`` without bound.
    """
    return source if source in known else OTHER_SOURCE


def hold_families(holds, now: float) -> list[GaugeMetricFamily]:
    """Per-source hold gauges, built from the current holds at each scrape.

    A source holding several pool members is one series: its oldest hold's
    age, and the longest duration it said to expect.
    """
    active = GaugeMetricFamily("yieldproxy_hold_active", "1 for each source holding the GPU.", labels=["source"])
    age = GaugeMetricFamily("yieldproxy_hold_age_seconds", "How long each hold has lasted.", labels=["source"])
    expected = GaugeMetricFamily(
        "yieldproxy_hold_expected_seconds",
        "The duration each hold's source said to expect (absent when it gave none).",
        labels=["source"],
    )
    ages: dict[str, float] = {}
    expects: dict[str, float] = {}
    for hold in holds:
        ages[hold.source] = max(ages.get(hold.source, 0.0), now - hold.since)
        if hold.expected_end is not None:
            expects[hold.source] = max(expects.get(hold.source, 0.0), hold.expected_end - hold.since)
    for source, held in ages.items():
        active.add_metric([source], 1)
        age.add_metric([source], max(0.0, held))
        if source in expects:
            expected.add_metric([source], max(0.0, expects[source]))
    return [active, age, expected]


#: The ``state`` label values of ``yieldproxy_upstream_state``: what ``/status`` says of a pool member
#: (:meth:`~yieldproxy.upstream.pool.member.Member.state_name`).
UPSTREAM_STATES = ("available", "yielded", "outage", "unreachable", "not_ready", "handing_over")


def pool_families(rows) -> list[GaugeMetricFamily]:
    """Per pool member: available now, its state, in flight, holds on it (and whose), parked requests it could take.

    ``rows`` holds ``(upstream, available, inflight, holds, waiting, state, hold sources)``.
    """
    available = GaugeMetricFamily(
        "yieldproxy_upstream_available",
        "1 while the pool member takes requests (no hold on it, not handing over, not loading, and it has "
        "answered since the start), else 0.",
        labels=["upstream"],
    )
    states = GaugeMetricFamily(
        "yieldproxy_upstream_state",
        "1 for each pool member's current state, 0 for the others: available, yielded (a yield holds it), "
        "outage (only the proxy's own outage or loading holds), unreachable (not answered since the start), "
        "not_ready (loading its model), handing_over (models loaded back after its yield).",
        labels=["upstream", "state"],
    )
    inflight = GaugeMetricFamily(
        "yieldproxy_upstream_inflight_requests", "Requests at each pool member now.", labels=["upstream"]
    )
    holds = GaugeMetricFamily(
        "yieldproxy_upstream_holds",
        "Holds on each pool member now (its own, and those of every member).",
        labels=["upstream"],
    )
    sources = GaugeMetricFamily(
        "yieldproxy_upstream_hold_active",
        "1 for each source holding each pool member (its own holds and those of every member): who yielded it.",
        labels=["upstream", "source"],
    )
    waiting = GaugeMetricFamily(
        "yieldproxy_upstream_waiting_requests",
        "Parked requests each pool member may serve (it drains them when available).",
        labels=["upstream"],
    )
    for name, is_available, in_flight, held, parked, state, holders in rows:
        available.add_metric([name], 1 if is_available else 0)
        for value in UPSTREAM_STATES:
            states.add_metric([name, value], 1 if value == state else 0)
        inflight.add_metric([name], in_flight)
        holds.add_metric([name], held)
        for source in holders:
            sources.add_metric([name, source], 1)
        waiting.add_metric([name], parked)
    return [available, states, inflight, holds, sources, waiting]


def connection_families(listeners) -> list:
    """Open connections, the cap and the refusals per listener (``proxy``, ``admin``).

    ``listeners`` maps a listener's name to its :class:`~yieldproxy.edge.capacity.Connections`.
    """
    current = GaugeMetricFamily(
        "yieldproxy_connections", "Client connections open now, per listener.", labels=["listener"]
    )
    limit = GaugeMetricFamily(
        "yieldproxy_connections_limit",
        "The connection cap per listener (proxy.max_connections, admin.max_connections).",
        labels=["listener"],
    )
    refused = CounterMetricFamily(
        "yieldproxy_connections_refused",
        "Connections refused because the listener was at its cap (answered 503, or closed under a flood).",
        labels=["listener"],
    )
    reclaimed = CounterMetricFamily(
        "yieldproxy_connections_reclaimed",
        "Idle keep-alive connections closed to make room for a new one at the cap.",
        labels=["listener"],
    )
    receiving = GaugeMetricFamily(
        "yieldproxy_receiving_bytes",
        "Bytes of request bodies being received now, per listener (a declared length counts whole).",
        labels=["listener"],
    )
    receiving_limit = GaugeMetricFamily(
        "yieldproxy_receiving_limit_bytes",
        "The bound on bodies being received at once (proxy.max_receiving_bytes); none for the admin listener.",
        labels=["listener"],
    )
    for name, connections in listeners.items():
        current.add_metric([name], connections.open)
        limit.add_metric([name], connections.limit)
        refused.add_metric([name], connections.refused)
        reclaimed.add_metric([name], connections.reclaimed)
        receiving.add_metric([name], connections.receiving)
        if connections.max_receiving_bytes is not None:
            receiving_limit.add_metric([name], connections.max_receiving_bytes)
    return [current, limit, refused, reclaimed, receiving, receiving_limit]


def oldest_parked_family(ages: dict[str, float]) -> GaugeMetricFamily:
    """Age of the oldest parked request per class (0 when none is parked)."""
    fam = GaugeMetricFamily(
        "yieldproxy_oldest_parked_seconds", "Age of the oldest parked request per class.", labels=["class"]
    )
    for cls in CLASS_NAMES:
        fam.add_metric([cls], ages.get(cls, 0.0))
    return fam


def fallback_families(rows) -> list[GaugeMetricFamily]:
    """Per mapped model: may the fallback be used now, and the worst cosine of its last verification.

    ``rows`` holds ``(model, verified, worst_cosine)``; a model never compared
    has no ``yieldproxy_fallback_min_cosine`` series.
    """
    verified = GaugeMetricFamily(
        "yieldproxy_fallback_verified",
        "1 while the fallback may serve this model (last verification passed and is recent enough), else 0.",
        labels=["model"],
    )
    worst = GaugeMetricFamily(
        "yieldproxy_fallback_min_cosine",
        "The lowest cosine between primary and fallback over the probe texts, at the last verification.",
        labels=["model"],
    )
    for model, ok, cosine in rows:
        verified.add_metric([model], 1 if ok else 0)
        if cosine is not None:
            worst.add_metric([model], cosine)
    return [verified, worst]
