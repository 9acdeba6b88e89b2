"""One request target, read the way Ollama's Go server reads it, or refused.

The proxy decides a request's class from its path and forwards its target;
both must be the *same* path, and the one Ollama will route on.  Ollama runs
on Go's ``net/http`` behind ``http.DefaultServeMux`` and gin: Go decodes
percent-escapes in the path (gin routes on the decoded ``URL.Path``,
``UseRawPath`` being false), keeps a ``#`` as part of the path, and the mux
redirects a path with dot segments or repeated slashes to its cleaned form.
A proxy that classified the raw path and forwarded it unchanged let
``POST /api/%65mbed`` and ``POST /api/embed#x`` past a yield as "passthrough"
while Ollama ran the model.

So :func:`parse_target` turns a raw request target into one canonical form,
used both to classify (:attr:`Target.path`, decoded) and to forward
(:attr:`Target.raw`, re-encoded), or refuses it with a reason the caller
reads in a 400:

- a ``#`` anywhere: a fragment is never sent by a client, and servers differ
  on it (Twisted's client drops it, Go keeps it in the path);
- an invalid percent-escape (Go refuses those with a 400 too);
- what servers read differently once decoded: an encoded slash (``%2F``), a
  backslash (raw or encoded), NUL and other control characters, bytes that
  are not UTF-8, and a dot segment written with escapes (``%2e%2e``: RFC 3986
  reads it as ``..``, Go's mux does not);
- a ``..`` that would climb above ``/`` (it would otherwise climb out of the
  upstream URL's path prefix).

What it changes, and why each is safe:

- dot segments are removed and repeated slashes collapsed, as Go's mux
  would redirect the client to that very path;
- a trailing slash is removed (``/api/embed/`` is ``/api/embed``): gin
  answers the slashed form of each of its routes with a redirect to the bare
  one (``RedirectTrailingSlash``, 307 for a POST), so a client that follows
  it ends there anyway; classifying ``/api/embed/`` as anything but
  ``/api/embed`` would be the mistake this module exists to prevent;
- the path is re-encoded the way Go's ``URL.EscapedPath`` encodes a decoded
  path (letters, digits, ``-._~`` and ``$&+,:;=@`` as they are, every other
  byte as ``%XX``), so Go decodes exactly :attr:`Target.path` from it;
- the query is kept byte for byte after the ``?``, once checked (ASCII
  without controls, valid percent-escapes).
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
