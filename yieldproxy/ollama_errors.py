"""Ollama's GPU and runner failures: moved to :mod:`yieldproxy.servers.ollama`.

Kept so that code written against this module keeps working; new code asks
the server's description (``servers.server(api).judge``).
"""

from __future__ import annotations

from .servers.base import MAX_ERROR_BODY
from .servers.ollama import GPU_FAILURE_PREFIXES, GPU_FAILURE_STATUSES, error_message, is_gpu_failure

__all__ = ["GPU_FAILURE_PREFIXES", "GPU_FAILURE_STATUSES", "MAX_ERROR_BODY", "error_message", "is_gpu_failure"]
