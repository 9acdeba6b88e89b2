"""Which class a request belongs to, from its route and (when trusted) a header.

``interactive`` wants an answer in seconds, ``batch`` can wait, ``long`` can
wait minutes; ``passthrough`` routes (model lists, version, ...) are never
parked.
"""

from __future__ import annotations

from ipaddress import ip_address

PASSTHROUGH = "passthrough"
CLASSES = ("interactive", "batch", "long")

#: DESIGN.md's default routes; everything else is passthrough.
DEFAULT_ROUTES: dict[bytes, str] = {
    b"/api/embed": "batch",
    b"/api/embeddings": "batch",
    b"/v1/embeddings": "batch",
    b"/api/chat": "interactive",
    b"/api/generate": "interactive",
    b"/v1/chat/completions": "interactive",
    b"/v1/completions": "interactive",
}


def api_family(path: bytes) -> str:
    """``openai`` for /v1/ routes, else ``ollama``: the shape of our error bodies."""
    return "openai" if path.startswith(b"/v1/") else "ollama"


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and unix-socket peers (host None)."""
    if host is None:
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def classify(path: bytes, class_header: bytes | None, trust_header: bool) -> str:
    """The class of a request; a trusted ``X-Yield-Class`` picks among the parkable classes."""
    route_class = DEFAULT_ROUTES.get(path.rstrip(b"/") or b"/", PASSTHROUGH)
    if trust_header and class_header is not None:
        wanted = class_header.strip().lower().decode("ascii", "replace")
        if wanted in CLASSES:
            return wanted
    return route_class
