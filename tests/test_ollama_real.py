"""A real Ollama behind the proxy (issue 30): the server the proxy exists for.

``.ci/ollama`` builds Ollama once per machine from the Go module proxy (CPU
only) and imports ``all-minilm`` (all-MiniLM-L6-v2) and ``smollm2``
(SmolLM2-135M-Instruct, a chat model) offline; see tests/ollamaserver.py.
Every request goes through the proxy from a real client (the ``ollama`` and
``openai`` packages) and is checked against what the same Ollama answers
directly:

* bursts of embeddings through a forced yield, and through ``kill -9`` and a
  start again with no yield declared: no caller fails, every vector is
  Ollama's own;
* the VRAM handover against Ollama's scheduler (``/api/ps``);
* Ollama's own errors: an unknown model, a body it rejects, an input over
  the context with ``truncate: false``, its queue full;
* chat: a streaming chat parked and replayed streams the real tokens; a
  stream cut by Ollama's death ends in an error line; a non-streaming chat;
  ``X-Yield-Max-Wait``;
* Go's HTTP server closing pooled connections, while idle and between two
  requests.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.protocols import portforward

from helpers import config_with, in_thread, start_stack, wait_for
from ollamaserver import CHAT_MODEL, EMBED_MODEL, OllamaServer, require_ollama, started
from test_burst import Burst

# Real processes for a minute or more: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 120.0
#: A chat that always answers the same: greedy sampling, a short answer.
GREEDY = {"temperature": 0, "seed": 7, "num_predict": 24}
QUESTION = [{"role": "user", "content": "Name three colours."}]
#: A question whose answer runs long: a stream still going when the test kills Ollama.
STORY = [{"role": "user", "content": "Write a long story, at least ten paragraphs, about a desktop that lends its GPU to a game."}]


@pytest.fixture(scope="module")
def ollama():
    """One Ollama for the module's tests that neither kill it nor need settings of their own."""
    require_ollama()
    server = started()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def own_ollama():
    """An Ollama of the test's own (killed, restarted or started with settings), cleaned up after it."""
    require_ollama()
    servers: list[OllamaServer] = []

    def start(env: dict[str, str] | None = None) -> OllamaServer:
        server = started(env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.cleanup()


async def proxy_in_front_of(upstream: str, watchers: bool = False, **sections):
    """The proxy (``service.build``, as twistd runs it) in front of ``upstream``."""
    return await start_stack(reactor, config_with(**sections), upstream=upstream, watchers=watchers)


def parked(stack) -> int:
    return len(stack.proxy.lot)


def sample(stack, name: str, **labels) -> float:
    return stack.sample(name, **labels)


# -- embeddings ------------------------------------------------------------------------------------


def chunks(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


class OllamaBurst(Burst):
    """The official client embeds each chunk through the proxy; right means Ollama's own vector for every text."""

    def __init__(self, url: str, work: list[list[str]], expected: dict[str, list[float]], concurrency: int):
        super().__init__(url, work, concurrency)  # type: ignore[arg-type]
        self.expected = expected

    def _call(self, client, chunk) -> bool:
        vectors = client.embed(model=EMBED_MODEL, input=chunk).embeddings
        return [list(v) for v in vectors] == [self.expected[text] for text in chunk]


def direct_vectors(server: OllamaServer, texts: list[str]) -> dict[str, list[float]]:
    """What ``server`` answers for each text, asked directly, 100 at a time (Ollama's vector for a text does
    not depend on what else is in the call: checked by :func:`test_a_texts_vector_does_not_depend_on_its_call`)."""
    vectors: dict[str, list[float]] = {}
    for chunk in chunks(texts, 100):
        vectors.update(zip(chunk, server.embed(chunk)))
    return vectors


def burst_texts(tag: str, count: int) -> list[str]:
    return [f"{tag} {i}: the desktop lends its GPU to a game, text number {i * 7919 % 10007}" for i in range(count)]


def assert_no_caller_failed(burst: OllamaBurst) -> None:
    assert burst.failures == []
    assert burst.wrong == []
    assert burst.done == len(burst.texts)


def test_a_texts_vector_does_not_depend_on_its_call(ollama):
    """The premise of the bursts' check: a text's vector is the same alone, in a call of four, or of a hundred."""
    texts = burst_texts("premise", 100)
    together = ollama.embed(texts)
    assert ollama.embed(texts[:4]) == together[:4]
    assert [ollama.embed([t])[0] for t in texts[:4]] == together[:4]


@pytest_twisted.ensureDeferred
async def test_thousands_of_embeddings_through_a_forced_yield_lose_nothing_and_are_ollamas_own(ollama):
    """2,000 texts in calls of 16 at concurrency 8, a yield mid-burst: every vector equals Ollama's own."""
    texts = burst_texts("yield", 2000)
    work = chunks(texts, 16)
    expected = await in_thread(reactor, direct_vectors, ollama, texts, timeout=600)
    stack = await proxy_in_front_of(ollama.root, replay={"concurrency": 2})
    try:
        burst = OllamaBurst(stack.proxy_url, work, expected, concurrency=8)
        running = in_thread(reactor, burst.run, timeout=900)
        await wait_for(reactor, lambda: burst.done >= 20, timeout=TIMEOUT)
        stack.proxy.state.hold("api", "a game, forced by the test")
        await wait_for(reactor, lambda: parked(stack) == 8, timeout=TIMEOUT)
        done_while_yielded = burst.done
        assert stack.proxy.replayer.inflight == 0
        stack.proxy.state.release("api")
        await running
        assert done_while_yielded < len(work)
        assert_no_caller_failed(burst)
        assert sample(stack, "yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) >= 8
        assert sample(stack, "yieldproxy_retries_total", **{"class": "batch"}) == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_ollama_killed_mid_burst_and_started_again_with_no_yield_declared_loses_nothing(own_ollama):
    """``kill -9`` of Ollama (and its runner) mid-burst, started again on its port: the proxy sees the outage
    by itself, parks, and replays; no caller fails and every vector is Ollama's own."""
    server = own_ollama()
    texts = burst_texts("kill", 2000)
    work = chunks(texts, 16)
    expected = await in_thread(reactor, direct_vectors, server, texts, timeout=600)
    stack = await proxy_in_front_of(server.root, watchers=True, replay={"concurrency": 2})
    try:
        burst = OllamaBurst(stack.proxy_url, work, expected, concurrency=8)
        running = in_thread(reactor, burst.run, timeout=900)
        await wait_for(reactor, lambda: burst.done >= 20, timeout=TIMEOUT)
        server.kill9()
        # The proxy finds the outage on its own: every caller ends up parked, none failed.
        await wait_for(reactor, lambda: parked(stack) == 8, timeout=TIMEOUT)
        assert burst.failures == []
        status = (await (await treq.get(stack.admin_url + "/status", persistent=False)).json())
        assert status["state"] == "yielded", status
        server.start()
        await in_thread(reactor, server.wait_ready)
        await running
        assert_no_caller_failed(burst)
    finally:
        await stack.stop()


# -- the VRAM handover ------------------------------------------------------------------------------


#: In the text of each caller's request, so that the tap tells them from the proxy's own calls.
CALLER_MARK = b"parked-caller-"


class _Recorder(portforward.ProxyServer):
    """Forwards to Ollama; before the first caller's bytes after the resume reach it, asks Ollama's ``/api/ps``."""

    def dataReceived(self, data: bytes) -> None:
        tap = self.factory.tap
        if tap.armed and CALLER_MARK in data:
            tap.armed = False
            self.transport.pauseProducing()
            d = treq.get(tap.ollama + "/api/ps", persistent=False).addCallback(treq.json_content)

            def go_on(ps):
                tap.loaded_at_first_replay = [m["name"] for m in ps["models"]]
                portforward.ProxyServer.dataReceived(self, data)
                self.transport.resumeProducing()

            d.addCallback(go_on)
            d.addErrback(tap.errors.append)
            return
        if data[:5] in (b"POST ", b"GET /"):
            tap.requests.append(data.split(b"\r\n", 1)[0].decode())
        portforward.ProxyServer.dataReceived(self, data)


class Tap:
    """A port forwarder in front of Ollama that records request lines and checks ``/api/ps`` at one moment."""

    def __init__(self, ollama: OllamaServer):
        self.ollama = ollama.root
        self.armed = False
        self.loaded_at_first_replay: list[str] | None = None
        self.requests: list[str] = []
        self.errors: list = []
        factory = portforward.ProxyFactory("127.0.0.1", ollama.port)
        factory.protocol = _Recorder
        factory.tap = self
        self.port = reactor.listenTCP(0, factory, interface="127.0.0.1")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port.getHost().port}"


def embed_through(url: str, text: str) -> list[float]:
    import ollama as client

    return list(client.Client(host=url, timeout=TIMEOUT).embed(model=EMBED_MODEL, input=text).embeddings[0])


async def loaded(server: OllamaServer) -> list[str]:
    return await in_thread(reactor, server.loaded)


@pytest_twisted.ensureDeferred
async def test_the_vram_handover_against_ollamas_scheduler(own_ollama):
    """``unload_on_yield``: ``/api/ps`` lists nothing soon after the yield starts, and nothing the proxy sends
    during the yield loads a model again; ``preload_models``: the model is loaded before the first replayed
    request reaches Ollama."""
    server = own_ollama()
    tap = Tap(server)
    stack = await proxy_in_front_of(
        tap.url, watchers=True,
        handover={"unload_on_yield": True, "preload_models": (EMBED_MODEL,)},
    )
    try:
        await in_thread(reactor, embed_through, stack.proxy_url, "warm up")
        assert [n.split(":")[0] for n in await loaded(server)] == [EMBED_MODEL]
        stack.proxy.state.hold("game", "the test takes the GPU")
        await wait_for(reactor, lambda: server.loaded() == [], timeout=30, step=0.1)
        unloaded = len(tap.requests)
        # Callers arrive during the yield: parked, and Ollama loads nothing.
        waiting = [
            in_thread(reactor, embed_through, stack.proxy_url, f"{CALLER_MARK.decode()}{i}")
            for i in range(3)
        ]
        await wait_for(reactor, lambda: parked(stack) == 3, timeout=TIMEOUT)
        # Nothing the proxy sent while yielded was a model call (each would load the model again).
        assert await loaded(server) == []
        sent_while_yielded = tap.requests[unloaded:]
        assert not [r for r in sent_while_yielded if r.startswith("POST /api/")], sent_while_yielded
        tap.armed = True
        stack.proxy.state.release("game")
        vectors = [await w for w in waiting]
        assert all(len(v) == 384 for v in vectors)
        assert tap.errors == []
        assert tap.loaded_at_first_replay is not None, tap.requests
        assert [n.split(":")[0] for n in tap.loaded_at_first_replay] == [EMBED_MODEL], tap.loaded_at_first_replay
    finally:
        await stack.stop()
        await tap.port.stopListening()


# -- Ollama's own errors ---------------------------------------------------------------------------


async def post(url: str, path: str, body=None, raw: bytes | None = None, headers: dict | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    answer = await treq.post(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}, persistent=False
    ).addTimeout(TIMEOUT, reactor)
    return answer.code, answer.headers, await answer.content()


@pytest_twisted.ensureDeferred
async def test_ollamas_own_errors_reach_the_caller_at_once_and_park_nobody(ollama):
    stack = await proxy_in_front_of(ollama.root, watchers=True)
    try:
        # An unknown model: Ollama's 404 in its own words, at once, and no hold on the upstream.
        code, _, body = await post(stack.proxy_url, "/api/embed", {"model": "no-such-model", "input": "x"})
        assert (code, json.loads(body)) == (404, {"error": 'model "no-such-model" not found, try pulling it first'})
        code, _, body = await post(stack.proxy_url, "/v1/embeddings", {"model": "no-such-model", "input": "x"})
        assert code == 404 and json.loads(body)["error"]["message"] == 'model "no-such-model" not found, try pulling it first'
        # A body Ollama rejects: its 400, at once.
        code, _, body = await post(stack.proxy_url, "/api/embed", {"model": EMBED_MODEL, "input": 5})
        assert (code, json.loads(body)) == (400, {"error": "invalid input type"})
        code, _, body = await post(stack.proxy_url, "/api/embed", raw=b"{not json")
        assert code == 400 and "invalid character" in json.loads(body)["error"]
        # An input over the context with truncate: false: Ollama's 400 (its words), at once.
        long_text = " ".join(["yield"] * 2000)
        direct = await in_thread(reactor, ollama.post, "/api/embed", {"model": EMBED_MODEL, "input": long_text, "truncate": False})
        code, _, body = await post(stack.proxy_url, "/api/embed", {"model": EMBED_MODEL, "input": long_text, "truncate": False})
        assert (code, json.loads(body)) == direct and code == 400, (code, body, direct)
        # With truncate (the default), the same input is embedded.
        code, _, body = await post(stack.proxy_url, "/api/embed", {"model": EMBED_MODEL, "input": long_text})
        assert code == 200 and len(json.loads(body)["embeddings"][0]) == 384
        status = await (await treq.get(stack.admin_url + "/status", persistent=False)).json()
        assert status["state"] == "available" and status["holds"] == [], status
        assert parked(stack) == 0
        assert sample(stack, "yieldproxy_park_seconds_count", **{"class": "batch"}) == 0
    finally:
        await stack.stop()


def _direct_embed_storm(server: OllamaServer, callers: int) -> list[tuple[int, object]]:
    """``callers`` direct callers at once (not through the proxy), each embedding one text."""
    results: list[tuple[int, object]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        outcome = server.post("/api/embed", {"model": EMBED_MODEL, "input": f"storm {i}"})
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return results


BUSY_WORDS = "server busy, please try again.  maximum pending requests exceeded"


@pytest_twisted.ensureDeferred
async def test_ollamas_own_full_queue_is_busy_not_a_failure_and_loses_nothing(own_ollama):
    """With ``OLLAMA_MAX_QUEUE`` small and many callers, Ollama answers some 503 "server busy" (checked
    directly); through the proxy the same crowd is answered in full: a busy answer is not a failure,
    holds nothing, and the request is tried again (docs/guarantees.md)."""
    server = own_ollama({"OLLAMA_MAX_QUEUE": "1", "OLLAMA_NUM_PARALLEL": "1"})
    # Directly, with no model loaded (every request passes the queue while the load blocks the scheduler).
    results = await in_thread(reactor, _direct_embed_storm, server, 24)
    busy = [r for r in results if r[0] == 503]
    assert busy, results
    assert all(r == (503, {"error": BUSY_WORDS}) for r in busy), busy
    assert all(r[0] == 200 for r in results if r not in busy)
    # Unloaded again, so the proxy's crowd meets the same full queue.
    await in_thread(reactor, server.post, "/api/embed", {"model": EMBED_MODEL, "keep_alive": 0})
    await wait_for(reactor, lambda: server.loaded() == [], timeout=30, step=0.1)
    stack = await proxy_in_front_of(server.root, watchers=True, replay={"concurrency": 16})
    try:
        texts = [f"crowd {i}" for i in range(24)]
        got = await in_thread(
            reactor, lambda: _embed_each_at_once(stack.proxy_url, texts), timeout=600
        )
        assert [g for g in got if isinstance(g, Exception)] == []
        assert got == await in_thread(reactor, server.embed, texts)
        status = await (await treq.get(stack.admin_url + "/status", persistent=False)).json()
        assert status["holds"] == [], status
    finally:
        await stack.stop()


def _embed_each_at_once(url: str, texts: list[str]) -> list:
    import ollama as client

    out: list = [None] * len(texts)

    def one(i: int) -> None:
        try:
            out[i] = list(client.Client(host=url, timeout=TIMEOUT).embed(model=EMBED_MODEL, input=texts[i]).embeddings[0])
        except Exception as e:  # what the caller would see
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 4)
    return out


# -- chat ------------------------------------------------------------------------------------------------


def chat_stream(url: str, headers: dict | None = None, options: dict | None = None, on_first=None, messages=QUESTION) -> tuple[str, dict]:
    """A streaming chat with the official client: the whole text and the last part."""
    import ollama as client

    text, last = [], {}
    for part in client.Client(host=url, timeout=TIMEOUT, headers=headers or {}).chat(
        model=CHAT_MODEL, messages=messages, stream=True, options=options or GREEDY
    ):
        text.append(part.message.content or "")
        last = part.model_dump()
        if on_first is not None:
            on_first()
            on_first = None
    return "".join(text), last


@pytest_twisted.ensureDeferred
async def test_a_streaming_chat_parked_by_a_yield_streams_ollamas_real_tokens_to_the_end(ollama):
    """Parked by a yield, replayed on resume: the same tokens Ollama streams directly (greedy sampling),
    to ``done``; three more parked at once all finish."""
    want, want_last = await in_thread(reactor, chat_stream, ollama.root)
    assert want.strip() and want_last["done"] is True
    stack = await proxy_in_front_of(ollama.root)
    try:
        stack.proxy.state.hold("api", "a game")
        alone = in_thread(reactor, chat_stream, stack.proxy_url)
        await wait_for(reactor, lambda: parked(stack) == 1, timeout=TIMEOUT)
        stack.proxy.state.release("api")
        got, last = await alone
        assert got == want
        assert last["done"] is True and last["done_reason"] == want_last["done_reason"]

        stack.proxy.state.hold("api", "a game")
        crowd = [in_thread(reactor, chat_stream, stack.proxy_url) for _ in range(3)]
        await wait_for(reactor, lambda: parked(stack) == 3, timeout=TIMEOUT)
        stack.proxy.state.release("api")
        for d in crowd:
            text, last = await d
            assert text.strip() and last["done"] is True
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_chat_stream_cut_by_ollamas_death_ends_with_an_error_line_never_a_hang(own_ollama):
    """Ollama killed mid-stream: the caller's stream ends with Ollama's own error form (an NDJSON
    ``{"error": ...}`` line, which the official client raises), promptly, never a clean ``done``."""
    import ollama as client

    server = own_ollama()
    stack = await proxy_in_front_of(server.root)
    try:
        first = threading.Event()
        outcome: dict = {}

        def chat() -> None:
            try:
                outcome["result"] = chat_stream(
                    stack.proxy_url, options={"temperature": 0, "num_predict": 2000}, on_first=first.set, messages=STORY
                )
            except Exception as e:
                outcome["error"] = e

        running = in_thread(reactor, chat, timeout=TIMEOUT)
        await in_thread(reactor, first.wait, TIMEOUT)
        killed_at = time.monotonic()
        server.kill9()
        await running
        assert "result" not in outcome, outcome
        error = outcome["error"]
        assert isinstance(error, client.ResponseError), repr(error)
        assert "upstream failed mid-answer" in str(error)
        assert time.monotonic() - killed_at < 30
    finally:
        await stack.stop()


def _raw_stream_lines(url: str, path: str, body: dict, kill, after_lines: int = 2) -> list[bytes]:
    """POST ``body`` on a raw socket, read the streamed answer line by line, call ``kill`` after a few lines."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
        )
        data = b""
        killed = False
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if not killed and data.count(b"\n{") >= after_lines:
                kill()
                killed = True
    head, _, body_bytes = data.partition(b"\r\n\r\n")
    # De-chunk for reading (the proxy relays chunked).
    out, rest = b"", body_bytes
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line, 16)
        except ValueError:
            break
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return [line for line in out.split(b"\n") if line.strip()]


@pytest_twisted.ensureDeferred
async def test_the_openai_chat_stream_cut_by_ollamas_death_ends_with_an_error_event(own_ollama):
    """The same death on ``/v1/chat/completions``: the ``openai`` client raises at once; on the wire the
    last line is an error in OpenAI's shape and no ``[DONE]`` follows; the native route's last line is
    ``{"error": ...}`` and no ``done: true``."""
    import openai

    server = own_ollama()
    stack = await proxy_in_front_of(server.root)
    try:
        lines = await in_thread(
            reactor, _raw_stream_lines, stack.proxy_url, "/api/chat",
            {"model": CHAT_MODEL, "messages": STORY, "stream": True, "options": {"temperature": 0, "num_predict": 2000}},
            server.kill9,
        )
        last = json.loads(lines[-1])
        assert set(last) == {"error"} and "upstream failed mid-answer" in last["error"], lines[-3:]
        assert not any(json.loads(line).get("done") for line in lines[:-1])

        server.start()
        await in_thread(reactor, server.wait_ready)
        first = threading.Event()
        outcome: dict = {}

        def chat() -> None:
            c = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            try:
                stream = c.chat.completions.create(model=CHAT_MODEL, messages=STORY, stream=True, max_tokens=2000, temperature=0)
                for _ in stream:
                    first.set()
                outcome["ended"] = "cleanly"
            except Exception as e:
                outcome["error"] = e
            finally:
                c.close()

        running = in_thread(reactor, chat, timeout=TIMEOUT)
        await in_thread(reactor, first.wait, TIMEOUT)
        server.kill9()
        await running
        assert isinstance(outcome.get("error"), openai.APIError), outcome
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_non_streaming_chat_and_an_interactive_callers_max_wait(ollama):
    """A non-streaming chat through the proxy is Ollama's answer; during a yield an interactive caller with
    ``X-Yield-Max-Wait: 1`` gets the proxy's honest 503 with ``Retry-After`` in Ollama's shape after about
    a second (docs/clients.md), and one without it waits and is answered after the resume."""
    import ollama as client

    direct = await in_thread(reactor, ollama.post, "/api/chat", {"model": CHAT_MODEL, "messages": QUESTION, "stream": False, "options": GREEDY})
    assert direct[0] == 200
    stack = await proxy_in_front_of(ollama.root)
    try:
        code, headers, body = await post(stack.proxy_url, "/api/chat", {"model": CHAT_MODEL, "messages": QUESTION, "stream": False, "options": GREEDY})
        answer = json.loads(body)
        assert code == 200 and answer["message"] == direct[1]["message"] and set(answer) == set(direct[1])

        stack.proxy.state.hold("api", "a game")
        patient = in_thread(
            reactor, lambda: client.Client(host=stack.proxy_url, timeout=TIMEOUT).chat(
                model=CHAT_MODEL, messages=QUESTION, stream=False, options=GREEDY
            ),
        )
        began = time.monotonic()
        code, headers, body = await post(
            stack.proxy_url, "/api/chat", {"model": CHAT_MODEL, "messages": QUESTION, "stream": False},
            headers={"X-Yield-Max-Wait": "1"},
        )
        waited = time.monotonic() - began
        assert code == 503 and headers.getRawHeaders("Retry-After"), (code, body)
        assert set(json.loads(body)) == {"error"} and "X-Yield-Max-Wait" in json.loads(body)["error"]
        assert 0.9 <= waited < 15, waited
        await wait_for(reactor, lambda: parked(stack) == 1, timeout=TIMEOUT)
        stack.proxy.state.release("api")
        answered = await patient
        assert answered.message.content == direct[1]["message"]["content"]
    finally:
        await stack.stop()


# -- Go's HTTP server and the proxy's pooled connections ----------------------------------------------


@pytest_twisted.ensureDeferred
async def test_pooled_connections_that_ollama_closes_lose_no_request(own_ollama):
    """Go's server closes the proxy's pooled connections: all of them when Ollama stops (``srvr.Close()``
    on SIGTERM) while they sit idle, and one after an answer it ends with ``Connection: close`` (a request
    body it did not read, over 256 KB). The next requests all go through: nothing is lost or failed."""
    server = own_ollama()
    stack = await proxy_in_front_of(server.root, watchers=True)
    try:
        texts = [f"pooled {i}" for i in range(8)]
        want = await in_thread(reactor, server.embed, texts)
        first = await in_thread(reactor, lambda: _embed_each_at_once(stack.proxy_url, texts), timeout=TIMEOUT)
        assert first == want
        # Ollama stops (closing every idle connection) and comes back on the same port.
        server.stop()
        server.start()
        await in_thread(reactor, server.wait_ready)
        again = await in_thread(reactor, lambda: _embed_each_at_once(stack.proxy_url, texts), timeout=TIMEOUT)
        assert again == want
        # An answer after which Go closes the connection: a GET /api/tags with a body it never reads.
        code, headers, body = await _get_with_body(stack.proxy_url, "/api/tags", b"x" * 300_000)
        assert code == 200 and "models" in json.loads(body)
        after = await in_thread(reactor, lambda: _embed_each_at_once(stack.proxy_url, texts), timeout=TIMEOUT)
        assert after == want
        failures = sum(
            s.value
            for m in stack.proxy.metrics.registry.collect()
            if m.name == "yieldproxy_requests"
            for s in m.samples
            if s.name.endswith("_total") and s.labels.get("code", "200") != "200"
        )
        assert failures == 0
    finally:
        await stack.stop()


async def _get_with_body(url: str, path: str, body: bytes):
    answer = await treq.request("GET", url + path, data=body, persistent=False).addTimeout(TIMEOUT, reactor)
    return answer.code, answer.headers, await answer.content()

