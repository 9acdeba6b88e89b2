"""The proxy over real sockets: streaming, parking edges, errors, and header hygiene."""

from __future__ import annotations

import hashlib
import json
import socket

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from helpers import config_with, in_thread, sleep, start_stack, wait_for
from yieldproxy.sim import expected_embedding

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

    def __init__(self):
        super().__init__()
        self.seen = []

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
            reactor.callLater(0.05, request.channel.transport.abortConnection)
            return NOT_DONE_YET
        request.responseHeaders.addRawHeader(b"x-repeated", b"one")
        request.responseHeaders.addRawHeader(b"x-repeated", b"two")
        request.responseHeaders.setRawHeaders(b"content-type", [b"application/json"])
        return json.dumps(record).encode()


@pytest.fixture
def echo_stack():
    """A proxy in front of the Echo backend."""

    async def start(config=None):
        echo = Echo()
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(echo))
        stack = await start_stack(reactor, config, upstream=f"http://127.0.0.1:{port.getHost().port}")
        stack._ports.append(port)
        stack.echo = echo
        return stack

    return start


# -- streaming -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_streamed_chat_arrives_chunk_by_chunk():
    stack = await start_stack(reactor, chunk_delay=0.15, chunks=5)
    try:
        response = await post(
            stack.proxy_url + "/api/chat",
            {"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.code == 200
        assert response.headers.getRawHeaders("content-type")[0].startswith("application/x-ndjson")
        arrivals = []
        await treq.collect(response, lambda data: arrivals.append((reactor.seconds(), data))).addTimeout(TIMEOUT, reactor)
        lines = b"".join(d for _, d in arrivals).splitlines()
        assert len(lines) == 6 and json.loads(lines[-1])["done"] is True
        # Chunks came as the backend produced them, not all at the end.
        assert len(arrivals) >= 5
        assert arrivals[-1][0] - arrivals[0][0] >= 0.5
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_openai_sse_stream_is_relayed_as_it_comes():
    stack = await start_stack(reactor, chunk_delay=0.1, chunks=4)
    try:
        response = await post(
            stack.proxy_url + "/v1/chat/completions",
            {"model": "llama3.2", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        )
        arrivals = []
        await treq.collect(response, lambda data: arrivals.append((reactor.seconds(), data))).addTimeout(TIMEOUT, reactor)
        text = b"".join(d for _, d in arrivals).decode()
        assert text.rstrip().endswith("data: [DONE]")
        assert len(arrivals) >= 4 and arrivals[-1][0] - arrivals[0][0] >= 0.3
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_parked_stream_is_replayed_whole():
    stack = await start_stack(reactor, chunk_delay=0.01)
    try:
        stack.proxy.state.hold("api")
        pending = post(stack.proxy_url + "/api/generate", {"model": "llama3.2", "prompt": "tell me"})
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
        stack.proxy.state.release("api")
        response = await pending
        assert float(response.headers.getRawHeaders("x-yield-parked-seconds")[0]) > 0
        lines = (await response.content()).splitlines()
        assert json.loads(lines[-1])["done"] is True
    finally:
        await stack.stop()


# -- parking edges ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_disconnected_parked_client_is_never_sent_upstream():
    stack = await start_stack(reactor)
    try:
        stack.proxy.state.hold("api")
        body = json.dumps(embed_body("left early")).encode()
        host, port = stack.proxy_url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
        sock.close()
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 0)
        stack.proxy.state.release("api")
        await sleep(reactor, 0.2)
        assert stack.sim.texts_embedded["left early"] == 0
        assert stack.sim.requests_total["/api/embed"] == 0
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "abandoned"}) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_client_leaving_mid_attempt_is_not_retried():
    stack = await start_stack(reactor, latency=1.0)
    try:
        d = post(stack.proxy_url + "/api/embed", embed_body("impatient"))
        await wait_for(reactor, lambda: stack.sim.in_flight == 1)
        d.cancel()
        await wait_for(reactor, lambda: stack.proxy.replayer.inflight == 0)
        await sleep(reactor, 0.3)
        assert stack.sim.requests_total["/api/embed"] == 1
        assert stack.sample("yieldproxy_retries_total", **{"class": "batch"}) == 0
        assert len(stack.proxy.lot) == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_full_lot_answers_at_once_with_retry_after():
    stack = await start_stack(reactor, config_with(parking={"max_parked": 3}))
    try:
        stack.proxy.state.hold("api", expected_seconds=20)
        parked = [post(stack.proxy_url + "/api/embed", embed_body(f"p{i}")) for i in range(3)]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 3)
        began = reactor.seconds()
        response = await post(stack.proxy_url + "/v1/embeddings", {"model": "all-minilm", "input": "over"})
        assert reactor.seconds() - began < 2
        assert response.code == 503
        assert 19 <= int(response.headers.getRawHeaders("retry-after")[0]) <= 20
        error = (await response.json())["error"]
        assert error["code"] == "queue_full" and "parked queue full" in error["message"]
        stack.proxy.state.release("api")
        for d in parked:
            assert (await d).code == 200
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_hold_bound_gives_a_clean_503():
    stack = await start_stack(reactor, config_with(classes={"batch": {"hold_seconds": 0.3}}))
    try:
        stack.proxy.state.hold("api")
        response = await post(stack.proxy_url + "/api/embed", embed_body())
        assert response.code == 503
        assert response.headers.getRawHeaders("retry-after")
        assert "hold bound" in (await response.json())["error"]
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "expired"}) == 1
        assert stack.sim.requests_total["/api/embed"] == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_caller_max_wait_header():
    stack = await start_stack(reactor)
    try:
        stack.proxy.state.hold("api")
        response = await post(stack.proxy_url + "/api/embed", embed_body(), headers={"X-Yield-Max-Wait": "0.2"})
        assert response.code == 503
        assert "X-Yield-Max-Wait" in (await response.json())["error"]
        bad = await post(stack.proxy_url + "/api/embed", embed_body(), headers={"X-Yield-Max-Wait": "soon"})
        assert bad.code == 400
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_passthrough_routes_are_never_parked():
    stack = await start_stack(reactor)
    try:
        stack.proxy.state.hold("api")
        response = await treq.get(stack.proxy_url + "/api/tags").addTimeout(TIMEOUT, reactor)
        assert response.code == 200
        assert "models" in await response.json()
        assert len(stack.proxy.lot) == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_class_header_makes_a_route_parkable():
    stack = await start_stack(reactor)
    try:
        stack.proxy.state.hold("api")
        d = treq.get(stack.proxy_url + "/api/tags", headers={"X-Yield-Class": "long"}).addTimeout(TIMEOUT, reactor)
        await wait_for(reactor, lambda: stack.proxy.lot.count_by_class().get("long") == 1)
        stack.proxy.state.release("api")
        assert (await d).code == 200
        bad = await treq.get(stack.proxy_url + "/api/tags", headers={"X-Yield-Class": "urgent"})
        assert bad.code == 400
    finally:
        await stack.stop()


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


@pytest_twisted.ensureDeferred
async def test_plain_upstream_500_is_relayed_not_retried(echo_stack):
    stack = await echo_stack()
    try:
        response = await post(stack.proxy_url + "/fail-500", {}, headers={"X-Yield-Class": "batch"})
        assert response.code == 500
        assert (await response.json()) == {"error": "model 'nope' not found"}
        assert len(stack.echo.seen) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_failure_after_the_first_byte_ends_the_stream_in_its_own_form(echo_stack):
    stack = await echo_stack()
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


@pytest_twisted.ensureDeferred
async def test_oversized_body_gets_413(echo_stack):
    stack = await echo_stack(config_with(proxy={"max_body_bytes": 1000}))
    try:
        response = await treq.post(stack.proxy_url + "/v1/embeddings", data=b"x" * 5000).addTimeout(TIMEOUT, reactor)
        assert response.code == 413
        assert (await response.json())["error"]["code"] == "too_large"
        assert stack.echo.seen == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_headers_hop_by_hop_stripped_repeated_kept(echo_stack):
    stack = await echo_stack()
    try:
        response = await treq.get(
            stack.proxy_url + "/api/show?x=1&y=%20",
            headers={
                "X-Multi": ["a", "b"],
                "Connection": "keep-alive, X-Secret-Hop",
                "X-Secret-Hop": "drop me",
                "Keep-Alive": "timeout=5",
                "Proxy-Authorization": "Basic abc",
                "X-Yield-Max-Wait": "5",
                "Authorization": "Bearer user-token",
            },
        ).addTimeout(TIMEOUT, reactor)
        record = await response.json()
        headers = record["headers"]
        assert record["uri"] == "/api/show?x=1&y=%20"
        assert headers["x-multi"] == ["a", "b"]
        assert headers["authorization"] == ["Bearer user-token"]
        for hop in ("x-secret-hop", "keep-alive", "proxy-authorization", "x-yield-max-wait"):
            assert hop not in headers
        assert headers["host"] == [stack.proxy.upstream.url.removeprefix("http://")]
        assert response.headers.getRawHeaders("x-repeated") == ["one", "two"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_no_cookies_shared_between_callers(echo_stack):
    stack = await echo_stack()
    try:
        first = await treq.get(stack.proxy_url + "/set-cookie").addTimeout(TIMEOUT, reactor)
        assert first.headers.getRawHeaders("set-cookie") == ["session=alice; Path=/"]
        await first.content()
        second = await treq.get(stack.proxy_url + "/other", persistent=False).addTimeout(TIMEOUT, reactor)
        record = await second.json()
        assert "cookie" not in record["headers"]
    finally:
        await stack.stop()


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
