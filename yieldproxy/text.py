"""Text from outside (a request line, an admin API's answer), made safe to show.

A request path may carry a newline that forges a log line, an admin API's
answer an escape sequence that rewrites the terminal: the request log, the
command-line client and the demo show such text only through
:func:`printable`.
"""

from __future__ import annotations


def printable(text: object, limit: int | None = None) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\x1b``), at most ``limit`` characters."""
    shown = str(text)
    if not shown.isprintable():
        shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in shown)
    if limit is not None and len(shown) > limit:
        shown = shown[: max(limit - 3, 0)] + "..."
    return shown
