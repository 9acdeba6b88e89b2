"""The answer's way back (issue 10, findings 5 and 8a).

* A replay slot stands for work on the GPU: it is free once the upstream has
  finished its answer, however slowly the client reads.  The rest waits in
  the proxy's memory within a bound per answer and a bound in total; a client
  past either is dropped (counted, 499), never the upstream paused for it.
* A request that expires says what really kept it (a yield, an outage, or
  replay slots busy after the GPU came back).
* An error body longer than what is read to judge it reaches the client
  whole, under its true length.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time

import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.logger import formatEvent
from twisted.web.client import ResponseFailed
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from helpers import Entry, config_with, declaring, in_thread, make_core, start_stack, wait_for
from inmemory import Rig, answered
from rawhttp import LogCapture, ScriptedBackend, counter_by, exchange, parse_response, port_of, recording_stack, request_bytes
from yieldproxy.lot.parking import Refused
from yieldproxy.tools.sim import expected_embedding

TIMEOUT = 60
MiB = 1024 * 1024
#: An answer larger than what the kernel's socket buffers take for a client (tcp_wmem max 4 MiB).
BIG = 8 * MiB
EMBED = json.dumps({"model": "all-minilm", "input": "small"}).encode()


def buffered(stack) -> float:
    return stack.sample("yieldproxy_client_buffered_bytes")


class SlowReader:
    """A raw client that asks for ``target`` and reads its answer at about ``rate`` bytes a second."""

    def __init__(self, port: int, target: bytes, rate: int = 64 * 1024, read: bool = True):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        self.sock.sendall(request_bytes(b"GET", target, [(b"X-Yield-Class", b"batch")]))
        self.rate = rate
        self.received = 0
        self.closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True) if read else None
        if self._thread is not None:
            self._thread.start()

    def _read(self) -> None:
        chunk = 4096
        while not self._stop.is_set():
            try:
                data = self.sock.recv(chunk)
            except OSError:
                break
            if not data:
                break
            self.received += len(data)
            time.sleep(len(data) / self.rate)
        self.closed = True

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5)


# -- finding 5: slow readers do not hold the GPU's slots ------------------------------------------


@pytest_twisted.ensureDeferred
async def test_slow_readers_do_not_hold_the_replay_slots():
    """Four clients reading 64 KB/s take all four slots' answers; the requests parked behind them
    are served as soon as the GPU is back, not expired behind the slow readers."""
    config = config_with(replay={"concurrency": 4})
    # Large enough that the kernel's socket buffers (up to 4 MiB here) cannot take it all.
    stack = await recording_stack(declaring("/big", config=config), big_size=BIG)
    port = port_of(stack.proxy_url)
    readers = []
    logs = LogCapture().__enter__()
    try:
        stack.proxy.state.hold("api", "game")
        readers = [SlowReader(port, b"/big") for _ in range(4)]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 4, timeout=10)
        waiting = [
            in_thread(
                reactor, exchange, port,
                request_bytes(b"POST", b"/api/embed", [(b"X-Yield-Class", b"batch"), (b"X-Yield-Max-Wait", b"10")], EMBED),
                20, timeout=TIMEOUT,
            )
            for _ in range(4)
        ]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 8, timeout=10)
        stack.proxy.state.release("api")
        for pending in waiting:
            answer = await pending
            # Served, not refused at their X-Yield-Max-Wait of 10 s: the slow readers did not keep the slots...
            assert answer.status == 200, answer.body
        # ...which are still reading (that takes minutes), while their upstream answers are done
        # (under load the last may still be coming in from the upstream: waited for, bounded).
        await wait_for(reactor, lambda: stack.proxy.replayer.inflight == 0, timeout=20)
        assert all(r.received < BIG for r in readers)
        # Their answers wait in the proxy for them, and are counted there.
        assert buffered(stack) > 4 * 1024 * 1024
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "expired"}) == 0
        for reader in readers:
            reader.close()
        # Readers that leave before the end are counted as gone, and their bytes freed.
        await wait_for(reactor, lambda: buffered(stack) == 0, timeout=10)
        await wait_for(reactor, lambda: counter_by(stack, "yieldproxy_requests", "code") == {"200": 4.0, "499": 4.0})
        assert logs.errors() == []
    finally:
        logs.__exit__()
        for reader in readers:
            reader.close()
        await wait_for(reactor, lambda: buffered(stack) == 0, timeout=10)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_client_past_its_buffer_bound_is_dropped_and_counted():
    """A client that never reads a 64 MB answer: dropped once 1 MiB waits for it; the upstream is
    stopped, the slot freed, the request counted as gone (499)."""
    config = config_with(replay={"concurrency": 1}, proxy={"slow_client_buffer_bytes": 1024 * 1024})
    stack = await recording_stack(declaring("/big", config=config))
    port = port_of(stack.proxy_url)
    reader = None
    logs = LogCapture().__enter__()
    try:
        reader = SlowReader(port, b"/big", read=False)
        await wait_for(
            reactor, lambda: stack.sample("yieldproxy_slow_clients_dropped_total", **{"class": "batch"}) == 1,
            timeout=20,
        )
        # Dropped by the buffer bound (its own log line), not by the 300 s idle timeout.
        assert "dropping a slow batch client" in logs.text()
        await wait_for(reactor, lambda: stack.proxy.replayer.inflight == 0 and not stack.echo.open, timeout=10)
        assert buffered(stack) == 0
        assert counter_by(stack, "yieldproxy_requests", "code") == {"499": 1.0}
        # The next request goes through at once.
        response = await treq.post(stack.proxy_url + "/api/embed", data=EMBED).addTimeout(TIMEOUT, reactor)
        assert response.code == 200
        await response.content()
        assert logs.errors() == []
    finally:
        logs.__exit__()
        if reader is not None:
            reader.close()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_the_total_buffer_bound_drops_the_client_that_would_pass_it():
    """Bounds 12 MiB per answer, 11 MiB in all, 10 MiB answers: what the kernel does not take of the
    first non-reader's answer (6 MiB or more) waits for it; the second, which would pass the total,
    is dropped; the count goes back to 0 when they are gone."""
    config = config_with(proxy={"slow_client_buffer_bytes": 12 * MiB, "slow_client_buffer_total_bytes": 11 * MiB})
    stack = await recording_stack(declaring("/big", config=config), big_size=10 * MiB)
    port = port_of(stack.proxy_url)
    readers = []
    try:
        readers.append(SlowReader(port, b"/big", read=False))
        await wait_for(reactor, lambda: stack.proxy.replayer.inflight == 0 and len(stack.echo.heads) == 1, timeout=10)
        first = buffered(stack)
        assert 6 * MiB <= first <= 10 * MiB
        readers.append(SlowReader(port, b"/big", read=False))
        await wait_for(
            reactor, lambda: stack.sample("yieldproxy_slow_clients_dropped_total", **{"class": "batch"}) == 1,
            timeout=10,
        )
        await wait_for(reactor, lambda: stack.proxy.replayer.inflight == 0, timeout=10)
        assert buffered(stack) == first
    finally:
        for reader in readers:
            reader.close()
        await wait_for(reactor, lambda: buffered(stack) == 0, timeout=10)
        await stack.stop()


def test_an_expiry_after_the_gpu_came_back_blames_the_busy_slots_not_the_gpu():
    core = make_core(concurrency=1)
    core.state.hold("api", "game")
    first = core.scheduler.admit(Entry(cls="interactive"))
    second = core.scheduler.admit(Entry(cls="interactive"))
    core.run(1)
    core.state.release("api")
    core.run(0.01)
    assert first.called and not second.called  # the first holds the only slot, and keeps it
    failures = []
    second.addErrback(failures.append)
    core.run(15)
    refusal = core.scheduler.explain(failures[0].value)  # as the caller reads it
    assert isinstance(refusal, Refused) and refusal.reason == "expired"
    assert "yielded" not in refusal.message
    assert "the GPU was back, but the requests ahead of this one still held all 1 replay slots" in refusal.message
    assert "hold bound" in refusal.message


def test_an_expiry_during_a_yield_or_an_outage_says_which():
    core = make_core()
    core.state.hold("api", "game")
    yielded = core.scheduler.admit(Entry(cls="batch", max_wait=1))
    core.state.hold("outage", "upstream failing")
    core.state.release("api")
    outage = core.scheduler.admit(Entry(cls="batch", max_wait=3))
    messages = []
    # Worded for the caller as it expires (the cause is the state at that moment).
    explain = lambda f: messages.append(core.scheduler.explain(f.value).message)  # noqa: E731
    yielded.addErrback(explain)
    outage.addErrback(explain)
    core.run(1.1)
    core.state.hold("api", "game")
    core.run(2)
    assert messages[0] == (
        "wait longer than your X-Yield-Max-Wait (1s): the upstream was failing and had not recovered in time "
        "(outage detected by the proxy)"
    )
    assert messages[1] == "wait longer than your X-Yield-Max-Wait (3s): the GPU was still yielded (held by api, outage)"
    assert core.clock.getDelayedCalls() == []


# -- finding 8a: a long error body reaches the client whole -----------------------------------------


class LongErrors(Resource):
    """A 500 (and a 503) whose JSON body is far longer than the 64 KiB read to judge it."""

    isLeaf = True

    def __init__(self, size: int):
        super().__init__()
        self.body = json.dumps({"error": "model load failed: " + "x" * size}).encode()

    def render(self, request):
        request.setResponseCode(503 if request.path == b"/busy" else 500)
        request.responseHeaders.setRawHeaders(b"content-type", [b"application/json"])
        if request.path == b"/chunked":
            # No Content-Length: the answer goes out chunked, in several writes.
            for start in range(0, len(self.body), 10_000):
                request.write(self.body[start:start + 10_000])
            request.finish()
            return NOT_DONE_YET
        return self.body


@pytest_twisted.ensureDeferred
async def test_a_long_error_body_reaches_the_client_whole_under_its_true_length():
    upstream = LongErrors(200_000)
    listening = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(upstream))
    stack = await start_stack(
        reactor, declaring("/fail", "/chunked", "/busy", config=config_with(upstream={"max_attempts": 1})),
        upstream=f"http://127.0.0.1:{listening.getHost().port}",
    )
    stack._ports.append(listening)
    port = port_of(stack.proxy_url)
    try:
        for target, headers in [
            (b"/fail", [(b"X-Yield-Class", b"batch")]),  # parked route: judged, then relayed
            (b"/chunked", [(b"X-Yield-Class", b"batch")]),
            (b"/api/tags", []),  # passthrough
        ]:
            answer = await in_thread(reactor, exchange, port, request_bytes(b"GET", target, headers), 20, timeout=TIMEOUT)
            assert answer.status == 500, target
            assert answer.body == upstream.body, (target, len(answer.body))
            assert json.loads(answer.body)["error"].startswith("model load failed")
            length = answer.header(b"content-length")
            assert length is None or int(length) == len(upstream.body)
        # A long 503 is retried, never relayed cut: with one attempt allowed, our own honest 502.
        answer = await in_thread(
            reactor, exchange, port, request_bytes(b"GET", b"/busy", [(b"X-Yield-Class", b"batch")]), 20, timeout=TIMEOUT
        )
        assert answer.status == 502
        assert "503" in json.loads(answer.body)["error"]
    finally:
        await stack.stop()


# -- issue 16.3: an answer that stops half-way never holds a slot or a client forever -----------

STALL = 60.0  # upstream.stall_timeout_seconds, by default


def _embed(i) -> dict:
    return {"model": "all-minilm", "input": f"text {i}"}


def test_half_answers_that_stall_free_their_replay_slots_after_the_stall_timeout():
    """Four answers that stop after their first bytes hold the four replay slots for
    ``stall_timeout_seconds``, not for ever: then they end (their clients get what was sent and a
    close), and the requests parked behind them, and one sent after the resume, are served."""
    rig = Rig(config_with(replay={"concurrency": 4}))
    with LogCapture() as logs:
        rig.proxy.state.hold("api", "game")
        stalled = [rig.post("/api/embed", _embed(i)) for i in range(4)]
        behind = [rig.post("/api/embed", _embed(i)) for i in range(4, 8)]
        assert len(rig.proxy.lot) == 8
        rig.sim.set_mode("stall")
        rig.proxy.state.release("api")
        rig.turn()
        assert rig.sim.in_flight == 4 and len(rig.proxy.lot) == 4  # four slots, four half-answers
        rig.sim.set_mode("ok")
        resumed_at = rig.clock.seconds()
        late = rig.post("/api/embed", _embed(8))
        rig.run(STALL - 1)
        assert not any(answered(d) for d in stalled + behind + [late])
        rig.run(1.5)
        for i, d in enumerate(behind + [late], start=4):
            answer = rig.result(d)
            assert answer.code == 200
            assert answer.json()["embeddings"] == [expected_embedding(f"text {i}", "all-minilm")]
        assert rig.clock.seconds() - resumed_at <= STALL + 1.5
        for d in stalled:
            # The status line and the bytes that came, then a clean close: short of its Content-Length.
            caught: list = []
            d.addErrback(caught.append)
            assert caught and caught[0].check(ResponseFailed), caught
        assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="stall") == 4
        assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "stall"}) == 4
        assert rig.proxy.replayer.inflight == 0
        said = [formatEvent(event) for event in logs.events]
        assert sum("sent nothing for 60s in the middle of an answer" in line for line in said) == 4
    rig.sim.stop()
    rig.run(1)
    assert rig.clock.getDelayedCalls() == []


def _raw_post(rig: Rig, path: bytes, body: dict):
    peer = rig.raw()
    peer.send(request_bytes(b"POST", path, [(b"Content-Type", b"application/json")], json.dumps(body).encode()))
    rig.turn()
    return peer


def test_a_stream_that_stalls_ends_with_its_own_error_then_a_terminated_body_and_a_close():
    """A stream whose upstream goes silent mid-answer: after the stall timeout the client gets the
    stream's own error (an NDJSON ``{"error"}`` line, an SSE error event), the last chunk, and the
    connection closes; the slot is free."""
    rig = Rig(config_with(replay={"concurrency": 1}))
    rig.sim.set_mode("stall")
    chat = {"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ndjson = _raw_post(rig, b"/api/chat", chat)
    sse = _raw_post(rig, b"/v1/chat/completions", chat)
    rig.run(STALL - 1)
    assert not ndjson.closed and not sse.closed
    assert ndjson.data.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in ndjson.data.lower()
    rig.run(1.5)
    assert ndjson.closed and sse.closed
    answer, rest = parse_response(ndjson.data)
    assert answer is not None and rest == b""  # a complete chunked body: its last chunk came
    first, error = answer.body.splitlines()
    assert json.loads(first)["done"] is False
    assert json.loads(error)["error"].startswith("upstream failed mid-answer: upstream http://upstream.invalid sent nothing for 60s")
    answer, rest = parse_response(sse.data)
    assert answer is not None and rest == b""
    events = [e for e in answer.body.split(b"\n\n") if e]
    assert json.loads(events[0][len(b"data: "):])["object"] == "chat.completion.chunk"
    error = json.loads(events[-1][len(b"data: "):])["error"]
    assert error["code"] == "upstream_broken" and "sent nothing for 60s" in error["message"]
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="stall") == 2
    assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "interactive", "reason": "stall"}) == 2
    assert rig.proxy.replayer.inflight == 0
    rig.sim.stop()
    rig.run(1)
    assert rig.clock.getDelayedCalls() == []


def test_a_stall_before_anything_reached_the_client_is_a_counted_retry():
    """An error answer's head and the first bytes of its body, then nothing: an error is read
    before anything of it is relayed, so nothing reached the client; the attempt ends after the
    stall timeout (body bytes had begun to flow) and the request goes back in line, counted, as
    for a reset."""
    body = json.dumps({"model": "all-minilm", "embeddings": [[0.5]]}).encode()
    whole = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    error = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"error\":"
    backend = ScriptedBackend((error, "stall"), (whole + body, "keep"))
    rig = Rig(upstream=backend)
    d = rig.post("/api/embed", _embed(0))
    rig.run(STALL - 1)
    assert not answered(d) and len(backend.heads) == 1
    rig.run(1.5)
    answer = rig.result(d)
    assert answer.code == 200 and answer.body == body
    assert len(backend.heads) == 2 and backend.connections == 2
    assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "stall"}) == 1
    assert rig.sample("yieldproxy_retries_total", **{"class": "batch"}) == 1
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="stall") == 1


ATTEMPT = 120.0  # upstream.attempt_timeout_seconds, by default


def test_a_passthrough_answer_that_stalls_mid_body_counts_a_stall_of_the_passthrough_class():
    """A route that never parks, its answer cut by a stall once bytes reached the client: the same
    count as a gated request's (``upstream_failures_total``), under the ``passthrough`` class."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    backend = ScriptedBackend((head + b'{"models": [', "stall"))
    rig = Rig(upstream=backend)
    peer = rig.raw()
    peer.send(request_bytes(b"GET", b"/api/tags", [], b""))
    rig.turn()
    rig.run(STALL + 1)
    assert peer.closed and peer.data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "passthrough", "reason": "stall"}) == 1
    assert rig.sample("yieldproxy_requests_total", **{"class": "passthrough", "code": "200"}) == 1


class _HeldBackend(ScriptedBackend):
    """A :class:`ScriptedBackend` that keeps its last connection, for a test to write more on it later."""

    protocol = None

    def buildProtocol(self, addr):
        self.protocol = super().buildProtocol(addr)
        return self.protocol


def test_a_head_then_a_long_silence_then_the_body_is_relayed_whole():
    """A server that sends its head before the model's prefill (an SSE server: vLLM, llama.cpp's),
    then nothing for 90 s, then the whole body: the stall timeout (60 s) bounds silences once body
    bytes flow, not the wait for the first one, which the attempt timeout (120 s) bounds; the
    answer is relayed whole, on one attempt."""
    body = json.dumps({"model": "all-minilm", "embeddings": [[0.5]]}).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    backend = _HeldBackend((head, "stall"))
    rig = Rig(upstream=backend)
    d = rig.post("/api/embed", _embed(0))
    rig.run(90)
    assert not answered(d)
    assert backend.protocol is not None
    backend.protocol.transport.write(body)
    rig.turn()
    answer = rig.result(d)
    assert answer.code == 200 and answer.body == body
    assert len(backend.heads) == 1 and backend.connections == 1
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="stall") == 0
    assert rig.sample("yieldproxy_retries_total", **{"class": "batch"}) == 0
    assert rig.clock.getDelayedCalls() == []


def test_a_head_then_silence_past_the_attempt_timeout_is_a_counted_retry():
    """The head came and then nothing, no byte of the body: the wait for the first body byte is
    bounded by the attempt timeout (120 s), not the stall timeout (60 s).  Nothing reached the
    client (the head is relayed with the first body byte), so past it the request goes back in
    line, counted, as for a reset, and the next attempt answers."""
    body = json.dumps({"model": "all-minilm", "embeddings": [[0.5]]}).encode()
    whole = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    backend = ScriptedBackend((whole, "stall"), (whole + body, "keep"))
    rig = Rig(upstream=backend)
    d = rig.post("/api/embed", _embed(0))
    rig.run(ATTEMPT - 1)
    assert not answered(d) and len(backend.heads) == 1
    rig.run(1.5)
    answer = rig.result(d)
    assert answer.code == 200 and answer.body == body
    assert len(backend.heads) == 2 and backend.connections == 2
    assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "timeout"}) == 1
    assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "stall"}) == 0
    assert rig.sample("yieldproxy_retries_total", **{"class": "batch"}) == 1
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="timeout") == 1
    assert rig.clock.getDelayedCalls() == []


# -- issue 16.3: an unreadable answer is not a GPU failure -------------------------------------------


def test_an_unreadable_answer_is_retried_once_not_max_attempts_times():
    """A head with a bare LF, or a chunk size that is not hex: no GPU failure, and each try runs the
    model again, so the request is sent twice at most (not ``upstream.max_attempts`` = 5 times),
    then the caller gets a 502 that says why."""
    bare_lf = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\nx-odd: 1\r\ncontent-length: 2\r\n\r\n{}"
    bad_chunk = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    for answer in (bare_lf, bad_chunk):
        backend = ScriptedBackend((answer, "keep"))
        rig = Rig(upstream=backend)
        reply = rig.result(rig.post("/api/embed", _embed(0)))
        assert reply.code == 502, reply.body
        assert "upstream failed 2 times, giving up" in reply.json()["error"]
        assert len(backend.heads) == 2
        assert rig.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "bad_answer"}) == 2
        assert rig.sample("yieldproxy_retries_total", **{"class": "batch"}) == 1
        assert rig.clock.getDelayedCalls() == []


# -- issue 16.5: upstream framing ---------------------------------------------------------------------


def _dechunk(data: bytes) -> tuple[bytes, bytes]:
    """A chunked body and what follows it."""
    body = b""
    while True:
        line, _, data = data.partition(b"\r\n")
        size = int(line, 16)
        if size == 0:
            assert data.startswith(b"\r\n")
            return body, data[2:]
        body, data = body + data[:size], data[size + 2:]


def test_a_body_in_a_transfer_coding_is_relayed_with_it_not_dechunked_and_relabelled():
    """``Transfer-Encoding: gzip, chunked`` from the upstream reaches the client as ``gzip, chunked``
    (its gzip bytes, re-chunked), on a passthrough route and a parked one; an HTTP/1.0 client gets
    ``gzip`` and the body until the close. Never the gzip bytes under no coding at all."""
    payload = json.dumps({"models": [{"name": "all-minilm:latest"}]}).encode()
    coded = gzip.compress(payload)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (coded[:10], coded[10:])) + b"0\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: gzip, chunked\r\n\r\n" + chunks
    backend = ScriptedBackend((answer, "keep"))
    rig = Rig(upstream=backend)
    for request in (request_bytes(b"GET", b"/api/tags"), request_bytes(b"POST", b"/api/embed", [], json.dumps(_embed(0)).encode())):
        peer = rig.raw()
        peer.send(request)
        rig.turn()
        head, _, rest = peer.data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"HTTP/1.1 200 OK"
        assert [line for line in lines if line.lower().startswith(b"transfer-encoding:")] == [
            b"Transfer-Encoding: gzip, chunked"
        ]
        assert not [line for line in lines if line.lower().startswith((b"content-length:", b"content-encoding:"))]
        body, after = _dechunk(rest)
        assert after == b"" and gzip.decompress(body) == payload
        assert not peer.closed  # a complete answer: the connection stays
    peer = rig.raw()
    peer.send(b"GET /api/tags HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
    rig.turn()
    head, _, rest = peer.data.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: gzip" in head.split(b"\r\n") and peer.closed
    assert gzip.decompress(rest) == payload


def test_an_error_answer_in_a_transfer_coding_is_relayed_with_it():
    """A 500 whose body is ``gzip, chunked``, read whole to be judged and then relayed as the
    caller's: it goes out with its coding, chunked, never under a plain ``Content-Length``."""
    payload = json.dumps({"error": "something nobody listed"}).encode()
    coded = gzip.compress(payload)
    answer = (
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded)
    )
    rig = Rig(upstream=ScriptedBackend((answer, "keep")))
    peer = rig.raw()
    peer.send(request_bytes(b"POST", b"/api/embed", [], json.dumps(_embed(0)).encode()))
    rig.turn()
    head, _, rest = peer.data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 500 ")
    assert b"Transfer-Encoding: gzip, chunked" in lines
    assert not [line for line in lines if line.lower().startswith(b"content-length:")]
    body, after = _dechunk(rest)
    assert after == b"" and gzip.decompress(body) == payload


def test_an_http_1_0_answer_is_never_kept_alive():
    """An HTTP/1.0 answer that says ``Connection: keep-alive``: its connection is not reused."""
    backend = ScriptedBackend((b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}", "keep"))
    rig = Rig(upstream=backend)
    for _ in range(3):
        assert rig.call("GET", rig.proxy_url + "/api/tags").body == b"{}"
    assert len(backend.heads) == 3 and backend.connections == 3
    assert rig.upstream.client.stats()["idle"] == 0
