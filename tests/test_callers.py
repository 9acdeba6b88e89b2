"""Real callers through a forced yield: LightRAG's embedding path, the ``openai`` client, ``litellm``.

Each caller is asyncio code: its whole workload runs in one thread under
``asyncio.run`` (``in_thread``), while the proxy and the simulated backend stay
in the reactor thread.  Every vector that comes back is recomputed and checked,
and the proxy must end with an empty lot and nothing in flight.

The clients are test extras (``pip install -e .[test]``); a client that cannot
be imported offline skips its test with the reason, and fails it when ``CI`` is
set.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import os

# litellm fetches its model cost map from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Keep the clients quiet and offline.
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import pytest
import pytest_twisted
from twisted.internet import reactor

from helpers import config_with, in_thread, start_stack, wait_for
from yieldproxy.tools.sim import expected_embedding, expected_embedding_f32

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

MODEL = "all-minilm"
DIM = 384
TEXTS = 2000
BATCH = 32
CONCURRENCY = 8
HOLD_SECONDS = 2.0

# JSON floats go through the proxy as text: they come back bit for bit (float64).
# base64 answers carry float32: compared with the float32-rounded expectation.
ATOL_F64 = 1e-12
ATOL_F32 = 1e-7


def require(module: str):
    """Import ``module``, or skip the test (fail it under ``CI``) with the reason."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a client that reaches for the network at import
        why = f"{module} cannot be imported: {type(e).__name__}: {e}"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the real-caller tests")
        pytest.skip(why)


class AsyncBurst:
    """
    Embeds ``texts`` in batches, ``concurrency`` batches at once, with an async caller.

    ``open_caller`` is called inside the running event loop and returns an
    ``async (batch) -> vectors`` function; ``expected(text)`` is the vector the
    sim answers, compared within ``atol``.  Every outcome is recorded.
    """

    def __init__(self, texts, open_caller, expected, atol, batch=BATCH, concurrency=CONCURRENCY):
        self.texts = texts
        self.open_caller = open_caller
        self.expected = expected
        self.atol = atol
        self.batch = batch
        self.concurrency = concurrency
        self.done = 0
        self.failures: list[str] = []
        self.wrong: list[str] = []
        self.answers: list[tuple[list[str], list]] = []

    async def _one(self, caller, semaphore, batch):
        async with semaphore:
            try:
                vectors = await caller(batch)
            except Exception as e:  # every failure the caller would see
                self.failures.append(f"{batch[0]}..: {type(e).__name__}: {e}")
                return
        self.answers.append((batch, vectors))
        self.done += len(batch)

    def _check(self) -> None:
        """Recompute every vector (after the burst, so the caller's thread stays light during it)."""
        import numpy as np

        for batch, vectors in self.answers:
            if len(vectors) != len(batch):
                self.wrong.extend(batch)
                continue
            for text, vector in zip(batch, vectors):
                got = np.asarray(vector, dtype=np.float64)
                want = np.asarray(self.expected(text), dtype=np.float64)
                if got.shape != want.shape or not np.allclose(got, want, rtol=0, atol=self.atol):
                    self.wrong.append(text)

    async def _main(self):
        caller = await self.open_caller()
        semaphore = asyncio.Semaphore(self.concurrency)
        batches = [self.texts[i : i + self.batch] for i in range(0, len(self.texts), self.batch)]
        try:
            await asyncio.gather(*(self._one(caller, semaphore, b) for b in batches))
        finally:
            close = getattr(caller, "aclose", None)
            if close is not None:
                await close()

    def run(self) -> None:
        asyncio.run(self._main())
        self._check()


def assert_clean(burst: AsyncBurst, stack) -> None:
    assert burst.failures == []
    assert burst.wrong == []
    assert burst.done == len(burst.texts)
    assert set(stack.sim.texts_embedded) == set(burst.texts)
    # A text embedded twice is only ever part of a counted retry of a failed attempt.
    # (One retried batch re-embeds all its texts, so compare against texts per retry.)
    extra = sum(n - 1 for n in stack.sim.texts_embedded.values())
    assert extra <= burst.batch * stack.sample("yieldproxy_retries_total", **{"class": "batch"})
    assert len(stack.proxy.lot) == 0 and stack.proxy.replayer.inflight == 0


async def through_a_yield(burst: AsyncBurst, stack, reset: bool = False) -> None:
    """Run ``burst``; mid-burst hold the GPU (declared for ``HOLD_SECONDS``, the backend resetting if
    ``reset``) until every one of the caller's concurrent requests waits in the lot, then release it."""
    running = in_thread(reactor, burst.run, timeout=60)
    # Hold while batches are at the backend, so the yield catches some mid-flight.
    await wait_for(
        reactor,
        lambda: (burst.done >= len(burst.texts) // 4 and stack.sim.in_flight >= 1) or burst.failures,
        timeout=30,
    )
    stack.proxy.state.hold("api", "forced by the test", expected_seconds=HOLD_SECONDS)
    if reset:
        await stack.sim.set_mode("reset")
    # The yield has stopped the burst: all its requests are parked, none at the backend.
    await wait_for(reactor, lambda: len(stack.proxy.lot) == burst.concurrency, timeout=10)
    assert stack.sim.in_flight == 0
    done_during_yield = burst.done
    parked = len(stack.proxy.lot)
    if reset:
        await stack.sim.set_mode("ok")
    stack.proxy.state.release("api")
    await running
    assert done_during_yield < len(burst.texts), "the yield came after the burst"
    assert parked >= 1
    assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "ok"}) >= 1


def _stack_options():
    # Each batch takes ~40 ms at the backend: the burst lasts long enough to be cut by the yield.
    return dict(latency=0.01, per_item_latency=0.001, parallel=4)


def texts_for(name: str) -> list[str]:
    return [f"{name} chunk {i}: the gpu came back and every parked request was answered" for i in range(TEXTS)]


def expected64(text):
    return expected_embedding(text, MODEL, DIM)


def expected32(text):
    return expected_embedding_f32(text, MODEL, DIM)


# -- LightRAG's embedding call path ----------------------------------------------


def lightrag_ollama_caller(url: str):
    require("ollama")
    llm_ollama = require("lightrag.llm.ollama")
    utils = require("lightrag.utils")
    func = utils.EmbeddingFunc(
        embedding_dim=DIM,
        func=functools.partial(llm_ollama.ollama_embed.func, embed_model=MODEL, host=url),
    )

    async def open_caller():
        return func

    return open_caller


@pytest_twisted.ensureDeferred
async def test_lightrag_ollama_embed_through_a_yield():
    """LightRAG's ``ollama_embed`` (no retries of its own) ingests 2,000 texts through a yield."""
    stack = await start_stack(reactor, config_with(replay={"concurrency": 4}), **_stack_options())
    try:
        burst = AsyncBurst(texts_for("ollama_embed"), lightrag_ollama_caller(stack.proxy_url), expected64, ATOL_F64)
        await through_a_yield(burst, stack)
        assert_clean(burst, stack)
        assert set(stack.sim.texts_embedded.values()) == {1}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_lightrag_openai_embed_through_a_yield():
    """LightRAG's ``openai_embed`` (base64 answers) against ``/v1`` through a yield."""
    llm_openai = require("lightrag.llm.openai")
    utils = require("lightrag.utils")
    stack = await start_stack(reactor, config_with(replay={"concurrency": 4}), **_stack_options())
    try:
        # No max_token_size: it would make openai_embed load tiktoken files from the internet.
        func = utils.EmbeddingFunc(
            embedding_dim=DIM,
            func=functools.partial(
                llm_openai.openai_embed.func, model=MODEL, base_url=stack.proxy_url + "/v1", api_key="x"
            ),
        )

        async def open_caller():
            return func

        burst = AsyncBurst(texts_for("openai_embed"), open_caller, expected32, ATOL_F32)
        await through_a_yield(burst, stack)
        assert_clean(burst, stack)
        assert set(stack.sim.texts_embedded.values()) == {1}
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_lightrag_ollama_embed_while_the_backend_resets_every_connection():
    """While yielded, the backend resets every connection; ``ollama_embed`` still sees no failure."""
    config = config_with(upstream={"attempt_timeout_seconds": 2.0}, replay={"concurrency": 4})
    stack = await start_stack(reactor, config, **_stack_options())
    try:
        burst = AsyncBurst(texts_for("reset"), lightrag_ollama_caller(stack.proxy_url), expected64, ATOL_F64)
        await through_a_yield(burst, stack, reset=True)
        assert_clean(burst, stack)
        # The reset caught batches mid-flight; the proxy retried them, the caller never knew.
        assert stack.sim.outcomes["reset"] >= 1
        assert stack.sample("yieldproxy_retries_total", **{"class": "batch"}) >= 1
    finally:
        await stack.stop()


# -- the openai client -----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_openai_client_through_a_yield():
    """``openai.AsyncOpenAI`` with its default base64 encoding: every vector right after a yield."""
    openai = require("openai")
    stack = await start_stack(reactor, config_with(replay={"concurrency": 4}), **_stack_options())
    try:
        url = stack.proxy_url + "/v1"

        async def open_caller():
            client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)

            async def embed(batch):
                response = await client.embeddings.create(model=MODEL, input=batch)
                return [d.embedding for d in sorted(response.data, key=lambda d: d.index)]

            embed.aclose = client.close
            return embed

        burst = AsyncBurst(texts_for("openai"), open_caller, expected32, ATOL_F32)
        await through_a_yield(burst, stack)
        assert_clean(burst, stack)
        assert set(stack.sim.texts_embedded.values()) == {1}
    finally:
        await stack.stop()


# -- litellm ---------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_litellm_through_a_yield():
    """``litellm.aembedding(model="ollama/...")`` (→ ``/api/embed``) through a yield."""
    litellm = require("litellm")
    litellm.telemetry = False
    stack = await start_stack(reactor, config_with(replay={"concurrency": 4}), **_stack_options())
    try:
        url = stack.proxy_url

        async def open_caller():
            async def embed(batch):
                response = await litellm.aembedding(model=f"ollama/{MODEL}", api_base=url, input=batch, timeout=60)
                return [d["embedding"] for d in sorted(response.data, key=lambda d: d["index"])]

            return embed

        burst = AsyncBurst(texts_for("litellm"), open_caller, expected64, ATOL_F64)
        await through_a_yield(burst, stack)
        assert_clean(burst, stack)
        assert set(stack.sim.texts_embedded.values()) == {1}
    finally:
        await stack.stop()
