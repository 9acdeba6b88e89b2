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
  the commit's outcome is awaited, or as it reads it: a stop is a stop, of
  both; every client is answered, 503 with ``Retry-After`` (the GPU is
  yielded), or finds nothing listening any more (refused: it never
  connected); none is reset or closed without an answer, and nothing
  reaches the GPU.

Then every moment the code names, with either process killed or stopped
there, with fewer clients: the process the rule of docs/operating.md names
is the one left serving, or none after a stop of both.
"""

from __future__ import annotations

import collections
import json

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError as ConnectionRefused
from twisted.internet.task import LoopingCall

from crowd import Crowd
from helpers import embedded, in_thread, wait_for
from rawhttp import request_bytes
from test_reload import MODEL, Proxy, children_of, embed_body, gone
from yieldproxy.lifecycle.succession.moments import COMMIT_POINT, MOMENTS, SIDE
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
        # A stopped new process says so on the link as it lets go ("aborting"), and ends once that is out.
        deaths = (("held", "kill", ("signal 9",)), ("held", "term", ("stopped before it took over",)),
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
], ids=["old-while-the-lot-goes-over", "old-during-the-commit", "old-as-it-reads-committed"])
@pytest_twisted.ensureDeferred
async def test_a_stop_of_either_process_during_a_reload_answers_every_client(tmp_path, moment, action):
    await stopped_during_a_reload(tmp_path, moment, action)


# -- every moment of the handover, every death and stop -------------------------------------------------------

#: Parked clients in each cell of the matrix below: a cell is about who is left serving, not about load.
FEW = 24
#: What lands on a moment: the old or the new process killed (``kill -9``) or stopped (SIGTERM).
ACTIONS = ("kill-old", "kill-new", "term-old", "term-new")


def owner_at(moment: str) -> str:
    """The process that owns everything at ``moment``: the old one before the commit point, the new one from it."""
    return "new" if MOMENTS.index(moment) >= MOMENTS.index(COMMIT_POINT) else "old"


def left_serving(moment: str, action: str) -> frozenset[str]:
    """Who may be left serving once ``action`` lands on ``moment`` (docs/operating.md's table): ``old``,
    ``new`` or ``none``; one of them but where a signal races with a frame (below).

    A stop of the old process during the reload is a stop of both; a stop of the new one ends it, and the
    old one serves on if it still owns everything.  A death of the process that does not own everything
    leaves the owner serving; the old one's death before the commit leaves the new one serving with what it
    holds; the new one's after the commit is a crash of the proxy (the old one finishes what is in flight,
    and exits).  A SIGTERM the new process sends the old one once ``committed`` has left it races with the
    old one reading it: read first, the old process has handed over, and its stop is its own."""
    owner = owner_at(moment)
    verb, target = action.split("-")
    if verb == "term":
        if target == "old" and owner == "new" and SIDE[moment] == "new":
            return frozenset({"none", "new"})
        return frozenset({"old" if target == "new" and owner == "old" else "none"})
    if target == "old":
        return frozenset({"new"})
    return frozenset({"old" if owner == "old" else "none"})


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("moment", MOMENTS)
@pytest_twisted.ensureDeferred
async def test_whatever_moment_a_death_or_a_stop_lands_on_one_process_is_left_serving_or_none_after_a_stop(
    tmp_path, moment, action,
):
    """Every (moment x action), the moments read from the code (lifecycle/succession/moments.py): the process
    :func:`left_serving` names is the one left, answering on both listeners, and every parked client is
    answered once (200 with its own vector once something serves and the GPU is resumed; 503 with
    Retry-After when nothing is left), but where a kill hits the process that owns them: those the dead
    process alone had are cut off, as in a crash (docs/operating.md).  Nothing is embedded twice."""
    allowed = left_serving(moment, action)
    sim = SimOllama(reactor, latency=0.0, parallel=32)
    proxy = Proxy(tmp_path, await sim.listen(), f'[state]\nholds_file = "{tmp_path / "holds.json"}"\n')
    crowd = None
    try:
        await proxy.start()
        code, _ = await proxy.post("/yield", {"reason": "game", "source": "broker"})
        assert code == 200
        crowd = Crowd(proxy.proxy_port, embed_request)
        crowd.send([f"parked {i}" for i in range(FEW)])
        await proxy.until_parked(FEW, tries=400)
        proxy.at(moment, action)
        asked = Deferred.fromCoroutine(proxy.post("/reload"))
        asked.addErrback(lambda failure: None)  # the process asked may end before it answers
        await wait_for(reactor, lambda: proxy.handover_pids() is not None, timeout=60, step=0.02)
        pids = proxy.handover_pids()
        assert pids is not None and pids["new"] is not None, pids
        pids = {"old": pids["old"], "new": pids["new"]}
        proxy.pids.append(pids["new"])


        def left() -> str | None:
            """Who is left, once all but at most one of those ``allowed`` are gone."""
            alive = [who for who, pid in pids.items() if not gone(pid)]
            if not alive:
                return "none"
            return alive[0] if len(alive) == 1 and alive[0] in allowed else None

        await wait_for(reactor, lambda: left() is not None, timeout=60, step=0.05)
        expected = left()
        assert expected in allowed, (expected, allowed)
        if expected != "none":
            serving = pids[expected]
            assert not gone(serving), f"pid {serving} ({expected}) is not serving"
            try:
                status = await proxy.status()
                assert status["pid"] == serving, status
                code, _ = await proxy.post("/resume", {"source": "broker"})
                assert code == 200
            except ConnectionRefused:
                # The one race left_serving names, read SIGTERM first: the old process asked the new one to
                # stop before it exited, and the new one, alone a moment, stops too.
                assert "none" in allowed, (expected, allowed)
                await wait_for(reactor, lambda: gone(serving), timeout=60, step=0.05)
                expected = "none"
        assert await in_thread(reactor, crowd.wait, None, 60)
        cut_off_allowed = action == f"kill-{owner_at(moment)}"
        kinds: collections.Counter = collections.Counter()
        for text, answer in crowd.outcomes.items():
            if answer.error in ("closed", "reset") and cut_off_allowed:
                kinds["cut off"] += 1
                continue
            if expected == "none" or (len(allowed) > 1 and answer.status == 503):
                # In the one race left_serving names, the old process may read its SIGTERM before it has
                # handed a request over: that request gets the stop's 503, whoever is left serving.
                assert answer.status == 503 and answer.retry_after, answer
            else:
                assert answer.status == 200, answer
                vector = json.loads(answer.body)["embeddings"][0]
                assert vector == pytest.approx(expected_embedding(text, MODEL), abs=1e-9), text
            kinds[answer.status] += 1
        assert sum(kinds.values()) == FEW, kinds
        counts = embedded(sim)
        assert all(count == 1 for count in counts.values()), counts
        assert set(counts) == {text for text, answer in crowd.outcomes.items() if answer.status == 200}
        if expected != "none":
            assert not gone(pids[expected])
        output = proxy.child.text()
        assert "Traceback" not in output and "Unhandled" not in output, output[-5000:]
    finally:
        if crowd is not None:
            crowd.close()
        proxy.stop()
        await sim.stop()
