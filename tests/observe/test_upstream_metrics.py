"""The per-upstream series of docs/metrics.md ("The upstreams of a pool"), read from a real ``/metrics``.

A pool of two simulated Ollamas behind a proxy, through real sockets: every
series the docs list is in the exposition with its labels, and moves as the
docs say (and as the alert rules in ``etc/prometheus/yieldproxy-rules.yml``
rely on: a yielded upstream reads ``available 0`` with a hold, an unreachable
one ``available 0`` with none).
"""

from __future__ import annotations

import socket

import pytest_twisted
import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor

from helpers import admin, start_pool_stack, start_stack, wait_for

MODEL = "all-minilm"
TIMEOUT = 30.0

#: docs/metrics.md's table: family -> (type, label names of its samples, bar ``le``).
DOCUMENTED = {
    "yieldproxy_upstream_available": ("gauge", {"upstream"}),
    "yieldproxy_upstream_inflight_requests": ("gauge", {"upstream"}),
    "yieldproxy_upstream_holds": ("gauge", {"upstream"}),
    "yieldproxy_upstream_waiting_requests": ("gauge", {"upstream"}),
    "yieldproxy_upstream_attempts": ("counter", {"upstream", "outcome"}),
    "yieldproxy_upstream_attempt_seconds": ("histogram", {"upstream", "class"}),
}


class Scrape:
    """One ``GET /metrics``, parsed by prometheus_client's own parser."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def get(self, name: str, **labels) -> float:
        """The sample's value; 0 when the series is absent (a counter not yet incremented)."""
        for family in self.families.values():
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return s.value
        return 0.0

    def has(self, name: str, **labels) -> bool:
        return any(s.name == name and s.labels == labels for f in self.families.values() for s in f.samples)

    def label_sets(self, family: str) -> set[frozenset]:
        return {frozenset(k for k in s.labels if k != "le") for s in self.families[family].samples}

    def upstreams(self, family: str) -> set[str]:
        return {s.labels["upstream"] for s in self.families[family].samples}


async def scrape(stack) -> Scrape:
    answer = await treq.get(stack.admin_url + "/metrics", persistent=False).addTimeout(TIMEOUT, reactor)
    assert answer.code == 200
    return Scrape(await answer.text())


def embed(stack, text: str):
    return treq.post(stack.proxy_url + "/api/embed", json={"model": MODEL, "input": text}, persistent=False)


async def chatted(stack, text: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": False}
    answer = await treq.post(stack.proxy_url + "/api/chat", json=body, persistent=False).addTimeout(TIMEOUT, reactor)
    assert answer.code == 200, await answer.text()
    await answer.content()


async def embedded(stack, text: str) -> None:
    answer = await embed(stack, text).addTimeout(TIMEOUT, reactor)
    assert answer.code == 200, await answer.text()
    await answer.content()


@pytest_twisted.ensureDeferred
async def test_every_per_upstream_series_is_exported_with_its_labels_and_moves_as_documented():
    # b answers slowly enough to be seen in flight; both name the model, so the first request goes to a.
    stack = await start_pool_stack(
        reactor, [{"name": "a", "models": [MODEL]}, {"name": "b", "models": [MODEL], "sim": {"latency": 0.6}}]
    )
    try:
        m = await scrape(stack)
        for gauge in ("available", "inflight_requests", "holds", "waiting_requests"):
            family = f"yieldproxy_upstream_{gauge}"
            assert m.families[family].type == "gauge"
            assert m.label_sets(family) == {frozenset({"upstream"})}, family
            assert m.upstreams(family) == {"a", "b"}, family
        assert [m.get("yieldproxy_upstream_available", upstream=u) for u in "ab"] == [1, 1]
        assert [m.get("yieldproxy_upstream_holds", upstream=u) for u in "ab"] == [0, 0]
        assert m.families["yieldproxy_upstream_attempts"].type == "counter"
        assert m.families["yieldproxy_upstream_attempt_seconds"].type == "histogram"

        # An answered attempt: ok, on the upstream that served it (the first, both being idle).
        await embedded(stack, "one")
        m = await scrape(stack)
        assert m.get("yieldproxy_upstream_attempts_total", upstream="a", outcome="ok") == 1
        assert m.get("yieldproxy_upstream_attempt_seconds_count", upstream="a", **{"class": "batch"}) == 1
        assert not m.has("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok")
        for family, (kind, labels) in DOCUMENTED.items():
            assert m.families[family].type == kind
            assert m.label_sets(family) == {frozenset(labels)}, family

        # A yield of a alone: a reads 0 with a hold, b stays available and serves.
        await admin(stack, "/yield", {"upstream": "a", "source": "game"})
        m = await scrape(stack)
        assert m.get("yieldproxy_upstream_available", upstream="a") == 0
        assert m.get("yieldproxy_upstream_holds", upstream="a") == 1
        assert m.get("yieldproxy_upstream_available", upstream="b") == 1
        assert m.get("yieldproxy_upstream_holds", upstream="b") == 0
        await embedded(stack, "two")
        m = await scrape(stack)
        assert m.get("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok") == 1
        assert m.get("yieldproxy_upstream_attempts_total", upstream="a", outcome="ok") == 1

        # A hold of every upstream: a has two, b one; a request parks and waits for both.
        await admin(stack, "/yield", {"source": "broker"})
        parked = embed(stack, "three")
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1, timeout=TIMEOUT)
        m = await scrape(stack)
        assert [m.get("yieldproxy_upstream_holds", upstream=u) for u in "ab"] == [2, 1]
        assert [m.get("yieldproxy_upstream_available", upstream=u) for u in "ab"] == [0, 0]
        assert [m.get("yieldproxy_upstream_waiting_requests", upstream=u) for u in "ab"] == [1, 1]
        assert m.get("yieldproxy_yield_active") == 1

        # The broker resumes: b (a is still gaming) takes the parked request; it is in flight there.
        await admin(stack, "/resume", {"source": "broker"})
        await wait_for(reactor, lambda: stack.proxy.scheduler.inflight == 1, timeout=TIMEOUT)
        m = await scrape(stack)
        assert [m.get("yieldproxy_upstream_waiting_requests", upstream=u) for u in "ab"] == [0, 0]
        assert [m.get("yieldproxy_upstream_inflight_requests", upstream=u) for u in "ab"] == [0, 1]
        assert m.get("yieldproxy_inflight_requests") == 1
        answer = await parked.addTimeout(TIMEOUT, reactor)
        assert answer.code == 200
        await answer.content()
        m = await scrape(stack)
        assert m.get("yieldproxy_upstream_inflight_requests", upstream="b") == 0
        assert m.get("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok") == 2
        assert m.get("yieldproxy_upstream_attempt_seconds_count", upstream="b", **{"class": "batch"}) == 2
        assert m.get("yieldproxy_upstream_attempt_seconds_sum", upstream="b", **{"class": "batch"}) >= 1.0

        # The game ends; then a's GPU resets connections: the failed attempt counts by its reason
        # (and in the histogram), and b answers the request.
        await admin(stack, "/resume", {"source": "game"})
        m = await scrape(stack)
        assert [m.get("yieldproxy_upstream_available", upstream=u) for u in "ab"] == [1, 1]
        await stack.sims["a"].set_mode("reset")
        await embedded(stack, "four")
        m = await scrape(stack)
        assert m.get("yieldproxy_upstream_attempts_total", upstream="a", outcome="reset") == 1
        assert m.get("yieldproxy_upstream_attempt_seconds_count", upstream="a", **{"class": "batch"}) == 2
        assert m.get("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok") == 3
        assert m.get("yieldproxy_upstream_failures_total", reason="reset", **{"class": "batch"}) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_an_unreachable_upstream_reads_unavailable_without_a_hold_while_the_other_serves():
    """What YieldproxyUpstreamUnavailable looks for: ``available 0`` and ``holds 0``, the pool still serving."""
    # Bound, never listening: connections to it are refused, and no other process can take the port.
    closed_socket = socket.socket()
    closed_socket.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{closed_socket.getsockname()[1]}"
    # Both name the model, so a is tried first (not passed over once b's model list is read).
    # Chat, not embeddings: b is a's unverified twin (a never answered), so b serves none of its embeddings.
    stack = await start_pool_stack(
        reactor, [{"name": "a", "url": closed, "models": [MODEL]}, {"name": "b", "models": [MODEL]}]
    )
    try:
        for i in range(3):
            await chatted(stack, f"around {i}")
        await wait_for(reactor, lambda: stack.proxy.scheduler.members[0].unreachable, timeout=TIMEOUT)
        m = await scrape(stack)
        assert m.get("yieldproxy_upstream_available", upstream="a") == 0
        assert m.get("yieldproxy_upstream_holds", upstream="a") == 0
        assert m.get("yieldproxy_upstream_available", upstream="b") == 1
        assert m.get("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok") == 3
        assert m.get("yieldproxy_yield_active") == 0
    finally:
        await stack.stop()
        closed_socket.close()


@pytest_twisted.ensureDeferred
async def test_a_single_upstream_is_the_pool_of_one_named_default():
    """Without ``[[upstreams]]`` the same series exist, ``upstream="default"``, beside the unlabelled ones."""
    stack = await start_stack(reactor)
    try:
        await embedded(stack, "alone")
        await admin(stack, "/yield", {"source": "game"})
        m = await scrape(stack)
        for family in DOCUMENTED:
            assert m.upstreams(family) == {"default"}, family
        assert m.get("yieldproxy_upstream_attempts_total", upstream="default", outcome="ok") == 1
        assert m.get("yieldproxy_upstream_available", upstream="default") == 0
        assert m.get("yieldproxy_upstream_holds", upstream="default") == 1
        assert m.get("yieldproxy_yield_active") == 1
    finally:
        await stack.stop()
