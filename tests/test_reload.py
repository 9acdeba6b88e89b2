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
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import ProcessProtocol, Protocol

from helpers import free_port, in_thread, sleep, until_healthy, wait_for
from rawhttp import RawClient, request_bytes
from test_twistd import TWISTD
from yieldproxy.sim import SimOllama, expected_embedding
from yieldproxy.sim.content import expected_reply, messages_prompt

# Real twistd processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 60
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    except FileNotFoundError:
        return True


def end(pid: int) -> None:
    """End a process this test started, by pid."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


class Proxy:
    """A twistd yieldproxy and its successors, with the config file and the "installed" package they run."""

    def __init__(self, tmp_path, sim_port: int | None, config: str = ""):
        self.site = tmp_path / "site"
        shutil.copytree(os.path.join(CHECKOUT, "yieldproxy"), self.site / "yieldproxy",
                        ignore=shutil.ignore_patterns("__pycache__"))
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

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.site), "PYTHONUNBUFFERED": "1", **self.env}
        process = reactor.spawnProcess(
            self.child, TWISTD,
            [TWISTD, "-n", "--pidfile=", "yieldproxy", "--config", str(self.config),
             *(["--upstream", f"http://127.0.0.1:{self.sim_port}"] if self.sim_port is not None else []),
             "--listen", f"tcp:{self.proxy_port}:interface=127.0.0.1",
             "--admin", f"tcp:{self.admin_port}:interface=127.0.0.1"],
            env=env,
        )
        self.pids.append(process.pid)
        await until_healthy(reactor, self.admin, lambda: self.child.exited.called, self.child.text)

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
        [sys.executable, "-c", "from yieldproxy.cli import main; main()", *args, "--admin", proxy.admin],
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
async def test_a_new_process_that_dies_as_the_handover_starts_leaves_everything_with_the_old_one(tmp_path):
    """The new code starts, says ready, and dies on the first frame of the handover: the old process takes
    its listeners and its lot back, answers 500 with why, and serves every parked request and new ones."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    try:
        await proxy.start()
        await proxy.post("/yield", {"reason": "game"})
        pending = [embed(proxy, f"kept {i}") for i in range(10)]
        await proxy.until_parked(10)
        succession = proxy.site / "yieldproxy" / "succession" / "__init__.py"
        head = "    def restore(self, message: dict[str, Any]) -> None:\n"
        succession.write_text(succession.read_text().replace(head, head + "        os._exit(3)\n"))
        assert "os._exit(3)" in succession.read_text()
        code, failed = await proxy.post("/reload")
        assert code == 500 and failed["reloaded"] is False, failed
        status = await proxy.status()
        assert status["pid"] == proxy.pid and status["parked_total"] == 10
        pending.append(embed(proxy, "after the failed reload"))
        await proxy.post("/resume")
        results = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        check_answers(results, [f"kept {i}" for i in range(10)] + ["after the failed reload"])
        assert sim.texts_embedded == collections.Counter({text: 1 for text in [f"kept {i}" for i in range(10)]
                                                          + ["after the failed reload"]})
    finally:
        proxy.stop()
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
        takeover = proxy.site / "yieldproxy" / "succession" / "takeover.py"
        said = '"version": __version__, "protocol": PROTOCOL})'
        assert said in takeover.read_text()
        takeover.write_text(takeover.read_text().replace(said, '"version": __version__, "protocol": 99})'))
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


def raw_embed(port: int, text: str):
    """One embedding on a raw connection (from a thread): the answer, status 0 if the connection ended without one."""
    client = RawClient(port, timeout=TIMEOUT)
    try:
        client.send(request_bytes(b"POST", b"/api/embed", body=embed_body(text)))
        return client.response(TIMEOUT)
    finally:
        client.close()


async def stop_during_a_reload(tmp_path, answers_checked: bool) -> None:
    """SIGTERM to the running process while its new process is still taking over (the whole lot taken, the
    end of the handover held back 3 s): a stop is a stop.  The new process does not live on by itself,
    holding the port, after the process it was meant to replace has gone; with ``answers_checked``, every
    parked request gets an answer (503 with Retry-After, as any stop gives)."""
    sim = SimOllama(reactor, latency=0.0, parallel=8)
    proxy = Proxy(tmp_path, await sim.listen())
    try:
        await proxy.start()
        await proxy.post("/yield", {"reason": "game"})
        pending = [in_thread(reactor, raw_embed, proxy.proxy_port, f"kept {i}") for i in range(5)]  # threads of the pool: leave some for name lookups
        await proxy.until_parked(5)
        # The new process holds the end of the handover 3 s, once it has taken the whole lot: the stop comes meanwhile.
        takeover = proxy.site / "yieldproxy" / "succession" / "takeover.py"
        head = "        kind = message[\"type\"]\n"
        marker = tmp_path / "lot-taken"
        hold = (
            f"        if kind == 'done' and not _HELD:\n"
            f"            _HELD.append(open({str(marker)!r}, 'w').close())\n"
            f"            self._reactor.callLater(3, self._message, message, blob, fds)\n"
            f"            return\n"
        )
        assert takeover.read_text().count(head) == 1
        takeover.write_text(takeover.read_text().replace(head, head + hold) + "\n_HELD: list = []\n")
        old = proxy.pid
        Deferred.fromCoroutine(proxy.post("/reload")).addErrback(lambda failure: None)
        await wait_for(reactor, lambda: children_of(old) != [], timeout=20, step=0.02)
        new = children_of(old)[0][0]
        proxy.pids.append(new)
        await wait_for(reactor, marker.exists, timeout=30, step=0.02)
        os.kill(old, signal.SIGTERM)
        await wait_for(reactor, lambda: gone(old) and gone(new), timeout=30, step=0.05)
        answers = await DeferredList(pending, consumeErrors=True).addTimeout(TIMEOUT, reactor)
        if answers_checked:
            for ok, answer in answers:
                assert ok, answer
                assert answer.status == 503 and answer.header(b"retry-after"), answer
    finally:
        proxy.stop()
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_stop_during_a_reload_stops_the_new_process_too(tmp_path):
    await stop_during_a_reload(tmp_path, answers_checked=False)


@pytest_twisted.ensureDeferred
async def test_a_stop_during_a_reload_answers_every_parked_request(tmp_path):
    await stop_during_a_reload(tmp_path, answers_checked=True)


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
        takeover = proxy.site / "yieldproxy" / "succession" / "takeover.py"
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
