"""The broker library (yieldproxy/tools/broker.py) against real proxies on 127.0.0.1.

The clients are blocking (urllib) or run their own asyncio loop, so each runs
in a worker thread while the reactor serves: a proxy of this checkout built
in-process by ``service.build`` (helpers.start_stack), and, for the lease,
a real ``twistd -n yieldproxy`` process.  Lease renewal is real time: a 1.5 s
lease held for two and a half leases and at least six renewals (the proxy's
lease runs on its reactor's real clock, so the renewals must be real).
"""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import stat
import threading
import time

import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import free_port, in_thread, start_stack, wait_for
from yieldproxy.config import Config
from yieldproxy.service import build
from yieldproxy.tools.broker import Admin, AdminError, AdminUnreachable, AsyncAdmin, read_answer

TOKEN = "broker-test-token-0123456789"
#: Short, so a test sees several renewals; long enough that a renewal thread a busy machine wakes a second late
#: still renews in time (the client counts a lease as lost once a whole one passed between two renewals).
LEASE = 3.0
#: A hold lasts this many leases, and at least RENEWALS renewals.
HELD = 2.5
RENEWALS = 6


def holds_of(admin: Admin) -> list[tuple[str, str | None]]:
    return [(h["source"], h.get("upstream")) for h in admin.status()["holds"]]


def hold_for_a_while(admin: Admin) -> dict:
    """Hold for two and a half leases and six renewals; what the proxy said during and after."""
    seen: dict = {}
    with admin.hold("broker", "a game", lease_seconds=LEASE) as hold:
        seen["taken"] = holds_of(admin)
        held_long_enough(hold, time.monotonic())
        status = admin.status()
        seen["late"] = [(h["source"], h["expires_at"] - status["now"]) for h in status["holds"]]
        seen["state"] = status["state"]
        seen["renewals"], seen["error"], seen["lost"] = hold.renewals, hold.error, hold.lost
    seen["after"] = holds_of(admin)
    seen["state_after"] = admin.status()["state"]
    return seen


def held_long_enough(hold, since: float) -> None:
    """Wait (in the holding thread) until HELD leases have passed and the hold was renewed RENEWALS times."""
    deadline = since + 10 * HELD * LEASE
    while time.monotonic() < deadline and (hold.renewals < RENEWALS or time.monotonic() - since < HELD * LEASE):
        time.sleep(0.02)


async def async_held_long_enough(hold, since: float) -> None:
    """:func:`held_long_enough` for asyncio."""
    deadline = since + 10 * HELD * LEASE
    while time.monotonic() < deadline and (hold.renewals < RENEWALS or time.monotonic() - since < HELD * LEASE):
        await asyncio.sleep(0.02)


def check_held(seen: dict) -> None:
    assert seen["taken"] == [("broker", None)]
    # Two and a half leases in, still held, its lease renewed within the last third or so.
    [(source, left)] = seen["late"]
    assert source == "broker" and 0 < left <= LEASE, seen
    assert seen["state"] == "yielded"
    assert seen["renewals"] >= RENEWALS and seen["error"] is None and not seen["lost"], seen
    assert seen["after"] == [] and seen["state_after"] != "yielded", seen


@pytest_twisted.ensureDeferred
async def test_a_short_lease_held_longer_stays_held_and_ends_on_exit():
    stack = await start_stack(reactor, token=TOKEN)
    try:
        seen = await in_thread(reactor, hold_for_a_while, Admin(stack.admin_url, token=TOKEN), timeout=30)
        check_held(seen)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_real_twistd_process_keeps_the_hold_and_the_exception_resumes():
    from test_twistd import start_service
    from yieldproxy.tools.sim import SimOllama

    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, _, admin_url = await start_service(sim_port)
    try:
        admin = Admin(admin_url)
        check_held(await in_thread(reactor, hold_for_a_while, admin, timeout=30))

        def fail_inside() -> list:
            with pytest.raises(RuntimeError, match="the game crashed"):
                with admin.hold("broker", "a game", lease_seconds=LEASE, upstream=None):
                    assert holds_of(admin) == [("broker", None)]
                    raise RuntimeError("the game crashed")
            return holds_of(admin)

        assert await in_thread(reactor, fail_inside, timeout=30) == []
    finally:
        process.signalProcess("TERM")
        await protocol.ended.addTimeout(30, reactor)
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_the_hold_ends_on_an_exception():
    stack = await start_stack(reactor)
    try:
        admin = Admin(stack.admin_url)

        def fail_inside() -> list:
            with pytest.raises(ValueError):
                with admin.hold("broker", "transcode", lease_seconds=600) as hold:
                    assert stack.proxy.state.yielded and hold.renewals == 0
                    raise ValueError("boom")
            return holds_of(admin)

        assert await in_thread(reactor, fail_inside, timeout=30) == []
        assert not stack.proxy.state.yielded
    finally:
        await stack.stop()


def run_async(coroutine_function, *args):
    """Run an asyncio program of its own (as a broker would), in the calling thread."""
    return asyncio.run(asyncio.wait_for(coroutine_function(*args), 30))


async def async_hold(url: str) -> dict:
    admin = AsyncAdmin(url, token=TOKEN)
    seen: dict = {}
    async with admin.hold("broker", "a game", lease_seconds=LEASE) as hold:
        seen["taken"] = [(h["source"], h.get("upstream")) for h in (await admin.status())["holds"]]
        await async_held_long_enough(hold, time.monotonic())
        status = await admin.status()
        seen["late"] = [(h["source"], h["expires_at"] - status["now"]) for h in status["holds"]]
        seen["state"] = status["state"]
        seen["renewals"], seen["error"], seen["lost"] = hold.renewals, hold.error, hold.lost
    status = await admin.status()
    seen["after"] = [(h["source"], h.get("upstream")) for h in status["holds"]]
    seen["state_after"] = status["state"]
    try:
        async with admin.hold("broker", "again", lease_seconds=LEASE):
            raise KeyError("crash")
    except KeyError:
        pass
    seen["after_exception"] = (await admin.status())["holds"]
    return seen


@pytest_twisted.ensureDeferred
async def test_asyncio_hold_renews_and_ends_on_exit_and_on_an_exception():
    stack = await start_stack(reactor, token=TOKEN)
    try:
        seen = await in_thread(reactor, run_async, async_hold, stack.admin_url, timeout=40)
        check_held(seen)
        assert seen["after_exception"] == []
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_failed_renewal_is_reported_and_resuming_is_still_tried():
    """The admin listener goes away mid-hold: errors reported, lost after a lease, the exit says it could not resume."""
    stack = await start_stack(reactor)
    listener = stack.proxy.service.getServiceNamed("admin")
    errors: list = []
    stopped = []

    def hold_while_it_goes() -> dict:
        admin = Admin(stack.admin_url, timeout=1)
        hold = admin.hold("broker", "a game", lease_seconds=LEASE, on_error=lambda h, e: errors.append(e))
        with pytest.raises(AdminUnreachable, match="connection refused"):
            with hold:
                reactor.callFromThread(lambda: stopped.append(listener.stopService()))
                # Until the renewals have failed for a whole lease (bounded).
                deadline = time.monotonic() + 10 * LEASE
                while not hold.lost and time.monotonic() < deadline:
                    time.sleep(0.02)
        return {"error": hold.error, "lost": hold.lost}

    try:
        seen = await in_thread(reactor, hold_while_it_goes, timeout=30)
        assert isinstance(seen["error"], AdminUnreachable) and seen["lost"], seen
        assert errors and all(isinstance(e, AdminUnreachable) for e in errors)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_clear_errors():
    stack = await start_stack(reactor, token=TOKEN)
    try:
        def calls() -> list[AdminError]:
            out = []
            for call in (
                lambda: Admin(stack.admin_url).status(),
                lambda: Admin(stack.admin_url, token="wrong").yield_gpu("broker"),
                lambda: Admin(stack.admin_url, token=TOKEN).yield_gpu("broker", upstream="nowhere"),
                lambda: Admin(stack.admin_url, token=TOKEN).yield_gpu("bad source!"),
                lambda: Admin(f"http://127.0.0.1:{free_port()}").status(),
                lambda: Admin(stack.proxy_url).status(),
            ):
                with pytest.raises(AdminError) as caught:
                    call()
                out.append(caught.value)
            return out

        missing, wrong, upstream, source, nobody, proxy = await in_thread(reactor, calls, timeout=30)
        assert missing.status == 401 and "(no token was given)" in missing.message
        assert wrong.status == 401 and "(the token given was refused)" in wrong.message
        assert upstream.status == 400 and upstream.server_message.startswith("unknown upstream 'nowhere'")
        assert source.status == 400 and "source may hold only" in source.message
        assert isinstance(nobody, AdminUnreachable) and nobody.status is None
        assert "connection refused" in nobody.message
        # The proxy listener answers /status as Ollama, which has no such route, answers it: gin's plain 404.
        assert proxy.status == 404
        assert proxy.message.endswith("answered 404 with something that is not the admin API: 404 page not found")
        assert not stack.proxy.state.yielded
    finally:
        await stack.stop()


def test_read_answer_needs_the_admin_apis_shape():
    assert read_answer(200, b'{"state": "available"}', "x", False) == {"state": "available"}
    with pytest.raises(AdminError, match="not the admin API: <html>"):
        read_answer(200, b"<html>", "x", False)
    with pytest.raises(AdminError, match=r"answered 409: too many holds\\x1b"):
        read_answer(409, b'{"error": "too many holds\\u001b"}', "x", False)


@pytest_twisted.ensureDeferred
async def test_the_readmes_three_lines_hold_the_gpu_while_the_block_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    [code] = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "from yieldproxy import Admin" in block]
    assert len([line for line in code.splitlines() if line.strip()]) == 3, code
    stack = await start_stack(reactor)
    seen = []
    try:
        program = code.replace("http://127.0.0.1:11436", stack.admin_url)
        assert program != code
        play = lambda: seen.append([(h.source, h.reason) for h in stack.proxy.state.holds])  # noqa: E731
        await in_thread(reactor, exec, program, {"play": play}, timeout=30)
        assert seen == [[("game", "steam: Cyberpunk 2077")]]
        assert not stack.proxy.state.yielded
    finally:
        await stack.stop()


def test_a_renewal_a_whole_lease_late_marks_the_hold_lost(monkeypatch):
    """The renewing thread did not run for a lease (a suspended process): the hold lapsed, even if it is back."""
    import yieldproxy.tools.broker as client

    class Answering:
        timeout = 10.0

        def yield_gpu(self, *args, **kwargs):
            return {"state": "yielded"}

    times = iter([100.0, 101.5, 104.0])
    monkeypatch.setattr(client.time, "monotonic", lambda: next(times))
    hold = client.Hold(Answering(), "broker", "a game", lease_seconds=2)
    hold._take()
    hold._renew_once()
    assert (hold.lost, hold.renewals) == (False, 1)
    hold._renew_once()
    assert (hold.lost, hold.renewals, hold.error) == (True, 2, None)


class _ScriptedAdmin:
    """A stdlib admin 'API' on 127.0.0.1 that answers each connection with the next scripted bytes (then a good one)."""

    GOOD = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 20\r\nconnection: close\r\n\r\n{"state": "yielded"}'

    def __init__(self, script: list[bytes]):
        import socket
        import threading

        self.script = list(script)
        self.paths: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import socket

        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        got = conn.recv(65536)
                        if not got:
                            break
                        data += got
                    self.paths.append(data.split(b" ", 2)[1] if data.count(b" ") >= 2 else b"")
                    conn.sendall(self.script.pop(0) if self.script else self.GOOD)
                except OSError:
                    pass

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.sock.close()


def test_a_renewal_cut_mid_answer_or_answered_in_garbage_is_an_error_and_the_renewals_go_on():
    """http.client's own errors (a body cut short, a status line that is not HTTP) are no OSError: they
    killed the renewing thread, so the hold was never renewed again and nothing said so."""
    admin_api = _ScriptedAdmin([
        _ScriptedAdmin.GOOD,  # the take
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"state\"",  # cut short: IncompleteRead
        b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP: BadStatusLine
    ])
    errors: list = []
    try:
        hold = Admin(admin_api.url, timeout=2).hold(
            "broker", "a game", lease_seconds=0.6, on_error=lambda h, e: errors.append(e),
        )
        with hold:
            deadline = time.monotonic() + 10
            while hold.renewals < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            alive = hold._thread is not None and hold._thread.is_alive()
        assert alive and hold.renewals >= 3, (hold.renewals, errors)
        assert len(errors) == 2 and all(isinstance(e, AdminUnreachable) for e in errors), errors
        assert hold.error is None and not hold.lost
        assert admin_api.paths[-1] == b"/resume"
    finally:
        admin_api.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"state\"",  # cut short: IncompleteRead
    b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP: BadStatusLine
])
def test_an_answer_cut_short_or_not_http_is_unreachable_alike_over_tcp_and_a_unix_socket(tmp_path, answer):
    """http.client's own errors are no OSError: one catch in Admin.call makes them AdminUnreachable, in the
    same words, whichever transport the call went over."""
    messages = []
    for family, address in ((socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_UNIX, str(tmp_path / "admin.sock"))):
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(1)
        server.settimeout(10)
        url = f"http://127.0.0.1:{server.getsockname()[1]}" if family == socket.AF_INET else f"unix:{address}"

        def answer_once(server: socket.socket = server) -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

        thread = threading.Thread(target=answer_once, daemon=True)
        thread.start()
        try:
            with pytest.raises(AdminUnreachable) as caught:
                Admin(url, timeout=5).status()
        finally:
            thread.join(5)
            server.close()
        messages.append(caught.value.message.replace(url, "URL"))
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("cannot reach the admin API at URL: the answer broke off or is not HTTP"), messages


def test_a_hold_entered_again_starts_afresh(monkeypatch):
    """A Hold used for a second block, more than a lease after the first ended, is not lost: it was taken anew
    (the first block's last renewal and its failed renewal belong to that block)."""
    import yieldproxy.tools.broker as client

    calls = []
    failing = []

    class Answering:
        timeout = 10.0

        def yield_gpu(self, *args, **kwargs):
            calls.append("yield")
            if failing:
                raise client.AdminUnreachable("cannot reach the admin API: connection refused")
            return {"state": "yielded"}

        def resume(self, *args, **kwargs):
            calls.append("resume")
            return {"state": "available"}

    now = [100.0]
    monkeypatch.setattr(client.time, "monotonic", lambda: now[0])
    hold = client.Hold(Answering(), "broker", "a game", lease_seconds=2)
    with hold:
        failing.append(True)
        hold._renew_once()  # what the renewing thread does: this renewal fails
        failing.clear()
    assert isinstance(hold.error, client.AdminUnreachable) and not hold.lost
    now[0] = 110.0  # the next game, ten seconds (five leases) later
    with hold:
        assert (hold.lost, hold.error, hold.renewed_at) == (False, None, 110.0)
    assert calls == ["yield", "yield", "resume", "yield", "resume"]

    async def under_asyncio() -> tuple:
        async with client.AsyncHold(hold) as again:
            return again.lost, again.renewed_at

    now[0] = 120.0
    assert asyncio.run(under_asyncio()) == (False, 120.0)


def test_a_503_with_retry_after_is_asked_again_after_it_while_the_timeout_allows():
    """The proxy answers 503 with Retry-After when it cannot take the call now (a reload handing the holds
    to a new process; too many admin connections): the call is made again after that many seconds, and its
    answer is the call's; past the timeout the 503 is the call's error, as before."""
    moved = (b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 0\r\ncontent-type: application/json\r\n"
             b"content-length: 40\r\n\r\n" + b'{"error": "handed the holds over: ask"}\n')
    admin_api = _ScriptedAdmin([moved, moved])
    try:
        answer = Admin(admin_api.url, timeout=5).yield_gpu("broker", for_seconds=60)
        assert answer["state"] == "yielded" and admin_api.paths == [b"/yield"] * 3
        late = moved.replace(b"retry-after: 0", b"retry-after: 30")
        admin_api.script[:] = [late]
        with pytest.raises(AdminError) as refused:
            Admin(admin_api.url, timeout=2).resume("broker")
        assert refused.value.status == 503 and "handed the holds over" in refused.value.message
        assert admin_api.paths[3:] == [b"/resume"]  # not asked again: 30 s is past its 2 s
    finally:
        admin_api.close()


def test_no_answer_within_the_timeout_names_the_call_s_timeout():
    """Something accepts the connection and never answers: the error names the call's timeout (the command's
    ``--timeout``), not the few microseconds less that were left for its one try."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        for timeout in (0.2, 0.3):
            with pytest.raises(AdminUnreachable) as caught:
                Admin("http://127.0.0.1:%d" % silent.getsockname()[1], timeout=timeout).status()
            assert caught.value.message.endswith(f": no answer within {timeout:g} s"), caught.value.message


def _flood_unix(path: str, count: int, stop, payload: bytes) -> int:
    """``count`` connections to the unix socket ``path``, each sending ``payload`` and made again when closed,
    until ``stop`` is set; how many were made."""
    selector = selectors.DefaultSelector()
    made = 0

    def connect() -> None:
        nonlocal made
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            sock.sendall(payload)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        made += 1

    try:
        for _ in range(count):
            connect()
        while not stop.is_set():
            for key, _ in selector.select(0.05):
                try:
                    if key.fileobj.recv(65536):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                selector.unregister(key.fileobj)
                key.fileobj.close()
                connect()
            while len(selector.get_map()) < count and not stop.is_set():
                connect()
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()
        selector.close()
    return made


@pytest_twisted.ensureDeferred
async def test_a_broker_on_the_admin_unix_socket_keeps_its_hold_through_a_flood_of_it(tmp_path):
    """``admin.listen = "unix:PATH:mode=660"``: the socket is made with that mode, and ``Admin("unix:PATH")``
    takes, renews and ends its hold there, while 80 connections of the same user flood the socket with heads that
    announce a chunked body and send none (the admin listener serves whole requests first: edge/capacity.py)."""
    from yieldproxy.tools.sim import SimOllama

    path = str(tmp_path / "admin.sock")
    sim = SimOllama(reactor)
    port = await sim.listen()
    config = Config().with_overrides(**{
        "proxy.upstream": f"http://127.0.0.1:{port}", "proxy.listen": "tcp:0:interface=127.0.0.1",
        "admin.listen": f"unix:{path}:mode=660", "upstream.detect_outages": False,
        "admin.max_connections": 16,
    })
    proxy = build(reactor, config, token=TOKEN)
    proxy.service.startService()
    stop = threading.Event()
    head = b"POST /yield HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    flood = in_thread(reactor, _flood_unix, path, 80, stop, head, timeout=120)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        connections = proxy.admin_app.connections
        await wait_for(reactor, lambda: connections.refused + connections.shed > 20, timeout=20)
        seen = await in_thread(reactor, hold_for_a_while, Admin(f"unix:{path}", token=TOKEN), timeout=60)
        check_held(seen)
    finally:
        stop.set()
        made = await flood
        await proxy.service.stopService()
        await sim.stop()
    assert made > 80  # the flood went on: its connections were cut or refused, and made again




def test_a_broker_waits_for_room_on_a_unix_socket_whose_accept_queue_is_full(tmp_path, monkeypatch):
    """Linux refuses a unix-socket connect at once with EAGAIN while the listener's accept queue is full (a
    flood, a busy reactor); the broker asks again within its timeout instead of calling the proxy unreachable."""
    path = str(tmp_path / "admin.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    queued = []
    refused = threading.Event()
    try:
        while True:  # fill the accept queue until Linux says EAGAIN
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            queued.append(filler)
            try:
                filler.connect(path)
            except BlockingIOError:
                break
            assert len(queued) < 100, "the accept queue never filled"

        class Watched(socket.socket):
            """A socket that says when a connect of it met the full queue."""

            def connect(self, address):
                try:
                    return super().connect(address)
                except BlockingIOError:
                    refused.set()
                    raise

        monkeypatch.setattr(socket, "socket", Watched)

        def serve():
            # Room is made once the broker has met the full queue: the fillers go, the broker is answered.
            assert refused.wait(10)
            for filler in queued:
                filler.close()
            while True:
                connection, _ = listener.accept()
                data = connection.recv(65536)
                if data.startswith(b"GET /status"):
                    body = b'{"state": "available"}'
                    connection.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                        b"Connection: close\r\n\r\n%s" % (len(body), body)
                    )
                    connection.close()
                    return
                connection.close()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        answer = Admin(f"unix:{path}", timeout=10).call("GET", "/status")
        server.join(10)
        assert answer["state"] == "available"
    finally:
        for filler in queued:
            filler.close()
        listener.close()
