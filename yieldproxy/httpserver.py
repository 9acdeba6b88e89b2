"""The proxy listener's HTTP server pieces: bounded bodies, TCP_NODELAY, no access log.

Everything about how bytes from a client become a request lives here, apart
from what the proxy does with the request (proxy.py).
"""

from __future__ import annotations

import io

from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site


class ProxyRequest(Request):
    """A request whose body is held in memory up to a limit, and discarded past it.

    Twisted's own Request spools bodies over 100 KB to a temporary file and
    accepts any size; a parked request must stay in memory (it is counted in
    ``parking.max_parked_bytes``) and an oversized one must not fill the disk.
    """

    max_body_bytes = 32 * 1024 * 1024
    too_large = False

    def gotLength(self, length):
        self.content = io.BytesIO()
        if length is not None and length > self.max_body_bytes:
            self.too_large = True

    def handleContentChunk(self, data):
        if self.too_large:
            return
        if self.content.tell() + len(data) > self.max_body_bytes:
            self.too_large = True
            self.content = io.BytesIO()
            return
        self.content.write(data)


class _NoDelayChannel(HTTPChannel):
    """An HTTP/1.1 channel with Nagle's algorithm off: small answers go out at once."""

    def connectionMade(self):
        super().connectionMade()
        set_nodelay = getattr(self.transport, "setTcpNoDelay", None)
        if set_nodelay is not None:
            try:
                set_nodelay(True)
            except OSError:
                pass


class ProxySite(Site):
    """A Site with bodies in memory, TCP_NODELAY, and no per-request access log."""

    displayTracebacks = False
    protocol = _NoDelayChannel

    def __init__(self, resource, max_body_bytes: int, **kwargs):
        request_class = type("BoundedProxyRequest", (ProxyRequest,), {"max_body_bytes": max_body_bytes})
        super().__init__(resource, requestFactory=request_class, **kwargs)

    def log(self, request):
        """The request log is ours (one line with class and outcome), not Twisted's."""
