"""The outage modes and the wording of the errors a real server gives."""

from __future__ import annotations

MODES = ("ok", "refuse", "error500", "hang", "reset")
"""The outage modes :meth:`SimOllama.set_mode` accepts."""

OOM_ERROR = "llama runner process has terminated: CUDA error: out of memory"
"""The error a model request gets in ``error500`` mode, in Ollama's wording."""

LOAD_OOM_ERROR = "llama runner process has terminated: cudaMalloc failed: out of memory"
"""What a request whose ``num_ctx`` passes ``max_num_ctx`` gets: its own load does not fit."""

BUSY_ERROR = "server busy, please try again.  maximum pending requests exceeded"
"""Ollama's 503 once ``OLLAMA_MAX_QUEUE`` requests wait (see ``max_queue``)."""
