"""Raw-socket tools for the hostile, fuzz and chaos tests.

A client that writes exactly the bytes a test gives it (Twisted's and treq's
clients refuse to send malformed requests), a backend that records exactly
the bytes the proxy sent upstream, a log capture that fails a test on any
logged traceback, and a reading of the proxy's outcome counters.
"""

from __future__ import annotations

import gc
import json
import socket
import time

import attrs
from twisted.internet import reactor as _reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from zope.interface import implementer

from helpers import start_stack

# -- a client that sends what it is told ---------------------------------------------


@attrs.define
class Response:
    """One parsed HTTP/1.1 answer; ``status`` 0 means the connection closed without one."""

    status: int = 0
    reason: bytes = b""
    headers: dict[bytes, list[bytes]] = attrs.Factory(dict)
    body: bytes = b""
    raw: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None

    def json(self):
        return json.loads(self.body)


def parse_response(data: bytes, head_only: bool = False) -> tuple[Response | None, bytes]:
    """The first complete answer in ``data`` (and what follows), or None if incomplete.

    ``head_only``: the answer to a HEAD request, which has no body whatever its headers say.
    """
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None, data
    head = data[:end].split(b"\r\n")
    version, _, rest = head[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    response = Response(status=int(code), reason=reason)
    for line in head[1:]:
        name, _, value = line.partition(b":")
        response.headers.setdefault(name.strip().lower(), []).append(value.strip())
    body_start = end + 4
    if head_only or response.status in (204, 304) or 100 <= response.status < 200:
        response.raw = data[:body_start]
        return response, data[body_start:]
    length = response.header(b"content-length")
    if length is not None:
        stop = body_start + int(length)
        if len(data) < stop:
            return None, data
        response.body = data[body_start:stop]
        response.raw = data[:stop]
        return response, data[stop:]
    if (response.header(b"transfer-encoding") or b"").lower() == b"chunked":
        pos = body_start
        body = b""
        while True:
            line_end = data.find(b"\r\n", pos)
            if line_end < 0:
                return None, data
            size = int(data[pos:line_end].split(b";")[0], 16)
            if size == 0:
                trailer_end = data.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    if data[line_end:line_end + 4] == b"\r\n\r\n":
                        trailer_end = line_end
                    else:
                        return None, data
                response.body = body
                response.raw = data[:trailer_end + 4]
                return response, data[trailer_end + 4:]
            chunk_start = line_end + 2
            if len(data) < chunk_start + size + 2:
                return None, data
            body += data[chunk_start:chunk_start + size]
            pos = chunk_start + size + 2
    # Delimited by the end of the connection: complete only once it closed.
    return None, data


class RawClient:
    """One blocking TCP connection to 127.0.0.1 (use it from a thread)."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.closed = False

    def send(self, data: bytes) -> bool:
        """Send ``data``; False when the proxy has closed or reset the connection."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _fill(self, deadline: float) -> bool:
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return False
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return False
        self.buffer += data
        return True

    def response(self, timeout: float = 10.0, head_only: bool = False) -> Response:
        """The next whole final answer (1xx skipped); status 0 if the connection ended first or time ran out."""
        deadline = time.monotonic() + timeout
        while True:
            parsed, rest = parse_response(self.buffer, head_only)
            if parsed is not None:
                self.buffer = rest
                if 100 <= parsed.status < 200:
                    continue
                return parsed
            if self.closed or time.monotonic() >= deadline or not self._fill(deadline):
                break
        end = self.buffer.find(b"\r\n\r\n")
        if self.closed and end >= 0:
            # A body delimited by the end of the connection (an HTTP/1.0 answer).
            head, _ = parse_response(self.buffer[:end] + b"\r\ncontent-length: 0\r\n\r\n")
            head.headers.pop(b"content-length", None)
            head.body = self.buffer[end + 4:]
            head.raw, self.buffer = self.buffer, b""
            return head
        return Response(raw=self.buffer)

    def wait_closed(self, timeout: float = 10.0) -> bool:
        """True once the proxy closed the connection (reads and drops what comes)."""
        deadline = time.monotonic() + timeout
        while not self.closed and time.monotonic() < deadline:
            self._fill(deadline)
        return self.closed

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def exchange(port: int, data: bytes, timeout: float = 10.0) -> Response:
    """Send ``data`` on a fresh connection and read one answer."""
    client = RawClient(port, timeout)
    try:
        client.send(data)
        return client.response(timeout, head_only=data.startswith(b"HEAD "))
    finally:
        client.close()


def connect_then_send(port: int, count: int, data: bytes, timeout: float = 15.0) -> list[Response]:
    """``count`` clients that all connect first, then each send ``data``: the answer each got (status 0: closed)."""
    clients = [RawClient(port, timeout=timeout) for _ in range(count)]
    try:
        for client in clients:
            client.send(data)
        return [client.response(timeout) for client in clients]
    finally:
        for client in clients:
            client.close()


def request_bytes(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]] = (), body: bytes = b"",
                  length: bool = True) -> bytes:
    """A request as bytes, headers exactly as given (plus Host and Content-Length unless given)."""
    names = {name.lower() for name, _ in headers}
    lines = [method + b" " + target + b" HTTP/1.1"]
    if b"host" not in names:
        lines.append(b"Host: 127.0.0.1")
    for name, value in headers:
        lines.append(name + b": " + value)
    if length and b"content-length" not in names and b"transfer-encoding" not in names and (body or method in (b"POST", b"PUT")):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# -- a backend that records the bytes it got -------------------------------------------


@implementer(IPushProducer)
class _Filler:
    """Writes ``size`` bytes as fast as the peer reads them (a big answer)."""

    def __init__(self, transport, size: int):
        self.transport = transport
        self.left = size
        self.paused = False
        self.stopped = False

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        while not self.paused and not self.stopped and self.left > 0:
            n = min(self.left, 256 * 1024)
            self.left -= n
            self.transport.write(b"x" * n)
        if self.left <= 0 and not self.stopped:
            self.stopped = True
            self.transport.unregisterProducer()

    def stopProducing(self):
        self.stopped = True


def _next_request(buffer: bytes) -> tuple[bytes, bytes, bytes] | None:
    """The first whole request in ``buffer`` (its head, its Content-Length body) and what follows it;
    None until it is all in."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if len(buffer) < end + 4 + length:
        return None
    return head, buffer[end + 4:end + 4 + length], buffer[end + 4 + length:]


class _RecordingProtocol(Protocol):
    def __init__(self, backend: "RecordingBackend"):
        self.backend = backend
        self.buffer = b""
        #: Requests answered on this connection.
        self.served = 0

    def connectionMade(self):
        self.backend.connections += 1
        self.backend.open.add(self)

    def connectionLost(self, reason):
        self.backend.open.discard(self)

    def dataReceived(self, data: bytes):
        self.buffer += data
        while (request := _next_request(self.buffer)) is not None:
            head, body, self.buffer = request
            self.answer(head, body)

    def answer(self, head: bytes, body: bytes):
        backend = self.backend
        backend.heads.append(head)
        backend.bodies.append(body)
        if backend.drop_reused and self.served:
            # Read, then the connection closed unanswered: an idle-close race, or a backend dying.
            self.transport.loseConnection()
            return
        self.served += 1
        target = head.split(b"\r\n")[0].split(b" ")[1]
        path = target.split(b"?")[0]
        if path == b"/big":
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                b"content-length: %d\r\n\r\n" % backend.big_size
            )
            filler = _Filler(self.transport, backend.big_size)
            self.transport.registerProducer(filler, True)
            filler.resumeProducing()
            return
        extra = b""
        if path == b"/set-cookie":
            extra = b"set-cookie: session=%s; Path=/\r\n" % (b"owner-" + str(len(backend.heads)).encode())
        payload = json.dumps({"n": len(backend.heads), "size": len(body)}).encode()
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
            % (extra, len(payload), b"" if head.startswith(b"HEAD ") else payload)
        )


class RecordingBackend(Factory):
    """An upstream that keeps the raw head of every request it got, and answers 200 JSON.

    ``/set-cookie`` answers with a Set-Cookie; ``/big`` streams ``big_size``
    bytes, no faster than the reader takes them.  With ``drop_reused``, a
    connection's second request is read and the connection closed unanswered.
    """

    def __init__(self, big_size: int = 64 * 1024 * 1024):
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.open: set = set()
        self.big_size = big_size
        self.drop_reused = False
        self.port = None

    def buildProtocol(self, addr):
        return _RecordingProtocol(self)

    async def listen(self, reactor=_reactor) -> int:
        self.port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(self)
        return self.port.getHost().port

    async def stop(self):
        for protocol in list(self.open):
            protocol.transport.abortConnection()
        if self.port is not None:
            await self.port.stopListening()

    def header_lines(self, index: int) -> list[bytes]:
        return self.heads[index].split(b"\r\n")[1:]

    def header_values(self, index: int, name: bytes) -> list[bytes]:
        out = []
        for line in self.header_lines(index):
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                out.append(value.strip())
        return out


async def recording_stack(config=None, reactor=_reactor, **backend_options):
    """A proxy in front of a :class:`RecordingBackend` (``stack.echo``)."""
    backend = RecordingBackend(**backend_options)
    port = await backend.listen(reactor)
    stack = await start_stack(reactor, config, upstream=f"http://127.0.0.1:{port}")
    stack.echo = backend
    # Stack.stop closes its listening ports (this one too), then the proxy's pool.
    stack._ports.append(backend.port)
    return stack


#: A request that passes even during a yield, sent to prove the upstream got nothing before it.
SENTINEL = request_bytes(b"GET", b"/api/version", [(b"X-Sentinel", b"1")])


async def assert_nothing_forwarded(stack, timeout: float = 10.0) -> None:
    """The upstream (a :class:`RecordingBackend`) got nothing so far: a request sent after reaches it, and alone.

    The proxy starts forwarding a request as soon as it has read it, so
    whatever it forwarded earlier is at the upstream before this one's
    answer is back: a positive event instead of a sleep.  The sentinel is
    then taken off the record, so later checks see only the test's requests.
    """
    from helpers import in_thread

    answer = await in_thread(_reactor, exchange, port_of(stack.proxy_url), SENTINEL, timeout, timeout=timeout + 5)
    assert answer.status == 200, answer.raw[:300]
    assert len(stack.echo.heads) == 1, stack.echo.heads
    assert stack.echo.header_values(0, b"x-sentinel") == [b"1"]
    stack.echo.heads.pop()
    stack.echo.bodies.pop()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def listen_site(site, reactor=_reactor):
    """Listen with ``site`` on a free 127.0.0.1 port: (listening port, port number)."""
    listening = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    return listening, listening.getHost().port


# -- logs -------------------------------------------------------------------------------


class LogCapture:
    """Every log event while active; ``errors()`` are the ones a test must not see."""

    def __init__(self):
        self.events: list[dict] = []

    def __call__(self, event: dict) -> None:
        self.events.append(event)

    def __enter__(self) -> "LogCapture":
        # An earlier test's garbage (an unhandled Deferred error is logged when it is
        # collected) must be reported before the capture starts, not inside it.
        gc.collect()
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc) -> None:
        globalLogPublisher.removeObserver(self)

    def errors(self) -> list[str]:
        """Tracebacks and error-level events, formatted."""
        out = []
        for event in self.events:
            level = event.get("log_level")
            if event.get("log_failure") is not None or event.get("isError") or level in (LogLevel.error, LogLevel.critical):
                failure = event.get("log_failure")
                text = formatEvent(event)
                if failure is not None:
                    text += "\n" + failure.getTraceback()
                out.append(text)
        return out

    def text(self) -> str:
        """Everything logged, formatted, plus the raw event values (for secret checks)."""
        parts = []
        for event in self.events:
            try:
                parts.append(formatEvent(event))
            except Exception:
                pass
            for key, value in event.items():
                if key in ("log_logger", "log_source", "log_observer"):
                    continue
                try:
                    parts.append(f"{key}={value!r}")
                except Exception:
                    pass
            failure = event.get("log_failure")
            if failure is not None:
                parts.append(failure.getTraceback())
        return "\n".join(parts)


# -- outcome accounting --------------------------------------------------------------------


def _registry(stack_or_proxy):
    return getattr(stack_or_proxy, "proxy", stack_or_proxy).metrics.registry


def counter_total(stack, family: str, **match) -> float:
    """The sum of a counter family's ``_total`` samples whose labels include ``match`` (a Stack or a Proxy)."""
    total = 0.0
    for metric in _registry(stack).collect():
        if metric.name != family:
            continue
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            if all(sample.labels.get(k) == v for k, v in match.items()):
                total += sample.value
    return total


def counter_by(stack, family: str, label: str, **match) -> dict[str, float]:
    """A counter family's ``_total`` samples summed by one label."""
    out: dict[str, float] = {}
    for metric in _registry(stack).collect():
        if metric.name != family:
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in match.items()):
                key = sample.labels.get(label)
                out[key] = out.get(key, 0.0) + sample.value
    return out


# -- a backend that answers what a test scripts ------------------------------------------


class _ScriptedProtocol(Protocol):
    def __init__(self, backend: "ScriptedBackend"):
        self.backend = backend
        self.buffer = b""

    def connectionMade(self):
        self.backend.connections += 1

    def dataReceived(self, data: bytes):
        self.buffer += data
        while (request := _next_request(self.buffer)) is not None:
            head, _, self.buffer = request
            backend = self.backend
            backend.heads.append(head)
            answer, then = backend.answers[min(len(backend.heads), len(backend.answers)) - 1]
            self.transport.write(answer)
            if then == "close":
                self.transport.loseConnection()
            elif then == "abort":
                self.transport.abortConnection()
            elif then == "abort_soon":
                _reactor.callLater(0.05, self.transport.abortConnection)
            if then != "keep":
                return  # "stall": nothing more, the connection left open


class ScriptedBackend(Factory):
    """An upstream that answers its n-th request with the n-th of ``answers`` (the last one repeats).

    Each answer is ``(bytes, then)``: the exact bytes written, then ``keep``
    (the connection stays for the next request), ``close`` (a clean close),
    ``abort`` (a reset), ``abort_soon`` (a reset 50 ms later, on the global
    reactor: for real sockets, so that the bytes arrive before it) or ``stall`` (nothing more, the connection left
    open).  ``heads`` keeps each request's head, ``connections`` counts them.
    """

    def __init__(self, *answers: tuple[bytes, str]):
        self.answers = list(answers)
        self.heads: list[bytes] = []
        self.connections = 0

    def buildProtocol(self, addr):
        return _ScriptedProtocol(self)
