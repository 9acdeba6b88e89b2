"""The proxy: streaming, parking edges, errors, and header hygiene.

Most run on a Clock, the callers connected in memory to the proxy
listener's own site (``tests/inmemory.py``): a chunk arrives at the clock time
the backend sent it, a hold bound ends at exactly its second, and "the
backend saw nothing" is checked after the clock has moved past every timer.
Real sockets remain where the wire is the subject: a refused connection, a
connection cut mid-answer, a 2 MiB body through TCP, a raw request line, and
the real ``ollama`` client.
"""

from __future__ import annotations

import hashlib
import json
import socket

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import CancelledError
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import Clock
from twisted.web.client import ResponseNeverReceived
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from helpers import config_with, declaring, in_thread, start_stack
from inmemory import Rig, answered
from yieldproxy.tools.sim import expected_embedding, expected_reply

TIMEOUT = 30


def embed_body(text: str = "hello") -> dict:
    return {"model": "all-minilm", "input": [text]}


def post(url: str, body, headers=None, timeout=TIMEOUT):
    """POST JSON on a fresh connection; a Deferred that fails after ``timeout``."""
    return treq.post(url, json=body, headers=headers, persistent=False).addTimeout(timeout, reactor)


# -- a backend that echoes what it received, for header and body checks -------------


class Echo(Resource):
    """Answers with what the proxy sent: method, path, headers, body size and hash."""

    isLeaf = True

    def __init__(self, clock=reactor):
        super().__init__()
        self.seen = []
        self._clock = clock

    def render(self, request):
        request.content.seek(0)
        body = request.content.read()
        record = {
            "method": request.method.decode(),
            "uri": request.uri.decode(),
            "headers": {k.decode().lower(): [v.decode() for v in vs] for k, vs in request.requestHeaders.getAllRawHeaders()},
            "size": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }
        self.seen.append(record)
        if request.path == b"/set-cookie":
            request.responseHeaders.addRawHeader(b"set-cookie", b"session=alice; Path=/")
        if request.path == b"/fail-500":
            request.setResponseCode(500)
            return json.dumps({"error": "model 'nope' not found"}).encode()
        if request.path == b"/break-mid-body":
            request.responseHeaders.setRawHeaders(b"content-type", [b"application/x-ndjson"])
            request.write(b'{"part": 1}\n')
            self._clock.callLater(0.05, request.channel.transport.abortConnection)
            return NOT_DONE_YET
        request.responseHeaders.addRawHeader(b"x-repeated", b"one")
        request.responseHeaders.addRawHeader(b"x-repeated", b"two")
        request.responseHeaders.setRawHeaders(b"content-type", [b"application/json"])
        return json.dumps(record).encode()


@pytest.fixture
def echo_stack():
    """A proxy in front of the Echo backend, over real sockets."""

    async def start(config=None):
        echo = Echo()
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(echo))
        stack = await start_stack(reactor, config, upstream=f"http://127.0.0.1:{port.getHost().port}")
        stack._ports.append(port)
        stack.echo = echo
        return stack

    return start


def echo_rig(config=None) -> tuple[Rig, Echo]:
    """A proxy in front of the Echo backend, both on one Clock, in memory."""
    clock = Clock()
    echo = Echo(clock)
    return Rig(config, upstream=echo, reactor=clock), echo


def arrivals_of(rig: Rig, d, seconds: float) -> tuple[object, list]:
    """The response of ``d`` and its body's pieces with the clock time each arrived, over ``seconds``."""
    response = rig.result(d)
    arrivals: list = []
    done = treq.collect(response, lambda data: arrivals.append((rig.clock.seconds(), data)))
    rig.run(seconds)
    rig.result(done)
    return response, arrivals


# -- streaming -------------------------------------------------------------------


def test_streamed_chat_arrives_chunk_by_chunk():
    rig = Rig(chunk_delay=0.15, chunks=5)
    d = rig.open(
        "POST", rig.proxy_url + "/api/chat",
        json={"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}]},
    )
    response, arrivals = arrivals_of(rig, d, 1.0)
    assert response.code == 200
    assert response.headers.getRawHeaders("content-type")[0].startswith("application/x-ndjson")
    lines = b"".join(d for _, d in arrivals).splitlines()
    assert len(lines) == 6 and json.loads(lines[-1])["done"] is True
    # Each line came when the backend produced it (one every 0.15 s), not all at the end.
    assert [round(t, 6) for t, _ in arrivals] == [0.0, 0.15, 0.3, 0.45, 0.6, 0.75]
    assert [data.count(b"\n") for _, data in arrivals] == [1] * 6
    assert rig.clock.getDelayedCalls() == []


def test_openai_sse_stream_is_relayed_as_it_comes():
    rig = Rig(chunk_delay=0.1, chunks=4)
    d = rig.open(
        "POST", rig.proxy_url + "/v1/chat/completions",
        json={"model": "llama3.2", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    _, arrivals = arrivals_of(rig, d, 1.0)
    text = b"".join(d for _, d in arrivals).decode()
    assert text.rstrip().endswith("data: [DONE]")
    # Each event came when the backend produced it (one every 0.1 s), the closing ones with the last.
    times = [round(t, 6) for t, _ in arrivals]
    assert sorted(set(times)) == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert rig.clock.getDelayedCalls() == []


def test_parked_stream_is_replayed_whole():
    rig = Rig(chunk_delay=0.01)
    rig.proxy.state.hold("api")
    pending = rig.post("/api/generate", {"model": "llama3.2", "prompt": "tell me"})
    assert len(rig.proxy.lot) == 1
    rig.run(2.5)
    assert not answered(pending) and rig.sim.requests_total["/api/generate"] == 0
    rig.proxy.state.release("api")
    rig.run(1)
    response = rig.result(pending)
    assert float(response.header("x-yield-parked-seconds")[0]) == 2.5
    lines = response.body.splitlines()
    assert json.loads(lines[-1])["done"] is True
    assert "".join(json.loads(line)["response"] for line in lines) == "".join(expected_reply("tell me", "llama3.2"))
    assert rig.clock.getDelayedCalls() == []


# -- parking edges ------------------------------------------------------------------


def test_disconnected_parked_client_is_never_sent_upstream():
    rig = Rig()
    rig.proxy.state.hold("api")
    d = rig.post("/api/embed", embed_body("left early"))
    assert len(rig.proxy.lot) == 1
    d.cancel()  # the caller closes its connection
    rig.turn()
    assert len(rig.proxy.lot) == 0
    rig.proxy.state.release("api")
    rig.run(60)
    assert rig.sim.texts_embedded["left early"] == 0
    assert rig.sim.requests_total["/api/embed"] == 0
    assert rig.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "abandoned"}) == 1
    assert rig.clock.getDelayedCalls() == []
    with pytest.raises(ResponseNeverReceived) as left:
        rig.result(d)
    assert left.value.reasons[0].check(CancelledError)


def test_client_leaving_mid_attempt_is_not_retried():
    rig = Rig(latency=1.0)
    d = rig.post("/api/embed", embed_body("impatient"))
    assert rig.sim.in_flight == 1
    rig.run(0.5)
    d.cancel()
    rig.turn()
    assert rig.proxy.replayer.inflight == 0
    rig.run(300)  # past the sim's latency, any backoff and the attempt's timeout
    assert rig.sim.requests_total["/api/embed"] == 1
    assert rig.sample("yieldproxy_retries_total", **{"class": "batch"}) == 0
    assert len(rig.proxy.lot) == 0
    assert rig.clock.getDelayedCalls() == []
    with pytest.raises(ResponseNeverReceived) as left:
        rig.result(d)
    assert left.value.reasons[0].check(CancelledError)


def test_full_lot_answers_at_once_with_retry_after():
    rig = Rig(config_with(parking={"max_parked": 3}))
    rig.proxy.state.hold("api", expected_seconds=20)
    parked = [rig.post("/api/embed", embed_body(f"p{i}")) for i in range(3)]
    assert len(rig.proxy.lot) == 3
    # Answered without the clock moving at all.
    response = rig.result(rig.post("/v1/embeddings", {"model": "all-minilm", "input": "over"}))
    assert response.code == 503
    assert int(response.header("retry-after")[0]) == 20
    error = response.json()["error"]
    assert error["code"] == "queue_full" and "parked queue full" in error["message"]
    rig.proxy.state.release("api")
    rig.turn()
    for d in parked:
        assert rig.result(d).code == 200


def test_hold_bound_gives_a_clean_503():
    rig = Rig(config_with(classes={"batch": {"hold_seconds": 0.3}}))
    rig.proxy.state.hold("api")
    d = rig.post("/api/embed", embed_body())
    rig.run(0.299)
    assert not answered(d) and len(rig.proxy.lot) == 1
    rig.run(0.001)
    response = rig.result(d)
    assert response.code == 503
    assert response.header("retry-after")
    assert "hold bound" in response.json()["error"]
    assert rig.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "expired"}) == 1
    assert rig.sim.requests_total["/api/embed"] == 0
    assert len(rig.proxy.lot) == 0


def test_caller_max_wait_header():
    rig = Rig()
    rig.proxy.state.hold("api")
    d = rig.post("/api/embed", embed_body(), headers={"X-Yield-Max-Wait": "0.2"})
    rig.run(0.199)
    assert not answered(d)
    rig.run(0.001)
    response = rig.result(d)
    assert response.code == 503
    assert "X-Yield-Max-Wait" in response.json()["error"]
    bad = rig.result(rig.post("/api/embed", embed_body(), headers={"X-Yield-Max-Wait": "soon"}))
    assert bad.code == 400
    assert rig.sim.requests_total["/api/embed"] == 0


def test_passthrough_routes_are_never_parked():
    rig = Rig()
    rig.proxy.state.hold("api")
    response = rig.call("GET", rig.proxy_url + "/api/tags")
    assert response.code == 200
    assert "models" in response.json()
    assert len(rig.proxy.lot) == 0


def test_class_header_makes_a_route_parkable():
    rig = Rig()
    rig.proxy.state.hold("api")
    d = rig.request("GET", rig.proxy_url + "/api/tags", headers={"X-Yield-Class": "long"})
    assert rig.proxy.lot.count_by_class().get("long") == 1
    assert not answered(d)
    rig.proxy.state.release("api")
    rig.turn()
    assert rig.result(d).code == 200
    bad = rig.call("GET", rig.proxy_url + "/api/tags", headers={"X-Yield-Class": "urgent"})
    assert bad.code == 400


# -- upstream failures --------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_unreachable_upstream_gets_a_clear_502_in_each_api_shape():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    dead = free.getsockname()[1]
    free.close()
    config = config_with(upstream={"max_attempts": 2, "retry_backoff_seconds": 0.05})
    stack = await start_stack(reactor, config, upstream=f"http://127.0.0.1:{dead}")
    try:
        ollama_style = await post(stack.proxy_url + "/api/embed", embed_body())
        assert ollama_style.code == 502
        message = (await ollama_style.json())["error"]
        assert f"127.0.0.1:{dead}" in message and "refused" in message
        openai_style = await post(stack.proxy_url + "/v1/embeddings", {"model": "m", "input": "x"})
        error = (await openai_style.json())["error"]
        assert openai_style.code == 502 and error["code"] == "upstream_error" and "refused" in error["message"]
        tags = await treq.get(stack.proxy_url + "/api/tags").addTimeout(TIMEOUT, reactor)
        assert tags.code == 502
    finally:
        await stack.stop()


def test_plain_upstream_500_is_relayed_not_retried():
    rig, echo = echo_rig(declaring("/fail-500"))
    response = rig.result(rig.post("/fail-500", {}, headers={"X-Yield-Class": "batch"}))
    assert response.code == 500
    assert response.json() == {"error": "model 'nope' not found"}
    rig.run(300)  # past any backoff: nothing goes round again
    assert len(echo.seen) == 1
    assert rig.sample("yieldproxy_retries_total", **{"class": "batch"}) == 0


@pytest_twisted.ensureDeferred
async def test_failure_after_the_first_byte_ends_the_stream_in_its_own_form(echo_stack):
    stack = await echo_stack(declaring("/break-mid-body"))
    try:
        response = await post(stack.proxy_url + "/break-mid-body", {}, headers={"X-Yield-Class": "interactive"})
        lines = (await response.content()).splitlines()
        assert json.loads(lines[0]) == {"part": 1}
        assert "upstream failed mid-answer" in json.loads(lines[-1])["error"]
        # Never silently replayed: the backend saw it once.
        assert len(stack.echo.seen) == 1
    finally:
        await stack.stop()


# -- bodies and headers ----------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_large_body_is_forwarded_intact(echo_stack):
    stack = await echo_stack()
    try:
        body = bytes(range(256)) * 8192  # 2 MiB
        response = await treq.post(stack.proxy_url + "/api/embed", data=body).addTimeout(TIMEOUT, reactor)
        record = await response.json()
        assert record["size"] == len(body)
        assert record["sha256"] == hashlib.sha256(body).hexdigest()
    finally:
        await stack.stop()


def test_oversized_body_gets_413():
    rig, echo = echo_rig(config_with(proxy={"max_body_bytes": 1000}))
    response = rig.call("POST", rig.proxy_url + "/v1/embeddings", data=b"x" * 5000)
    assert response.code == 413
    assert response.json()["error"]["code"] == "too_large"
    assert echo.seen == []


def test_headers_hop_by_hop_stripped_repeated_kept():
    rig, echo = echo_rig()
    response = rig.call(
        "GET", rig.proxy_url + "/v1/models/x?x=1&y=%20",
        headers={
            "X-Multi": ["a", "b"],
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "drop me",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic abc",
            "X-Yield-Max-Wait": "5",
            "Authorization": "Bearer user-token",
        },
    )
    record = response.json()
    headers = record["headers"]
    assert record["uri"] == "/v1/models/x?x=1&y=%20"
    assert headers["x-multi"] == ["a", "b"]
    assert headers["authorization"] == ["Bearer user-token"]
    for hop in ("x-secret-hop", "keep-alive", "proxy-authorization", "x-yield-max-wait"):
        assert hop not in headers
    assert headers["host"] == [rig.proxy.upstream.url.removeprefix("http://")]
    assert response.header("x-repeated") == ["one", "two"]


def test_no_cookies_shared_between_callers():
    rig, echo = echo_rig(declaring("/set-cookie", "/other"))
    first = rig.call("GET", rig.proxy_url + "/set-cookie")
    assert first.header("set-cookie") == ["session=alice; Path=/"]
    second = rig.call("GET", rig.proxy_url + "/other")
    assert "cookie" not in second.json()["headers"]
    assert len(echo.seen) == 2


@pytest_twisted.ensureDeferred
async def test_absolute_uri_never_reaches_another_host(echo_stack):
    stack = await echo_stack()
    try:
        host, port = stack.proxy_url.removeprefix("http://").split(":")

        def raw():
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"GET http://example.invalid/api/tags HTTP/1.1\r\nHost: example.invalid\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                return data

        answer = await in_thread(reactor, raw, timeout=TIMEOUT)
        assert answer.startswith(b"HTTP/1.1 400")
        assert stack.echo.seen == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_ollama_client_through_the_proxy_gets_the_backend_vectors():
    import ollama

    stack = await start_stack(reactor)
    try:
        def call():
            client = ollama.Client(host=stack.proxy_url, timeout=30)
            return [list(v) for v in client.embed(model="all-minilm", input=["a", "b"]).embeddings]

        vectors = await in_thread(reactor, call, timeout=TIMEOUT)
        assert vectors == [expected_embedding("a"), expected_embedding("b")]
    finally:
        await stack.stop()
