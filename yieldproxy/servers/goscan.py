"""Go's ``encoding/json`` syntax errors, in Go's own words.

Ollama reads a request body with ``json.NewDecoder(body).Decode(&req)``
(gin's ``ShouldBindJSON``) and answers a body it cannot read 400 with the
error's text.  Python's ``json`` finds the same bad bodies but says it
differently, so :func:`syntax_error` replays Go's scanner
(``encoding/json/scanner.go``) over the bytes, one state per function there,
and returns the text ``json.Decoder.Decode`` gives: ``invalid character 'x'
looking for beginning of value``, ``unexpected EOF`` for a body cut short,
``EOF`` for one with nothing but white space.  Only the first JSON value is
read, as ``json.Decoder.Decode`` reads it: what follows it is never looked at
(``json.Decoder.readValue`` stops at its last byte).

Only bodies Python's parser already refused come here (the scan is a
Python loop); runs of string bytes and digits are skipped with a regex.
"""

from __future__ import annotations

import re
from typing import Callable

#: Go's ``maxNestingDepth`` (scanner.go): deeper nesting is a syntax error.
MAX_NESTING_DEPTH = 10000

#: ``json.Decoder.Decode``'s answer for a body of white space only (``io.EOF``).
EOF = "EOF"
#: ``json.Decoder.Decode``'s answer for a body that ends inside its first value (``io.ErrUnexpectedEOF``).
UNEXPECTED_EOF = "unexpected EOF"

_SPACE = b" \t\r\n"
_DIGITS = b"0123456789"
_HEX = b"0123456789abcdefABCDEF"
#: String bytes that need no state change: not a quote, a backslash or a control byte.
_STRING_RUN = re.compile(rb'[^"\\\x00-\x1f]+')
_DIGIT_RUN = re.compile(rb"[0-9]+")

# parse states (scanner.go: parseObjectKey, parseObjectValue, parseArrayValue)
_OBJECT_KEY, _OBJECT_VALUE, _ARRAY_VALUE = range(3)


class _Done(Exception):
    """The scan ended: ``message`` is Go's error, or None when the first value is whole."""

    def __init__(self, message: str | None):
        self.message = message


def quote_char(c: int) -> str:
    """Go's ``quoteChar`` (scanner.go): the byte as Go prints it in a syntax error."""
    if c == 0x27:
        return "'\\''"
    if c == 0x22:
        return "'\"'"
    return "'" + _go_quote(chr(c)) + "'"


_SHORT_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v", "\\": "\\\\"}


def _go_quote(ch: str) -> str:
    """``strconv.Quote`` of one rune below U+0100, without its quotes."""
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    code = ord(ch)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    # unicode.IsPrint below U+0100: every letter, mark, number, punctuation and
    # symbol, and the ASCII space; U+0080-U+00A0 and the soft hyphen are not.
    if 0x80 <= code <= 0xA0 or code == 0xAD:
        return f"\\u{code:04x}"
    return ch


def syntax_error(body: bytes) -> str | None:
    """What ``json.NewDecoder(body).Decode(&v)`` says of ``body``'s syntax, or None when its first value is whole."""
    try:
        _Scanner(body).run()
    except _Done as done:
        return done.message
    raise AssertionError("the scanner always ends")  # pragma: no cover


class _Scanner:
    """scanner.go's ``scanner``, its ``step`` function a method name; ``run`` feeds it the body."""

    def __init__(self, body: bytes):
        self.body = body
        self.stack: list[int] = []
        self.step: Callable[[int], None] = self.begin_value

    def run(self) -> None:
        body = self.body
        i, n = 0, len(body)
        while i < n:
            if self.step == self.in_string:
                run = _STRING_RUN.match(body, i)
                if run is not None:
                    i = run.end()
                    continue
            elif self.step in (self.one, self.dot0, self.e0):
                run = _DIGIT_RUN.match(body, i)
                if run is not None:
                    i = run.end()
                    continue
            self.step(body[i])
            i += 1
        # json.Decoder.readValue at io.EOF: one more space ends a number; else the value is cut short.
        self.at_eof = True
        if self.body.strip(_SPACE) == b"":
            raise _Done(EOF)
        try:
            self.step(0x20)
        except _Done as done:
            if done.message is None:
                raise
        raise _Done(UNEXPECTED_EOF)

    at_eof = False

    def error(self, c: int, context: str) -> None:
        if self.at_eof:
            raise _Done(UNEXPECTED_EOF)
        raise _Done(f"invalid character {quote_char(c)} {context}")

    def push(self, c: int, state: int) -> None:
        self.stack.append(state)
        if len(self.stack) > MAX_NESTING_DEPTH:
            self.error(c, "exceeded max depth")

    def pop(self) -> None:
        self.stack.pop()
        if not self.stack:
            # The top-level value ended at this byte: json.Decoder.readValue reads no further.
            raise _Done(None)
        self.step = self.end_value

    # -- values ----------------------------------------------------------------------

    def begin_value_or_empty(self, c: int) -> None:
        if c in _SPACE:
            return
        if c == 0x5D:  # ]
            self.end_value(c)
            return
        self.begin_value(c)

    def begin_value(self, c: int) -> None:
        if c in _SPACE:
            return
        if c == 0x7B:  # {
            self.push(c, _OBJECT_KEY)
            self.step = self.begin_string_or_empty
        elif c == 0x5B:  # [
            self.push(c, _ARRAY_VALUE)
            self.step = self.begin_value_or_empty
        elif c == 0x22:
            self.step = self.in_string
        elif c == 0x2D:  # -
            self.step = self.neg
        elif c == 0x30:
            self.step = self.zero
        elif c == 0x74:
            self.step = self._literal("true", 1)
        elif c == 0x66:
            self.step = self._literal("false", 1)
        elif c == 0x6E:
            self.step = self._literal("null", 1)
        elif 0x31 <= c <= 0x39:
            self.step = self.one
        else:
            self.error(c, "looking for beginning of value")

    def begin_string_or_empty(self, c: int) -> None:
        if c in _SPACE:
            return
        if c == 0x7D:  # }
            self.stack[-1] = _OBJECT_VALUE
            self.end_value(c)
            return
        self.begin_string(c)

    def begin_string(self, c: int) -> None:
        if c in _SPACE:
            return
        if c == 0x22:
            self.step = self.in_string
            return
        self.error(c, "looking for beginning of object key string")

    def end_value(self, c: int) -> None:
        if not self.stack:
            # A top-level scalar ended at the byte before: json.Decoder.readValue stops there.
            raise _Done(None)
        if c in _SPACE:
            self.step = self.end_value
            return
        top = self.stack[-1]
        if top == _OBJECT_KEY:
            if c == 0x3A:  # :
                self.stack[-1] = _OBJECT_VALUE
                self.step = self.begin_value
                return
            self.error(c, "after object key")
        elif top == _OBJECT_VALUE:
            if c == 0x2C:  # ,
                self.stack[-1] = _OBJECT_KEY
                self.step = self.begin_string
                return
            if c == 0x7D:
                self.pop()
                return
            self.error(c, "after object key:value pair")
        else:
            if c == 0x2C:
                self.step = self.begin_value
                return
            if c == 0x5D:
                self.pop()
                return
            self.error(c, "after array element")

    # -- strings ---------------------------------------------------------------------

    def in_string(self, c: int) -> None:
        if c == 0x22:
            self.step = self.end_value
        elif c == 0x5C:
            self.step = self.in_string_esc
        elif c < 0x20:
            self.error(c, "in string literal")

    def in_string_esc(self, c: int) -> None:
        if c in b'bfnrt\\/"':
            self.step = self.in_string
        elif c == 0x75:  # u
            self.step = self._hex(4)
        else:
            self.error(c, "in string escape code")

    def _hex(self, left: int) -> Callable[[int], None]:
        def step(c: int) -> None:
            if c not in _HEX:
                self.error(c, "in \\u hexadecimal character escape")
            self.step = self._hex(left - 1) if left > 1 else self.in_string
        return step

    # -- numbers ---------------------------------------------------------------------

    def neg(self, c: int) -> None:
        if c == 0x30:
            self.step = self.zero
        elif 0x31 <= c <= 0x39:
            self.step = self.one
        else:
            self.error(c, "in numeric literal")

    def one(self, c: int) -> None:
        if c in _DIGITS:
            return
        self.zero(c)

    def zero(self, c: int) -> None:
        if c == 0x2E:  # .
            self.step = self.dot
        elif c in b"eE":
            self.step = self.e
        else:
            self.end_value(c)

    def dot(self, c: int) -> None:
        if c in _DIGITS:
            self.step = self.dot0
            return
        self.error(c, "after decimal point in numeric literal")

    def dot0(self, c: int) -> None:
        if c in _DIGITS:
            return
        if c in b"eE":
            self.step = self.e
            return
        self.end_value(c)

    def e(self, c: int) -> None:
        if c in b"+-":
            self.step = self.e_sign
            return
        self.e_sign(c)

    def e_sign(self, c: int) -> None:
        if c in _DIGITS:
            self.step = self.e0
            return
        self.error(c, "in exponent of numeric literal")

    def e0(self, c: int) -> None:
        if c in _DIGITS:
            return
        self.end_value(c)

    # -- true, false, null -----------------------------------------------------------

    def _literal(self, word: str, at: int) -> Callable[[int], None]:
        def step(c: int) -> None:
            want = word[at]
            if c != ord(want):
                self.error(c, f"in literal {word} (expecting {quote_char(ord(want))})")
            self.step = self._literal(word, at + 1) if at + 1 < len(word) else self.end_value
        return step
