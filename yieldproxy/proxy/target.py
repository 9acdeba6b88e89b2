"""One request target, read the way Ollama's Go server reads it, or refused.

:func:`parse_target` gives one canonical form, decoded to classify (:attr:`Target.path`) and
re-encoded as Go encodes it to forward (:attr:`Target.raw`), or :class:`BadTarget` for what servers
read differently.  Why (a disguised route would pass a yield), and the rules: docs/classes.md,
"One target to classify and to forward".
"""

from __future__ import annotations

import functools
import re

import attrs

#: Bytes Go's ``shouldEscape(c, encodePath)`` leaves as they are in a path segment.
_PATH_SAFE = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~$&+,:;=@"
)
_ENCODE = [chr(b) if b in _PATH_SAFE else f"%{b:02X}" for b in range(256)]
#: A path already in canonical form: safe bytes, single slashes, no dot
#: segment, no trailing slash.  Most requests take this fast path.
_CANONICAL_PATH = re.compile(rb"(?:/(?!\.\.?(?:/|\Z))[A-Za-z0-9\-_.~$&+,:;=@]+)+|/")
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
#: Query bytes kept as they are: visible ASCII but ``#`` (checked before).
_QUERY = re.compile(rb"[\x21-\x7e]*")


class BadTarget(ValueError):
    """A request target the proxy refuses (400): its message says why."""


@attrs.frozen
class Target:
    """A request target in canonical form."""

    #: The decoded path, as Go's router sees it: what classification matches on.
    path: str
    #: The canonical target to forward: the re-encoded path and the query, if any.
    raw: bytes

    @property
    def api_path(self) -> bytes:
        """The decoded path as bytes (for :func:`yieldproxy.lot.classify.api_family`)."""
        return self.path.encode("utf-8")


def _decode(segment: bytes) -> bytes:
    return _ESCAPE.sub(lambda m: bytes((int(m.group(1), 16),)), segment)


def _encode(segment: str) -> str:
    return "".join(_ENCODE[b] for b in segment.encode("utf-8"))


@functools.lru_cache(maxsize=4096)
def parse_target(raw: bytes) -> Target:
    """The canonical form of a request target, or :class:`BadTarget` saying what is wrong.

    :param raw: the request-target exactly as it came on the request line.

    Remembered for the targets seen last (clients send the same few again and
    again; a refused one is read again each time).
    """
    if not raw.startswith(b"/"):
        raise BadTarget("request target must be a path")
    if b"#" in raw:
        raise BadTarget("request target has a '#' (a fragment is never sent to a server)")
    path, question, query = raw.partition(b"?")
    if question:
        if not _QUERY.fullmatch(query):
            raise BadTarget("query has a control character, a space or a byte outside ASCII; percent-encode it")
        if _BAD_ESCAPE.search(query):
            raise BadTarget("query has an invalid percent-escape ('%' must be followed by two hex digits)")
    if _CANONICAL_PATH.fullmatch(path):
        return Target(path.decode("ascii"), raw)
    return Target(*_canonical_path(path, question + query))


def _canonical_path(path: bytes, query: bytes) -> tuple[str, bytes]:
    """The decoded and the re-encoded path of a path that is not canonical yet."""
    if _BAD_ESCAPE.search(path):
        raise BadTarget("path has an invalid percent-escape ('%' must be followed by two hex digits)")
    segments: list[str] = []
    for raw_segment in path.split(b"/")[1:]:
        segment = _decode(raw_segment)
        if b"/" in segment:
            raise BadTarget("path has an encoded slash (%2F); servers read it differently")
        if b"\\" in segment:
            raise BadTarget("path has a backslash; servers read it differently")
        if any(b < 0x20 or b == 0x7F for b in segment):
            raise BadTarget("path has a control character (once percent-decoded)")
        try:
            text = segment.decode("utf-8")
        except UnicodeDecodeError:
            raise BadTarget("path is not valid UTF-8 (once percent-decoded)") from None
        if text in (".", ".."):
            if raw_segment != segment:
                raise BadTarget("path has a percent-encoded dot segment; servers read it differently")
            if text == "..":
                if not segments:
                    raise BadTarget("path climbs above '/' with '..'")
                segments.pop()
            continue
        if text:
            segments.append(text)
    decoded = "/" + "/".join(segments)
    encoded = "/" + "/".join(_encode(s) for s in segments)
    return decoded, encoded.encode("ascii") + query
