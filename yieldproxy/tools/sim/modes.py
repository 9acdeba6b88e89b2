"""
The outage modes: the ways a real GPU server fails as a whole.

``ok``
    every request is served.
``refuse``
    the server is gone: its port is closed, every connection reset (a crash,
    a restart, a stopped service).
``error500``
    the process answers, its GPU does not: every model request gets the
    server's own out-of-memory error at once, while the routes that do not
    touch the model still answer.
``error500_unknown``
    as ``error500``, in words no list of known failures has (Ollama:
    :data:`~.ollama.UNKNOWN_ERROR`, a CUDA fault that is not an out-of-memory;
    the other servers: their own internal 500).
``hang``
    model requests are accepted and never answered (a wedged runner).
``reset``
    model requests get a TCP reset (a runner that dies mid-request).
``stall``
    model requests get the head of their answer and its first bytes (the
    first line of a stream, the first bytes of a whole body under its full
    ``Content-Length``), then nothing, the connection left open (a runner
    that hangs mid-answer).
``stall_head``
    model requests get the head of their answer (status 200 and its
    headers) and then nothing, not one byte of the body (a runner wedged
    right after it began to answer).

Each API words the errors its own way (see :mod:`.ollama` and its siblings).
"""

from __future__ import annotations

MODES = ("ok", "refuse", "error500", "error500_unknown", "hang", "reset", "stall", "stall_head")
"""The outage modes :meth:`SimOllama.set_mode` accepts."""
