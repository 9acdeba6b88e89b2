"""Chaos runs: the promise ("nothing lost") under flapping yields, a killed backend, clients that
leave, yields that outlive the hold bound, and SIGTERM.

The runs about time alone (flapping yields, the hold bound, the graceful
stop) run on a Clock with the proxy in memory (``tests/inmemory.py``), so
their timings are exact; those about processes and sockets (a killed backend,
clients that drop their connections, SIGTERM to twistd) run on 127.0.0.1,
each bounded well under 60 s.  After each, the checks are the same three:

* the callers saw no failure they should not have (every request answered,
  and every answer right, or an explicit error with Retry-After where the
  scenario calls for one);
* no text reached the backend twice, except after a counted retry
  (``yieldproxy_retries_total``);
* the metrics add up: every accepted request is counted once, as answered
  (``yieldproxy_requests_total``, whatever the code) or abandoned
  (``yieldproxy_replay_total{outcome="abandoned"}``); the refusals inside the
  answered ones add up with ``yieldproxy_rejected_total`` and the
  ``expired``/``shutdown`` replay outcomes; and nothing is left in the lot
  or in flight.

``test_every_accepted_request_is_counted_once`` checks the identity on its
own: the codes of ``yieldproxy_requests_total`` (499 for a client that went
away) add up to every request the proxy took.
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys

import attrs
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import ProcessProtocol, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.web.client import ResponseNeverReceived

from helpers import ChildOutput, Entry, config_with, free_port, in_thread, make_core, release_every_hold, sleep, start_stack, until_healthy, wait_for
from inmemory import Rig, answered
from rawhttp import LogCapture, counter_by, counter_total, parse_response, port_of, request_bytes
from test_burst import Burst, assert_clean
from test_twistd import TWISTD
from yieldproxy.tools.sim import expected_embedding

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 60
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Children import the code under test from this checkout, not an installed copy.
CHILD_ENV = {**os.environ, "PYTHONPATH": CHECKOUT, "PYTHONUNBUFFERED": "1"}


def embed(text: str) -> bytes:
    return json.dumps({"model": "all-minilm", "input": text}).encode()


# -- accounting -------------------------------------------------------------------------


@attrs.frozen
class Outcomes:
    """What the proxy's counters say happened."""

    codes: dict
    replay: dict
    rejected: dict
    retries: float

    @property
    def answered(self) -> float:
        return sum(v for code, v in self.codes.items() if code != "499")

    @property
    def abandoned(self) -> float:
        """Clients that went away before their answer (code 499), parked or not."""
        return self.codes.get("499", 0.0)


def outcomes(stack_or_proxy) -> Outcomes:
    return Outcomes(
        codes=counter_by(stack_or_proxy, "yieldproxy_requests", "code"),
        replay=counter_by(stack_or_proxy, "yieldproxy_replay", "outcome"),
        rejected=counter_by(stack_or_proxy, "yieldproxy_rejected", "reason"),
        retries=counter_total(stack_or_proxy, "yieldproxy_retries"),
    )


def assert_accounts(stack_or_proxy, accepted: int, **expected) -> Outcomes:
    """accepted = answered + abandoned, every part as ``expected``; nothing parked or in flight.

    ``expected`` names parts: ``ok`` (200 answers), ``expired``, ``shutdown``,
    ``abandoned`` (replay outcomes), ``over_budget`` (rejected reasons), ``code_503``...
    """
    proxy = getattr(stack_or_proxy, "proxy", stack_or_proxy)
    seen = outcomes(proxy)
    assert seen.answered + seen.abandoned == accepted, seen
    parts = {
        "ok": seen.codes.get("200", 0.0),
        "code_503": seen.codes.get("503", 0.0),
        "expired": seen.replay.get("expired", 0.0),
        "shutdown": seen.replay.get("shutdown", 0.0),
        "abandoned": seen.abandoned,
        "over_budget": seen.rejected.get("over_budget", 0.0),
        "refused_at_once": sum(seen.rejected.values()),
    }
    for name, value in expected.items():
        assert parts[name] == value, (name, parts, seen)
    # Every proxy refusal among the answers is one of the counted kinds.
    refusals = parts["expired"] + parts["shutdown"] + parts["refused_at_once"] + seen.replay.get("rejected", 0.0)
    assert refusals <= seen.answered - parts["ok"], seen
    assert len(proxy.lot) == 0 and proxy.replayer.inflight == 0
    return seen


# -- 1. flapping yields -------------------------------------------------------------------


class MemoryBurst:
    """``texts`` embedded through a :class:`~inmemory.Rig`'s proxy by ``concurrency`` callers, as :class:`Burst` does.

    Each caller sends its next text when its answer is complete; every
    outcome is recorded as the blocking ollama client would see it (an
    answer that is not 200 is a failure, a wrong vector is wrong).
    """

    def __init__(self, rig, texts: list[str], concurrency: int):
        self.rig = rig
        self.texts = texts
        self.done = 0
        self.failures: list[str] = []
        self.wrong: list[str] = []
        self._queue = iter(texts)
        self._callers = concurrency
        self._idle = 0

    @property
    def finished(self) -> bool:
        return self._idle == self._callers

    def start(self) -> None:
        for _ in range(self._callers):
            self._next()
        self.rig.turn()

    def _next(self) -> None:
        text = next(self._queue, None)
        if text is None:
            self._idle += 1
            return
        d = self.rig.send("POST", self.rig.proxy_url + "/api/embed", json={"model": "all-minilm", "input": text})
        d.addCallback(lambda response: treq.json_content(response).addCallback(lambda body: (response.code, body)))
        d.addCallbacks(self._answered, self._failed, callbackArgs=(text,), errbackArgs=(text,))
        d.addBoth(lambda _: self._next())

    def _answered(self, answer, text: str) -> None:
        code, body = answer
        if code != 200:
            self.failures.append(f"{text}: {code} {body}")
            return
        self.done += 1
        if body["embeddings"][0] != expected_embedding(text, "all-minilm"):
            self.wrong.append(text)

    def _failed(self, failure, text: str) -> None:
        self.failures.append(f"{text}: {failure.getErrorMessage()}")


def test_burst_through_yields_flapping_every_100ms():
    """Hold and release every 100 ms (of the clock) under a 1,000-text burst: all answered, once each."""
    rig = Rig(config_with(replay={"concurrency": 4}), latency=0.02, parallel=4)
    burst = MemoryBurst(rig, [f"flap text {i}" for i in range(1000)], concurrency=24)
    flips = 0
    with LogCapture() as logs:
        burst.start()
        while not burst.finished and rig.clock.seconds() < 120:
            rig.proxy.state.hold("flapper", "flapping")
            rig.run(0.1)
            rig.proxy.state.release("flapper")
            rig.run(0.1)
            flips += 1
    assert burst.finished
    assert flips >= 20, "the burst ended before the flapping got going"
    assert logs.errors() == []
    assert_clean(burst, rig)
    seen = assert_accounts(rig, len(burst.texts), ok=len(burst.texts), refused_at_once=0, expired=0, abandoned=0)
    assert seen.replay.get("ok", 0) > 0, "no request was ever parked: the flapping did not bite"
    # "flapper" is not among admin.known_sources: counted under "other".
    assert rig.sample("yieldproxy_yields_total", source="other") == flips
    assert rig.clock.getDelayedCalls() == []


# -- 2. the backend killed and restarted -------------------------------------------------------

SIM_CHILD = r"""
import json, sys, threading
from yieldproxy.tools import sim

_answer = sim.SimOllama._answer_batch
withholding = threading.Event()

def _read_commands():
    # "WITHHOLD" on stdin: from now on every batch is taken and never answered (a backend mid-work).
    for line in sys.stdin:
        if line.strip() == "WITHHOLD":
            withholding.set()
            print("WITHHOLDING", flush=True)

def _answer_and_tell(self, job):
    if withholding.is_set():
        for text in job.texts:
            print("WITHHELD " + json.dumps(text), flush=True)
        return
    # Told before answering: a text the parent hears about may have died unanswered
    # (so counting it can only make the duplicate check stricter).
    for text in job.texts:
        print("EMBEDDED " + json.dumps(text), flush=True)
    _answer(self, job)

threading.Thread(target=_read_commands, daemon=True).start()
sim.SimOllama._answer_batch = _answer_and_tell
sim.main(sys.argv[1:])
"""


class SimChild(ProcessProtocol):
    """``python -m yieldproxy.tools.sim`` in a child process (wrapped to report each embedded text)."""

    def __init__(self):
        self.buffer = b""
        self.embedded: list[str] = []
        self.withheld: list[str] = []
        self.withholding: Deferred = Deferred()
        self.listening: Deferred = Deferred()
        self.ended: Deferred = Deferred()
        self.stderr = b""

    def outReceived(self, data):
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            text = line.decode()
            if text.startswith("EMBEDDED "):
                self.embedded.append(json.loads(text[len("EMBEDDED "):]))
            elif text.startswith("WITHHELD "):
                self.withheld.append(json.loads(text[len("WITHHELD "):]))
            elif text == "WITHHOLDING" and not self.withholding.called:
                self.withholding.callback(None)
            elif text.startswith("listening on") and not self.listening.called:
                self.listening.callback(text)

    def errReceived(self, data):
        self.stderr += data

    def processEnded(self, reason):
        self.ended.callback(reason.value)


async def start_sim_child(port: int, *options: str):
    child = SimChild()
    process = reactor.spawnProcess(
        child, sys.executable,
        [sys.executable, "-c", SIM_CHILD, "--port", str(port), *options],
        env=CHILD_ENV,
    )
    try:
        await child.listening.addTimeout(20, reactor)
    except Exception:
        process.signalProcess("KILL")
        raise AssertionError(f"sim child did not start: {child.stderr.decode(errors='replace')}")
    return process, child


@pytest_twisted.ensureDeferred
async def test_backend_killed_and_restarted_mid_burst_under_a_yield():
    """kill -9 of the backend mid-burst, a new one on the same port, all under a declared yield."""
    port = free_port()
    config = config_with(
        upstream={"attempt_timeout_seconds": 5.0, "retry_backoff_seconds": 0.1},
        replay={"concurrency": 4},
    )
    first, first_child = await start_sim_child(port, "--latency", "0.01", "--parallel", "4")
    second = second_child = None
    stack = await start_stack(reactor, config, upstream=f"http://127.0.0.1:{port}")
    burst = Burst(stack.proxy_url, [f"kill text {i}" for i in range(400)], concurrency=16)
    try:
        with LogCapture() as logs:
            running = in_thread(reactor, burst.run, timeout=TIMEOUT)
            await wait_for(reactor, lambda: burst.done >= 100, timeout=30)
            # The backend takes requests and answers none, so the kill is sure to catch one mid-work.
            first.write(b"WITHHOLD\n")
            await first_child.withholding.addTimeout(10, reactor)
            await wait_for(reactor, lambda: first_child.withheld, timeout=10)
            stack.proxy.state.hold("broker", "backend restart", expected_seconds=5)
            first.signalProcess("KILL")
            await first_child.ended.addTimeout(10, reactor)
            # The proxy has seen the backend go (a request in flight failed and went back to the lot).
            await wait_for(reactor, lambda: counter_total(stack, "yieldproxy_upstream_failures") > 0, timeout=10)
            second, second_child = await start_sim_child(port, "--latency", "0.01", "--parallel", "4")
            stack.proxy.state.release("broker")
            await running
        assert logs.errors() == []
        assert burst.failures == [] and burst.wrong == [] and burst.done == len(burst.texts)
        embedded = collections.Counter(first_child.embedded + second_child.embedded)
        assert set(embedded) == set(burst.texts)
        seen = assert_accounts(stack, len(burst.texts), ok=len(burst.texts), refused_at_once=0, abandoned=0)
        duplicates = sum(n - 1 for n in embedded.values())
        assert duplicates <= seen.retries
        # The kill did catch requests in flight, and they were retried, not failed.
        assert seen.retries > 0
        reasons = counter_by(stack, "yieldproxy_upstream_failures", "reason")
        assert set(reasons) <= {"refused", "reset", "connect"}, reasons
    finally:
        for process, child in ((first, first_child), (second, second_child)):
            if process is not None and not child.ended.called:
                process.signalProcess("KILL")
                await child.ended.addTimeout(10, reactor)
        await stack.stop()


# -- 3. parked clients leaving at random ------------------------------------------------------------


class RawCaller(Protocol):
    """One request on its own connection, driven from the reactor (so a test can leave exactly when it wants)."""

    def __init__(self, request: bytes):
        self.request = request
        self.data = b""
        self.done: Deferred = Deferred()
        self.left = False

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.data += data

    def connectionLost(self, reason):
        self.done.callback(self.data)

    def has_answer_waiting(self) -> bool:
        """True once any answer byte arrived, or waits unread in the socket."""
        import select

        if self.data:
            return True
        handle = self.transport.getHandle()
        return bool(select.select([handle], [], [], 0)[0])

    def leave(self) -> None:
        self.left = True
        self.transport.abortConnection()


@pytest_twisted.ensureDeferred
async def test_thirty_percent_of_parked_clients_leave_at_random():
    """60 parked; 18 leave at random moments, while parked and while the lot drains; the rest are answered."""
    rng = random.Random(7)
    stack = await start_stack(reactor, config_with(replay={"concurrency": 2}), latency=0.1, parallel=2)
    count, leaving = 60, 18
    try:
        with LogCapture() as logs:
            stack.proxy.state.hold("api", "game")
            endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port_of(stack.proxy_url))
            callers = []
            for i in range(count):
                caller = RawCaller(request_bytes(b"POST", b"/api/embed", [(b"Connection", b"close")], embed(f"leaver {i}")))
                await connectProtocol(endpoint, caller)
                callers.append(caller)
            await wait_for(reactor, lambda: len(stack.proxy.lot) == count, timeout=20)
            order = list(range(count))
            rng.shuffle(order)
            left = []

            async def leave_some(n: int, spread: float):
                for _ in range(n):
                    await sleep(reactor, rng.uniform(0, spread / n))
                    while order:
                        caller = callers[order.pop()]
                        # Only a caller that has no answer yet: leaving then must count as abandoned.
                        if not caller.has_answer_waiting():
                            caller.leave()
                            left.append(caller)
                            break

            await leave_some(leaving // 2, 0.5)  # while parked
            stack.proxy.state.release("api")
            await leave_some(leaving - leaving // 2, 1.0)  # while the lot drains (2 at a time, 0.1 s each)
            await DeferredList([c.done for c in callers]).addTimeout(TIMEOUT, reactor)
        assert logs.errors() == []
        assert len(left) == leaving
        stayed = [c for c in callers if not c.left]
        for caller in stayed:
            response, _ = parse_response(caller.data)
            assert response is not None and response.status == 200, caller.data[:200]
        texts = {f"leaver {i}" for i in range(count)}
        stayed_texts = {json.loads(c.request.split(b"\r\n\r\n", 1)[1])["input"] for c in stayed}
        assert {t for t, n in stack.sim.texts_embedded.items() if n} >= stayed_texts
        assert all(n <= 1 for n in stack.sim.texts_embedded.values())
        # Those that left while parked never reached the backend at all.
        assert sum(stack.sim.texts_embedded.values()) <= count - leaving // 2
        assert_accounts(stack, count, ok=count - leaving, abandoned=leaving, refused_at_once=0)
        assert texts >= set(stack.sim.texts_embedded)
    finally:
        release_every_hold(stack.proxy.state)
        await stack.stop()


# -- 4. a yield that outlives the hold bound -----------------------------------------------------------


def test_yield_outliving_the_hold_bound_gets_everyone_a_clean_503():
    """40 parked past a 1 s hold bound: each gets 503 + Retry-After in its API's shape at 1 s; nothing hangs."""
    rig = Rig(config_with(classes={"batch": {"hold_seconds": 1.0}}))
    with LogCapture() as logs:
        rig.proxy.state.hold("game", "a long game")
        calls = [
            rig.post("/v1/embeddings" if i % 2 else "/api/embed", {"model": "all-minilm", "input": f"late {i}"})
            for i in range(40)
        ]
        assert len(rig.proxy.lot) == 40
        rig.run(0.999)
        assert not any(answered(d) for d in calls) and len(rig.proxy.lot) == 40
        rig.run(0.001)
        assert all(answered(d) for d in calls)
        responses = [rig.result(d) for d in calls]
        # Then a declared yield longer than the bound: refused at once, not parked.
        rig.proxy.state.hold("game", "a long game", expected_seconds=30)
        quick = rig.result(rig.post("/api/embed", {"model": "all-minilm", "input": "x"}))
    assert logs.errors() == []
    for i, response in enumerate(responses):
        assert response.code == 503
        assert int(response.header("retry-after")[0]) >= 1
        body = response.json()
        message = body["error"]["message"] if i % 2 else body["error"]
        assert "hold bound" in message
    assert quick.code == 503 and int(quick.header("retry-after")[0]) == 30
    assert sum(rig.sim.requests_total.values()) == 0
    assert_accounts(rig, 41, code_503=41, expired=40, over_budget=1, abandoned=0, ok=0)


# -- 5. SIGTERM --------------------------------------------------------------------------------------


async def _post_many(url: str, texts: list[str]):
    return [
        treq.post(url + "/api/embed", json={"model": "all-minilm", "input": t}, persistent=False).addTimeout(TIMEOUT, reactor)
        for t in texts
    ]


def test_graceful_stop_with_requests_parked_and_in_flight_adds_up():
    """The stop SIGTERM runs (on the proxy's own service, its clock moved by the test): in flight finish, parked get 503."""
    rig = Rig(reactor=MemoryReactorClock(), latency=1.0, parallel=8)
    service = rig.proxy.service
    service.startService()
    with LogCapture() as logs:
        in_flight = [rig.post("/api/embed", {"model": "all-minilm", "input": f"flying {i}"}) for i in range(4)]
        assert rig.sim.in_flight == 4
        rig.proxy.state.hold("game", "game")
        parked = [rig.post("/api/embed", {"model": "all-minilm", "input": f"parked {i}"}) for i in range(6)]
        assert len(rig.proxy.lot) == 6
        stopped = service.stopService()
        rig.turn()
        # The parked ones are answered at once, before the ones in flight.
        for d in parked:
            response = rig.result(d)
            assert response.code == 503 and response.header("retry-after")
            assert "shutting down" in response.json()["error"]
        assert not any(answered(d) for d in in_flight) and not answered(stopped)
        rig.run(1.0)
        for d in in_flight:
            assert rig.result(d).code == 200
        assert answered(stopped)
    assert logs.errors() == []
    assert rig.sim.texts_embedded == collections.Counter({f"flying {i}": 1 for i in range(4)})
    assert_accounts(rig, 10, ok=4, code_503=6, shutdown=6, abandoned=0)
    assert rig.clock.getDelayedCalls() == []


async def start_twistd(sim_port: int, tmp_path, shutdown_timeout: float = 30.0):
    proxy_port, admin_port = free_port(), free_port()
    config = tmp_path / "yieldproxy.toml"
    config.write_text(f"[proxy]\nshutdown_timeout_seconds = {shutdown_timeout}\n")
    child = ChildOutput()
    process = reactor.spawnProcess(
        child, TWISTD,
        [TWISTD, "-n", "--pidfile=", "yieldproxy", "--config", str(config),
         "--upstream", f"http://127.0.0.1:{sim_port}",
         "--listen", f"tcp:{proxy_port}:interface=127.0.0.1",
         "--admin", f"tcp:{admin_port}:interface=127.0.0.1"],
        env=CHILD_ENV,
    )
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        await until_healthy(
            reactor, admin, lambda: child.ended.called, lambda: child.output.decode(errors="replace"), tries=200,
        )
    except AssertionError:
        if not child.ended.called:
            process.signalProcess("KILL")
        raise
    return process, child, f"http://127.0.0.1:{proxy_port}", admin


async def _status(admin: str) -> dict:
    return await (await treq.get(admin + "/status", persistent=False).addTimeout(10, reactor)).json()


@pytest_twisted.ensureDeferred
async def test_sigterm_with_requests_parked_and_in_flight(tmp_path):
    """twistd gets SIGTERM: parked answered 503 at once, in flight finish, a clean exit, no traceback."""
    from yieldproxy.tools.sim import SimOllama

    sim = SimOllama(reactor, latency=1.5, parallel=8)
    sim_port = await sim.listen()
    process, child, url, admin = await start_twistd(sim_port, tmp_path)
    try:
        in_flight = await _post_many(url, [f"flying {i}" for i in range(4)])
        await wait_for(reactor, lambda: sim.in_flight == 4, timeout=10)
        await (await treq.post(admin + "/yield", json={"reason": "game"}, persistent=False)).content()
        parked = await _post_many(url, [f"parked {i}" for i in range(6)])
        for _ in range(100):
            if (await _status(admin))["parked_total"] == 6:
                break
            await sleep(reactor, 0.05)
        assert sim.in_flight == 4
        process.signalProcess("TERM")
        for d in parked:
            response = await d
            # Answered while the backend still holds the four in flight: the parked did not wait for them.
            assert sim.in_flight == 4, "parked requests waited for the in-flight ones"
            assert response.code == 503 and response.headers.getRawHeaders("retry-after")
            assert "shutting down" in (await response.json())["error"]
        for d in in_flight:
            response = await d
            assert response.code == 200
            assert (await response.json())["embeddings"]
        assert await child.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), child.output
        output = child.output.decode(errors="replace")
        assert "Traceback" not in output and "Unhandled" not in output, output
        assert sim.texts_embedded == collections.Counter({f"flying {i}": 1 for i in range(4)})
    finally:
        if not child.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_sigterm_cuts_what_is_still_in_flight_after_the_shutdown_timeout(tmp_path):
    """What is *not* promised: past proxy.shutdown_timeout_seconds, an unfinished answer is cut.  As the process
    ends, its connections close in no set order: the client's first (it sees a close), or the upstream's (the
    attempt fails, and the client reads the 503 of a proxy shutting down, sent at once); never the answer."""
    from yieldproxy.tools.sim import SimOllama

    sim = SimOllama(reactor, latency=20.0, parallel=8)
    sim_port = await sim.listen()
    process, child, url, admin = await start_twistd(sim_port, tmp_path, shutdown_timeout=1.0)
    try:
        slow = (await _post_many(url, ["too slow"]))[0]
        await wait_for(reactor, lambda: sim.in_flight == 1, timeout=10)
        process.signalProcess("TERM")
        assert await child.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), child.output
        # The proxy went before the backend's answer (20 s): the backend saw its caller leave, nothing answered.
        assert sim.requests_total["/api/embed"] == 1 and sim.outcomes["abandoned"] == 1
        assert sim.texts_embedded["too slow"] == 0
        try:
            answer = await slow
        except ResponseNeverReceived:
            pass  # the client's connection closed first
        else:
            assert answer.code == 503 and "shutting down" in (await answer.json())["error"]
    finally:
        if not child.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


# -- the counters add up ------------------------------------------------------------------------------


def test_every_accepted_request_is_counted_once():
    rig = Rig(latency=1.0)
    for path in ("/api/embed", "/api/embed"):
        d = rig.post(path, {"model": "all-minilm", "input": "gone"})
        assert rig.sim.in_flight == 1
        d.cancel()
        d.addErrback(lambda failure: None)  # the caller's own CancelledError
        rig.turn()
        assert rig.proxy.replayer.inflight == 0
        rig.run(1.0)
        assert rig.sim.in_flight == 0
    seen = outcomes(rig)
    assert seen.answered + seen.abandoned == 2, seen
    assert seen.abandoned == 2


def test_stopping_the_replayer_while_it_waits_logs_nothing():
    import gc

    core = make_core(concurrency=1)
    core.scheduler.admit(Entry(cls="batch"))  # goes at once: the only slot is taken
    core.state.hold("api")
    core.scheduler.admit(Entry(cls="batch"))  # parked
    core.state.release("api")
    core.run(0.01)  # the release task now waits for the slot
    assert core.replayer._waiting is not None
    with LogCapture() as logs:
        core.replayer.stop()
        core.run(0.01)
        gc.collect()
    assert logs.errors() == []


# -- the guarantees page ------------------------------------------------------------------------------


def test_every_guarantee_names_a_test_that_exists():
    """docs/guarantees.md backs each line with tests/FILE.py::name: each must be a test in that file."""
    import ast
    import re

    page = open(os.path.join(CHECKOUT, "docs", "guarantees.md"), encoding="utf-8").read()
    cited = set(re.findall(r"tests/((?:\w+/)*\w+\.py)::(\w+)", page))
    assert len(cited) >= 40
    missing = []
    names_in: dict[str, set[str]] = {}  # each test file parsed once, not once per citation
    for filename, name in sorted(cited):
        if filename not in names_in:
            path = os.path.join(CHECKOUT, "tests", filename)
            tree = ast.parse(open(path, encoding="utf-8").read()) if os.path.exists(path) else ast.Module(body=[])
            names_in[filename] = {
                node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        if name not in names_in[filename]:
            missing.append(f"{filename}::{name}")
    assert missing == []
    assert os.path.exists(os.path.join(CHECKOUT, "bench", "soak.py"))
