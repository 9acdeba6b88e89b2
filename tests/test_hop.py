"""The upstream hop on the lean client (forward.py on h1client.py): what is about the wire.

A request reaches the upstream more than once only as a retry the proxy
counts: the client never resends on its own, not even an idempotent request
on a pooled connection that died under it (``twisted.web.client.Agent``
did, silently, for a GET).
"""

from __future__ import annotations

import json

import pytest_twisted
from twisted.internet import reactor

from helpers import config_with, in_thread
from rawhttp import exchange, port_of, recording_stack, request_bytes

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
