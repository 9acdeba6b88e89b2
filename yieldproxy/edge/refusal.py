"""How the edge answers a request or a connection without the app: one answer, decided here.

Every such answer is a :class:`Refusal` (a status, its words, the code the
OpenAI shape names it by, a Retry-After when one is due) written by
:func:`wire_answer`: the reader's refusals (reader.py), the requests the
edge keeps from the app (request.py), the connections past the cap
(capacity.py).  So the JSON shape of the route, the headers and the close
are the same whichever part of the edge refuses.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import attrs
from twisted.web.http import RESPONSES

#: ``error_body(path, status, message, code)``: the JSON body of an answer the edge writes itself, in the shape
#: of the API ``path`` belongs to (the listeners give theirs: errors.listener_error_body).
ErrorBody = Callable[[bytes, int, str, str], bytes]

#: The methods a 405 names (a reverse proxy serves these; ``CONNECT`` is the one refused).
ALLOWED_METHODS = b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"
#: Reason phrases Twisted's table lacks.
_PHRASES = {431: b"Request Header Fields Too Large"}
_HTTP11 = b"HTTP/1.1"


@attrs.frozen
class Refusal:
    """Answer ``status`` with ``message`` (``code`` names it in the OpenAI shape); ``retry_after`` seconds, if due."""

    status: int
    message: str
    code: str
    retry_after: int | None = None


def plain_error_body(path: bytes, status: int, message: str, code: str) -> bytes:
    """``{"error": message}``: the error body of a site that was given no other."""
    return json.dumps({"error": message}).encode("utf-8")


def wire_answer(
    refusal: Refusal, error_body: ErrorBody, line: tuple[bytes, bytes, bytes] | None, close: bool = True
) -> bytes:
    """The whole answer to ``refusal`` as bytes on the wire.

    ``line`` is the request line read (method, target, version), None when
    none was: its path picks the body's shape, its version is the answer's
    (as the app's answers echo it), and a HEAD request gets the headers
    without the body (RFC 9110 9.3.2).  ``close``: the connection closes
    after it (``Connection: close``).
    """
    method, target, version = line if line is not None else (b"", b"", _HTTP11)
    status = refusal.status
    body = error_body(target.split(b"?", 1)[0], status, refusal.message, refusal.code)
    phrase = _PHRASES.get(status) or RESPONSES.get(status, b"Error")
    parts = [b"%s %d %s\r\ncontent-type: application/json; charset=utf-8\r\n" % (version, status, phrase)]
    if status == 405:
        parts.append(b"allow: %s\r\n" % ALLOWED_METHODS)
    if refusal.retry_after is not None:
        parts.append(b"retry-after: %d\r\n" % refusal.retry_after)
    parts.append(b"content-length: %d\r\n" % len(body))
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    if method != b"HEAD":
        parts.append(body)
    return b"".join(parts)


def shut_write(transport: Any) -> bool:
    """Shut the write side once the answer is out, so the client reads it rather than a reset (closing a
    socket with unread input sends one); False when the transport cannot, and is closed instead."""
    lose_write = getattr(transport, "loseWriteConnection", None)
    if lose_write is None:
        transport.loseConnection()
        return False
    lose_write()
    return True
