"""A LightRAG ingest over a pool of two, one upstream yielded for the whole ingest (issue 12).

The real ``lightrag-hku`` pipeline (``LightRAG.ainsert``: chunking, entity
extraction, the chunk, entity and relation vector stores) runs in an asyncio
loop in a thread, against two simulated Ollamas behind one pool proxy:

* embeddings go through LightRAG's own ``ollama_embed`` (the ``ollama``
  client's ``/api/embed``, no retries of its own);
* each extraction call goes through LightRAG's own ``ollama_model_complete``
  (``/api/chat``); the sim answers deterministic words, not an extraction,
  so the test's LLM function checks that answer and then gives LightRAG
  deterministic entity and relation lines made from the chunk, so the
  entities and relations are embedded through the pool too.

The desktop is yielded (``POST /yield {"upstream": "desktop"}``) before the
ingest starts and released after it: every document must end ``processed``,
nothing may park, and every model request must be served by the server.

LightRAG's default tokenizer fetches tiktoken files at run time (offline it
fails, and ``ainsert`` does not raise: the document's status says so), so a
byte tokenizer stands in.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile

import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import in_thread, start_pool_stack
from test_callers import require
from yieldproxy.tools.sim import expected_embedding, expected_reply, messages_prompt

EMBED_MODEL = "all-minilm"
CHAT_MODEL = "llama3.2"
DIM = 384
DOCUMENTS = 12
TIMEOUT = 30.0


class ByteTokenizer:
    """UTF-8 bytes as tokens: offline, deterministic, and ``decode(encode(s)) == s``."""

    def encode(self, content: str) -> list[int]:
        return list(content.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="ignore")


def document(i: int) -> str:
    """A document of several chunks (chunks are 600 bytes here)."""
    lines = [
        f"Document {i}, part {p}: the desktop lends its GPU to a game while the server box keeps embedding; "
        f"the proxy routes request {i}-{p} to whichever upstream is available, and nothing is parked."
        for p in range(12)
    ]
    return "\n".join(lines)


def extraction(prompt: str) -> str:
    """Entity and relation lines, in LightRAG's delimiters, made from the prompt (so: per chunk)."""
    tag = hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:10]
    return "\n".join(
        [
            f"entity<|#|>Desktop {tag}<|#|>equipment<|#|>A desktop whose GPU is lent to a game ({tag}).",
            f"entity<|#|>Server {tag}<|#|>equipment<|#|>A server box that keeps embedding ({tag}).",
            f"relation<|#|>Desktop {tag}<|#|>Server {tag}<|#|>pool, upstream<|#|>Both serve one proxy ({tag}).",
            "<|COMPLETE|>",
        ]
    )


class Ingest:
    """One ``LightRAG.ainsert`` of :data:`DOCUMENTS` documents through ``url``; records what it saw."""

    def __init__(self, url: str, workdir: str):
        self.url = url
        self.workdir = workdir
        self.statuses: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.chats = 0
        self.wrong_replies: list[str] = []
        self.embedded: list[str] = []
        self.wrong_vectors: list[str] = []

    async def _main(self) -> None:
        import numpy as np
        from lightrag import LightRAG
        from lightrag.kg.shared_storage import initialize_pipeline_status
        from lightrag.llm.ollama import ollama_embed, ollama_model_complete
        from lightrag.utils import EmbeddingFunc, Tokenizer, logger

        logger.setLevel("WARNING")

        async def embed(texts: list[str], **kwargs):
            vectors = await ollama_embed.func(texts, embed_model=EMBED_MODEL, host=self.url)
            for text, vector in zip(texts, vectors):
                self.embedded.append(text)
                if not np.allclose(vector, expected_embedding(text, EMBED_MODEL, DIM), rtol=0, atol=1e-12):
                    self.wrong_vectors.append(text)
            return vectors

        async def llm(prompt, system_prompt=None, history_messages=None, **kwargs):
            history = list(history_messages or [])
            reply = await ollama_model_complete(
                prompt, system_prompt=system_prompt, history_messages=history, **kwargs
            )
            self.chats += 1
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
            messages += [*history, {"role": "user", "content": prompt}]
            if reply != "".join(expected_reply(messages_prompt(messages))):
                self.wrong_replies.append(prompt[:80])
            return extraction(prompt)

        rag = LightRAG(
            working_dir=self.workdir,
            embedding_func=EmbeddingFunc(embedding_dim=DIM, func=embed),
            llm_model_func=llm,
            llm_model_name=CHAT_MODEL,
            llm_model_kwargs={"host": self.url, "timeout": 60},
            tokenizer=Tokenizer("bytes", ByteTokenizer()),
            chunk_token_size=600,
            chunk_overlap_token_size=50,
            embedding_batch_num=8,
            enable_llm_cache=False,
        )
        await rag.initialize_storages()
        await initialize_pipeline_status()
        try:
            ids = [f"doc-{i}" for i in range(DOCUMENTS)]
            await rag.ainsert([document(i) for i in range(DOCUMENTS)], ids=ids)
            for doc_id in ids:
                status = await rag.doc_status.get_by_id(doc_id)
                value = (status or {}).get("status")
                self.statuses[doc_id] = str(getattr(value, "value", value))
                if status and status.get("error_msg"):
                    self.errors[doc_id] = status["error_msg"]
        finally:
            await rag.finalize_storages()

    def run(self) -> None:
        asyncio.run(self._main())


@pytest_twisted.ensureDeferred
async def test_lightrag_ingest_over_two_upstreams_with_one_yielded_throughout():
    """Issue 12: every document processed, no failure, nothing parked, all served by the available upstream."""
    require("lightrag")
    require("lightrag.llm.ollama")
    stack = await start_pool_stack(reactor, [{"name": "desktop"}, {"name": "server"}], latency=0.002, parallel=4)
    workdir = tempfile.mkdtemp(prefix="yieldproxy-lightrag-")
    # The twins' verification embedded its probe texts on both before the ingest: counted from here.
    before = {name: dict(sim.requests_total) for name, sim in stack.sims.items()}
    try:
        answer = await treq.post(
            stack.admin_url + "/yield", json={"upstream": "desktop", "reason": "game"}, persistent=False
        ).addTimeout(TIMEOUT, reactor)
        assert answer.code == 200, await answer.text()
        ingest = Ingest(stack.proxy_url, os.path.join(workdir, "rag"))
        await in_thread(reactor, ingest.run, timeout=100)
        # The desktop stayed yielded for the whole ingest.
        assert stack.proxy.scheduler.member("desktop").state_name() == "yielded"
        assert ingest.errors == {}
        assert ingest.statuses == {f"doc-{i}": "processed" for i in range(DOCUMENTS)}, ingest.statuses
        # Chunks, entities and relations were embedded, every vector right; every chat answer right.
        assert len(ingest.embedded) >= 3 * DOCUMENTS and ingest.wrong_vectors == []
        assert ingest.chats >= DOCUMENTS and ingest.wrong_replies == []
        # Nothing parked, nothing failed, and the server served every model request.
        for cls in ("batch", "interactive"):
            assert stack.sample("yieldproxy_park_seconds_count", **{"class": cls}) == 0
            assert stack.sample("yieldproxy_rejected_total", **{"class": cls, "reason": "queue_full"}) == 0
        assert stack.sample("yieldproxy_parked_requests", **{"class": "batch"}) == 0
        def since(name: str, path: str) -> int:
            return stack.sims[name].requests_total[path] - before[name].get(path, 0)

        assert since("desktop", "/api/embed") == since("desktop", "/api/chat") == 0
        assert since("server", "/api/embed") >= 1 and since("server", "/api/chat") == ingest.chats
        attempts = since("server", "/api/embed") + since("server", "/api/chat")
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="server", outcome="ok") == attempts
        assert stack.sample("yieldproxy_upstream_attempts_total", upstream="desktop", outcome="ok") == 0
        for cls in ("batch", "interactive"):
            for code in ("500", "502", "503", "504"):
                assert stack.sample("yieldproxy_requests_total", **{"class": cls, "code": code}) == 0
        assert len(stack.proxy.lot) == 0 and stack.proxy.scheduler.inflight == 0
    finally:
        await stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
