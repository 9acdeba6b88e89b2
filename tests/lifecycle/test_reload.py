"""Reload and upgrade against real processes on 127.0.0.1: nothing lost, nothing sent twice, no connection refused.

Each test starts ``twistd -n yieldproxy`` as a child with ``PYTHONPATH`` at
a copy of the package (the "installed" code: a test upgrades it by changing
the copy, as ``pip install -U`` would change site-packages), in front of the
simulated Ollama running in the test's own reactor (it counts every text it
embeds, so a request sent twice shows).  A reload starts a new process (the
old one's child); its pid comes back in the answer to ``POST /reload``, and
every process a test started is ended by pid when it is done.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import ProcessProtocol, Protocol

from helpers import embedded, free_port, in_thread, sleep, until_healthy, wait_for
from rawhttp import RawClient, request_bytes
from test_twistd import TWISTD
from yieldproxy.lifecycle.succession.predecessor import WIND_DOWN_STEP
from yieldproxy.tools.sim import SimOllama, expected_embedding
from yieldproxy.tools.sim.content import expected_reply, messages_prompt

# Real twistd processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 60
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "all-minilm"


class Child(ProcessProtocol):
    """The first process: its output (the successors write to the same pipes), and its exit."""

    def __init__(self):
        self.output = b""
        self.exited: Deferred = Deferred()

    def outReceived(self, data):
        self.output += data

    errReceived = outReceived

    def processExited(self, reason):
        self.exited.callback(reason.value.exitCode)

    def text(self) -> str:
        return self.output.decode(errors="replace")


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the open and the read
        return True


def end(pid: int) -> None:
    """End a process this test started, by pid."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


#: Appended to the copy's lifecycle/succession/moments.py (whose MOMENTS and SIDE it keeps): at the moment a test
#: names (``Proxy.at``), once, a process is signalled: ``kill`` (SIGKILL) or ``term`` (SIGTERM) the process
#: passing it, ``term-parent`` its parent (the old process, for a moment of the new one), ``signals-parent``
#: SIGHUP, SIGUSR1 and SIGUSR2 to it; ``usr1`` SIGUSR1 to the process passing it; ``kill-old``, ``kill-new``,
#: ``term-old``, ``term-new`` the old or the new process, whichever passes the moment.  The pids of both
#: are written down beside the plan (``Proxy.handover_pids``).
ACTING_MOMENTS = """

import json as _json, os as _os, signal as _signal

_PLAN = _os.environ.get("YIELDPROXY_TEST_MOMENTS", "")


def _new_process_of(me):
    for entry in _os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == me and b"yieldproxy" in command:
            return int(entry)
    return None


def reached(moment):
    if not _PLAN:
        return
    try:
        with open(_PLAN) as f:
            plan = _json.load(f)
    except (OSError, ValueError):
        return
    if plan.get("moment") != moment:
        return
    try:
        _os.rename(_PLAN, _PLAN + ".taken")  # once, whichever process passes it first
    except OSError:
        return
    me, parent = _os.getpid(), _os.getppid()
    old, new = (me, _new_process_of(me)) if SIDE[moment] == "old" else (parent, me)
    with open(_PLAN + ".pids", "w") as f:
        _json.dump({"old": old, "new": new}, f)
    with open(_PLAN + ".acted", "w") as f:
        f.write(str(me))
    for pid, sig in {
        "kill": [(me, _signal.SIGKILL)], "term": [(me, _signal.SIGTERM)], "term-parent": [(parent, _signal.SIGTERM)],
        "signals-parent": [(parent, _signal.SIGHUP), (parent, _signal.SIGUSR1), (parent, _signal.SIGUSR2)],
        "usr1": [(me, _signal.SIGUSR1)],
        "kill-old": [(old, _signal.SIGKILL)], "kill-new": [(new, _signal.SIGKILL)],
        "term-old": [(old, _signal.SIGTERM)], "term-new": [(new, _signal.SIGTERM)],
    }[plan["action"]]:
        _os.kill(pid, sig)
"""


class Proxy:
    """A twistd yieldproxy and its successors, with the config file and the "installed" package they run."""

    def __init__(self, tmp_path, sim_port: int | None, config: str = ""):
        self.site = tmp_path / "site"
        shutil.copytree(os.path.join(CHECKOUT, "yieldproxy"), self.site / "yieldproxy",
                        ignore=shutil.ignore_patterns("__pycache__"))
        moments = self.site / "yieldproxy" / "lifecycle" / "succession" / "moments.py"
        moments.write_text(moments.read_text() + ACTING_MOMENTS)
        self.plan = tmp_path / "moment.json"
        self.config = tmp_path / "yieldproxy.toml"
        self.config.write_text(config)
        self.proxy_port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.proxy_port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.sim_port = sim_port
        self.pids: list[int] = []
        self.child = Child()
        #: More environment for the first process (its successors inherit it).
        self.env: dict[str, str] = {}
        #: The proxy listener's backlog (a crowd connecting at once needs more than the default 50).
        self.backlog: int | None = None

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.site), "PYTHONUNBUFFERED": "1",
               "YIELDPROXY_TEST_MOMENTS": str(self.plan), **self.env}
        backlog = f":backlog={self.backlog}" if self.backlog else ""
        process = reactor.spawnProcess(
            self.child, TWISTD,
            [TWISTD, "-n", "--pidfile=", "yieldproxy", "--config", str(self.config),
             *(["--upstream", f"http://127.0.0.1:{self.sim_port}"] if self.sim_port is not None else []),
             "--listen", f"tcp:{self.proxy_port}:interface=127.0.0.1{backlog}",
             "--admin", f"tcp:{self.admin_port}:interface=127.0.0.1"],
            env=env,
        )
        self.pids.append(process.pid)
        await until_healthy(reactor, self.admin, lambda: self.child.exited.called, self.child.text)

    def at(self, moment: str, action: str) -> None:
        """At ``moment`` of the next reload (lifecycle/succession/moments.py), once, do ``action`` (see ACTING_MOMENTS)."""
        for leftover in (self.plan.with_name(self.plan.name + suffix) for suffix in (".taken", ".acted", ".pids")):
            leftover.unlink(missing_ok=True)
        self.plan.write_text(json.dumps({"moment": moment, "action": action}))

    def acted(self) -> int | None:
        """The pid that acted on the last plan, once it has."""
        try:
            return int(self.plan.with_name(self.plan.name + ".acted").read_text())
        except (OSError, ValueError):
            return None

    def handover_pids(self) -> dict[str, int] | None:
        """The old and the new process of the last plan's reload, once it has been acted on."""
        try:
            return json.loads(self.plan.with_name(self.plan.name + ".pids").read_text())
        except (OSError, ValueError):
            return None

    @property
    def pid(self) -> int:
        return self.pids[-1]

    async def status(self) -> dict:
        response = await treq.get(self.admin + "/status", persistent=False).addTimeout(10, reactor)
        return await response.json()

    async def until_parked(self, count: int, tries: int = 100) -> None:
        """Wait (``tries`` x 50 ms at most) until ``count`` requests are parked; the caller asserts what it needs."""
        for _ in range(tries):
            if (await self.status())["parked_total"] == count:
                return
            await sleep(reactor, 0.05)

    async def post(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        response = await treq.post(self.admin + path, json=body or {}, persistent=False).addTimeout(TIMEOUT, reactor)
        return response.code, await response.json()

    async def reload(self) -> dict:
        code, outcome = await self.post("/reload")
        assert code == 200, (outcome, self.child.text())
        self.pids.append(outcome["pid"])
        return outcome

    async def old_gone(self, pid: int) -> None:
        await wait_for(reactor, lambda: gone(pid), timeout=30, step=0.05)

    def stop(self) -> None:
        """End every process of this proxy: those it knows, and any successor whose pid a failed check never
        learned (found by this test's own config path on its command line)."""
        mine = set(self.pids)
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if str(self.config).encode() in f.read():
                            mine.add(int(entry))
                except OSError:
                    pass
        for pid in mine:
            end(pid)

    def upgrade(self, version: str) -> None:
        """A new version "installed" underneath the running process."""
        init = self.site / "yieldproxy" / "__init__.py"
        init.write_text(init.read_text().replace('__version__ = "', f'__version__ = "{version}+was-'))


def embed_body(text: str) -> bytes:
    return json.dumps({"model": MODEL, "input": [text]}).encode()


def embed(proxy: Proxy, text: str) -> Deferred:
    """One embedding on a connection of its own; fires with (text, code, body)."""
    d = treq.post(proxy.url + "/api/embed", data=embed_body(text), persistent=False)

    async def read(response):
        return text, response.code, await response.content()

    return d.addCallback(lambda r: Deferred.fromCoroutine(read(r)))


def check_answers(results, texts: list[str]) -> None:
    """Every request answered 200, exactly with its own vector."""
    seen = []
    for ok, value in results:
        assert ok, value
        text, code, body = value
        assert code == 200, (text, code, body[:300])
        vector = json.loads(body)["embeddings"][0]
        assert vector == pytest.approx(expected_embedding(text, MODEL), abs=1e-9), text
        seen.append(text)
    assert sorted(seen) == sorted(texts)


class Hammer:
    """Connects again and again while it runs; counts refusals and connections made."""

    def __init__(self, port: int):
        self.port = port
        self.made = 0
        self.refused = 0
        self.errors: list = []
        self.running = True
        self.done = Deferred.fromCoroutine(self._run())

    async def _run(self) -> None:
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port, timeout=10)
        while self.running:
            try:
                protocol = await connectProtocol(endpoint, Protocol())
            except ConnectionRefusedError:
                self.refused += 1
            except Exception as e:
                self.errors.append(repr(e))
            else:
                self.made += 1
                protocol.transport.loseConnection()
            await sleep(reactor, 0.002)


@pytest_twisted.ensureDeferred
async def test_parked_and_arriving_requests_survive_three_reloads_exactly_once(tmp_path):
    """200 parked during a yield + 40 arriving during three reloads (a config change, a broken config, a new
    version installed underneath): every one answered once, with its own vector; no connection refused."""
    sim = SimOllama(reactor, latency=0.005, parallel=16)
    proxy = Proxy(tmp_path, await sim.listen())
    hammer = None
    try:
        await proxy.start()
        first = await proxy.status()
        code, yielded = await proxy.post("/yield", {"reason": "game", "source": "broker", "for_seconds": 600})
        assert code == 200
        held = [(h["source"], h["since"], h["expires_at"]) for h in yielded["holds"]]
        parked_texts = [f"parked {i}" for i in range(200)]
        pending = [embed(proxy, text) for text in parked_texts]
        await proxy.until_parked(200, tries=300)
        assert (await proxy.status())["parked_total"] == 200
        arriving: list[str] = []
        hammer = Hammer(proxy.proxy_port)

        def arrive(label: str, count: int) -> None:
            for i in range(count):
                text = f"{label} {i}"
                arriving.append(text)
                pending.append(embed(proxy, text))

        # 1. A config change: the batch class's hold bound.
        proxy.config.write_text("[classes.batch]\nhold_seconds = 900\n")
        arrive("before reload 1", 5)
        reload_1 = proxy.post("/reload")
        arrive("during reload 1", 5)
        code, outcome = await reload_1
        assert code == 200, outcome
        proxy.pids.append(outcome["pid"])
        assert outcome["parked_handed_over"] >= 200
        # The new process accepts as soon as it has the holds, and makes the lot's connections again meanwhile.
        await proxy.until_parked(210)
        status = await proxy.status()
        assert status["config"]["classes"]["batch"]["hold_seconds"] == 900
        assert status["parked_total"] == 210 and status["state"] == "yielded"
        # The broker's hold as it was: its start and its lease end.
        assert [(h["source"], h["since"], h["expires_at"]) for h in status["holds"]] == held
        await proxy.old_gone(proxy.pids[0])

        # 2. A broken config: refused in one line naming the file and the key; nothing dropped.
        proxy.config.write_text("[replay]\nconcurrency = 0\n")
        arrive("during reload 2", 10)
        code, refused = await proxy.post("/reload")
        assert code == 400, refused
        assert refused["error"] == f"{proxy.config}: replay.concurrency: must be >= 1, got 0"
        assert not gone(proxy.pid)
        lines = [line for line in proxy.child.text().splitlines() if "reload refused" in line]
        assert len(lines) == 1 and "replay.concurrency" in lines[0] and str(proxy.config) in lines[0], lines
        assert (await proxy.status())["parked_total"] == 220

        # 3. A new version installed underneath, and SIGHUP.
        proxy.config.write_text("[classes.batch]\nhold_seconds = 900\n")
        proxy.upgrade("9.9.9")
        before = proxy.pid
        arrive("before reload 3", 5)
        os.kill(before, signal.SIGHUP)
        arrive("during reload 3", 5)
        await wait_for(reactor, lambda: gone(before), timeout=30, step=0.05)
        status = await proxy.status()
        assert status["version"].startswith("9.9.9+was-")
        assert status["started_at"] > first["started_at"]
        proxy.pids.append(status["pid"])
        arrive("after reload 3", 10)
        await proxy.until_parked(240)
        assert (await proxy.status())["parked_total"] == 240
        # Nothing reached the GPU while it was yielded.
        assert sum(sim.texts_embedded.values()) == 0
        hammer.running = False
        await hammer.done

        code, _ = await proxy.post("/resume", {"source": "broker"})
        assert code == 200
        results = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        check_answers(results, parked_texts + arriving)
        assert sim.texts_embedded == collections.Counter({text: 1 for text in parked_texts + arriving})
        assert hammer.refused == 0 and hammer.errors == [] and hammer.made > 50, (hammer.made, hammer.errors)
        output = proxy.child.text()
        assert "Traceback" not in output and "Unhandled" not in output, output
    finally:
        if hammer is not None:
            hammer.running = False
        proxy.stop()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_connection_goes_over_as_it_was_in_its_own_http_version_and_with_its_own_deadline(tmp_path):
    """A connection is data (issue 25): an HTTP/1.0 client parked across a reload is answered in HTTP/1.0 and the
    connection closed, as the old process would have (it was rebuilt as HTTP/1.1 and answered chunked, never
    closed); an idle admin keep-alive connection goes over with its keep-alive deadline and is sent nothing it
    did not ask for (it got a 408 a few seconds after the handover: the new process took it for a connection
    just accepted, whose first request's read time counts from the accept), and its next request is answered
    by the new process."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    old_client = admin_client = None
    try:
        await proxy.start()
        code, _ = await proxy.post("/yield", {"source": "broker", "reason": "game"})
        assert code == 200
        old_client = await in_thread(reactor, RawClient, proxy.proxy_port)
        body = embed_body("in http 1.0")
        sent = b"POST /api/embed HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        assert await in_thread(reactor, old_client.send, sent)
        await proxy.until_parked(1)
        admin_client = await in_thread(reactor, RawClient, proxy.admin_port)
        status = await in_thread(reactor, lambda: admin_client.send(request_bytes(b"GET", b"/status")) and admin_client.response())
        assert status.status == 200 and status.header(b"connection") != b"close"
        old = proxy.pid

        outcome = await proxy.reload()
        assert outcome["parked_handed_over"] == 1 and outcome["connections_handed_over"] >= 1, outcome
        await proxy.old_gone(old)
        # Past the admin listener's read time from an accept (5 s): nothing came, unasked.
        quiet = await in_thread(reactor, admin_client.response, 6.0)
        assert quiet.status == 0 and quiet.raw == b"" and not admin_client.closed, quiet.raw
        resumed = await in_thread(
            reactor,
            lambda: admin_client.send(request_bytes(
                b"POST", b"/resume", [(b"Content-Type", b"application/json")], body=b'{"source": "broker"}',
            )) and admin_client.response(),
        )
        assert resumed.status == 200 and resumed.json()["pid"] == outcome["pid"], resumed.raw[:300]

        answer = await in_thread(reactor, old_client.response, TIMEOUT)
        assert answer.raw.startswith(b"HTTP/1.0 200 "), answer.raw[:200]
        assert answer.header(b"transfer-encoding") is None
        assert answer.json()["embeddings"][0] == pytest.approx(expected_embedding("in http 1.0", MODEL), abs=1e-9)
        assert await in_thread(reactor, old_client.wait_closed, 10.0)
    finally:
        for client in (old_client, admin_client):
            if client is not None:
                client.close()
        proxy.stop()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_streaming_chat_and_a_keepalive_connection_survive_a_reload(tmp_path):
    """A chat streaming through the old process ends whole there; an idle keep-alive connection goes over and its
    next request is answered by the new process; the old one exits once its stream is done."""
    # The stream is held after its first line until the reload is over (however long a new Python process
    # takes to start on a busy machine), then goes on, a line every 20 ms.
    sim = SimOllama(reactor, latency=0.0, parallel=8, chunks=40, chunk_delay=0.02)
    sim.hold("/api/chat")
    proxy = Proxy(tmp_path, await sim.listen())
    client = None
    try:
        await proxy.start()
        client = await in_thread(reactor, RawClient, proxy.proxy_port)
        first = await in_thread(reactor, lambda: client.send(request_bytes(b"POST", b"/api/embed", body=embed_body("a"))) and client.response())
        assert first.status == 200 and first.header(b"connection") != b"close"

        messages = [{"role": "user", "content": "tell me a story"}]
        posted = treq.post(
            proxy.url + "/api/chat", json={"model": "llama3.2", "messages": messages, "stream": True},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        await wait_for(reactor, lambda: sim.held == 1, timeout=10)
        sim.release()  # the head and the first line go out,
        sim.hold("/api/chat")  # the next line (due 20 ms later) waits
        response = await posted
        assert response.code == 200
        chunks: list[bytes] = []
        streamed = treq.collect(response, chunks.append)
        await wait_for(reactor, lambda: len(chunks) >= 1, timeout=10)

        old = proxy.pid
        outcome = await proxy.reload()
        assert outcome["connections_handed_over"] >= 1, outcome
        assert not streamed.called and not gone(old)  # the stream goes on where it started

        # The keep-alive connection now belongs to the new process.
        second = await in_thread(reactor, lambda: client.send(request_bytes(b"POST", b"/api/embed", body=embed_body("b"))) and client.response())
        assert second.status == 200
        assert second.json()["embeddings"][0] == pytest.approx(expected_embedding("b", MODEL), abs=1e-9)

        assert not streamed.called and not gone(old) and sim.held == 1
        sim.release()
        await streamed.addTimeout(TIMEOUT, reactor)
        lines = [json.loads(line) for line in b"".join(chunks).splitlines() if line.strip()]
        assert lines[-1]["done"] is True
        text = "".join(line["message"]["content"] for line in lines if not line["done"])
        assert text == "".join(expected_reply(messages_prompt(messages), "llama3.2", 40))
        assert sim.requests_total["/api/chat"] == 1
        await proxy.old_gone(old)
        assert (await proxy.status())["pid"] == outcome["pid"]
    finally:
        if client is not None:
            client.close()
        proxy.stop()
        await sim.stop()


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess:
    """``yieldproxy ARGS`` of the "installed" copy."""
    env = {**os.environ, "PYTHONPATH": str(proxy.site)}
    return subprocess.run(
        [sys.executable, "-c", "from yieldproxy.tools.cli import main; main()", *args, "--admin", proxy.admin],
        capture_output=True, text=True, timeout=TIMEOUT, env=env,
    )


@pytest_twisted.ensureDeferred
async def test_a_refused_config_or_a_new_process_that_cannot_start_keeps_the_running_one(tmp_path):
    """``yieldproxy reload`` exits 1 with the line naming the file and the key; a broken upgrade (the new code does
    not even start) is a failed reload: the running process keeps its parked requests and serves them."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    try:
        await proxy.start()
        await proxy.post("/yield", {"reason": "game"})
        pending = [embed(proxy, f"kept {i}") for i in range(10)]
        await proxy.until_parked(10)

        proxy.config.write_text("[parking]\nmax_parked = -3\n")
        result = await in_thread(reactor, cli, proxy, "reload")
        assert result.returncode == 1, result
        assert f"{proxy.config}: parking.max_parked" in result.stderr and result.stdout == ""

        proxy.config.write_text("")
        (proxy.site / "yieldproxy" / "tap.py").write_text("raise ImportError('a broken upgrade')\n")
        code, failed = await proxy.post("/reload")
        assert code == 500 and "before it took over" in failed["error"], failed
        status = await proxy.status()
        assert status["pid"] == proxy.pid and status["parked_total"] == 10
        assert [line for line in proxy.child.text().splitlines() if "reload failed" in line]

        await proxy.post("/resume")
        results = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        check_answers(results, [f"kept {i}" for i in range(10)])
        # Still serving new requests after both failed reloads.
        check_answers(await DeferredList([embed(proxy, "after")], consumeErrors=True), ["after"])
    finally:
        proxy.stop()
        await sim.stop()


def chat(proxy: Proxy, text: str) -> Deferred:
    """One non-streaming chat on a connection of its own; fires with (text, code, body)."""
    body = {"model": "llama3.2", "messages": [{"role": "user", "content": text}], "stream": False}
    d = treq.post(proxy.url + "/api/chat", json=body, persistent=False)

    async def read(response):
        return text, response.code, await response.content()

    return d.addCallback(lambda r: Deferred.fromCoroutine(read(r)))


@pytest_twisted.ensureDeferred
async def test_a_request_parked_for_an_upstream_the_reload_removes_goes_to_another(tmp_path):
    """Chats parked while their only upstream (a) is yielded; the new config removes a and lets b take chat:
    after the reload b answers every one (a hold of an upstream that is gone goes with it)."""
    a = SimOllama(reactor, latency=0.0, parallel=4)
    b = SimOllama(reactor, latency=0.0, parallel=4)
    port_a, port_b = await a.listen(), await b.listen()
    upstream_a = f'[[upstreams]]\nname = "a"\nurl = "http://127.0.0.1:{port_a}"\n\n'
    upstream_b = f'[[upstreams]]\nname = "b"\nurl = "http://127.0.0.1:{port_b}"\n'
    proxy = Proxy(tmp_path, None, upstream_a + upstream_b + 'classes = ["batch"]\n')
    try:
        await proxy.start()
        code, _ = await proxy.post("/yield", {"source": "game", "upstream": "a"})
        assert code == 200
        texts = [f"question {i}" for i in range(5)]
        pending = [chat(proxy, text) for text in texts]
        await proxy.until_parked(5, tries=200)
        assert (await proxy.status())["parked_total"] == 5

        proxy.config.write_text(upstream_b)
        outcome = await proxy.reload()
        assert outcome["parked_handed_over"] == 5
        results = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        for ok, (text, code, body) in results:
            assert ok and code == 200, (text, code, body[:300])
            prompt = messages_prompt([{"role": "user", "content": text}])
            assert json.loads(body)["message"]["content"] == "".join(expected_reply(prompt, "llama3.2"))
        assert a.requests_total["/api/chat"] == 0 and b.requests_total["/api/chat"] == 5
        status = await proxy.status()
        assert status["holds"] == [] and [u["name"] for u in status["upstreams"]] == ["b"]
    finally:
        proxy.stop()
        await a.stop()
        await b.stop()


class NotifySocket:
    """A fake systemd notify socket: every datagram with the pid that sent it (SCM_CREDENTIALS)."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setblocking(False)
        self.received: list[tuple[int, list[str]]] = []

    def read(self) -> list[tuple[int, list[str]]]:
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except BlockingIOError:
                return self.received
            pid = next(
                (struct.unpack("iII", d[:12])[0] for level, kind, d in ancillary
                 if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), -1,
            )
            self.received.append((pid, data.decode().split("\n")))

    def close(self) -> None:
        self.sock.close()


@pytest_twisted.ensureDeferred
async def test_under_systemd_the_reload_says_reloading_then_names_the_new_main_process(tmp_path):
    """``RELOADING=1`` with ``MONOTONIC_USEC=`` as it starts, then ``MAINPID=<new>`` with ``READY=1`` from the old
    process once the new one serves; the new one says no ``READY=1`` of its own, the old one nothing after."""
    sim = SimOllama(reactor, latency=0.0)
    notify = NotifySocket(tmp_path / "notify")
    proxy = Proxy(tmp_path, await sim.listen())
    proxy.env = {"NOTIFY_SOCKET": notify.path}
    try:
        await proxy.start()
        old = proxy.pid
        await wait_for(reactor, lambda: any("READY=1" in lines for _, lines in notify.read()), timeout=10)
        outcome = await proxy.reload()
        await proxy.old_gone(old)
        await sleep(reactor, 0.5)
        said = notify.read()
        from_old = [lines for pid, lines in said if pid == old]
        from_new = [lines for pid, lines in said if pid == outcome["pid"]]
        assert from_old[0][0] == "READY=1"
        reloading = from_old[1]
        assert reloading[0] == "RELOADING=1" and reloading[1].startswith("MONOTONIC_USEC=")
        assert from_old[2][:2] == [f"MAINPID={outcome['pid']}", "READY=1"]
        assert len(from_old) == 3, from_old  # nothing after: no STOPPING=1, no watchdog of the old pid
        assert not any("READY=1" in lines for lines in from_new), from_new
    finally:
        proxy.stop()
        notify.close()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_request_pipelined_behind_a_parked_one_goes_over_with_it(tmp_path):
    """Two embeddings written at once on one connection: the first parks, the second waits (read already, in the
    old process's buffer) behind it.  A reload hands the connection over with both: each is answered once, in
    order, by the new process."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    client = None
    try:
        await proxy.start()
        await proxy.post("/yield", {"reason": "game"})
        client = await in_thread(reactor, RawClient, proxy.proxy_port)
        both = (request_bytes(b"POST", b"/api/embed", body=embed_body("first"))
                + request_bytes(b"POST", b"/api/embed", body=embed_body("second")))
        assert await in_thread(reactor, client.send, both)
        await proxy.until_parked(1)
        await sleep(reactor, 0.2)  # the second request's bytes are read (and held) by the old process
        outcome = await proxy.reload()
        assert outcome["parked_handed_over"] == 1, outcome
        await proxy.post("/resume")
        first = await in_thread(reactor, client.response, TIMEOUT)
        second = await in_thread(reactor, client.response, 20)
        assert first.status == 200 and second.status == 200, (first, second, proxy.child.text()[-3000:])
        assert first.json()["embeddings"][0] == pytest.approx(expected_embedding("first", MODEL), abs=1e-9)
        assert second.json()["embeddings"][0] == pytest.approx(expected_embedding("second", MODEL), abs=1e-9)
        assert sim.texts_embedded == collections.Counter({"first": 1, "second": 1})
    finally:
        if client is not None:
            client.close()
        proxy.stop()
        await sim.stop()


def children_of(pid: int) -> list[tuple[int, str]]:
    """The processes whose parent is ``pid``: (pid, state)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append((int(entry), fields[0]))
    return found


@pytest_twisted.ensureDeferred
async def test_a_new_process_the_old_one_gives_up_on_is_reaped_not_left_a_zombie(tmp_path):
    """A new process that speaks another handover protocol is killed by the old one, which waits for it: no
    zombie is left under the running process (and it still serves)."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    try:
        await proxy.start()
        takeover = proxy.site / "yieldproxy" / "lifecycle" / "succession" / "takeover.py"
        said = '"type": "ready", "pid": os.getpid(), "version": __version__, "protocol": PROTOCOL,'
        assert said in takeover.read_text()
        takeover.write_text(takeover.read_text().replace(said, said.replace("PROTOCOL", "99")))
        code, failed = await proxy.post("/reload")
        assert code == 500 and "protocol 99" in failed["error"], failed
        try:
            await wait_for(reactor, lambda: children_of(proxy.pid) == [], timeout=10, step=0.05)
        except AssertionError:
            raise AssertionError(f"left under the running process: {children_of(proxy.pid)}") from None
        check_answers(await DeferredList([embed(proxy, "after")], consumeErrors=True), ["after"])
    finally:
        proxy.stop()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_reload_goes_on_when_the_client_that_asked_for_it_goes_away(tmp_path):
    """The admin client of ``POST /reload`` gives up (a timeout, a ^C) while the lot is going over: the handover
    goes on regardless.  Ending it then would kill the new process with the parked requests it had taken."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    try:
        await proxy.start()
        await proxy.post("/yield", {"reason": "game"})
        pending = [embed(proxy, f"kept {i}") for i in range(10)]
        await proxy.until_parked(10)
        # The new process takes 3 s to say it serves, once the whole lot is there.
        takeover = proxy.site / "yieldproxy" / "lifecycle" / "succession" / "takeover.py"
        head = "    def _serve(self) -> None:\n"
        marker = tmp_path / "lot-taken"
        takeover.write_text(takeover.read_text().replace(
            head, head + f"        open({str(marker)!r}, 'w').close(); __import__('time').sleep(3)\n"))
        old = proxy.pid
        asking = treq.post(proxy.admin + "/reload", json={}, persistent=False)
        asking.addErrback(lambda failure: None)
        await wait_for(reactor, lambda: children_of(old) != [], timeout=20, step=0.02)
        new = children_of(old)[0][0]
        proxy.pids.append(new)
        await wait_for(reactor, marker.exists, timeout=30, step=0.02)
        asking.cancel()  # the client goes away, its connection closed
        await wait_for(reactor, lambda: "now serving as pid" in proxy.child.text(), timeout=30, step=0.05)
        await proxy.old_gone(old)
        assert not gone(new)
        await proxy.post("/resume")
        results = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        check_answers(results, [f"kept {i}" for i in range(10)])
        assert sim.texts_embedded == collections.Counter({f"kept {i}": 1 for i in range(10)})
    finally:
        proxy.stop()
        await sim.stop()


class KeepAliveHolder(threading.Thread):
    """A plain keep-alive client (``http.client``, one connection for every call) that takes a hold of its own
    and ends the one before, again and again: after each change answered 200, the holds in the answer (from
    whichever process gave it) must be exactly the ones it has taken and not ended; a change answered
    503 with Retry-After was refused, and is asked again."""

    def __init__(self, admin_port: int):
        super().__init__(daemon=True, name="keepalive-holder")
        self.port = admin_port
        self.held: list[str] = []
        self.applied = 0
        self.refused = 0
        self.problems: list[str] = []
        self.running = threading.Event()
        self.running.set()
        self.steady = threading.Event()

    def call(self, conn, path: str, body: dict) -> tuple[int, dict, str | None]:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read()), answer.getheader("retry-after")

    def change(self, conn, path: str, source: str) -> bool:
        code, status, retry_after = self.call(conn, path, {"source": source, **({"reason": "loop"} if path == "/yield" else {})})
        if code == 503 and retry_after:
            self.refused += 1
            return False
        if code != 200:
            self.problems.append(f"{path} {source}: {code} {status}")
            return False
        if path == "/yield":
            self.held.append(source)
        else:
            self.held.remove(source)
        mine = [h["source"] for h in status["holds"] if h["source"].startswith("keep")]
        if sorted(mine) != sorted(self.held):
            self.problems.append(f"after {path} {source} (pid {status['pid']}): holds {mine}, taken {self.held}")
        self.applied += 1
        return True

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        n = 0
        try:
            while self.running.is_set() and not self.problems:
                n += 1
                while not self.change(conn, "/yield", f"keep{n}") and not self.problems:
                    pass
                if len(self.held) > 1:
                    while not self.change(conn, "/resume", self.held[0]) and not self.problems:
                        pass
                self.steady.set()
        except Exception as e:  # the connection broke, or an answer was not one
            self.problems.append(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def pause(self) -> None:
        """Stop the loop (what it holds, it keeps)."""
        self.running.clear()
        self.join(30)

    def end(self) -> None:
        """Stop, and end what it still holds (on a connection of its own)."""
        self.pause()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            for source in list(self.held):
                assert self.change(conn, "/resume", source), self.problems
        finally:
            conn.close()


@pytest_twisted.ensureDeferred
async def test_hold_changes_through_reloads_are_applied_by_the_serving_process_or_refused_never_lost(tmp_path):
    """A broker holds the GPU with the broker library (``Admin.hold``, a 4 s lease renewed every 1.3 s) and a
    keep-alive client takes and ends holds of its own in a loop, through three reloads: no renewal fails, the
    lease never lapses and each new process renews it, every change answered 200 is in every later answer
    (whichever process gives it), and nothing parked reaches the GPU until the last hold ends, then each once.
    (The lease is short, so a handover that kept the admin API from answering would lose it, and long enough
    that a busy machine's scheduling does not.)"""
    from yieldproxy.tools.broker import Admin

    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    holder = None
    broker = None
    try:
        await proxy.start()
        broker = Admin(proxy.admin, timeout=5).hold("broker", "game", lease_seconds=4)
        await in_thread(reactor, broker.__enter__)
        holder = KeepAliveHolder(proxy.admin_port)
        holder.start()
        texts = [f"held back {i}" for i in range(20)]
        pending = [embed(proxy, text) for text in texts]
        await proxy.until_parked(20)
        await in_thread(reactor, holder.steady.wait, 30)
        reloads = 0
        for how in ("post", "sighup", "post"):
            before, applied = proxy.pid, holder.applied
            if how == "post":
                await proxy.reload()
            else:
                os.kill(before, signal.SIGHUP)
                await wait_for(reactor, lambda old=before: children_of(old) != [], timeout=30, step=0.02)
                proxy.pids.append(children_of(before)[0][0])
            await proxy.old_gone(before)
            reloads += 1
            # The loop went on through it, and on after it (its connection now the new process's).
            await wait_for(reactor, lambda then=applied: holder.applied > then + 20 or holder.problems, timeout=30)
            assert not holder.problems, holder.problems
            # The new process renews the broker's lease too.
            renewed = broker.renewals
            await wait_for(reactor, lambda then=renewed: broker.renewals > then or broker.error, timeout=30)
            assert broker.error is None and not broker.lost, (broker.error, broker.renewals)
        assert (await proxy.status())["pid"] == proxy.pids[-1] and reloads == 3
        assert broker.error is None and not broker.lost and broker.renewals >= 3, (broker.error, broker.renewals)
        assert embedded(sim) == {}
        # The broker lets go; the keep-alive client's own holds (its loop stopped) still keep the lot parked.
        await in_thread(reactor, holder.pause)
        assert not holder.problems, holder.problems
        await in_thread(reactor, broker.__exit__, None, None, None)
        broker = None
        status = await proxy.status()
        assert status["state"] == "yielded" and status["parked_total"] == 20, status
        assert {h["source"] for h in status["holds"]} == set(holder.held)
        assert embedded(sim) == {}
        await in_thread(reactor, holder.end)
        holder = None
        results = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        check_answers(results, texts)
        assert embedded(sim) == {text: 1 for text in texts}
    finally:
        if holder is not None:
            holder.running.clear()
        if broker is not None:
            broker._stop.set()
        proxy.stop()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_connection_busy_through_two_reloads_in_a_row_goes_over_when_its_answer_is_done(tmp_path):
    """A keep-alive connection waits for a chat in the first process while it hands over, and while the
    second hands over in its turn: once the chat is answered, the connection goes over (through the second,
    which the first still sends to) to the third, which answers its next request at once; the first two exit."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    sim.hold("/api/chat")
    proxy = Proxy(tmp_path, await sim.listen())
    client = None
    try:
        await proxy.start()
        first = proxy.pid
        client = await in_thread(reactor, RawClient, proxy.proxy_port, TIMEOUT)
        chat = json.dumps({"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}], "stream": False})
        assert await in_thread(reactor, client.send, request_bytes(b"POST", b"/api/chat", body=chat.encode()))
        await wait_for(reactor, lambda: sim.held == 1, timeout=10)
        second = (await proxy.reload())["pid"]
        third = (await proxy.reload())["pid"]
        # The first finishes its chat; the second, with nothing of its own left, waits for it, to pass its
        # connection on.  An absence, so a bound: ten of the second's wind-down steps.
        await sleep(reactor, 10 * WIND_DOWN_STEP)
        assert not gone(first) and not gone(second)
        sim.release()
        answer = await in_thread(reactor, client.response, TIMEOUT)
        assert answer.status == 200 and answer.header(b"connection") != b"close", answer
        nxt = await in_thread(reactor, lambda: client.send(
            request_bytes(b"POST", b"/api/embed", body=embed_body("next"))) and client.response(TIMEOUT))
        assert nxt.status == 200, (nxt, proxy.child.text()[-3000:])
        assert nxt.json()["embeddings"][0] == pytest.approx(expected_embedding("next", MODEL), abs=1e-9)
        await proxy.old_gone(first)
        await proxy.old_gone(second)
        assert (await proxy.status())["pid"] == third and not gone(third)
        assert sim.requests_total["/api/chat"] == 1 and embedded(sim) == {"next": 1}
    finally:
        if client is not None:
            client.close()
        proxy.stop()
        await sim.stop()


def said(proxy: Proxy, pid: int, words: str) -> list[str]:
    """The log lines with ``words`` that name ``pid``."""
    return [line for line in proxy.child.text().splitlines() if words in line and f"pid {pid}" in line]


async def reload_signalled_at_birth(proxy: Proxy, *signals: int) -> tuple[int, dict, int]:
    """``POST /reload``, and ``signals`` to the new process as soon as it exists (before Python runs in it, or
    soon after): the answer, and the new process's pid."""
    old = proxy.pid
    asked = Deferred.fromCoroutine(proxy.post("/reload"))
    await wait_for(reactor, lambda: children_of(old) != [], timeout=30, step=0.002)
    new = children_of(old)[0][0]
    for signum in signals:
        os.kill(new, signum)
    code, outcome = await asked
    return code, outcome, new


@pytest_twisted.ensureDeferred
async def test_signals_during_a_reload_wait_or_are_refused_and_none_is_fatal(tmp_path):
    """SIGHUP, SIGUSR1 and SIGUSR2 to the new process in its first moments, and to the old one while the lot
    goes over (no signal watcher: their default action would end either): both live on, each signal has its
    line, the SIGHUPs start no reload, and the reload goes through.  SIGINT to a new process in its first
    moments is a stop before it took over: the old one keeps everything.  With the signal watcher, SIGUSR1 to
    the old process while the lot goes over takes the signal hold there, and it goes over; to the new one
    before it serves, it is refused."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    try:
        await proxy.start()
        await proxy.post("/yield", {"reason": "game", "source": "broker"})
        texts = [f"parked {i}" for i in range(10)]
        pending = [embed(proxy, text) for text in texts]
        await proxy.until_parked(10)

        old = proxy.pid
        proxy.at("held", "signals-parent")
        code, outcome, new = await reload_signalled_at_birth(proxy, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
        assert code == 200 and outcome["pid"] == new, outcome
        proxy.pids.append(new)
        assert proxy.acted() == new
        await proxy.old_gone(old)
        await proxy.until_parked(10)
        assert not gone(new) and children_of(new) == []  # no reload came of the SIGHUP
        assert len(said(proxy, new, "reload not started: this process is still taking over")) == 1
        assert len(said(proxy, old, "reload not started: a reload is under way already")) == 1
        for name in ("SIGUSR1", "SIGUSR2"):
            for pid in (old, new):
                assert said(proxy, pid, f"{name} received by pid {pid} during a reload: ignored"), (name, pid)

        code, failed, stopped = await reload_signalled_at_birth(proxy, signal.SIGINT)
        assert code == 500 and "stopped before it took over" in failed["error"], failed
        await wait_for(reactor, lambda: gone(stopped), timeout=30, step=0.05)
        status = await proxy.status()
        assert status["pid"] == new and status["parked_total"] == 10

        proxy.config.write_text("[watchers]\nsignals = true\n")
        watching = (await proxy.reload())["pid"]
        await proxy.old_gone(new)
        proxy.at("preparing", "usr1")  # the old process, as it starts sending its lot (before the commit)
        code, outcome, last = await reload_signalled_at_birth(proxy, signal.SIGUSR1)
        assert code == 200 and outcome["pid"] == last, outcome
        proxy.pids.append(last)
        await proxy.old_gone(watching)
        status = await proxy.status()
        assert status["pid"] == last and {h["source"] for h in status["holds"]} == {"broker", "signal"}, status
        assert said(proxy, last, "SIGUSR1 received by pid")[0].endswith("the signal hold is not taken here")

        await proxy.post("/resume", {"source": "broker"})
        await proxy.post("/resume", {"source": "signal"})
        check_answers(await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor), texts)
        assert embedded(sim) == {text: 1 for text in texts}
        assert "Traceback" not in proxy.child.text()
    finally:
        proxy.stop()
        await sim.stop()


def pid_in(path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@pytest_twisted.ensureDeferred
async def test_a_daemonised_twistd_with_a_pidfile_reloads_and_the_pidfile_names_the_serving_process(tmp_path):
    """``twistd --pidfile=FILE yieldproxy`` without ``-n`` (it forks into the background): ``POST /reload``,
    ``yieldproxy reload`` and SIGHUP each hand over, and after each the pidfile names the new process, which
    serves the parked requests; a stop of the last one removes the file."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    pidfile, logfile = tmp_path / "yieldproxy.pid", tmp_path / "twistd.log"
    try:
        env = {**os.environ, "PYTHONPATH": str(proxy.site), "PYTHONUNBUFFERED": "1"}
        launched = await in_thread(reactor, subprocess.run, [
            TWISTD, f"--pidfile={pidfile}", f"--logfile={logfile}", "yieldproxy", "--config", str(proxy.config),
            "--upstream", f"http://127.0.0.1:{proxy.sim_port}", "--listen", f"tcp:{proxy.proxy_port}:interface=127.0.0.1",
            "--admin", f"tcp:{proxy.admin_port}:interface=127.0.0.1",
        ], env=env, cwd=str(tmp_path), timeout=TIMEOUT, capture_output=True)
        assert launched.returncode == 0, launched
        await wait_for(reactor, lambda: pid_in(pidfile) is not None, timeout=30, step=0.05)
        proxy.pids.append(pid_in(pidfile))
        await until_healthy(reactor, proxy.admin, lambda: gone(proxy.pid), lambda: logfile.read_text())
        await proxy.post("/yield", {"reason": "game"})
        texts = [f"parked {i}" for i in range(5)]
        pending = [embed(proxy, text) for text in texts]
        await proxy.until_parked(5)

        for how in ("post", "cli", "sighup"):
            old = proxy.pid
            if how == "post":
                new = (await proxy.reload())["pid"]
            elif how == "cli":
                result = await in_thread(reactor, cli, proxy, "reload")
                assert result.returncode == 0, result
                new = (await proxy.status())["pid"]
                proxy.pids.append(new)
            else:
                os.kill(old, signal.SIGHUP)
                await wait_for(reactor, lambda old=old: children_of(old) != [], timeout=30, step=0.02)
                new = children_of(old)[0][0]
                proxy.pids.append(new)
            await proxy.old_gone(old)
            assert pid_in(pidfile) == new, (how, pid_in(pidfile), new, logfile.read_text()[-3000:])
            status = await proxy.status()
            assert status["pid"] == new and status["parked_total"] == 5

        await proxy.post("/resume", {})
        check_answers(await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor), texts)
        os.kill(proxy.pid, signal.SIGTERM)
        await wait_for(reactor, lambda: gone(proxy.pid), timeout=30, step=0.05)
        assert not pidfile.exists()
        assert "Traceback" not in logfile.read_text()
    finally:
        proxy.stop()
        await sim.stop()
