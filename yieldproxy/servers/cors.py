"""Which web pages a server's CORS check lets in: gin-contrib/cors's rule, as a value.

Ollama (``server/routes.go``, ``GenerateRoutes``) puts gin-contrib/cors
(v1.7.2 in Ollama v0.11.4's go.mod) in front of every route, with
``AllowWildcard`` and ``AllowBrowserExtensions`` on and ``AllowOrigins``
from ``envconfig.AllowedOrigins()`` (``OLLAMA_ORIGINS`` then its defaults).
The middleware (v1.7.2 ``config.go``: ``applyCors`` 70-99, ``validateOrigin``
125-141, ``validateWildcardOrigin`` 101-115; ``newCors`` 42-68) lets a
request pass when:

- it has no ``Origin`` (``Header.Get``: its first ``Origin`` line; an empty
  one counts as none);
- its ``Origin`` is exactly ``http://`` or ``https://`` followed by the
  request's ``Host`` (what the upstream receives: the proxy sends its own);
- the ``Origin`` is one of the allowed origins, compared after the allowed
  ones were trimmed and lower-cased (``normalize``, utils.go:67-82) but the
  ``Origin`` itself as it came (``validateOrigin``);
- or it matches a wildcard entry (one ``*``, the entry as written, not
  trimmed nor lower-cased: ``parseWildcardRules``, cors.go:143-173): ``*rest``
  matches by suffix, ``start*`` by prefix, ``start*rest`` by both
  (``validateWildcardOrigin``); an entry ``*`` alone allows every origin
  (``newCors``, config.go:47-51).

Any other ``Origin`` gets ``c.AbortWithStatus(http.StatusForbidden)``: a 403
with an empty body, before routing matters (the middleware runs on the 404
and 405 chains too).  ``cors.New`` panics on start for an entry with no
``*`` that does not start with an allowed scheme, or with two ``*``
(``Validate``, cors.go:117-141; ``getAllowedSchemas`` 89-104;
``parseWildcardRules``): :meth:`Origins.from_entries` refuses those with a
ValueError.
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
