"""The seam a reload writes a connection down and makes it again through (lifecycle/succession/connections.py).

On real sockets in this process: the proxy of this checkout (helpers.start_stack), a raw keep-alive client
in a thread.  What a new HTTP edge must keep when it takes this module over: a connection written down is
paused here (not read, no timer, not reclaimable) until it is resumed (served here as if nothing happened,
what the client sent meanwhile included) or let go (gone from here without a word: the client's connection
lives on, served by the copy made again).
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import config_with, in_thread, start_stack, wait_for
from rawhttp import RawClient, request_bytes
from yieldproxy.lifecycle.succession.connections import export_idle, idle_connections, make_again
from yieldproxy.tools.sim import expected_embedding

MODEL = "all-minilm"


def embed(text: str) -> bytes:
    return request_bytes(b"POST", b"/api/embed", body=b'{"model": "%s", "input": ["%s"]}' % (MODEL.encode(), text.encode()))


def vector(answer) -> list[float]:
    return answer.json()["embeddings"][0]


@pytest_twisted.ensureDeferred
async def test_a_connection_written_down_is_paused_until_resumed_or_let_go_to_its_copy_made_again():
    stack = await start_stack(reactor, config_with())
    connections = stack.proxy.proxy_app.connections
    port = int(stack.proxy_url.rsplit(":", 1)[1])
    client = await in_thread(reactor, RawClient, port, 10)
    try:
        first = await in_thread(reactor, lambda: client.send(embed("one")) and client.response())
        assert first.status == 200
        await wait_for(reactor, lambda: len(idle_connections(connections)) == 1)
        [channel] = idle_connections(connections)
        # Written down: paused here.
        exported = export_idle(channel)
        assert exported is not None and exported.data == b""
        assert channel.transport not in reactor.getReaders() and channel.frozen and channel.deadline_in is None
        assert idle_connections(connections) == [] and not connections.reclaim_idle()
        # The client sends meanwhile: nothing reads it here until the copy is resumed, which answers it.
        assert await in_thread(reactor, client.send, embed("two"))
        exported.resume()
        exported.let_go()  # once resumed, letting go does nothing
        second = await in_thread(reactor, client.response)
        assert second.status == 200 and vector(second) == pytest.approx(expected_embedding("two", MODEL), abs=1e-9)
        assert channel.transport.connected and not channel.frozen and channel.deadline_in is not None

        # Written down again, made again (as the new process would), and let go here: the client's next
        # request is answered by the copy, on the same connection, with no FIN or reset from the old copy.
        await wait_for(reactor, lambda: len(idle_connections(connections)) == 1)
        exported = export_idle(idle_connections(connections)[0])
        assert exported is not None
        made = make_again(
            reactor, stack.proxy.proxy_app.site(), exported.fd, exported.family, exported.data,
            connection=exported.connection,
        )
        exported.let_go()
        exported.resume()  # once let go, resuming does nothing
        assert not channel.transport.connected and made is not channel
        # Taken up as it was: idle, its keep-alive deadline running on with the time it had left.
        assert made.state.value == "idle" and 0 < made.deadline_in <= exported.connection["deadline_in"]
        third = await in_thread(reactor, lambda: client.send(embed("three")) and client.response())
        assert third.status == 200 and vector(third) == pytest.approx(expected_embedding("three", MODEL), abs=1e-9)
        assert not client.closed
    finally:
        client.close()
        await stack.stop()
