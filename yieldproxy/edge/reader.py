"""The I/O-free HTTP/1.1 request reader: bytes in, events out.

A connection :meth:`~RequestReader.feed`\\ s it what its socket reads and asks
for :meth:`~RequestReader.next_event` until it says :data:`NEED_DATA` (feed
more) or :data:`PAUSED` (the request ended: answer it, then
:meth:`~RequestReader.start_next`).  No clock, no transport, no logging: the
connection owns time and resources; this owns the rules of framing (CRLF
only, one framing, bounded lines and heads), found in the order the bytes
come, so that the events are the same however the bytes are cut.  Its states
and every move between them are one table, :data:`TRANSITIONS` (as h11's
``_state.py`` does it): the reader moves only through
:meth:`RequestReader._to`, which raises on a move that is not there.

The rules, one by one: docs/architecture.md (*The HTTP edge*);
``tests/edge/readercases.py`` has a case for each.
"""

from __future__ import annotations

import re
from typing import Final, Union

import attrs

from .h1wire import (
    BAD_VALUE,
    BARE_LF,
    CHUNK_DIGITS,
    DATA,
    END,
    MAX_CHUNK_SIZE_DIGITS,
    NEED,
    SIZE,
    TOKEN,
    ChunkDecoder,
    WireError,
    parse_length,
)
from .refusal import Refusal

# -- limits ---------------------------------------------------------------------------------


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be a whole number of at least 1, not {value!r}")


@attrs.frozen
class Limits:
    """How much of a request the reader takes before it refuses it."""

    #: The request line and header lines together, without their CRLFs (Twisted's count): past it, 431.
    max_head_bytes: int = attrs.field(default=16384, validator=_positive)
    #: One line, without its CRLF: a request line past it is a 414, a header line a 431.
    max_line_bytes: int = attrs.field(default=16384, validator=_positive)
    #: Header lines: past it, 431.
    max_headers: int = attrs.field(default=100, validator=_positive)
    #: A chunk-size line with its extensions, without its CRLF: past it, 400 (Twisted's: 1023; h1parse's: 4096).
    max_chunk_line: int = attrs.field(default=4096, validator=_positive)
    #: The trailers: their lines with their CRLFs and the empty line that ends them: past it, 400 (Twisted's: 64 KiB).
    max_trailer_bytes: int = attrs.field(default=16384, validator=_positive)


#: The limits of the proxy listener.
DEFAULT_LIMITS: Final = Limits()


# -- events ---------------------------------------------------------------------------------


@attrs.define  # not frozen: one per request, and a frozen __init__ costs twice (servers.base.Asked)
class RequestHead:
    """A request line and its headers, read and checked.

    ``headers`` keeps the names as sent, their order and repeats.  ``length``
    is the Content-Length when one was sent (0 included), None otherwise
    (chunked, or no body).  ``keep_alive``: HTTP/1.1 and no ``close`` among
    the ``Connection`` tokens (an HTTP/1.0 request is never kept alive, as
    Twisted never did).  ``expect_continue``: HTTP/1.1 and the first
    ``Expect`` is ``100-continue`` (as Twisted reads it).  ``head_bytes``: the
    bytes the head took on the wire, with its CRLFs and an empty line skipped
    before it.
    """

    method: bytes
    target: bytes
    version: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    length: int | None
    chunked: bool
    keep_alive: bool
    expect_continue: bool
    head_bytes: int


@attrs.frozen
class ChunkAnnounced:
    """A chunk's size line was read: ``size`` bytes of body are coming (the last chunk, of size 0, is not announced)."""

    size: int


@attrs.define  # not frozen: made for each read of body bytes (as RequestHead)
class BodyData:
    """Body bytes, de-chunked; never empty."""

    data: bytes


@attrs.frozen
class EndOfMessage:
    """The request is complete (its trailers, if any, were read and dropped)."""


@attrs.frozen
class Incomplete:
    """The client closed its side in the middle of a request."""


@attrs.frozen
class Closed:
    """The client closed its side between requests."""


Event = Union[RequestHead, ChunkAnnounced, BodyData, EndOfMessage, Refusal, Incomplete, Closed]


class NeedData:
    """Nothing more until more bytes are fed (the type of :data:`NEED_DATA`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


class Paused:
    """Nothing more until :meth:`RequestReader.start_next` (state done), or ever (error, closed)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PAUSED"


NEED_DATA: Final = NeedData()
PAUSED: Final = Paused()

_END_OF_MESSAGE: Final = EndOfMessage()
_INCOMPLETE: Final = Incomplete()
_CLOSED: Final = Closed()

# -- states ---------------------------------------------------------------------------------

#: idle: between requests, no byte of the next one read; head: reading a request's head; body: its
#: body; done: the request is read (until start_next); error: refused; closed: the client closed.
STATES: Final = ("idle", "head", "body", "done", "error", "closed")

#: Every move: (state, what happened) -> the next state.  What happened is an event's kind (its class
#: name), "bytes" (the first byte of a request arrived) or "start_next".  Nothing else moves the reader.
TRANSITIONS: Final[dict[tuple[str, str], str]] = {
    ("idle", "bytes"): "head",
    ("idle", "Closed"): "closed",
    ("head", "RequestHead"): "body",
    ("head", "Refusal"): "error",
    ("head", "Incomplete"): "closed",
    ("body", "ChunkAnnounced"): "body",
    ("body", "BodyData"): "body",
    ("body", "EndOfMessage"): "done",
    ("body", "Refusal"): "error",
    ("body", "Incomplete"): "closed",
    ("done", "start_next"): "idle",
}

#: TRANSITIONS by state, then by what happened (a lookup without a tuple built for it, on every event).
_NEXT: Final[dict[str, dict[str, str]]] = {state: {} for state in STATES}
for (_state, _happened), _target in TRANSITIONS.items():
    _NEXT[_state][_happened] = _target
del _state, _happened, _target

# -- the rules' words -------------------------------------------------------------------------

#: The answer to a request that breaks no rule the reader names.
MALFORMED: Final = "malformed HTTP request"
BARE_LF_IN_HEAD: Final = "a request line or header line ends in a bare LF (lines end in CRLF)"
BARE_LF_IN_CHUNKS: Final = "a chunk line ends in a bare LF (chunk lines end in CRLF)"
CHUNK_SIZE_DIGITS: Final = f"a chunk size of more than {MAX_CHUNK_SIZE_DIGITS} hex digits"
NOT_CHUNKED: Final = "Transfer-Encoding must be chunked (no other coding is accepted)"
CONFLICTING: Final = "invalid or conflicting Content-Length / Transfer-Encoding"
FOLDED: Final = "a header line starts with a space or tab (folded header lines are not accepted)"

_TARGET: Final = re.compile(rb"[\x21-\x7e]+")
_VERSIONS: Final = (b"HTTP/1.1", b"HTTP/1.0")
#: Tokens of a Connection value are split at commas and blanks: ``close`` anywhere closes (Twisted splits
#: at spaces, h11 at commas: closing when either would is never wrong).
_CLOSE: Final = re.compile(rb"(?:^|[\s,])close(?:$|[\s,])")

# What a header name means to the reader (the values of _NAMES).
_PLAIN, _LENGTH, _CODING, _CONNECTION, _EXPECT = range(5)
_SPECIAL: Final = {
    b"content-length": _LENGTH, b"transfer-encoding": _CODING, b"connection": _CONNECTION, b"expect": _EXPECT,
}
#: Header names seen before, each a token, and what it means (a lookup instead of a regex and a lower()
#: per header).  Bounded: a client sending endless new names only makes them slower.
_NAMES: dict[bytes, int] = {}
_MAX_NAMES: Final = 4096
#: Methods seen before, each a token.
_METHODS: set[bytes] = {b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH"}
_MAX_METHODS: Final = 64


def _name_kind(name: bytes) -> int:
    """What a header name means (``_PLAIN``...), or -1 when it is not a token."""
    kind = _NAMES.get(name)
    if kind is not None:
        return kind
    if not TOKEN.fullmatch(name):
        return -1
    kind = _SPECIAL.get(name.lower(), _PLAIN)
    if len(_NAMES) < _MAX_NAMES:
        _NAMES[name] = kind
    return kind


def _closes(connection: bytes) -> bool:
    """Whether a Connection value has a ``close`` token (the search only where the letters are)."""
    lower = connection.lower()
    return b"close" in lower and _CLOSE.search(lower) is not None


def _valid_method(method: bytes) -> bool:
    if method in _METHODS:
        return True
    if not TOKEN.fullmatch(method):
        return False
    if len(_METHODS) < _MAX_METHODS:
        _METHODS.add(method)
    return True


def _piece(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """``buf[start:end]`` as bytes."""
    piece = buf[start:end]
    return piece if isinstance(piece, bytes) else bytes(piece)


class RequestReader:
    """Reads the requests of one connection, one after the other (module docstring).

    Pipelined bytes wait in :attr:`read_ahead` until :meth:`start_next`; after a :class:`Refusal` it drops
    what it is fed.  Whatever the bytes, it raises nothing; a misuse (bytes after :meth:`feed_eof`,
    ``start_next`` before a request ended) raises RuntimeError.
    """

    __slots__ = (
        "limits", "_state", "_buf", "_pos", "_gone", "_eof",
        # the head being read, line by line (when it does not come whole: _head_slowly)
        "_first", "_skipped", "_method", "_target", "_version", "_headers", "_head_total", "_head_bytes",
        "_scanned", "_length", "_chunked", "_close", "_expect",
        # the body being read
        "_remaining", "_chunks",
    )

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        self._state = "idle"
        #: Bytes fed and not yet read start at ``_buf[_pos]``; ``_buf`` is a bytearray only while a head or
        #: a line arrives in many small pieces (feed), bytes otherwise.
        self._buf: bytes | bytearray = b""
        self._pos = 0
        #: Bytes read (or dropped) before ``_buf``.
        self._gone = 0
        self._eof = False
        self._remaining = 0
        self._chunks: ChunkDecoder | None = None
        self._new_head()

    def _new_head(self) -> None:
        self._first = True  # the next line is the request line (or the one empty line before it)
        self._skipped = False
        self._method = self._target = self._version = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_total = 0
        self._head_bytes = 0
        self._scanned = 0
        self._length: int | None = None
        self._chunked = False
        self._close = False
        self._expect: bytes | None = None

    # -- the API --------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """One of :data:`STATES`."""
        return self._state

    @property
    def read_ahead(self) -> bytes:
        """Bytes fed but not read yet (in ``done``: the pipelined requests behind the one that ended)."""
        return bytes(self._buf[self._pos :])

    @property
    def request_line(self) -> tuple[bytes, bytes, bytes] | None:
        """The method, target and version of the request being read, once its request line is (a refusal
        answers in its API's shape, and a HEAD without a body): None before."""
        if not self._target or (self._state == "head" and self._first):
            return None
        return self._method, self._target, self._version

    @property
    def consumed(self) -> int:
        """Bytes read so far, with those dropped after a refusal: every byte fed is here or in :attr:`read_ahead`."""
        return self._gone + self._pos

    def feed(self, data: bytes) -> None:
        """Keep ``data`` to read (nothing is read until :meth:`next_event`)."""
        if self._eof:
            raise RuntimeError("bytes fed after the end of the input (feed_eof)")
        if not data:
            return
        if self._state == "error":
            self._gone += len(data)  # a refused connection reads nothing more
            return
        buf, pos = self._buf, self._pos
        if pos == len(buf):
            self._gone += pos
            self._buf, self._pos = data, 0
        elif type(buf) is bytearray:
            # Many small pieces: grow in place (a copy of all that is waiting for each piece is quadratic).
            if pos:
                del buf[:pos]
                self._gone += pos
                self._pos = 0
            buf += data
        elif len(buf) - pos < 2048:
            self._gone += pos
            self._buf, self._pos = buf[pos:] + data, 0
        else:
            grown = bytearray(memoryview(buf)[pos:])
            grown += data
            self._gone += pos
            self._buf, self._pos = grown, 0

    def feed_eof(self) -> None:
        """The client closed its side: once what was fed is read, :class:`Incomplete` or :class:`Closed` follows."""
        self._eof = True

    def start_next(self) -> None:
        """Read the next request (the one that ended was answered)."""
        self._to("start_next")
        self._chunks = None
        self._new_head()

    def next_event(self) -> Event | NeedData | Paused:
        """The next event, :data:`NEED_DATA` or :data:`PAUSED`."""
        state = self._state
        if state == "body":
            return self._body()
        if state == "idle":
            if self._pos == len(self._buf):
                if self._eof:
                    self._to("Closed")
                    return _CLOSED
                return NEED_DATA
            self._to("bytes")
            state = "head"
        if state == "head":
            # A head not begun yet may be all there: read it at once if it is (see _head).
            event: RequestHead | Refusal | NeedData | None = None
            if self._head_bytes == 0 and self._scanned == 0:
                event = self._head()
            if event is None:
                event = self._head_slowly()
            if event is NEED_DATA and self._eof:
                return self._incomplete()
            return event
        return PAUSED  # done, error, closed

    # -- moving ---------------------------------------------------------------------------

    def _to(self, happened: str) -> None:
        """Move as :data:`TRANSITIONS` says on ``happened``; RuntimeError if it says nothing."""
        try:
            self._state = _NEXT[self._state][happened]
        except KeyError:
            raise RuntimeError(f"the request reader cannot take {happened} in state {self._state}") from None

    def _refuse(self, status: int, message: str, code: str) -> Refusal:
        self._to("Refusal")
        self._gone += len(self._buf)
        self._buf, self._pos = b"", 0
        return Refusal(status, message, code)

    def _bad_request(self, message: str = MALFORMED) -> Refusal:
        return self._refuse(400, message, "bad_request")

    def _incomplete(self) -> Incomplete:
        self._to("Incomplete")
        self._gone += len(self._buf)
        self._buf, self._pos = b"", 0
        return _INCOMPLETE

    # -- the head ---------------------------------------------------------------------------

    def _head(self) -> RequestHead | None:
        """The common case, a whole and ordinary head in the buffer: read at once, or None to read it line by line.

        It gives up (None) on anything out of the ordinary, which
        :meth:`_head_slowly` then reads from the same bytes: so every refusal,
        and every head with something odd in it, is read by the one code that
        reads heads that come in pieces.
        """
        buf, pos = self._buf, self._pos
        limits = self.limits
        # No valid head is longer than this on the wire: looking further for its end is in vain.
        span = limits.max_head_bytes + 2 * limits.max_headers + 8
        end = buf.find(b"\r\n\r\n", pos, pos + span)
        if end < 0:
            return None
        head = _piece(buf, pos, end)
        lines = head.split(b"\r\n")
        count = len(lines)
        # No CR, LF, NUL, VT or FF but the CRLFs between the lines (dropping them all drops only those);
        # within the limits; no empty line first.
        content = len(head) - 2 * (count - 1)
        if (
            len(head.translate(None, b"\r\n\0\x0b\x0c")) != content
            or count > limits.max_headers + 1
            or content > limits.max_head_bytes
            or not lines[0]
        ):
            return None
        if len(head) > limits.max_line_bytes and max(map(len, lines)) > limits.max_line_bytes:
            return None
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            return None
        method, target, version = parts
        if version not in _VERSIONS or not (method in _METHODS or _valid_method(method)) or not _TARGET.fullmatch(target):
            return None
        headers = []
        length = None
        chunked = close = framed = False
        expect = None
        names = _NAMES
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            kind = names.get(name)
            if kind is None:
                kind = _name_kind(name)
                if kind < 0:
                    return None
            if not colon:
                return None
            value = value.strip(b" \t")
            headers.append((name, value))
            if kind:
                if kind == _LENGTH:
                    if framed:
                        return None
                    length = parse_length(value)
                    if length is None:
                        return None
                    framed = True
                elif kind == _CODING:
                    if framed or value.lower() != b"chunked":
                        return None
                    framed = chunked = True
                elif kind == _CONNECTION:
                    if not close and _closes(value):
                        close = True
                elif expect is None:
                    expect = value
        consumed = end + 4 - pos
        self._pos = end + 4
        return self._head_read(method, target, version, tuple(headers), length, chunked, close, expect, consumed)

    def _head_read(
        self, method: bytes, target: bytes, version: bytes, headers: tuple[tuple[bytes, bytes], ...],
        length: int | None, chunked: bool, close: bool, expect: bytes | None, head_bytes: int,
    ) -> RequestHead:
        self._to("RequestHead")
        self._method, self._target, self._version = method, target, version
        http11 = version == b"HTTP/1.1"
        if chunked:
            self._chunks = ChunkDecoder(True, self.limits.max_chunk_line, self.limits.max_trailer_bytes)
        else:
            self._remaining = length or 0
        return RequestHead(
            method, target, version, headers, length, chunked,
            http11 and not close,
            http11 and expect is not None and expect.lower() == b"100-continue",
            head_bytes,
        )

    def _head_slowly(self) -> RequestHead | Refusal | NeedData:
        """Read the head line by line, each line as it completes, each rule in the order the bytes break it.

        The reference reading: :meth:`_head` gives up to it on anything odd.
        A line breaks a rule before its end when a bare LF comes (at once) or
        it reaches ``max_line_bytes + 2`` bytes with no CRLF (Twisted's
        LineReceiver), which wins a tie; every other rule at the line's end.
        """
        buf = self._buf
        max_line = self.limits.max_line_bytes
        while True:
            pos = self._pos
            lf = buf.find(b"\n", pos + self._scanned)
            if lf < 0:
                seen = len(buf) - pos
                if seen >= max_line + 2:
                    return self._line_too_long()
                self._scanned = seen
                return NEED_DATA
            if lf == pos or buf[lf - 1] != 0x0D:
                if lf - pos > max_line:
                    return self._line_too_long()
                return self._bad_request(BARE_LF_IN_HEAD)
            line = _piece(buf, pos, lf - 1)
            self._scanned = 0
            self._pos = lf + 1
            event = self._head_line(line)
            if event is not None:
                return event

    def _line_too_long(self) -> Refusal:
        max_line = self.limits.max_line_bytes
        if self._first:
            return self._refuse(414, f"request line longer than {max_line} bytes", "uri_too_long")
        return self._refuse(431, f"a header line is longer than {max_line} bytes", "headers_too_large")

    def _head_line(self, line: bytes) -> RequestHead | Refusal | None:
        """One line of a head, in the order Twisted's HTTPChannel checks it: the line's length, the head's, then
        the line itself."""
        limits = self.limits
        size = len(line)
        if size > limits.max_line_bytes:
            return self._line_too_long()
        total = self._head_total + size
        if total > limits.max_head_bytes:
            return self._refuse(431, f"request headers larger than {limits.max_head_bytes} bytes", "headers_too_large")
        self._head_total = total
        self._head_bytes += size + 2
        if self._first:
            if not line and not self._skipped:
                self._skipped = True  # one empty line before a request line is skipped (RFC 9112 2.2)
                return None
            parts = line.split(b" ")
            if len(parts) != 3:
                return self._bad_request()
            method, target, version = parts
            if not _valid_method(method) or not _TARGET.fullmatch(target) or version not in _VERSIONS:
                return self._bad_request()
            self._method, self._target, self._version = method, target, version
            self._first = False
            return None
        if not line:
            return self._head_read(
                self._method, self._target, self._version, tuple(self._headers), self._length, self._chunked,
                self._close, self._expect, self._head_bytes,
            )
        if len(self._headers) >= limits.max_headers:
            return self._refuse(431, f"more than {limits.max_headers} request headers", "headers_too_large")
        if line[0] in b" \t":
            return self._bad_request(FOLDED)
        name, colon, value = line.partition(b":")
        kind = _name_kind(name)
        if not colon or kind < 0:
            return self._bad_request()
        value = value.strip(b" \t")
        if BAD_VALUE.search(value):
            return self._bad_request()
        if kind == _LENGTH:
            length = parse_length(value)
            if length is None or self._length is not None or self._chunked:
                return self._bad_request(CONFLICTING)
            self._length = length
        elif kind == _CODING:
            if value.lower() != b"chunked":
                return self._bad_request(NOT_CHUNKED)
            if self._length is not None or self._chunked:
                return self._bad_request(CONFLICTING)
            self._chunked = True
        elif kind == _CONNECTION:
            if _closes(value):
                self._close = True
        elif kind == _EXPECT and self._expect is None:
            self._expect = value
        self._headers.append((name, value))
        return None

    # -- the body -------------------------------------------------------------------------

    def _body(self) -> BodyData | ChunkAnnounced | EndOfMessage | Refusal | Incomplete | NeedData:
        chunks = self._chunks
        if chunks is not None:
            return self._chunk()
        remaining = self._remaining
        if not remaining:
            self._to("EndOfMessage")
            return _END_OF_MESSAGE
        buf, pos = self._buf, self._pos
        end = len(buf)
        if pos == end:
            return self._incomplete() if self._eof else NEED_DATA
        if end - pos <= remaining:
            if pos == 0 and type(buf) is bytes:
                data = buf  # the common case, a piece of body alone: no copy
            else:
                data = bytes(buf[pos:])
            self._remaining = remaining - (end - pos)
            self._gone += end
            self._buf, self._pos = b"", 0
        else:
            data = bytes(buf[pos : pos + remaining])
            self._remaining = 0
            self._pos = pos + remaining
        self._to("BodyData")
        return BodyData(data)

    def _chunk(self) -> BodyData | ChunkAnnounced | EndOfMessage | Refusal | Incomplete | NeedData:
        chunks = self._chunks
        assert chunks is not None
        buf = self._buf
        try:
            kind, start, end = chunks.step(buf, self._pos)
        except WireError as error:
            if error.rule == BARE_LF:
                return self._bad_request(BARE_LF_IN_CHUNKS)
            if error.rule == CHUNK_DIGITS:
                return self._bad_request(CHUNK_SIZE_DIGITS)
            return self._bad_request()
        if kind == DATA:
            if start == 0 and end == len(buf) and type(buf) is bytes:
                data = buf
            else:
                data = bytes(buf[start:end])
            self._pos = end
            self._to("BodyData")
            return BodyData(data)
        self._pos = start
        if kind == SIZE:
            self._to("ChunkAnnounced")
            return ChunkAnnounced(end)
        if kind == END:
            self._to("EndOfMessage")
            return _END_OF_MESSAGE
        assert kind == NEED
        return self._incomplete() if self._eof else NEED_DATA
