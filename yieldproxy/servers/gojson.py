"""Request bodies read the way Ollama's Go decoder reads them.

Python's ``json`` and Go's ``encoding/json`` read the same bytes differently, and a
proxy reading ``body["prompt"]`` would take ``{"keep_alive":0,"Prompt":"hi"}`` for an
unload while Ollama runs a generation.  :func:`read_request` reads a whole body as
Go binds it (case-folded keys, the last duplicate wins, a wrong type fails it) and
refuses (:class:`BadBody`) where the two disagree on the bytes; :func:`scan_model`
finds only the ``model`` of a large body without building it, with the same answer.
The rules, with Go's source: docs/classes.md, "Bodies are read as Ollama reads them".
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, NoReturn

import attrs

from . import goscan

#: Bodies up to this size are parsed whole; above it the model is scanned for.
FULL_READ_LIMIT = 64 * 1024
#: Nesting the scanner follows before it gives up (a 400): real requests nest a
#: dozen levels; a body nested this deep and this large is an attack on the CPU.
SCAN_MAX_DEPTH = 128
#: Bytes of bracket structure the scanner may go over while checking it (a 400 past it).
SCAN_MAX_WORK = 32 * 1024 * 1024
#: ``model`` keys at any depth the scanner checks before it gives up (a 400).
SCAN_MAX_MODEL_KEYS = 10_000


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

#: The fields the proxy reads, by JSON name, with their Go kind.  In Ollama's
#: api/types.go at fb30760996871fa9460115c753afd2c60d4ab0f7: GenerateRequest
#: ``Model string``, ``Prompt string`` (line 68), ``KeepAlive *Duration``
#: (94); ChatRequest ``Messages []Message`` (138), ``KeepAlive *Duration``
#: (148).  Bound by gin v1.10.0's ``ShouldBindJSON`` (``json.NewDecoder(...)
#: .Decode``: the first JSON value only) in each handler (server/routes.go
#: 248, 2444).
FIELDS = {"model": STRING, "prompt": STRING, "messages": SLICE, "keep_alive": DURATION}
_FOLDED_FIELDS = {fold(name): name for name in FIELDS}


class _TypeError(Exception):
    """The value does not decode into its field; Go's decode (and Ollama's request) fails."""


@attrs.define  # not frozen: one per request (as servers.base.Asked)
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
    if value.isascii():  # no surrogate, and asked at once (CPython keeps the answer with the string)
        return value
    return _SURROGATE.sub("\ufffd", value) if _SURROGATE.search(value) else value


# -- keep_alive: api.Duration.UnmarshalJSON ----------------------------------------------

_NANOSECONDS = {"ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": 1_000_000}
_NANOSECONDS.update({"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9})
_MAX_INT64 = 2**63 - 1


def go_duration(value: Any) -> int:
    """Nanoseconds of an ``api.Duration`` decoded from ``value`` (a JSON value).

    Ollama's ``api/types.go`` (``Duration.UnmarshalJSON``, line 1243 at
    fb30760996871fa9460115c753afd2c60d4ab0f7): a number is
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
    scaled = seconds * 1e9
    # Go's float64 -> int64 conversion truncates; past int64 it is not zero.
    return int(scaled) if scaled < 2**63 else _MAX_INT64


_DIGITS = re.compile(rb"[0-9]*")
_UNIT = re.compile(rb"[^0-9.]*")


def _take(pattern: re.Pattern[bytes], s: bytes) -> tuple[bytes, bytes]:
    """The leading run of ``s`` that ``pattern`` (which matches the empty string too) takes, and the rest."""
    m = pattern.match(s)
    assert m is not None
    return m.group(), s[m.end():]


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
        whole_digits, s = _take(_DIGITS, s)
        if len(whole_digits) > 0:
            whole = int(whole_digits)
            if whole > 2**63:
                raise _TypeError
        else:
            whole = 0
        frac, scale, post = 0, 1.0, False
        if s[:1] == b".":
            s = s[1:]
            digits, s = _take(_DIGITS, s)
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
        unit_text, s = _take(_UNIT, s)
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


class _Pairs(list[tuple[str, Any]]):
    """An object's members in order, duplicates kept (``object_pairs_hook``)."""


def _refuse_constant(name: str) -> NoReturn:
    raise BadBody(f"request body has {name}, which is not JSON")


_FIRST_VALUE = json.JSONDecoder(object_pairs_hook=_Pairs, parse_constant=_refuse_constant)
#: JSON's white space, which is Go's: what may come before and after a body's value.
_GO_SPACE = " \t\r\n"

class FirstValue:
    """One request body's first JSON value, parsed at most once: the refusal rule (:func:`decode_error`) and
    the proxy's reads (:func:`read_request`, :func:`find_model`) of one request share it.  The proxy makes
    one per request and passes it along; nothing is kept between requests."""

    __slots__ = ("body", "_value", "_end")

    def __init__(self, body: bytes) -> None:
        self.body = body
        #: The value, and where it ends in the body decoded (-1: not parsed yet): see :func:`_first_value`.
        self._value: Any = None
        self._end = -1


def _parse_first(text: str) -> tuple[Any, int]:
    """The first JSON value of ``text`` past its leading white space, and the index where it ends."""
    return _FIRST_VALUE.raw_decode(text, len(text) - len(text.lstrip(_GO_SPACE)))


def _first_value(body: bytes, text: str, shared: FirstValue | None) -> tuple[Any, int]:
    """The first value of ``text`` (``body`` decoded) and where it ends: parsed once for the request's ``shared``."""
    if shared is None or shared.body is not body:
        return _parse_first(text)
    if shared._end < 0:
        shared._value, shared._end = _parse_first(text)
    return shared._value, shared._end


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody("request body is not valid UTF-8") from None


def read_request(body: bytes, shared: FirstValue | None = None) -> GoRequest:
    """What Ollama's decoder binds from ``body``, or :class:`BadBody` saying what is wrong (``shared``: the
    request's :class:`FirstValue`, when it has one)."""
    text = _text(body)
    try:
        value, end = _first_value(body, text, shared)
    except RecursionError:
        raise BadBody("request body is nested too deeply to read") from None
    except BadBody:
        raise
    except ValueError as e:
        raise BadBody(f"request body is not valid JSON: {e}") from None
    if text[end:].strip(_GO_SPACE):
        raise BadBody("request body has data after the JSON object")
    if not isinstance(value, _Pairs):
        raise BadBody("request body must be a JSON object")
    return _bind(value)


# -- a large body: the model only ------------------------------------------------------------

#: Keeps quotes and brackets (``{}`` read as ``[]``), drops every other byte.
_STRUCTURE = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_WHITESPACE = b" \t\r\n"
#: A key Go binds to ``model``: each letter as itself, in either case, or as a
#: ``\u00XX`` escape (no rune outside ASCII folds to m, o, d, e or l).
_MODEL_KEY = re.compile(
    rb'"(?:[mM]|\\u00[46][dD])(?:[oO]|\\u00[46][fF])(?:[dD]|\\u00[46]4)'
    rb'(?:[eE]|\\u00[46]5)(?:[lL]|\\u00[46][cC])"[ \t\r\n]*:[ \t\r\n]*'
)


def _unescaped(body: bytes) -> bytes:
    """``body`` with each ``\\\\`` and ``\\"`` escape replaced by two ``_`` (same offsets).

    What is left of ``"`` then delimits strings, so a split or a count on it
    tells strings from structure.
    """
    if b"\\" not in body:
        return body
    return body.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def _brackets(segment: bytes) -> bytes:
    """The brackets of ``segment`` (which starts outside a string) that are outside strings.

    Everything but quotes and brackets is dropped first (C speed, no object
    per string); adjacent quotes are then removed in pairs, which keeps every
    bracket on its side of the strings; only strings holding brackets are
    left to split off.
    """
    kept = segment.translate(_STRUCTURE, _NOT_STRUCTURE)
    while b'""' in kept:
        kept = kept.replace(b'""', b"")
    if b'"' in kept:
        kept = b"".join(kept.split(b'"')[0::2])
    return kept


def _depth_change(segment: bytes) -> int:
    brackets = _brackets(segment)
    return 2 * brackets.count(b"[") - len(brackets)


def _check_one_object(brackets: bytes) -> None:
    """``brackets`` (``[`` and ``]``) is one group: the top-level object, and nothing after it.

    Innermost pairs are removed pass after pass (one nesting level each, at
    C speed); the work is bounded, so a body built of deep narrow towers
    cannot hold the reactor.
    """
    inner = brackets[1:-1]
    work = 0
    for _ in range(SCAN_MAX_DEPTH):
        if not inner:
            return
        work += len(inner)
        if work > SCAN_MAX_WORK:
            break
        shorter = inner.replace(b"[]", b"")
        if len(shorter) == len(inner):
            raise BadBody("request body is not valid JSON or has data after the JSON object")
        inner = shorter
    if inner:
        raise BadBody(f"request body is nested too deeply to read (more than {SCAN_MAX_DEPTH} levels, or too many deep ones)")


def scan_model(body: bytes) -> str | None:
    """The model :func:`read_request` would find, without building the body.

    The brackets outside strings must close the one top-level object exactly
    at its end (no trailing data); then each ``"model":`` key a regex finds
    counts only at depth 1.  Every pass over the bytes runs at C speed; the
    Python work is per ``model`` key and per nesting level, both bounded.
    Values it skips are not checked: a body that is not JSON there is one
    Ollama refuses (400) whatever its class.
    """
    if not body.isascii():
        _text(body)  # validity only
    masked = _unescaped(body)
    start = len(masked) - len(masked.lstrip(_WHITESPACE))
    if masked[start:start + 1] != b"{":
        raise BadBody("request body must be a JSON object")
    if masked.rstrip(_WHITESPACE)[-1:] != b"}":
        raise BadBody("request body is not valid JSON or has data after the JSON object")
    if masked.count(b'"') % 2:
        raise BadBody("request body is not valid JSON: unterminated string")
    _check_one_object(_brackets(masked))
    model: str | None = None
    failed = False
    depth = 0
    last = 0
    # Searched in the masked bytes: every quote there delimits a string, and
    # escapes of letters (\u006d...) are left as they are.
    for n, match in enumerate(_MODEL_KEY.finditer(masked)):
        if n >= SCAN_MAX_MODEL_KEYS:
            raise BadBody(f"request body has more than {SCAN_MAX_MODEL_KEYS} 'model' keys")
        key = match.start()
        depth += _depth_change(masked[last:key])
        last = key
        if depth != 1:
            continue
        value = match.end()
        if body[value:value + 1] == b'"':
            end = masked.find(b'"', value + 1)
            try:
                model = _go_string(json.loads(body[value:end + 1].decode("utf-8")))
            except ValueError as e:
                raise BadBody(f"request body is not valid JSON: {e}") from None
        elif not body.startswith(b"null", value):
            failed = True
    return None if failed else model


def find_model(body: bytes, shared: FirstValue | None = None) -> str | None:
    """The model Ollama reads from ``body``: parsed whole when small, scanned for when large."""
    if len(body) <= FULL_READ_LIMIT:
        return read_request(body, shared).model
    return scan_model(body)


# -- a whole body against a route's request struct ---------------------------------------------

#: Kinds of struct field :func:`decode_error` judges, by what Go's decoder does with each JSON value.
#: ``string``, ``bool``, ``int``: the Go type (a pointer's too: Go names the type pointed to);
#: ``map``: ``map[string]any``; ``any``: ``any``; ``raw``: ``json.RawMessage`` (takes any value);
#: ``duration``: ``*api.Duration`` (:func:`go_duration`); ``ints``: ``[]int``;
#: ``messages``: ``[]api.Message``; ``opaque``: a type with its own decoder or fields not followed here.
GO_TYPES = {"string": "string", "bool": "bool", "int": "int", "map": "map[string]interface {}", "ints": "[]int",
            "messages": "[]api.Message"}


@attrs.frozen
class GoStruct:
    """A request struct as Go decodes into it: its type's name and every field, by JSON name.

    ``fields`` maps a JSON name to ``(kind, everywhere)``: ``everywhere`` is
    False for a field only some of the supported server versions have (the
    others ignore its key), so only a value all of them take is judged.
    """

    #: The type as Go prints it (``api.EmbedRequest``).
    name: str
    fields: dict[str, tuple[str, bool]]
    _folded: dict[str, str] = attrs.field(
        init=False, eq=False, repr=False,
        default=attrs.Factory(lambda self: {fold(n): n for n in self.fields}, takes_self=True),
    )

    def field(self, key: str) -> str | None:
        """The field a key binds to, as Go matches it (exact name, else case-folded), or None."""
        if key in self.fields:
            return key
        return self._folded.get(fold(key))


#: A field of Go's ``any`` (``interface{}``): ``input``, ``format``, ...
_ANY = "any"
#: :func:`_judge`'s answer for a value that decodes.
_FINE = "fine"
#: :func:`_judge`'s answer when the proxy cannot tell exactly what Go does with the value.
_UNSURE = "unsure"


def _json_kind(value: Any) -> str:
    """The word Go's ``UnmarshalTypeError`` uses for a JSON value."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, _Pairs):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    return "number"


def _fits_any(value: Any) -> bool:
    """Whether Go decodes ``value`` into ``any`` without error: every number must fit a float64."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, float):
        return not math.isinf(value)
    if isinstance(value, int):
        try:
            return not math.isinf(float(value))
        except OverflowError:
            return False
    if isinstance(value, _Pairs):
        return all(_fits_any(v) for _, v in value)
    # A list of texts (an embedding's input) is the common one: each string at once, without a call.
    return all(type(v) is str or _fits_any(v) for v in value)


def _judge(kind: str, value: Any) -> str:
    """``_FINE``, ``_UNSURE``, or the JSON kind Go's type error names, for ``value`` into a field of ``kind``."""
    if value is None or kind == "raw":
        # null leaves a value as it is and sets a pointer, slice, map or interface to nil.
        return _FINE
    if kind == "string":
        return _FINE if isinstance(value, str) else _json_kind(value)
    if kind == _ANY:
        return _FINE if _fits_any(value) else _UNSURE
    found = _json_kind(value)
    if kind == "bool":
        return _FINE if found == "bool" else found
    if kind == "int":
        if found == "number":
            return _FINE if isinstance(value, int) and -(2**63) <= value < 2**63 else _UNSURE
        return found
    if kind == "map":
        if found == "object":
            return _FINE if _fits_any(value) else _UNSURE
        return found
    if kind == "duration":
        try:
            go_duration(value)
        except _TypeError:
            return _UNSURE
        return _FINE
    if kind == "ints":
        if found != "array":
            return found
        fits = all(isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63 for v in value)
        return _FINE if fits else _UNSURE
    if kind == "messages":
        if found != "array":
            return found
        return _FINE if not value else _UNSURE
    return _UNSURE


#: Bodies :func:`decode_error` reads: larger ones are not judged (they would be built whole in memory).
DECODE_CHECK_LIMIT = FULL_READ_LIMIT

def decode_error(body: bytes, struct: GoStruct, shared: FirstValue | None = None) -> str | None:
    """What ``json.NewDecoder(body).Decode(&req)`` returns for ``req`` of ``struct``, as its text, or None.

    None when it decodes, and when the proxy cannot tell exactly (a body over
    :data:`DECODE_CHECK_LIMIT`, a value of a type with its own decoder...):
    only an error whose words are certain is returned.  ``goscan.EOF`` for
    a body of white space.  Go reads the first JSON value only, so data
    after it is never an error here (unlike :func:`read_request`).

    Go's ``encoding/json`` (v1, the default build): ``json.Decoder.Decode`` reads
    one value (``readValue``, stream.go) and refuses its syntax first; then
    ``decodeState.object`` binds each member in order, keeping the first
    ``UnmarshalTypeError`` (``saveError``) and going on, the struct's name
    and the field's JSON name added by ``addErrorContext`` (decode.go).
    """
    if len(body) > DECODE_CHECK_LIMIT:
        return None
    # Invalid UTF-8 is Go's U+FFFD; read_request refuses such a body before it asks ``shared``.
    text = body.decode("utf-8", "surrogateescape")
    if not text.strip(_GO_SPACE):
        return goscan.EOF
    try:
        value, _ = _first_value(body, text, shared)
    except (ValueError, RecursionError):
        # Python's parser refused it: Go's scanner says how (or, for a depth only
        # Python's recursion limit refused, that it is fine: then not judged).
        return goscan.syntax_error(body)
    if not isinstance(value, _Pairs):
        # A top-level number Python reads a prefix of (``1.``, ``2e``) is a syntax error to Go.
        said = goscan.syntax_error(body)
        if said is not None:
            return said
        if value is None:
            return None
        return f"json: cannot unmarshal {_json_kind(value)} into Go value of type {struct.name}"
    return _first_type_error(value, struct)


def _first_type_error(pairs: "_Pairs", struct: GoStruct) -> str | None:
    """Go's error for an object's members, decoded in order into ``struct``: the first type error is kept
    and decoding goes on (``saveError``); a type with its own decoder may stop it with another error,
    so any value not judged here, before the first error or after it, makes the answer unsure (None)."""
    first: str | None = None
    fields = struct.fields
    for key, value in pairs:
        # A field's own name (ASCII) is itself as Go holds it: matched at once, without folding.
        name = key if key in fields else struct.field(_go_string(key))
        if name is None:
            continue  # Go ignores a key no field has
        kind, everywhere = fields[name]
        if type(value) is str and (kind == STRING or kind == _ANY):
            continue  # a text into a string or an ``any`` (most of every request), judged without a call
        verdict = _judge(kind, value)
        if verdict == _FINE:
            continue
        if verdict == _UNSURE or not everywhere:
            return None
        if first is None:
            short = struct.name.rpartition(".")[2]
            first = f"json: cannot unmarshal {verdict} into Go struct field {short}.{name} of type {GO_TYPES[kind]}"
    return first
