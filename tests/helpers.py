"""Shared test helpers: a Clock-driven core, and timeouts for real-socket awaits."""

from __future__ import annotations

import os
import signal
import socket

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import Clock, Cooperator

from yieldproxy.config import ClassConfig, Config, ParkingConfig, ReplayConfig, RouteRule, VerificationConfig
from yieldproxy.lot.parking import Entry, ParkingLot
from yieldproxy.lot.replay import Replayer
from yieldproxy.lot.state import YieldState
from yieldproxy.names import canonical_model
from yieldproxy.observe.metrics import Metrics
from yieldproxy.schedule.scheduler import Scheduler
from yieldproxy.servers import PROBE_TEXT
from yieldproxy.service import build_heart, one_step_cooperator
from yieldproxy.upstream.health import UpstreamHealth


def clock_cooperator(clock: Clock) -> Cooperator:
    """A Cooperator that runs its steps on ``clock``, so tests advance it by hand."""
    return one_step_cooperator(clock)


@attrs.define(eq=False)
class Core:
    """State, lot, replayer and scheduler on one Clock, wired as ``service.build`` does."""

    clock: Clock
    metrics: Metrics
    state: YieldState
    lot: ParkingLot
    replayer: Replayer
    scheduler: Scheduler
    #: The upstream's reachability and outage verdicts, as ``service.build`` gives them to the proxy app.
    health: UpstreamHealth = attrs.Factory(lambda: UpstreamHealth("http://upstream.invalid"))

    def run(self, seconds: float = 0.0, step: float | None = None) -> None:
        """Advance the clock by ``seconds``, stopping at each due call's own time to run it.

        Every call runs at exactly the time it asked for (and the calls it
        schedules within the window run too), however long the window.
        ``step`` is accepted for older callers and ignored: there are no
        steps any more.
        """
        advance_through(self.clock, seconds)

    def sample(self, name: str, **labels) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def advance_through(clock: Clock, seconds: float) -> None:
    """Move ``clock`` forward by ``seconds``, running each delayed call at its own time, in order.

    ``Clock.advance(seconds)`` jumps to the end first, so every call due in
    the window sees the end's time and what it schedules is measured from
    there; stepping in small increments is slow and still late by up to a
    step.  Here the clock stops at every due time, and setting the time
    instead of adding to it leaves no floating-point drift.
    """
    end = clock.seconds() + seconds
    clock.advance(0)
    while True:
        due = [call.getTime() for call in clock.getDelayedCalls() if call.active()]
        next_time = min(due, default=None)
        if next_time is None or next_time > end:
            break
        clock.rightNow = max(clock.rightNow, next_time)
        clock.advance(0)
    clock.rightNow = max(clock.rightNow, end)
    clock.advance(0)


def release_every_hold(state: YieldState) -> None:
    """End a test's holds the way their sources would (``release``), which cancels their lease timers."""
    for hold in state.holds:
        state.release(hold.source, hold.scope)


def knows(record, model: str) -> bool:
    """Whether ``record`` (a :class:`~yieldproxy.upstream.served.ServedRecord`) holds ``model``, any spelling of it."""
    return canonical_model(model) in {entry.model for entry in record.recent()}


def make_core(config: Config | None = None, twin_ok=None, judges=None, **replay) -> Core:
    config = config or Config()
    if replay:
        config = attrs.evolve(config, replay=attrs.evolve(config.replay, **replay))
    clock = Clock()
    metrics = Metrics()
    heart = build_heart(clock, config, metrics, clock_cooperator(clock), twin_ok=twin_ok, judges=judges)
    return Core(clock, metrics, heart.state, heart.lot, heart.scheduler.drainer(None), heart.scheduler)


def config_with(**sections) -> Config:
    """A Config with some sections' keys replaced: ``config_with(parking={"max_parked": 2})``."""
    config = Config()
    changes = {}
    for name, keys in sections.items():
        if name == "classes":
            classes = dict(config.classes)
            for cls, cls_keys in keys.items():
                classes[cls] = attrs.evolve(classes[cls], **cls_keys)
            changes["classes"] = classes
        else:
            changes[name] = attrs.evolve(getattr(config, name), **keys)
    return attrs.evolve(config, **changes)


def declaring(*paths: str, config: Config | None = None, cls: str = "interactive") -> Config:
    """``config`` (the defaults if None) with ``[[routes]]`` rules naming ``paths``, in ``cls``.

    For a test whose fake upstream serves routes Ollama has not: the proxy
    answers such a route ``404 page not found`` at once, as Ollama would
    (``servers/ollama.py``, ``refuse``), unless a rule names it.  ``cls``
    defaults to the class an unknown route gets, so nothing else changes.
    """
    config = config or Config()
    rules = tuple(RouteRule(cls=cls, path=path) for path in paths)
    return attrs.evolve(config, routes=(*config.routes, *rules))


__all__ = ["Core", "make_core", "config_with", "declaring", "Entry", "ClassConfig", "ParkingConfig", "ReplayConfig"]


# -- real sockets ---------------------------------------------------------------


#: Texts the proxy embeds by itself (the outage watcher's probe, the twin verification's probe texts),
#: which a sim's ``texts_embedded`` counts beside the callers'.
OWN_TEXTS = frozenset({PROBE_TEXT, *VerificationConfig().probe_texts})


def embedded(sim) -> dict[str, int]:
    """What a sim embedded for callers (not the proxy's own probe and verification texts)."""
    return {text: n for text, n in sim.texts_embedded.items() if text not in OWN_TEXTS}


async def admin(stack, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    """``GET`` (no ``body``) or ``POST`` ``path`` on a running stack's admin API; its JSON, asserted 200."""
    import treq
    from twisted.internet import reactor

    if body is None:
        d = treq.get(stack.admin_url + path, persistent=False)
    else:
        d = treq.post(stack.admin_url + path, json=body, persistent=False)
    answer = await d.addTimeout(timeout, reactor)
    assert answer.code == 200, await answer.text()
    return await answer.json()


@attrs.define(eq=False)
class Stack:
    """A simulated backend and a proxy (``service.build``, its service started) on free 127.0.0.1 ports."""

    reactor: object
    sim: object
    proxy: object
    proxy_url: str
    admin_url: str
    #: A test's own backend in place of the sim, if any.
    echo: object = None
    #: Ports a test opened beside the stack (its own backend), closed after the proxy stops.
    _ports: list = attrs.Factory(list)

    async def stop(self) -> None:
        """Stop the proxy as twistd does (the graceful stop), then the sim and the test's own ports."""
        if self.proxy.service.running:
            await self.proxy.service.stopService()
        for port in self._ports:
            await port.stopListening()
        if self.sim is not None:
            await self.sim.stop()

    def sample(self, name: str, **labels) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


#: Both listeners on a port the kernel picks.
EPHEMERAL = {"proxy.listen": "tcp:0:interface=127.0.0.1", "admin.listen": "tcp:0:interface=127.0.0.1"}


def listening_url(proxy, name: str) -> str:
    """Where the proxy's ``proxy`` or ``admin`` listener listens (it may have been given port 0)."""
    return f"http://127.0.0.1:{proxy.service.getServiceNamed(name).port.getHost().port}"


#: The models a test's simulated Ollama has (the fixtures' sims, unless a test names its own): every name
#: the tests send through one.  The sim, as Ollama, answers any other name 404 (tools/sim: ``models``).
TEST_MODELS = (
    "all-minilm", "llama3.2", "nomic-embed-text", "m", "x", "y", "a", "b", "e", "small", "big", "huge", "broken",
    "stuck", "late", "other", "any", "anything", "whatever", "named", "alias", "inner", "llama3", "llama3:70b",
    "all-minilm:v2", "all-minilm:q4_0", "bge-m3", "bert", "minilm-l6", "minilm-cpu", "m-cpu", "bulk-embed", "fuzz-a", "text-embed",
    "text-embedding-3-small", "sentence-transformers/all-MiniLM-L6-v2",
)


def with_test_models(options: dict) -> dict:
    """A sim's options with :data:`TEST_MODELS` unless they name its models."""
    return options if "models" in options else {**options, "models": TEST_MODELS}


async def start_stack(
    reactor, config: Config | None = None, upstream: str | None = None, token=None, watchers: bool = False,
    read_token=None, history_interval: float = 1.0, **sim_options,
) -> Stack:
    """Start a SimOllama (unless ``upstream`` is given) and a proxy in front of it, as twistd would.

    The proxy is ``service.build``'s, its service started on ephemeral ports.
    Without ``watchers`` the outage watcher is left out
    (``upstream.detect_outages`` off): most stacks test what happens to
    requests that fail on their own; outage detection has its own tests.
    """
    from yieldproxy.service import build
    from yieldproxy.tools.sim import SimOllama

    sim = None
    if upstream is None:
        sim = SimOllama(reactor, **with_test_models(sim_options))
        port = await sim.listen()
        upstream = f"http://127.0.0.1:{port}"
    config = (config or Config()).with_overrides(**{"proxy.upstream": upstream}, **EPHEMERAL)
    if not watchers:
        config = config.with_overrides(**{"upstream.detect_outages": False})
    proxy = build(reactor, config, token=token, read_token=read_token, history_interval=history_interval)
    proxy.service.startService()
    return Stack(reactor, sim, proxy, listening_url(proxy, "proxy"), listening_url(proxy, "admin"))


async def sleep(reactor, seconds: float) -> None:
    from twisted.internet.task import deferLater

    await deferLater(reactor, seconds)


async def wait_for(reactor, predicate, timeout: float = 10.0, step: float = 0.01) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    waited = 0.0
    while not predicate():
        if waited >= timeout:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        await sleep(reactor, step)
        waited += step


async def until_healthy(reactor, admin_url: str, ended, output, tries: int = 300) -> None:
    """Poll a child twistd's ``GET /healthz`` every 0.1 s until it answers 200 (at most ``tries`` times).

    ``ended()`` says whether the process has exited (then it fails at once),
    ``output()`` what it printed, for the failure's message.
    """
    import treq

    for _ in range(tries):
        try:
            response = await treq.get(admin_url + "/healthz", persistent=False).addTimeout(2, reactor)
            await response.content()
            if response.code == 200:
                return
        except Exception:
            pass
        if ended():
            raise AssertionError(f"twistd exited before it served: {output()}")
        await sleep(reactor, 0.1)
    raise AssertionError(f"twistd did not become healthy: {output()}")


def in_thread(reactor, function, *args, timeout: float = 120.0, **kwargs):
    """Run a blocking client call in a thread; the Deferred fails after ``timeout``."""
    from twisted.internet.threads import deferToThreadPool

    return deferToThreadPool(reactor, reactor.getThreadPool(), function, *args, **kwargs).addTimeout(timeout, reactor)



#: Ports :func:`free_port` hands out: below the kernel's ephemeral range (ip_local_port_range, 32768 up), so
#: no listener on port 0 and no outgoing connection takes one between the handing out and the child's bind
#: (an Infinity takes 20 s to bind); each pytest-xdist worker its own slice, so no two workers share one.
_PORTS_FROM, _PORTS_TO, _PORTS_PER_WORKER = 20000, 32768, 1000
#: This process's slice (its first port) and how many of it were handed out.
_handed: list[int] = []


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now, from this process's slice, in turn (for child processes)."""
    if not _handed:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        first = _PORTS_FROM + (int(worker) if worker.isdigit() else 0) * _PORTS_PER_WORKER
        _handed.extend((min(first, _PORTS_TO - _PORTS_PER_WORKER), 0))
    for _ in range(_PORTS_PER_WORKER):
        port = _handed[0] + _handed[1] % _PORTS_PER_WORKER
        _handed[1] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # another process's: the next
            return port
    raise RuntimeError("no free port below the ephemeral range")


def log_tail(path: str) -> str:
    """The last 3,000 characters of a child process's log file, for a failing test's message."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-3000:]
    except OSError:
        return "(no log)"


class ChildOutput(ProcessProtocol):
    """Keeps a child's output; ``ended`` fires with its exit code.

    twistd stopped by SIGTERM re-raises the signal after a clean shutdown, so
    its status reflects the signal (systemd counts that as a clean stop):
    ``ended`` then fires with ``"SIGTERM"``.
    """

    def __init__(self):
        self.output = b""
        self.ended: Deferred = Deferred()

    def outReceived(self, data):
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason):
        status = reason.value
        self.ended.callback("SIGTERM" if status.signal == signal.SIGTERM else status.exitCode)


def ci_cache_dir(env: str, script: str, key: str, name: str, default_version: str | None = None) -> str:
    """Where a ``.ci/`` script keeps what it builds or fetches: ``$env`` when set, else
    ``$YIELDPROXY_CACHE/<name>-<version>`` (``/var/cache/yieldproxy`` by default), the version read from
    the script's ``KEY=`` line (``default_version`` when the script or the line is missing; without one,
    a missing line fails)."""
    import os
    import re

    given = os.environ.get(env)
    if given:
        return given
    version = default_version
    try:
        with open(script, encoding="utf-8") as f:
            found = re.search(rf"^{key}=(\S+)$", f.read(), re.M)
        if found:
            version = found.group(1)
    except OSError:
        if default_version is None:
            raise
    assert version is not None, f"no {key}= line in {script}"
    return os.path.join(os.environ.get("YIELDPROXY_CACHE", "/var/cache/yieldproxy"), f"{name}-{version}")


def skip_or_fail(why: str | None, ci_must: str) -> None:
    """When something a test needs is missing here (``why``), skip it; under CI, which must ``ci_must``, fail it."""
    import os

    import pytest

    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must {ci_must}")
    pytest.skip(why)


def required_tool(*names: str, install: str) -> str:
    """The path of the first of ``names`` on PATH; skip without it, but fail under CI (which installs it)."""
    import os
    import shutil

    import pytest

    for name in names:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(f"{names[0]} is not installed ({install}); CI must install it")
    pytest.skip(f"{names[0]} is not installed ({install}); set CI=1 to make this a failure")


# -- a pool of upstreams on a Clock (issue 12) ----------------------------------------


def pool_config(*members, config: Config | None = None) -> Config:
    """``config`` (default: the defaults) with ``[[upstreams]]`` made of ``members``: dicts of MemberConfig keys.

    A member without a ``url`` gets one of its own (nothing listens there:
    clock-only pools have no clients).
    """
    from yieldproxy.config import MemberConfig

    tables = tuple(
        MemberConfig(**{"url": f"http://127.0.0.1:{20000 + i}", **member}) for i, member in enumerate(members)
    )
    return attrs.evolve(config or Config(), upstreams=tables)


def make_pool_core(*members, config: Config | None = None, twin_ok=None, judges=None, **replay) -> Core:
    """A :class:`Core` whose scheduler routes over a pool of ``members`` (see :func:`pool_config`); ``core.scheduler``.

    ``twin_ok(member, entry)``: the pool's twin check (default: every eligible member serves).
    """
    return make_core(pool_config(*members, config=config), twin_ok=twin_ok, judges=judges, **replay)


@attrs.define(eq=False)
class PoolStack:
    """Several simulated backends and a proxy pooling them (``[[upstreams]]``), on free 127.0.0.1 ports."""

    reactor: object
    #: The sims by member name, in config order.
    sims: dict
    proxy: object
    proxy_url: str
    admin_url: str

    async def stop(self) -> None:
        if self.proxy.service.running:
            await self.proxy.service.stopService()
        for sim in self.sims.values():
            await sim.stop()

    def sample(self, name: str, **labels) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def start_pool_stack(
    reactor, members, config: Config | None = None, token=None, watchers: bool = False, history_interval: float = 1.0,
    **sim_options,
) -> PoolStack:
    """A SimOllama per member (dicts of ``[[upstreams]]`` keys, each with a ``name``) and a proxy pooling them.

    A member's own sim options go under its ``sim`` key (merged over ``sim_options``).
    Without ``watchers`` outage detection is off, as in :func:`start_stack`.  Unless
    ``config`` names its own ``verification.models``, ``all-minilm``'s twins are
    verified from the start, and it returns once that is done (or could not run).
    """
    from yieldproxy.service import build
    from yieldproxy.tools.sim import SimOllama

    sims = {}
    tables = []
    for member in members:
        member = dict(member)
        options = with_test_models({**sim_options, **member.pop("sim", {})})
        sim = SimOllama(reactor, **options)
        port = await sim.listen()
        sims[member["name"]] = sim
        tables.append({"url": f"http://127.0.0.1:{port}", **member})
    config = pool_config(*tables, config=config).with_overrides(**EPHEMERAL)
    if not config.verification.models:
        config = attrs.evolve(config, verification=attrs.evolve(config.verification, models=("all-minilm",)))
    if not watchers:
        config = attrs.evolve(
            config,
            upstream=attrs.evolve(config.upstream, detect_outages=False),
            upstreams=tuple(attrs.evolve(m, detect_outages=False) for m in config.upstreams),
        )
    proxy = build(reactor, config, token=token, history_interval=history_interval)
    proxy.service.startService()
    if proxy.twins is not None:
        # The model lists are read first (discovery), then the twins verified.
        try:
            await wait_for(reactor, lambda: _lists_read(proxy) and proxy.twins.settled, timeout=5)
        except AssertionError:
            pass  # a member that never answers (a test of one): the others were verified meanwhile
    return PoolStack(reactor, sims, proxy, listening_url(proxy, "proxy"), listening_url(proxy, "admin"))


def _lists_read(proxy) -> bool:
    """Every member that discovers its models has a list (or is unreachable)."""
    return all(
        m.catalogue.static or m.catalogue.discovered is not None or not m.available() for m in proxy.scheduler.members
    )
