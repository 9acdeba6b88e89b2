"""
The outage modes: the ways a real GPU server fails as a whole (``ok``,
``refuse``, ``error500``, ``error500_unknown``, ``hang``, ``reset``, ``stall``,
``stall_head``), each worded by the API the sim plays (:mod:`.ollama` and its
siblings).  What each mode does: docs/architecture.md (*The simulated Ollama*).
"""

from __future__ import annotations

MODES = ("ok", "refuse", "error500", "error500_unknown", "hang", "reset", "stall", "stall_head")
"""The outage modes :meth:`SimOllama.set_mode` accepts."""
