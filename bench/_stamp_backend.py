"""A tiny HTTP backend that records when each request arrives (``time.monotonic()``).

Not a benchmark itself: ``resume_latency.py`` starts it in its own process.
CLOCK_MONOTONIC is one clock for every process on Linux, so its stamps can
be compared with the benchmark's own.

* any ``POST``: the arrival time of the request's first byte is recorded, and
  a small Ollama-shaped embedding answer goes back (200, Content-Length);
* ``GET /_stamps``: ``{"stamps": [...]}``, the times recorded since the last
  such call (then cleared).

It prints ``listening on 127.0.0.1:PORT`` and serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

ANSWER = b'{"model":"nomic-embed-text","embeddings":[[0.1,0.2,0.3,0.4]]}'

stamps: list[float] = []


def _response(body: bytes, close: bool) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
        % (len(body), b"Connection: close\r\n" if close else b"", body)
    )


class Stamp(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, Content-Length bodies only (what the proxy sends)."""

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A bytearray: appending to bytes would copy a 30 MB body over and over.
        self.buf = bytearray()
        self.started: float | None = None

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.buf:
            self.started = now
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            total = end + 4 + length
            if len(self.buf) < total:
                return
            del self.buf[:total]
            close = b"connection: close" in head
            if head.startswith(b"post "):
                stamps.append(self.started)
                self.transport.write(_response(ANSWER, close))
            elif head.startswith(b"get /_stamps"):
                body = json.dumps({"stamps": stamps}).encode()
                stamps.clear()
                self.transport.write(_response(body, close))
            else:
                self.transport.write(_response(b"{}", close))
            if close:
                self.transport.close()
                return
            self.started = now if self.buf else None


async def main() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Stamp, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(f"listening on 127.0.0.1:{port}", flush=True)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await stop
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
