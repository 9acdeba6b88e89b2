"""Many HTTP clients at once on raw sockets, one request each, served by one thread.

For the tests of real processes that park a thousand requests and keep more
arriving through reloads (tests/lifecycle/test_reload_deaths.py): each client connects
(non-blocking), sends its request, and reads until its answer is whole or its
connection ends.  Its :class:`Outcome` says which: an answer (its status,
``Retry-After`` and body), ``refused`` (nothing listened: the connection was
never made), or ``closed`` / ``reset`` (the connection was made and ended
without a whole answer: a client left without an answer).
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
from typing import Callable

import attrs

from rawhttp import parse_response


@attrs.define
class Outcome:
    """What became of one client's request."""

    text: str
    #: The answer's status (0: none came whole).
    status: int = 0
    retry_after: bytes | None = None
    body: bytes = b""
    #: ``refused``, ``closed``, ``reset`` or another error's name; None for an answer.
    error: str | None = None

    @property
    def answered(self) -> bool:
        return self.status != 0


@attrs.define(eq=False)
class _Client:
    text: str
    sock: socket.socket
    request: bytes
    sent: int = 0
    received: bytes = b""
    connected: bool = False


class Crowd:
    """Clients on 127.0.0.1:``port``, each sending ``request_for(text)`` once (see the module docstring)."""

    def __init__(self, port: int, request_for: Callable[[str], bytes]):
        self.port = port
        self._request_for = request_for
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._queue: list[str] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        #: Each client's outcome, by its text, once it has one.
        self.outcomes: dict[str, Outcome] = {}
        self.sent: list[str] = []
        self._running = True
        self._thread = threading.Thread(target=self._run, name="crowd", daemon=True)
        self._thread.start()

    def send(self, texts) -> None:
        """New clients, one per text (a text once only)."""
        with self._lock:
            self._queue.extend(texts)
            self.sent.extend(texts)
        self._wake_write.send(b"x")

    def wait(self, count: int | None = None, timeout: float = 60.0) -> bool:
        """Until ``count`` clients (default: every one sent) have an outcome; False after ``timeout``."""
        with self._changed:
            return self._changed.wait_for(
                lambda: len(self.outcomes) >= (len(self.sent) if count is None else count), timeout
            )

    def close(self) -> None:
        self._running = False
        self._wake_write.send(b"x")
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            try:
                key.fileobj.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self._selector.close()
        self._wake_write.close()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            for key, events in self._selector.select(1.0):
                if key.data is None:
                    try:
                        self._wake_read.recv(4096)
                    except BlockingIOError:
                        pass
                    self._start_queued()
                else:
                    self._step(key.data, events)

    def _start_queued(self) -> None:
        with self._lock:
            texts, self._queue = self._queue, []
        for text in texts:
            sock = socket.socket()
            sock.setblocking(False)
            client = _Client(text, sock, self._request_for(text))
            code = sock.connect_ex(("127.0.0.1", self.port))
            if code not in (0, errno.EINPROGRESS):
                self._end(client, error=errno.errorcode.get(code, str(code)))
                continue
            self._selector.register(sock, selectors.EVENT_WRITE, client)

    def _step(self, client: _Client, events: int) -> None:
        sock = client.sock
        if not client.connected:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._end(client, error="refused" if code == errno.ECONNREFUSED else errno.errorcode.get(code))
                return
            client.connected = True
        if client.sent < len(client.request):
            try:
                client.sent += sock.send(client.request[client.sent:])
            except BlockingIOError:
                return
            except OSError as e:
                self._end(client, error=_name(e))
                return
            if client.sent == len(client.request):
                self._selector.modify(sock, selectors.EVENT_READ, client)
            return
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            self._end(client, error=_name(e))
            return
        if not data:
            self._end(client, error="closed")
            return
        client.received += data
        response, _rest = parse_response(client.received)
        if response is not None:
            self._end(client, response=response)

    def _end(self, client: _Client, response=None, error: str | None = None) -> None:
        try:
            self._selector.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()
        outcome = Outcome(client.text, error=error)
        if response is not None:
            outcome.status = response.status
            outcome.retry_after = response.header(b"retry-after")
            outcome.body = response.body
        with self._changed:
            self.outcomes[client.text] = outcome
            self._changed.notify_all()


def _name(error: OSError) -> str:
    if isinstance(error, ConnectionResetError):
        return "reset"
    return errno.errorcode.get(error.errno or 0, type(error).__name__)
