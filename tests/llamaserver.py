"""A real llama.cpp ``llama-server`` for the tests: where it is, and one running on a free port.

``.ci/llama-server`` builds it once per machine (from the llama.cpp that the
llama-cpp-python sdist vendors) with a GGUF of all-MiniLM-L6-v2, into a
cache directory outside the clone: ``$YIELDPROXY_LLAMA_DIR``, else
``$YIELDPROXY_CACHE/llamacpp-<version>`` (``/var/cache/yieldproxy`` by
default), the version read from that script.  The tests never build it
(about 13 minutes); where it is absent they are skipped with the reason, and
with ``CI`` set they fail (``.ci/run`` always builds it and exports
``YIELDPROXY_LLAMA_DIR``).

It serves one model (its ``--alias``), is ready in well under a second, and
until then answers every route 503 ``Loading model`` (docs/servers.md): the
embedding model by default, or with ``chat=True`` the real chat model of
tests/chatmodel.py (four slots of 512 tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Sequence

import attrs
import pytest

import chatmodel
from helpers import ci_cache_dir, free_port, log_tail, skip_or_fail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_SCRIPT = os.path.join(REPO, ".ci", "llama-server")
MODEL_FILE = "minilm-f16.gguf"
#: The name it serves its model under (``--alias``): the one the Infinity tests use for the same model.
ALIAS = "all-minilm"
#: Bound on a start: ready in 0.1-0.5 s here; generous for a busy machine.
START_TIMEOUT = 60.0


def llama_dir() -> str:
    """Where ``llama-server`` and the GGUF are (or would be)."""
    return ci_cache_dir("YIELDPROXY_LLAMA_DIR", BUILD_SCRIPT, "SDIST_VERSION", "llamacpp", default_version="0.3.36")


def missing(chat: bool = False) -> str | None:
    """Why a real llama-server of the embedding model (of the chat model with ``chat``) cannot run here, or None."""
    where = llama_dir()
    if not os.access(os.path.join(where, "llama-server"), os.X_OK):
        return f"no llama-server in {where}: run .ci/llama-server (builds it once, about 13 minutes) or set YIELDPROXY_LLAMA_DIR"
    if chat:
        return chatmodel.missing()
    if not os.path.isfile(os.path.join(where, MODEL_FILE)):
        return f"no {MODEL_FILE} in {where}: run .ci/llama-server"
    return None


def require_llama(chat: bool = False) -> None:
    """Skip the test when no real llama-server (or model) is here; under CI, fail it instead."""
    skip_or_fail(missing(chat), "run the real llama-server tests")


def model_arguments(chat: bool) -> tuple[str, ...]:
    """What makes llama-server serve the embedding model (mean pooling), or the chat model (2048 tokens of
    context over four slots: four chats at once)."""
    if chat:
        return ("-m", chatmodel.chat_model_path(), "--alias", chatmodel.CHAT_ALIAS, "-c", "2048", "-np", "4")
    return ("-m", os.path.join(llama_dir(), MODEL_FILE), "--alias", ALIAS, "--embedding", "--pooling", "mean")


@attrs.define(eq=False)
class LlamaServer:
    """One llama-server process on ``port`` (started again on the same port by :meth:`restart`)."""

    port: int
    extra: tuple[str, ...] = ()
    #: Serve the chat model instead of the embedding model.
    chat: bool = False
    workdir: str = attrs.field(factory=lambda: tempfile.mkdtemp(prefix="yieldproxy-llama-"))
    process: subprocess.Popen | None = None
    starts: int = 0

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"llama-server.{self.starts}.log")

    def start(self) -> "LlamaServer":
        """Start it (not waiting: see :meth:`wait_ready`)."""
        command = [
            os.path.join(llama_dir(), "llama-server"), *model_arguments(self.chat),
            "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", "--no-webui", *self.extra,
        ]
        self.starts += 1
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        return self

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def health(self) -> int | None:
        """Its ``/health`` status, or None when nothing answers."""
        try:
            with urllib.request.urlopen(self.root + "/health", timeout=2) as answer:
                return answer.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_until(self, statuses: Sequence[int], timeout: float = START_TIMEOUT) -> float:
        """Until ``/health`` answers one of ``statuses`` (the seconds it took); fails the test if it exits."""
        began = time.monotonic()
        while self.health() not in statuses:
            if self.process is not None and self.process.poll() is not None:
                pytest.fail(f"llama-server exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - began > timeout:
                pytest.fail(f"llama-server not at {statuses} within {timeout}s:\n{self.log_tail()}")
            time.sleep(0.002)
        return time.monotonic() - began

    def wait_ready(self) -> float:
        return self.wait_until((200,))

    def kill9(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def post(self, path: str, body: dict) -> tuple[int, object]:
        """A direct call (not through the proxy): its status and JSON."""
        request = urllib.request.Request(
            self.root + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Its own vectors for ``texts`` (``/v1/embeddings``)."""
        status, answer = self.post("/v1/embeddings", {"model": ALIAS, "input": texts})
        assert status == 200, answer
        return [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]


def started(extra: Sequence[str] = (), chat: bool = False) -> LlamaServer:
    """A llama-server on a free port, ready; stopped (its directory removed) if it never gets ready."""
    require_llama(chat)
    server = LlamaServer(free_port(), tuple(extra), chat)
    try:
        server.start().wait_ready()
    except BaseException:  # pytest.fail is no Exception: no llama-server outlives the test that started it
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
        raise
    return server
