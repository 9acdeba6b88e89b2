"""Who is asking: the ``Host`` a request names, and the web page (``Origin``) it comes from.

A browser lets any web page send requests to ``127.0.0.1``: :class:`HostPolicy`
defeats DNS rebinding (Ollama's ``allowedHostsMiddleware`` does it there, but the
proxy replaces ``Host`` towards the upstream), and :func:`cross_site` tells a
cross-site write.  Neither header can be forged by a web page; a program that
is not a browser can send anything, which is what the admin token is for.  The
rules: docs/security.md (*Host names*, *Web pages*).
"""

from __future__ import annotations

import functools
import socket
from ipaddress import ip_address
from typing import TYPE_CHECKING, Iterable

import attrs

if TYPE_CHECKING:
    from twisted.web.http_headers import Headers

#: Names under these suffixes never resolve through public DNS, so a web page cannot rebind them
#: (not ``.local``, which any machine on the LAN may answer by mDNS: docs/security.md, *Host names*).
LOCAL_SUFFIXES = (".localhost", ".internal")


def host_name(header: str) -> str:
    """The name in a ``Host`` header: no port, no brackets, lower case, no trailing dot."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        value = value[1:end] if end > 0 else value[1:]
    elif value.count(":") == 1:
        value = value.rsplit(":", 1)[0]
    return value.rstrip(".")


def _is_local_ip(name: str, own_address: str | None) -> bool | None:
    """For an IP literal: is it one of ours or a private address?  None for a name."""
    local = _is_private_ip(name)
    if local is None:
        return None
    if own_address is not None and name == own_address.lower():
        return True
    return local


@functools.lru_cache(maxsize=1024)
def _is_private_ip(name: str) -> bool | None:
    """For an IP literal: loopback, private, link-local or unspecified?  None for a name.

    Cached: parsing an address costs microseconds, and a listener sees the same few ``Host`` values.
    """
    try:
        address = ip_address(name)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return address.is_loopback or address.is_private or address.is_link_local or address.is_unspecified


@attrs.frozen
class HostPolicy:
    """Which ``Host`` values a listener answers to (docs/security.md, *Host names*): its own names, and
    ``allowed`` (the ``allowed_hosts`` key)."""

    #: The config key that extends the policy, named in refusals.
    key: str
    allowed: tuple[str, ...] = ()
    #: This machine's host name (lower case), read once.
    hostname: str = attrs.field(factory=lambda: socket.gethostname().lower().rstrip("."))

    @classmethod
    def from_config(cls, key: str, allowed: Iterable[str]) -> "HostPolicy":
        return cls(key, tuple(entry.lower().rstrip(".") for entry in allowed))

    def allows(self, header: str | None, own_address: str | None = None) -> bool:
        """May a request naming ``header`` (its raw ``Host``) be answered?

        ``own_address`` is the listener's address the connection came in on.
        """
        if header is None or "*" in self.allowed:
            return True
        name = host_name(header)
        if not name:
            return True
        local = _is_local_ip(name, own_address)
        if local is not None:
            return local or name in self.allowed
        if name == "localhost" or name.endswith(LOCAL_SUFFIXES):
            return True
        if name == self.hostname or name == self.hostname.split(".")[0]:
            return True
        for entry in self.allowed:
            if name == entry or (entry.startswith("*.") and name.endswith(entry[1:])):
                return True
        return False


def _authority(origin: str) -> str | None:
    """``host[:port]`` of an ``Origin`` (default ports dropped), or None for ``null`` or garbage."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        return None
    return _without_default_port(rest, scheme)


def _without_default_port(authority: str, scheme: str = "http") -> str:
    default = ":443" if scheme == "https" else ":80"
    return authority[: -len(default)] if authority.endswith(default) else authority


def cross_site(headers: Headers) -> str | None:
    """Why a request comes from another web site, or None when it does not (or is no browser's).

    Only ``Sec-Fetch-Site`` ``same-origin`` and ``none`` (typed by the user) pass: ``same-site`` includes
    another port of the same host, which is another program.  ``Origin`` must name ``Host``'s host and port.
    """
    for value in headers.getRawHeaders(b"sec-fetch-site") or []:
        site = value.decode("latin-1").strip().lower()
        if site not in ("same-origin", "none"):
            return f"the request comes from another site (Sec-Fetch-Site: {site})"
    origins = headers.getRawHeaders(b"origin") or []
    if not origins:
        return None
    hosts = headers.getRawHeaders(b"host") or []
    host = _without_default_port(hosts[0].decode("latin-1").strip().lower()) if len(hosts) == 1 else None
    for value in origins:
        origin = value.decode("latin-1")
        authority = _authority(origin)
        if authority is None or host is None or authority != host:
            return f"the request comes from another web page (Origin: {origin.strip()[:100]})"
    return None
