"""What a move through the house idiom costs, against the upstream parser's bare states.

docs/architecture.md ("Named states") keeps two bare states in the upstream
client's parser: the response's framing (``h1parse.ResponseParser._state``)
and where a chunked body is (``h1wire.ChunkDecoder._phase``).  This prints
what keeps them bare: a move through :meth:`yieldproxy.states.Machine.fire`
against a slot assignment, and what the parser costs per answer and per
chunk, so the share a table-driven parser would add can be read off.  In
this process, no sockets; the CPU time of the process (``time.process_time``),
best of ``--rounds``.

* **embedding answer**: a 200 with a 4 KB body framed by Content-Length, in
  one piece (four moves of the parser's state);
* **streamed answer**: a chunked NDJSON answer of 200 chat chunks, a piece
  each (three moves of the chunk decoder per chunk).
"""

from __future__ import annotations

import argparse
import enum
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from yieldproxy.edge.h1parse import ResponseParser  # noqa: E402
from yieldproxy.states import Machine, Moves  # noqa: E402

#: Moves of the parser's state for one answer framed by Content-Length (start, the head, its framing,
#: the end), and of the chunk decoder's phase for one chunk (its size line, its data, its CRLF).
MOVES_PER_ANSWER = 4
MOVES_PER_CHUNK = 3


class _Events:
    """Takes every event and does nothing: only the parsing is measured."""

    def on_head(self, *head: object) -> None:
        pass

    def on_body(self, data: bytes) -> None:
        pass

    def on_end(self, keep_alive: bool) -> None:
        pass


class _Side(enum.Enum):
    A = "a"
    B = "b"


class _Switch(Machine[_Side, str]):
    """A machine of two states and no hooks: the cheapest move the idiom makes."""

    __slots__ = ()
    moves = Moves("a switch", {(_Side.A, "flip"): _Side.B, (_Side.B, "flip"): _Side.A})

    def __init__(self) -> None:
        self.state = _Side.A


class _Bare:
    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = 0


def _best(run, count: int, rounds: int) -> float:
    """Nanoseconds per call of ``run``, best of ``rounds`` runs of ``count`` calls."""
    best = float("inf")
    for _ in range(rounds):
        began = time.process_time()
        for _ in range(count):
            run()
        best = min(best, time.process_time() - began)
    return best / count * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    embed = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
             b"Date: Mon, 07 Dec 2026 11:00:00 GMT\r\nContent-Length: 4096\r\n\r\n" + b"x" * 4096)
    line = b'{"model":"m","created_at":"2026-12-07T11:00:00Z","message":{"role":"assistant","content":"tok"},"done":false}\n'
    stream = [b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"]
    stream += [b"%x\r\n" % len(line) + line + b"\r\n" for _ in range(200)] + [b"0\r\n\r\n"]
    response = ResponseParser(_Events())

    def one_embedding() -> None:
        response.start()
        response.feed(embed)

    def one_stream() -> None:
        response.start()
        for piece in stream:
            response.feed(piece)

    switch, bare = _Switch(), _Bare()

    def fire_twice() -> None:
        switch.fire("flip")
        switch.fire("flip")

    def assign_twice() -> None:
        bare._state = 1
        bare._state = 0

    fire = _best(fire_twice, 100_000, args.rounds) / 2
    assign = _best(assign_twice, 100_000, args.rounds) / 2
    answer = _best(one_embedding, 10_000, args.rounds)
    chunk = _best(one_stream, 200, args.rounds) / 200
    extra = fire - assign
    print(f"a move through fire (no hook):   {fire:7.0f} ns")
    print(f"a slot assignment:               {assign:7.0f} ns")
    print(f"parsing an embedding's answer:   {answer:7.0f} ns; {MOVES_PER_ANSWER} moves through fire would add "
          f"{MOVES_PER_ANSWER * extra:.0f} ns ({MOVES_PER_ANSWER * extra / answer:.0%})")
    print(f"parsing a chunk of a stream:     {chunk:7.0f} ns; {MOVES_PER_CHUNK} moves through fire would add "
          f"{MOVES_PER_CHUNK * extra:.0f} ns ({MOVES_PER_CHUNK * extra / chunk:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
