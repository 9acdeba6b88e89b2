"""Minimal model calls for outage probes: moved to :mod:`yieldproxy.servers`.

Each server's description has its own (``servers.server(api).minimal_call``);
these names are Ollama's, kept so that code written against this module
keeps working.
"""

from __future__ import annotations

from .servers.base import PROBE_TEXT, ModelCall
from .servers.ollama import minimal_call

__all__ = ["PROBE_TEXT", "ModelCall", "minimal_call"]
