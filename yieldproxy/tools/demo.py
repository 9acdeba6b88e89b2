"""``yieldproxy demo``: a burst surviving a yield, with no Ollama needed.

A simulated Ollama and a proxy run in this process; a burst of embedding
requests goes through them while the GPU is yielded and resumed over the real
admin API; every answer is checked and a short report printed.

The burst is sent with treq (the proxy's callers' side: many requests at once
on the reactor, each bounded); the yield and the resume with the broker
library, the one client of the admin API, on the reactor's thread pool.
"""

from __future__ import annotations

import argparse
import enum
import itertools
import json
import math
import secrets
import sys
from typing import Any

import attrs
from twisted.internet import defer, error as ierror, task, threads
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IAgentEndpointFactory
from twisted.web.resource import Resource
from zope.interface import implementer

from ..edge.tcp import set_no_delay
from ..states import Machine, Moves
from ..text import printable
from .broker import Admin, AdminError
from .exits import EXIT_ERROR, EXIT_OK
from .sim import SimOllama, expected_embedding

#: The demo's embedding model, one of the models the sim has by default (it answers deterministically).
DEMO_MODEL = "all-minilm"
#: The demo source's hold; a distinct name so it cannot end a real broker's hold.
DEMO_SOURCE = "demo"
#: Requests the simulated backend serves at once (like OLLAMA_NUM_PARALLEL).
DEMO_SIM_PARALLEL = 4


@attrs.define(eq=False)
class _Line:
    """The live progress line: redrawn in place on a terminal, plain lines otherwise."""

    _stream: Any
    tty: bool
    _drawn: bool = False

    def show(self, text: str) -> None:
        if self.tty:
            self._stream.write("\r\x1b[K" + text)
            self._drawn = True
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def finish(self) -> None:
        """Leave the last progress line on the terminal."""
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False

    def clear(self) -> None:
        if self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False

    def say(self, text: str) -> None:
        """A line of its own (an event, a warning) without mangling the progress line."""
        self.clear()
        self._stream.write(text + "\n")
        self._stream.flush()


@attrs.define(eq=False)
class _Burst:
    """What the demo's client saw; the progress line and the report read it."""

    total: int
    sent: int = 0
    ok: int = 0
    failed: int = 0
    wrong: int = 0
    #: Texts whose answer carried X-Yield-Parked-Seconds: they went through the lot.
    replayed: set = attrs.Factory(set)
    longest_wait: float = 0.0
    longest_parked: float = 0.0
    #: Why requests failed: the reason, how many, and one text as an example.
    failures: dict[str, list] = attrs.Factory(dict)
    stopped: bool = False
    in_flight: set = attrs.Factory(set)

    def fail(self, text: str, why: str, wrong: bool = False) -> None:
        if wrong:
            self.wrong += 1
        else:
            self.failed += 1
        seen = self.failures.setdefault(why, [0, text])
        seen[0] += 1


@attrs.define(eq=False)
class _Watch:
    """The proxy's yield and drain as they happened, from its own state observer."""

    started: float
    yielded_at: float | None = None
    resumed_at: float | None = None
    drained_at: float | None = None
    peak_before_yield: int = 0
    parked_in_yield: int = 0
    #: (text, arrived, finished) of every request the backend saw.
    at_backend: list = attrs.Factory(list)


def max_overlap(intervals) -> int:
    """The most intervals open at once (an end and a start at the same instant do not overlap)."""
    events = sorted([(b, 1) for b, _ in intervals] + [(e, -1) for _, e in intervals])
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


class _BackendTimer(Resource):
    """Wraps the sim's resource to note when each text arrived at the backend and left it.

    With the texts that came back marked as parked, this gives the exact number of
    replayed requests at the backend at once, however the drain and direct traffic mix.
    """

    isLeaf = True

    def __init__(self, inner, clock, visits: list):
        super().__init__()
        self._inner = inner
        self._clock = clock
        self._visits = visits

    def render(self, request):
        arrived = self._clock.seconds()
        text = None
        if request.content is not None:
            try:
                text = json.loads(request.content.read()).get("input")
            except (ValueError, AttributeError):
                pass
            request.content.seek(0)
        request.notifyFinish().addBoth(lambda _: self._visits.append((text, arrived, self._clock.seconds())))
        return self._inner.render(request)


def demo_text(i: int) -> str:
    """The ``i``-th text of the burst: distinct, so every vector can be checked."""
    return f"demo text {i}: the GPU may be yielded while this one waits"


def _vector_ok(got: Any, expected: list[float]) -> bool:
    return (
        isinstance(got, list)
        and len(got) == len(expected)
        and all(isinstance(g, (int, float)) and math.isclose(g, e, rel_tol=1e-9, abs_tol=1e-12)
                for g, e in zip(got, expected))
    )


@implementer(IAgentEndpointFactory)
@attrs.frozen
class NoDelayEndpoints:
    """TCP with Nagle off: without it the demo's small requests wait for delayed ACKs."""

    _reactor: Any
    _timeout: float

    def endpointForURI(self, uri):
        endpoint = TCP4ClientEndpoint(self._reactor, uri.host.decode("ascii"), uri.port, timeout=self._timeout)
        return _NoDelay(endpoint)


@attrs.frozen
class _NoDelay:
    """A client endpoint wrapper that sets TCP_NODELAY on each new connection."""

    _wrapped: Any

    def connect(self, factory):
        def nodelay(protocol):
            set_no_delay(getattr(protocol, "transport", None))
            return protocol

        return self._wrapped.connect(factory).addCallback(nodelay)


def why_unreachable(failure_value: BaseException, timeout: float) -> str | None:
    """A short reason for a request of the burst that got no answer, or None if it is something else."""
    if isinstance(failure_value, defer.TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(failure_value, ierror.ConnectionRefusedError):
        return "connection refused"
    if isinstance(failure_value, (ierror.TimeoutError, ierror.ConnectingCancelledError)):
        return "the connection attempt timed out"
    if isinstance(failure_value, ierror.ConnectError):
        detail = failure_value.osError or (failure_value.args[0] if failure_value.args else None)
        return f"cannot connect ({detail})" if detail else "cannot connect"
    if isinstance(failure_value, (ResponseNeverReceived, ResponseFailed)):
        reasons = getattr(failure_value, "reasons", []) or []
        detail = "; ".join(r.getErrorMessage() for r in reasons) or "connection closed"
        return f"the connection broke before an answer ({detail})"
    if isinstance(failure_value, (ierror.ConnectionLost, ierror.ConnectionDone, OSError)):
        return f"the connection broke ({failure_value})"
    return None


async def bounded(reactor, coroutine, timeout: float):
    """Await ``coroutine``, cancelled after ``timeout`` seconds with a :class:`defer.TimeoutError`.

    A cancelled Agent request fails with ``ResponseNeverReceived``, not
    ``CancelledError``: ``onTimeoutCancel`` turns whatever the cancel left into
    the timeout (addTimeout calls it only when its own timer fired).
    """

    def timed_out(result: object, seconds: float) -> Failure:
        return Failure(defer.TimeoutError(f"no answer within {seconds:g} s"))

    return await defer.Deferred.fromCoroutine(coroutine).addTimeout(timeout, reactor, onTimeoutCancel=timed_out)


async def demo_command(reactor, args: argparse.Namespace) -> int:
    """Sim + proxy in this process, a burst through them, a yield in the middle; a report."""
    line = _Line(sys.stderr, sys.stderr.isatty())
    _log_above(line)
    run = await _start(reactor, args, line)
    print(run.intro(), flush=True)
    elapsed = await run.burst_through_a_yield()
    sim, burst = run.sim, run.burst
    duplicates = sum(1 for n in sim.texts_embedded.values() if n > 1)
    not_sent = burst.total - burst.sent
    good = burst.failed == 0 and burst.wrong == 0 and not_sent == 0 and not run.admin_errors
    print(_demo_report(args, burst, run.watch, run.cap, elapsed, duplicates, not_sent, run.admin_errors, good))
    return EXIT_OK if good else EXIT_ERROR


def _log_above(line: _Line) -> None:
    """Warnings from the proxy and the sim go above the progress line."""
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        formatEventAsClassicLogText,
        globalLogBeginner,
    )

    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(
            lambda event: line.say((formatEventAsClassicLogText(event) or "").rstrip()),  # type: ignore[arg-type]
            [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)],
        )],
        redirectStandardIO=False,
    )


async def _start(reactor, args: argparse.Namespace, line: _Line) -> _Run:
    """The simulated backend, a proxy in front of it with its admin API, a client: all listening."""
    from treq.client import HTTPClient
    from twisted.internet.endpoints import TCP4ServerEndpoint

    from ..config import Config
    from ..service import build

    watch = _Watch(started=reactor.seconds())

    class TimedSim(SimOllama):
        """The sim, with :class:`_BackendTimer` in front of its resource."""

        def resource(self):
            return _BackendTimer(super().resource(), reactor, watch.at_backend)

    sim = TimedSim(reactor, latency=args.latency, parallel=DEMO_SIM_PARALLEL)
    sim_port = await sim.listen(0, "127.0.0.1")
    config = Config().with_overrides(**{"proxy.upstream": f"http://127.0.0.1:{sim_port}"})
    token = secrets.token_urlsafe(16)
    proxy = build(reactor, config, token=token)
    proxy_listener = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(proxy.proxy_app.site())
    admin_listener = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(proxy.admin_app.site())
    admin = Admin(f"http://127.0.0.1:{admin_listener.getHost().port}", token)
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = args.concurrency
    http = HTTPClient(Agent.usingEndpointFactory(reactor, NoDelayEndpoints(reactor, 10.0), pool=pool))
    run = _Run(
        reactor, args, line, watch, _Burst(args.texts), sim, proxy,
        proxy_url=f"http://127.0.0.1:{proxy_listener.getHost().port}",
        admin=admin, http=http, cap=config.replay.concurrency,
        listeners=[proxy_listener, admin_listener], pool=pool,
    )
    watch.started = reactor.seconds()
    proxy.state.observe(run.state_changed)
    return run


class Phase(enum.Enum):
    """Where the demo's controller is (:meth:`_Run.yield_and_resume`)."""

    #: Waiting for the moment to yield.
    WAITING = "waiting"
    #: Yielding the GPU, then giving it back.
    YIELDING = "yielding"


#: What the controller's one event does; any other is a bug (:class:`~yieldproxy.states.Unexpected`).
PHASE_MOVES: Moves[Phase, str] = Moves("the demo's controller", {
    # It is time to yield: after --yield-after, or once half the burst is sent.
    (Phase.WAITING, "go"): Phase.YIELDING,
})


@attrs.define(eq=False)
class _Run(Machine[Phase, str]):
    """One run of the demo: its parts, the burst's client side, the yield, the watch over both."""

    moves = PHASE_MOVES

    reactor: Any
    args: argparse.Namespace
    line: _Line
    watch: _Watch
    burst: _Burst
    sim: Any
    proxy: Any
    proxy_url: str
    #: The proxy's admin API: called on the reactor's thread pool (:meth:`call_admin`), as the reactor serves it.
    admin: Admin
    http: Any
    cap: int
    listeners: list
    pool: HTTPConnectionPool
    admin_errors: list[str] = attrs.Factory(list)
    #: The controller's progress (:data:`PHASE_MOVES`).
    state: Phase = attrs.field(default=Phase.WAITING, init=False)
    #: Fires when it is time to yield: after --yield-after, or once half the burst is sent.
    go: defer.Deferred = attrs.Factory(defer.Deferred)

    @property
    def deadline(self) -> float:
        return self.args.deadline or (60.0 + self.args.yield_after + self.args.yield_for + 0.02 * self.args.texts)

    @property
    def request_timeout(self) -> float:
        return max(30.0, self.args.yield_for + 30.0)

    def mark(self) -> float:
        """Seconds since the burst started, for the progress lines."""
        return self.reactor.seconds() - self.watch.started

    def intro(self) -> str:
        args = self.args
        return (
            f"demo: {args.texts} embedding requests, {args.concurrency} at a time, through the proxy at "
            f"{self.proxy_url} to a simulated Ollama ({args.latency * 1000:g} ms a request, "
            f"{DEMO_SIM_PARALLEL} in parallel); "
            f"the GPU is yielded after {args.yield_after:g} s for {args.yield_for:g} s."
        )

    # -- the burst -----------------------------------------------------------

    async def burst_through_a_yield(self) -> float:
        """Send the whole burst, yield and resume in the middle; the seconds it took."""
        from twisted.internet.task import LoopingCall

        reactor, args = self.reactor, self.args
        ticker = LoopingCall(self.progress)
        ticker.clock = reactor
        ticker.start(0.2 if self.line.tty else 1.0, now=True)
        controller = defer.Deferred.fromCoroutine(self.yield_and_resume())
        texts = iter(range(args.texts))
        workers = defer.gatherResults(
            [defer.Deferred.fromCoroutine(self.worker(texts)) for _ in range(args.concurrency)],
            consumeErrors=True,
        )
        watchdog = reactor.callLater(self.deadline, self.out_of_time, controller)
        yield_timer = reactor.callLater(args.yield_after, self.time_to_yield)
        try:
            await workers
            elapsed = self.mark()
            if self.state is Phase.WAITING:
                controller.cancel()
            await controller.addErrback(lambda f: f.trap(defer.CancelledError))
        finally:
            for call in (watchdog, yield_timer):
                if call.active():
                    call.cancel()
            ticker.stop()
            self.progress()
            self.line.finish()
            await self.shut_down()
        return elapsed

    async def worker(self, texts) -> None:
        """Send the next text, one at a time, until none is left."""
        half = (self.args.texts + 1) // 2
        for i in texts:
            if self.burst.stopped:
                return
            self.burst.sent += 1
            if self.burst.sent == half:
                self.time_to_yield()
            await self.send(demo_text(i))

    async def send(self, text: str) -> None:
        """One embedding request through the proxy; its answer checked and counted."""
        reactor, burst = self.reactor, self.burst
        began = reactor.seconds()

        async def exchange():
            response = await self.http.post(
                self.proxy_url + "/api/embed", json={"model": DEMO_MODEL, "input": text}, reactor=reactor
            )
            return response.code, response.headers.getRawHeaders(b"x-yield-parked-seconds"), await response.content()

        d = defer.Deferred.fromCoroutine(bounded(reactor, exchange(), self.request_timeout))
        burst.in_flight.add(d)
        try:
            code, parked, raw = await d
        except Exception as e:
            why = "stopped at the deadline" if burst.stopped else (why_unreachable(e, self.request_timeout) or repr(e))
            burst.fail(text, why)
            return
        finally:
            burst.in_flight.discard(d)
        burst.longest_wait = max(burst.longest_wait, reactor.seconds() - began)
        if parked:
            burst.replayed.add(text)
            try:
                burst.longest_parked = max(burst.longest_parked, float(parked[0]))
            except ValueError:
                pass
        self._check(text, code, raw)

    def _check(self, text: str, code: int, raw: bytes) -> None:
        """A 200 carrying exactly the text's vector is ok; anything else a failure, with why."""
        burst = self.burst
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if code != 200:
            error = body.get("error") if isinstance(body, dict) else raw[:200]
            burst.fail(text, f"HTTP {code}: {printable(error, 200)}")
            return
        vectors = body.get("embeddings") if isinstance(body, dict) else None
        expected = expected_embedding(text, DEMO_MODEL, self.sim.dim)
        if isinstance(vectors, list) and len(vectors) == 1 and _vector_ok(vectors[0], expected):
            burst.ok += 1
        else:
            burst.fail(text, "wrong vector", wrong=True)

    # -- the yield -------------------------------------------------------------

    def time_to_yield(self) -> None:
        # A fast machine must not finish the burst before the yield.
        if not self.go.called:
            self.go.callback(None)

    async def yield_and_resume(self) -> None:
        """Hold the GPU over the admin API when it is time, and release it --yield-for later."""
        args, line, mark = self.args, self.line, self.mark
        await self.go
        self.fire("go")
        line.say(f"{mark():6.2f}s  POST /yield (source {DEMO_SOURCE}, expected {args.yield_for:g} s)")
        try:
            # The lease ends the hold by itself should the resume call below be lost.
            await self.call_admin(
                self.admin.yield_gpu, DEMO_SOURCE, "demo: the GPU is lent to another job",
                expected_seconds=args.yield_for, for_seconds=args.yield_for + 10.0,
            )
        except AdminError as e:
            self.admin_errors.append(f"yield: {e.message}")
            return
        await task.deferLater(self.reactor, args.yield_for, lambda: None)
        parked = len(self.proxy.lot)
        line.say(f"{mark():6.2f}s  POST /resume: {parked} parked requests go out, at most {self.cap} at a time")
        try:
            await self.call_admin(self.admin.resume, DEMO_SOURCE)
        except AdminError as e:
            self.admin_errors.append(f"resume: {e.message}")

    def call_admin(self, call, *args: Any, **kwargs: Any) -> defer.Deferred:
        """A call of the broker library's :class:`Admin`, in the reactor's thread pool: the reactor runs on, and
        with it the admin API the call is to."""
        return threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(), call, *args, **kwargs)

    def out_of_time(self, controller: defer.Deferred) -> None:
        """The deadline: stop sending, give up on what is in flight and on the yield."""
        watch = self.watch
        self.burst.stopped = True
        if watch.yielded_at is not None and watch.resumed_at is None:
            watch.parked_in_yield = len(self.proxy.lot)
        self.line.say(f"{self.mark():6.2f}s  the demo's deadline ({self.deadline:g} s) passed; stopping")
        for d in list(self.burst.in_flight):
            d.cancel()
        controller.cancel()

    # -- watching the proxy ----------------------------------------------------

    def state_changed(self, yielded: bool) -> None:
        """The proxy's own state observer: when it yielded, resumed, and what it parked."""
        watch, now = self.watch, self.reactor.seconds()
        if yielded:
            watch.yielded_at = now
            watch.peak_before_yield = self.sim.peak_in_flight
        else:
            watch.resumed_at = now
            watch.parked_in_yield = len(self.proxy.lot)
            self.watch_drain()

    def watch_drain(self) -> None:
        """Note when the lot is empty again after the resume."""
        watch = self.watch
        if self.proxy.scheduler.state_name == "draining":
            self.reactor.callLater(0.01, self.watch_drain)
        elif watch.drained_at is None and watch.resumed_at is not None:
            drained_at = watch.drained_at = self.reactor.seconds()
            self.line.say(f"{self.mark():6.2f}s  the lot is empty: drained in {drained_at - watch.resumed_at:.2f} s")

    def progress(self) -> None:
        burst = self.burst
        try:
            self.line.show(
                f"{self.mark():6.2f}s  sent {burst.sent}/{burst.total}  ok {burst.ok}  failed {burst.failed + burst.wrong}"
                f"  parked {len(self.proxy.lot)}  state {self.proxy.scheduler.state_name}"
            )
        except Exception as e:  # A broken progress line must not stop the demo.
            self.line.say(f"progress line failed: {e!r}")

    async def shut_down(self) -> None:
        """Client, listeners, proxy, sim: each bounded, none may hide the report."""
        reactor = self.reactor
        await _quietly(reactor, self.pool.closeCachedConnections())
        for listener in self.listeners:
            await _quietly(reactor, listener.stopListening())
        self.proxy.replayer.stop()
        await _quietly(reactor, self.proxy.upstream.close())
        await _quietly(reactor, self.sim.stop())


async def _quietly(reactor, d) -> None:
    """Cleanup that must neither hang nor hide the report."""
    try:
        await defer.maybeDeferred(lambda: d).addTimeout(5, reactor)
    except Exception:
        pass


def _demo_report(args, burst: _Burst, watch: _Watch, cap: int, elapsed: float,
                 duplicates: int, not_sent: int, admin_errors: list[str], good: bool) -> str:
    rows = [
        ("sent", f"{burst.sent}" + (f" ({not_sent} never sent)" if not_sent else "")),
        ("ok", f"{burst.ok}"),
        ("failed", f"{burst.failed}"),
        ("wrong vectors", f"{burst.wrong}" + (f", {duplicates} texts embedded twice" if duplicates else "")),
        ("longest wait", f"{burst.longest_wait:.2f} s"),
    ]
    if watch.yielded_at is None:
        rows.append(("yield", "none: the burst ended before the yield"))
    else:
        if watch.resumed_at is None:
            yielded = f"GPU yielded {watch.started + elapsed - watch.yielded_at:.2f} s, not resumed before the end"
        else:
            yielded = f"GPU yielded {watch.resumed_at - watch.yielded_at:.2f} s"
        parked = f"{yielded}; {watch.parked_in_yield} requests parked through it"
        if burst.longest_parked:
            parked += f", the longest {burst.longest_parked:.2f} s"
        rows.append(("time parked", parked))
        if len(burst.replayed) > watch.parked_in_yield:
            # Arrivals during the drain queue behind the lot (no overtaking), at the replay cap.
            rows.append(("replayed", (
                f"{len(burst.replayed)} requests went out through the lot, in order, "
                f"until it drained"
            )))
        if watch.resumed_at is not None:
            replay_peak = max_overlap([(b, e) for t, b, e in watch.at_backend if t in burst.replayed])
            peak = f"{replay_peak} replayed at once (replay cap {cap})"
            if replay_peak > cap:
                peak += " -- ABOVE THE CAP"
            rows.append((
                "peak backend",
                f"{peak}; {watch.peak_before_yield} before the yield (direct traffic is not capped)",
            ))
    rows.append(("took", f"{elapsed:.2f} s"))
    width = max(len(k) for k, _ in rows)
    out = ["", "demo report:"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    for why, (count, text) in itertools.islice(burst.failures.items(), 5):
        out.append(f"  {count} x {why} (e.g. {text!r})")
    for why in admin_errors:
        out.append(f"  admin API: {why}")
    out.append(
        "result: OK: every request answered, every vector right" if good
        else "result: FAILED: see above"
    )
    return "\n".join(out)
