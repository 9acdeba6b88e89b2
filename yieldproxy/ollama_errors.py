"""Which upstream errors mean "the GPU or its runner failed", read the way Ollama writes them.

An upstream 500 is not, by itself, a GPU failure: Ollama answers a request's
own mistakes with 500 too, and quotes the request while doing so (a bad
``template`` on ``/api/generate`` gives ``template: :1: function "gpu" not
defined``, HEAD ``server/routes.go:503-505``).  Searching the body for words
such as "gpu" or "cuda" would let any caller declare an outage.  So a failure
counts only when the error *message*, taken from the structure of Ollama's
error JSON, **starts** with a prefix that Ollama's own code writes for a
runner or memory failure.  Text after the prefix (the runner's last stderr
line, which can say ``CUDA error: out of memory``) is never read: only the
prefix decides, and no request field can be put in front of it.

The error JSON is Ollama's ``{"error": "<message>"}`` (``gin.H{"error":
err.Error()}`` in ``server/routes.go``), or on the ``/v1/`` routes its
OpenAI shape ``{"error": {"message": "<message>", "type": "api_error", ...}}``
(``openai.NewError``, written by ``middleware/openai.go`` ``writeError``).

The prefixes, from Ollama's source (mirror of github.com/ollama/ollama):

* ``HEAD`` = ``fb30760996871fa9460115c753afd2c60d4ab0f7`` (v0.33 era, the
  ``llama-server`` runner), and
* ``v0.12.0`` = ``9f3a37fd36bf1c46cc86a47bc5372535f8ee3547`` (the ``llama
  runner`` wording still deployed widely, and the one the simulated Ollama
  speaks).

How they reach a client as a 500: the scheduler's load errors go through
``handleScheduleError``'s default branch (HEAD ``server/routes.go:3107-3118``:
``c.JSON(http.StatusInternalServerError, gin.H{"error": err.Error()})``);
errors of a completion go out through ``streamResponse`` /
the non-streaming branch with status 500 (HEAD ``server/routes.go:765-777``,
``2097-2120``); ``/api/embeddings`` answers 500 (HEAD ``server/routes.go:1084-1087``)
and v0.12.0's ``/api/embed`` too.  HEAD's ``/api/embed`` answers the same
runner errors with **400** (HEAD ``server/routes.go:1010-1012``: every error that
is not an ``api.StatusError``), so a 400 with one of these prefixes counts as
well; no request field can produce such a 400 either.
"""

from __future__ import annotations

import json

#: Prefixes of Ollama's own runner and memory failures (see the module docstring for the commits).
GPU_FAILURE_PREFIXES: tuple[str, ...] = (
    # The runner process died or is gone.
    "llama runner process has terminated",  # v0.12.0 llm/server.go:1261
    "llama runner process no longer running",  # v0.12.0 llm/server.go:1173, 1277
    "llama-server process has terminated",  # HEAD llm/llama_server.go:1306-1325
    "llama-server process no longer running",  # HEAD llm/llama_server.go:1198, 1341
    "model runner has unexpectedly stopped",  # HEAD llm/llama_server.go:1642-1644, 1936-1938; v0.12.0 llm/server.go:1460
    "an error was encountered while running the model",  # HEAD llm/llama_server.go:1766, 2075; v0.12.0 llm/server.go:1537
    "do embedding request:",  # the runner's port is gone: HEAD llm/llama_server.go:2371; v0.12.0 llm/server.go:1588
    "unexpected server status:",  # the runner is not ready: HEAD llm/llama_server.go:1550, 1907, 2348; v0.12.0 llm/server.go:1438, 1572
    "llama-server error:",  # the runner's health check failed: HEAD llm/llama_server.go:1250
    # The runner could not start or load the model.
    "timed out waiting for llama runner to start",  # v0.12.0 llm/server.go:1259, 1270
    "timed out waiting for llama-server to start",  # HEAD llm/llama_server.go:1302, 1336
    "error starting runner:",  # v0.12.0 llm/server.go:407
    "error starting llama-server:",  # HEAD llm/llama_server.go:969
    "llama-server startup failed",  # HEAD llm/llama_server.go:1059, 1096, 1101
    # Not enough (GPU) memory to load.
    "llama-server reported out-of-memory during startup",  # HEAD llm/llama_server.go:1372, 1375
    "unable to load full model on GPU",  # ErrLoadRequiredFull: HEAD llm/server.go:20; v0.12.0 llm/server.go:497
    "model requires more system memory",  # v0.12.0 llm/server.go:540, 957
    "failed to allocate memory for model",  # v0.12.0 llm/server.go:591
    "memory layout cannot be allocated",  # v0.12.0 llm/server.go:801, 811
    "failed to commit memory for model",  # v0.12.0 llm/server.go:834
)

#: Statuses such an error comes with (500; 400 from HEAD's /api/embed, see above).
GPU_FAILURE_STATUSES = frozenset({400, 500})

#: Ollama's error bodies are a few hundred bytes; a longer one is not read as JSON.
MAX_ERROR_BODY = 64 * 1024


def error_message(body: bytes) -> str | None:
    """The message of an Ollama error body, from its JSON structure only, or None.

    ``{"error": "msg"}`` (Ollama) or ``{"error": {"message": "msg", ...}}``
    (its OpenAI-compatible routes); anything else (not JSON, other keys, a
    message that is not a string) has no message.
    """
    if not body or len(body) > MAX_ERROR_BODY:
        return None
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else None


def is_gpu_failure(status: int, body: bytes) -> bool:
    """True when Ollama says its runner or GPU memory failed (prefix at the very start of its message)."""
    if status not in GPU_FAILURE_STATUSES:
        return False
    message = error_message(body)
    return message is not None and message.startswith(GPU_FAILURE_PREFIXES)
