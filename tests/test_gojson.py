"""Bodies read the way Ollama's Go decoder reads them."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yieldproxy.gojson import BadBody, fold, go_duration, read_request

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
    assert read_request(b'{"prompt":"\\ud800x"}').string("prompt") == "\ufffdx"


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
