"""Request bodies read the way Ollama's Go decoder reads them.

Ollama binds a request body with gin's ``ShouldBindJSON``: Go's
``encoding/json`` decoding the first JSON value into a struct
(``api.GenerateRequest``, ``api.ChatRequest``, ...).  Python's ``json`` reads
the same bytes differently, and the difference is exploitable: a proxy that
reads ``body["prompt"]`` sees no prompt in ``{"keep_alive":0,"Prompt":"hi"}``
(an unload, it concludes) while Ollama runs a generation.  What Go does, and
this module with it:

- an object key binds to a struct field when it equals the field's JSON name
  exactly *or* under Unicode simple case folding (``strings.EqualFold``:
  ``foldName``/``foldRune`` in ``encoding/json/fold.go``), so ``Prompt``,
  ``PROMPT``, ``ſ`` (U+017F, folds to ``s``) and ``K`` (U+212A, folds to
  ``k``) count, while ``ı`` (U+0131) does not fold to ``i``;
- when several keys bind to one field, each is decoded in turn: the **last**
  one wins; a ``null`` leaves a string field as it was and sets a pointer,
  slice or interface field to nil;
- a value of the wrong type for its field makes the whole decode fail
  (Ollama answers 400 and runs nothing).

Where Python and Go disagree on the bytes themselves, this module refuses
(:class:`BadBody`) rather than guess: ``NaN``/``Infinity`` (Python reads
them, Go refuses), data after the first JSON value (Go reads only the first
value), invalid UTF-8 (Go replaces it with U+FFFD).  A lone UTF-16 surrogate
escape (``"\\ud800"``) reads as U+FFFD, as in Go.

:func:`read_request` parses a whole body and binds the fields the proxy
reads (:data:`FIELDS`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable

import attrs


class BadBody(ValueError):
    """The body had to be read and cannot be read the way Ollama would read it."""


# -- keys, as Go matches them to struct fields ------------------------------------------

#: The only runes outside ASCII whose simple case-fold orbit holds an ASCII letter
#: (CaseFolding.txt, status C and S): they fold like the letter.
_FOLD_TO_ASCII = {"\u017f": "S", "\u212a": "K"}


def fold(key: str) -> str:
    """``key`` folded so that ``fold(a) == fold(b)`` exactly when Go matches ``a`` to the field ``b``.

    Exact for every ``b`` in ASCII (all of Ollama's JSON field names): ASCII
    letters fold to upper case, U+017F and U+212A to ``S`` and ``K``; any
    other rune is kept as it is and so never matches an ASCII name.
    """
    if key.isascii():
        return key.upper()
    return "".join(_FOLD_TO_ASCII.get(c, c.upper() if c.isascii() else c) for c in key)


# -- field kinds --------------------------------------------------------------------------

#: A Go ``string`` field: ``null`` is ignored, any other non-string is a type error.
STRING = "string"
#: A Go slice (``[]Message``): ``null`` empties it, an array sets it, anything else errs.
SLICE = "slice"
#: ``*api.Duration`` (``keep_alive``): ``null`` unsets it; see :func:`go_duration`.
DURATION = "duration"

#: The fields the proxy reads, by JSON name, with their Go kind.
FIELDS = {"model": STRING, "prompt": STRING, "messages": SLICE, "keep_alive": DURATION}
_FOLDED_FIELDS = {fold(name): name for name in FIELDS}


class _TypeError(Exception):
    """The value does not decode into its field; Go's decode (and Ollama's request) fails."""


_UNSET = object()


@attrs.frozen
class GoRequest:
    """What Go binds for :data:`FIELDS` (absent: never set, or set to nil)."""

    #: JSON name -> the bound value: ``str`` for strings, ``int`` (length) for
    #: slices, ``int`` nanoseconds for a duration; a key is missing when the
    #: field stays at its zero value (nil for a pointer).
    values: dict[str, Any]
    #: Fields whose value Go could not decode: Ollama answers such a request 400.
    type_errors: frozenset[str] = frozenset()

    @property
    def model(self) -> str | None:
        """The model Go binds, or None when it binds none (or fails on it)."""
        if "model" in self.type_errors:
            return None
        return self.values.get("model")

    def string(self, name: str) -> str | None:
        """A string field's value ("" when never set), None after a type error."""
        if name in self.type_errors:
            return None
        return self.values.get(name, "")


def _bind(pairs: Iterable[tuple[str, Any]]) -> GoRequest:
    """Apply each top-level pair in order, as Go's decoder does."""
    values: dict[str, Any] = {}
    errors: set[str] = set()
    for key, value in pairs:
        name = key if key in FIELDS else _FOLDED_FIELDS.get(fold(key))
        if name is None:
            continue
        kind = FIELDS[name]
        try:
            if kind == STRING:
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise _TypeError
                values[name] = _go_string(value)
            elif kind == SLICE:
                if value is None:
                    values.pop(name, None)
                elif isinstance(value, list) and not isinstance(value, _Pairs):
                    values[name] = len(value)
                else:
                    raise _TypeError
            else:
                if value is None:
                    values.pop(name, None)
                else:
                    values[name] = go_duration(value)
        except _TypeError:
            errors.add(name)
    return GoRequest(values, frozenset(errors))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _go_string(value: str) -> str:
    """A decoded JSON string as Go holds it: a lone surrogate escape is U+FFFD."""
    return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value


# -- keep_alive: api.Duration.UnmarshalJSON ----------------------------------------------

_NANOSECONDS = {"ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": 1_000_000}
_NANOSECONDS.update({"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9})
_MAX_INT64 = 2**63 - 1


def go_duration(value: Any) -> int:
    """Nanoseconds of an ``api.Duration`` decoded from ``value`` (a JSON value).

    Ollama's ``api/types.go`` (``Duration.UnmarshalJSON``): a number is
    seconds, ``time.Duration(t * float64(time.Second))``, a negative one
    means forever; a string is a Go duration (``time.ParseDuration``), a
    negative one forever too; anything else is an error.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _TypeError
    if isinstance(value, str):
        nanos = _parse_go_duration(_go_string(value))
        return _MAX_INT64 if nanos < 0 else nanos
    try:
        seconds = float(value)
    except OverflowError:
        raise _TypeError from None
    if math.isinf(seconds) or math.isnan(seconds):
        # Go's strconv.ParseFloat fails on a number out of float64's range.
        raise _TypeError
    if seconds < 0:
        return _MAX_INT64
    nanos = seconds * 1e9
    # Go's float64 -> int64 conversion truncates; past int64 it is not zero.
    return int(nanos) if nanos < 2**63 else _MAX_INT64


def _parse_go_duration(text: str) -> int:
    """Go's ``time.ParseDuration`` (``time/format.go``), to the nanosecond."""
    s = text.encode("utf-8")
    neg = False
    if s[:1] in (b"-", b"+"):
        neg = s[:1] == b"-"
        s = s[1:]
    if s == b"0":
        return 0
    if not s:
        raise _TypeError
    total = 0
    while s:
        if not (s[:1] == b"." or s[:1].isdigit()):
            raise _TypeError
        m = re.match(rb"[0-9]*", s)
        whole_digits = m.group()
        s = s[m.end():]
        if len(whole_digits) > 0:
            whole = int(whole_digits)
            if whole > 2**63:
                raise _TypeError
        else:
            whole = 0
        frac, scale, post = 0, 1.0, False
        if s[:1] == b".":
            s = s[1:]
            m = re.match(rb"[0-9]*", s)
            digits = m.group()
            s = s[m.end():]
            post = bool(digits)
            overflow = False
            for d in digits:
                if overflow:
                    continue
                if frac > (2**63 - 1) // 10:
                    overflow = True
                    continue
                nxt = frac * 10 + (d - 48)
                if nxt > 2**63:
                    overflow = True
                    continue
                frac = nxt
                scale *= 10
        if not whole_digits and not post:
            raise _TypeError
        m = re.match(rb"[^0-9.]*", s)
        unit_text = m.group()
        s = s[m.end():]
        if not unit_text:
            raise _TypeError
        unit = _NANOSECONDS.get(unit_text.decode("utf-8", "replace"))
        if unit is None:
            raise _TypeError
        if whole > 2**63 // unit:
            raise _TypeError
        whole *= unit
        if frac > 0:
            whole += int(float(frac) * (float(unit) / scale))
            if whole > 2**63:
                raise _TypeError
        total += whole
        if total > 2**63:
            raise _TypeError
    if neg:
        return -total
    if total > _MAX_INT64:
        raise _TypeError
    return total


# -- the whole body -------------------------------------------------------------------------


class _Pairs(list):
    """An object's members in order, duplicates kept (``object_pairs_hook``)."""


def _refuse_constant(name: str):
    raise BadBody(f"request body has {name}, which is not JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_Pairs, parse_constant=_refuse_constant)


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody("request body is not valid UTF-8") from None


def read_request(body: bytes) -> GoRequest:
    """What Ollama's decoder binds from ``body``, or :class:`BadBody` saying what is wrong."""
    text = _text(body)
    try:
        value = _DECODER.decode(text)
    except RecursionError:
        raise BadBody("request body is nested too deeply to read") from None
    except BadBody:
        raise
    except ValueError as e:
        if str(e).startswith("Extra data"):
            raise BadBody("request body has data after the JSON object") from None
        raise BadBody(f"request body is not valid JSON: {e}") from None
    if not isinstance(value, _Pairs):
        raise BadBody("request body must be a JSON object")
    return _bind(value)
