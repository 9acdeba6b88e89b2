"""HTTP/1.1 framing shared by the request reader (:mod:`.reader`) and the upstream response parser (:mod:`yieldproxy.edge.h1parse`).

Field lines (``name: value``), Content-Length values, chunk-size lines and
the decoding state of a chunked body, read with two tempers: *strict* for a
request from a client, which may be hostile (the reader's rules:
docs/architecture.md, *The HTTP edge*; a chunk-size line holds the size, then
extensions of the characters Twisted allows, nothing else, and trailer lines
must be field lines), *lenient* for an answer from the upstream, which the
proxy relays (blanks before the ``;`` allowed, trailer lines skipped unread).

Whatever the bytes, the code here raises nothing but :class:`WireError`,
whose :attr:`~WireError.rule` says which rule the bytes broke: each parser
words its own answer from it.
"""

from __future__ import annotations

import re
from typing import Final

#: A token (RFC 9110 5.6.2): a field name, a method, a transfer coding.
TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: A chunk size: at most 16 hex digits, 64 bits, as Go's ``parseHexUint`` takes (net/http/internal/chunked.go).
MAX_CHUNK_SIZE_DIGITS: Final = 16
HEX: Final = re.compile(rb"[0-9A-Fa-f]{1,%d}" % MAX_CHUNK_SIZE_DIGITS)
#: A Content-Length: at most 18 digits (under 2**63, what Go and nginx take).
MAX_LENGTH_DIGITS: Final = 18
#: What a strict chunk extension may hold (Twisted's ``_chunkExtChars``: HTAB, SP, VCHAR but ``\\``, obs-text).
_BAD_EXTENSION: Final = re.compile(rb"[^\t -\[\]-~\x80-\xff]")
#: What a strict field value may not hold (NUL, CR, LF, and the VT and FF h11 refuses too).
BAD_VALUE: Final = re.compile(rb"[\x00\n\r\x0b\x0c]")

# The rules a chunked body can break (WireError.rule).
BARE_LF: Final = "bare_lf"  # a chunk line or trailer line ends in a bare LF (strict)
CHUNK_DIGITS: Final = "chunk_digits"  # more than 16 characters before a chunk size's end (strict)
CHUNK_SIZE: Final = "chunk_size"  # a chunk-size line that is not a size (and extensions)
CHUNK_LINE_LONG: Final = "chunk_line_long"  # a chunk-size line longer than its limit
CHUNK_END: Final = "chunk_end"  # chunk data not followed by CRLF
TRAILER_LINE: Final = "trailer_line"  # a trailer line that is not a field line (strict)
TRAILERS_LONG: Final = "trailers_long"  # trailers past their limit

# What ChunkDecoder.step found.
NEED: Final = 0  # nothing complete: give the same bytes again with more
SIZE: Final = 1  # a chunk-size line (of a chunk that is not the last)
DATA: Final = 2  # chunk data
END: Final = 3  # the last chunk and the trailers: the body is complete

# Where a chunked body is.
_SIZE_LINE, _DATA, _DATA_END, _TRAILERS, _DONE = range(5)


class WireError(ValueError):
    """The bytes break a rule of HTTP/1.1 framing: :attr:`rule` names it, :attr:`line` shows the line (40 bytes at most)."""

    def __init__(self, rule: str, line: bytes = b""):
        super().__init__(rule)
        self.rule = rule
        self.line = line


def split_field(line: bytes) -> tuple[bytes, bytes] | None:
    """The name and value of a field line (``name: value``), or None when it is not one.

    The name must be a token (no blank before the colon: RFC 9112 5.1); the
    value loses its leading and trailing spaces and tabs.
    """
    name, colon, value = line.partition(b":")
    if not colon or not TOKEN.fullmatch(name):
        return None
    return name, value.strip(b" \t")


def parse_length(text: bytes) -> int | None:
    """A Content-Length value (digits only, at most 18 of them), or None when it is not one."""
    # bytes.isdigit() is ASCII digits only; no sign, no blank, no underscore (which int() would take).
    if not text.isdigit() or len(text) > MAX_LENGTH_DIGITS:
        return None
    return int(text)


class ChunkDecoder:
    """Where a chunked body is: the next chunk-size line, in a chunk, after it, in the trailers.

    Pull-style and I/O-free: :meth:`step` reads what comes next from a
    buffer the caller keeps (``buf[pos:]`` always starts where the last step
    stopped), and says what it found.  ``strict`` chooses the temper (module
    docstring); ``max_line`` bounds a chunk-size line (its bytes before CRLF),
    ``max_trailers`` the trailers (their lines with their CRLFs; strict, with
    the empty line that ends them too).
    """

    __slots__ = ("strict", "max_line", "max_trailers", "_phase", "remaining", "_trailer_bytes", "_scanned")

    def __init__(self, strict: bool, max_line: int, max_trailers: int):
        self.strict = strict
        self.max_line = max_line
        self.max_trailers = max_trailers
        self._phase = _SIZE_LINE
        #: Bytes of the current chunk still to come.
        self.remaining = 0
        self._trailer_bytes = 0
        #: Bytes of the current line already looked at for a LF (strict), so a dribbled line is not searched again.
        self._scanned = 0

    def step(self, buf: bytes | bytearray, pos: int) -> tuple[int, int, int]:
        """Read what comes next in ``buf[pos:]``: ``(kind, a, b)``.

        * ``(NEED, pos, 0)``: nothing complete yet; keep ``buf[pos:]``;
        * ``(SIZE, new_pos, size)``: the size line of a chunk of ``size`` bytes (never 0: the last
          chunk is read on, through the trailers, to ``END``);
        * ``(DATA, start, end)``: ``buf[start:end]`` is body; go on from ``end``;
        * ``(END, new_pos, 0)``: the body is complete; what follows is not the body's.

        Raises :class:`WireError` when the bytes break a rule.
        """
        while True:
            phase = self._phase
            if phase == _DATA:
                end = len(buf)
                if pos >= end:
                    return NEED, pos, 0
                remaining = self.remaining
                if end - pos < remaining:
                    self.remaining = remaining - (end - pos)
                    return DATA, pos, end
                self.remaining = 0
                self._phase = _DATA_END
                return DATA, pos, pos + remaining
            if phase == _DATA_END:
                left = len(buf) - pos
                if left < 2:
                    if left and buf[pos] != 0x0D:
                        raise WireError(CHUNK_END)
                    return NEED, pos, 0
                if buf[pos] != 0x0D or buf[pos + 1] != 0x0A:
                    raise WireError(CHUNK_END)
                pos += 2
                self._phase = _SIZE_LINE
                continue
            if phase == _SIZE_LINE:
                if self.strict:
                    end = self._strict_size_line(buf, pos)
                else:
                    end = self._lenient_size_line(buf, pos)
                if end < 0:
                    return NEED, pos, 0
                size = self.remaining
                pos = end + 2
                if size:
                    self._phase = _DATA
                    return SIZE, pos, size
                self._phase = _TRAILERS
                continue
            if phase == _TRAILERS:
                if self.strict:
                    end = self._strict_trailer_line(buf, pos)
                else:
                    end = self._lenient_trailer_line(buf, pos)
                if end < 0:
                    return NEED, pos, 0
                last = end == pos
                pos = end + 2
                if not last:
                    continue
                self._phase = _DONE
                return END, pos, 0
            return END, pos, 0  # _DONE: nothing more is the body's

    # -- chunk-size lines -----------------------------------------------------------------

    def _lenient_size_line(self, buf: bytes | bytearray, pos: int) -> int:
        """The CR of the size line at ``pos``, its size in :attr:`remaining`; -1 if the line is not all in."""
        end = buf.find(b"\r\n", pos)
        if end < 0:
            if len(buf) - pos > self.max_line:
                raise WireError(CHUNK_LINE_LONG)
            return -1
        if end - pos > self.max_line:
            raise WireError(CHUNK_LINE_LONG)
        line = bytes(buf[pos:end])
        size_text = line.split(b";", 1)[0].rstrip(b" \t")
        if not HEX.fullmatch(size_text) or b"\r" in line or b"\n" in line:
            raise WireError(CHUNK_SIZE, line[:40])
        self.remaining = int(size_text, 16)
        return end

    def _strict_size_line(self, buf: bytes | bytearray, pos: int) -> int:
        """As :meth:`_lenient_size_line`, with the strict rules.

        The rules a line breaks before its end are checked in the order its
        bytes come, so that a line read whole or a byte at a time breaks the
        same one: a bare LF when it comes, more than 16 characters of size
        (no ``;`` and no CR among the first 17), then a line past ``max_line``
        (``max_line + 2`` bytes and no CRLF yet).  On a tie, that order.
        """
        lf = buf.find(b"\n", pos + self._scanned)
        seen, bare_lf = _line_so_far(buf, pos, lf)
        if lf < 0:
            self._scanned = seen
        # The index in the line of the byte that breaks each rule, -1 for none (so far).
        first, rule = bare_lf, BARE_LF
        if seen > MAX_CHUNK_SIZE_DIGITS and (first < 0 or first > MAX_CHUNK_SIZE_DIGITS):
            start = buf[pos : pos + MAX_CHUNK_SIZE_DIGITS + 1]
            if b";" not in start and b"\r" not in start:
                first, rule = MAX_CHUNK_SIZE_DIGITS, CHUNK_DIGITS
        max_line = self.max_line
        if seen > max_line + 1 and (first < 0 or first > max_line + 1):
            first, rule = max_line + 1, CHUNK_LINE_LONG
        if first >= 0:
            raise WireError(rule)
        if lf < 0:
            return -1
        self._scanned = 0
        end = lf - 1
        line = bytes(buf[pos:end])
        size_text, semicolon, extensions = line.partition(b";")
        if not HEX.fullmatch(size_text) or (semicolon and _BAD_EXTENSION.search(extensions)):
            raise WireError(CHUNK_SIZE, line[:40])
        self.remaining = int(size_text, 16)
        return end

    # -- trailers --------------------------------------------------------------------------

    def _lenient_trailer_line(self, buf: bytes | bytearray, pos: int) -> int:
        """The CR of the trailer line at ``pos`` (``pos`` itself: the empty line that ends them); -1 if not all in."""
        end = buf.find(b"\r\n", pos)
        if end < 0:
            if self._trailer_bytes + len(buf) - pos > self.max_trailers:
                raise WireError(TRAILERS_LONG)
            return -1
        self._trailer_bytes += end - pos + 2
        if self._trailer_bytes > self.max_trailers:
            raise WireError(TRAILERS_LONG)
        return end

    def _strict_trailer_line(self, buf: bytes | bytearray, pos: int) -> int:
        """As :meth:`_lenient_trailer_line`, with the strict rules.

        In the order the bytes come (as for a size line): a bare LF when it
        comes, or trailers too long as soon as the line so far and the CRLF it
        still needs (only the LF after a CR) take them past ``max_trailers``
        (Twisted's check, made at every byte: so the empty line that ends them
        counts too); a bare LF wins a tie.  A complete line must be a field
        line (no folding), its value free of CR, NUL, VT and FF.
        """
        lf = buf.find(b"\n", pos + self._scanned)
        seen, bare_lf = _line_so_far(buf, pos, lf)
        if lf < 0:
            self._scanned = seen
        # The first k (bytes of the line so far) with k + (1 if they end in CR else 2) > room.
        room = self.max_trailers - self._trailer_bytes
        if room <= 1:
            first_k = 1
        else:
            first_k = room - 1
            if first_k <= seen and buf[pos + first_k - 1] == 0x0D:
                first_k = room
        if first_k <= seen and (bare_lf < 0 or first_k - 1 < bare_lf):
            raise WireError(TRAILERS_LONG)
        if bare_lf >= 0:
            raise WireError(BARE_LF)
        if lf < 0:
            return -1
        self._scanned = 0
        end = lf - 1
        if end == pos:
            return end  # the empty line: the trailers are done
        line = bytes(buf[pos:end])
        field = split_field(line)
        if field is None or BAD_VALUE.search(field[1]):
            raise WireError(TRAILER_LINE, line[:40])
        self._trailer_bytes += end - pos + 2
        return end


def _line_so_far(buf: bytes | bytearray, pos: int, lf: int) -> tuple[int, int]:
    """How many bytes of the line at ``pos`` its rules can see, and where its bare LF is (-1: none).

    ``lf`` is the first LF from ``pos`` (-1: none yet).  Ended by CRLF, the
    line's rules see it through its CR (the LF completes it); ended by a bare
    LF, through that LF; not ended yet, all that is there.
    """
    if lf < 0:
        return len(buf) - pos, -1
    if lf == pos or buf[lf - 1] != 0x0D:
        return lf - pos + 1, lf - pos
    return lf - pos, -1
