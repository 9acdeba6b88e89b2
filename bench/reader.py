"""What reading a request costs: the edge's request reader against h11 and Twisted's HTTPChannel.

The request reader (``yieldproxy/edge/reader.py``) is the hottest code of the
proxy: every byte a client sends goes through it.  Here it reads the same
streams as h11 and as Twisted's ``HTTPChannel`` (what the listener is built on
today: a LineReceiver calling back for every line and every header), in this
process, no sockets: only the parsing is measured.

* **typical**: 300 requests as an Ollama client sends them (a 300-byte head:
  request line, Host, User-Agent, Accept, Content-Type, Connection...; a 2 KB
  JSON body framed by Content-Length), each arriving in one piece (one
  ``dataReceived`` each);
* **large**: one request with a 1 MB body, arriving in 64 KB pieces (the head
  in the first).

Each reader is driven as a server connection would: bytes in, then every event
taken (the body bytes counted), then on to the next request.  h11 gets a new
``Connection`` per request (it must send an answer before it reads the next
one; its constructor is a few microseconds of the figure); HTTPChannel gets a
request object that does nothing but take what the channel hands it (so what
is measured is the channel, not twisted.web's Request).  What is timed is
the CPU time of the process (``time.process_time``: a turn lost to another
process is not counted), the runs alternate (reader, h11, channel, reader,
...) and the best of ``--rounds`` is kept, so that a busy machine slows all
three alike.

Printed: microseconds per request for each, and the ratios.  Target: the
reader at most half of HTTPChannel's time on the typical stream (it "beats it
clearly").

    .venv/bin/python bench/reader.py [--rounds 60] [--requests 300]
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import SRC

sys.path.insert(0, str(SRC))  # the tree measured (YIELDPROXY_BENCH_SRC, else this checkout)

import h11  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402
from twisted.web.http import HTTPChannel  # noqa: E402
from twisted.web.http_headers import Headers  # noqa: E402

from yieldproxy.edge.reader import NEED_DATA, PAUSED, BodyData, RequestReader  # noqa: E402

#: The reader at most this fraction of HTTPChannel's time on the typical stream.
TARGET = 0.5


def typical_request(index: int) -> bytes:
    body = b'{"model":"nomic-embed-text","input":"' + b"x" * 1990 + b'%06d"}' % index
    return (
        b"POST /api/embed HTTP/1.1\r\n"
        b"Host: 127.0.0.1:11434\r\n"
        b"User-Agent: ollama-python/0.4.7 (x86_64 linux) Python/3.11.7\r\n"
        b"Accept: application/json\r\n"
        b"Accept-Encoding: gzip, deflate\r\n"
        b"Content-Type: application/json\r\n"
        b"Connection: keep-alive\r\n"
        b"X-Request-Id: 7f3c2a9e-51b4-4c8e-9d61-%012d\r\n"
        b"Content-Length: %d\r\n\r\n" % (index, len(body))
    ) + body


def large_request() -> list[bytes]:
    body = b"y" * (1 << 20)
    data = (
        b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1:11434\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    return [data[i : i + 65536] for i in range(0, len(data), 65536)]


# -- the three readers: each returns the body bytes it was handed --------------------------


def run_reader(pieces: list[bytes]) -> int:
    reader = RequestReader()
    received = 0
    for piece in pieces:
        reader.feed(piece)
        while True:
            event = reader.next_event()
            if event is NEED_DATA:
                break
            if event is PAUSED:
                reader.start_next()
                continue
            if type(event) is BodyData:
                received += len(event.data)
    return received


def run_h11(pieces: list[bytes]) -> int:
    received = 0
    conn = h11.Connection(h11.SERVER)
    for piece in pieces:
        conn.receive_data(piece)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                break
            if type(event) is h11.Data:
                received += len(event.data)
            elif type(event) is h11.EndOfMessage:
                conn = h11.Connection(h11.SERVER)  # the next request (see the module docstring)
                break
    return received


class _Taker:
    """What HTTPChannel hands a request to: takes it, nothing more (the channel's cost alone is measured)."""

    received = 0

    def __init__(self, channel, queued=None):
        self.channel = channel
        self.requestHeaders = Headers()
        self.responseHeaders = Headers()

    def parseCookies(self):
        pass

    def gotLength(self, length):
        pass

    def handleContentChunk(self, data):
        _Taker.received += len(data)

    def requestReceived(self, command, path, version):
        self.channel.requestDone(self)

    def connectionLost(self, reason):
        pass


def run_channel(pieces: list[bytes]) -> int:
    _Taker.received = 0
    channel = HTTPChannel()
    channel.requestFactory = _Taker
    channel.makeConnection(StringTransport())
    for piece in pieces:
        channel.dataReceived(piece)
    return _Taker.received


RUNNERS = {"reader": run_reader, "h11": run_h11, "HTTPChannel": run_channel}


def measure(pieces: list[bytes], requests: int, rounds: int, body: int) -> dict[str, float]:
    """Microseconds per request for each reader, the best of ``rounds`` alternated runs."""
    best = {name: float("inf") for name in RUNNERS}
    for _ in range(rounds):
        for name, run in RUNNERS.items():
            start = time.process_time()
            received = run(pieces)
            elapsed = time.process_time() - start
            assert received == body, (name, received, body)
            best[name] = min(best[name], elapsed / requests * 1e6)
    return best


def report(title: str, figures: dict[str, float]) -> float:
    ours = figures["reader"]
    print(f"{title}:")
    for name, micros in figures.items():
        ratio = "" if name == "reader" else f"   reader / {name} = {ours / micros:.3f}"
        print(f"  {name:12s} {micros:9.2f} us/request{ratio}")
    return ours / figures["HTTPChannel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    typical = [typical_request(i) for i in range(args.requests)]
    head_end = typical[0].index(b"\r\n\r\n") + 4
    print(f"typical request: {head_end}-byte head, {len(typical[0]) - head_end}-byte body, one piece each")
    body = sum(len(r) - r.index(b"\r\n\r\n") - 4 for r in typical)
    ratio = report("typical", measure(typical, args.requests, args.rounds, body))
    large = large_request()
    print(f"large request: 1 MiB body in {len(large)} pieces of 64 KiB")
    report("large", measure(large, 1, args.rounds, 1 << 20))
    verdict = "OK" if ratio <= TARGET else "MISS"
    print(f"typical: reader / HTTPChannel = {ratio:.3f} (target <= {TARGET}) {verdict}")


if __name__ == "__main__":
    main()
