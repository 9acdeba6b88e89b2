"""An incremental HTTP/1.1 response parser, for the lean upstream client (edge/h1client.py).

What it reads, and when a connection may carry another request:
docs/architecture.md (*The upstream client*); never after an HTTP/1.0 answer,
whatever its ``Connection`` header says (a 1.0 server's keep-alive is an
extension the proxy does not rely on).  ``Transfer-Encoding`` is read strictly
(as h11 does, but keeping what a relay must pass on): ``chunked`` at most once
and only last, or the answer is refused; any other coding (``gzip, chunked``)
stays on the body, named in :attr:`ResponseParser.codings` for the relay to
send on (never de-chunked and relabelled as a plain body).  Whatever the input,
it raises nothing but :class:`ParseError` and never loops without consuming
input (``tests/edge/test_h1client.py`` fuzzes it).  Its field lines and chunked
bodies are read by :mod:`yieldproxy.edge.h1wire`, in its lenient temper.
"""

from __future__ import annotations

from typing import Protocol as TypingProtocol

from .h1wire import DATA, END, NEED, TOKEN, ChunkDecoder, WireError, parse_length, split_field

#: Most bytes of a response head (status line and headers).
MAX_HEAD = 64 * 1024
#: Most bytes of a chunk-size line (with its extensions), and of the trailers.
MAX_CHUNK_LINE = 4096
MAX_TRAILERS = 64 * 1024
#: Most interim (1xx) responses before the final one.
MAX_INTERIM = 32

#: What each broken rule of a chunked body is called (h1wire's rules, lenient).
_CHUNK_ERRORS = {
    "chunk_line_long": "chunk-size line too long",
    "chunk_end": "chunk data not followed by CRLF",
    "trailers_long": "trailers too long",
}


class ParseError(ValueError):
    """What the upstream sent is not an HTTP/1.x response."""


class ParserEvents(TypingProtocol):
    """What :class:`ResponseParser` calls as a response arrives."""

    def on_head(self, version: bytes, code: int, phrase: bytes, headers: list[tuple[bytes, bytes]], length: int | None) -> None: ...

    def on_body(self, data: bytes) -> None: ...

    def on_end(self, keep_alive: bool) -> None: ...


# Parser states.
_IDLE, _HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(5)


class ResponseParser:
    """An incremental HTTP/1.1 response parser: feed it bytes, it calls its events.

    One per connection, :meth:`start`-ed for each response.  Every malformed
    input raises :class:`ParseError`, nothing else.  After ``on_end`` it
    returns at once without touching its state (the events may start the
    next exchange on the same connection); ``extra`` then says whether bytes
    followed the response (the connection must not be reused).  After
    ``on_body`` or ``on_head`` it goes on only if its state was left alone:
    :meth:`halt` (called from an event) stops it.
    """

    __slots__ = ("_events", "_state", "_buf", "_remaining", "_head_request", "_keep_alive",
                 "_interim", "_chunks", "extra", "received", "codings")

    def __init__(self, events: ParserEvents):
        self._events = events
        self._state = _IDLE
        self._buf = b""
        self._remaining = 0
        self._head_request = False
        self._keep_alive = False
        self._interim = 0
        #: The chunked body being read (state _CHUNKED).
        self._chunks: ChunkDecoder | None = None
        #: Bytes followed the end of the response.
        self.extra = False
        #: Any byte of this response arrived.
        self.received = False
        #: The transfer codings the body still carries, as sent (``b"gzip"``), once its head is
        #: read; None when there are none (``chunked`` alone, or none at all).
        self.codings: bytes | None = None

    def start(self, head_request: bool = False) -> None:
        """Expect a new response (to a HEAD request: no body, whatever its headers say)."""
        self._state = _HEAD
        self._buf = b""
        self._head_request = head_request
        self._interim = 0
        self._chunks = None
        self.extra = False
        self.received = False
        self.codings = None

    def halt(self) -> None:
        """Stop parsing (the exchange was abandoned from within an event)."""
        self._state = _IDLE
        self._buf = b""

    def feed(self, data: bytes) -> None:
        """Parse ``data``, calling the events; raises :class:`ParseError`."""
        state = self._state
        if state == _IDLE:
            if data:
                raise ParseError("bytes from the upstream with no request outstanding")
            return
        if data:
            self.received = True
        if state == _LENGTH and not self._buf:
            # The common case, a body framed by Content-Length: no copying, no loop.
            n = len(data)
            remaining = self._remaining
            if n < remaining:
                self._remaining = remaining - n
                self._events.on_body(data)
                return
            if n == remaining:
                self._events.on_body(data)
                if self._state == _LENGTH:
                    self._end(b"")
                return
        buf = self._buf + data if self._buf else data
        self._buf = b""
        while True:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise ParseError(f"response head longer than {MAX_HEAD} bytes")
                    self._buf = buf
                    return
                if end > MAX_HEAD:
                    raise ParseError(f"response head longer than {MAX_HEAD} bytes")
                head, buf = buf[:end], buf[end + 4 :]
                if self._head_parsed(head, bool(buf)):
                    return
                continue
            if state == _LENGTH:
                n = len(buf)
                if n < self._remaining:
                    self._remaining -= n
                    if n:
                        self._events.on_body(buf)
                    return
                body, buf = buf[: self._remaining], buf[self._remaining :]
                self._remaining = 0
                if body:
                    self._events.on_body(body)
                    if self._state != _LENGTH:
                        return
                self._end(buf)
                return
            if state == _CHUNKED:
                self._chunked(buf)
                return
            if state == _UNTIL_CLOSE:
                if buf:
                    self._events.on_body(buf)
                return
            return  # _IDLE: halted from an event

    def feed_eof(self, clean: bool = True) -> bool:
        """The connection ended: True if that completed the response (it is read until close).

        A response read until close ends with a clean close; a reset may have
        cut it, so it is not complete.
        """
        if self._state == _UNTIL_CLOSE and clean:
            self._state = _IDLE
            self._events.on_end(False)
            return True
        return False

    def _chunked(self, buf: bytes) -> None:
        """Read a chunked body from ``buf``, until more bytes are needed or the response ends or is halted."""
        chunks = self._chunks
        assert chunks is not None
        pos = 0
        while True:
            try:
                kind, start, end = chunks.step(buf, pos)
            except WireError as error:
                if error.rule == "chunk_size":
                    raise ParseError(f"bad chunk size {error.line!r}") from None
                raise ParseError(_CHUNK_ERRORS[error.rule]) from None
            if kind == DATA:
                self._events.on_body(buf if start == 0 and end == len(buf) else buf[start:end])
                if self._state != _CHUNKED or self._chunks is not chunks:
                    return  # halted (or started again) by the event
                pos = end
            elif kind == END:
                self._end(buf[start:])
                return
            elif kind == NEED:
                self._buf = buf[start:]
                return
            else:  # SIZE: a chunk's size line, nothing to do
                pos = start

    def _end(self, rest: bytes) -> None:
        self.extra = bool(rest)
        self._state = _IDLE
        self._events.on_end(self._keep_alive)

    def _head_parsed(self, head: bytes, more: bool) -> bool:
        """Parse one response head; True when parsing must stop (the response ended or was halted)."""
        # Every line ends in CRLF: no bare CR or LF (response splitting), no NUL.
        crlf = head.count(b"\r\n")
        if head.count(b"\r") != crlf or head.count(b"\n") != crlf or b"\0" in head:
            raise ParseError("bare CR, LF or NUL in the response head")
        lines = head.split(b"\r\n")
        status = lines[0]
        version = status[:8]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or status[8:9] != b" ":
            raise ParseError(f"not an HTTP/1.x status line: {status[:40]!r}")
        code_text = status[9:12]
        if len(code_text) != 3 or not code_text.isdigit() or (len(status) > 12 and status[12:13] != b" "):
            raise ParseError(f"bad status code in {status[:40]!r}")
        code = int(code_text)
        if code < 100:
            raise ParseError(f"bad status code in {status[:40]!r}")
        phrase = status[13:]
        headers: list[tuple[bytes, bytes]] = []
        lengths: list[bytes] = []
        codings: list[bytes] = []
        connection: list[bytes] = []
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t"):
                # obs-fold (RFC 9112 5.2): a user agent replaces it with a space.
                if not headers:
                    raise ParseError("continuation line before any header")
                name, value = headers[-1]
                value = (value + b" " + line.strip(b" \t")).strip(b" \t")
                headers[-1] = (name, value)
            else:
                field = split_field(line)
                if field is None:
                    raise ParseError(f"bad header line {line[:40]!r}")
                name, value = field
                headers.append(field)
            lower = name.lower()
            if lower == b"content-length":
                lengths.append(value)
            elif lower == b"transfer-encoding":
                codings.append(value)
            elif lower == b"connection":
                connection.append(value)
        if 100 <= code < 200:
            if code == 101:
                raise ParseError("101 Switching Protocols to a request that asked for no upgrade")
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise ParseError(f"more than {MAX_INTERIM} interim responses")
            return False  # an interim response: the final one follows
        # HTTP/1.0 is never kept alive (module docstring).
        keep_alive = version == b"HTTP/1.1" and b"close" not in {
            t.strip(b" \t").lower() for v in connection for t in v.split(b",")
        }
        length: int | None = None
        if self._head_request or code in (204, 304):
            state = None
            length = 0
        elif codings:
            # Transfer-Encoding wins over Content-Length (RFC 9112 6.3); both: do not reuse.
            if lengths:
                keep_alive = False
            items = [t.strip(b" \t") for v in codings for t in v.split(b",")]
            items = [t for t in items if t]  # empty list elements are allowed (RFC 9110 5.6.1)
            names = [t.split(b";", 1)[0].rstrip(b" \t").lower() for t in items]
            if not names or not all(TOKEN.fullmatch(n) for n in names):
                raise ParseError(f"bad Transfer-Encoding {b', '.join(codings)[:60]!r}")
            if b"chunked" in names[:-1]:
                raise ParseError("Transfer-Encoding applies chunked twice, or not last")
            if names[-1] == b"chunked":
                state = _CHUNKED
                self._chunks = ChunkDecoder(strict=False, max_line=MAX_CHUNK_LINE, max_trailers=MAX_TRAILERS)
                items = items[:-1]
            else:
                # Framed by the end of the connection (RFC 9112 6.3), the codings stay on.
                state = _UNTIL_CLOSE
                keep_alive = False
            self.codings = b", ".join(items) or None
        elif lengths:
            values = {t.strip(b" \t") for v in lengths for t in v.split(b",")}
            if len(values) != 1:
                raise ParseError("conflicting Content-Length values")
            (text,) = values
            length = parse_length(text)
            if length is None:
                raise ParseError(f"bad Content-Length {text[:40]!r}")
            state = _LENGTH if length else None
        else:
            state = _UNTIL_CLOSE
            keep_alive = False
        self._keep_alive = keep_alive
        self._state = _LENGTH if state is None else state  # a placeholder while on_head runs
        self._remaining = length or 0
        self._events.on_head(version, code, phrase, headers, length if state != _UNTIL_CLOSE else None)
        if self._state == _IDLE:
            return True  # halted by the event
        if state is None:
            self._state = _IDLE
            self.extra = more
            self._events.on_end(keep_alive)
            return True
        self._state = state
        return False
