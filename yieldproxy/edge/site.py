"""A listener's site: the factory of its connections, with the limits and timeouts they apply.

Both listeners serve a :class:`ProxySite`: a :class:`twisted.web.server.Site`
whose ``buildProtocol`` makes this package's own
:class:`~yieldproxy.edge.connection.ServerConnection`, or, past the connection
cap, an :class:`~yieldproxy.edge.capacity.OverCapacity` that answers 503.  It
carries the bounds its connections enforce, so that a hostile or broken client
cannot make the proxy buffer or wait without bound; what is refused, with which
answer and why: docs/security.md (*What the listeners refuse*, *Limits*).
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.web.server import Request, Site

from .capacity import MAX_HEADER_BYTES, Connections, OverCapacity
from .connection import LINGER_SECONDS, ServerConnection
from .reader import Limits
from .refusal import ErrorBody, plain_error_body
from .request import ProxyRequest

#: Seconds to deliver a whole request (proxy.request_read_timeout_seconds).
DEFAULT_REQUEST_READ_TIMEOUT = 30.0
#: Header lines per request (Twisted allows 500; no Ollama client sends 30).
MAX_HEADERS = 100


class ProxySite(Site):
    """A Site serving :class:`ServerConnection`\\ s with bounded requests, TCP_NODELAY, and no access log.

    ``oversized(request)`` sets the status and headers of a body over the limit and returns the body (the proxy
    app's 413, counted in its metrics); ``timeout`` (Twisted's) is the keep-alive timeout.
    """

    displayTracebacks = False
    #: Twisted's "Starting factory <... object at 0x...>" on every start and stop says nothing an operator can use
    #: (the listener says where it listens).
    noisy = False
    linger_seconds = LINGER_SECONDS
    reader_limits = Limits(max_head_bytes=MAX_HEADER_BYTES, max_line_bytes=MAX_HEADER_BYTES, max_headers=MAX_HEADERS)

    def __init__(
        self,
        resource,
        max_body_bytes: int,
        request_read_timeout: float | None = DEFAULT_REQUEST_READ_TIMEOUT,
        oversized: Callable[[Request], bytes] | None = None,
        receiving_full: Callable[[Request], bytes] | None = None,
        stall_timeout: float | None = None,
        connections: Connections | None = None,
        host_policy: Any = None,
        read_from_accept: bool = False,
        error_body: ErrorBody = plain_error_body,
        on_refused: Callable[[Request, int, str], None] | None = None,
        **kwargs,
    ):
        super().__init__(resource, requestFactory=ProxyRequest, **kwargs)
        #: The body of an answer the edge writes itself: ``error_body(path, status, message, code)``.
        self.error_body = error_body
        #: Told of each request answered here without reaching the app (None: nobody).
        self.on_refused = on_refused
        #: The largest body read (a larger one is answered by ``oversized`` unread).
        self.max_body_bytes = max_body_bytes
        #: Seconds a client has to deliver a whole request (None: no limit).
        self.request_read_timeout = request_read_timeout
        #: Seconds a client may read nothing of its answer (None: the keep-alive timeout).
        self.stall_timeout = stall_timeout
        self.connections = connections
        #: Which ``Host`` values it answers (a :class:`~yieldproxy.edge.hosts.HostPolicy`; None: any).
        self.host_policy = host_policy
        #: The first request's read timeout counts from the accept, not from its first byte.
        self.read_from_accept = read_from_accept
        #: Answers a request whose body passed the limit (None: a plain 413 here).
        self.oversized = oversized
        #: Answers a request whose body found the receiving budget used up (None: a plain 503 here).
        self.receiving_full = receiving_full

    def buildProtocol(self, addr):
        """A connection, unless the listener is full: then make room, or refuse (see :class:`Connections`)."""
        connections = self.connections
        if connections is not None and (
            connections.peer_full(addr) or (connections.full() and not connections.reclaim_idle())
        ):
            # Even past MAX_REFUSING (the rest of an accept loop under way): the ports are paused by now.
            promote = self.connection_for if connections.quick_seconds else None
            return OverCapacity(connections, self.reactor, promote, self.error_body, self.reader_limits)
        return self.connection_for(addr)

    def connection_for(self, addr: Any = None) -> ServerConnection:
        """A connection, whatever the cap: for one accepted already (let in past the cap, or handed over by a
        reload: lifecycle/succession/)."""
        return ServerConnection(self)

    def log(self, request):
        """The request log is ours (one line with class and outcome), not Twisted's."""
