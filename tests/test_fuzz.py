"""Bad input, generated: whatever a client sends, the proxy answers it, never with a 500, and logs no traceback.

Hypothesis writes requests byte for byte (methods, targets, headers, bodies,
framing) and sends each on a fresh raw socket, from a thread, while the proxy
and its upstream run in the reactor.  Every request is complete and framed
(so every one must be answered); malformed framing has its own tests in
test_hostile.py.  The upstream (:class:`RecordingBackend`) answers 200 to
everything, so any 5xx but 503 is the proxy's own.

The proxy reads bodies where it must: a route rule that names models makes it
parse every ``/api/embed`` body, and during a yield it parses parkable bodies
to spot unload requests.  Both paths get malformed JSON here.
"""

from __future__ import annotations

import json
import os
from urllib.parse import unquote_to_bytes

import attrs
import pytest
import pytest_twisted
import treq
from hypothesis import HealthCheck, example, given, settings, strategies as st
from twisted.internet import reactor

from helpers import config_with, in_thread, release_every_hold, start_stack
from inmemory import Rig
from rawhttp import LogCapture, RecordingBackend, exchange, parse_response, port_of, recording_stack, request_bytes

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TOKEN = "fuzz-admin-token"

#: Examples per fuzz test; raise it for a longer hunt: YIELDPROXY_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py
EXAMPLES = int(os.environ.get("YIELDPROXY_FUZZ_EXAMPLES", "300"))
TIMEOUT = 120 * max(1, EXAMPLES // 300)

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# -- strategies ------------------------------------------------------------------------

TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
PRINTABLE = bytes(range(0x21, 0x7F))


def _from_alphabet(alphabet: bytes, min_size: int = 0, max_size: int = 24):
    return st.binary(min_size=min_size, max_size=max_size).map(lambda b: bytes(alphabet[x % len(alphabet)] for x in b))


tokens = _from_alphabet(TCHAR, 1, 12)
methods = st.one_of(
    st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT", b"post"]),
    tokens,
)
PROXY_ROUTES = [
    b"/api/embed", b"/api/embeddings", b"/v1/embeddings", b"/api/chat", b"/api/generate",
    b"/v1/chat/completions", b"/v1/completions", b"/api/tags", b"/api/pull", b"/api/create",
    b"/api/show", b"/api/ps", b"/api/version", b"/", b"/v1/models",
]
ADMIN_ROUTES = [b"/healthz", b"/status", b"/yield", b"/resume", b"/metrics", b"/history", b"/", b"/static/status.js"]


def targets(routes):
    junk = _from_alphabet(PRINTABLE, 0, 30)
    return st.one_of(
        st.sampled_from(routes),
        st.tuples(st.sampled_from(routes), junk).map(lambda t: t[0] + t[1]),
        st.tuples(st.sampled_from(routes), junk).map(lambda t: t[0] + b"?" + t[1]),
        junk.map(lambda p: b"/" + p),
        st.sampled_from([b"*", b"http://example.invalid/api/tags", b"/%2e%2e/%2e%2e/etc/passwd", b"/api//embed", b"/api/embed/"]),
    )


# Header values: anything but CR LF pairs (which would end the line: framing is tested elsewhere).
# (Branches repeat to weight them: most lines are valid, so requests get past the parser.)
_visible = _from_alphabet(bytes(range(0x20, 0x7F)) + b"\t", 0, 40)
_any_byte = st.binary(max_size=40)
header_values = st.one_of(
    _visible, _visible, _visible,
    _any_byte.map(lambda b: b.translate(None, b"\r\n\x00")),  # obs-text, other controls
    _any_byte.filter(lambda b: b"\r\n" not in b and not b.endswith(b"\r")),  # bare CR, LF, NUL: refused
)
_known_names = st.sampled_from([
    b"Content-Type", b"X-Yield-Class", b"X-Yield-Max-Wait", b"Authorization", b"Cookie", b"Connection",
    b"Expect", b"Host", b"TE", b"Upgrade", b"Keep-Alive", b"Trailer", b"Proxy-Authorization",
    b"Accept-Encoding", b"Content-Encoding", b"X-Forwarded-For", b"Range",
])
header_names = st.one_of(
    _known_names, _known_names, _known_names, tokens, tokens,
    _from_alphabet(bytes(range(0x21, 0x7F)), 1, 10),  # may hold separators: not a token
)
special_values = {
    b"X-Yield-Class": st.sampled_from([b"interactive", b"batch", b"long", b"LONG ", b"urgent", b"", b"\xff"]),
    b"X-Yield-Max-Wait": st.sampled_from([b"0", b"1", b"-1", b"nan", b"inf", b"1e309", b"0x10", b"", b" 2 ", b"\xff"]),
    b"Connection": st.sampled_from([b"close", b"keep-alive", b"upgrade", b"X-Yield-Class, close", b"te"]),
    b"Expect": st.sampled_from([b"100-continue", b"something-else"]),
    b"Content-Type": st.sampled_from([b"application/json", b"multipart/form-data; boundary=x", b"application/x-www-form-urlencoded", b"text/plain"]),
}


@st.composite
def headers(draw):
    out = []
    for _ in range(draw(st.integers(0, 6))):
        name = draw(header_names)
        if name.lower() in (b"content-length", b"transfer-encoding"):
            continue
        value = draw(special_values.get(name, header_values))
        out.append((name, value))
    return out


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)
ollama_like = st.fixed_dictionaries(
    {"model": st.one_of(st.sampled_from(["all-minilm", "fuzz-model", "llama3.2"]), json_values)},
    optional={
        "input": json_values,
        "prompt": json_values,
        "messages": json_values,
        "keep_alive": st.one_of(st.sampled_from([0, "0", "0s", "0m", -1, "5m", "bad"]), json_values),
        "stream": json_values,
    },
)


@st.composite
def bodies(draw):
    kind = draw(st.sampled_from(["empty", "binary", "json", "ollama", "truncated", "not-object"]))
    if kind == "empty":
        return b""
    if kind == "binary":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "not-object":
        return json.dumps(draw(st.lists(json_values, max_size=3))).encode()
    document = json.dumps(draw(ollama_like)).encode()
    if kind == "truncated":
        return document[: draw(st.integers(0, max(0, len(document) - 1)))]
    return document


@st.composite
def framed(draw, body: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A correct framing of ``body``: Content-Length, chunked (random splits), or none when empty."""
    if body and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces, last = [], 0
        for cut in [*cuts, len(body)]:
            if cut > last:
                pieces.append(body[last:cut])
                last = cut
        encoded = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        return [(b"Transfer-Encoding", b"chunked")], encoded
    return [(b"Content-Length", b"%d" % len(body))], body


@attrs.frozen
class Sent:
    method: bytes
    target: bytes
    version: bytes
    headers: list
    body: bytes

    def wire(self) -> bytes:
        lines = [self.method + b" " + self.target + b" " + self.version]
        lines += [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


@st.composite
def requests(draw, routes, extra_headers=st.just([])):
    method = draw(methods)
    target = draw(targets(routes))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 12 + [b"HTTP/1.0"] * 4 + [b"HTTP/1.2", b"HTTP/2.0", b"http/1.1"]))
    body = draw(bodies())
    framing, encoded = draw(framed(body))
    all_headers = [(b"Host", b"127.0.0.1"), *draw(headers()), *draw(extra_headers), *framing]
    return Sent(method, target, version, all_headers, encoded)


def check_answer(sent: Sent, response, allowed_5xx=(503,)) -> None:
    """Every complete request is answered, never with a 500 (or another 5xx of the proxy's own)."""
    assert response.status != 0, f"no answer to {sent.wire()[:300]!r}: {response.raw[:200]!r}"
    assert response.status < 500 or response.status in allowed_5xx, (
        f"{response.status} for {sent.wire()[:300]!r}: {response.body[:300]!r}"
    )
    if response.status >= 400 and (response.header(b"content-type") or b"").startswith(b"application/json") and response.body:
        assert "error" in response.json()


async def assert_still_serving(stack) -> None:
    """The listeners still answer: /healthz, and a plain embedding through the proxy."""
    health = await treq.get(stack.admin_url + "/healthz", persistent=False).addTimeout(30, reactor)
    assert health.code == 200 and await health.text() == "ok"
    ok = await treq.post(
        stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": "still here"}, persistent=False
    ).addTimeout(30, reactor)
    assert ok.code == 200
    await ok.content()


def model_rule_config(**sections):
    """A config whose route rule names models, so the proxy must parse every /api/embed body."""
    from yieldproxy.config import RouteRule

    config = config_with(**sections)
    return attrs.evolve(config, routes=(RouteRule(cls="long", path="/api/embed", models=("fuzz-*",)),))


# -- the proxy listener -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_fuzzed_requests_to_the_proxy_are_answered_without_a_500():
    """GPU available: every request is relayed or refused with a 4xx, bodies parsed by the model rule."""
    stack = await recording_stack(model_rule_config())
    port = port_of(stack.proxy_url)

    statuses = []

    @SETTINGS
    @given(requests(PROXY_ROUTES))
    def fuzz(sent):
        response = exchange(port, sent.wire(), timeout=10)
        statuses.append(response.status)
        check_answer(sent, response)

    try:
        with LogCapture() as logs:
            await in_thread(reactor, fuzz, timeout=TIMEOUT)
        assert logs.errors() == []
        assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0
        assert stack.echo.heads, "nothing reached the upstream: the fuzzing sent only refusals"
        # Few reach the upstream: a target with junk after a route is one Ollama has not, and a
        # generated body one Go cannot decode; Ollama's 404 or 400 comes at once from the proxy
        # (servers/ollama.py refuse).
        assert statuses.count(200) >= 1 and sum(400 <= s < 500 for s in statuses) >= 20
        await assert_still_serving(stack)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_fuzzed_requests_during_a_yield_get_clean_refusals():
    """GPU yielded, hold bounds of 0: parkable requests are parsed (unload check) and answered 503 at once."""
    zero = {"hold_seconds": 0.0}
    stack = await recording_stack(model_rule_config(classes={"interactive": zero, "batch": zero, "long": zero}))
    port = port_of(stack.proxy_url)
    stack.proxy.state.hold("fuzz", "yielded for the fuzzing")

    @SETTINGS
    @given(requests(PROXY_ROUTES))
    def fuzz(sent):
        response = exchange(port, sent.wire(), timeout=10)
        check_answer(sent, response)
        if response.status == 503:
            assert response.header(b"retry-after"), response.raw[:300]

    try:
        with LogCapture() as logs:
            await in_thread(reactor, fuzz, timeout=TIMEOUT)
        assert logs.errors() == []
        assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0
        stack.proxy.state.release("fuzz")
        await assert_still_serving(stack)
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_fuzzed_bytes_never_crash_the_listener():
    """Not even HTTP: random bytes on the socket get a 4xx or a close, and the proxy keeps serving."""
    stack = await recording_stack()
    port = port_of(stack.proxy_url)

    @settings(SETTINGS, max_examples=max(1, EXAMPLES // 3))
    @given(st.one_of(st.binary(max_size=400), st.binary(max_size=200).map(lambda b: b"GET /api/tags HTTP/1.1\r\n" + b)))
    def fuzz(data):
        response = exchange(port, data + b"\r\n\r\n", timeout=0.5)
        assert response.status < 500, (data, response.raw[:200])

    try:
        with LogCapture() as logs:
            await in_thread(reactor, fuzz, timeout=TIMEOUT)
        assert logs.errors() == []
        await assert_still_serving(stack)
    finally:
        await stack.stop()


# -- the admin listener ------------------------------------------------------------------------


admin_json = st.one_of(
    st.dictionaries(
        st.one_of(st.sampled_from(["reason", "source", "expected_seconds", "for_seconds"]), st.text(max_size=8)),
        json_values,
        max_size=4,
    ),
    json_values,
).map(lambda v: json.dumps(v).encode())


def _klein_decodable(sent: Sent) -> bool:
    """Host and percent-decoded path in UTF-8 (see the test below for the others)."""
    try:
        for name, value in sent.headers:
            if name.lower() == b"host":
                value.decode("utf-8")
        unquote_to_bytes(sent.target.split(b"?")[0]).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@st.composite
def admin_requests(draw):
    auth = draw(st.sampled_from([[], [(b"Authorization", b"Bearer " + TOKEN.encode())], [(b"Authorization", b"Bearer wrong")]]))
    sent = draw(requests(ADMIN_ROUTES, st.just(auth)).filter(_klein_decodable))
    if draw(st.booleans()):
        # A JSON document the yield/resume parsers get to read, and authorised.
        body = draw(admin_json)
        framing, encoded = draw(framed(body))
        sent = Sent(
            b"POST", draw(st.sampled_from([b"/yield", b"/resume"])), b"HTTP/1.1",
            [(b"Host", b"127.0.0.1"), (b"Authorization", b"Bearer " + TOKEN.encode()), *framing], encoded,
        )
    return sent


@pytest_twisted.ensureDeferred
async def test_fuzzed_admin_calls_are_answered_without_a_500():
    stack = await start_stack(reactor, token=TOKEN)
    port = port_of(stack.admin_url)

    @SETTINGS
    @given(admin_requests())
    def fuzz(sent):
        response = exchange(port, sent.wire(), timeout=10)
        check_answer(sent, response, allowed_5xx=())
        if sent.target in (b"/yield", b"/resume") and sent.method == b"POST" and response.status == 200:
            assert response.json()["state"] in ("available", "yielded", "draining")

    try:
        with LogCapture() as logs:
            await in_thread(reactor, fuzz, timeout=TIMEOUT)
        assert logs.errors() == []
        release_every_hold(stack.proxy.state)
        await assert_still_serving(stack)
    finally:
        await stack.stop()


# -- found by fuzzing -----------------------------------------------------------------------------

#: Nested past json's recursion limit, yet under 4 KiB: the proxy reads bodies that small
#: during a yield (to spot unload requests).
DEEP = b"[" * 4000


def _exchange_in_memory(rig, data: bytes, site=None):
    """``data`` written in memory to the proxy listener's site (or ``site``), on the rig's Clock; the answer."""
    peer = rig.raw(site)
    peer.send(data)
    rig.turn()
    return parse_response(peer.data)[0]


@pytest.mark.parametrize("yielded", [False, True], ids=["model-rule", "yielded"])
def test_deeply_nested_json_body_is_a_400_not_a_500(yielded):
    rig = Rig(config_with() if yielded else model_rule_config(), upstream=RecordingBackend())
    if yielded:
        rig.proxy.state.hold("test")
    with LogCapture() as logs:
        body = DEEP if yielded else b'{"model": "fuzz-a", "input": ' + DEEP
        response = _exchange_in_memory(rig, request_bytes(b"POST", b"/api/embed", [(b"X-Yield-Max-Wait", b"0")], body))
    assert response is not None and response.status != 500
    assert logs.errors() == []


def test_deeply_nested_json_to_the_admin_api_is_a_400_not_a_500():
    rig = Rig()
    data = request_bytes(b"POST", b"/yield", [(b"Content-Type", b"application/json")], body=DEEP)
    response = _exchange_in_memory(rig, data, rig.proxy.admin_app.site())
    assert response.status == 400


@pytest.mark.parametrize("where", ["host", "path"])
@pytest_twisted.ensureDeferred
async def test_admin_listener_logs_no_traceback_for_non_utf8_host_or_path(where):
    stack = await start_stack(reactor)
    try:
        data = (
            request_bytes(b"GET", b"/healthz", [(b"Host", b"\xff\xfe")])
            if where == "host" else request_bytes(b"GET", b"/%ff%fe")
        )
        with LogCapture() as logs:
            response = await in_thread(reactor, exchange, port_of(stack.admin_url), data, 10, timeout=30)
        assert 400 <= response.status < 500
        assert logs.errors() == []
    finally:
        await stack.stop()


# -- disguised model calls through a yield ----------------------------------------------------------
#
# Generated targets and bodies in the shapes that once passed a yield: percent-
# encoded, dot-segmented, slashed and fragmented targets; keys in Go's case-
# folded spellings, duplicated, with values Go reads its own way.  The oracle
# is built from how each request was made (Ollama's route table and Go's
# binding rules, written out here), not from the proxy's classifier.

#: Ollama's routes (server/routes.go, GenerateRoutes) that run a model, or load one onto the GPU.
MODEL_CALL_ROUTES = {
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/v1/chat/completions", "/v1/completions",
    "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/audio/transcriptions", "/api/pull", "/api/create",
}
DISGUISE_ROUTES = sorted(MODEL_CALL_ROUTES) + ["/api/tags", "/api/show", "/api/ps", "/v1/models", "/api/unknown"] + [
    "/api/generate", "/api/chat"] * 4  # where an unload can hide: weighted up

#: Key spellings Go binds to each field, and spellings it does not.
BINDS = {
    "model": ["model", "Model", "MODEL", "m\\u006fdel"],
    "prompt": ["prompt", "Prompt", "PROMPT", "pr\\u006fmpt"],
    "messages": ["messages", "Messages", "MESSAGES", "me\\u017fsages", "me\u017fsages"],
    "keep_alive": ["keep_alive", "KEEP_ALIVE", "Keep_Alive", "\\u212aeep_alive", "\u212aeep_alive"],
}
NEVER_BINDS = {
    "prompt": ["prompt ", "pr0mpt", "_prompt"],
    "messages": ["message", "messages_"],
    "keep_alive": ["keep_al\\u0131ve", "keep_al\u0131ve", "keepalive", "keep-alive"],
}
#: Values by field, each with how Go binds it: ("zero" | "nonzero" | "empty" | "full" | "null" | "error").
VALUES = {
    "model": [('"m"', "full"), ("null", "null"), ("5", "error")],
    "prompt": [('""', "empty"), ('"hi"', "full"), ("null", "null"), ("5", "error")],
    "messages": [("[]", "empty"), ('[{"role":"user","content":"hi"}]', "full"), ("null", "null"), ("{}", "error")],
    "keep_alive": [
        ("0", "zero"), ('"0"', "zero"), ('"0s"', "zero"), ("-0.0", "zero"), ("1e-10", "zero"), ('"0.5ns"', "zero"),
        ("5", "nonzero"), ('"5m"', "nonzero"), ("-1", "nonzero"), ('"-1s"', "nonzero"),
        ("null", "null"), ('"bad"', "error"), ("true", "error"),
    ],
}


@st.composite
def disguised_target(draw):
    """A route, written the way a client may disguise it, and the route Go would serve it as."""
    route = draw(st.sampled_from(DISGUISE_ROUTES)).encode()
    segments = []
    for segment in route.split(b"/")[1:]:
        if draw(st.sampled_from([True] + [False] * 7)):
            segment = segment.upper()  # gin's routes are case-sensitive: an unknown route
        segments.append(b"".join(
            (b"%%%02x" if draw(st.booleans()) else b"%%%02X") % c if draw(st.sampled_from([1, 0, 0, 0])) else bytes((c,))
            for c in segment
        ))
        extra = draw(st.sampled_from([None] * 7 + [".", "..", ""]))
        if extra == ".":
            segments.append(b".")
        elif extra == "..":
            segments.extend([b"tags", b".."])
        elif extra == "":
            segments.append(b"")
    target = b"/" + b"/".join(segments)
    target += draw(st.sampled_from([b""] * 6 + [b"/", b"//", b"?x=1", b"?x=%41", b"#frag", b"?a#b"]))
    head, rest = target[:1], target[1:]
    trick = draw(st.sampled_from([None] * 12 + ["%2F", "%2e%2e", "backslash", "climb"]))
    if trick == "%2F":
        target = head + rest.replace(b"/", b"%2F", 1)
    elif trick == "%2e%2e":
        target = b"/api/%2e%2e" + target
    elif trick == "backslash":
        target = head + rest.replace(b"/", b"%5C" if draw(st.booleans()) else b"\\", 1)
    elif trick == "climb":
        target = b"/.." + target
    return target


@st.composite
def disguised_body(draw):
    """A JSON body as members in order, each noted with how Go binds it; maybe mangled afterwards."""
    # Half of them start as an unload (a model, keep_alive 0) that other members may undo.
    fields = ["model", "keep_alive"] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 4))):
        fields.insert(draw(st.integers(0, len(fields))), draw(st.sampled_from(sorted(BINDS))))
    members, binding = [], []
    for field in fields:
        value, kind = draw(st.sampled_from(VALUES[field]))
        if field in NEVER_BINDS and draw(st.integers(0, 3)) == 0:
            key = draw(st.sampled_from(NEVER_BINDS[field]))
        else:
            key = draw(st.sampled_from(BINDS[field]))
            binding.append((field, kind))
        members.append(f'"{key}":{value}')
    body = ("{" + ",".join(members) + "}").encode("utf-8")
    mangle = draw(st.integers(0, 9))
    if mangle == 0:
        body += b' {"prompt":"hi"}'  # Go reads the first value only
    elif mangle == 1:
        body = body[:-1] + b',"x":NaN}'  # not JSON: a NaN inside a string would still be
    elif mangle == 2:
        body = body[:-1] + b',"x":"\xff"}'
    return body, binding, mangle in (0, 1, 2)


def go_unloads(path: str, binding, mangled: bool) -> bool:
    """True when Ollama would unload (and load nothing) for this body on ``path`` (POST)."""
    if mangled or path not in ("/api/generate", "/api/chat"):
        return False
    state = {}
    for field, kind in binding:
        if kind == "error":
            return False  # Ollama refuses the request: no unload either
        if kind == "null":
            if field in ("keep_alive", "messages"):
                state.pop(field, None)
            continue  # a string field keeps its value
        state[field] = kind
    empty = state.get("prompt" if path == "/api/generate" else "messages", "empty") == "empty"
    return state.get("keep_alive") == "zero" and empty


def _ollamas_bare_refusal(response) -> bool:
    """Ollama's own 404 or 405 (gin's plain text), given at once by the proxy (servers/ollama.py refuse)."""
    return (response.status, response.body) in ((404, b"404 page not found"), (405, b"405 method not allowed"))


def _received_route(head: bytes) -> tuple[str, str]:
    method, target, _ = head.split(b"\r\n")[0].split(b" ")
    return method.decode(), unquote_to_bytes(target.partition(b"?")[0]).decode("utf-8")


@pytest_twisted.ensureDeferred
async def test_fuzzed_disguises_during_a_yield_never_reach_the_upstream_as_a_model_call():
    """No disguise of target or body gets a model call to a yielded GPU; no 500, no traceback."""
    zero = {"hold_seconds": 0.0}
    stack = await recording_stack(config_with(classes={"interactive": zero, "batch": zero, "long": zero}))
    port = port_of(stack.proxy_url)
    stack.proxy.state.hold("fuzz", "yielded for the fuzzing")
    outcomes = {"passed": 0, "parked": 0, "refused": 0, "unloads": 0}

    @SETTINGS
    @given(st.sampled_from([b"POST"] * 6 + [b"GET", b"HEAD", b"OPTIONS", b"DELETE"]), disguised_target(), disguised_body())
    # True unloads behind disguised targets, every run (random ones are rarer).
    @example(b"POST", b"/api/%67enerate/", (b'{"model":"m","KEEP_ALIVE":0}', [("model", "full"), ("keep_alive", "zero")], False))
    @example(b"POST", b"//api/tags/../chat", (b'{"\\u212aeep_alive":"0s","Messages":[]}', [("keep_alive", "zero"), ("messages", "empty")], False))
    def fuzz(method, target, made):
        body, binding, mangled = made
        before = len(stack.echo.heads)
        response = exchange(port, request_bytes(method, target, body=body), timeout=10)
        assert response.status != 0 and (response.status < 500 or response.status == 503), response.raw[:300]
        if response.status >= 400 and method != b"HEAD":
            assert _ollamas_bare_refusal(response) or "error" in response.json(), response.raw[:300]
        received = stack.echo.heads[before:]
        if response.status == 503:
            outcomes["parked"] += 1
            assert received == []
        elif response.status in (400, 403, 404, 405):
            outcomes["refused"] += 1
            assert received == []
        for head in received:
            outcomes["passed"] += 1
            got_method, path = _received_route(head)
            assert b"#" not in head.split(b"\r\n")[0] and "//" not in path and "/./" not in path + "/"
            if path in MODEL_CALL_ROUTES and got_method == "POST":
                assert go_unloads(path, binding, mangled), (
                    f"a model call reached the upstream during a yield: {head[:200]!r} {body[:300]!r}"
                )
                outcomes["unloads"] += 1

    try:
        with LogCapture() as logs:
            await in_thread(reactor, fuzz, timeout=TIMEOUT)
        assert logs.errors() == []
        assert min(outcomes.values()) > 0, outcomes  # every path was taken, true unloads too
        assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0
        stack.proxy.state.release("fuzz")
        await assert_still_serving(stack)
    finally:
        await stack.stop()
