"""Bodies read the way Ollama's Go decoder reads them; the fast model scan agrees with the full read."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from yieldproxy.servers.gojson import (
    FULL_READ_LIMIT,
    BadBody,
    FirstValue,
    decode_error,
    find_model,
    fold,
    go_duration,
    read_request,
    scan_model,
)
from yieldproxy.servers.ollama import REQUEST_STRUCTS

SETTINGS = settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))


# -- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, field, binds",
    [
        ("model", "model", True),
        ("Model", "model", True),
        ("MODEL", "model", True),
        ("keep_alive", "keep_alive", True),
        ("KEEP_ALIVE", "keep_alive", True),
        ("\u212aeep_alive", "keep_alive", True),  # KELVIN SIGN folds to k (strings.EqualFold)
        ("\u017ftream", "stream", True),
        ("mes\u017fages", "messages", True),  # LATIN SMALL LETTER LONG S folds to s
        ("keep_al\u0131ve", "keep_alive", False),  # dotless i: only a Turkic mapping, not a simple fold
        ("keep_al\u0130ve", "keep_alive", False),
        ("keepalive", "keep_alive", False),  # v1 keeps the underscore (MatchCaseSensitiveDelimiter)
        ("keep-alive", "keep_alive", False),
        ("model ", "model", False),
    ],
)
def test_keys_match_fields_as_go_matches_them(key, field, binds):
    assert (fold(key) == fold(field)) is binds


def test_the_last_duplicate_wins_and_null_keeps_a_string():
    assert read_request(b'{"model":"small","Model":"llama3:70b"}').model == "llama3:70b"
    assert read_request(b'{"Model":"llama3:70b","model":"small"}').model == "small"
    assert read_request(b'{"model":"big","model":null}').model == "big"
    assert read_request(b'{"model":"big","model":5}').model is None  # Go fails the decode
    assert read_request(b'{"prompt":"\\ud800x"}').values["prompt"] == "\ufffdx"


@pytest.mark.parametrize(
    "body, why",
    [
        (b'{"keep_alive": NaN}', "NaN"),
        (b'{"keep_alive": -Infinity}', "Infinity"),
        (b'{"model": "m"} {"prompt": "x"}', "after the JSON object"),
        (b'{"model": "m\xff"}', "UTF-8"),
        (b'\xef\xbb\xbf{"model": "m"}', "not valid JSON"),
        (b'["m"]', "JSON object"),
        (b"", "not valid JSON"),
    ],
)
def test_what_go_reads_differently_is_refused(body, why):
    with pytest.raises(BadBody, match=why):
        read_request(body)


# -- keep_alive (api.Duration) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, nanoseconds",
    [
        (0, 0), (0.0, 0), (-0.0, 0), (1e-10, 0), (1e-9, 1), (5, 5_000_000_000), (1.5, 1_500_000_000),
        (-1, 2**63 - 1), (-0.5, 2**63 - 1), (1e300, 2**63 - 1),
        ("0", 0), ("-0", 0), ("0s", 0), ("-0s", 0), ("+0h", 0), ("0.5ns", 0), ("0.0000000001s", 0),
        ("5m", 300_000_000_000), ("1h30m", 5_400_000_000_000), (".5s", 500_000_000), ("5.s", 5_000_000_000),
        ("1\u00b5s", 1000), ("1\u03bcs", 1000), ("1us", 1000), ("-1s", 2**63 - 1),
        ("9223372036854775807ns", 2**63 - 1), ("2562047h47m16.854775807s", 2**63 - 1),
    ],
)
def test_keep_alive_durations_as_ollama_reads_them(value, nanoseconds):
    assert go_duration(value) == nanoseconds


@pytest.mark.parametrize(
    "value", ["", "s", "1", "1e3s", ".s", "1x", "9223372036854775808ns", "2562047h47m16.854775808s", True, None, [], {}]
)
def test_keep_alive_values_go_refuses(value):
    body = json.dumps({"keep_alive": value}).encode()
    request = read_request(body)
    assert "keep_alive" in request.type_errors or (value is None and "keep_alive" not in request.values)


# -- the fast model scan ------------------------------------------------------------------------------

_MODEL_SPELLINGS = ["model", "Model", "MODEL", "mODEL", "m\\u006fdel", "\\u004dodel", "MOD\\u0045L"]
_OTHER_KEYS = ["models", "mode", "model_", "input", "prompt", "options", "\\u006dodels", "x", ""]
_WS = st.sampled_from(["", " ", "\n", "\t", " \r\n "])
_text = st.text(max_size=12)


def _string(draw, value: str) -> str:
    return json.dumps(value, ensure_ascii=draw(st.booleans()))


@st.composite
def json_text(draw, depth: int = 0):
    """A JSON value as text, possibly holding nested "model" keys and string tricks."""
    kind = draw(st.sampled_from(["str", "num", "lit", "arr", "obj"] if depth < 3 else ["str", "num", "lit"]))
    if kind == "str":
        return _string(draw, draw(st.one_of(_text, st.sampled_from(['"model":', "{[", "\\", '\\"', "]}"]))))
    if kind == "num":
        return draw(st.sampled_from(["0", "-1", "1.5e3", "12345678901234567890"]))
    if kind == "lit":
        return draw(st.sampled_from(["true", "false", "null"]))
    if kind == "arr":
        items = draw(st.lists(json_text(depth + 1), max_size=3))
        return "[" + ",".join(draw(_WS) + item + draw(_WS) for item in items) + "]"
    return json_object(draw, depth + 1)


def json_object(draw, depth: int) -> str:
    members = []
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(_MODEL_SPELLINGS + _OTHER_KEYS))
        members.append(f'{draw(_WS)}"{key}"{draw(_WS)}:{draw(_WS)}{draw(json_text(depth))}{draw(_WS)}')
    return "{" + ",".join(members) + "}"


@st.composite
def documents(draw):
    """A valid JSON object whose top level names the model (or not) in Go's many spellings."""
    members = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            key = draw(st.sampled_from(_MODEL_SPELLINGS))
            value = draw(st.one_of(st.just(None), _text.map(lambda t: _string(draw, t)), json_text(1)))
            value = "null" if value is None else value
        else:
            key = draw(st.sampled_from(_OTHER_KEYS))
            value = draw(json_text(0))
        members.append(f'{draw(_WS)}"{key}"{draw(_WS)}:{draw(_WS)}{value}{draw(_WS)}')
    return (draw(_WS) + "{" + ",".join(members) + "}" + draw(_WS)).encode("utf-8")


@SETTINGS
@given(documents())
def test_the_scan_finds_the_model_the_full_read_finds(body):
    json.loads(body)  # the generator makes valid JSON only
    assert scan_model(body) == read_request(body).model


@SETTINGS
@given(documents(), st.integers(FULL_READ_LIMIT // 20, FULL_READ_LIMIT // 10))
def test_large_bodies_find_the_same_model(body, pad_items):
    """Past FULL_READ_LIMIT the model is scanned for, with the same answer as a full read."""
    padding = b'"pad":[' + b",".join([b'"[{\\"model\\":\\"fake\\"}]"'] * pad_items) + b"]"
    large = b"{" + padding + (b"," + body.strip()[1:] if body.strip() != b"{}" else b"}")
    assert len(large) > FULL_READ_LIMIT
    assert find_model(large) == read_request(large).model


def test_the_scan_refuses_what_the_full_read_refuses():
    for body in [b'{"model":"a"}{"model":"b"}', b'{"model":"a"} 1', b'"x"{"model":"a"}', b'[{"model":"a"}]',
                 b'{"model":"a"', b'{"model":"a\xff"}', b'{"model":"a"]}']:
        with pytest.raises(BadBody):
            read_request(body)
        with pytest.raises(BadBody):
            scan_model(body)


def test_the_scan_bounds_its_work_on_hostile_structures():
    towers = b'{"model":"m","x":[' + b",".join([b"[" * 60 + b"]" * 60] * 200_000) + b"]}"
    keys = b'{"model":"m","x":[' + b",".join([b'{"model":1}'] * 20_000) + b"]}"
    for body in (towers, keys):
        began = time.process_time()
        with pytest.raises(BadBody):
            scan_model(body)
        assert time.process_time() - began < 3.0


def test_a_30_mb_body_is_scanned_in_a_fraction_of_a_full_parse():
    """Finding 8: a routes rule read a 30 MB body whole and stalled the reactor for seconds."""
    body = json.dumps({"model": "m", "context": [7] * 10_000_000}).encode()
    began = time.process_time()
    full = read_request(body).model
    full_seconds = time.process_time() - began
    began = time.process_time()
    scanned = find_model(body)
    scan_seconds = time.process_time() - began
    assert full == scanned == "m"
    assert scan_seconds < full_seconds / 4, (scan_seconds, full_seconds)


# -- one parse per body ------------------------------------------------------------------------


@st.composite
def bodies(draw):
    """Valid objects, and the same with a few bytes put in: trailing data, broken syntax, invalid UTF-8."""
    body = draw(documents())
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.sampled_from([b"x", b"}", b"]", b",", b'"', b"\xff", b"NaN", b" ", b"1", b"{}"])) + body[at:]
    return body


def _read(body: bytes, shared=None):
    try:
        return read_request(body, shared)
    except BadBody as e:
        return f"BadBody: {e}"


@SETTINGS
@given(bodies(), st.lists(st.booleans(), min_size=1, max_size=4))
def test_a_body_read_again_is_read_as_it_was_read_first(body, order):
    """What the refusal rule (decode_error) and the handler (read_request) find in a body through one shared
    parse is the same whichever read it first, as when each parses it afresh."""
    struct = REQUEST_STRUCTS["/api/embed"]
    fresh_read = _read(body)
    fresh_error = decode_error(body, struct)
    shared = FirstValue(body)
    for handler_first in order:
        if handler_first:
            assert _read(body, shared) == fresh_read
        else:
            assert decode_error(body, struct, shared) == fresh_error


def test_a_body_the_refusal_rule_read_is_not_parsed_again_by_the_handler(monkeypatch):
    parsed = []
    real = json.JSONDecoder.raw_decode
    monkeypatch.setattr(json.JSONDecoder, "raw_decode", lambda self, s, idx=0: parsed.append(s) or real(self, s, idx))
    body = json.dumps({"model": "all-minilm", "input": ["x" * 1000]}).encode()
    shared = FirstValue(body)
    assert decode_error(body, REQUEST_STRUCTS["/api/embed"], shared) is None
    assert read_request(body, shared).model == "all-minilm" and find_model(body, shared) == "all-minilm"
    assert len(parsed) == 1
    # A parse is shared only where it is passed, and only for its own body: nothing is kept between requests.
    assert read_request(body).model == "all-minilm"
    assert len(parsed) == 2
    other = body.replace(b"x", b"y")
    assert read_request(other, shared).model == "all-minilm"
    assert len(parsed) == 3



def test_an_empty_body_read_first_in_a_process_is_not_json():
    """Nothing is kept between reads: an empty body, read first in a fresh process, is not JSON (a parse kept
    in a module global, keyed by the body's identity, once matched its empty sentinel and said otherwise)."""
    import subprocess
    import sys

    code = (
        "from yieldproxy.servers.gojson import BadBody, read_request\n"
        "try:\n    read_request(b'')\nexcept BadBody as e:\n    print(e)\n"
    )
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert said.startswith("request body is not valid JSON"), said
