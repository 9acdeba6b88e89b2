"""A listener's request: a twisted.web ``Request`` that is answered here when it must never reach the app.

The connection (connection.py) hands it over whole, and its resource (the
proxy's Klein app, the admin API's) renders it, unless :meth:`ProxyRequest._refusal`
answers it first: what is refused, with each answer: docs/architecture.md
(*The HTTP edge*) and docs/security.md (*What the listeners refuse*).  Form
bodies are never parsed (a proxy forwards bodies as they are).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.internet.address import UNIXAddress
from twisted.web.http import parse_qs
from twisted.web.server import Request

from .refusal import Refusal

#: Retry-After, in seconds, of the 503 for a body refused because the receiving budget is used up.
RECEIVING_RETRY_AFTER = 5


def receiving_full_message(connections: Any) -> str:
    """What a client whose body was refused for the receiving budget is told."""
    limit = connections.max_receiving_bytes if connections is not None else None
    return (
        f"too many request bodies are being received at once (proxy.max_receiving_bytes = {limit}); "
        "try again shortly"
    )


class ProxyRequest(Request):
    """A request read whole by its connection, or refused here (see the module docstring)."""

    #: Its connection (edge/connection.py's ServerConnection), until the answer is done or the client gone.
    channel: Any
    #: The body, whole (a BytesIO the connection sets; the app reads it once and drops it).
    content: Any
    #: Set once the body passed the listener's body limit: it was not read, and the app never sees it.
    too_large = False
    #: Set once the body was refused because the listener's receiving budget is used up (a 503).
    receiving_full = False
    #: The handler's Deferred while it runs (proxy/resource.py), cancelled if the client goes away:
    #: what a ``notifyFinish`` errback did, without a Deferred more per request.
    handler = None
    #: Set when the client went away before the answer was done (the resource reads it).
    gone = False
    #: Its Host header is UTF-8 once the site's resource sees it: :meth:`process` answers any other
    #: itself (:meth:`_refusal`), so the proxy's Klein entry need not read the header again.
    host_is_utf8 = True

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        """The request is whole (its connection set ``content``): on to :meth:`process`, no form parsing."""
        self.method, self.uri, self.clientproto = command, path, version
        target, sep, query = path.partition(b"?")
        self.path = target
        self.args = parse_qs(query, 1) if sep else {}
        self.process()

    def connectionLost(self, reason: Any) -> None:
        self.gone = True
        super().connectionLost(reason)
        handler, self.handler = self.handler, None
        if handler is not None:
            handler.cancel()

    def process(self) -> None:
        """Hand the request to the site's resource, unless it is answered here (see :meth:`_refusal`)."""
        channel = self.channel
        site = channel.site
        refusal = self._refusal()
        if refusal is not None:
            if site.on_refused is not None:
                site.on_refused(self, refusal.status, refusal.code)
            channel.refuse_request(self, refusal)
            return
        if self.too_large:
            answer = site.oversized
        elif self.receiving_full:
            answer = site.receiving_full
        else:
            super().process()
            return
        body = answer(self)
        self.setHeader(b"content-length", b"%d" % len(body))
        self.write(body)
        self.finish()

    def _refusal(self) -> Refusal | None:
        """Why this request is answered here without reaching the app, if it is.

        Klein needs the Host header and the (percent-decoded) path in UTF-8,
        and logs a traceback for each request where they are not: a client
        could fill the log with them.  RFC 9112 (3.2) wants 400 for an invalid
        Host anyway; the proxy itself never uses it.
        """
        channel = self.channel
        site = channel.site
        if self.method == b"CONNECT":
            # A reverse proxy for one upstream opens no tunnels, whatever the target.
            return Refusal(405, "CONNECT is not served here: this is a reverse proxy for one upstream", "bad_request")
        if self.too_large and site.oversized is None:
            return Refusal(413, f"request body larger than {site.max_body_bytes} bytes", "too_large")
        if self.receiving_full and site.receiving_full is None:
            return Refusal(
                503, receiving_full_message(channel.connections), "receiving_full", retry_after=RECEIVING_RETRY_AFTER
            )
        hosts = self.requestHeaders.getRawHeaders(b"host", [])
        # The Host this connection's last request passed the checks below with:
        # a keep-alive client sends the same one every time.
        known = len(hosts) == 1 and hosts[0] == channel.host_passed
        if not known:
            for host in hosts:
                try:
                    host.decode("utf-8")
                except UnicodeDecodeError:
                    return Refusal(400, "the Host header is not valid UTF-8", "bad_request")
            if len(hosts) > 1:
                # RFC 9112 3.2: more than one Host is a 400.
                return Refusal(400, "more than one Host header", "bad_request")
        path = self.path
        if b"%" in path or not path.isascii():
            try:
                unquote_to_bytes(path).decode("utf-8")
            except UnicodeDecodeError:
                return Refusal(400, "the request path is not valid UTF-8 (once percent-decoded)", "bad_request")
        if known:
            return None
        policy = site.host_policy
        # A target that is not a path (absolute-form) goes nowhere whatever its Host:
        # the app refuses it with its own 400.  A unix socket is out of any web page's reach.
        if policy is not None and self.uri[:1] in (b"/", b"*"):
            local = self.getHost()
            if not isinstance(local, UNIXAddress):
                named = hosts[0].decode("utf-8") if hosts else None
                if named is not None and not policy.allows(named, getattr(local, "host", None)):
                    return Refusal(
                        403,
                        f"Host {named[:100]!r} is not a name of this listener (a web page using DNS "
                        f"rebinding?); if it is yours, add it to {policy.key}",
                        "forbidden_host",
                    )
            if len(hosts) == 1:
                channel.host_passed = hosts[0]
        return None
