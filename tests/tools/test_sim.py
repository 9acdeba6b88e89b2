"""
Tests for :mod:`yieldproxy.tools.sim`, the simulated Ollama backend.

Three layers: pure functions (plain tests); the resource in memory, driven by
a :class:`~twisted.internet.task.Clock` through ``StubTreq`` (no reactor, no
leaked timers); and a handful of real-socket tests under pytest-twisted, each
bounded by a timeout and stopping its server in ``finally``.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest
import pytest_twisted
import treq
from hypothesis import given, settings, strategies as st
from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet import defer, task, threads
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.web.client import Agent, HTTPConnectionPool, ResponseNeverReceived

from yieldproxy.tools import sim as simmod
from yieldproxy.tools.sim import (
    BUSY_ERROR,
    MODES,
    OOM_ERROR,
    SimOllama,
    canonical_model,
    decode_base64_f32,
    encode_base64_f32,
    expected_embedding,
    expected_embedding_f32,
    expected_reply,
    messages_prompt,
    parse_keep_alive,
)

URL = "http://sim.invalid"
TIMEOUT = 5.0
#: The models these tests' Ollama sims have: the default ones, and the short names the tests send.
MODELS = ("all-minilm", "llama3.2", "m", "e")


# ---------------------------------------------------------------------------
# Pure functions.


def test_expected_embedding_is_deterministic_and_normalised() -> None:
    a = expected_embedding("hello world")
    assert a == expected_embedding("hello world")
    assert len(a) == 384
    assert all(type(v) is float for v in a)
    assert math.isclose(math.fsum(v * v for v in a), 1.0, rel_tol=1e-12)
    assert a != expected_embedding("hello world!")
    assert a != expected_embedding("hello world", model="nomic-embed-text")
    assert len(expected_embedding("x", dim=7)) == 7
    assert expected_embedding("", dim=3) == expected_embedding("", dim=3)


def test_expected_embedding_model_tag_and_dimensions() -> None:
    """``m`` and ``m:latest`` agree; a smaller dim is the truncated vector renormalised."""
    assert canonical_model("all-minilm") == "all-minilm:latest"
    assert canonical_model("library/all-minilm:v2") == "all-minilm:v2"
    assert canonical_model("me/all-minilm:v2") == "me/all-minilm:v2"
    assert expected_embedding("t", "all-minilm") == expected_embedding("t", "all-minilm:latest")
    full = expected_embedding("t", dim=384)
    small = expected_embedding("t", dim=16)
    norm = math.sqrt(math.fsum(v * v for v in full[:16]))
    assert small == pytest.approx([v / norm for v in full[:16]], rel=1e-12)
    with pytest.raises(ValueError):
        expected_embedding("t", dim=0)


def test_float32_and_base64_round_trip() -> None:
    f32 = expected_embedding_f32("abc", dim=32)
    assert f32 != expected_embedding("abc", dim=32)
    assert f32 == pytest.approx(expected_embedding("abc", dim=32), abs=1e-7)
    assert decode_base64_f32(encode_base64_f32(expected_embedding("abc", dim=32))) == f32


def test_parse_keep_alive() -> None:
    assert parse_keep_alive(None, 300.0) == 300.0
    assert parse_keep_alive(0, 300.0) == 0.0
    assert parse_keep_alive("0", 300.0) == 0.0
    assert parse_keep_alive(12.5, 300.0) == 12.5
    assert parse_keep_alive("5m", 1.0) == 300.0
    assert parse_keep_alive("1h30m", 1.0) == 5400.0
    assert parse_keep_alive("250ms", 1.0) == 0.25
    assert parse_keep_alive(-1, 1.0) == math.inf
    assert parse_keep_alive("-1m", 1.0) == math.inf
    for bad in ("soon", "5 minutes", "", True, [1]):
        with pytest.raises(ValueError):
            parse_keep_alive(bad, 1.0)


def test_expected_reply_is_deterministic() -> None:
    pieces = expected_reply("why is the sky blue?", "llama3.2", 5)
    assert len(pieces) == 5
    assert pieces == expected_reply("why is the sky blue?", "llama3.2:latest", 5)
    assert "".join(pieces) != "".join(expected_reply("another prompt entirely", "llama3.2", 5))
    assert all(p.startswith(" ") for p in pieces[1:])
    assert messages_prompt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]) == "user: hi\nassistant: yo"


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        SimOllama(task.Clock(), parallel=0)
    with pytest.raises(ValueError):
        SimOllama(task.Clock(), latency=-1)
    with pytest.raises(ValueError):
        SimOllama(task.Clock(), mode="sideways")
    with pytest.raises(ValueError):
        SimOllama(task.Clock()).set_mode("sideways")


# ---------------------------------------------------------------------------
# In memory, on a Clock.


def _post(stub: StubTreq, path: str, body: Any) -> defer.Deferred[Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return stub.post(URL + path, data=data, headers={"content-type": ["application/json"]})


def _flushed(stub: StubTreq, d: defer.Deferred[Any]) -> defer.Deferred[Any]:
    stub.flush()
    return d


def _json_of(stub: StubTreq, d: defer.Deferred[Any]) -> tuple[int, Any]:
    """Settle an in-memory request: (status, decoded JSON)."""
    stub.flush()
    response = _result(d)
    body = treq.content(response)
    stub.flush()
    return response.code, json.loads(_result(body))


def _result(d: defer.Deferred[Any]) -> Any:
    box: list[Any] = []
    d.addBoth(box.append)
    assert box, "Deferred has not fired"
    if isinstance(box[0], Exception) or hasattr(box[0], "raiseException"):
        box[0].raiseException()
    return box[0]


def _fired(d: defer.Deferred[Any]) -> bool:
    box: list[Any] = []
    d.addBoth(lambda r: (box.append(r), r)[1])
    return bool(box)


def test_parallel_cap_and_fifo_on_a_clock() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS, latency=1.0, per_item_latency=0.5, parallel=2)
    stub = StubTreq(sim.resource())
    ds = [_post(stub, "/api/embed", {"model": "all-minilm", "input": [f"t{i}"]}) for i in range(5)]
    stub.flush()
    assert (sim.in_flight, sim.serving, sim.queued) == (5, 2, 3)
    clock.advance(1.4)
    stub.flush()
    assert not any(_fired(d) for d in ds)
    clock.advance(0.1)
    stub.flush()
    assert [_fired(d) for d in ds] == [True, True, False, False, False]
    assert (sim.in_flight, sim.serving, sim.queued) == (3, 2, 1)
    clock.advance(1.5)
    clock.advance(1.5)
    results = [_json_of(stub, d) for d in ds]
    for i, (code, body) in enumerate(results):
        assert code == 200
        assert body["embeddings"] == [expected_embedding(f"t{i}")]
        assert body["prompt_eval_count"] == 1
    assert sim.peak_in_flight == 5 and sim.peak_serving == 2
    assert sim.in_flight == 0
    started = [r.received_at for r in sim.history]
    assert started == sorted(started)
    assert sim.texts_embedded == {f"t{i}": 1 for i in range(5)}
    assert sim.requests_total["/api/embed"] == 5
    sim.reset_peak()
    assert sim.peak_in_flight == 0
    assert clock.getDelayedCalls() == []



def test_a_held_path_waits_for_release_and_others_go_on() -> None:
    """``hold`` keeps a due answer (its slot too) until ``release``; a path not held is answered as usual."""
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS, latency=1.0, parallel=2)
    stub = StubTreq(sim.resource())
    sim.hold("/api/embed")
    held = _post(stub, "/api/embed", {"model": "all-minilm", "input": ["kept"]})
    other = _post(stub, "/api/generate", {"model": "llama3.2", "prompt": "hi", "stream": False})
    stub.flush()
    clock.advance(5.0)
    stub.flush()
    assert not _fired(held) and _fired(other) and (sim.held, sim.serving) == (1, 1)
    sim.release()
    stub.flush()
    code, body = _json_of(stub, held)
    assert code == 200 and body["embeddings"] == [expected_embedding("kept")]
    assert sim.held == 0 and sim.in_flight == 0
    assert clock.getDelayedCalls() == []

def test_max_queue_answers_busy_like_ollama() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS, latency=1.0, parallel=1, max_queue=1)
    stub = StubTreq(sim.resource())
    ds = [_post(stub, "/api/embed", {"model": "m", "input": str(i)}) for i in range(3)]
    stub.flush()
    code, body = _json_of(stub, ds[2])
    assert code == 503 and body == {"error": BUSY_ERROR}
    clock.advance(1.0)
    clock.advance(1.0)
    assert [_json_of(stub, d)[0] for d in ds[:2]] == [200, 200]
    assert sim.outcomes == {"ok": 2, "busy": 1}
    assert clock.getDelayedCalls() == []


def test_model_load_ps_and_unload_on_a_clock() -> None:
    clock = task.Clock()
    clock.advance(1_700_000_000)
    sim = SimOllama(clock, models=MODELS, latency=0.5, load_seconds=2.0)
    stub = StubTreq(sim.resource())
    # Two requests during one load share it.
    d1 = _post(stub, "/api/embed", {"model": "all-minilm", "input": "a"})
    d2 = _post(stub, "/api/embed", {"model": "all-minilm:latest", "input": ["b", "c"]})
    stub.flush()
    assert sim.loaded_models() == []
    clock.advance(2.0)
    assert sim.loaded_models() == ["all-minilm:latest"]
    clock.advance(0.5)
    code, body = _json_of(stub, d1)
    assert code == 200 and body["load_duration"] == 2_000_000_000
    assert body["total_duration"] == 2_500_000_000
    assert _json_of(stub, d2)[1]["embeddings"] == [expected_embedding("b"), expected_embedding("c")]

    code, ps = _json_of(stub, stub.get(URL + "/api/ps"))
    [entry] = ps["models"]
    assert entry["name"] == "all-minilm:latest" and entry["size_vram"] > 0
    assert entry["expires_at"].endswith("Z")

    # Unload the Ollama way: keep_alive 0 and no input.
    code, body = _json_of(stub, _post(stub, "/api/embed", {"model": "all-minilm", "keep_alive": 0}))
    assert code == 200 and body["embeddings"] == []
    assert _json_of(stub, stub.get(URL + "/api/ps"))[1] == {"models": []}

    # /api/generate with an empty prompt loads; with keep_alive 0 it unloads.
    d = _post(stub, "/api/generate", {"model": "llama3.2"})
    stub.flush()
    clock.advance(2.0)
    code, body = _json_of(stub, d)
    assert body["done"] is True and body["done_reason"] == "load" and body["response"] == ""
    assert sim.loaded_models() == ["llama3.2:latest"]
    code, body = _json_of(stub, _post(stub, "/api/generate", {"model": "llama3.2", "keep_alive": 0}))
    assert body["done_reason"] == "unload"
    assert sim.loaded_models() == []

    # A model expires on its own after keep_alive (lazily, without a timer).
    d = _post(stub, "/api/embed", {"model": "all-minilm", "input": "x", "keep_alive": "10s"})
    stub.flush()
    clock.advance(2.0)  # a Clock jumps: steps scheduled on the way wait for the next advance
    clock.advance(0.5)
    _json_of(stub, d)
    assert sim.loaded_models() == ["all-minilm:latest"]
    clock.advance(10)
    assert sim.loaded_models() == []
    names = [m["name"] for m in _json_of(stub, stub.get(URL + "/api/tags"))[1]["models"]]
    assert "all-minilm:latest" in names and "llama3.2:latest" in names
    assert clock.getDelayedCalls() == []


def test_errors_in_each_api_shape() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS)
    stub = StubTreq(sim.resource())
    code, body = _json_of(stub, _post(stub, "/api/embed", {"input": "x"}))
    assert code == 400 and body == {"error": "model is required"}
    code, body = _json_of(stub, _post(stub, "/api/embed", {"model": "", "input": "x"}))
    assert code == 400 and "model" in body["error"]
    code, body = _json_of(stub, _post(stub, "/api/chat", b"{not json"))
    assert code == 400 and isinstance(body["error"], str)
    code, body = _json_of(stub, _post(stub, "/api/embed", {"model": "m", "input": [1, 2]}))
    assert code == 400
    code, body = _json_of(stub, _post(stub, "/api/embed", {"model": "m", "input": "x", "keep_alive": "soon"}))
    assert code == 400 and "invalid duration" in body["error"]
    code, body = _json_of(stub, _post(stub, "/v1/embeddings", {"input": "x"}))
    assert code == 400 and set(body["error"]) >= {"message", "type", "code"}
    code, body = _json_of(stub, _post(stub, "/v1/embeddings", {"model": "m", "input": "x", "encoding_format": "hex"}))
    assert code == 400 and body["error"]["type"] == "invalid_request_error"
    # gin's own answers to an unknown path or method: plain text, on /v1/ too (checked against a real
    # Ollama by tests/test_sim_vs_ollama_real.py).
    for path, want in (("/api/nope", (404, b"404 page not found")), ("/v1/nope", (404, b"404 page not found")),
                       ("/api/embed", (405, b"405 method not allowed"))):
        answer = _result(_flushed(stub, stub.get(URL + path)))
        content = treq.content(answer)
        stub.flush()
        assert (answer.code, _result(content)) == want
        assert answer.headers.getRawHeaders("content-type") == ["text/plain"]
    assert _json_of(stub, stub.get(URL + "/api/version")) == (200, {"version": "0.12.0-sim"})
    assert sim.outcomes["bad_request"] == 8 and sim.outcomes["not_found"] == 2

    sim.set_mode("error500")
    code, body = _json_of(stub, _post(stub, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert code == 500 and body == {"error": OOM_ERROR}
    code, body = _json_of(stub, _post(stub, "/v1/embeddings", {"model": "m", "input": "x"}))
    assert code == 500 and body["error"]["message"] == OOM_ERROR
    assert _json_of(stub, stub.get(URL + "/api/tags"))[0] == 200
    assert sim.mode_hits[("error500", "/api/chat")] == 1
    assert [r.outcome for r in sim.history][-3:] == ["error500", "error500", "ok"]
    assert sim.texts_embedded == {}
    assert clock.getDelayedCalls() == []


def test_embedding_routes_in_memory() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS, dim=64)
    stub = StubTreq(sim.resource())
    _, body = _json_of(stub, _post(stub, "/api/embeddings", {"model": "all-minilm", "prompt": "legacy"}))
    assert body == {"embedding": expected_embedding("legacy", dim=64)}
    _, body = _json_of(stub, _post(stub, "/api/embed", {"model": "all-minilm", "input": "d", "dimensions": 8}))
    assert body["embeddings"] == [expected_embedding("d", dim=8)]
    _, body = _json_of(stub, _post(stub, "/v1/embeddings", {"model": "e", "input": ["p", "q"]}))
    assert body["object"] == "list" and body["model"] == "e"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][1]["embedding"] == expected_embedding("q", "e", 64)
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    _, body = _json_of(stub, _post(stub, "/v1/embeddings", {"model": "e", "input": "p", "encoding_format": "base64"}))
    assert decode_base64_f32(body["data"][0]["embedding"]) == expected_embedding_f32("p", "e", 64)
    assert clock.getDelayedCalls() == []


class _BrokenSim(SimOllama):
    """A sim whose answers raise: a bug in one step must answer its request, not hang it."""

    def _answer_batch(self, job: Any) -> None:
        raise RuntimeError("boom")

    def _stream_step(self, job: Any, i: int) -> None:
        if i == 1:
            raise RuntimeError("boom mid-stream")
        super()._stream_step(job, i)


def test_a_failing_step_answers_in_the_routes_shape() -> None:
    clock = task.Clock()
    sim = _BrokenSim(clock, models=MODELS, latency=1.0)
    stub = StubTreq(sim.resource())
    ollama = _post(stub, "/api/embed", {"model": "m", "input": "x"})
    openai = _post(stub, "/v1/embeddings", {"model": "m", "input": "x"})
    streamed = _post(stub, "/api/generate", {"model": "m", "prompt": "p"})
    stub.flush()
    clock.advance(1.0)
    assert _json_of(stub, ollama) == (500, {"error": "sim internal error"})
    code, body = _json_of(stub, openai)
    assert code == 500 and body["error"]["message"] == "sim internal error"
    # Once a stream has begun its status is sent: the connection is reset instead.
    stub.flush()
    assert not _fired(streamed) or _result(streamed).code == 200
    assert sim.in_flight == 0 and sim.serving == 0
    # Counted as what they were, not as answered fine.
    assert sim.outcomes == {"error500": 3}
    assert [r.outcome for r in sim.history] == ["error500"] * 3
    assert clock.getDelayedCalls() == []


def test_hang_then_stop_leaves_no_timer() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS, latency=1.0, load_seconds=1.0)
    stub = StubTreq(sim.resource())
    # One request is being served (waiting on the load); then hang: new ones
    # are accepted and never answered, and hold no timer.
    served = _post(stub, "/api/embed", {"model": "m", "input": "a"})
    stub.flush()
    assert clock.getDelayedCalls() != []
    sim.set_mode("hang")
    hung = _post(stub, "/api/embed", {"model": "m", "input": "b"})
    stub.flush()
    clock.advance(1.0)  # the load
    clock.advance(1.0)  # the work
    clock.advance(100)
    stub.flush()
    assert _fired(served) and not _fired(hung)
    assert sim.in_flight == 1 and sim.history[-1].mode == "hang"
    sim.set_mode("ok")  # a hung request stays hung
    clock.advance(100)
    assert sim.in_flight == 1
    _post(stub, "/api/embed", {"model": "m", "input": "c"})  # served again
    stub.flush()
    clock.advance(0.5)
    sim.set_mode("hang")
    assert sim.in_flight == 2
    stopped = sim.stop()
    assert _fired(stopped)
    assert sim.in_flight == 0 and sim.serving == 0
    assert sim.outcomes["stopped"] == 2
    assert clock.getDelayedCalls() == []


def test_stall_sends_the_head_and_first_bytes_then_nothing() -> None:
    """``stall``: a whole answer's head (its full length) and first bytes, a stream's first line; then nothing."""
    clock = task.Clock()
    sim = SimOllama(clock, models=MODELS, latency=1.0)
    sim.set_mode("stall")
    stub = StubTreq(sim.resource())
    embed = _post(stub, "/api/embed", {"model": "all-minilm", "input": "a"})
    chat = _post(stub, "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    stub.flush()
    whole, streamed = _result(embed), _result(chat)
    assert whole.code == 200 and streamed.code == 200
    length = whole.length
    assert streamed.headers.getRawHeaders(b"content-type") == [b"application/x-ndjson"]
    parts: list[bytes] = []
    lines: list[bytes] = []
    body = treq.collect(whole, parts.append)
    stream = treq.collect(streamed, lines.append)
    for _ in range(3):
        clock.advance(100)
        stub.flush()
    assert not _fired(body) and not _fired(stream)
    assert b"".join(parts) == b'{"model":"all-mi' and length > 100
    first = json.loads(b"".join(lines))
    assert first["done"] is False and first["message"]["role"] == "assistant"
    sim.set_mode("ok")  # what stalled stays stalled
    clock.advance(100)
    stub.flush()
    assert sim.in_flight == 2 and [r.mode for r in sim.history] == ["stall", "stall"]
    assert sim.texts_embedded == {}
    assert _fired(sim.stop())
    assert sim.in_flight == 0 and sim.outcomes["stopped"] == 2
    assert clock.getDelayedCalls() == []


# ---------------------------------------------------------------------------
# Real sockets.


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


def _within(d: defer.Deferred[Any], seconds: float = TIMEOUT) -> defer.Deferred[Any]:
    """Every real-socket await gets a deadline: pytest-twisted would hang."""
    return d.addTimeout(seconds, _reactor())


async def _sleep(seconds: float) -> None:
    await task.deferLater(_reactor(), seconds, lambda: None)


async def _until(predicate: Any, seconds: float = TIMEOUT) -> None:
    """Poll ``predicate`` until true, or fail after ``seconds``."""
    deadline = _reactor().seconds() + seconds
    while not predicate():
        if _reactor().seconds() > deadline:
            raise AssertionError("condition not met in time")
        await _sleep(0.01)


class _Server:
    """A listening sim plus a treq client on its own pool; both closed in ``close``."""

    def __init__(self, **settings: Any) -> None:
        self.sim = SimOllama(_reactor(), **({"models": MODELS} | settings if "api" not in settings else settings))
        self.pool = HTTPConnectionPool(_reactor(), persistent=True)
        self.pool.maxPersistentPerHost = 20
        self.http = HTTPClient(Agent(_reactor(), pool=self.pool))
        self.url = ""

    async def start(self) -> "_Server":
        port = await _within(self.sim.listen(0))
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def post(self, path: str, body: Any, **kw: Any) -> Any:
        return await _within(self.http.post(self.url + path, json=body, **kw))

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        response = await self.post(path, body)
        return response.code, await _within(response.json())

    async def get_json(self, path: str) -> tuple[int, Any]:
        response = await _within(self.http.get(self.url + path))
        return response.code, await _within(response.json())

    async def close(self) -> None:
        try:
            await _within(self.sim.stop())
        finally:
            await _within(self.pool.closeCachedConnections())


def _in_thread(fn: Any) -> defer.Deferred[Any]:
    """Blocking clients (ollama, openai) run off the reactor thread."""
    return _within(threads.deferToThread(fn), 20)


@pytest_twisted.ensureDeferred
async def test_ollama_client_embeddings() -> None:
    import ollama

    server = await _Server(latency=0.01).start()
    try:
        client = ollama.Client(host=server.url, timeout=TIMEOUT)
        texts = ["alpha", "beta", "gamma ray"]
        result = await _in_thread(lambda: client.embed(model="all-minilm", input=texts))
        assert [list(v) for v in result.embeddings] == [expected_embedding(t) for t in texts]
        assert result.prompt_eval_count == 4
        legacy = await _in_thread(lambda: client.embeddings(model="all-minilm", prompt="delta"))
        assert list(legacy.embedding) == expected_embedding("delta")
        ps = await _in_thread(client.ps)
        assert [m.model for m in ps.models] == ["all-minilm:latest"]
        version = await _in_thread(lambda: client._client.get("/api/version").json())
        assert version == {"version": "0.12.0-sim"}
        assert server.sim.texts_embedded == {"alpha": 1, "beta": 1, "gamma ray": 1, "delta": 1}
        # Unload through the client, as a yield hook would.
        await _in_thread(lambda: client.generate(model="all-minilm", keep_alive=0))
        assert server.sim.loaded_models() == []
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_openai_client_base64_and_float() -> None:
    from openai import OpenAI

    server = await _Server().start()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        texts = ["one", "two"]
        # The openai client asks for base64 by default and decodes it.
        result = await _in_thread(lambda: client.embeddings.create(model="all-minilm", input=texts))
        assert [d.embedding for d in result.data] == [expected_embedding_f32(t) for t in texts]
        assert result.usage.prompt_tokens == 2
        code, body = await server.post_json("/v1/embeddings", {"model": "all-minilm", "input": "three"})
        assert code == 200 and body["data"][0]["embedding"] == expected_embedding("three")
        chunks = await _in_thread(
            lambda: [
                c.choices[0].delta.content
                for c in client.chat.completions.create(
                    model="llama3.2",
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                )
                if c.choices
            ]
        )
        assert "".join(c or "" for c in chunks) == "".join(expected_reply("user: hi"))
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_streams_ndjson_and_sse() -> None:
    server = await _Server(latency=0.01, chunk_delay=0.02, chunks=4).start()
    try:
        arrivals: list[bytes] = []
        response = await server.post("/api/chat", {"model": "llama3.2", "messages": [{"role": "user", "content": "why?"}]})
        assert response.headers.getRawHeaders(b"content-type") == [b"application/x-ndjson"]
        await _within(treq.collect(response, arrivals.append))
        assert len(arrivals) >= 3  # the chunks came apart, not as one body
        lines = [json.loads(line) for line in b"".join(arrivals).splitlines()]
        assert len(lines) == 5
        assert [line["done"] for line in lines] == [False] * 4 + [True]
        assert lines[-1]["done_reason"] == "stop" and lines[-1]["eval_count"] == 4
        assert "".join(line["message"]["content"] for line in lines) == "".join(
            expected_reply("user: why?", "llama3.2", 4)
        )

        code, body = await server.post_json("/api/generate", {"model": "llama3.2", "prompt": "p", "stream": False})
        assert code == 200 and body["response"] == "".join(expected_reply("p", "llama3.2", 4))
        assert body["done"] is True and body["total_duration"] > 0

        response = await server.post(
            "/v1/chat/completions",
            {"model": "llama3.2", "stream": True, "stream_options": {"include_usage": True},
             "messages": [{"role": "user", "content": "hey"}]},
        )
        assert response.headers.getRawHeaders(b"content-type") == [b"text/event-stream"]
        text = (await _within(response.content())).decode()
        events = [e for e in text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "".join(
            expected_reply("user: hey", "llama3.2", 4)
        )

        code, body = await server.post_json(
            "/v1/chat/completions", {"model": "llama3.2", "messages": [{"role": "user", "content": "hey"}]}
        )
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == "".join(expected_reply("user: hey", "llama3.2", 4))
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_parallel_cap_over_sockets() -> None:
    server = await _Server(latency=0.2, parallel=2).start()
    try:
        t0 = _reactor().seconds()
        texts = [f"text {i}" for i in range(10)]
        # The first two answers wait until all ten are in (however slowly a busy machine sends them).
        server.sim.hold("/api/embed")
        answers = defer.gatherResults(
            [defer.ensureDeferred(server.post_json("/api/embed", {"model": "all-minilm", "input": t})) for t in texts],
            consumeErrors=True,
        )
        await _until(lambda: server.sim.in_flight == 10)
        server.sim.release()
        results = await _within(answers)
        elapsed = _reactor().seconds() - t0
        assert [body["embeddings"][0] for _, body in results] == [expected_embedding(t) for t in texts]
        assert server.sim.peak_in_flight == 10
        assert server.sim.peak_serving == 2
        assert server.sim.open_connections >= 2
        for transport in server.sim.transports():  # Nagle is off on every accepted socket
            assert transport.getHandle().getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert elapsed >= 0.2 * 5 - 0.05
        assert server.sim.in_flight == 0
        assert max(server.sim.texts_embedded.values()) == 1
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_refuse_closes_port_and_pool_then_reopens_same_port() -> None:
    server = await _Server(latency=0.5).start()
    try:
        port = server.sim.port
        assert (await server.get_json("/api/version"))[0] == 200  # a pooled connection now
        in_flight = defer.ensureDeferred(server.post("/api/embed", {"model": "m", "input": "x"}))
        await _until(lambda: server.sim.in_flight == 1)
        await _within(server.sim.set_mode("refuse"))
        with pytest.raises(ResponseNeverReceived):
            await _within(in_flight)
        assert server.sim.history[-1].outcome == "refused"
        assert server.sim.open_connections == 0  # the idle pooled one too
        with pytest.raises(ConnectionRefusedError):
            await server.get_json("/api/version")
        await _within(server.sim.set_mode("ok"))
        assert server.sim.port == port
        assert (await server.get_json("/api/version"))[0] == 200
        code, body = await server.post_json("/api/embed", {"model": "m", "input": "y"})
        assert code == 200 and body["embeddings"] == [expected_embedding("y", "m")]
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_error500_mode() -> None:
    server = await _Server().start()
    try:
        await _within(server.sim.set_mode("error500"))
        code, body = await server.post_json("/api/embed", {"model": "all-minilm", "input": "x"})
        assert code == 500 and body == {"error": OOM_ERROR}
        code, body = await server.post_json("/api/generate", {"model": "llama3.2", "prompt": "x"})
        assert code == 500
        assert (await server.get_json("/api/version")) == (200, {"version": "0.12.0-sim"})
        assert (await server.get_json("/api/tags"))[0] == 200
        await _within(server.sim.set_mode("ok"))
        assert (await server.post_json("/api/embed", {"model": "all-minilm", "input": "x"}))[0] == 200
        assert server.sim.mode_hits[("error500", "/api/embed")] == 1
        assert server.sim.mode_hits[("ok", "/api/embed")] == 1
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_hang_until_the_client_gives_up() -> None:
    server = await _Server().start()
    try:
        await _within(server.sim.set_mode("hang"))
        with pytest.raises((defer.CancelledError, ResponseNeverReceived)):
            await server.http.post(server.url + "/api/embed", json={"model": "m", "input": "x"}, timeout=0.3)
        await _until(lambda: server.sim.in_flight == 0)  # the client left; the sim noticed
        assert server.sim.history[-1].outcome == "abandoned"
        assert server.sim.texts_embedded == {}
        assert (await server.get_json("/api/version"))[0] == 200
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_reset_aborts_in_flight_and_new_requests() -> None:
    server = await _Server(latency=5.0).start()
    try:
        pending = defer.ensureDeferred(server.post("/api/embed", {"model": "m", "input": "x"}))
        await _until(lambda: server.sim.serving == 1)
        await _within(server.sim.set_mode("reset"))
        with pytest.raises(ResponseNeverReceived) as caught:
            await _within(pending)
        assert caught.value.reasons[0].check(ConnectionLost)  # a reset, not a clean close
        assert server.sim.in_flight == 0
        with pytest.raises(ResponseNeverReceived) as caught:
            await server.post("/api/embed", {"model": "m", "input": "y"})
        assert caught.value.reasons[0].check(ConnectionLost)
        assert (await server.get_json("/api/version"))[0] == 200
        assert [r.outcome for r in server.sim.history if r.path == "/api/embed"] == ["reset", "reset"]
        assert server.sim.texts_embedded == {}
    finally:
        await server.close()


# ---------------------------------------------------------------------------
# The models it has, as Ollama has models (issue 32, item 7).

#: Each model route: a body that runs the model, and Ollama's 404 for a model it does not have (v0.12.0
#: server/routes.go: the embed routes through handleScheduleError, the others from their own lookup).
_PULL_FIRST = 'model "{}" not found, try pulling it first'
_NOT_FOUND = "model '{}' not found"
_MODEL_ROUTES = {
    "/api/embed": ({"input": "x"}, _PULL_FIRST),
    "/api/embeddings": ({"prompt": "x"}, _PULL_FIRST),
    "/v1/embeddings": ({"input": "x"}, _PULL_FIRST),
    "/api/chat": ({"messages": [{"role": "user", "content": "hi"}], "stream": False}, _NOT_FOUND),
    "/api/generate": ({"prompt": "p", "stream": False}, _NOT_FOUND),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}]}, _NOT_FOUND),
    "/v1/completions": ({"prompt": "p"}, _NOT_FOUND),
}
_HAS = ("all-minilm", "llama3.2:8b", "me/private:v1")
#: Names to try: the models it has in other spellings, near misses, and others.
_NAMES = st.one_of(
    st.sampled_from([
        "all-minilm", "ALL-MiniLM:Latest", "registry.ollama.ai/library/all-minilm:latest", "all-minilm:v2",
        "llama3.2", "llama3.2:8B", "LLAMA3.2:8b", "me/private:v1", "private:v1", "you/private:v1", "gmae",
    ]),
    st.from_regex(r"([a-z]{1,4}/)?[a-z][a-z0-9.-]{0,8}(:[a-z0-9]{1,4})?", fullmatch=True),
)


@settings(max_examples=60, deadline=None)
@given(path=st.sampled_from(sorted(_MODEL_ROUTES)), name=_NAMES, mode=st.sampled_from(["ok", "error500"]))
def test_a_model_route_serves_only_the_models_it_has_and_404s_others_in_ollamas_words(
    path: str, name: str, mode: str
) -> None:
    """Every model route, every spelling: served when the name is one of its models as Ollama compares
    names, else Ollama's 404 in the route's shape, whatever the mode (Ollama looks the model up first)."""
    clock = task.Clock()
    sim = SimOllama(clock, models=_HAS, mode=mode)
    stub = StubTreq(sim.resource())
    extra, words = _MODEL_ROUTES[path]
    code, body = _json_of(stub, _post(stub, path, {"model": name, **extra}))
    has = canonical_model(name) in {canonical_model(m) for m in _HAS}
    if not has:
        assert code == 404, body
        if path.startswith("/v1/"):
            assert body["error"]["message"] == words.format(name) and body["error"]["type"] == "not_found_error"
        else:
            assert body == {"error": words.format(name)}
        assert sim.texts_embedded == {} and sim.loaded_models() == []
    else:
        assert code == (200 if mode == "ok" else 500), body
    assert clock.getDelayedCalls() == []


def test_a_model_name_typo_reaches_the_caller_through_the_proxy_in_ollamas_words() -> None:
    """What a user with a typo meets: the proxy passes the sim's 404 on as it is, no retry, no outage."""
    from inmemory import Rig

    rig = Rig()
    answer = rig.result(rig.post("/api/embed", {"model": "all-minlm", "input": "x"}))
    assert (answer.code, answer.json()) == (404, {"error": 'model "all-minlm" not found, try pulling it first'})
    answer = rig.result(rig.post("/v1/chat/completions", {"model": "lama3.2", "messages": [{"role": "user", "content": "x"}]}))
    assert answer.code == 404 and answer.json()["error"]["message"] == "model 'lama3.2' not found"
    assert rig.sim.requests_total["/api/embed"] == 1 and not rig.proxy.state.yielded
    assert rig.call("GET", rig.admin_url + "/status").json()["upstreams"][0]["failing_models"] == []


def test_tags_and_show_describe_the_models_it_has_and_404_another() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, models=("all-minilm", "llama3.2"))
    stub = StubTreq(sim.resource())
    tags = [m["name"] for m in _json_of(stub, stub.get(URL + "/api/tags"))[1]["models"]]
    assert tags == ["all-minilm:latest", "llama3.2:latest"]
    code, body = _json_of(stub, _post(stub, "/api/show", {"model": "ALL-MINILM"}))
    assert code == 200 and body["capabilities"] == ["embedding"] and body["details"]["family"] == "bert"
    code, body = _json_of(stub, _post(stub, "/api/show", {"name": "llama3.2"}))
    assert code == 200 and body["capabilities"] == ["completion"]
    assert _json_of(stub, _post(stub, "/api/show", {"model": "gmae"})) == (404, {"error": "model 'gmae' not found"})
    assert _json_of(stub, _post(stub, "/api/show", {})) == (400, {"error": "model is required"})
    assert _json_of(stub, _post(stub, "/api/show", b"")) == (400, {"error": "missing request body"})
    # Served a model it lacks, it learns nothing: /api/tags still lists its own.
    assert _json_of(stub, _post(stub, "/api/embed", {"model": "gmae", "input": "x"}))[0] == 404
    sim.add_model("gmae")
    assert _json_of(stub, _post(stub, "/api/embed", {"model": "gmae", "input": "x"}))[0] == 200
    tags = [m["name"] for m in _json_of(stub, stub.get(URL + "/api/tags"))[1]["models"]]
    assert tags == ["all-minilm:latest", "llama3.2:latest", "gmae:latest"]
    assert clock.getDelayedCalls() == []


def test_the_servers_of_one_model_still_serve_it_whatever_the_name() -> None:
    """TEI, Infinity and llama.cpp serve their one model whatever the request names: no 404 there."""
    clock = task.Clock()
    sim = SimOllama(clock, api="infinity", models=("bge-small",))
    stub = StubTreq(sim.resource())
    assert _json_of(stub, _post(stub, "/embeddings", {"model": "anything", "input": ["x"]}))[0] == 200


def test_help_shows_every_default_and_model_replaces_the_default_list() -> None:
    from yieldproxy.tools.sim.command import build_parser

    parser = build_parser("yieldproxy sim")
    text = parser.format_help()
    # Each option's own entry in the list of options: from its line to the next option's.
    entries = {
        m.group(1): " ".join(m.group(2).split())
        for m in re.finditer(r"^  (--[a-z-]+)(.*?)(?=^  -|\Z)", text.split("options:", 1)[1], re.M | re.S)
    }
    expected = {
        "--port": "11434", "--interface": "127.0.0.1", "--latency": "0.0", "--per-item-latency": "0.0",
        "--parallel": "4", "--chunk-delay": "0.0", "--chunks": "5", "--dim": "384", "--load-seconds": "0.0",
        "--mode": "ok", "--api": "ollama", "--model": "all-minilm llama3.2",
    }
    assert set(entries) == set(expected)  # and -h, --help
    for option, default in expected.items():
        assert entries[option].endswith(f"(default: {default})"), (option, entries[option])
    assert tuple(parser.parse_args([]).models) == ("all-minilm", "llama3.2")
    assert tuple(parser.parse_args(["--model", "bge-m3", "--model", "qwen3"]).models) == ("bge-m3", "qwen3")


@pytest_twisted.ensureDeferred
async def test_command_line_prints_port() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "yieldproxy.tools.sim", "--port", "0", "--latency", "0.01", "--parallel", "2", "--dim", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(20, proc.kill)
    timer.start()
    pool = HTTPConnectionPool(_reactor(), persistent=False)
    try:
        line = await _in_thread(proc.stdout.readline)
        assert line.startswith("listening on 127.0.0.1:"), line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1])
        http = HTTPClient(Agent(_reactor(), pool=pool))
        response = await _within(
            http.post(f"http://127.0.0.1:{port}/api/embed", json={"model": "all-minilm", "input": "cli"})
        )
        body = await _within(response.json())
        assert body["embeddings"] == [expected_embedding("cli", dim=8)]
    finally:
        timer.cancel()
        proc.terminate()
        await _in_thread(lambda: proc.wait(10))
        proc.stdout.close()
        proc.stderr.close()
        await _within(pool.closeCachedConnections())


def test_no_reactor_at_import() -> None:
    """Importing the sim must not install or touch the global reactor."""
    code = (
        "import sys, yieldproxy.tools.sim; "
        "sys.exit('twisted.internet.reactor' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=20).returncode == 0
    assert set(MODES) == {"ok", "refuse", "error500", "error500_unknown", "hang", "reset", "stall", "stall_head"}
    assert simmod.__all__


# ---------------------------------------------------------------------------
# The other servers it plays: TEI, Infinity, llama.cpp (docs/servers.md).

from yieldproxy.tools.sim import (  # noqa: E402
    cosine,
    expected_labels,
    expected_relevance,
    expected_sparse,
    expected_tokens,
    raw_embedding,
)

SERVED = "all-minilm"  # the first of the default models: what a one-model server serves


async def _raw(server: _Server, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any, bytes]:
    """One exchange: status, headers, the raw body (JSON bodies sent as JSON unless bytes)."""
    if body is not None and not isinstance(body, bytes):
        kw["json"] = body
    elif body is not None:
        kw["data"] = body
    response = await _within(server.http.request(method, server.url + path, **kw))
    return response.code, response.headers, await _within(response.content())


def _content_type(headers: Any) -> str:
    return (headers.getRawHeaders(b"content-type") or [b""])[0].decode()


@pytest_twisted.ensureDeferred
async def test_tei_routes_and_shapes() -> None:
    server = await _Server(api="tei", dim=16).start()
    try:
        code, body = await server.post_json("/embed", {"inputs": ["a", "b"]})
        assert code == 200 and body == [expected_embedding("a", SERVED, 16), expected_embedding("b", SERVED, 16)]
        # One input still answers a list of vectors; no model name anywhere.
        _, body = await server.post_json("/embed", {"inputs": "a", "normalize": False})
        assert body == [raw_embedding("a", SERVED, 16)]
        _, body = await server.post_json("/embed", {"inputs": "a", "dimensions": 4})
        assert body == [expected_embedding("a", SERVED, 4)]
        # POST / runs the model's default task (embed); GET / is the health check.
        assert (await server.post_json("/", {"inputs": "a"}))[1] == [expected_embedding("a", SERVED, 16)]
        _, body = await server.post_json("/rerank", {"query": "q", "texts": ["x", "q", "y"], "return_text": True})
        assert [r["index"] for r in body][0] == 1 and body[0]["text"] == "q"
        assert body == sorted(body, key=lambda r: r["score"], reverse=True)
        assert {r["index"]: r["score"] for r in body} == {
            i: expected_relevance("q", t, SERVED) for i, t in enumerate(["x", "q", "y"])
        }
        _, single = await server.post_json("/predict", {"inputs": "great"})
        assert single == [{"score": s, "label": label} for label, s in expected_labels("great", SERVED)]
        _, batch = await server.post_json("/predict", {"inputs": [["great"], ["a", "b"]]})
        assert len(batch) == 2 and batch[0] == single
        _, body = await server.post_json("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["a", "b"]}})
        assert body == pytest.approx([1.0, cosine(expected_embedding("a", SERVED, 16), expected_embedding("b", SERVED, 16))])
        _, body = await server.post_json("/embed_sparse", {"inputs": "a b"})
        assert body == [[{"index": i, "value": v} for i, v in expected_sparse("a b", SERVED)]]
        _, body = await server.post_json("/embed_all", {"inputs": "a b"})
        assert body == [[raw_embedding("a", SERVED, 16), raw_embedding("b", SERVED, 16)]]
        _, body = await server.post_json("/tokenize", {"inputs": "Hi there", "add_special_tokens": False})
        assert body == [[{"id": i, "text": t, "special": False, "start": a, "stop": b} for i, t, a, b in expected_tokens("Hi there")]]
        # The OpenAI-compatible route ignores the model named and answers with the served one.
        _, body = await server.post_json("/v1/embeddings", {"model": "anything", "input": ["a"]})
        assert body["model"] == SERVED and body["data"][0]["embedding"] == expected_embedding("a", SERVED, 16)
        code, body = await server.get_json("/info")
        assert code == 200 and body["served_model_name"] == SERVED and body["max_client_batch_size"] == 32
        code, _, raw = await _raw(server, "GET", "/health")
        assert (code, raw) == (200, b"")
        assert server.sim.texts_embedded["a"] >= 5 and server.sim.in_flight == 0
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_tei_errors_in_its_own_shapes() -> None:
    server = await _Server(api="tei", latency=0.3, parallel=1, max_queue=0).start()
    try:
        code, body = await server.post_json("/embed", {"inputs": []})
        assert (code, body) == (400, {"error": "`inputs` cannot be empty", "error_type": "Empty"})
        code, body = await server.post_json("/embed", {"inputs": ["a"] * 33})
        assert (code, body) == (422, {"error": "batch size 33 > maximum allowed batch size 32", "error_type": "Validation"})
        code, body = await server.post_json("/embed", {"inputs": "x " * 600, "truncate": False})
        assert code == 422 and body["error_type"] == "Validation" and "less than 512 tokens" in body["error"]
        # axum's JSON extractor rejects in plain text, before TEI's own code runs.
        code, headers, raw = await _raw(server, "POST", "/embed", {"input": "a"})
        assert code == 422 and _content_type(headers).startswith("text/plain")
        assert raw.startswith(b"Failed to deserialize the JSON body into the target type")
        code, headers, raw = await _raw(server, "POST", "/embed", b"{no", headers={"content-type": ["application/json"]})
        assert code == 400 and raw.startswith(b"Failed to parse the request body as JSON")
        code, _, raw = await _raw(server, "POST", "/embed", b"{}")
        assert (code, raw) == (415, b"Expected request with `Content-Type: application/json`")
        # The OpenAI route words the same errors OpenAI's way, but flat.
        code, body = await server.post_json("/v1/embeddings", {"input": []})
        assert (code, body) == (400, {"message": "`inputs` cannot be empty", "code": 400, "type": "Empty"})
        assert (await _raw(server, "GET", "/nope"))[::2] == (404, b"")
        assert (await _raw(server, "GET", "/embed"))[::2] == (405, b"")
        # Busy: one served, none may wait: TEI's 429.
        first = defer.ensureDeferred(server.post_json("/embed", {"inputs": "a"}))
        await _until(lambda: server.sim.serving == 1)
        code, body = await server.post_json("/embed", {"inputs": "b"})
        assert (code, body) == (429, {"error": "Model is overloaded", "error_type": "Overloaded"})
        assert (await _within(first))[0] == 200
        # The GPU fails: 424 Backend on model routes, and /health says so.
        await _within(server.sim.set_mode("error500"))
        code, body = await server.post_json("/embed", {"inputs": "a"})
        assert code == 424 and body["error_type"] == "Backend" and "out of memory" in body["error"]
        code, body = await server.post_json("/v1/embeddings", {"input": "a"})
        assert code == 424 and body["type"] == "Backend" and body["code"] == 424
        assert await server.get_json("/health") == (503, {"error": "unhealthy", "error_type": "Unhealthy"})
        assert (await server.post_json("/tokenize", {"inputs": "a"}))[0] == 200  # the tokenizer needs no GPU
        await _within(server.sim.set_mode("ok"))
        assert (await _raw(server, "GET", "/health"))[0] == 200
    finally:
        await server.close()


def test_tei_health_runs_the_model_so_it_hangs_and_resets_with_it() -> None:
    clock = task.Clock()
    sim = SimOllama(clock, api="tei")
    stub = StubTreq(sim.resource())
    sim.set_mode("hang")
    hung = stub.get(URL + "/health")
    stub.flush()
    assert not _fired(hung) and sim.in_flight == 1
    assert _fired(stub.get(URL + "/info"))  # the rest of the router answers
    _fired(sim.set_mode("reset"))
    assert sim.in_flight == 0 and sim.history[0].outcome == "reset"
    sim.set_mode("ok")
    assert _json_of(stub, stub.post(URL + "/tokenize", data=b'{"inputs": "a"}', headers={"content-type": ["application/json"]}))[0] == 200
    assert clock.getDelayedCalls() == []


@pytest_twisted.ensureDeferred
async def test_infinity_routes_and_shapes() -> None:
    from openai import OpenAI

    server = await _Server(api="infinity", dim=16).start()
    try:
        # One model: any name is answered, with the served one.
        code, body = await server.post_json("/embeddings", {"model": "whatever", "input": ["a", "b"]})
        assert code == 200 and body["object"] == "list" and body["model"] == SERVED
        assert [d["embedding"] for d in body["data"]] == [expected_embedding(t, SERVED, 16) for t in "ab"]
        assert body["id"].startswith("infinity-") and isinstance(body["created"], int)
        # dimensions truncate without renormalising, as the real server does.
        _, body = await server.post_json("/embeddings", {"input": "a", "dimensions": 4})
        assert body["data"][0]["embedding"] == expected_embedding("a", SERVED, 16)[:4]
        # Often started with --url-prefix /v1: both are answered; base64 for the openai client.
        client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        result = await _in_thread(lambda: client.embeddings.create(model="m", input=["a"]))
        assert result.data[0].embedding == pytest.approx(expected_embedding("a", SERVED, 16), abs=1e-7)
        _, body = await server.post_json("/rerank", {"query": "q", "documents": ["x", "q", "y"], "top_n": 2,
                                                     "return_documents": True})
        assert body["object"] == "rerank" and [r["index"] for r in body["results"]][0] == 1
        assert len(body["results"]) == 2 and body["results"][0]["document"] == "q"
        assert body["results"][1]["relevance_score"] == max(expected_relevance("q", t, SERVED) for t in "xy")
        _, body = await server.post_json("/classify", {"input": ["great"]})
        assert body["object"] == "classify"
        assert body["data"] == [[{"score": s, "label": label} for label, s in expected_labels("great", SERVED)]]
        code, body = await server.get_json("/models")
        assert code == 200 and body["data"][0]["id"] == SERVED and body["data"][0]["owned_by"] == "infinity"
        code, body = await server.get_json("/health")
        assert code == 200 and set(body) == {"unix"}
        code, headers, _ = await _raw(server, "GET", "/", allow_redirects=False)
        assert code == 307 and headers.getRawHeaders(b"location") == [b"/docs"]
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_infinity_errors_in_its_own_shapes() -> None:
    server = await _Server(api="infinity", latency=0.3, parallel=1, max_queue=0).start()
    try:
        # FastAPI's validation: 422 {"detail": [...]}, a malformed body too.
        code, body = await server.post_json("/embeddings", {"model": "m", "input": []})
        assert code == 422 and body["detail"][0]["type"] == "too_short"
        code, body = await server.post_json("/embeddings", {"model": "m"})
        assert code == 422 and body["detail"][0]["type"] == "missing" and body["detail"][0]["loc"][-1] == "input"
        code, _, raw = await _raw(server, "POST", "/embeddings", b"{no", headers={"content-type": ["application/json"]})
        assert code == 422 and json.loads(raw)["detail"][0]["type"] == "json_invalid"
        assert await server.get_json("/nope") == (404, {"detail": "Not Found"})
        assert await server.get_json("/embeddings") == (405, {"detail": "Method Not Allowed"})
        first = defer.ensureDeferred(server.post_json("/embeddings", {"input": "a"}))
        await _until(lambda: server.sim.serving == 1)
        code, body = await server.post_json("/embeddings", {"model": "bert", "input": "b"})
        assert (code, body) == (429, {"error": {"message": "model bert is currently overloaded", "type": None,
                                                "param": None, "code": 429}})
        assert (await _within(first))[0] == 200
        await _within(server.sim.set_mode("error500"))
        code, body = await server.post_json("/rerank", {"query": "q", "documents": ["a"]})
        assert code == 500 and body["error"]["code"] == 500
        assert body["error"]["message"].startswith("InternalServerError: CUDA out of memory")
        assert (await server.get_json("/health"))[0] == 200  # Infinity's health does not look at the engine
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_llamacpp_routes_and_shapes() -> None:
    from openai import OpenAI

    server = await _Server(api="llamacpp", dim=16, chunks=3, models=("llama3.2",)).start()
    try:
        assert await server.get_json("/health") == (200, {"status": "ok"})
        _, body = await server.post_json("/embedding", {"content": "a"})
        assert body == [{"index": 0, "embedding": [expected_embedding("a", "llama3.2", 16)]}]
        _, body = await server.post_json("/v1/embeddings", {"model": "named", "input": ["a", "b"]})
        assert body["model"] == "named" and body["object"] == "list"  # the name asked for, echoed
        assert [d["embedding"] for d in body["data"]] == [expected_embedding(t, "llama3.2", 16) for t in "ab"]
        _, body = await server.post_json("/v1/rerank", {"query": "q", "documents": ["x", "q"], "top_n": 1})
        assert body["object"] == "list" and body["results"] == [{"index": 1, "relevance_score": 1.0}]
        # With "texts", TEI's format: a bare list.
        _, body = await server.post_json("/rerank", {"query": "q", "texts": ["x", "q"], "return_text": True})
        assert body[0] == {"index": 1, "score": 1.0, "text": "q"} and body[1]["index"] == 0
        text = "".join(expected_reply("hello", "llama3.2", 3))
        _, body = await server.post_json("/completion", {"prompt": "hello"})
        assert body["content"] == text and body["stop"] is True and body["stop_type"] == "eos"
        # The native stream: SSE objects, the last with stop true, and no [DONE].
        response = await server.post("/completion", {"prompt": "hello", "stream": True})
        events = [e for e in (await _within(response.content())).decode().split("\n\n") if e]
        chunks = [json.loads(e[len("data: "):]) for e in events]
        assert [c["stop"] for c in chunks] == [False, False, False, True]
        assert "".join(c["content"] for c in chunks) == text
        _, body = await server.post_json("/infill", {"input_prefix": "def f(", "input_suffix": "):"})
        assert body["content"] == "".join(expected_reply("def f():", "llama3.2", 3))
        # /api/chat is Ollama's path with llama.cpp's OpenAI-shaped answer.
        _, body = await server.post_json("/api/chat", {"messages": [{"role": "user", "content": "hi"}]})
        assert body["object"] == "chat.completion"
        client = OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        pieces = await _in_thread(lambda: [
            c.choices[0].delta.content
            for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
            if c.choices
        ])
        assert "".join(p or "" for p in pieces) == "".join(expected_reply("user: hi", "llama3.2", 3))
        _, body = await server.post_json("/tokenize", {"content": "Hi there"})
        assert body == {"tokens": [i for i, _, _, _ in expected_tokens("Hi there")]}
        code, body = await server.get_json("/v1/models")
        assert code == 200 and body["data"][0]["id"] == "llama3.2" and body["data"][0]["meta"] is not None
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_llamacpp_errors_loading_and_outages() -> None:
    server = await _Server(api="llamacpp", load_seconds=0.3).start()
    try:
        loading = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
        # Its HTTP server is up before the model: 503 everywhere but the model lists.
        assert await server.get_json("/health") == (503, loading)
        assert await server.post_json("/v1/embeddings", {"input": "a"}) == (503, loading)
        code, body = await server.get_json("/v1/models")
        assert code == 200 and body["data"][0]["meta"] is None
        await _until(lambda: not server.sim.loading)
        assert await server.get_json("/health") == (200, {"status": "ok"})
        not_found = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
        assert await server.get_json("/nope") == (404, not_found)
        assert await server.get_json("/embedding") == (404, not_found)  # no 405 in cpp-httplib
        code, body = await server.post_json("/embedding", {"nothing": 1})
        assert (code, body) == (400, {"error": {"code": 400, "message": '"input" or "content" must be provided',
                                                "type": "invalid_request_error"}})
        # The caller's malformed JSON or chat body is a 500 there: the message tells it from the GPU's.
        code, _, raw = await _raw(server, "POST", "/completion", b"{no")
        assert code == 500 and json.loads(raw)["error"]["type"] == "server_error"
        code, body = await server.post_json("/v1/chat/completions", {"model": "m"})
        assert code == 500 and body["error"]["message"] == "'messages' is required"
        await _within(server.sim.set_mode("error500"))
        compute = {"error": {"code": 500, "message": "Compute error.", "type": "server_error"}}
        assert await server.post_json("/v1/embeddings", {"input": "a"}) == (500, compute)
        assert await server.post_json("/completion", {"prompt": "a"}) == (500, compute)
        assert await server.get_json("/health") == (200, {"status": "ok"})  # the process is fine
        # Down and back: the restarted server loads its model again.
        await _within(server.sim.set_mode("refuse"))
        await _within(server.sim.set_mode("ok"))
        assert await server.get_json("/health") == (503, loading)
        await _until(lambda: not server.sim.loading)
        assert await server.get_json("/health") == (200, {"status": "ok"})
    finally:
        await server.close()


def test_llamacpp_loads_at_start_and_after_refuse_or_reset_on_a_clock() -> None:
    clock = task.Clock()
    clock.advance(1000)
    sim = SimOllama(clock, api="llamacpp", load_seconds=2.0)
    stub = StubTreq(sim.resource())
    assert _json_of(stub, stub.get(URL + "/health"))[0] == 503
    clock.advance(1.999)
    assert _json_of(stub, stub.get(URL + "/health"))[0] == 503
    clock.advance(0.001)
    assert _json_of(stub, stub.get(URL + "/health"))[0] == 200
    sim.set_mode("error500")
    sim.set_mode("ok")  # a compute error does not restart it
    assert _json_of(stub, stub.get(URL + "/health"))[0] == 200
    for outage in ("reset", "refuse"):
        sim.set_mode(outage)
        sim.set_mode("ok")
        assert _json_of(stub, stub.get(URL + "/health"))[0] == 503
        clock.advance(2.0)
        assert _json_of(stub, stub.get(URL + "/health"))[0] == 200
    assert [r.outcome for r in sim.history].count("loading") == 4
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize("api, path, body", [
    ("tei", "/embed", {"inputs": "cli"}),
    ("infinity", "/embeddings", {"input": "cli"}),
    ("llamacpp", "/embedding", {"content": "cli"}),
])
@pytest_twisted.ensureDeferred
async def test_command_line_plays_another_server(api: str, path: str, body: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "yieldproxy.tools.sim", "--port", "0", "--api", api, "--model", "bge", "--dim", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    timer = threading.Timer(20, proc.kill)
    timer.start()
    pool = HTTPConnectionPool(_reactor(), persistent=False)
    try:
        line = await _in_thread(proc.stdout.readline)
        assert line.startswith("listening on 127.0.0.1:"), line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1])
        http = HTTPClient(Agent(_reactor(), pool=pool))
        response = await _within(http.post(f"http://127.0.0.1:{port}{path}", json=body))
        answer = await _within(response.json())
        vector = answer["data"][0]["embedding"] if api == "infinity" else (
            answer[0] if api == "tei" else answer[0]["embedding"][0])
        assert vector == expected_embedding("cli", "bge", 8)
    finally:
        timer.cancel()
        proc.terminate()
        await _in_thread(lambda: proc.wait(10))
        proc.stdout.close()
        proc.stderr.close()
        await _within(pool.closeCachedConnections())
