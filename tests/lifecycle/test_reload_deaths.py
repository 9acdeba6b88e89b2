"""A reload with a thousand parked requests and more arriving, while one process or the other dies or is stopped.

Real ``twistd -n yieldproxy`` processes (test_reload.Proxy) in front of the
simulated Ollama, which counts every text it embeds.  A thousand clients
(tests/crowd.py: one thread, raw sockets) park an embedding each while the
GPU is yielded, and a new client arrives every 10 ms throughout.  At a moment
of the handover the test names (lifecycle/succession/moments.py: the copy of the
package the processes run signals one of them there), a process dies or is
stopped:

* the new process killed (``kill -9``) or stopped (SIGTERM) while it holds
  part of the lot, or killed as the commit reaches it, with no hold on the
  GPU (so that whatever a new process let out would reach it at once): the
  old process takes everything back, keeps serving, and says so in one
  line; nothing reaches the GPU meanwhile, and after a reload that goes
  through every client is answered 200 with its own vector, every text
  embedded once;
* the old process stopped while the new one holds part of the lot, while
  the commit's outcome is awaited, or as it reads it, and the new process
  stopped as it commits: a stop is a stop, of both; every client is answered, 503 with
  ``Retry-After`` (the GPU is yielded), or finds nothing listening any more
  (refused: it never connected); none is reset or closed without an answer,
  and nothing reaches the GPU.
"""

from __future__ import annotations

import collections
import json

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall

from crowd import Crowd
from helpers import embedded, in_thread, wait_for
from rawhttp import request_bytes
from test_reload import MODEL, Proxy, children_of, embed_body, gone
from yieldproxy.tools.sim import SimOllama, expected_embedding

pytestmark = pytest.mark.heavy

PARKED = 1000
#: Seconds between two arriving clients.
ARRIVAL_EVERY = 0.01


def embed_request(text: str) -> bytes:
    return request_bytes(b"POST", b"/api/embed", [(b"Connection", b"close")], embed_body(text))


class Arrivals:
    """A new client every :data:`ARRIVAL_EVERY` seconds while it runs."""

    def __init__(self, crowd: Crowd, label: str):
        self._crowd = crowd
        self._label = label
        self.texts: list[str] = []
        self._loop = LoopingCall(self._one)
        self._loop.clock = reactor
        self._loop.start(ARRIVAL_EVERY)

    def _one(self) -> None:
        text = f"{self._label} {len(self.texts)}"
        self.texts.append(text)
        self._crowd.send([text])

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()


async def parked_crowd(proxy: Proxy, label: str) -> Crowd:
    """A yield, and :data:`PARKED` clients parked behind it."""
    code, _ = await proxy.post("/yield", {"reason": "game", "source": "broker"})
    assert code == 200
    crowd = Crowd(proxy.proxy_port, embed_request)
    crowd.send([f"{label} {i}" for i in range(PARKED)])
    await proxy.until_parked(PARKED, tries=1200)
    assert (await proxy.status())["parked_total"] == PARKED
    return crowd


def lines(proxy: Proxy, words: str) -> list[str]:
    return [line for line in proxy.child.text().splitlines() if words in line]


#: The old process's lot stays parked although no hold is on the GPU: its model preload (handover.preload_models)
#: after the yield is held by the simulated Ollama, and holds the release until it is done.  A new process has
#: no preload of its own: whatever it let out before the commit would reach the GPU at once.
PRELOADING = '[handover]\npreload_models = ["llama3.2"]\npreload_timeout_seconds = 600\n'


@pytest_twisted.ensureDeferred
async def test_a_new_process_killed_or_stopped_before_the_commit_leaves_everything_with_the_old_one(tmp_path):
    """Three reloads whose new process dies or is stopped at a moment of the handover, then one that goes
    through, with no hold on the GPU (the old process's lot held back by its preload, a new process's not):
    nothing reaches the GPU before the reload that goes through, and then every parked and arriving client is
    answered once, 200 with its vector, each text embedded once."""
    sim = SimOllama(reactor, latency=0.0, parallel=32)
    proxy = Proxy(tmp_path, await sim.listen(), PRELOADING)
    proxy.backlog = 2048
    crowd = arrivals = None
    try:
        await proxy.start()
        first = proxy.pid
        crowd = await parked_crowd(proxy, "parked")
        sim.hold("/api/generate")
        code, status = await proxy.post("/resume", {"source": "broker"})
        assert code == 200 and status["holds"] == [] and status["state"] == "draining", status
        await wait_for(reactor, lambda: sim.held == 1, timeout=30)  # the preload, held
        arrivals = Arrivals(crowd, "arriving")
        # A stopped new process says so on the link as it lets go ("aborting"); a stop that ends it before
        # that frame is out reads as its exit by the signal: either way the old process takes everything back.
        deaths = (("held", "kill", ("signal 9",)), ("held", "term", ("stopped before it took over", "(signal 15)")),
                  ("commit", "kill", ("signal 9",)))
        for moment, action, whys in deaths:
            proxy.at(moment, action)
            code, failed = await proxy.post("/reload")
            assert code == 500 and failed["reloaded"] is False, failed
            assert proxy.acted() not in (None, first), "the moment was not reached in the new process"
            assert any(why in failed["error"] for why in whys) and "took back" in failed["error"], failed
            await wait_for(reactor, lambda: gone(proxy.acted()) and children_of(first) == [], timeout=30, step=0.05)
            assert (await proxy.status())["pid"] == first
        said = lines(proxy, "reload failed:")
        assert len(said) == 3 and all("took back" in line and "nothing dropped" in line for line in said), said
        assert embedded(sim) == {}  # none of the new processes let anything out

        outcome = await proxy.reload()  # this one has no preload: it serves the lot at once
        arrivals.stop()
        assert await in_thread(reactor, crowd.wait, None, 180)
        for text, answer in crowd.outcomes.items():
            assert answer.status == 200, answer
            vector = json.loads(answer.body)["embeddings"][0]
            assert vector == pytest.approx(expected_embedding(text, MODEL), abs=1e-9), text
        assert embedded(sim) == collections.Counter({text: 1 for text in crowd.sent})
        assert (await proxy.status())["pid"] == outcome["pid"]
        sim.release()
        await proxy.old_gone(first)
        output = proxy.child.text()
        assert "Traceback" not in output and "Unhandled" not in output, output[-5000:]
    finally:
        if arrivals is not None:
            arrivals.stop()
        if crowd is not None:
            crowd.close()
        proxy.stop()
        await sim.stop()


async def stopped_during_a_reload(tmp_path, moment: str, action: str) -> None:
    """One proxy, a thousand parked and more arriving, a reload during which ``action`` is done at ``moment``:
    both processes end, and every client is answered 503 with Retry-After or found nothing listening."""
    sim = SimOllama(reactor, latency=0.0, parallel=32)
    proxy = Proxy(tmp_path, await sim.listen())
    proxy.backlog = 2048
    crowd = arrivals = None
    try:
        await proxy.start()
        old = proxy.pid
        crowd = await parked_crowd(proxy, "parked")
        arrivals = Arrivals(crowd, "arriving")
        proxy.at(moment, action)
        asked = Deferred.fromCoroutine(proxy.post("/reload"))
        asked.addErrback(lambda failure: None)  # the process asked may end before it answers
        await wait_for(reactor, lambda: children_of(old) != [], timeout=30, step=0.02)
        new = children_of(old)[0][0]
        proxy.pids.append(new)
        await wait_for(reactor, lambda: proxy.acted() is not None, timeout=60, step=0.02)
        await wait_for(reactor, lambda: gone(old) and gone(new), timeout=60, step=0.05)
        arrivals.stop()
        assert await in_thread(reactor, crowd.wait, None, 60)
        kinds = collections.Counter()
        for text, answer in crowd.outcomes.items():
            if answer.error == "refused":
                assert text.startswith("arriving"), answer  # it came once nothing listened any more
                kinds["refused"] += 1
                continue
            assert answer.status == 503 and answer.retry_after, answer
            kinds[503] += 1
        assert kinds[503] >= PARKED, kinds
        assert embedded(sim) == {}
        output = proxy.child.text()
        assert "Traceback" not in output and "Unhandled" not in output, output[-5000:]
    finally:
        if arrivals is not None:
            arrivals.stop()
        if crowd is not None:
            crowd.close()
        proxy.stop()
        await sim.stop()


@pytest.mark.parametrize(("moment", "action"), [
    ("held", "term-parent"),  # the old process stopped while the new one holds part of the lot
    ("commit", "term-parent"),  # the old process stopped while it awaits the commit's outcome
    ("committed", "term"),  # the old process stopped as it reads the outcome (its stop comes a turn later)
    ("commit", "term"),  # the new process stopped as the commit reaches it (it commits, then stops)
], ids=["old-while-the-lot-goes-over", "old-during-the-commit", "old-as-it-reads-committed", "new-at-the-commit"])
@pytest_twisted.ensureDeferred
async def test_a_stop_of_either_process_during_a_reload_answers_every_client(tmp_path, moment, action):
    await stopped_during_a_reload(tmp_path, moment, action)
