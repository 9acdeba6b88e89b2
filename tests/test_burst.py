"""The proof: a real Ollama client embeds a burst through a forced yield, and loses nothing.

The official ``ollama`` client runs in threads (it is blocking), the proxy and
the simulated backend in the reactor, all on 127.0.0.1.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import ollama
import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import config_with, in_thread, start_stack, wait_for
from rawhttp import counter_total
from yieldproxy.servers.base import PROBE_TEXT
from yieldproxy.tools.sim import expected_embedding

MODEL = "all-minilm"


class Burst:
    """Embeds ``texts`` through ``url`` with ``concurrency`` blocking clients, one text a call; records
    every outcome: ``done`` (answered), ``wrong`` (answered, not what the backend computes), ``failures``.

    Other bursts (another client, another call) override :meth:`_client` and :meth:`_call`.
    """

    def __init__(self, url: str, texts: list[str], concurrency: int):
        self.url = url
        self.texts = texts
        self.concurrency = concurrency
        self.done = 0
        self.failures: list[str] = []
        self.wrong: list[str] = []
        self._lock = threading.Lock()
        self._next = 0

    def _take(self) -> str | None:
        with self._lock:
            if self._next >= len(self.texts):
                return None
            text = self.texts[self._next]
            self._next += 1
            return text

    def _client(self):
        return ollama.Client(host=self.url, timeout=120)

    def _call(self, client, text: str) -> bool:
        """One call; True when its answer is exactly what the backend computes for it."""
        vector = client.embed(model=MODEL, input=text).embeddings[0]
        return list(vector) == expected_embedding(text, MODEL)

    def _worker(self) -> None:
        client = self._client()
        try:
            while (text := self._take()) is not None:
                try:
                    right = self._call(client, text)
                except Exception as e:  # every failure the caller would see
                    with self._lock:
                        self.failures.append(f"{text}: {type(e).__name__}: {e}")
                    continue
                with self._lock:
                    self.done += 1
                    if not right:
                        self.wrong.append(text)
        finally:
            client.close()

    def run(self) -> None:
        with ThreadPoolExecutor(self.concurrency) as pool:
            for _ in range(self.concurrency):
                pool.submit(self._worker)


def assert_clean(burst: Burst, stack) -> None:
    assert burst.failures == []
    assert burst.wrong == []
    assert burst.done == len(burst.texts)
    # The outage watcher's probes embed a text of their own; it is nobody's request.
    embedded = {text: n for text, n in stack.sim.texts_embedded.items() if text != PROBE_TEXT}
    assert set(embedded) == set(burst.texts)
    # A text embedded twice is only ever a counted retry of a failed attempt
    # (the backend answered, then the connection died before the answer arrived).
    extra = sum(n - 1 for n in embedded.values())
    assert extra <= stack.sample("yieldproxy_retries_total", **{"class": "batch"})
    assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0


@pytest_twisted.ensureDeferred
async def test_burst_survives_a_yield_with_zero_failures():
    """1,200 texts at concurrency 32, a 3 s yield mid-burst: all answered, all right, replay capped."""
    config = config_with(replay={"concurrency": 4})
    stack = await start_stack(reactor, config, latency=0.004, parallel=4)
    try:
        burst = Burst(stack.proxy_url, [f"burst text {i}" for i in range(1200)], concurrency=32)
        running = in_thread(reactor, burst.run, timeout=180)
        await wait_for(reactor, lambda: burst.done >= 300, timeout=60)
        stack.proxy.state.hold("api", "forced by the test", expected_seconds=3)
        # Every caller parked: nothing is in flight, and nothing reaches the backend while yielded.
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 32, timeout=10)
        assert stack.sim.in_flight == 0
        done_during_yield = burst.done
        stack.sim.reset_peak()
        stack.proxy.state.release("api")
        # The cap holds while the lot drains (replay.concurrency); callers that find it empty go straight
        # upstream, uncapped. The lot stays full while every caller parks behind the replay, unless a loaded
        # machine lets it empty before the burst ends: then what came after is not replay.
        await stack.proxy.lot.when_empty()
        peak_while_draining = stack.sim.peak_in_flight
        await running
        assert done_during_yield < len(burst.texts)
        assert_clean(burst, stack)
        # No attempt failed, so every text reached the backend exactly once.
        assert set(stack.sim.texts_embedded.values()) == {1}
        # From the resume until the lot was empty, the backend never saw more than the replay cap.
        assert peak_while_draining <= 4
        parked = stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"})
        assert parked >= 32
        assert stack.sample("yieldproxy_park_seconds_count", **{"class": "batch"}) >= 32
    finally:
        await stack.stop()


@pytest.mark.parametrize("mode", ["refuse", "error500", "hang", "reset"])
@pytest_twisted.ensureDeferred
async def test_burst_survives_each_outage_mode_under_a_yield(mode):
    """The backend fails in its own way as the GPU goes; requests caught mid-flight are replayed.

    Only the hanging backend is timed out (1 s); the others get a bound no loaded machine reaches, so
    each mode's failures are its own, however slow the machine is beside the test."""
    config = config_with(
        upstream={"attempt_timeout_seconds": 1.0 if mode == "hang" else 60.0},
        replay={"concurrency": 4},
    )
    stack = await start_stack(reactor, config, latency=0.01, parallel=4)
    try:
        burst = Burst(stack.proxy_url, [f"{mode} text {i}" for i in range(240)], concurrency=16)
        running = in_thread(reactor, burst.run, timeout=120)
        await wait_for(reactor, lambda: burst.done >= 40, timeout=60)
        # The GPU goes away first; the broker declares the yield once the proxy has seen it fail.
        await stack.sim.set_mode(mode)
        await wait_for(reactor, lambda: counter_total(stack, "yieldproxy_upstream_failures") > 0, timeout=10)
        stack.proxy.state.hold("broker", f"test {mode}")
        # Every caller's request is back in the lot (none still in flight to the failing backend).
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 16, timeout=10)
        await stack.sim.set_mode("ok")
        stack.proxy.state.release("broker")
        await running
        assert_clean(burst, stack)
        # "refuse" also drops the connections in use, so its first failures are resets.
        reasons = {"refuse": {"refused", "reset"}, "error500": {"gpu_error"}, "hang": {"timeout"}, "reset": {"reset"}}[mode]
        failures = {
            s.labels["reason"]: s.value
            for m in stack.proxy.metrics.registry.collect()
            if m.name == "yieldproxy_upstream_failures"
            for s in m.samples
            if s.name.endswith("_total")
        }
        assert set(failures) <= reasons and failures, failures
        assert stack.sample("yieldproxy_retries_total", **{"class": "batch"}) > 0
    finally:
        await stack.stop()
