"""What a server refuses at once, in its own words: each server's ``refuse`` and ``servers.refusal``.

The Ollama rule is checked against Ollama's own request front: 1,200
generated requests answered by Ollama v0.11.4's gin router, its CORS
middleware and its handlers' body decoding (``ollama_front_v0.11.4.json``,
see its ``about``).  Every answer the rule gives must be that answer byte
for byte; every request that front let through must not be refused.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from yieldproxy.servers import SERVERS, Asked, Origins, Refusal, goscan, ollama, refusal, refuser
from yieldproxy.servers.cors import Origins as CorsOrigins
from yieldproxy.servers.gojson import _FIRST_VALUE

FRONT = json.loads((Path(__file__).parent / "ollama_front_v0.11.4.json").read_text("utf-8"))
HOST = FRONT["host"]
HOSTS = frozenset({HOST})
DEFAULTS = ollama.allowed_origins()


def _body(case) -> bytes:
    return case["body"].encode("utf-8") if "body" in case else base64.b64decode(case["body_b64"])


def _asked(case) -> Asked:
    return Asked(case["method"], case["path"], case["origin"] or None, HOSTS, _body(case))


def _as_answer(refused: Refusal) -> tuple[int, dict[str, str], str]:
    headers = {name.decode(): value.decode() for name, value in refused.headers}
    if refused.content_type is not None:
        headers["content-type"] = refused.content_type.decode()
    return refused.status, headers, refused.body.decode("utf-8")


def test_every_refusal_is_ollamas_own_answer_and_nothing_it_lets_through_is_refused():
    refused = unmodelled = 0
    for case in FRONT["cases"]:
        mine = ollama.refuse(_asked(case), DEFAULTS)
        if case["status"] == 299:
            assert mine is None, case
        elif mine is None:
            # Refused by a rule the proxy does not model (a handler's own check, a /v1/ middleware).
            unmodelled += 1
            assert case["status"] == 400, case
        else:
            refused += 1
            assert _as_answer(mine) == (case["status"], case["headers"], case["answer"]), case
    # Most of Ollama's refusals are modelled: every 403, 404 and 405, and most 400s.
    assert refused > 700 and unmodelled < 150, (refused, unmodelled)


@pytest.mark.parametrize(
    "origin, refused",
    [
        (None, False),
        ("", False),
        ("http://localhost", False),
        ("https://localhost:8443", False),
        ("http://127.0.0.1:3000", False),
        ("http://0.0.0.0:80", False),
        ("app://obsidian.md", False),
        ("file://", False),
        ("tauri://localhost", False),
        ("vscode-webview://1234", False),
        ("vscode-file://vscode-app", False),
        (f"http://{HOST}", False),  # the request's own host: not a cross-origin request
        ("https://evil.example", True),
        ("null", True),  # sandboxed frames, data: and file pages in some browsers
        ("http://localhost.evil.example", True),
        ("http://LOCALHOST", True),  # compared as sent, against the lower-cased entries
        ("http://127.0.0.2", True),
        ("chrome-extension://abcdef", True),  # its scheme may be listed, it is not by default
    ],
)
def test_ollamas_default_origins(origin, refused):
    answer = ollama.refuse(Asked("POST", "/api/embed", origin, HOSTS, b'{"model":"m"}'), DEFAULTS)
    assert (answer is not None) == refused
    if refused:
        assert answer == Refusal(403, reason="origin")


def test_configured_origins_mirror_ollama_origins():
    origins = ollama.allowed_origins(["https://app.example", "https://*.corp.example", "chrome-extension://abc"])
    asked = lambda origin: Asked("POST", "/api/embed", origin, HOSTS, b'{"model":"m"}')  # noqa: E731
    assert ollama.refuse(asked("https://app.example"), origins) is None
    assert ollama.refuse(asked("https://x.corp.example"), origins) is None
    assert ollama.refuse(asked("chrome-extension://abc"), origins) is None
    assert ollama.refuse(asked("https://other.example"), origins) is not None
    everything = ollama.allowed_origins(["*"])
    assert ollama.refuse(asked("https://other.example"), everything) is None
    typo = ollama.refuse(Asked("POST", "/api/embedd", "https://other.example", HOSTS, b""), everything)
    assert typo is not None and typo.headers == ((b"access-control-allow-origin", b"*"),)


@pytest.mark.parametrize(
    "entry", ["localhost", "ftp://x", " http://x", "http://*.a.*", "app://**"],
)
def test_an_origin_entry_ollama_would_not_start_with_is_refused(entry):
    with pytest.raises(ValueError):
        CorsOrigins.from_entries([entry])


def test_a_route_a_rule_declares_is_never_refused_as_unknown():
    asked = Asked("POST", "/api/embedd", None, HOSTS, b"{}", declared=True)
    assert ollama.refuse(asked, DEFAULTS) is None
    assert ollama.refuse(Asked("POST", "/api/embedd", None, HOSTS, b"{}"), DEFAULTS).status == 404


def test_experimental_options_head_and_routes_releases_differ_on_are_left_to_ollama():
    for method, path in [("POST", "/api/experimental/web_search"), ("POST", "/api/experimental/new"),
                         ("OPTIONS", "/api/embedd"), ("HEAD", "/api/embedd"), ("HEAD", "/api/embed"),
                         # v0.11.4 has no /api/me (404), later releases serve it with POST (405 for a GET)
                         ("GET", "/api/me"), ("POST", "/v1/messages"), ("POST", "/v1/images/generations")]:
        assert ollama.refuse(Asked(method, path, None, HOSTS, b""), DEFAULTS) is None, (method, path)


def test_large_bodies_are_not_judged():
    big = b'{"model":3,"input":"' + b"a" * 70_000 + b'"}'
    assert ollama.refuse(Asked("POST", "/api/embed", None, HOSTS, big), DEFAULTS) is None


# -- a pool: refused only when every server that could serve it refuses it --------------------------


def test_a_pool_refuses_only_what_every_candidate_refuses():
    typo = Asked("POST", "/api/embedd", None, HOSTS, b"{}")
    assert refusal(("ollama",), typo, DEFAULTS).status == 404
    # TEI's routes are not all known (a build may add its own): it might take the path, so nobody refuses it.
    assert refusal(("ollama", "tei"), typo, DEFAULTS) is None
    # An Ollama route is served by Ollama members only: their rule decides.
    foreign = Asked("POST", "/api/embed", "https://evil.example", HOSTS, b"{}")
    assert refusal(("tei", "ollama"), foreign, DEFAULTS) == Refusal(403, reason="origin")
    # A route TEI serves natively is TEI's: it refuses nothing on TEI's behalf.
    assert refusal(("ollama", "tei"), Asked("POST", "/rerank", "https://evil.example", HOSTS, b"x"), DEFAULTS) is None


def test_every_server_has_a_refusal_rule():
    from yieldproxy.servers import SERVERS

    for api, described in SERVERS.items():
        assert callable(described.refuse), api
        if api != "ollama":
            # Servers whose refusals the proxy does not know exactly refuse nothing.
            assert described.refuse(Asked("POST", "/x", "https://evil.example", HOSTS, b"]"), DEFAULTS) is None


# -- generated: Origins and bodies ------------------------------------------------------------------

_schemes = st.sampled_from(["http", "https", "HTTP", "app", "file", "tauri", "vscode-webview", "chrome-extension", "null"])
_hosts = st.sampled_from(["localhost", "127.0.0.1", "0.0.0.0", "LocalHost", "evil.example", "localhost.evil", "127.0.0.2", ""])
_ports = st.one_of(st.just(""), st.integers(0, 65535).map(lambda p: f":{p}"), st.text("0123456789abc:", max_size=6).map(lambda t: ":" + t))
_origins = st.one_of(
    st.builds(lambda s, h, p, tail: f"{s}://{h}{p}{tail}", _schemes, _hosts, _ports, st.sampled_from(["", "/", "/x"])),
    st.text(max_size=30),
)


def _loopbackish(origin: str) -> bool:
    """Ollama's defaults, read from envconfig.AllowedOrigins' loop, as a test of their own."""
    for scheme in ("http://", "https://"):
        for host in ("localhost", "127.0.0.1", "0.0.0.0"):
            if origin == scheme + host or origin.startswith(scheme + host + ":"):
                return True
    return origin.startswith(("app://", "file://", "tauri://", "vscode-webview://", "vscode-file://"))


@given(_origins)
@settings(max_examples=400, deadline=None)
def test_an_origin_is_refused_exactly_when_ollamas_defaults_do_not_list_it(origin):
    answer = ollama.refuse(Asked("POST", "/api/embed", origin, HOSTS, b'{"model":"m"}'), DEFAULTS)
    own = origin in (f"http://{HOST}", f"https://{HOST}")
    assert (answer is not None) == (bool(origin) and not own and not _loopbackish(origin))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "Model", "input", "prompt", "messages", "options", "keep_alive", "stream", "x"]),
        inner, max_size=4,
    ),
    max_leaves=8,
)
_mutations = st.tuples(st.integers(0, 200), st.sampled_from([b"", b"x", b"}", b"]", b",", b":", b'"', b"\\", b"\x01", b"\xff", b"-", b"1.", b"tru", b"NaN", b" "]))


@given(_json, st.lists(_mutations, max_size=2))
@settings(max_examples=400, deadline=None)
def test_go_scanner_agrees_with_a_json_parser_on_which_bodies_are_whole(value, mutations):
    body = json.dumps(value).encode()
    for at, insert in mutations:
        at = min(at, len(body))
        body = body[:at] + insert + body[at:]
    text = body.decode("utf-8", "surrogateescape")
    start = len(text) - len(text.lstrip(" \t\r\n"))
    if text[start:start + 1] not in ("{", "["):
        return  # Python reads a prefix of a top-level number ("1." as 1): only brackets compare
    try:
        _FIRST_VALUE.raw_decode(text, start)
        whole = True
    except ValueError:
        whole = False
    said = goscan.syntax_error(body)
    assert (said is None) == whole, (body, said)
    if not whole:
        assert said in (goscan.EOF, goscan.UNEXPECTED_EOF) or said.startswith("invalid character '")


@given(_json)
@settings(max_examples=300, deadline=None)
def test_a_body_of_the_routes_shape_is_never_refused(value):
    """Any JSON object whose known fields have their Go types decodes: not refused."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k.lower() not in ("model", "prompt", "messages", "options", "keep_alive", "stream")}
        value.update(model="all-minilm", input=["a"], options={"num_ctx": 1}, keep_alive="5m", stream=False)
    body = json.dumps(value).encode()
    answer = ollama.refuse(Asked("POST", "/api/embed", None, HOSTS, body), DEFAULTS)
    if isinstance(value, dict):
        assert answer is None, body


def test_go_words_for_common_mistakes():
    cases = {
        b"": "missing request body",
        b"model=all-minilm": "invalid character 'm' looking for beginning of value",
        b'{"model":"m",}': "invalid character '}' looking for beginning of object key string",
        b'{"model":"m" "input":"a"}': "invalid character '\"' after object key:value pair",
        b"{'model':'m'}": "invalid character '\\'' looking for beginning of object key string",
        b'{"model":"m"': "unexpected EOF",
        b'{"input":[1,2}': "invalid character '}' after array element",
        b'{"model":"m","input":"a\x01"}': "invalid character '\\x01' in string literal",
        b'{"model":"m","input":"a\\q"}': "invalid character 'q' in string escape code",
        b'{"model":"m","input":5e}': "invalid character '}' in exponent of numeric literal",
        b'{"model":"m","stream":tru}': "invalid character '}' in literal true (expecting 'e')",
        b'{"model":3}': "json: cannot unmarshal number into Go struct field EmbedRequest.model of type string",
        b'{"model":"m","truncate":"no"}': "json: cannot unmarshal string into Go struct field EmbedRequest.truncate of type bool",
        b'{"model":"m","options":[1]}': "json: cannot unmarshal array into Go struct field EmbedRequest.options of type map[string]interface {}",
        b'["a"]': "json: cannot unmarshal array into Go value of type api.EmbedRequest",
    }
    for body, words in cases.items():
        answer = ollama.refuse(Asked("POST", "/api/embed", None, HOSTS, body), DEFAULTS)
        assert answer is not None and json.loads(answer.body) == {"error": words}, body
        assert answer.content_type == b"application/json; charset=utf-8"


def test_origins_is_one_value_for_every_server():
    assert Origins is CorsOrigins


@settings(max_examples=60, deadline=None)
@given(
    apis=st.lists(st.sampled_from(sorted(SERVERS)), min_size=1, max_size=4),
    case=st.sampled_from(FRONT["cases"][:200]),
)
def test_the_rule_made_once_for_a_pool_answers_as_refusal(apis, case):
    """``refuser(apis)`` is found once per pool, not per request: a pool of one api is its server's own rule
    (no lookup left for a request), and any pool answers every request as :func:`refusal` does."""
    made = refuser(apis)
    if len(set(apis)) == 1:
        assert made == SERVERS[apis[0]].refuse
    assert made(_asked(case), DEFAULTS) == refusal(apis, _asked(case), DEFAULTS)
