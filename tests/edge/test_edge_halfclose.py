"""A client that shuts its side after a whole request gets its answer (issue 31, class 6).

``nc -N``, ``printf ... | nc -q 1`` and scripted clients send a request and
then ``shutdown(SHUT_WR)``: they will send nothing more, and read the answer.
The connection answers every whole request it read, then closes, free or
parked during a yield.  A client that closes its socket (not one side of it)
while its request is parked is still seen to have gone: its request is
dropped, not replayed.  On 127.0.0.1 against the simulated backend.
"""

from __future__ import annotations

import json
import socket

import pytest_twisted
from twisted.internet import reactor

from helpers import in_thread, sleep, start_stack, wait_for
from rawhttp import parse_response, port_of, request_bytes

TIMEOUT = 30
EMBED = request_bytes(
    b"POST", b"/api/embed", [(b"Content-Type", b"application/json")],
    json.dumps({"model": "all-minilm", "input": "hello"}).encode(),
)


def _send_and_shut(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    return sock


def _read_to_end(sock: socket.socket) -> bytes:
    """Everything the proxy sends until it closes (bounded by the socket's timeout)."""
    out = b""
    try:
        while True:
            piece = sock.recv(65536)
            if not piece:
                return out
            out += piece
    finally:
        sock.close()


def _answers(data: bytes) -> list:
    """The final answers in ``data`` (interim 1xx ones skipped, as an HTTP/1.1 client does)."""
    answers = []
    while data:
        answer, data = parse_response(data)
        if answer is None:
            break
        if answer.status >= 200:
            answers.append(answer)
    return answers


@pytest_twisted.ensureDeferred
async def test_a_half_closed_client_gets_its_answers_with_a_free_gpu():
    """A whole request (two, pipelined) then ``shutdown(SHUT_WR)``: each answered 200 in order, then the close."""
    stack = await start_stack(reactor)
    port = port_of(stack.proxy_url)
    try:
        sock = await in_thread(reactor, _send_and_shut, port, EMBED, timeout=TIMEOUT)
        answers = _answers(await in_thread(reactor, _read_to_end, sock, timeout=TIMEOUT))
        assert [a.status for a in answers] == [200], answers
        assert b'"embeddings"' in answers[0].body
        sock = await in_thread(reactor, _send_and_shut, port, EMBED + request_bytes(b"GET", b"/api/tags"),
                               timeout=TIMEOUT)
        answers = _answers(await in_thread(reactor, _read_to_end, sock, timeout=TIMEOUT))
        assert [a.status for a in answers] == [200, 200], answers
        # A request not whole when the client shut its side is never answered: closed.
        sock = await in_thread(reactor, _send_and_shut, port, EMBED[:-3], timeout=TIMEOUT)
        assert await in_thread(reactor, _read_to_end, sock, timeout=TIMEOUT) == b""
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_half_closed_client_parked_during_a_yield_gets_its_answer_after_the_resume():
    stack = await start_stack(reactor)
    port = port_of(stack.proxy_url)
    stack.proxy.state.hold("test", "a game")
    try:
        sock = await in_thread(reactor, _send_and_shut, port, EMBED, timeout=TIMEOUT)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
        reading = in_thread(reactor, _read_to_end, sock, timeout=TIMEOUT)
        # It stays parked: the client only shut its side.
        await sleep(reactor, 0.5)
        assert len(stack.proxy.lot) == 1
        stack.proxy.state.release("test")
        answers = _answers(await reading)
        assert [a.status for a in answers] == [200], answers
        assert answers[0].header(b"x-yield-parked-seconds") is not None
        assert b'"embeddings"' in answers[0].body
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_client_that_closes_its_socket_while_parked_is_still_seen_gone():
    """Closing a socket sends the same FIN as shutting one side of it: the proxy tells them apart (the kernel of a
    client that closed answers the interim ``100 Continue`` with a reset), and drops the request of one gone."""
    stack = await start_stack(reactor)
    port = port_of(stack.proxy_url)
    stack.proxy.state.hold("test", "a game")
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        sock.sendall(EMBED)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
        sock.close()
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 0, timeout=5)
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "abandoned"}) == 1
    finally:
        stack.proxy.state.release("test")
        await stack.stop()
