"""The upstream hop on the lean client (upstream/attempt.py on edge/h1client.py): what is about the wire.

A request reaches the upstream more than once only as a retry the proxy
counts: the client never resends on its own, not even an idempotent request
on a pooled connection that died under it (``twisted.web.client.Agent``
did, silently, for a GET).
"""

from __future__ import annotations

import json
import socket

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint

from helpers import config_with, in_thread, start_stack
from rawhttp import ScriptedBackend, exchange, port_of, recording_stack, request_bytes

TIMEOUT = 30


def request_lines(backend) -> list[bytes]:
    return [head.split(b"\r\n")[0] for head in backend.heads]


@pytest_twisted.ensureDeferred
async def test_a_pooled_connection_dying_under_a_request_is_a_counted_retry_never_a_silent_duplicate():
    stack = await recording_stack(config_with(upstream={"retry_backoff_seconds": 0.05}))
    stack.echo.drop_reused = True
    port = port_of(stack.proxy_url)

    def call(method: bytes, target: bytes, headers=(), body=b""):
        return in_thread(reactor, exchange, port, request_bytes(method, target, list(headers), body), 20, timeout=TIMEOUT)

    try:
        # Passthrough gets one attempt: the GET that meets the dead connection is a 502, sent once.
        assert (await call(b"GET", b"/api/tags")).status == 200
        second = await call(b"GET", b"/api/tags")
        assert second.status == 502
        assert "closed the connection before answering" in json.loads(second.body)["error"]
        assert request_lines(stack.echo) == [b"GET /api/tags HTTP/1.1"] * 2
        # A parked class: the same failure is retried, and the duplicate it sends is counted.
        batch = [(b"X-Yield-Class", b"batch"), (b"Content-Type", b"application/json")]
        body = json.dumps({"model": "all-minilm", "input": "x"}).encode()
        assert (await call(b"POST", b"/api/embed", batch, body)).status == 200
        answer = await call(b"POST", b"/api/embed", batch, body)
        assert answer.status == 200
        assert request_lines(stack.echo)[2:] == [b"POST /api/embed HTTP/1.1"] * 3
        assert stack.sample("yieldproxy_upstream_failures_total", **{"class": "batch", "reason": "reset"}) == 1
        assert stack.sample("yieldproxy_retries_total", **{"class": "batch"}) == 1
    finally:
        await stack.stop()


def read_to_the_end(port: int, request: bytes, timeout: float = 20.0) -> tuple[bytes, str]:
    """Send ``request`` on a fresh connection and read until it ends: what came, and how it ended."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = b""
    try:
        sock.sendall(request)
        while True:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                return data, "reset"
            if not part:
                return data, "close"
            data += part
    finally:
        sock.close()


@pytest_twisted.ensureDeferred
async def test_a_passthrough_answer_cut_mid_chunk_reaches_the_client_with_its_status_line_then_a_clean_close():
    """The upstream sends a chunked answer's head and half a chunk, then closes (or resets): the
    client gets the status line and what came, then a clean close (no last chunk: it knows the
    answer is cut), never a bare reset that loses the status line still in the proxy's buffers."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    half = b"40\r\n" + b'{"models":[{"name":"all-minilm"'
    for then in ("close", "abort_soon"):
        backend = ScriptedBackend((head + half, then))
        listening = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(backend)
        stack = await start_stack(reactor, config_with(), upstream=f"http://127.0.0.1:{listening.getHost().port}")
        stack._ports.append(listening)
        try:
            for _ in range(5):
                data, ended = await in_thread(
                    reactor, read_to_the_end, port_of(stack.proxy_url), request_bytes(b"GET", b"/api/tags"),
                    timeout=TIMEOUT,
                )
                assert ended == "close", (then, data)
                assert data.startswith(b"HTTP/1.1 200 OK\r\n"), (then, data)
                # What came, re-chunked as it arrived, and no last chunk.
                assert data.endswith(b'\r\n1f\r\n{"models":[{"name":"all-minilm"\r\n'), (then, data)
                assert not data.endswith(b"0\r\n\r\n")
        finally:
            await stack.stop()
