"""A real chat model streaming through the proxy from a real llama-server (issue 30).

llama-server (tests/llamaserver.py) serves SmolLM2-135M-Instruct
(tests/chatmodel.py) as ``smollm2``, four slots at once; the proxy has it as
a member ``api = "llamacpp"``, whose ``/v1/chat/completions`` is OpenAI's
chat, class ``interactive`` (yieldproxy/servers/llamacpp.py).  Every call is
the real ``openai`` client's, or raw HTTP where the bytes are the subject:

* streaming chats parked by a yield are replayed after the resume and
  stream real tokens to their end, the same tokens the server streams when
  asked directly; four at once all finish;
* a stream cut by llama-server's death (``kill -9``) mid-way ends for its
  caller with the error event of docs/guarantees.md in OpenAI's shape,
  promptly: the ``openai`` client raises ``APIError``, and on the wire the
  last event is that error, no ``[DONE]``;
* a non-streaming chat through the proxy has the shape and the answer of one
  asked directly;
* ``X-Yield-Max-Wait`` during a yield: the honest 503 with ``Retry-After`` in
  OpenAI's shape after the caller's wait, or at once when the declared yield
  is longer than it (docs/clients.md).
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor

from chatmodel import CHAT_ALIAS
from helpers import in_thread, sleep, wait_for
from llamaserver import LlamaServer, require_llama, started
from test_llamacpp_real import Proxy, llama_member, start_proxy

# Real processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 60.0
#: Greedy sampling, one seed: the same prompt gives the same tokens (asked alone).
GREEDY = {"temperature": 0.0, "seed": 7}
#: llama-server's own keys (the openai client's ``extra_body``): the whole prompt computed every time, as
#: the first time (a prompt partly from its cache is computed in other batches, which may change a token).
SAME_EVERY_TIME = {"cache_prompt": False}
PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to five.",
]
#: A stream long enough to be cut mid-way: it goes on to ``max_tokens`` (llama-server's ``ignore_eos``).
LONG_STREAM = {"max_tokens": 400, "ignore_eos": True}
#: After a kill, how long the caller may wait for its error (it comes in well under a second here).
PROMPT_ERROR_SECONDS = 10.0


def _chat_llama_server():
    """A llama-server of the chat model, stopped (its directory removed) after its user."""
    require_llama(chat=True)
    server = started(chat=True)
    yield server
    server.stop()
    shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def chat_llama():
    """A llama-server of the chat model, for the module."""
    yield from _chat_llama_server()


@pytest.fixture
def own_chat_llama():
    """A llama-server of the chat model that the test may kill."""
    yield from _chat_llama_server()


def chat_proxy(llama: LlamaServer, **overrides) -> Proxy:
    return start_proxy(llama_member("llama", llama), **overrides)


def openai_client(url: str, headers: dict | None = None):
    import openai

    return openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT, default_headers=headers or {}
    )


@attrs.define
class Streamed:
    """What one streaming chat gave its caller."""

    content: str = ""
    finish_reason: str | None = None
    models: set = attrs.Factory(set)
    headers: dict = attrs.Factory(dict)
    #: Set at the first token that carried content.
    first_token: threading.Event = attrs.Factory(threading.Event)
    #: The exception the stream ended with, and when (``time.monotonic()``).
    error: BaseException | None = None
    ended_at: float | None = None


def stream_chat(url: str, prompt: str, into: Streamed | None = None, **extra) -> Streamed:
    """A streaming chat by the ``openai`` client, read to its end; an error it raises is kept, not raised."""
    got = into if into is not None else Streamed()
    client = openai_client(url)
    body = {"max_tokens": 24, **GREEDY, **extra}
    own = {**SAME_EVERY_TIME, **({"ignore_eos": body.pop("ignore_eos")} if "ignore_eos" in body else {})}
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=CHAT_ALIAS, messages=[{"role": "user", "content": prompt}], stream=True,
            extra_body=own, **body,
        )
        got.headers = {k.lower(): v for k, v in raw.headers.items()}
        for chunk in raw.parse():
            got.models.add(chunk.model)
            for choice in chunk.choices:
                if choice.delta.content:
                    got.content += choice.delta.content
                    got.first_token.set()
                if choice.finish_reason:
                    got.finish_reason = choice.finish_reason
    except Exception as e:  # noqa: BLE001 - kept for the test to judge
        got.error = e
    finally:
        got.ended_at = time.monotonic()
        client.close()
    return got


async def parked(proxy: Proxy) -> int:
    """How many requests the proxy's ``/status`` says are parked."""
    return (await proxy.admin("/status"))["parked_total"]


async def wait_parked(proxy: Proxy, count: int) -> None:
    began = time.monotonic()
    while (seen := await parked(proxy)) != count:
        assert time.monotonic() - began < TIMEOUT, f"{seen} parked, never {count}"
        await sleep(reactor, 0.02)


def attempts_by_outcome(proxy: Proxy) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for metric in proxy.proxy.metrics.registry.collect() for sample in metric.samples
        if sample.name == "yieldproxy_upstream_attempts_total" and sample.labels["upstream"] == "llama"
    }


async def sent_once_each(proxy: Proxy, chats: int) -> None:
    """Until the proxy has counted ``chats`` attempts (counted as the upstream ends its answer: a moment after
    the caller read it), and then: each chat went upstream exactly once, nothing failed.

    ``abandoned`` is counted beside ``ok``: the ``openai`` client closes its connection as soon as it reads
    ``data: [DONE]``, and now and then that is before llama-server's last chunk reached the proxy (the
    caller had the whole answer; its assertions check that).
    """
    await wait_for(reactor, lambda: sum(attempts_by_outcome(proxy).values()) >= chats, timeout=TIMEOUT)
    outcomes = attempts_by_outcome(proxy)
    assert sum(outcomes.values()) == chats and set(outcomes) <= {"ok", "abandoned"}, outcomes


# -- a yield: parked, replayed, streamed to the end ------------------------------------------


@pytest_twisted.ensureDeferred
async def test_streaming_chats_parked_by_a_yield_stream_their_real_tokens_to_the_end_after_the_resume(chat_llama):
    direct = await in_thread(reactor, stream_chat, chat_llama.root, PROMPTS[0])
    assert direct.error is None and direct.content and direct.finish_reason, direct
    proxy = chat_proxy(chat_llama)
    try:
        await proxy.admin("/yield", {"upstream": "llama", "source": "game"})
        one = in_thread(reactor, stream_chat, proxy.url, PROMPTS[0])
        await wait_parked(proxy, 1)
        assert attempts_by_outcome(proxy) == {} and not one.called
        await proxy.admin("/resume", {"upstream": "llama", "source": "game"})
        replayed = await one
        # The server's own tokens, all of them: the same as asked directly, with its finish.
        assert replayed.error is None, replayed.error
        assert replayed.content == direct.content and replayed.finish_reason == direct.finish_reason
        assert replayed.models == direct.models == {CHAT_ALIAS}
        assert float(replayed.headers["x-yield-parked-seconds"]) > 0
        await sent_once_each(proxy, 1)
        assert await parked(proxy) == 0

        # Four at once: parked together, replayed together (four slots), each to its end.
        await proxy.admin("/yield", {"upstream": "llama", "source": "game"})
        chats = [in_thread(reactor, stream_chat, proxy.url, p, max_tokens=48) for p in PROMPTS]
        await wait_parked(proxy, 4)
        assert sum(attempts_by_outcome(proxy).values()) == 1 and not any(c.called for c in chats)
        await proxy.admin("/resume", {"upstream": "llama", "source": "game"})
        for prompt, chat in zip(PROMPTS, chats):
            got = await chat
            assert got.error is None, (prompt, got.error)
            assert got.content.strip() and got.finish_reason in ("stop", "length"), (prompt, got)
            assert got.models == {CHAT_ALIAS} and float(got.headers["x-yield-parked-seconds"]) > 0
        await sent_once_each(proxy, 5)
        assert await parked(proxy) == 0
        assert proxy.sample("yieldproxy_retries_total", **{"class": "interactive"}) == 0
    finally:
        await proxy.stop()


# -- a stream cut by the server's death ---------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_stream_cut_by_a_kill_9_raises_the_openai_clients_api_error_at_once(own_chat_llama):
    import openai

    proxy = chat_proxy(own_chat_llama)
    try:
        got = Streamed()
        chat = in_thread(reactor, stream_chat, proxy.url, "Tell me a long story about a ship.", got, **LONG_STREAM)
        await wait_for(reactor, got.first_token.is_set, timeout=TIMEOUT)
        killed_at = time.monotonic()
        own_chat_llama.kill9()
        await chat
        # An error in the stream, in OpenAI's shape: the client's APIError (not a connection error), promptly.
        assert got.error is not None, f"the stream ended cleanly after the kill: {got}"
        assert type(got.error) is openai.APIError, repr(got.error)
        assert got.ended_at - killed_at < PROMPT_ERROR_SECONDS
        body = got.error.body
        assert set(body) == {"message", "type", "code"}, body
        assert body["code"] == "upstream_broken" and body["type"] == "server_error"
        assert body["message"].startswith("upstream failed mid-answer"), body
        # Cut, not finished: part of the answer came, no finish.
        assert got.content and got.finish_reason is None
        # Never replayed: a failure after the first byte is the caller's to retry.
        await wait_for(reactor, lambda: attempts_by_outcome(proxy) != {}, timeout=TIMEOUT)
        assert attempts_by_outcome(proxy) == {"broken": 1}
        assert proxy.sample("yieldproxy_retries_total", **{"class": "interactive"}) == 0
    finally:
        await proxy.stop()


def raw_stream(url: str, started_streaming: threading.Event, timeout: float = TIMEOUT) -> tuple[int, dict, bytes]:
    """A streaming chat by plain HTTP/1.1: status, headers, and every byte of the body until the proxy ends it
    (``started_streaming`` is set at the first body bytes)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = {
        "model": CHAT_ALIAS, "messages": [{"role": "user", "content": "Tell me a long story about a ship."}],
        "stream": True, **LONG_STREAM, **GREEDY,
    }
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        received = b""
        while True:
            try:
                piece = answer.read1(65536)
            except http.client.IncompleteRead as e:  # a chunked body cut short: what came is kept
                received += e.partial
                break
            if not piece:
                break
            received += piece
            started_streaming.set()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, received
    finally:
        connection.close()


def sse_events(body: bytes) -> list[str]:
    """The ``data:`` of each whole event (an event ends with a blank line); a partial last event is dropped,
    as an SSE reader does."""
    events = []
    for block in body.decode("utf-8").replace("\r\n", "\n").split("\n\n")[:-1]:
        data = [line[len("data:"):].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")]
        if data:
            events.append("\n".join(data))
    return events


@pytest_twisted.ensureDeferred
async def test_on_the_wire_a_stream_cut_by_a_kill_9_ends_with_an_error_event_never_a_clean_done(own_chat_llama):
    proxy = chat_proxy(own_chat_llama)
    try:
        streaming = threading.Event()
        chat = in_thread(reactor, raw_stream, proxy.url, streaming)
        await wait_for(reactor, streaming.is_set, timeout=TIMEOUT)
        killed_at = time.monotonic()
        own_chat_llama.kill9()
        status, headers, body = await chat
        assert time.monotonic() - killed_at < PROMPT_ERROR_SECONDS
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), headers
        events = sse_events(body)
        assert len(events) >= 2, body
        # Tokens first, each a whole chat chunk, then the error: the last event, and the body ends there.
        *tokens, last = events
        assert all(json.loads(t)["object"] == "chat.completion.chunk" for t in tokens), tokens
        error = json.loads(last)
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "code"}, last
        assert error["error"]["code"] == "upstream_broken", last
        assert body.endswith(b"\n\n") and b"[DONE]" not in body, body[-300:]
    finally:
        await proxy.stop()


# -- a chat not streamed, and a caller's wait ---------------------------------------------------


def shape(value):
    """The structure of a JSON value: its keys all the way down, its leaves' types."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def plain_chat(url: str, prompt: str) -> tuple[dict, dict]:
    """A non-streaming chat by the ``openai`` client: the JSON it got, and its headers."""
    client = openai_client(url)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=CHAT_ALIAS, messages=[{"role": "user", "content": prompt}], max_tokens=24, **GREEDY,
            extra_body=SAME_EVERY_TIME,
        )
        return json.loads(raw.text), {k.lower(): v for k, v in raw.headers.items()}
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_a_chat_not_streamed_is_the_servers_own_answer_in_its_own_shape(chat_llama):
    direct, _ = await in_thread(reactor, plain_chat, chat_llama.root, PROMPTS[1])
    proxy = chat_proxy(chat_llama)
    try:
        relayed, headers = await in_thread(reactor, plain_chat, proxy.url, PROMPTS[1])
        assert shape(relayed) == shape(direct)
        assert relayed["object"] == "chat.completion" and relayed["model"] == CHAT_ALIAS
        # The same tokens (greedy, the whole prompt computed each time) and the same counts.
        assert relayed["choices"] == direct["choices"]
        assert [relayed["usage"][k] for k in COUNTS] == [direct["usage"][k] for k in COUNTS]
        assert relayed["choices"][0]["message"]["content"]
        assert "x-yield-parked-seconds" not in headers  # never parked
        await sent_once_each(proxy, 1)
    finally:
        await proxy.stop()


def refused_chat(url: str, max_wait: str) -> tuple[BaseException, float]:
    """A chat by the ``openai`` client as docs/clients.md sets one up for a person waiting: the error it
    raised, and how long it took."""
    import openai

    client = openai_client(url, {"X-Yield-Max-Wait": max_wait})
    began = time.monotonic()
    try:
        client.chat.completions.create(
            model=CHAT_ALIAS, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, **GREEDY
        )
    except openai.APIError as e:
        return e, time.monotonic() - began
    finally:
        client.close()
    pytest.fail("the chat was answered during the yield")


@pytest_twisted.ensureDeferred
async def test_a_callers_max_wait_during_a_yield_ends_in_the_honest_503_in_openais_shape(chat_llama):
    import openai

    proxy = chat_proxy(chat_llama)
    try:
        # A yield of unknown length: parked for the caller's second, then the 503.
        await proxy.admin("/yield", {"upstream": "llama", "source": "game"})
        waiting = in_thread(reactor, refused_chat, proxy.url, "1")
        await wait_parked(proxy, 1)
        error, took = await waiting
        assert isinstance(error, openai.InternalServerError) and error.status_code == 503, repr(error)
        assert 1.0 <= took < 10.0
        assert int(error.response.headers["retry-after"]) >= 1
        body = error.response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, body
        assert "wait longer than your X-Yield-Max-Wait (1s)" in body["error"]["message"], body
        assert await parked(proxy) == 0 and attempts_by_outcome(proxy) == {}

        # A yield declared for ten minutes: a caller who allows 5 s is told at once, never parked.
        await proxy.admin("/yield", {"upstream": "llama", "source": "game", "expected_seconds": 600})
        error, took = await in_thread(reactor, refused_chat, proxy.url, "5")
        assert isinstance(error, openai.InternalServerError) and error.status_code == 503, repr(error)
        assert took < 5.0
        assert 60 <= int(error.response.headers["retry-after"]) <= 600
        message = error.response.json()["error"]["message"]
        assert message.startswith("wait longer than your X-Yield-Max-Wait: the GPU is expected back in"), message
        assert proxy.sample("yieldproxy_rejected_total", **{"class": "interactive", "reason": "over_budget"}) == 1
        assert attempts_by_outcome(proxy) == {}

        # After the resume the same caller is served.
        await proxy.admin("/resume", {"upstream": "llama", "source": "game"})
        answer, _ = await in_thread(reactor, plain_chat, proxy.url, PROMPTS[0])
        assert answer["choices"][0]["message"]["content"]
        await sent_once_each(proxy, 1)
    finally:
        await proxy.stop()

