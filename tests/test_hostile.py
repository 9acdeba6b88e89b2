"""Hostile clients over real sockets: what a client can send, and what it can never make the proxy do.

Requests are written byte for byte on raw sockets (in threads, so the
reactor keeps serving), and the upstream is a :class:`RecordingBackend` that
keeps the exact bytes the proxy sent it: a header that was not forwarded is
provably absent, not merely unparsed.  "Nothing was forwarded" is proved by
a request sent after, which reaches the upstream alone
(:func:`assert_nothing_forwarded`), not by a sleep.

The listener's timeouts are checked twice: over a real socket that they
happen, and on a Clock, with the bytes written in memory to the proxy
listener's own site (``tests/inmemory.py``), that they happen at exactly
their second.
"""

from __future__ import annotations

import hmac
import json
import socket
import time

import attrs
import httpx
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import config_with, declaring, in_thread, start_stack, wait_for
from inmemory import Rig
from rawhttp import (
    LogCapture,
    RawClient,
    RecordingBackend,
    assert_nothing_forwarded,
    counter_total,
    exchange,
    listen_site,
    parse_response,
    port_of,
    recording_stack,
    request_bytes,
)
from yieldproxy.admin import api as admin_module

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 30
EMBED = json.dumps({"model": "all-minilm", "input": "hello"}).encode()


def raw(stack, data: bytes, timeout: float = 10.0):
    """Send ``data`` to the proxy on a fresh connection (in a thread); one answer."""
    return in_thread(reactor, exchange, port_of(stack.proxy_url), data, timeout, timeout=TIMEOUT)


def assert_json_error(response, status: int, api: str = "ollama") -> dict:
    assert response.status == status, response.raw[:300]
    assert response.header(b"content-type").startswith(b"application/json")
    body = response.json()
    if api == "openai":
        assert set(body["error"]) >= {"message", "type", "code"}
    else:
        assert isinstance(body["error"], str) and body["error"]
    return body


# -- where requests can go ------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_absolute_uri_and_connect_never_reach_another_host():
    """Absolute-form targets get 400, CONNECT gets 405; a decoy host they name sees no connection."""
    stack = await recording_stack()
    decoy = socket.socket()
    decoy.bind(("127.0.0.1", 0))
    decoy.listen(16)
    decoy.setblocking(False)
    decoy_port = decoy.getsockname()[1]
    target = b"127.0.0.1:%d" % decoy_port
    try:
        absolute = await raw(stack, request_bytes(b"GET", b"http://" + target + b"/api/tags", [(b"Host", target)]))
        assert_json_error(absolute, 400)
        absolute_v1 = await raw(stack, request_bytes(b"POST", b"http://" + target + b"/v1/embeddings", body=b"{}"))
        assert absolute_v1.status == 400
        connect = await raw(stack, request_bytes(b"CONNECT", target, [(b"Host", target)]))
        assert_json_error(connect, 405)
        connect_path = await raw(stack, request_bytes(b"CONNECT", b"/api/tags"))
        assert_json_error(connect_path, 405)
        # A Host header naming the decoy changes nothing: the request goes to the upstream.
        hosted = await raw(stack, request_bytes(b"GET", b"/api/tags", [(b"Host", target)]))
        assert hosted.status == 200
        # A path that looks like a network-path reference is a path (its slashes collapsed,
        # proxy/target.py), one Ollama has no route for: its own 404, given at once.
        scheme_relative = await raw(stack, request_bytes(b"GET", b"//" + target + b"/api/tags"))
        assert (scheme_relative.status, scheme_relative.body) == (404, b"404 page not found")
        assert len(stack.echo.heads) == 1
        upstream_host = stack.proxy.upstream.url.removeprefix("http://").encode()
        assert stack.echo.header_values(0, b"host") == [upstream_host]
        with pytest.raises(BlockingIOError):
            decoy.accept()
    finally:
        decoy.close()
        await stack.stop()


# -- header injection -------------------------------------------------------------------


@pytest.mark.parametrize(
    "header_block",
    [
        b"X-Note: a\nX-Injected: 1",  # bare LF inside a value
        b"X-Note: a\rX-Injected: 1",  # bare CR inside a value
        b"X-Note: a\x00X-Injected: 1",  # NUL inside a value
        b"X-Note : a",  # space before the colon (RFC 9112 5.1: reject)
        b"X Note: a",  # not a token
        b"X-Note",  # no colon
    ],
    ids=["bare-lf", "bare-cr", "nul", "space-before-colon", "space-in-name", "no-colon"],
)
@pytest_twisted.ensureDeferred
async def test_malformed_header_lines_are_refused_not_forwarded(header_block):
    stack = await recording_stack()
    try:
        data = b"POST /api/embed HTTP/1.1\r\nHost: x\r\n" + header_block + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(EMBED), EMBED)
        response = await raw(stack, data)
        assert_json_error(response, 400)
        assert response.header(b"connection") == b"close"
        await assert_nothing_forwarded(stack)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_crlf_cannot_inject_a_header_or_a_request_upstream():
    """Folded lines stay one value, encoded CRLF stays encoded, a raw one in the target is refused."""
    stack = await recording_stack()
    try:
        folded = await raw(stack, request_bytes(b"GET", b"/api/tags", [(b"X-Note", b"a\r\n X-Injected: 1")]))
        assert folded.status in (200, 400)
        encoded = await raw(stack, request_bytes(b"GET", b"/api/tags?q=%0d%0aX-Injected:%201%0d%0a"))
        assert encoded.status == 200
        in_target = await raw(stack, b"GET /api/tags?q=\nX-Injected:1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert_json_error(in_target, 400)
        smuggled_request = await raw(
            stack, b"GET /api/tags HTTP/1.1\r\nHost: x\r\nX-Note: a\nGET /api/ps HTTP/1.1\r\n\r\n"
        )
        assert_json_error(smuggled_request, 400)
        for head in stack.echo.heads:
            lines = head.split(b"\r\n")
            assert not any(line.lower().startswith(b"x-injected") for line in lines), head
            assert all(b"\n" not in line and b"\r" not in line for line in lines)
            assert lines[0].startswith(b"GET /api/tags")
        encoded_line = [h for h in stack.echo.heads if b"%0d%0a" in h]
        assert encoded_line and encoded_line[0].split(b"\r\n")[0] == b"GET /api/tags?q=%0d%0aX-Injected:%201%0d%0a HTTP/1.1"
    finally:
        await stack.stop()


# -- framing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [
        [(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked")],
        [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"5")],
        [(b"Content-Length", b"5"), (b"Content-Length", b"6")],
        [(b"Content-Length", b"5"), (b"Content-Length", b"5")],
        [(b"Content-Length", b"5, 5")],
        [(b"Content-Length", b"+5")],
        [(b"Content-Length", b"-1")],
        [(b"Transfer-Encoding", b"gzip, chunked")],
        [(b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"chunked")],
        [(b"Transfer-Encoding", b"xchunked")],
    ],
    ids=["cl-te", "te-cl", "cl-cl-differ", "cl-cl-same", "cl-list", "cl-plus", "cl-negative", "te-gzip-chunked", "te-te", "te-unknown"],
)
@pytest_twisted.ensureDeferred
async def test_ambiguous_body_framing_is_refused_and_never_forwarded(framing):
    """Content-Length/Transfer-Encoding that could be read two ways: 400, closed, nothing upstream."""
    stack = await recording_stack()
    try:
        # The body is a complete chunked body that also hides a second request.
        smuggle = b"0\r\n\r\nGET /api/ps HTTP/1.1\r\nHost: x\r\n\r\n"
        data = request_bytes(b"POST", b"/api/embed", framing, smuggle)
        response = await raw(stack, data)
        assert_json_error(response, 400)
        assert response.header(b"connection") == b"close"
        await assert_nothing_forwarded(stack)
        assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chunked_body_is_forwarded_with_a_length_of_its_own():
    """A well-formed chunked body reaches the upstream re-framed: Content-Length, no Transfer-Encoding."""
    stack = await recording_stack()
    try:
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(EMBED), EMBED)
        response = await raw(stack, request_bytes(b"POST", b"/api/embed", [(b"Transfer-Encoding", b"chunked")], chunked))
        assert response.status == 200
        assert stack.echo.bodies == [EMBED]
        assert stack.echo.header_values(0, b"content-length") == [b"%d" % len(EMBED)]
        assert stack.echo.header_values(0, b"transfer-encoding") == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_form_bodies_are_forwarded_unparsed():
    """Twisted parses form uploads into request.args by default; the proxy forwards them as bytes.

    (On a route of the upstream's own: on Ollama's model routes such bodies get its 400 at once.)"""
    stack = await recording_stack(declaring("/upload"))
    try:
        body = b"--x\r\nnot really multipart"
        response = await raw(
            stack, request_bytes(b"POST", b"/upload", [(b"Content-Type", b"multipart/form-data; boundary=x")], body)
        )
        assert response.status == 200
        form = b"a=1&" * 1000
        response = await raw(
            stack, request_bytes(b"POST", b"/upload", [(b"Content-Type", b"application/x-www-form-urlencoded")], form)
        )
        assert response.status == 200
        assert stack.echo.bodies == [body, form]
    finally:
        await stack.stop()


# -- oversized bodies -----------------------------------------------------------------------


def _recording_requests(site):
    """Wrap the site's request class to see every request's body buffer."""
    seen = []
    base = site.requestFactory

    class Recorded(base):
        max_content = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

        def handleContentChunk(self, data):
            super().handleContentChunk(data)
            if self.content is not None:  # None once the request is finished
                self.max_content = max(self.max_content, self.content.tell())

    site.requestFactory = Recorded
    return seen


async def _own_listener(stack, **site_attrs):
    """A second proxy listener on the stack's app, with its site at hand."""
    site = stack.proxy.proxy_app.site()
    for name, value in site_attrs.items():
        setattr(site, name, value)
    listening, port = await listen_site(site)
    stack._ports.append(listening)
    return site, port


@pytest_twisted.ensureDeferred
async def test_declared_oversized_body_gets_413_before_it_is_sent():
    """200 MB announced: 413 at once, no 100 Continue, nothing buffered, the connection closed."""
    limit = 1024 * 1024
    stack = await recording_stack(config_with(proxy={"max_body_bytes": limit}))
    try:
        site, port = await _own_listener(stack)
        seen = _recording_requests(site)
        head = request_bytes(b"POST", b"/v1/embeddings", [(b"Content-Length", b"%d" % (200 * 1024 * 1024))])

        def client(expect_continue: bool):
            c = RawClient(port)
            try:
                extra = b"Expect: 100-continue\r\n" if expect_continue else b""
                c.send(head.replace(b"\r\n\r\n", b"\r\n" + extra + b"\r\n", 1) if extra else head)
                answer = c.response(10)
                # Keep sending: the proxy reads and drops it, then closes.
                sent = 0
                for _ in range(64):
                    if not c.send(b"x" * 65536):
                        break
                    sent += 65536
                return answer, c.wait_closed(10), sent
            finally:
                c.close()

        for expect in (False, True):
            answer, closed, _ = await in_thread(reactor, client, expect, timeout=TIMEOUT)
            body = assert_json_error(answer, 413, "openai")
            assert body["error"]["code"] == "too_large"
            assert answer.header(b"connection") == b"close"
            assert closed
        assert all(r.max_content == 0 for r in seen) and len(seen) == 2
        assert stack.echo.heads == []
        assert counter_total(stack, "yieldproxy_rejected", reason="too_large") == 2
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_chunked_oversized_body_gets_413_before_it_ends():
    """No length announced: 413 as soon as the limit is passed, without waiting for the last chunk."""
    limit = 256 * 1024
    stack = await recording_stack(config_with(proxy={"max_body_bytes": limit}))
    try:
        site, port = await _own_listener(stack)
        seen = _recording_requests(site)

        def client():
            c = RawClient(port)
            try:
                c.send(request_bytes(b"POST", b"/api/embed", [(b"Transfer-Encoding", b"chunked")]))
                chunk = b"%x\r\n%s\r\n" % (65536, b"y" * 65536)
                for _ in range(8):  # 512 KiB, and never the closing chunk
                    c.send(chunk)
                return c.response(10), c.wait_closed(10)
            finally:
                c.close()

        answer, closed = await in_thread(reactor, client, timeout=TIMEOUT)
        assert_json_error(answer, 413)
        assert closed
        assert seen and max(r.max_content for r in seen) <= limit
        assert stack.echo.heads == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_real_client_sending_200_mb_reads_the_413():
    """httpx streams a 200 MB body without waiting: it still gets the 413, not a reset."""
    stack = await recording_stack(config_with(proxy={"max_body_bytes": 1024 * 1024}))
    try:
        site, port = await _own_listener(stack)
        seen = _recording_requests(site)
        size = 200 * 1024 * 1024

        def chunks():
            block = b"z" * (1024 * 1024)
            for _ in range(size // len(block)):
                yield block

        def post():
            with httpx.Client(timeout=30) as client:
                response = client.post(
                    f"http://127.0.0.1:{port}/api/embed", content=chunks(),
                    headers={"content-length": str(size), "content-type": "application/json"},
                )
                return response.status_code, response.json()

        status, body = await in_thread(reactor, post, timeout=TIMEOUT)
        assert status == 413 and "max_body_bytes" in body["error"]
        assert all(r.max_content == 0 for r in seen)
        assert stack.echo.heads == []
    finally:
        await stack.stop()


# -- header limits ------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_too_many_headers_get_431():
    stack = await recording_stack()
    try:
        many = [(b"X-H%d" % i, b"v") for i in range(150)]
        response = await raw(stack, request_bytes(b"POST", b"/v1/embeddings", many, EMBED))
        body = assert_json_error(response, 431, "openai")
        assert body["error"]["code"] == "headers_too_large" and "headers" in body["error"]["message"]
        assert response.header(b"connection") == b"close"
        # Under the limit, the same request goes through.
        response = await raw(stack, request_bytes(b"POST", b"/v1/embeddings", many[:50], EMBED))
        assert response.status == 200
        assert len(stack.echo.heads) == 1
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_oversized_headers_get_431_and_long_targets_414():
    stack = await recording_stack()
    try:
        one_huge = await raw(stack, request_bytes(b"GET", b"/api/tags", [(b"X-Big", b"a" * 20000)]))
        assert_json_error(one_huge, 431)
        many_big = await raw(stack, request_bytes(b"GET", b"/api/tags", [(b"X-B%d" % i, b"b" * 1000) for i in range(20)]))
        assert_json_error(many_big, 431)
        cookie = await raw(stack, request_bytes(b"GET", b"/api/tags", [(b"Cookie", b"c=" + b"d" * 17000)]))
        assert_json_error(cookie, 431)
        long_target = await raw(stack, request_bytes(b"GET", b"/api/tags?" + b"q" * 20000))
        assert_json_error(long_target, 414)
        # A header block that never ends is cut at the limit, not buffered on.
        def endless():
            c = RawClient(port_of(stack.proxy_url))
            try:
                c.send(b"GET /api/tags HTTP/1.1\r\nX-Endless: ")
                for _ in range(40):
                    if not c.send(b"e" * 1024):
                        break
                return c.response(10)
            finally:
                c.close()

        assert_json_error(await in_thread(reactor, endless, timeout=TIMEOUT), 431)
        assert stack.echo.heads == []
    finally:
        await stack.stop()


# -- callers stay apart --------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_one_callers_cookies_and_auth_never_reach_another():
    """Two callers share the proxy's pooled upstream connections, never each other's credentials."""
    stack = await recording_stack(declaring("/set-cookie"))
    try:
        alice = [(b"Authorization", b"Bearer alice-secret"), (b"Cookie", b"session=alice")]
        port = port_of(stack.proxy_url)

        def conversation():
            a = RawClient(port)
            b = RawClient(port)
            try:
                answers = []
                for i in range(3):
                    a.send(request_bytes(b"GET", b"/set-cookie", alice))
                    answers.append(("alice", a.response()))
                    b.send(request_bytes(b"GET", b"/set-cookie"))
                    answers.append(("bob", b.response()))
                return answers
            finally:
                a.close()
                b.close()

        answers = await in_thread(reactor, conversation, timeout=TIMEOUT)
        assert [r.status for _, r in answers] == [200] * 6
        # Each answer's cookie is the one set for that very request.
        for who, response in answers:
            n = response.json()["n"]
            assert response.headers[b"set-cookie"] == [b"session=owner-%d; Path=/" % n]
        for index, head in enumerate(stack.echo.heads):
            auth = stack.echo.header_values(index, b"authorization")
            cookie = stack.echo.header_values(index, b"cookie")
            if index % 2 == 0:
                assert auth == [b"Bearer alice-secret"] and cookie == [b"session=alice"]
            else:
                assert auth == [] and cookie == []
        # The upstream connections were shared (pooled), which is what makes this a real check.
        assert stack.echo.connections < len(stack.echo.heads)
    finally:
        await stack.stop()


# -- slow and idle clients --------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_slowloris_headers_get_408_and_never_park():
    """Headers at one byte every 0.25 s: 408 after the read timeout, nothing parked or forwarded."""
    stack = await recording_stack()
    try:
        stack.proxy.state.hold("api", "game")
        site, port = await _own_listener(stack, request_read_timeout=1.5)
        data = request_bytes(b"POST", b"/api/embed", [(b"X-Padding", b"p" * 40)], EMBED)

        def slowloris():
            c = RawClient(port)
            try:
                for byte in data:
                    if _readable(c.sock) or not c.send(bytes([byte])):
                        break  # answered (or closed): stop dribbling
                    parked_meanwhile.append(len(stack.proxy.lot))
                    time.sleep(0.25)
                return c.response(5)
            finally:
                c.close()

        parked_meanwhile: list[int] = []
        answer = await in_thread(reactor, slowloris, timeout=TIMEOUT)
        body = assert_json_error(answer, 408)
        assert "1.5s" in body["error"]
        assert answer.header(b"connection") == b"close"
        # Cut mid-header, never at the end of the request (the exact time is on a Clock:
        # test_slowloris_gets_408_at_the_read_timeout_however_it_dribbles).
        assert len(parked_meanwhile) < len(data) and set(parked_meanwhile) == {0}
        assert len(stack.proxy.lot) == 0 and stack.echo.heads == []
    finally:
        await stack.stop()


def test_slowloris_gets_408_at_the_read_timeout_however_it_dribbles():
    """On a Clock: one header byte every 0.25 s resets nothing; the 408 comes at exactly 1.5 s."""
    rig = Rig(config_with(proxy={"request_read_timeout_seconds": 1.5}))
    rig.proxy.state.hold("api", "game")
    data = request_bytes(b"POST", b"/api/embed", [(b"X-Padding", b"p" * 40)], EMBED)
    peer = rig.raw()
    for i, byte in enumerate(data[:6]):  # at 0, 0.25 ... 1.25 s
        rig.run(0.25 if i else 0.0)
        peer.send(bytes([byte]))
    rig.run(0.249)
    assert peer.data == b"" and len(rig.proxy.lot) == 0
    rig.run(0.001)
    answer = parse_response(peer.data)[0]
    assert answer.status == 408 and "1.5s" in answer.json()["error"]
    assert answer.header(b"connection") == b"close"
    rig.run(10)
    assert peer.closed and len(rig.proxy.lot) == 0 and rig.sim.requests_total == {}
    assert rig.clock.getDelayedCalls() == []


def _readable(sock) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


@pytest_twisted.ensureDeferred
async def test_slow_body_gets_408_and_a_complete_request_is_not_cut():
    stack = await recording_stack()
    try:
        site, port = await _own_listener(stack, request_read_timeout=1.0)

        def slow_body():
            c = RawClient(port)
            try:
                c.send(request_bytes(b"POST", b"/api/embed", [(b"Content-Length", b"%d" % len(EMBED))]))
                for byte in EMBED:
                    if _readable(c.sock) or not c.send(bytes([byte])):
                        break
                    time.sleep(0.2)
                return c.response(5)
            finally:
                c.close()

        assert_json_error(await in_thread(reactor, slow_body, timeout=TIMEOUT), 408)

        def keep_alive():
            """A kept-alive connection: two complete requests, one after the other."""
            c = RawClient(port)
            try:
                c.send(request_bytes(b"POST", b"/api/embed", body=EMBED))
                first = c.response(5)
                c.send(request_bytes(b"POST", b"/api/embed", body=EMBED))
                return first, c.response(5)
            finally:
                c.close()

        # That it is not cut when idle for longer than the read timeout between them is on a
        # Clock: test_slow_body_gets_408_at_the_read_timeout_and_an_idle_kept_alive_connection_is_not_cut.
        first, second = await in_thread(reactor, keep_alive, timeout=TIMEOUT)
        assert first.status == 200 and second.status == 200
    finally:
        await stack.stop()


def test_slow_body_gets_408_at_the_read_timeout_and_an_idle_kept_alive_connection_is_not_cut():
    """On a Clock: a body dribbled 0.2 s a byte gets its 408 at exactly 1 s; a kept-alive connection
    idle for longer than that between two complete requests is not cut."""
    rig = Rig(config_with(proxy={"request_read_timeout_seconds": 1.0}))
    slow = rig.raw()
    slow.send(request_bytes(b"POST", b"/api/embed", [(b"Content-Length", b"%d" % len(EMBED))]))
    for i, byte in enumerate(EMBED[:5]):  # at 0, 0.2 ... 0.8 s
        rig.run(0.2 if i else 0.0)
        slow.send(bytes([byte]))
    rig.run(0.199)
    assert slow.data == b""
    rig.run(0.001)
    assert parse_response(slow.data)[0].status == 408
    kept = rig.raw()
    kept.send(request_bytes(b"POST", b"/api/embed", body=EMBED))
    rig.turn()
    first, rest = parse_response(kept.data)
    assert first.status == 200 and rest == b""
    rig.run(1.5)
    assert not kept.closed
    kept.data = b""
    kept.send(request_bytes(b"POST", b"/api/embed", body=EMBED))
    rig.turn()
    assert parse_response(kept.data)[0].status == 200
    assert rig.sim.texts_embedded["hello"] == 2


def test_a_silent_connection_is_closed_at_exactly_the_keepalive_timeout():
    """On a Clock: no byte, no request: past the read timeout no 408; closed at
    ``proxy.keepalive_timeout_seconds`` (not the longer idle timeout), nothing written."""
    rig = Rig(config_with(proxy={
        "request_read_timeout_seconds": 1.0, "keepalive_timeout_seconds": 2.0, "idle_timeout_seconds": 300.0,
    }))
    peer = rig.raw()
    rig.run(1.999)
    assert not peer.closed and peer.data == b""
    rig.run(0.001)
    assert peer.closed and peer.data == b""
    assert rig.clock.getDelayedCalls() == []


@pytest_twisted.ensureDeferred
async def test_a_silent_connection_is_closed_by_the_idle_timeout_without_an_answer():
    """No byte, no request: no 408 that a pooled client could take for its next answer."""
    stack = await recording_stack()
    try:
        site, port = await _own_listener(stack, request_read_timeout=0.3, timeOut=1)

        def silent():
            c = RawClient(port)
            try:
                closed = c.wait_closed(10)
                return closed, c.buffer
            finally:
                c.close()

        # Closed by the proxy (within wait_closed's 10 s), with not a byte written; the exact
        # time is on a Clock: test_a_silent_connection_is_closed_at_exactly_the_keepalive_timeout.
        closed, data = await in_thread(reactor, silent, timeout=TIMEOUT)
        assert closed and data == b""
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_parked_request_of_an_idle_client_is_bounded_by_the_hold():
    """A complete request parks; its client then sits idle: it is answered at the hold bound."""
    stack = await recording_stack(config_with(classes={"batch": {"hold_seconds": 1.0}}))
    try:
        stack.proxy.state.hold("api", "game")
        site, port = await _own_listener(stack, request_read_timeout=0.5)
        answer = await in_thread(reactor, exchange, port, request_bytes(b"POST", b"/api/embed", body=EMBED), 10, timeout=TIMEOUT)
        body = assert_json_error(answer, 503)
        assert "hold bound" in body["error"] and answer.header(b"retry-after")
        assert len(stack.proxy.lot) == 0 and stack.echo.heads == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_client_that_stops_reading_is_dropped_and_frees_its_slot():
    """A 64 MB answer to a client that never reads: the slot is free once the upstream has sent it
    (not when the client reads it); the client is dropped after the idle timeout, its buffer freed.

    The listener's timers run on a Clock of the test's: the idle timeout passes when the test says, so
    "still connected with its answer unread" is checked before it, however slow the machine is.  (Its
    zero-delay calls, the sending of what was written, stay on the reactor.)"""
    from twisted.internet.task import Clock

    class ListenerClock(Clock):
        def callLater(self, delay, f, *args, **kwargs):
            if delay == 0:
                return reactor.callLater(0, f, *args, **kwargs)
            return super().callLater(delay, f, *args, **kwargs)

    listener_clock = ListenerClock()
    stack = await recording_stack(declaring("/big", config=config_with(replay={"concurrency": 1})))
    try:
        site, port = await _own_listener(stack, stall_timeout=1, reactor=listener_clock)
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.sendall(request_bytes(b"GET", b"/big", [(b"X-Yield-Class", b"batch")]))
        try:
            await wait_for(reactor, lambda: len(stack.echo.heads) == 1, timeout=10)
            await wait_for(reactor, lambda: stack.proxy.replayer.inflight == 0, timeout=20)
            # The slot is free while the client is still connected with its answer unread:
            # the slow client does not keep the slot until it is dropped.
            assert stack.sample("yieldproxy_client_buffered_bytes") > 0
            assert stack.sample("yieldproxy_requests_total", **{"class": "batch", "code": "499"}) == 0
            # The slot is free: the next request goes through.
            response = await treq.post(stack.proxy_url + "/api/embed", data=EMBED).addTimeout(TIMEOUT, reactor)
            assert response.code == 200
            await response.content()
            assert stack.sample("yieldproxy_client_buffered_bytes") > 0
            # The client that reads nothing is dropped at the idle timeout, and its bytes freed.
            listener_clock.advance(0.9)
            assert stack.sample("yieldproxy_client_buffered_bytes") > 0
            listener_clock.advance(0.1)
            await wait_for(reactor, lambda: stack.sample("yieldproxy_client_buffered_bytes") == 0, timeout=10)
            await wait_for(reactor, lambda: stack.sample("yieldproxy_requests_total", **{"class": "batch", "code": "499"}) == 1)
        finally:
            client.close()
    finally:
        await stack.stop()


# -- the admin token ------------------------------------------------------------------------------------


def test_admin_token_is_compared_in_constant_time(monkeypatch):
    token = "s3cret-token-" + "k" * 40
    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(admin_module.hmac, "compare_digest", spy)
    rig = Rig(token=token)
    for given in (None, "x", token[:-1], token + "x", token.upper()):
        headers = {"Authorization": f"Bearer {given}"} if given else {}
        assert rig.call("GET", rig.admin_url + "/status", headers=headers).code == 401, given
    ok = rig.call("GET", rig.admin_url + "/status", headers={"Authorization": f"Bearer {token}"})
    assert ok.code == 200
    # Every check, of every length, went through hmac.compare_digest.
    assert len(compared) == 6
    assert {a for a, _ in compared} == {0, len("Bearer x"), len("Bearer ") + len(token) - 1, len("Bearer ") + len(token) + 1, len("Bearer ") + len(token)}


@pytest_twisted.ensureDeferred
async def test_admin_token_and_callers_credentials_are_never_logged():
    token = "never-log-me-" + "t" * 30
    user_secret = "user-api-key-do-not-log"
    stack = await start_stack(reactor, config_with(classes={"batch": {"hold_seconds": 0.3}}), token=token)
    try:
        with LogCapture() as logs:
            auth = {"Authorization": f"Bearer {token}"}
            for method, path, body in [
                ("POST", "/yield", {"reason": "game", "source": "broker"}),
                ("GET", "/status", None),
                ("GET", "/metrics", None),
                ("POST", "/yield", {"reason": 5}),
                ("POST", "/resume", {"source": "broker"}),
                ("POST", "/resume", {"source": "broker", "extra": 1}),
            ]:
                data = None if body is None else json.dumps(body).encode()
                for headers in (auth, {"Authorization": f"Bearer {token}x"}):
                    response = await treq.request(
                        method, stack.admin_url + path, data=data, headers=headers, persistent=False
                    ).addTimeout(TIMEOUT, reactor)
                    await response.content()
            # The proxy side too: a caller's own credentials, through a yield, an expiry and an outage.
            stack.proxy.state.hold("broker", "game")
            expired = await treq.post(
                stack.proxy_url + "/api/embed", data=EMBED, headers={"Authorization": f"Bearer {user_secret}"},
                persistent=False,
            ).addTimeout(TIMEOUT, reactor)
            assert expired.code == 503
            stack.proxy.state.release("broker")
            await stack.sim.set_mode("refuse")
            failed = await treq.post(
                stack.proxy_url + "/api/embed", data=EMBED,
                headers={"Authorization": f"Bearer {user_secret}", "Cookie": f"k={user_secret}"}, persistent=False,
            ).addTimeout(TIMEOUT, reactor)
            assert failed.code in (502, 503)
            await stack.sim.set_mode("ok")
        text = logs.text()
        assert logs.events, "nothing was logged: the capture did not work"
        assert token not in text
        assert user_secret not in text
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_non_utf8_host_or_path_gets_a_json_400_and_no_traceback():
    """Klein would log a traceback for each; the proxy listener answers them itself."""
    stack = await recording_stack()
    try:
        with LogCapture() as logs:
            bad_host = await raw(stack, request_bytes(b"POST", b"/api/embed", [(b"Host", b"\xff\xfe")], EMBED))
            bad_path = await raw(stack, request_bytes(b"POST", b"/v1/%ff%fe", body=EMBED))
        assert_json_error(bad_host, 400)
        assert_json_error(bad_path, 400, "openai")
        assert logs.errors() == []
        assert stack.echo.heads == []
        # Percent-encoded UTF-8 is fine, and forwarded as it came.
        fine = await raw(stack, request_bytes(b"GET", b"/v1/models/%C3%A9t%C3%A9"))
        assert fine.status == 200
        assert stack.echo.heads[0].split(b"\r\n")[0] == b"GET /v1/models/%C3%A9t%C3%A9 HTTP/1.1"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_admin_listener_refuses_an_oversized_body_before_reading_it():
    stack = await start_stack(reactor, token="admin-token")
    try:
        head = request_bytes(b"POST", b"/yield", [(b"Content-Length", b"%d" % (10 * 1024**3))])
        answer = await in_thread(reactor, exchange, port_of(stack.admin_url), head, 3, timeout=TIMEOUT)
        assert answer.status in (401, 413)
    finally:
        await stack.stop()


def test_admin_listener_bounds_the_time_to_read_a_request():
    site = Rig().proxy.admin_app.site()
    assert getattr(site, "request_read_timeout", None) is not None and site.request_read_timeout <= 60


@pytest_twisted.ensureDeferred
async def test_well_behaved_edge_cases_still_work():
    """The bounds cost nothing to correct clients: pipelining, HTTP/1.0, 100-continue, OPTIONS *."""
    stack = await recording_stack(config_with(proxy={"max_body_bytes": 4096}))
    port = port_of(stack.proxy_url)
    try:
        def pipelined():
            c = RawClient(port)
            try:
                one = request_bytes(b"POST", b"/api/embed", body=EMBED)
                two = request_bytes(b"GET", b"/api/tags")
                c.send(one + two + one)
                return [c.response(10) for _ in range(3)]
            finally:
                c.close()

        answers = await in_thread(reactor, pipelined, timeout=TIMEOUT)
        assert [a.status for a in answers] == [200, 200, 200]
        assert [a.json()["n"] for a in answers] == [1, 2, 3]

        old = await raw(stack, b"POST /api/embed HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(EMBED), EMBED))
        assert old.status == 200 and old.json()["size"] == len(EMBED)

        def expect_continue():
            c = RawClient(port)
            try:
                c.send(request_bytes(b"POST", b"/api/embed", [(b"Expect", b"100-continue"), (b"Content-Length", b"%d" % len(EMBED))]))
                c.sock.settimeout(5)
                interim = c.sock.recv(100)
                c.send(EMBED)
                return interim, c.response(10)
            finally:
                c.close()

        interim, final = await in_thread(reactor, expect_continue, timeout=TIMEOUT)
        assert interim.startswith(b"HTTP/1.1 100 Continue") and final.status == 200
        star = await raw(stack, b"OPTIONS * HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert star.status == 200
        # A body exactly at the limit is fine; one byte more is not.
        at_limit = await raw(stack, request_bytes(b"POST", b"/api/embed", body=b'{"input":"%s"}' % (b"a" * 4084)))
        over = await raw(stack, request_bytes(b"POST", b"/api/embed", body=b'{"input":"%s"}' % (b"a" * 4085)))
        assert at_limit.status == 200 and over.status == 413
        assert len(stack.echo.heads) == 6
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_requests_answered_by_the_listener_get_their_request_log_line():
    stack = await recording_stack()
    try:
        with LogCapture() as logs:
            connect = await raw(stack, request_bytes(b"CONNECT", b"example.invalid:443"))
            bad_host = await raw(stack, request_bytes(b"GET", b"/api/tags", [(b"Host", b"\xff")]))
        assert connect.status == 405 and bad_host.status == 400
        lines = [e for e in logs.events if e.get("log_namespace") == "yieldproxy.requestlog"]
        assert [(e["method"], e["status"], e["outcome"]) for e in lines] == [
            ("CONNECT", 405, "bad_request"), ("GET", 400, "bad_request"),
        ]
    finally:
        await stack.stop()


def test_request_read_timeout_setting_reaches_the_listener():
    rig = Rig(config_with(proxy={"request_read_timeout_seconds": 2.0}))
    assert rig.proxy.proxy_app.site().request_read_timeout == 2.0
    # And it is what the listener enforces: a request begun and not finished gets its 408 at 2 s.
    peer = rig.raw()
    peer.send(b"POST /api/embed HTTP/1.1\r\nHost: x\r\n")
    rig.run(1.999)
    assert peer.data == b""
    rig.run(0.001)
    assert parse_response(peer.data)[0].status == 408


# -- disguised model calls during a yield ------------------------------------------------------
#
# The upstream sees exactly what the proxy classified: a target it would read
# as a model route parks (and reaches the upstream in canonical form after the
# resume) or is refused; a body Ollama would read as a generation or a load
# parks; only true unloads pass.


async def _yielded_recording_stack(config=None):
    stack = await recording_stack(config)
    stack.proxy.state.hold("test", "a game")
    return stack


async def _assert_parks_then_goes(stack, data: bytes, request_line: bytes, body: bytes | None = None):
    """``data`` parks (nothing reaches the upstream), then goes exactly as ``request_line`` on resume."""
    answer = raw(stack, data, timeout=20)
    await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
    await assert_nothing_forwarded(stack)
    stack.proxy.state.release("test")
    response = await answer
    assert response.status == 200, response.raw[:300]
    assert [head.split(b"\r\n")[0] for head in stack.echo.heads] == [request_line]
    if body is not None:
        assert stack.echo.bodies == [body]


@pytest.mark.parametrize(
    "target, canonical",
    [
        (b"/api/%65mbed", b"/api/embed"),
        (b"/api/%65%6D%62%65%64", b"/api/embed"),
        (b"/api/%65mbed?x=%41", b"/api/embed?x=%41"),
        (b"/api/tags/../embed", b"/api/embed"),
        (b"/api/./embed", b"/api/embed"),
        (b"//api//embed", b"/api/embed"),
        (b"/api/embed/", b"/api/embed"),
        (b"/api/embed//", b"/api/embed"),
        (b"/v1/%65mbeddings", b"/v1/embeddings"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_disguised_targets_park_and_reach_the_upstream_in_canonical_form(target, canonical):
    stack = await _yielded_recording_stack()
    try:
        await _assert_parks_then_goes(
            stack, request_bytes(b"POST", target, body=EMBED), b"POST " + canonical + b" HTTP/1.1", EMBED
        )
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_route_rules_match_the_canonical_path():
    from yieldproxy.config import RouteRule

    rules = (RouteRule(cls="long", path="/api/embed"), RouteRule(cls="batch", prefix="/api/experimental/"))
    stack = await _yielded_recording_stack(attrs.evolve(config_with(), routes=rules))
    try:
        for target, cls in [(b"/api/%65mbed/", "long"), (b"/api//experimental/./x", "batch")]:
            answer = raw(stack, request_bytes(b"POST", target, body=EMBED), timeout=20)
            await wait_for(reactor, lambda cls=cls: stack.proxy.lot.count_by_class().get(cls) == 1)
            stack.proxy.state.release("test")
            assert (await answer).status == 200
            stack.proxy.state.hold("test", "a game")
        assert [head.split(b"\r\n")[0] for head in stack.echo.heads] == [
            b"POST /api/embed HTTP/1.1", b"POST /api/experimental/x HTTP/1.1",
        ]
    finally:
        await stack.stop()


@pytest.mark.parametrize(
    "target",
    [
        b"/api/embed#x",
        b"/api/embed?x=1#frag",
        b"/v1/embeddings#",
        b"/api%2Fembed",
        b"/api%2fembed",
        b"/api/tags/%2e%2e/embed",
        b"/api/tags/.%2E/embed",
        b"/../api/embed",
        b"/api/../../api/embed",
        b"/api\\embed",
        b"/api%5Cembed",
        b"/api/embed%00",
        b"/api/embed%0d%0aX-Injected:%201",
        b"/api/embed?x=%zz",
        b"/api/%6",
    ],
)
@pytest_twisted.ensureDeferred
async def test_ambiguous_targets_get_a_400_in_the_route_shape_and_reach_nothing(target):
    stack = await _yielded_recording_stack()
    try:
        with LogCapture() as logs:
            response = await raw(stack, request_bytes(b"POST", target, body=EMBED))
        body = assert_json_error(response, 400, "openai" if target.startswith(b"/v1/") else "ollama")
        assert "target" in str(body) or "path" in str(body) or "query" in str(body)
        assert counter_total(stack, "yieldproxy_rejected", reason="bad_request") == 1
        await assert_nothing_forwarded(stack)
        assert len(stack.proxy.lot) == 0
        assert logs.errors() == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_dot_segments_cannot_climb_out_of_the_upstream_path_prefix():
    backend_port = None
    from rawhttp import RecordingBackend

    backend = RecordingBackend()
    backend_port = await backend.listen(reactor)
    stack = await start_stack(reactor, upstream=f"http://127.0.0.1:{backend_port}/ollama")
    stack._ports.append(backend.port)
    stack.echo = backend
    try:
        climb = await raw(stack, request_bytes(b"GET", b"/api/../../admin/secret"))
        assert_json_error(climb, 400)
        inside = await raw(stack, request_bytes(b"GET", b"/v1/../api/./tags"))
        assert inside.status == 200
        assert [head.split(b"\r\n")[0] for head in backend.heads] == [b"GET /ollama/api/tags HTTP/1.1"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_escapes_reach_the_upstream_in_canonical_form():
    stack = await recording_stack()
    try:
        with LogCapture() as logs:
            response = await raw(stack, request_bytes(b"GET", b"/v1/models/caf%c3%a9"))
        assert response.status == 200
        assert stack.echo.heads[0].split(b"\r\n")[0] == b"GET /v1/models/caf%C3%A9 HTTP/1.1"
        assert logs.errors() == []
    finally:
        await stack.stop()


# The body tests below are about how Ollama's Go decoder reads a body, not about the wire: they
# write the same bytes in memory to the proxy listener's own site, on a Clock, and the upstream
# is the same RecordingBackend, connected in memory, keeping the exact bytes the proxy sent.


def _recording_rig(config=None, yielded: bool = True):
    backend = RecordingBackend()
    rig = Rig(config, upstream=backend)
    if yielded:
        rig.proxy.state.hold("test", "a game")
    return rig, backend


def _exchange(rig, data: bytes):
    """``data`` written on a new in-memory connection; the complete answer once everything due has run."""
    peer = rig.raw()
    peer.send(data)
    rig.turn()
    return parse_response(peer.data)[0]


def _parks_then_goes(rig, backend, data: bytes, request_line: bytes, body: bytes) -> None:
    """``data`` parks (nothing reaches the upstream while the clock moves), then goes exactly as ``request_line``."""
    peer = rig.raw()
    peer.send(data)
    rig.run(10)
    assert len(rig.proxy.lot) == 1 and peer.data == b""
    assert backend.heads == [], backend.heads
    rig.proxy.state.release("test")
    rig.turn()
    response = parse_response(peer.data)[0]
    assert response is not None and response.status == 200, peer.data[:300]
    assert [head.split(b"\r\n")[0] for head in backend.heads] == [request_line]
    assert backend.bodies == [body]


#: Bodies Ollama reads as a generation or a model load, however the proxy used to read them.
DISGUISED_BODIES = [
    (b"/api/generate", b'{"model":"m","keep_alive":0,"Prompt":"hi"}'),
    (b"/api/generate", b'{"model":"m","keep_alive":0,"PROMPT":"hi"}'),
    (b"/api/generate", b'{"model":"m","prompt":"","keep_alive":0,"prompt":"hi"}'),
    (b"/api/generate", b'{"model":"m","keep_al\\u0131ve":0}'),  # dotless i: no keep_alive, a load
    (b"/api/generate", b'{"model":"m","keep_alive":0,"keep_alive":null}'),
    (b"/api/generate", b'{"model":"m","keep_alive":0} {"prompt":"hi"}'),
    (b"/api/generate", b'{"model":"m\xff","keep_alive":0}'),
    (b"/api/chat", b'{"model":"m","keep_alive":0,"Messages":[{"role":"user","content":"hi"}]}'),
    (b"/api/embed", b'{"model":"m","keep_alive":0}'),  # EmbedHandler loads before anything else
    (b"/api/embed", b'{"model":"m","KEEP_ALIVE":0,"Input":[]}'),
    (b"/api/embeddings", b'{"model":"m","keep_alive":0}'),
]


@pytest.mark.parametrize("path, body", DISGUISED_BODIES)
def test_disguised_bodies_park_during_a_yield(path, body):
    rig, backend = _recording_rig()
    _parks_then_goes(rig, backend, request_bytes(b"POST", path, body=body), b"POST " + path + b" HTTP/1.1", body)


#: Unloads as Ollama reads them: they free the GPU and load nothing.
TRUE_UNLOADS = [
    (b"/api/generate", b'{"model":"m","keep_alive":0}'),
    (b"/api/generate", b'{"model":"m","KEEP_ALIVE":0}'),
    (b"/api/generate", b'{"model":"m","\\u212aeep_alive":"0s"}'),  # Kelvin sign folds to k
    (b"/api/generate", '{"model":"m","\u212aeep_alive":0}'.encode()),
    (b"/api/generate", b'{"model":"m","prompt":"hi","keep_alive":0,"Prompt":""}'),
    (b"/api/chat", b'{"model":"m","Keep_Alive":0,"messages":[]}'),
    (b"/api/chat", b'{"model":"m","keep_alive":0,"messages":[{"role":"user","content":"hi"}],"MESSAGES":[]}'),
]


@pytest.mark.parametrize("path, body", TRUE_UNLOADS)
def test_true_unloads_pass_during_a_yield(path, body):
    rig, backend = _recording_rig()
    response = _exchange(rig, request_bytes(b"POST", path, body=body))
    assert response.status == 200
    assert len(backend.heads) == 1 and backend.bodies == [body]
    assert len(rig.proxy.lot) == 0


def _model_rule_config():
    """A rule that passes one small model: only Go's reading of the body may decide it."""
    from yieldproxy.config import RouteRule

    return attrs.evolve(config_with(), routes=(RouteRule(cls="passthrough", path="/api/embed", models=("small",)),))


_PAD = ",".join(['"%s"' % ("x" * 60)] * 2000)  # well past the size where the body is scanned, not parsed


@pytest.mark.parametrize(
    "body, passes",
    [
        (b'{"model":"small","input":"a","Model":"llama3:70b"}', False),
        (b'{"model":"llama3:70b","input":"a","MODEL":"small"}', True),
        (b'{"model":"small","model":null,"input":"a"}', True),
        (b'{"model":"small","model":5,"input":"a"}', "go"),  # Ollama's own 400, at once
        (b'{"model":"small","input":"a"} {"model":"x"}', None),  # trailing data: a 400
        (b'{"model":"small","input":[' + _PAD.encode() + b'],"Model":"llama3:70b"}', False),
        (b'{"input":[' + _PAD.encode() + b'],"model":"small"}', True),
        (b'{"input":[' + _PAD.encode() + b'],"model":"small","m\\u006fdel":"big"}', False),
        (b'{"model":"small","input":[' + _PAD.encode() + b']} {"model":"x"}', None),
    ],
    ids=["folded-dup", "folded-last", "null", "type-error", "trailing",
         "big-folded-dup", "big-last", "big-escaped-key", "big-trailing"],
)
def test_model_rules_read_the_model_ollama_reads(body, passes):
    rig, backend = _recording_rig(_model_rule_config())
    data = request_bytes(b"POST", b"/api/embed", body=body)
    if passes == "go":
        answer = _exchange(rig, data)
        assert (answer.status, answer.body) == (
            400, b'{"error":"json: cannot unmarshal number into Go struct field EmbedRequest.model of type string"}'
        )
        assert len(rig.proxy.lot) == 0 and backend.heads == []
    elif passes is None:
        assert_json_error(_exchange(rig, data), 400)
        rig.run(10)
        assert backend.heads == []
    elif passes:
        assert _exchange(rig, data).status == 200
        assert backend.bodies == [body]
    else:
        _parks_then_goes(rig, backend, data, b"POST /api/embed HTTP/1.1", body)


def test_header_bytes_of_parked_requests_count_in_parked_bytes():
    """Headers are held in memory while parked, like the body: parking.max_parked_bytes bounds them too."""
    rig, backend = _recording_rig(config_with(parking={"max_parked_bytes": 8192}))
    padding = [(b"X-Pad-%d" % i, b"p" * 1000) for i in range(6)]
    first = rig.raw()
    first.send(request_bytes(b"POST", b"/api/embed", padding, body=EMBED))
    rig.turn()
    assert len(rig.proxy.lot) == 1
    assert rig.proxy.lot.parked_bytes > 6 * 1000 + len(EMBED)
    assert rig.sample("yieldproxy_parked_bytes") == rig.proxy.lot.parked_bytes
    # A second such request would hold more than 8 KiB: refused at once, small as its body is.
    second = _exchange(rig, request_bytes(b"POST", b"/api/embed", padding, body=EMBED))
    assert "bytes held" in assert_json_error(second, 503)["error"]
    assert len(rig.proxy.lot) == 1
    rig.proxy.state.release("test")
    rig.turn()
    assert parse_response(first.data)[0].status == 200
    assert rig.proxy.lot.parked_bytes == 0
    assert len(backend.heads) == 1


# -- malformed framing: the documented 400, never a silent close (issue 16, section 4) ---------------

_HEAD = b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\n"
_CHUNKED = _HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "data",
    [
        _CHUNKED + b"1" + b"0" * 16 + b"\r\n" + b"x" * 64,  # 17 hex digits: past 64 bits
        _CHUNKED + b"f" * 40 + b"\r\nabc\r\n0\r\n\r\n",
        _CHUNKED + b"3\nabc\r\n0\r\n\r\n",  # bare LF after a chunk size
        _CHUNKED + b"3\r\nabc\r\n0\n\n",  # bare LF in the last chunk
        _CHUNKED + b"3\r\nabc\r\n0\r\nX-Trailer: 1\n\r\n",  # bare LF ending a trailer line
        b"POST /api/embed HTTP/1.1\nHost: 127.0.0.1\nContent-Length: 3\n\nabc",  # a head in bare LFs
        _HEAD + b"Content-Length: 3\r\n\nabc",  # the blank line a bare LF
        _HEAD + b"Content-Length: 3\nX-Note: a\r\n\r\nabc",  # one header line ends in a bare LF
    ],
    ids=[
        "chunk-size-17-digits", "chunk-size-40-digits", "lf-after-chunk-size", "lf-last-chunk", "lf-trailer",
        "lf-head", "lf-blank-line", "lf-header-line",
    ],
)
def test_malformed_framing_gets_a_400_at_once_and_reaches_nothing(data):
    """On a Clock: the 400 comes at once (not the read timeout's 408, not a silent close); nothing goes upstream."""
    rig, backend = _recording_rig(yielded=False)
    peer = rig.raw()
    peer.send(data)
    rig.turn()
    answer = parse_response(peer.data)[0]
    assert answer is not None, peer.data
    assert_json_error(answer, 400)
    assert answer.header(b"connection") == b"close"
    rig.run(10)
    assert peer.closed and backend.heads == []
    assert rig.clock.getDelayedCalls() == []


def test_a_chunk_larger_than_the_body_limit_gets_413_at_its_size_line():
    """A chunk size over proxy.max_body_bytes is refused when it is read, not after the limit's worth of bytes."""
    rig, backend = _recording_rig(config_with(proxy={"max_body_bytes": 1024}), yielded=False)
    peer = rig.raw()
    peer.send(_CHUNKED + b"%x\r\n" % (1 << 40) + b"x" * 10)
    rig.turn()
    answer = parse_response(peer.data)[0]
    assert answer is not None, peer.data
    assert_json_error(answer, 413)
    rig.run(10)
    assert peer.closed and backend.heads == []
    assert rig.clock.getDelayedCalls() == []
