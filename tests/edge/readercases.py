"""Driving the edge's request reader (yieldproxy/edge/reader.py) in tests, and the table of its rules.

:func:`drive` feeds a reader pieces of input the way a server connection
would (every event taken after each piece, ``start_next`` at once after each
request) and checks, at every step, what must hold whatever the input: it
raises nothing, it never returns an event without reading input or moving,
every byte fed is either read (``consumed``) or waiting (``read_ahead``, the
very bytes at the end of the input), a head's ``head_bytes`` are the bytes it
took.  What it returns, :class:`Outcome`, is the same however the input is cut
(body bytes are joined between two other events): the tests compare it across
splits.

:data:`RULES` is every rule of the reader with an input that breaks it and the
answer: ``tests/edge/test_edge_reader.py`` checks the reader gives it.  Each
answer is the one the listener gave before the edge was the proxy's own
(Twisted's HTTPChannel with httpserver.py's hardening; a test fed both the
same bytes until that channel was gone), or names why it differs.
"""

from __future__ import annotations

import random

import attrs

from yieldproxy.edge.reader import (
    DEFAULT_LIMITS,
    NEED_DATA,
    PAUSED,
    STATES,
    BodyData,
    ChunkAnnounced,
    EndOfMessage,
    Limits,
    RequestHead,
    RequestReader,
)

#: Most next_event calls one piece may take: far more than any input here can need (a bound, not a wait).
MAX_CALLS = 100_000


@attrs.frozen
class Outcome:
    """What a reader made of an input: its events (body bytes joined), its last state, what it left unread."""

    events: tuple
    state: str
    read_ahead: bytes


def pieces_of(data: bytes, cuts) -> list[bytes]:
    """``data`` cut at the positions ``cuts`` (any order, duplicates and out-of-range ones ignored)."""
    points = sorted({c for c in cuts if 0 < c < len(data)})
    out = []
    last = 0
    for point in points:
        out.append(data[last:point])
        last = point
    out.append(data[last:])
    return out


def splits(data: bytes, seed: int = 0) -> list[list[bytes]]:
    """The cuts every input is read with: whole, a byte at a time, and three random cuttings."""
    rng = random.Random(seed)
    out = [[data], [data[i : i + 1] for i in range(len(data))] or [b""]]
    for _ in range(3):
        out.append(pieces_of(data, [rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 8))]))
    return out


def drive(pieces: list[bytes], limits: Limits = DEFAULT_LIMITS, eof: bool = True, reader: RequestReader | None = None) -> Outcome:
    """Feed ``pieces`` (then the end of input, with ``eof``) to a reader, taking every event; check the invariants."""
    reader = reader if reader is not None else RequestReader(limits)
    # The input, from the first byte the reader holds: byte i of it is byte offset + i of all it was ever fed.
    offset = reader.consumed
    stream = bytearray(reader.read_ahead)
    events: list = []
    request_start = reader.consumed
    body = bytearray()
    head: RequestHead | None = None

    def check_accounting() -> None:
        assert reader.state in STATES
        ahead = reader.read_ahead
        assert type(ahead) is bytes
        # Every byte fed is read or waiting, and what waits is the end of the input.
        assert reader.consumed + len(ahead) == offset + len(stream), (reader.consumed, len(ahead), len(stream))
        assert ahead == stream[reader.consumed - offset :]

    def take() -> None:
        nonlocal request_start, head, body
        for _ in range(MAX_CALLS):
            before = (reader.consumed, reader.state)
            event = reader.next_event()
            check_accounting()
            if event is NEED_DATA or event is PAUSED:
                # Reading on (lines of a head, the first byte) may have moved it; asking again changes nothing.
                now = (reader.consumed, reader.state)
                assert reader.next_event() is event
                assert (reader.consumed, reader.state) == now
                if event is PAUSED and reader.state == "done":
                    reader.start_next()
                    assert reader.state == "idle"
                    request_start = reader.consumed
                    continue
                return
            # Every event reads input or moves the reader: it never loops in place.
            assert (reader.consumed, reader.state) != before, event
            if type(event) is BodyData:
                assert event.data and type(event.data) is bytes
                body += event.data
                if events and type(events[-1]) is BodyData:
                    events[-1] = BodyData(events[-1].data + event.data)
                    continue
            elif type(event) is RequestHead:
                assert reader.consumed - request_start == event.head_bytes
                assert event.version in (b"HTTP/1.1", b"HTTP/1.0")
                assert event.length is None or not event.chunked
                head, body = event, bytearray()
            elif type(event) is ChunkAnnounced:
                assert event.size > 0
            elif type(event) is EndOfMessage:
                assert reader.state == "done"
                assert head is not None
                if head.length is not None:
                    assert len(body) == head.length
                    assert reader.consumed - request_start == head.head_bytes + head.length
            events.append(event)
        raise AssertionError(f"more than {MAX_CALLS} events from one piece: the reader loops")

    take()  # what a reader given to it holds already
    for piece in pieces:
        reader.feed(piece)
        stream.extend(piece)
        check_accounting()
        take()
    if eof:
        reader.feed_eof()
        take()
        assert reader.state in ("closed", "error")
    return Outcome(tuple(events), reader.state, reader.read_ahead)


def read(data: bytes, limits: Limits = DEFAULT_LIMITS, eof: bool = True) -> Outcome:
    """What a reader makes of ``data``, checked to be the same for every cutting of it (:func:`splits`)."""
    outcomes = [drive(pieces, limits, eof) for pieces in splits(data)]
    for outcome in outcomes[1:]:
        assert outcome == outcomes[0], (data[:200], outcomes[0], outcome)
    return outcomes[0]


# -- the rules -------------------------------------------------------------------------------

POST = b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"

MALFORMED = "malformed HTTP request"
BARE_LF = "a request line or header line ends in a bare LF (lines end in CRLF)"
BARE_LF_CHUNK = "a chunk line ends in a bare LF (chunk lines end in CRLF)"
DIGITS = "a chunk size of more than 16 hex digits"
NOT_CHUNKED = "Transfer-Encoding must be chunked (no other coding is accepted)"
CONFLICTING = "invalid or conflicting Content-Length / Transfer-Encoding"
FOLDED = "a header line starts with a space or tab (folded header lines are not accepted)"


@attrs.frozen
class Rule:
    """An input that breaks one rule, and the reader's answer: (status, message, code).

    The reader answers as today's listener does when it is fed the input a
    byte at a time, but where ``today`` says what today's answers instead
    (``why`` says why the reader does not).  ``whole``: today's answer when
    the input comes in one piece, where the cut changes it (it never changes
    the reader's).
    """

    id: str
    data: bytes
    status: int
    message: str
    today: tuple | None = None
    why: str = ""
    whole: tuple | None = None

    @property
    def code(self) -> str:
        return {400: "bad_request", 414: "uri_too_long", 431: "headers_too_large"}[self.status]


SERVED = "served"  # today's answer to a request it reads and serves
#: Why the reader's answer does not depend on the cut, where today's does.
_CUT = (
    "the rule the bytes break first, in the order they come, is the one answered: today's listener says "
    "so fed a byte at a time, but whole it checks the lines that came with their CRLF before the last, "
    "unfinished one"
)

RULES = [
    # Lines end in CRLF: a bare LF is refused when it comes.
    Rule("lf-ends-request-line", b"GET / HTTP/1.1\nHost: x\r\n\r\n", 400, BARE_LF, whole=(400, MALFORMED), why=_CUT),
    Rule("lf-ends-header", POST + b"Content-Length: 3\nX-Note: a\r\n\r\nabc", 400, BARE_LF, whole=(400, MALFORMED), why=_CUT),
    Rule("lf-in-value", POST + b"X-Note: a\nX-Injected: 1\r\n\r\n", 400, BARE_LF, whole=(400, MALFORMED), why=_CUT),
    Rule("lf-blank-line", POST + b"Content-Length: 3\r\n\nabc", 400, BARE_LF),
    Rule("lf-head", b"POST /api/embed HTTP/1.1\nHost: 127.0.0.1\nContent-Length: 3\n\nabc", 400, BARE_LF),
    Rule("lf-in-target", b"GET /api/tags?q=\nX-Injected:1 HTTP/1.1\r\nHost: x\r\n\r\n", 400, BARE_LF, whole=(400, MALFORMED), why=_CUT),
    Rule("lf-first", b"\nGET / HTTP/1.1\r\n\r\n", 400, BARE_LF, whole=(400, MALFORMED), why=_CUT),
    Rule("lf-unfinished", b"GET / HTTP/1.1\r\nX: a\n", 400, BARE_LF),
    Rule("cr-in-value", POST + b"X-Note: a\rX-Injected: 1\r\n\r\n", 400, MALFORMED),
    Rule("cr-in-target", b"GET /\r HTTP/1.1\r\n\r\n", 400, MALFORMED),
    # The request line.
    Rule("two-words", b"GET /\r\n\r\n", 400, MALFORMED),
    Rule("four-words", b"GET / HTTP/1.1 x\r\n\r\n", 400, MALFORMED),
    Rule("double-space", b"GET  / HTTP/1.1\r\n\r\n", 400, MALFORMED),
    Rule("method-not-token", b"G(T / HTTP/1.1\r\n\r\n", 400, MALFORMED),
    Rule("empty-target", b"GET  HTTP/1.1\r\n\r\n", 400, MALFORMED),
    Rule("tab-in-target", b"GET /\t HTTP/1.1\r\n\r\n", 400, MALFORMED),
    Rule("nul-in-target", b"GET /\x00 HTTP/1.1\r\n\r\n", 400, MALFORMED),
    Rule("high-byte-in-target", b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n", 400, MALFORMED),
    Rule(
        "del-in-target", b"GET /a\x7f HTTP/1.1\r\nHost: x\r\n\r\n", 400, MALFORMED, today=(SERVED,),
        why="a target is visible ASCII (RFC 9112 3.2; h11 refuses it too); Twisted takes bytes up to 176 (an "
            "octal 0o176 written as decimal)",
    ),
    Rule(
        "continuation-byte-in-target", b"GET /a\x80 HTTP/1.1\r\nHost: x\r\n\r\n", 400, MALFORMED,
        today=(400, "the request path is not valid UTF-8 (once percent-decoded)"),
        why="the same 400, found by the reader (as h11 does) instead of the request's UTF-8 check",
    ),
    Rule("version-1.2", b"GET / HTTP/1.2\r\n\r\n", 400, MALFORMED),
    Rule("version-2", b"GET / HTTP/2.0\r\n\r\n", 400, MALFORMED),
    Rule("version-0.9", b"GET /\r\n", 400, MALFORMED),
    Rule("version-lowercase", b"GET / http/1.1\r\n\r\n", 400, MALFORMED),
    Rule("two-empty-lines-first", b"\r\n\r\nGET / HTTP/1.1\r\n\r\n", 400, MALFORMED),
    # Header lines.
    Rule("no-colon", POST + b"X-Note\r\n\r\n", 400, MALFORMED),
    Rule("space-before-colon", POST + b"X-Note : a\r\n\r\n", 400, MALFORMED),
    Rule("space-in-name", POST + b"X Note: a\r\n\r\n", 400, MALFORMED),
    Rule("empty-name", POST + b": a\r\n\r\n", 400, MALFORMED),
    Rule("nul-in-value", POST + b"X-Note: a\x00X-Injected: 1\r\n\r\n", 400, MALFORMED),
    Rule(
        "vt-in-value", POST + b"X-Note: a\x0bb\r\n\r\n", 400, MALFORMED, today=(SERVED,),
        why="h11 refuses VT and FF in a value: the reader is never looser than h11",
    ),
    Rule(
        "ff-in-value", POST + b"X-Note: a\x0cb\r\n\r\n", 400, MALFORMED, today=(SERVED,),
        why="as VT",
    ),
    Rule(
        "folded", POST + b"X-Note: a\r\n X-Injected: 1\r\n\r\n", 400, FOLDED, today=(SERVED,),
        why="RFC 9112 5.2 lets a server refuse obsolete folding with a 400; joined, a value is not what a "
            "client that does not fold reads (the reader's API: obs-fold is a 400)",
    ),
    Rule("folded-by-tab", POST + b"X-Note: a\r\n\tb\r\n\r\n", 400, FOLDED, today=(SERVED,), why="as folded"),
    Rule("folded-first", POST[:-2] + b"\r\n b\r\n\r\n", 400, FOLDED, today=(SERVED,), why="as folded"),
    # One framing.
    Rule("cl-te", POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, CONFLICTING),
    Rule("te-cl", POST + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", 400, CONFLICTING),
    Rule("cl-cl-differ", POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef", 400, CONFLICTING),
    Rule("cl-cl-same", POST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nabcde", 400, CONFLICTING),
    Rule("cl-list", POST + b"Content-Length: 5, 5\r\n\r\nabcde", 400, CONFLICTING),
    Rule("cl-plus", POST + b"Content-Length: +5\r\n\r\nabcde", 400, CONFLICTING),
    Rule("cl-negative", POST + b"Content-Length: -1\r\n\r\n", 400, CONFLICTING),
    Rule("cl-empty", POST + b"Content-Length: \r\n\r\n", 400, CONFLICTING),
    Rule("cl-hex", POST + b"Content-Length: 0x5\r\n\r\nabcde", 400, CONFLICTING),
    Rule("cl-inner-space", POST + b"Content-Length: 1 0\r\n\r\n", 400, CONFLICTING),
    Rule(
        "cl-19-digits", POST + b"Content-Length: 0000000000000000005\r\n\r\nabcde", 400, CONFLICTING,
        today=(SERVED,),
        why="at most 18 digits (under 2**63, as Go and nginx; h11 takes 20): Twisted reads any number, and "
            "raises past 4300 digits",
    ),
    Rule(
        "cl-5000-digits", POST + b"Content-Length: " + b"1" * 5000 + b"\r\n\r\n", 400, CONFLICTING,
        today=("raises",),
        why="Twisted's int() takes at most 4300 digits: its ValueError leaves dataReceived (a traceback in "
            "the log, the connection dropped unanswered)",
    ),
    Rule("te-identity", POST + b"Transfer-Encoding: identity\r\nContent-Length: 3\r\n\r\nabc", 400, NOT_CHUNKED),
    Rule("te-gzip-chunked", POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 400, NOT_CHUNKED),
    Rule("te-chunked-chunked", POST + b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n", 400, NOT_CHUNKED),
    Rule("te-unknown", POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400, NOT_CHUNKED),
    Rule("te-empty", POST + b"Transfer-Encoding: \r\n\r\n", 400, NOT_CHUNKED),
    Rule("te-te", POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, CONFLICTING),
    # Chunks.
    Rule("chunk-size-17-digits", CHUNKED + b"1" + b"0" * 16 + b"\r\n" + b"x" * 64, 400, DIGITS),
    Rule("chunk-size-40-digits", CHUNKED + b"f" * 40 + b"\r\nabc\r\n0\r\n\r\n", 400, DIGITS),
    Rule("chunk-size-17-zeros", CHUNKED + b"0" * 17 + b"\r\n\r\n", 400, DIGITS),
    Rule("chunk-size-unfinished", CHUNKED + b"1" * 17, 400, DIGITS),
    Rule("lf-after-chunk-size", CHUNKED + b"3\nabc\r\n0\r\n\r\n", 400, BARE_LF_CHUNK),
    Rule("lf-last-chunk", CHUNKED + b"3\r\nabc\r\n0\n\n", 400, BARE_LF_CHUNK),
    Rule("lf-trailer", CHUNKED + b"3\r\nabc\r\n0\r\nX-Trailer: 1\n\r\n", 400, BARE_LF_CHUNK),
    Rule("lf-blank-after-trailers", CHUNKED + b"3\r\nabc\r\n0\r\n\n", 400, BARE_LF_CHUNK),
    Rule("chunk-size-not-hex", CHUNKED + b"xyz\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-size-empty", CHUNKED + b"\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-size-0x", CHUNKED + b"0x3\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-size-plus", CHUNKED + b"+3\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-size-blank", CHUNKED + b"3 \r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-size-blank-before-ext", CHUNKED + b"3 ;a=b\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-ext-backslash", CHUNKED + b"3;a\\b\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-ext-nul", CHUNKED + b"3;a\x00\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-ext-cr", CHUNKED + b"3;a\rb\r\nabc\r\n0\r\n\r\n", 400, MALFORMED),
    Rule("chunk-not-crlf", CHUNKED + b"3\r\nabcX0\r\n\r\n", 400, MALFORMED),
    Rule(
        "chunk-lf-only", CHUNKED + b"3\r\nabc\n", 400, MALFORMED, today=("waits",),
        why="chunk data must be followed by CRLF: the reader refuses what follows at once, Twisted waits "
            "for a second byte (the read timeout's 408 if it never comes)",
    ),
    Rule(
        "chunk-line-too-long", CHUNKED + b"3;" + b"e" * 5000 + b"\r\nabc\r\n0\r\n\r\n", 400, MALFORMED,
    ),
    Rule(
        "trailer-not-a-field", CHUNKED + b"3\r\nabc\r\n0\r\nno colon here\r\n\r\n", 400, MALFORMED,
        today=(SERVED,), why="a trailer line is a field line (h11 refuses it too); Twisted takes any line",
    ),
    Rule(
        "trailer-nul-in-value", CHUNKED + b"3\r\nabc\r\n0\r\nX-T: a\x00b\r\n\r\n", 400, MALFORMED, today=(SERVED,),
        why="a trailer's value is checked as a header's",
    ),
    Rule(
        "trailer-cr-in-value", CHUNKED + b"3\r\nabc\r\n0\r\nX-T: a\rb\r\n\r\n", 400, MALFORMED, today=(SERVED,),
        why="a trailer's value is checked as a header's",
    ),
    Rule(
        "trailer-folded", CHUNKED + b"3\r\nabc\r\n0\r\nX-T: 1\r\n 2\r\n\r\n", 400, MALFORMED, today=(SERVED,),
        why="as a folded header",
    ),
    Rule(
        "trailers-too-long", CHUNKED + b"3\r\nabc\r\n0\r\n" + b"X-T: %s\r\n" % (b"t" * 1000) * 17 + b"\r\n", 400,
        MALFORMED, today=(SERVED,),
        why="the reader's limit is max_trailer_bytes, 16 KiB (Twisted's is 64 KiB)",
    ),
    # Limits.
    Rule("request-line-too-long", b"GET /api/tags?" + b"q" * 20000 + b" HTTP/1.1\r\n\r\n", 414,
         "request line longer than 16384 bytes"),
    Rule("request-line-unfinished", b"GET /api/tags?" + b"q" * 20000, 414, "request line longer than 16384 bytes"),
    Rule("request-line-too-long-after-blank", b"\r\nGET /" + b"q" * 20000 + b" HTTP/1.1\r\n\r\n", 414,
         "request line longer than 16384 bytes"),
    Rule("header-line-too-long", POST + b"X-Big: " + b"a" * 20000 + b"\r\n\r\n", 431,
         "a header line is longer than 16384 bytes"),
    Rule("header-line-unfinished", b"GET /api/tags HTTP/1.1\r\nX-Endless: " + b"e" * 17000, 431,
         "a header line is longer than 16384 bytes"),
    Rule("headers-too-large", POST + b"".join(b"X-B%d: %s\r\n" % (i, b"b" * 1000) for i in range(20)) + b"\r\n",
         431, "request headers larger than 16384 bytes"),
    Rule("too-many-headers", POST + b"".join(b"X-H%d: v\r\n" % i for i in range(150)) + b"\r\n", 431,
         "more than 100 request headers"),
    Rule("101-headers", b"GET / HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n", 431,
         "more than 100 request headers"),
    Rule(
        "bare-lf-beats-a-later-length", b"GET /\n" + b"q" * 20000, 400, BARE_LF,
        whole=(414, "request line longer than 16384 bytes"), why=_CUT,
    ),
]
