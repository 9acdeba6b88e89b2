"""The regression matrix: whatever the upstream says or does, a real-client burst loses nothing (issue 16).

{declared yield, undeclared} x {refuse, reset, hang, 500 with known words,
500 with unknown words, stall after head} x {embed, chat stream}: in each cell a
burst of the official ``ollama`` client's calls runs through the proxy; mid-burst
the simulated backend fails that way for a short window (and, in the declared
row, the operator yields through ``POST /yield`` at the same moment and resumes
after it).  Every cell ends with 0 caller failures, every vector and every
streamed reply right, and the backend saw at most ``sent + 2 x concurrency``
model requests (the requests caught in flight, retried once, and the proxy's
own probes).

The cells are kept to a second or two each: small bursts, short windows, and
short timeouts and probe intervals (all upstream.* keys).
"""

from __future__ import annotations

import attrs
import ollama
import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import admin, config_with, in_thread, sleep, start_stack, wait_for
from rawhttp import counter_by, counter_total
from test_burst import Burst
from yieldproxy.config import UpstreamConfig
from yieldproxy.tools.sim import DEFAULT_CHAT_MODEL, expected_embedding, expected_reply, messages_prompt

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

EMBED_MODEL = "all-minilm"
#: The ways a backend fails, as the sim's modes (yieldproxy/tools/sim/modes.py) play them.
KINDS = {
    "refuse": "refuse",
    "reset": "reset",
    "hang": "hang",
    "500_known_words": "error500",
    "500_unknown_words": "error500_unknown",
    "stall_after_head": "stall_head",
}
SENT = 40
CONCURRENCY = 8
#: upstream.attempt_timeout_seconds, model_probe_timeout_seconds and stall_timeout_seconds in the cells
#: (a head then no body byte, ``stall_head``, ends at the attempt timeout, as a hang does):
#: short, yet long enough that a loaded machine does not time out a healthy call.
TIMEOUTS = 0.8
#: How long the backend keeps failing once every caller waits in the lot (so that the window is
#: decided by events, not by the speed of a loaded machine).
WINDOW = 0.3
TIMEOUT = 60
PATHS = {"embed": "/api/embed", "chat": "/api/chat"}

#: ``upstream.stall_timeout_seconds`` (a silence once an answer's body has begun), when this version has it.
HAS_STALL_TIMEOUT = "stall_timeout_seconds" in attrs.fields_dict(UpstreamConfig)


class Callers(Burst):
    """``CONCURRENCY`` blocking ``ollama`` clients sending ``SENT`` calls of one kind; every outcome recorded."""

    def __init__(self, url: str, route: str, tag: str):
        super().__init__(url, [f"{tag} {i}" for i in range(SENT)], CONCURRENCY)
        self.route = route

    def _client(self) -> ollama.Client:
        return ollama.Client(host=self.url, timeout=TIMEOUT)

    def _call(self, client: ollama.Client, text: str) -> bool:
        """One call; True when its answer is exactly what the backend computes for it."""
        if self.route == "embed":
            vector = client.embed(model=EMBED_MODEL, input=text).embeddings[0]
            return list(vector) == expected_embedding(text, EMBED_MODEL)
        messages = [{"role": "user", "content": text}]
        reply = "".join(
            part.message.content or "" for part in client.chat(model=DEFAULT_CHAT_MODEL, messages=messages, stream=True)
        )
        return reply == "".join(expected_reply(messages_prompt(messages), DEFAULT_CHAT_MODEL))


def matrix_config():
    upstream = {
        "attempt_timeout_seconds": TIMEOUTS,
        "model_probe_timeout_seconds": TIMEOUTS,
        "health_interval_seconds": 0.1,
        "health_max_interval_seconds": 0.4,
        "retry_backoff_seconds": 0.02,
        "retry_backoff_max_seconds": 0.05,
        # Fewer tries than a hang's window holds timeouts: an attempt the failure explains must not count.
        "max_attempts": 2,
    }
    if HAS_STALL_TIMEOUT:
        upstream["stall_timeout_seconds"] = TIMEOUTS
    return config_with(replay={"concurrency": 4}, upstream=upstream)


@pytest.mark.parametrize("route", ["embed", "chat"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
@pytest_twisted.ensureDeferred
async def test_a_real_client_burst_loses_nothing_whatever_the_upstream_does(declared, kind, route):
    stack = await start_stack(reactor, matrix_config(), watchers=True, latency=0.02, parallel=4)
    try:
        outage = next(s for s in stack.proxy.watchers if s.name == "watcher:outage")
        await wait_for(reactor, lambda: outage.reachable, timeout=10)
        callers = Callers(stack.proxy_url, route, f"{kind} {route}")
        running = in_thread(reactor, callers.run, timeout=TIMEOUT)
        await wait_for(reactor, lambda: callers.done >= CONCURRENCY, timeout=30)
        # The backend fails; in the declared row the operator yields at the same moment.
        # A GPU that fails fails the calls in progress too.
        failing = stack.sim.set_mode(KINDS[kind], in_flight=True)
        if declared:
            await admin(stack, "/yield", {"reason": "matrix", "source": "broker"})
        await failing
        if declared:
            # Every caller's request is back in the lot (the ones in flight failed and went back).
            await wait_for(reactor, lambda: len(stack.proxy.lot) == CONCURRENCY, timeout=30)
        else:
            # The proxy judged the failures an outage by itself (a probe of the same call failed too).
            await wait_for(reactor, lambda: stack.proxy.state.hold_of("outage") is not None, timeout=30)
        await sleep(reactor, WINDOW)
        await stack.sim.set_mode("ok")
        if declared:
            await admin(stack, "/resume", {"source": "broker"})
        await running
        backend = stack.sim.requests_total[PATHS[route]]
        print(
            f"matrix cell {'declared' if declared else 'undeclared'}/{kind}/{route}: "
            f"{len(callers.failures)} caller failures, {len(callers.wrong)} wrong, "
            f"{backend} backend requests (bound {SENT + 2 * CONCURRENCY})"
            + (f"; first failure: {callers.failures[0]}" if callers.failures else "")
        )
        assert callers.failures == [], callers.failures[:3]
        assert callers.wrong == []
        assert callers.done == SENT
        # Nothing left behind, every request answered 200 once.
        assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0
        assert counter_by(stack, "yieldproxy_requests", "code") == {"200": float(SENT)}
        # The backend saw each call, the calls caught by the failure once more, and the probes.
        assert backend <= SENT + 2 * CONCURRENCY, (backend, dict(stack.sim.requests_total))
        # The window did catch calls (the matrix tests what it says): in the undeclared row, the
        # proxy judged them an outage by itself.
        assert counter_total(stack, "yieldproxy_upstream_failures") > 0
        if not declared:
            assert stack.sample("yieldproxy_yields_total", source="outage") >= 1
    finally:
        await stack.stop()
