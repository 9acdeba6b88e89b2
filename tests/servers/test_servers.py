"""What the proxy knows about each server (:mod:`yieldproxy.servers`).

Four layers: the route tables (each route of docs/servers.md's table
classified as it says, and the servers agreeing on every route they share);
the judges, table-driven, with hostile bodies that put a server's own words
where the caller's text goes; the simulated servers in memory on a Clock
(every minimal call, model list and translated embedding answered, every
outage answer judged as docs/servers.md says); and the outage modes over real
sockets, each await bounded.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
import treq
from treq.client import HTTPClient
from treq.testing import StubTreq
from twisted.internet import defer, task
from twisted.internet.error import ConnectionRefusedError
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed, ResponseNeverReceived

from yieldproxy import servers
from yieldproxy.config import RouteRule, UpstreamConfig
from yieldproxy.errors import ERROR_SHAPES, error_body
from yieldproxy.lot.classify import Classifier
from yieldproxy.servers import (
    APIS,
    BUSY,
    CALLER,
    DOWN,
    GPU,
    NOT_READY,
    OK,
    PASSTHROUGH,
    UP,
    UPSTREAM,
    ModelCall,
    infinity as infinity_mod,
    llamacpp as llamacpp_mod,
    native_apis,
    route_class,
    server,
    tei as tei_mod,
)
from yieldproxy.tools.sim import BUSY_ERROR, OOM_ERROR, SimOllama, expected_embedding
from yieldproxy.tools.sim.infinity import OOM_MESSAGE as INFINITY_OOM
from yieldproxy.tools.sim.llamacpp import COMPUTE_ERROR, LOADING_BODY
from yieldproxy.tools.sim.tei import BACKEND_ERROR
from yieldproxy.upstream import translation

ROOT = Path(__file__).resolve().parents[2]
SERVERS_MD = ROOT / "docs" / "servers.md"
CLASSES = ("interactive", "batch", "long", PASSTHROUGH)


def _sample(path: str) -> str:
    """A concrete path for a table path with ``<name>`` placeholders."""
    return re.sub("<[a-z_]+>", "sample0", path)


def _every_route() -> list[tuple[str, str, str]]:
    """``(api, method, concrete path)`` for every route of every server."""
    return [
        (api, method, _sample(route.path))
        for api, s in servers.SERVERS.items()
        for route in s.routes
        for method in sorted(route.methods)
    ]


# -- the route tables -------------------------------------------------------------


def test_every_api_has_a_description_and_an_unknown_one_is_refused():
    assert APIS == ("ollama", "openai", "tei", "infinity", "llamacpp")
    for api in APIS:
        s = server(api)
        assert s.api == api and s.routes
        assert {r.cls for r in s.routes} <= set(CLASSES)
        assert s.embed_shape in ("ollama", "openai") and s.embed_path.startswith("/")
        assert s.health_path.startswith("/") and s.models_path.startswith("/")
    with pytest.raises(ValueError, match="unknown api 'vllm'; expected one of ollama, openai"):
        server("vllm")
    with pytest.raises(ValueError):
        Classifier.from_rules((), apis=("ollama", "vllm"))


def test_the_legacy_health_path_is_ollamas():
    """``upstream.health_path`` (a single Ollama, before the pool) defaults to the Ollama description's."""
    assert UpstreamConfig().health_path == server("ollama").health_path == "/api/version"


def test_servers_agree_on_the_class_of_every_route_they_share():
    """So the order of a pool's apis never changes a class."""
    for _, method, path in _every_route():
        classes = {api: server(api).route_class(method, path) for api in APIS}
        known = {cls for cls in classes.values() if cls is not None}
        assert len(known) == 1, (method, path, classes)
    for order in itertools.permutations(APIS):
        for _, method, path in _every_route():
            assert route_class(order, method, path) == route_class(APIS, method, path)


def _docs_table(heading: str) -> dict[str, list[tuple[str, str]]]:
    """``{class: [(method, path), ...]}`` from the table under ``heading`` in docs/servers.md.

    Each cell lists ``METHOD /path`` items; an item without a method takes
    the previous item's; anything else in backquotes (an environment
    variable) is skipped.
    """
    text = SERVERS_MD.read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n\n**", 1)[0]
    table: dict[str, list[tuple[str, str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        cls = cells[0].strip("`")
        method = None
        for item in re.findall(r"`([^`]+)`", cells[1]):
            words = item.split()
            if len(words) == 2 and words[0].isupper():
                method, path = words
            elif len(words) == 1 and words[0].startswith("/"):
                path = words[0]
            else:
                continue
            assert method is not None, item
            table.setdefault(cls, []).append((method, path.replace("<id>", "<id_slot>")))
    return table


DOCS_TABLES = {
    "tei": "**TEI** (`tei`)",
    "infinity": "**Infinity** (`infinity`)",
    "llamacpp": "**llama.cpp** (`llamacpp`)",
}


@pytest.mark.parametrize("api", sorted(DOCS_TABLES))
def test_each_route_of_the_docs_table_is_classified_as_it_says(api):
    table = _docs_table(DOCS_TABLES[api])
    assert set(table) >= {"batch", PASSTHROUGH}
    listed = 0
    for cls, entries in table.items():
        for method, path in entries:
            paths = [path]
            if api == "infinity" and path not in ("/health", "/metrics", "/"):
                paths.append("/v1" + path)  # "each path under --url-prefix when one is set (often /v1)"
            for p in paths:
                assert Classifier.from_rules((), apis=(api,)).classify(method, _sample(p)) == cls, (method, p)
                listed += 1
    # ... and the module holds no route the table does not show.
    assert listed == sum(len(r.methods - {"HEAD"}) for r in server(api).routes)


@pytest.mark.parametrize(
    "api, method, path",
    [
        ("tei", "GET", "/embed"), ("tei", "POST", "/health"), ("tei", "POST", "/info"), ("tei", "GET", "/v1/models"),
        ("tei", "POST", "/api/embed"), ("tei", "DELETE", "/"),
        ("infinity", "GET", "/embeddings"), ("infinity", "POST", "/models"), ("infinity", "GET", "/v1/health"),
        ("infinity", "POST", "/tokenize"), ("infinity", "POST", "/v2/embeddings"),
        ("llamacpp", "GET", "/completion"), ("llamacpp", "POST", "/health"), ("llamacpp", "POST", "/slots"),
        ("llamacpp", "POST", "/slots/0/x"), ("llamacpp", "POST", "/api/generate"), ("llamacpp", "POST", "/api/embed"),
        ("openai", "POST", "/embeddings"), ("openai", "POST", "/v1/messages"), ("openai", "GET", "/health"),
        ("openai", "POST", "/v1/models"),
    ],
)
def test_any_other_route_of_a_server_is_unknown(api, method, path):
    assert server(api).route_class(method, path) is None
    assert Classifier.from_rules((), apis=(api,)).classify(method, path) == "interactive"
    assert Classifier.from_rules((), "passthrough", apis=(api,)).classify(method, path) == "passthrough"


def test_options_passes_on_every_server_and_head_where_get_does():
    for api in APIS:
        assert server(api).route_class("OPTIONS", "/anything/at/all") == PASSTHROUGH
    assert server("tei").route_class("HEAD", "/health") == PASSTHROUGH  # axum's get serves HEAD
    assert server("llamacpp").route_class("HEAD", "/health") == PASSTHROUGH  # cpp-httplib's too
    assert server("infinity").route_class("HEAD", "/health") is None  # FastAPI's does not


def test_a_pool_classifies_by_the_apis_of_its_members_and_rules_come_first():
    tei_only = Classifier.from_rules((), apis=("tei",))
    assert tei_only.classify("POST", "/embed") == "batch"
    assert tei_only.classify("POST", "/api/embed") == "interactive"  # not a TEI route: unknown
    assert Classifier.from_rules(()).classify("POST", "/embed") == "interactive"  # not Ollama's either
    pool = Classifier.from_rules((), apis=("ollama", "tei", "llamacpp"))
    assert pool.classify("POST", "/api/embed") == "batch"
    assert pool.classify("POST", "/embed") == "batch"
    assert pool.classify("POST", "/completion") == "interactive"
    assert pool.classify("POST", "/rerank") == "batch"
    assert pool.classify("GET", "/props") == "passthrough"
    assert pool.classify("POST", "/tokenize") == "passthrough"
    assert pool.classify("POST", "/api/pull") == "passthrough"  # Ollama's model loads (held during a yield)
    assert pool.classify("POST", "/nowhere") == "interactive"
    rules = (RouteRule(cls="long", path="/rerank"), RouteRule(cls="passthrough", path="/embed", models=("tiny",)))
    ruled = Classifier.from_rules(rules, apis=("tei", "infinity"))
    assert ruled.classify("POST", "/rerank") == "long"
    assert ruled.classify("POST", "/embed", "tiny") == "passthrough"
    assert ruled.classify("POST", "/embed", "big") == "batch"
    assert ruled.needs_model("POST", "/embed") and not ruled.needs_model("POST", "/rerank")


def test_a_shared_path_is_served_natively_only_in_the_first_apis_dialect():
    """Members whose api natively serves the route; with several apis, one dialect: the path's owner's
    (Ollama's for /api/) when a member speaks it, else the first knowing api's."""
    # /rerank: TEI's body ("texts"), Infinity's ("documents", Cohere's answer), llama.cpp's own.
    assert native_apis(("tei", "infinity", "llamacpp"), "POST", "/rerank") == ("tei",)
    assert native_apis(("infinity", "tei"), "POST", "/rerank") == ("infinity",)
    # /embeddings is OpenAI's on TEI and Infinity, llama.cpp's native route on llama.cpp.
    assert native_apis(("tei", "infinity", "llamacpp"), "POST", "/embeddings") == ("tei", "infinity")
    assert native_apis(("llamacpp", "tei", "infinity"), "POST", "/embeddings") == ("llamacpp",)
    # OpenAI's /v1/embeddings is one dialect everywhere (TEI, llama.cpp, Ollama, Infinity under /v1).
    assert native_apis(APIS, "POST", "/v1/embeddings") == APIS
    # llama.cpp's /api/chat answers in OpenAI's shape, not Ollama's: /api/ is Ollama's whatever the order,
    # and llama.cpp serves it only in a pool with no Ollama member.
    assert native_apis(("ollama", "llamacpp"), "POST", "/api/chat") == ("ollama",)
    assert native_apis(("llamacpp", "ollama"), "POST", "/api/chat") == ("ollama",)
    assert native_apis(("llamacpp", "ollama"), "GET", "/api/tags") == ("ollama",)
    assert native_apis(("llamacpp",), "POST", "/api/chat") == ("llamacpp",)
    assert native_apis(("ollama", "llamacpp"), "POST", "/v1/messages") == ("ollama", "llamacpp")
    assert native_apis(APIS, "GET", "/v1/models") == ("ollama", "openai", "infinity", "llamacpp")
    assert native_apis(("tei", "ollama"), "GET", "/v1/models/x") == ("ollama",)
    assert native_apis(("ollama",), "GET", "/api/pull") == ("ollama",)
    assert native_apis(APIS, "OPTIONS", "/x") == APIS
    assert native_apis(APIS, "POST", "/nowhere") == ()
    assert native_apis(("tei", "tei"), "POST", "/embed") == ("tei",)


def test_infinity_under_its_url_prefix():
    inf = server("infinity")
    assert (inf.models_path, inf.embed_path) == ("/models", "/embeddings")
    v1 = inf.with_prefix("/v1")
    assert (v1.models_path, v1.embed_path, v1.health_path) == ("/v1/models", "/v1/embeddings", "/health")
    assert v1.with_prefix("/v1") == v1 and inf.with_prefix("") == inf
    with pytest.raises(ValueError, match="no API prefix '/api'"):
        inf.with_prefix("/api")
    with pytest.raises(ValueError):
        server("tei").with_prefix("/v1")


# -- the judges ---------------------------------------------------------------------


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _ollama(message: str) -> bytes:
    return _j({"error": message})


def _openai(message: str, kind: str = "api_error") -> bytes:
    return _j({"error": {"message": message, "type": kind, "param": None, "code": None}})


def _tei(message: str, kind: str) -> bytes:
    return _j({"error": message, "error_type": kind})


def _tei_flat(message: str, kind: str, code: int) -> bytes:
    return _j({"message": message, "code": code, "type": kind})


def _infinity(message: str, code: int) -> bytes:
    return _j({"error": {"message": message, "type": None, "param": None, "code": code}})


def _llamacpp(message: str, kind: str, code: int) -> bytes:
    return _j({"error": {"code": code, "message": message, "type": kind}})


CUDA = "CUDA error: out of memory"

JUDGED = [
    # -- Ollama: its runner prefixes (tests/watchers/test_outage.py has the rest), its full queue.
    ("ollama", 200, b'{"embeddings": []}', OK),
    ("ollama", 500, _ollama(OOM_ERROR), GPU),
    ("ollama", 500, _openai(OOM_ERROR), GPU),
    ("ollama", 400, _ollama("do embedding request: Post \"http://127.0.0.1:1/embedding\": EOF"), GPU),
    ("ollama", 503, _ollama(BUSY_ERROR), BUSY),
    ("ollama", 503, _openai(BUSY_ERROR), BUSY),
    ("ollama", 503, _ollama(BUSY_ERROR + " " + CUDA), UPSTREAM),
    ("ollama", 503, _ollama("account unavailable"), UPSTREAM),
    ("ollama", 500, _ollama('template: :1: function "gpu" not defined'), UPSTREAM),
    # Ollama's own out-of-memory substrings anywhere in a 500 (llm/status.go), llama.cpp's "Compute error."
    ("ollama", 500, _ollama(f"x llama runner process has terminated: {CUDA}"), GPU),
    ("ollama", 500, _ollama(CUDA), GPU),
    ("ollama", 500, _ollama("Compute error."), GPU),
    ("ollama", 500, _openai("Compute error."), GPU),
    ("ollama", 500, _ollama("CUDA error: an illegal memory access was encountered"), UPSTREAM),
    ("ollama", 502, _ollama(OOM_ERROR), UPSTREAM),
    ("ollama", 404, _ollama('model "cuda" not found, try pulling it first'), CALLER),
    ("ollama", 400, _ollama(f"invalid input: {CUDA} Compute error. Backend"), CALLER),
    ("ollama", 429, _ollama(BUSY_ERROR), CALLER),
    # -- an OpenAI-compatible server: nothing of its words is known.
    ("openai", 200, b"{}", OK),
    ("openai", 429, _openai("Rate limit reached"), BUSY),
    ("openai", 503, _openai("The engine is currently overloaded"), BUSY),
    ("openai", 500, _openai(CUDA), UPSTREAM),
    ("openai", 500, _ollama(OOM_ERROR), UPSTREAM),
    ("openai", 400, _openai(f"{CUDA}: Compute error.", "invalid_request_error"), CALLER),
    ("openai", 404, b"", CALLER),
    # -- TEI: the type field decides, with its status; only Backend errors of the backend are the GPU's.
    ("tei", 200, b"[[0.1]]", OK),
    ("tei", 424, _tei(BACKEND_ERROR, "Backend"), GPU),
    ("tei", 424, _tei_flat(BACKEND_ERROR, "Backend", 424), GPU),
    ("tei", 424, _tei("Backend error: Backend is unhealthy", "Backend"), GPU),
    ("tei", 503, _tei("unhealthy", "Unhealthy"), GPU),
    ("tei", 429, _tei("Model is overloaded", "Overloaded"), BUSY),
    ("tei", 429, _tei_flat("Model is overloaded", "Overloaded", 429), BUSY),
    ("tei", 424, _tei("Backend error: model is not a re-ranker model", "Backend"), CALLER),
    ("tei", 424, _tei("Backend error: Model is not an embedding model", "Backend"), CALLER),
    ("tei", 424, _tei_flat("Backend error: `normalize` is not available for SPLADE models", "Backend", 424), CALLER),
    ("tei", 424, _tei("score is NaN", "Backend"), UPSTREAM),
    ("tei", 400, _tei("Input validation error: `inputs` cannot be empty", "Empty"), CALLER),
    ("tei", 422, _tei(f"Input validation error: Backend error: {CUDA}", "Validation"), CALLER),
    ("tei", 422, _tei(f"tokenizer error Backend error: {CUDA}", "Tokenizer"), CALLER),
    # hostile: TEI's words where the caller's text goes, or outside TEI's structure.
    ("tei", 424, _tei(BACKEND_ERROR, "Validation"), CALLER),
    ("tei", 422, _tei(BACKEND_ERROR, "Backend"), CALLER),
    ("tei", 424, _j({"error": BACKEND_ERROR, "error_type": "Backend", "input": "x"}), CALLER),
    ("tei", 424, _j({"message": BACKEND_ERROR, "code": "424", "type": "Backend"}), CALLER),
    ("tei", 424, _j({"error": [BACKEND_ERROR], "error_type": "Backend"}), CALLER),
    ("tei", 424, BACKEND_ERROR.encode(), CALLER),
    ("tei", 503, _tei("unhealthy", "unhealthy"), UPSTREAM),  # the OpenAPI example's case: not what it sends
    ("tei", 422, b"Failed to deserialize the JSON body into the target type: Backend error: CUDA", CALLER),
    ("tei", 400, b"Failed to parse the request body as JSON: Compute error.", CALLER),
    ("tei", 415, b"Expected request with `Content-Type: application/json`", CALLER),
    ("tei", 404, b"", CALLER),
    ("tei", 413, b"length limit exceeded", CALLER),
    ("tei", 500, b"", UPSTREAM),
    # -- Infinity: never the GPU (its GPU failures hang); its full queue.
    ("infinity", 200, b"{}", OK),
    ("infinity", 429, _infinity("model all-minilm is currently overloaded", 429), BUSY),
    ("infinity", 429, _infinity("model CUDA out of memory is currently overloaded", 429), BUSY),
    ("infinity", 500, _infinity(INFINITY_OOM, 500), UPSTREAM),
    ("infinity", 500, _infinity("InternalServerError: model m does not support base64 encoding, as it uses "
                                "uint8-bitpacking with EmbeddingDtype.ubinary", 500), UPSTREAM),
    ("infinity", 500, _infinity("Internal Server Error", 500), UPSTREAM),
    ("infinity", 400, _infinity("ModelNotDeployedError: model=`m` does not support `rerank`. Reason: x", 400), CALLER),
    ("infinity", 400, _infinity(f"Invalid model: {CUDA}", 400), CALLER),
    ("infinity", 422, _j({"detail": [{"type": "too_short", "loc": ["body", "input"], "input": INFINITY_OOM}]}), CALLER),
    ("infinity", 404, _j({"detail": "Not Found"}), CALLER),
    ("infinity", 405, _j({"detail": "Method Not Allowed"}), CALLER),
    ("infinity", 429, _j({"detail": "model m is currently overloaded"}), CALLER),
    ("infinity", 429, _infinity("model m is currently overloaded", 500), CALLER),
    # -- llama.cpp: only the whole "Compute error." of a server_error is the GPU's.
    ("llamacpp", 200, b"{}", OK),
    ("llamacpp", 500, _llamacpp(COMPUTE_ERROR, "server_error", 500), GPU),
    ("llamacpp", 503, _j(LOADING_BODY), NOT_READY),
    ("llamacpp", 503, _llamacpp("no slot available", "unavailable_error", 503), BUSY),
    ("llamacpp", 500, _llamacpp("Context size has been exceeded.", "server_error", 500), UPSTREAM),
    ("llamacpp", 500, _llamacpp("Invalid input batch.", "server_error", 500), UPSTREAM),
    ("llamacpp", 501, _llamacpp("This server does not support embeddings. Start it with `--embeddings`",
                                "not_supported_error", 501), UPSTREAM),
    ("llamacpp", 503, _llamacpp("something else", "unavailable_error", 503), UPSTREAM),
    ("llamacpp", 500, _llamacpp("'messages' is required", "server_error", 500), CALLER),
    ("llamacpp", 400, _llamacpp('"input" or "content" must be provided', "invalid_request_error", 400), CALLER),
    ("llamacpp", 400, _j({"error": {"code": 400, "message": "the request exceeds the available context size",
                                    "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 4096}}),
     CALLER),
    ("llamacpp", 404, _llamacpp("File Not Found", "not_found_error", 404), CALLER),
    # hostile: the caller's body quoted back by a parse error, the words in the wrong place or shape.
    ("llamacpp", 500, _llamacpp("[json.exception.parse_error.101] parse error at line 1, column 1: syntax error "
                                "while parsing value - invalid literal; last read: 'Compute error.'",
                                "server_error", 500), CALLER),
    ("llamacpp", 500, _llamacpp("Compute error. ", "server_error", 500), CALLER),
    ("llamacpp", 500, _llamacpp("compute error.", "server_error", 500), CALLER),
    ("llamacpp", 400, _llamacpp(COMPUTE_ERROR, "invalid_request_error", 400), CALLER),
    ("llamacpp", 500, _llamacpp(COMPUTE_ERROR, "server_error", 400), UPSTREAM),
    ("llamacpp", 500, _llamacpp(COMPUTE_ERROR, "invalid_request_error", 400), UPSTREAM),
    ("llamacpp", 500, _j({"error": {"code": 500, "message": COMPUTE_ERROR, "type": "server_error"}, "x": 1}),
     UPSTREAM),
    ("llamacpp", 500, _j({"error": COMPUTE_ERROR}), UPSTREAM),
    ("llamacpp", 500, COMPUTE_ERROR.encode(), UPSTREAM),
    ("llamacpp", 503, _j({"error": {"message": "Loading model", "type": "unavailable_error", "code": 500}}),
     UPSTREAM),
    ("llamacpp", 503, b"<html><body>Loading model</body></html>", UPSTREAM),
]


@pytest.mark.parametrize("api, status, body, judged", JUDGED)
def test_each_servers_error_answers_are_judged_from_its_own_structure_and_words(api, status, body, judged):
    assert server(api).judge(status, body) == judged


def test_no_judge_reads_a_gpu_failure_from_words_a_caller_can_send():
    """Each server's GPU words, in every field and shape but the one the server writes them in.

    One exception, Ollama's own: a 500 whose message *contains* one of its out-of-memory
    substrings is an out-of-memory to Ollama itself (llm/status.go ``IsOutOfMemoryMessage``),
    wherever the words stand, so a quoted input can read so too.  Such words are evidence,
    never an outage: the probe, whose text is the proxy's, decides that
    (tests/watchers/test_outage.py::test_a_template_naming_ollamas_oom_words_is_retried_alone_and_never_holds).
    """
    words = [OOM_ERROR, BACKEND_ERROR, COMPUTE_ERROR, INFINITY_OOM, "unhealthy", "CUDA", "Backend", "gpu"]
    for api in APIS:
        for word in words:
            for status in (400, 422, 424, 500, 502, 503):
                bodies = [
                    word.encode(),
                    _j({"detail": word}),
                    _j({"message": word}),
                    _j({"error": {"msg": word}}),
                    _j([{"error": word}]),
                    _j({"error": "bad input: " + word}),
                    _j({"error": {"message": "bad input: " + word, "type": "server_error", "code": status}}),
                ]
                ollamas_oom = api == "ollama" and status == 500 and "out of memory" in word.lower()
                for body in bodies:
                    if ollamas_oom and body in bodies[-2:]:
                        assert server(api).judge(status, body) == GPU, (api, status, body)
                        continue
                    assert server(api).judge(status, body) != GPU, (api, status, body)
    # And a body too long to be an error of theirs is not read at all.
    assert server("llamacpp").judge(500, _llamacpp(COMPUTE_ERROR, "server_error", 500) + b" " * 70000) == UPSTREAM


def test_every_judge_and_health_judge_answers_one_of_its_words():
    statuses = (200, 204, 301, 400, 401, 404, 413, 422, 424, 429, 499, 500, 501, 502, 503, 504)
    for api in APIS:
        for status in statuses:
            for body in (b"", b"{}", b"null", b"[]", b'{"error": null}', b"\xff", _j(LOADING_BODY)):
                assert server(api).judge(status, body) in servers.JUDGEMENTS
                assert server(api).judge_health(status, body) in servers.HEALTH


@pytest.mark.parametrize(
    "api, status, body, health",
    [
        ("ollama", 200, b'{"version":"0.12.0"}', UP),
        ("ollama", 500, b"", DOWN),
        ("openai", 200, b'{"data": []}', UP),
        ("openai", 401, b"", DOWN),
        ("tei", 200, b"", UP),
        ("tei", 503, _tei("unhealthy", "Unhealthy"), DOWN),
        ("infinity", 200, b'{"unix": 1.5}', UP),
        ("infinity", 404, _j({"detail": "Not Found"}), DOWN),
        ("llamacpp", 200, b'{"status":"ok"}', UP),
        ("llamacpp", 503, _j(LOADING_BODY), NOT_READY),
        ("llamacpp", 503, _llamacpp("no slot available", "unavailable_error", 503), DOWN),
        ("llamacpp", 503, _j({"error": {"message": "Loading model"}}), DOWN),
        ("llamacpp", 500, _llamacpp(COMPUTE_ERROR, "server_error", 500), DOWN),
    ],
)
def test_health_answers_are_judged_up_not_ready_or_down(api, status, body, health):
    assert server(api).judge_health(status, body) == health


def test_the_wrong_task_messages_are_teis_own_constants():
    assert all(m.startswith(tei_mod.BACKEND_PREFIX) and len(m) > 30 for m in tei_mod.WRONG_TASK)
    assert set(tei_mod.STATUS_OF_TYPE) == {"Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"}
    assert llamacpp_mod.STATUS_OF_TYPE["server_error"] == 500 and infinity_mod.PREFIXES == ("", "/v1")


# -- model lists, error shapes ------------------------------------------------------


@pytest.mark.parametrize(
    "api, body, names",
    [
        ("ollama", _j({"models": [{"name": "all-minilm:latest", "model": "all-minilm:latest"},
                                  {"name": "llama3.2:latest"}, {"name": "all-minilm:latest"}]}),
         ("all-minilm:latest", "llama3.2:latest")),
        ("ollama", _j({"models": []}), ()),
        ("openai", _j({"object": "list", "data": [{"id": "gpt-x", "object": "model"}]}), ("gpt-x",)),
        ("infinity", _j({"data": [{"id": "a", "stats": {}}, {"id": "b"}], "object": "list"}), ("a", "b")),
        ("llamacpp", _j({"models": [{"name": "m.gguf"}], "object": "list", "data": [{"id": "m.gguf", "meta": None}]}),
         ("m.gguf",)),
        ("tei", _j({"model_id": "BAAI/bge-small-en-v1.5", "served_model_name": "bge"}), ("bge", "BAAI/bge-small-en-v1.5")),
        ("tei", _j({"model_id": "BAAI/bge-small-en-v1.5", "served_model_name": "BAAI/bge-small-en-v1.5"}),
         ("BAAI/bge-small-en-v1.5",)),
        ("tei", _j({"model_id": "x"}), ("x",)),  # older TEI: no served_model_name
    ],
)
def test_each_model_list_is_read(api, body, names):
    assert server(api).parse_models(body) == names


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("body", [b"", b"{", b"[]", b'{"data": [{"name": "x"}]}', b'{"models": [1]}', b'{"model_id": 3}'])
def test_a_body_that_is_no_model_list_is_a_value_error(api, body):
    with pytest.raises(ValueError):
        server(api).parse_models(body)


def test_each_route_has_an_error_shape_and_each_shape_reads_as_its_servers_own():
    for api, _, path in _every_route():
        assert server(api).error_shape(path) in ERROR_SHAPES
    assert server("ollama").error_shape("/api/embed") == "ollama"
    assert server("ollama").error_shape("/v1/embeddings") == "openai"
    assert server("tei").error_shape("/embed") == "tei" and server("tei").error_shape("/v1/embeddings") == "tei_openai"
    assert {server(a).error_shape("/api/chat") for a in ("openai", "infinity", "llamacpp")} == {"openai"}
    # Our own errors, in each server's shape, are what that server's clients parse.
    assert json.loads(error_body("tei", 503, "yielded", "yielded")) == {"error": "yielded", "error_type": "Unhealthy"}
    assert tei_mod.tei_error(error_body("tei", 429, "full", "parked_full")) == ("Overloaded", "full")
    assert tei_mod.tei_error(error_body("tei_openai", 400, "bad", "bad_request")) == ("Validation", "bad")
    assert json.loads(error_body("tei_openai", 504, "slow", "timeout")) == {"message": "slow", "code": 504,
                                                                            "type": "Backend"}
    assert json.loads(error_body("openai", 503, "m", "c")) == {"error": {"message": "m", "type": "server_error",
                                                                         "code": "c"}}
    with pytest.raises(ValueError, match="unknown error shape 'html'"):
        error_body("html", 500, "m", "c")


# -- against the simulated servers, in memory ---------------------------------------

URL = "http://sim.invalid"


def _settle(clock: task.Clock, stub: StubTreq, d: defer.Deferred) -> tuple[int, bytes]:
    """Run an in-memory exchange to its end: (status, body)."""
    for _ in range(50):
        stub.flush()
        clock.advance(0.1)
    box: list = []
    d.addBoth(box.append)
    assert box, "no answer"
    response = box[0]
    body: list = []
    treq.content(response).addBoth(body.append)
    stub.flush()
    return response.code, body[0]


def _send(stub: StubTreq, method: str, path: str, body: Any = None) -> defer.Deferred:
    data = json.dumps(body).encode() if body is not None else None
    return stub.request(method, URL + path, data=data, headers={"content-type": ["application/json"]})


SIM_APIS = ("ollama", "tei", "infinity", "llamacpp")
#: What each simulated server's model routes answer in ``error500`` mode, judged (docs/servers.md's outage table).
ERROR500_JUDGED = {"ollama": GPU, "tei": GPU, "infinity": UPSTREAM, "llamacpp": GPU}


def _model_calls(api: str, sim: SimOllama) -> list[tuple[str, str, dict]]:
    """The minimal call of every model route the sim plays for ``api``."""
    calls = []
    for route in server(api).routes:
        if route.cls == PASSTHROUGH or "POST" not in route.methods or route.path == "/":
            continue
        minimal = server(api).minimal_call(ModelCall(route.path, "all-minilm"))
        if minimal is not None and _sim_serves(sim, minimal[1]):
            calls.append(minimal)
    return calls


def _sim_serves(sim: SimOllama, path: str) -> bool:
    from yieldproxy.tools.sim.server import APIS as SIM_API_TABLE

    return SIM_API_TABLE[sim.api].route(path, "POST") is not None


@pytest.mark.parametrize("api", SIM_APIS)
def test_every_minimal_call_is_served_and_its_outage_answer_judged_as_the_docs_say(api):
    clock = task.Clock()
    sim = SimOllama(clock, api=api, dim=8)
    stub = StubTreq(sim.resource())
    calls = _model_calls(api, sim)
    expected_paths = {
        "ollama": {"/api/embed", "/api/embeddings", "/v1/embeddings", "/api/chat", "/api/generate",
                   "/v1/chat/completions", "/v1/completions"},
        "tei": {"/embed", "/embed_all", "/embed_sparse", "/predict", "/rerank", "/similarity", "/embeddings",
                "/v1/embeddings"},
        "infinity": {"/embeddings", "/rerank", "/classify", "/v1/embeddings", "/v1/rerank", "/v1/classify"},
        "llamacpp": {"/completion", "/completions", "/infill", "/v1/completions", "/chat/completions",
                     "/v1/chat/completions", "/api/chat", "/embedding", "/embeddings", "/v1/embeddings", "/rerank",
                     "/reranking", "/v1/rerank", "/v1/reranking"},
    }[api]
    assert {path for _, path, _ in calls} == expected_paths
    for method, path, body in calls:
        code, raw = _settle(clock, stub, _send(stub, method, path, body))
        assert code == 200, (path, raw)
        assert server(api).judge(code, raw) == OK
    sim.set_mode("error500")
    for method, path, body in calls:
        code, raw = _settle(clock, stub, _send(stub, method, path, body))
        assert server(api).judge(code, raw) == ERROR500_JUDGED[api], (path, code, raw)
    sim.set_mode("ok")
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize("api", SIM_APIS)
def test_the_sims_model_list_health_and_full_queue_are_read(api):
    clock = task.Clock()
    sim = SimOllama(clock, api=api, models=("bge-small", "llama3.2"), latency=1.0, parallel=1, max_queue=0)
    stub = StubTreq(sim.resource())
    s = server(api)
    code, raw = _settle(clock, stub, _send(stub, "GET", s.models_path))
    names = s.parse_models(raw)
    # Ollama lists every model by its full name; the others serve one, the first.
    assert code == 200 and names == (("bge-small:latest", "llama3.2:latest") if api == "ollama" else ("bge-small",))
    code, raw = _settle(clock, stub, _send(stub, "GET", s.health_path))
    assert s.judge_health(code, raw) == UP
    # One served, none may wait: the full queue in the server's own words.
    method, path, body = s.minimal_call(ModelCall(s.embed_path, "bge-small"))
    first = _send(stub, method, path, body)
    stub.flush()
    code, raw = _settle(clock, stub, _send(stub, method, path, body))
    assert s.judge(code, raw) == BUSY, (code, raw)
    assert _settle(clock, stub, first)[0] == 200
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize("api, prefix", [("ollama", ""), ("openai", ""), ("tei", ""), ("infinity", ""),
                                         ("infinity", "/v1"), ("llamacpp", "")])
def test_a_translated_embedding_request_is_answered_at_the_embed_path(api, prefix):
    """upstream/translation.py's body in the server's shape, sent to its embed_path, reads back as the right vectors."""
    clock = task.Clock()
    sim = SimOllama(clock, api="ollama" if api == "openai" else api, dim=8, models=("all-minilm",))
    stub = StubTreq(sim.resource())
    s = server(api).with_prefix(prefix)
    for route, body in [("embed", {"model": "all-minilm", "input": ["a", "b"]}),
                        ("v1", {"model": "all-minilm", "input": ["a", "b"]})]:
        request = translation.parse_request({"embed": "/api/embed", "v1": "/v1/embeddings"}[route], _j(body))
        _, payload = translation.backend_request(request, s.embed_shape, "all-minilm")
        code, raw = _settle(clock, stub, stub.post(URL + s.embed_path, data=payload,
                                                   headers={"content-type": ["application/json"]}))
        vectors = translation.parse_response(request, s.embed_shape, code, raw).vectors
        for vector, text in zip(vectors, "ab", strict=True):
            assert list(vector) == pytest.approx(expected_embedding(text, "all-minilm", 8), abs=1e-6)
    assert clock.getDelayedCalls() == []


# -- the outage modes, over real sockets -----------------------------------------------

TIMEOUT = 5.0


def _reactor():
    from twisted.internet import reactor

    return reactor


async def _exchange(http: HTTPClient, url: str, method: str, path: str, body: Any = None,
                    wait: float = TIMEOUT) -> tuple[str, int, bytes]:
    """``("answer", status, body)``, or ``("refused" | "reset" | "no answer", 0, b"")``."""
    kw = {"json": body} if body is not None else {}
    d = http.request(method, url + path, **kw).addTimeout(wait, _reactor())
    try:
        response = await d
        raw = await treq.content(response).addTimeout(TIMEOUT, _reactor())
    except ConnectionRefusedError:
        return "refused", 0, b""
    except (ResponseNeverReceived, ResponseFailed) as e:
        if any(f.check(defer.CancelledError) for f in getattr(e, "reasons", [])):
            return "no answer", 0, b""
        return "reset", 0, b""
    except defer.TimeoutError:
        return "no answer", 0, b""
    return "answer", response.code, raw


#: docs/servers.md's outage table, read by each server's judges: for each mode, what a model
#: call gets (a judgement, or how the connection fails) and what the health route gets.
OUTAGES = {
    "ollama": {
        "error500": (GPU, UP), "refuse": ("refused", "refused"), "reset": ("reset", UP), "hang": ("no answer", UP),
    },
    "tei": {
        "error500": (GPU, DOWN), "refuse": ("refused", "refused"), "reset": ("reset", "reset"),
        "hang": ("no answer", "no answer"),
    },
    "infinity": {
        "error500": (UPSTREAM, UP), "refuse": ("refused", "refused"), "reset": ("reset", UP),
        "hang": ("no answer", UP),
    },
    "llamacpp": {
        "error500": (GPU, UP), "refuse": ("refused", "refused"), "reset": ("reset", UP), "hang": ("no answer", UP),
    },
}
#: What the health route says once a mode ends: llama.cpp restarted loads its model again.
AFTER = {"refuse": NOT_READY, "reset": NOT_READY}


def _read(api: str, what: str, outcome: tuple[str, int, bytes]) -> str:
    kind, code, raw = outcome
    if kind != "answer":
        return kind
    return server(api).judge(code, raw) if what == "call" else server(api).judge_health(code, raw)


@pytest.mark.parametrize("api", SIM_APIS)
@pytest_twisted.ensureDeferred
async def test_each_outage_mode_of_the_sim_is_judged_as_the_docs_outage_table_says(api):
    reactor = _reactor()
    load = 0.2 if api == "llamacpp" else 0.0
    sim = SimOllama(reactor, api=api, dim=8, load_seconds=load)
    pool = HTTPConnectionPool(reactor, persistent=False)
    http = HTTPClient(Agent(reactor, pool=pool))
    s = server(api)
    try:
        port = await sim.listen(0).addTimeout(TIMEOUT, reactor)
        url = f"http://127.0.0.1:{port}"
        method, path, body = s.minimal_call(ModelCall(s.embed_path, "all-minilm"))

        async def ready() -> None:
            deadline = reactor.seconds() + TIMEOUT
            while _read(api, "health", await _exchange(http, url, "GET", s.health_path)) != UP:
                assert reactor.seconds() < deadline, "never became ready"
                await task.deferLater(reactor, 0.05, lambda: None)

        if api == "llamacpp":
            assert _read(api, "health", await _exchange(http, url, "GET", s.health_path)) == NOT_READY
            assert _read(api, "call", await _exchange(http, url, method, path, body)) == NOT_READY
        await ready()
        assert _read(api, "call", await _exchange(http, url, method, path, body)) == OK
        for mode, (call, health) in OUTAGES[api].items():
            await sim.set_mode(mode)
            # A refused connection takes HostnameEndpoint 0.3 s to report; a hang is "no answer" after 1 s.
            got_call = _read(api, "call", await _exchange(http, url, method, path, body, wait=1.0))
            got_health = _read(api, "health", await _exchange(http, url, "GET", s.health_path, wait=1.0))
            assert (got_call, got_health) == (call, health), mode
            await sim.set_mode("ok")
            if api == "llamacpp" and mode in AFTER:
                assert _read(api, "health", await _exchange(http, url, "GET", s.health_path)) == AFTER[mode]
            await ready()
            assert _read(api, "call", await _exchange(http, url, method, path, body)) == OK, mode
    finally:
        await sim.stop().addTimeout(TIMEOUT, reactor)
        await pool.closeCachedConnections()
