"""API shape translation for the fallback, both ways, without any server.

Each client API's promise is checked on what we render: Ollama's /api/embed
and OpenAI's /v1/embeddings get unit vectors (a llama.cpp-like backend may
answer raw ones), the legacy /api/embeddings gets the vector as it is, and
base64 answers are little-endian float32.  The rendered answers are also
read back with the real clients' own response models.
"""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest
from hypothesis import given, strategies as st

from yieldproxy.upstream.translation import (
    BackendError,
    EmbedRequest,
    Embeddings,
    Untranslatable,
    backend_request,
    client_response,
    cosine,
    decode_base64_f32,
    encode_base64_f32,
    error_message,
    l2_normalise,
    parse_request,
    parse_response,
    route_of,
)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


# -- reading the client's request ------------------------------------------------


def test_routes():
    assert route_of("/api/embed") == "embed"
    assert route_of("/api/embed/") == "embed"
    assert route_of("/api/embeddings") == "legacy"
    assert route_of("/v1/embeddings") == "v1"
    assert route_of("/api/chat") is None
    assert route_of("/v1/chat/completions") is None


def test_ollama_embed_request_single_and_batch():
    one = parse_request("/api/embed", body(model="all-minilm", input="hello"))
    assert one == EmbedRequest("embed", "all-minilm", ("hello",))
    assert one.unit_vectors
    many = parse_request(
        "/api/embed",
        body(model="m", input=["a", "b"], truncate=True, dimensions=8, options={"num_ctx": 256}, keep_alive="5m"),
    )
    assert many.inputs == ("a", "b")
    assert many.dimensions == 8
    assert many.options == {"num_ctx": 256}
    assert many.keep_alive == "5m"


def test_ollama_legacy_request():
    req = parse_request("/api/embeddings", body(model="m", prompt="hi there"))
    assert req.route == "legacy" and req.inputs == ("hi there",)
    assert not req.unit_vectors


def test_openai_request():
    req = parse_request("/v1/embeddings", body(model="text-embed", input=["x", "y"], encoding_format="base64", dimensions=4, user="u1"))
    assert req == EmbedRequest("v1", "text-embed", ("x", "y"), 4, "base64")
    assert req.unit_vectors
    # No encoding_format means float; null too.
    assert parse_request("/v1/embeddings", body(model="m", input="x")).encoding_format == "float"
    assert parse_request("/v1/embeddings", body(model="m", input="x", encoding_format=None)).encoding_format == "float"


@pytest.mark.parametrize(
    "path, fields, why",
    [
        ("/api/chat", {"model": "m", "messages": []}, "not an embedding route"),
        ("/api/embed", {"input": "x"}, "no model"),
        ("/api/embed", {"model": "", "input": "x"}, "no model"),
        ("/api/embed", {"model": "m"}, "no input"),
        ("/api/embed", {"model": "m", "input": []}, "no input"),
        ("/api/embed", {"model": "m", "input": "x", "truncate": False}, "truncate"),
        ("/api/embed", {"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
        ("/api/embed", {"model": "m", "input": "x", "dimensions": True}, "dimensions"),
        ("/api/embed", {"model": "m", "input": "x", "options": "fast"}, "options"),
        ("/api/embeddings", {"model": "m", "prompt": ""}, "no prompt"),
        ("/api/embeddings", {"model": "m"}, "no prompt"),
        ("/v1/embeddings", {"model": "m", "input": [1, 2, 3]}, "token-id"),
        ("/v1/embeddings", {"model": "m", "input": [[1, 2], [3]]}, "token-id"),
        ("/v1/embeddings", {"model": "m", "input": ["ok", ""]}, "empty string"),
        ("/v1/embeddings", {"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_requests_the_fallback_does_not_serve(path, fields, why):
    with pytest.raises(Untranslatable, match=why):
        parse_request(path, body(**fields))


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_unreadable_bodies(raw):
    with pytest.raises(Untranslatable):
        parse_request("/api/embed", raw)


# -- the request the backend gets ---------------------------------------------------


def test_ollama_client_to_openai_backend():
    req = parse_request("/api/embed", body(model="all-minilm", input=["a", "b"], dimensions=16, keep_alive=0, options={"x": 1}))
    path, raw = backend_request(req, "openai", "sentence-transformers/all-MiniLM-L6-v2")
    assert path == "/embeddings"
    # Floats (every OpenAI-shaped server speaks them); Ollama-only fields dropped.
    assert json.loads(raw) == {
        "model": "sentence-transformers/all-MiniLM-L6-v2", "input": ["a", "b"], "encoding_format": "float", "dimensions": 16,
    }


def test_openai_client_to_ollama_backend():
    req = parse_request("/v1/embeddings", body(model="text-embedding-3-small", input="hello", encoding_format="base64"))
    path, raw = backend_request(req, "ollama", "all-minilm:latest")
    assert path == "/api/embed"
    assert json.loads(raw) == {"model": "all-minilm:latest", "input": ["hello"], "truncate": True}


def test_ollama_client_to_ollama_backend_keeps_options():
    req = parse_request("/api/embed", body(model="m", input="x", options={"num_ctx": 128}, keep_alive="10m"))
    _, raw = backend_request(req, "ollama", "m-cpu")
    assert json.loads(raw) == {"model": "m-cpu", "input": ["x"], "truncate": True, "options": {"num_ctx": 128}, "keep_alive": "10m"}


def test_legacy_goes_to_the_legacy_route_of_an_ollama_backend():
    req = parse_request("/api/embeddings", body(model="m", prompt="p"))
    path, raw = backend_request(req, "ollama", "m")
    assert path == "/api/embeddings"
    assert json.loads(raw) == {"model": "m", "prompt": "p"}
    path, raw = backend_request(req, "openai", "m")
    assert path == "/embeddings" and json.loads(raw)["input"] == ["p"]


def test_non_ascii_text_is_sent_as_it_is():
    req = parse_request("/api/embed", body(model="m", input="東京 🎉"))
    _, raw = backend_request(req, "openai", "m")
    assert json.loads(raw)["input"] == ["東京 🎉"]


# -- reading the backend's answer ------------------------------------------------------


def openai_answer(vectors, base64_encoded=False, order=None, tokens=7) -> bytes:
    data = [
        {"object": "embedding", "index": i, "embedding": encode_base64_f32(v) if base64_encoded else v}
        for i, v in enumerate(vectors)
    ]
    if order:
        data = [data[i] for i in order]
    return json.dumps({"object": "list", "data": data, "model": "x", "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}).encode()


def test_openai_answer_read_in_index_order_and_from_base64():
    req = EmbedRequest("embed", "m", ("a", "b", "c"))
    vectors = [[1.0, 0.0], [0.0, 2.0], [0.5, 0.5]]
    got = parse_response(req, "openai", 200, openai_answer(vectors, order=[2, 0, 1]))
    assert got == Embeddings(tuple(tuple(v) for v in vectors), 7)
    got = parse_response(req, "openai", 200, openai_answer(vectors, base64_encoded=True))
    assert [list(v) for v in got.vectors] == vectors


def test_ollama_answers():
    req = EmbedRequest("embed", "m", ("a", "b"))
    got = parse_response(req, "ollama", 200, body(model="m", embeddings=[[0.6, 0.8], [1, 0]], prompt_eval_count=4))
    assert got.vectors == ((0.6, 0.8), (1.0, 0.0)) and got.prompt_tokens == 4
    legacy = EmbedRequest("legacy", "m", ("a",))
    assert parse_response(legacy, "ollama", 200, body(embedding=[3, 4])).vectors == ((3.0, 4.0),)


@pytest.mark.parametrize(
    "api, status, raw, reason",
    [
        ("openai", 500, body(error={"message": "boom", "type": "server_error"}), "status_500"),
        ("ollama", 404, body(error='model "m" not found, try pulling it first'), "status_404"),
        ("openai", 422, body(detail=[{"msg": "List should have at least 1 item"}]), "status_422"),
        ("ollama", 200, body(error="late error"), "backend_error"),
        ("ollama", 200, b"<html>", "bad_answer"),
        ("ollama", 200, b"[]", "bad_answer"),
        ("ollama", 200, body(embeddings=[[1.0]]), "bad_answer"),  # one vector for two inputs
        ("ollama", 200, body(embeddings=[[1.0], [1.0, 2.0]]), "bad_answer"),  # ragged
        ("ollama", 200, body(embeddings=[[1.0], []]), "bad_answer"),
        ("ollama", 200, body(embeddings=[[1.0], ["x"]]), "bad_answer"),
        ("ollama", 200, b'{"embeddings": [[1.0], [NaN]]}', "bad_answer"),
        ("openai", 200, body(data=[{"index": 0, "embedding": [1]}, {"index": 0, "embedding": [1]}]), "bad_answer"),
        ("openai", 200, body(data=[{"index": "0", "embedding": [1]}, {"index": 1, "embedding": [1]}]), "bad_answer"),
        ("openai", 200, body(data=[{"index": 0, "embedding": "!!!"}, {"index": 1, "embedding": [1]}]), "bad_answer"),
        ("openai", 200, body(object="list"), "bad_answer"),
    ],
)
def test_backend_failures(api, status, raw, reason):
    req = EmbedRequest("embed", "m", ("a", "b"))
    with pytest.raises(BackendError) as caught:
        parse_response(req, api, status, raw)
    assert caught.value.reason == reason


def test_backend_error_messages_are_kept():
    req = EmbedRequest("embed", "m", ("a",))
    with pytest.raises(BackendError, match="boom"):
        parse_response(req, "openai", 500, body(error={"message": "boom", "type": "server_error"}))
    with pytest.raises(BackendError, match="not found"):
        parse_response(req, "ollama", 404, body(error="model not found"))


def test_dimensions_a_backend_ignored_are_truncated():
    req = EmbedRequest("v1", "m", ("a",), dimensions=2)
    got = parse_response(req, "ollama", 200, body(embeddings=[[3.0, 4.0, 12.0]]))
    assert got.vectors == ((3.0, 4.0),)
    # Truncated, then normalised again for a client promised unit vectors.
    out = json.loads(client_response(req, got))
    assert out["data"][0]["embedding"] == pytest.approx([0.6, 0.8])
    short = EmbedRequest("v1", "m", ("a",), dimensions=4)
    with pytest.raises(BackendError, match="asked for 4"):
        parse_response(short, "ollama", 200, body(embeddings=[[3.0, 4.0]]))


@pytest.mark.parametrize(
    "raw, message",
    [
        (body(error="plain ollama error"), "plain ollama error"),
        (body(error={"message": "openai error", "type": "invalid_request_error"}), "openai error"),
        (body(error="Input validation error: inputs too long", error_type="Validation"), "inputs too long"),  # TEI
        (body(detail="Not Found"), "Not Found"),
        (body(detail=[{"msg": "field required"}]), "field required"),  # FastAPI (Infinity)
        (b"upstream exploded", "upstream exploded"),
        (b"", "(empty body)"),
    ],
)
def test_error_message_of_either_shape(raw, message):
    assert message in error_message(raw)


# -- the answer the client gets --------------------------------------------------------


RAW = Embeddings(((3.0, 4.0), (0.0, 2.0)), prompt_tokens=5)  # not unit vectors, as llama.cpp may answer


def test_ollama_embed_answer_is_normalised():
    req = EmbedRequest("embed", "all-minilm", ("a", "b"))
    out = json.loads(client_response(req, RAW, duration_seconds=0.25))
    assert out["model"] == "all-minilm"  # the name the client asked for
    assert out["embeddings"] == [pytest.approx([0.6, 0.8]), pytest.approx([0.0, 1.0])]
    assert out["prompt_eval_count"] == 5 and out["total_duration"] == 250_000_000


def test_legacy_answer_is_left_as_it_is():
    req = EmbedRequest("legacy", "m", ("a",))
    out = json.loads(client_response(req, Embeddings(((3.0, 4.0),))))
    assert out == {"embedding": [3.0, 4.0]}


def test_openai_answer_float_and_base64():
    req = EmbedRequest("v1", "text-embedding-3-small", ("a", "b"))
    out = json.loads(client_response(req, RAW))
    assert out["object"] == "list" and out["model"] == "text-embedding-3-small"
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert out["data"][0]["embedding"] == pytest.approx([0.6, 0.8])
    assert out["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    b64 = EmbedRequest("v1", "m", ("a", "b"), encoding_format="base64")
    out = json.loads(client_response(b64, RAW))
    raw = base64.b64decode(out["data"][0]["embedding"])
    assert struct.unpack("<2f", raw) == pytest.approx((0.6, 0.8))


def test_answers_read_back_with_the_real_clients_models():
    """What we render parses with the official clients' own response types."""
    from ollama import EmbedResponse
    from openai.types import CreateEmbeddingResponse

    got = EmbedResponse.model_validate_json(client_response(EmbedRequest("embed", "m", ("a", "b")), RAW))
    assert got.embeddings[1] == pytest.approx([0.0, 1.0])
    got = CreateEmbeddingResponse.model_validate_json(client_response(EmbedRequest("v1", "m", ("a", "b")), RAW))
    assert got.data[0].embedding == pytest.approx([0.6, 0.8])


@pytest.mark.parametrize("client_path, client_fields, backend_api, backend_answer", [
    ("/api/embed", {"model": "all-minilm", "input": ["a", "b"]}, "openai", openai_answer([[3.0, 4.0], [0.0, 2.0]])),
    ("/v1/embeddings", {"model": "all-minilm", "input": ["a", "b"], "encoding_format": "base64"}, "ollama",
     body(model="all-minilm", embeddings=[[3.0, 4.0], [0.0, 2.0]])),
    ("/v1/embeddings", {"model": "all-minilm", "input": ["a", "b"]}, "openai", openai_answer([[3.0, 4.0], [0.0, 2.0]], base64_encoded=True)),
])
def test_round_trips(client_path, client_fields, backend_api, backend_answer):
    req = parse_request(client_path, body(**client_fields))
    backend_request(req, backend_api, "fallback-name")
    result = parse_response(req, backend_api, 200, backend_answer)
    out = json.loads(client_response(req, result))
    if req.route == "embed":
        vectors = out["embeddings"]
    else:
        vectors = [
            decode_base64_f32(d["embedding"]) if req.encoding_format == "base64" else d["embedding"]
            for d in out["data"]
        ]
    assert vectors[0] == pytest.approx([0.6, 0.8], rel=1e-6)
    assert vectors[1] == pytest.approx([0.0, 1.0], rel=1e-6)


# -- vector helpers -------------------------------------------------------------------------


def test_vector_helpers():
    assert l2_normalise([3, 4]) == pytest.approx([0.6, 0.8])
    assert l2_normalise([0, 0]) == [0, 0]
    assert cosine([1, 0], [2, 0]) == pytest.approx(1.0)
    assert cosine([1, 0], [0, 1]) == pytest.approx(0.0)
    assert cosine([0, 0], [1, 1]) == 0.0
    with pytest.raises(ValueError, match="dimensions differ"):
        cosine([1, 2], [1, 2, 3])


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=64))
def test_base64_round_trip_is_float32_exact(vector):
    assert decode_base64_f32(encode_base64_f32(vector)) == vector


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=64).filter(lambda v: norm(v) > 1e-6))
def test_normalised_vectors_have_unit_length(vector):
    assert norm(l2_normalise(vector)) == pytest.approx(1.0)
