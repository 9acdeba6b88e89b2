"""A request the upstream would refuse at once is refused at once, in its own words, and never parked.

During a yield a web page on any site could send no-cors POSTs (``text/plain``,
no preflight) of large JSON bodies to the proxy port: Ollama's CORS check
refuses each at once, but the proxy parked them, filled
``parking.max_parked_bytes``, and real callers got 503 "queue full".  A typo'd
path waited out the yield for a 503 blaming the GPU, a typo'd body for its 400.
The proxy now asks the upstream's rule (``servers.refusal``) once, at admission.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import config_with, declaring
from inmemory import Rig
from rawhttp import RecordingBackend, parse_response, request_bytes
from yieldproxy.servers import Asked, ollama, refusal

EMBED = b'{"model":"all-minilm","input":"hello"}'
PAGE = [(b"Origin", b"https://evil.example"), (b"Content-Type", b"text/plain;charset=UTF-8")]


def _yielded(config=None):
    backend = RecordingBackend()
    rig = Rig(config, upstream=backend)
    rig.proxy.state.hold("test", "a game")
    return rig, backend


def _send(rig, data: bytes):
    peer = rig.raw()
    peer.send(data)
    rig.run(1)
    return peer


def test_a_web_page_cannot_fill_the_lot_during_a_yield():
    rig, backend = _yielded(config_with(parking={"max_parked_bytes": 4 * 1024 * 1024}))
    big = b'{"model":"all-minilm","input":"' + b"x" * (1024 * 1024) + b'"}'
    for _ in range(12):  # three times what the lot holds
        peer = _send(rig, request_bytes(b"POST", b"/api/embed", PAGE, big))
        answer = parse_response(peer.data)[0]
        assert answer is not None and (answer.status, answer.body) == (403, b""), peer.data[:200]
        assert answer.headers.get(b"content-type") is None
    assert len(rig.proxy.lot) == 0
    assert rig.sample("yieldproxy_refused_at_once_total", reason="origin") == 12
    # A real caller still parks, and is served once the GPU is back.
    caller = _send(rig, request_bytes(b"POST", b"/api/embed", body=EMBED))
    assert caller.data == b"" and len(rig.proxy.lot) == 1
    rig.proxy.state.release("test")
    rig.turn()
    assert parse_response(caller.data)[0].status == 200
    assert backend.bodies == [EMBED]


def test_a_page_ollama_allows_still_parks():
    rig, backend = _yielded(config_with(proxy={"allowed_origins": ("https://app.example",)}))
    for origin in (b"http://localhost:3000", b"https://app.example"):
        peer = _send(rig, request_bytes(b"POST", b"/api/embed", [(b"Origin", origin)], EMBED))
        assert peer.data == b""
    assert len(rig.proxy.lot) == 2 and backend.heads == []


def test_a_typod_route_gets_ollamas_404_at_once_not_a_503_after_the_yield():
    rig, backend = _yielded()
    peer = _send(rig, request_bytes(b"POST", b"/api/embedd", body=EMBED))
    answer = parse_response(peer.data)[0]
    assert (answer.status, answer.body) == (404, b"404 page not found")
    assert answer.headers[b"content-type"] == [b"text/plain"]
    wrong_method = parse_response(_send(rig, request_bytes(b"GET", b"/api/embed")).data)[0]
    assert (wrong_method.status, wrong_method.body) == (405, b"405 method not allowed")
    assert wrong_method.headers[b"allow"] == [b"POST"]
    assert len(rig.proxy.lot) == 0 and backend.heads == []


def test_a_route_the_operator_declares_parks_as_before():
    rig, backend = _yielded(declaring("/api/embedd"))
    peer = _send(rig, request_bytes(b"POST", b"/api/embedd", body=EMBED))
    assert peer.data == b"" and len(rig.proxy.lot) == 1


def test_a_typod_body_gets_ollamas_400_at_once():
    rig, backend = _yielded()
    for body, words in [
        (b'{"model":"all-minilm","input":"a",}', "invalid character '}' looking for beginning of object key string"),
        (b'{"model":"all-minilm","truncate":"yes"}',
         "json: cannot unmarshal string into Go struct field EmbedRequest.truncate of type bool"),
        (b"", "missing request body"),
    ]:
        answer = parse_response(_send(rig, request_bytes(b"POST", b"/api/embed", body=body)).data)[0]
        assert answer.status == 400 and json.loads(answer.body) == {"error": words}
    assert len(rig.proxy.lot) == 0 and backend.heads == []


def test_an_allowed_page_reads_the_refusal_as_ollama_would_send_it():
    rig, _ = _yielded()
    origin = b"http://localhost:5173"
    answer = parse_response(_send(rig, request_bytes(b"POST", b"/api/embedd", [(b"Origin", origin)], EMBED)).data)[0]
    assert answer.status == 404
    assert answer.headers[b"access-control-allow-origin"] == [origin]
    assert answer.headers[b"vary"] == [b"Origin"]


# -- generated: whatever the Origin, path and body, refused exactly when Ollama's rule refuses -------

_paths = st.sampled_from([
    "/api/embed", "/api/embeddings", "/api/chat", "/api/generate", "/v1/embeddings", "/api/embedd",
    "/api/Embed", "/api/tags", "/v1/chat/completion", "/x",
])
_origin_values = st.one_of(
    st.none(),
    st.sampled_from(["http://localhost", "http://127.0.0.1:8080", "app://x", "https://evil.example", "null",
                     "http://LOCALHOST", "http://localhost.evil.example"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20),
)
_bodies = st.one_of(
    st.sampled_from([EMBED, b"", b"{", b"[1]", b'{"model":3}', b'{"model":"m","options":1}', b"model=x",
                     b'{"model":"m"} trailing', b'{"messages":[]}', b"null"]),
    st.binary(max_size=40),
)


@given(method=st.sampled_from(["POST", "POST", "GET", "DELETE", "PUT"]), path=_paths, origin=_origin_values, body=_bodies)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_during_a_yield_a_request_is_refused_exactly_when_the_upstream_would(method, path, origin, body):
    rig, backend = _yielded()
    headers = [(b"Origin", origin.encode())] if origin is not None else []
    peer = _send(rig, request_bytes(method.encode(), path.encode(), headers, body if method != "GET" else b""))
    hosts = frozenset({rig.proxy.upstream.url.removeprefix("http://")})
    asked = Asked(method, path, origin or None, hosts, body if method != "GET" else b"")
    expected = refusal(("ollama",), asked, ollama.allowed_origins())
    answer = parse_response(peer.data)[0] if peer.data else None
    if expected is not None:
        # The upstream's answer, at once; nothing parked, nothing sent upstream.
        assert answer is not None and answer.status == expected.status and answer.body == expected.body
        assert len(rig.proxy.lot) == 0 and backend.heads == []
    else:
        # Not refused on the upstream's behalf: it parks (or passes, or meets one of the proxy's own rules).
        parked = len(rig.proxy.lot) == 1
        passed = len(backend.heads) == 1
        assert parked or passed or _the_proxys_own_400(answer), peer.data[:300]


def _the_proxys_own_400(answer) -> bool:
    """A 400 in the proxy's words (a body it cannot read as Go would, gojson.BadBody), not in Go's."""
    if answer is None or answer.status != 400:
        return False
    message = json.loads(answer.body)["error"]
    message = message["message"] if isinstance(message, dict) else message
    return message.startswith("request body")
