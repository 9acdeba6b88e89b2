"""What :mod:`yieldproxy.servers.infinity` says, checked against the real Infinity (which runs here).

One Infinity serving all-MiniLM-L6-v2 starts for this module, with
``--url-prefix /v1`` and ``--embedding-dtype ubinary``: a bit-packed model,
on which the openai client's default request (``encoding_format: base64``)
makes Infinity raise inside the route's ``except Exception``.  That is the
evidence that Infinity's 500 ``InternalServerError: ...`` can be the
caller's doing, so its judge must never read it as the GPU's.

Needs the ``fallback-test`` extra, as ``tests/test_fallback_real.py`` does;
skipped with the reason where it is missing, failed with ``CI`` set.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from test_fallback_real import running_infinity
from yieldproxy.servers import CALLER, GPU, OK, PASSTHROUGH, UP, UPSTREAM, ModelCall, server

# Real processes for half a minute or more: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

MODEL = "all-minilm"
TIMEOUT = 60


@pytest.fixture(scope="module")
def bitpacked():
    """A real Infinity serving a bit-packed (``ubinary``) all-MiniLM-L6-v2 under ``/v1``."""
    with running_infinity("servers", ("--embedding-dtype", "ubinary")) as server:
        yield server


def _call(root: str, method: str, path: str, body: object = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(root + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_real_infinitys_answers_are_judged_as_its_module_says(bitpacked):
    inf = server("infinity").with_prefix("/v1")
    root = bitpacked.root
    # Health and model list, under the member's prefix.
    assert inf.judge_health(*_call(root, "GET", inf.health_path)) == UP
    code, raw = _call(root, "GET", inf.models_path)
    assert code == 200 and inf.parse_models(raw) == (MODEL,)
    # The probe of its embedding route is served, and so are floats.
    method, path, body = inf.minimal_call(ModelCall("/v1/embeddings", MODEL))
    assert inf.judge(*_call(root, method, path, body)) == OK
    # What the openai client sends by default: base64.  Infinity's 500 "InternalServerError: ...",
    # raised by the request's own encoding (fastapi_schemas/pymodels.py): relayed, never the GPU's.
    code, raw = _call(root, "POST", "/v1/embeddings", {"model": MODEL, "input": ["hi"], "encoding_format": "base64"})
    message = json.loads(raw)["error"]["message"]
    assert code == 500 and message.startswith("InternalServerError: model all-minilm does not support base64")
    assert inf.judge(code, raw) == UPSTREAM != GPU
    # The caller's other mistakes, in Infinity's and FastAPI's shapes.
    assert inf.judge(*_call(root, "POST", "/v1/rerank", {"query": "q", "documents": ["a"]})) == CALLER
    assert inf.judge(*_call(root, "POST", "/v1/embeddings", {"model": MODEL, "input": []})) == CALLER
    assert inf.judge(*_call(root, "GET", "/v1/embeddings")) == CALLER
    assert inf.judge(*_call(root, "GET", "/v1/nowhere")) == CALLER
    # Routes as the real server has them: the model's under /v1, health and metrics not.
    assert _call(root, "GET", "/v1/docs")[0] == 200 and inf.route_class("GET", "/v1/docs") == PASSTHROUGH
    assert _call(root, "GET", "/metrics")[0] == 200 and inf.route_class("GET", "/metrics") == PASSTHROUGH
    assert _call(root, "GET", "/v1/health")[0] == 404 and inf.route_class("GET", "/v1/health") is None
    assert _call(root, "HEAD", "/health")[0] == 405 and inf.route_class("HEAD", "/health") is None
    assert inf.route_class("POST", "/v1/embeddings") == "batch"
