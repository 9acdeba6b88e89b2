"""Which web pages a server's CORS check lets in: gin-contrib/cors's rule, as a value.

Ollama puts gin-contrib/cors (v1.7.2 in v0.11.4's go.mod) in front of every
route, with ``AllowWildcard`` and ``AllowBrowserExtensions`` on and
``AllowOrigins`` from ``envconfig.AllowedOrigins()``.  A request passes when
it has no ``Origin`` (an empty one counts as none); when its ``Origin`` is
``http://`` or ``https://`` and the request's own ``Host``; when it is one
of the allowed origins (those trimmed and lower-cased, the ``Origin`` as it
came: ``validateOrigin``, config.go:125-141); or when it matches a wildcard
entry as written (``*rest`` by suffix, ``start*`` by prefix, both for
``start*rest``; ``*`` alone allows all: ``validateWildcardOrigin``,
config.go:101-115).  Any other ``Origin`` gets a bare 403, on the 404 and 405
chains too.  ``cors.New`` panics on an entry with no ``*`` and no allowed
scheme, or with two ``*`` (cors.go:117-141): :meth:`Origins.from_entries`
refuses those with a ValueError.  docs/security.md says what a web page gets.
"""

from __future__ import annotations

from typing import Iterable

import attrs

#: Schemes an entry without ``*`` may start with (``DefaultSchemas`` and, with
#: ``AllowBrowserExtensions``, ``ExtensionSchemas``: gin-contrib/cors v1.7.2 config.go:22-33).
ENTRY_SCHEMES = (
    "http://", "https://",
    "chrome-extension://", "safari-extension://", "moz-extension://", "ms-browser-extension://",
)


@attrs.frozen
class Origins:
    """The origins a gin-contrib/cors check (with ``AllowWildcard``) lets in."""

    #: Entries without ``*``, trimmed and lower-cased.
    exact: frozenset[str] = frozenset()
    #: ``(start, rest)`` of each entry with one ``*``, as written.
    wildcards: tuple[tuple[str, str], ...] = ()
    #: An entry ``*``: every origin.
    every: bool = False

    @classmethod
    def from_entries(cls, entries: Iterable[str]) -> "Origins":
        """The check for ``AllowOrigins = entries``; ValueError naming an entry cors.New would refuse."""
        exact: set[str] = set()
        wildcards: list[tuple[str, str]] = []
        every = False
        for entry in entries:
            stars = entry.count("*")
            if entry == "*":
                every = True
            if stars == 0:
                if not entry.startswith(ENTRY_SCHEMES):
                    raise ValueError(
                        f"{entry!r}: an origin must contain '*' or start with one of {', '.join(ENTRY_SCHEMES)}"
                    )
                exact.add(entry.strip().lower())
                continue
            if stars > 1:
                raise ValueError(f"{entry!r}: only one '*' is allowed in an origin")
            start, _, rest = entry.partition("*")
            wildcards.append((start, rest))
        return cls(frozenset(exact), tuple(wildcards), every)

    def allows(self, origin: str) -> bool:
        """Whether ``origin`` is one of these (``validateOrigin``; the same-host case is :func:`refuses`')."""
        if self.every or origin in self.exact:
            return True
        for start, rest in self.wildcards:
            if start == "" and origin.endswith(rest):
                return True
            if rest == "" and origin.startswith(start):
                return True
            if origin.startswith(start) and origin.endswith(rest):
                return True
        return False

    def refuses(self, origin: str | None, hosts: Iterable[str]) -> bool:
        """True when the check answers 403: an ``Origin`` that is neither the request's own host nor allowed.

        ``hosts``: the ``Host`` values the upstream may receive for this
        request (one per upstream in a pool; the proxy sends its own).
        """
        if not origin:
            return False
        for host in hosts:
            if origin == "http://" + host or origin == "https://" + host:
                return False
        return not self.allows(origin)
