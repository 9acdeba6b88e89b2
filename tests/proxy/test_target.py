"""The request target: one canonical form, used to classify and to forward, or a reasoned refusal."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import given, settings, strategies as st

from yieldproxy.proxy.target import BadTarget, parse_target

SETTINGS = settings(max_examples=500, deadline=None, database=None)


@pytest.mark.parametrize(
    "raw, path, forwarded",
    [
        (b"/api/embed", "/api/embed", b"/api/embed"),
        (b"/", "/", b"/"),
        (b"/api/%65mbed", "/api/embed", b"/api/embed"),
        (b"/api/%65%6d%62%65%64", "/api/embed", b"/api/embed"),
        (b"/api/tags/../embed", "/api/embed", b"/api/embed"),
        (b"/api/./embed/.", "/api/embed", b"/api/embed"),
        (b"//api///embed", "/api/embed", b"/api/embed"),
        (b"/api/embed/", "/api/embed", b"/api/embed"),
        (b"/api/embed?keep=%41&x", "/api/embed", b"/api/embed?keep=%41&x"),
        (b"/api/tags?", "/api/tags", b"/api/tags?"),
        (b"/a/..", "/", b"/"),
        (b"/...", "/...", b"/..."),
        (b"/v1/models/llama3.2:8b", "/v1/models/llama3.2:8b", b"/v1/models/llama3.2:8b"),
        (b"/v1/models/caf%C3%A9", "/v1/models/caf\u00e9", b"/v1/models/caf%C3%A9"),
        (b"/a%20b", "/a b", b"/a%20b"),
        (b"/x%3Fy", "/x?y", b"/x%3Fy"),
        (b"/x%23y", "/x#y", b"/x%23y"),
        (b"/%25", "/%", b"/%25"),
        (b"/a\"b", "/a\"b", b"/a%22b"),
    ],
)
def test_canonical_forms(raw, path, forwarded):
    target = parse_target(raw)
    assert (target.path, target.raw) == (path, forwarded)


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"*", "must be a path"),
        (b"http://example.invalid/api/tags", "must be a path"),
        (b"/api/embed#x", "'#'"),
        (b"/api/embed?a#b", "'#'"),
        (b"/api%2Fembed", "encoded slash"),
        (b"/api\\embed", "backslash"),
        (b"/api%5cembed", "backslash"),
        (b"/api/%00", "control character"),
        (b"/api/%0A", "control character"),
        (b"/api/%7f", "control character"),
        (b"/api/%ff", "UTF-8"),
        (b"/api/%2e%2e/x", "percent-encoded dot segment"),
        (b"/api/%2E/x", "percent-encoded dot segment"),
        (b"/..", "climbs above"),
        (b"/api/../../x", "climbs above"),
        (b"/api/%6", "invalid percent-escape"),
        (b"/api/%zz", "invalid percent-escape"),
        (b"/api?x=%", "invalid percent-escape"),
        (b"/api?x=\xff", "outside ASCII"),
        (b"/api?x=\x01", "control character"),
    ],
)
def test_refusals_say_why(raw, why):
    with pytest.raises(BadTarget, match=why):
        parse_target(raw)


# -- properties ---------------------------------------------------------------------------------

_visible = st.binary(max_size=40).map(lambda b: bytes(0x21 + x % 94 for x in b))
targets = st.one_of(
    _visible.map(lambda b: b"/" + b),
    st.lists(st.sampled_from([b"api", b"v1", b"embed", b".", b"..", b"", b"%65", b"%2e", b"%2F", b"%C3%A9", b"a%20b"]),
             max_size=6).map(lambda parts: b"/" + b"/".join(parts)),
)


def _go_path(raw: bytes) -> bytes:
    """What Go's url.ParseRequestURI puts in URL.Path for a valid target (it decodes every escape)."""
    return unquote_to_bytes(raw.partition(b"?")[0])


@SETTINGS
@given(targets)
def test_the_canonical_target_is_what_go_decodes_and_is_stable(raw):
    try:
        target = parse_target(raw)
    except BadTarget:
        return
    # Go decodes the forwarded target to exactly the path the class was decided on...
    assert _go_path(target.raw) == target.path.encode("utf-8")
    # ...which has no dot segment, no empty segment, no trailing slash: Go's mux
    # would not redirect it, gin would not redirect it.
    segments = target.path.split("/")[1:]
    assert target.path == "/" or all(s not in ("", ".", "..") for s in segments)
    # Normalising again changes nothing.
    assert parse_target(target.raw) == target


MODEL_ROUTES = [b"/api/embed", b"/api/generate", b"/api/chat", b"/v1/chat/completions", b"/v1/embeddings"]


@st.composite
def disguised(draw):
    """A model route in a disguise Go's server would still route to it (or to a redirect to it)."""
    route = draw(st.sampled_from(MODEL_ROUTES))
    out = []
    for segment in route.split(b"/")[1:]:
        text = b"".join(
            b"%%%02X" % c if draw(st.booleans()) and draw(st.booleans()) else bytes((c,)) for c in segment
        )
        out.append(text)
        if draw(st.integers(0, 5)) == 0:
            out.append(b".")
        if draw(st.integers(0, 5)) == 0:
            out.extend([b"junk", b".."])
    joined = b"/" + b"/".join(out)
    if draw(st.booleans()):
        joined = joined.replace(b"/", b"//", draw(st.integers(1, 3)))
    if draw(st.booleans()):
        joined += b"/"
    return route, joined


@SETTINGS
@given(disguised())
def test_a_disguised_model_route_is_classified_as_the_route(case):
    route, raw = case
    target = parse_target(raw)
    assert target.path.encode() == route and target.raw == route
