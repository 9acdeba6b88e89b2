"""A real Ollama for the tests: where it is, and one running on a free port.

``.ci/ollama`` builds it once per machine (``go install
github.com/ollama/ollama@VERSION`` with cgo, CPU only) and imports the
suite's two models into a models directory beside it: ``all-minilm``
(all-MiniLM-L6-v2, 384 dimensions) and ``smollm2`` (SmolLM2-135M-Instruct,
a chat model).  The cache is ``$YIELDPROXY_OLLAMA_DIR``, else
``$YIELDPROXY_CACHE/ollama-<version>`` (``/var/cache/yieldproxy`` by
default), the version read from that script.  The tests never build it;
where it is absent they are skipped with the reason, and with ``CI`` set
they fail (``.ci/run`` builds it and exports ``YIELDPROXY_OLLAMA_DIR``).

Each server gets a models directory of its own, hard links of the cached
one (blobs are never written in place, so a test that creates, copies or
deletes models changes only its own), and its own ``HOME``.
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
from typing import Any

import attrs
import pytest

from helpers import ci_cache_dir, free_port, log_tail, skip_or_fail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_SCRIPT = os.path.join(REPO, ".ci", "ollama")
EMBED_MODEL = "all-minilm"
CHAT_MODEL = "smollm2"
#: Bound on a start: ready in well under a second here; generous for a busy machine.
START_TIMEOUT = 60.0


def ollama_dir() -> str:
    """Where the ``ollama`` binary and its ``models/`` are (or would be)."""
    return ci_cache_dir("YIELDPROXY_OLLAMA_DIR", BUILD_SCRIPT, "VERSION", "ollama")


def missing() -> str | None:
    """Why a real Ollama cannot run here, or None."""
    where = ollama_dir()
    if not os.access(os.path.join(where, "ollama"), os.X_OK):
        return f"no ollama in {where}: run .ci/ollama (builds it once, about 10 minutes) or set YIELDPROXY_OLLAMA_DIR"
    if not os.path.isfile(os.path.join(where, "models", "ready")):
        return f"no imported models in {where}/models: run .ci/ollama"
    return None


def require_ollama() -> None:
    """Skip the test when no real Ollama is here; under CI, fail it instead."""
    skip_or_fail(missing(), "run the real Ollama tests")


@attrs.define(eq=False)
class OllamaServer:
    """One ``ollama serve`` on ``port`` (started again on the same port, same models, by :meth:`start`)."""

    port: int
    #: Extra environment (``OLLAMA_MAX_QUEUE``, ``OLLAMA_NUM_PARALLEL``, ...).
    env: dict[str, str] = attrs.Factory(dict)
    workdir: str = attrs.field(factory=lambda: tempfile.mkdtemp(prefix="yieldproxy-ollama-"))
    process: subprocess.Popen | None = None
    starts: int = 0

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def models(self) -> str:
        return os.path.join(self.workdir, "models")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"ollama.{self.starts}.log")

    @property
    def binary(self) -> str:
        return os.path.join(ollama_dir(), "ollama")

    def environment(self) -> dict[str, str]:
        home = os.path.join(self.workdir, "home")
        os.makedirs(home, exist_ok=True)
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "OLLAMA_MODELS": self.models,
            "OLLAMA_HOST": f"127.0.0.1:{self.port}",
            # The blobs are hard links shared with the cache: never prune them.
            "OLLAMA_NOPRUNE": "1",
            **self.env,
        }

    def start(self) -> "OllamaServer":
        """Start it (not waiting: see :meth:`wait_ready`); the first start links the cached models in."""
        if not os.path.isdir(self.models):
            subprocess.run(["cp", "-al", os.path.join(ollama_dir(), "models"), self.models], check=True)
        self.starts += 1
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [self.binary, "serve"], stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=self.environment(),
                start_new_session=True,  # its runners too: kill9() and stop() signal the group
            )
        return self

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.root + "/api/version", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Until ``/api/version`` answers (the seconds it took); fails the test if it exits first."""
        began = time.monotonic()
        while not self.answers():
            if self.process is not None and self.process.poll() is not None:
                pytest.fail(f"ollama exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - began > timeout:
                pytest.fail(f"ollama did not answer within {timeout}s:\n{self.log_tail()}")
            time.sleep(0.01)
        return time.monotonic() - began

    def kill9(self) -> None:
        """``kill -9`` of the server and its runners (one process group, as systemd kills a unit)."""
        self._signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # the runners, and a server that would not stop
        if self.process is not None:
            self.process.wait(10)

    def _signal_group(self, signum: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """A direct call (not through the proxy): its status, headers and body."""
        return request(self.root, method, path, body, raw, headers)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, _, content = self.request("POST", path, body)
        return status, json.loads(content)

    def embed(self, texts: list[str], model: str = EMBED_MODEL) -> list[list[float]]:
        """Its own vectors for ``texts`` (``/api/embed``)."""
        status, answer = self.post("/api/embed", {"model": model, "input": texts})
        assert status == 200, answer
        return answer["embeddings"]

    def loaded(self) -> list[str]:
        """The models ``/api/ps`` lists as loaded."""
        status, _, content = self.request("GET", "/api/ps")
        assert status == 200, content
        return [m["name"] for m in json.loads(content)["models"]]


def request(root: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
    """One call to the server at ``root``: its status, headers and body (JSON ``body``, or ``raw`` bytes)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    call = urllib.request.Request(root + path, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(call, timeout=timeout) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def started(env: dict[str, str] | None = None) -> OllamaServer:
    """An Ollama on a free port, answering; stopped (its directory removed) if it never answers."""
    require_ollama()
    server = OllamaServer(free_port(), dict(env or {}))
    try:
        server.start().wait_ready()
    except BaseException:  # pytest.fail is no Exception: no Ollama outlives the test that started it
        server.cleanup()
        raise
    return server
