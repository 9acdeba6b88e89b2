"""
A client of the admin API, and what its callers share: errors with exit statuses, bounded calls.

Both ``yieldproxy status/yield/resume`` (tools/cli.py) and ``yieldproxy demo``
(tools/demo.py) talk to an admin API; neither should have to import the other to
do so.  Every call here is bounded by a timeout and turns "nothing answered"
into a :class:`CliError` that says why, with the exit status that goes with it.
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet import defer, error as ierror
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from ..edge.tcp import set_no_delay
from .broker import AdminError, read_answer

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_YIELDED = 4

#: Seconds each admin API call may take, unless ``--timeout`` says otherwise.
HTTP_TIMEOUT = 10.0


class CliError(Exception):
    """A message for the person at the terminal, and the exit status that goes with it."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.message = message
        self.code = code


@attrs.frozen
class AdminTarget:
    """The admin API's base URL; over a unix socket when ``unix_path`` is set."""

    url: str
    unix_path: str | None = None

    def describe(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else self.url


@implementer(IAgentEndpointFactory)
@attrs.frozen
class _UnixEndpoints:
    """Every URL goes to one unix socket: how an Agent talks to ``admin.listen unix:...``."""

    _reactor: Any
    _path: str
    _timeout: float

    def endpointForURI(self, uri):
        return UNIXClientEndpoint(self._reactor, self._path, timeout=self._timeout)


@implementer(IAgentEndpointFactory)
@attrs.frozen
class NoDelayEndpoints:
    """TCP with Nagle off: without it the demo's small requests wait for delayed ACKs."""

    _reactor: Any
    _timeout: float

    def endpointForURI(self, uri):
        endpoint = TCP4ClientEndpoint(self._reactor, uri.host.decode("ascii"), uri.port, timeout=self._timeout)
        return _NoDelay(endpoint)


@attrs.frozen
class _NoDelay:
    """A client endpoint wrapper that sets TCP_NODELAY on each new connection."""

    _wrapped: Any

    def connect(self, factory):
        def nodelay(protocol):
            set_no_delay(getattr(protocol, "transport", None))
            return protocol

        return self._wrapped.connect(factory).addCallback(nodelay)


def why_unreachable(failure_value: BaseException, timeout: float) -> str | None:
    """A short reason for a failure to get any answer, or None if it is something else."""
    if isinstance(failure_value, defer.TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(failure_value, ierror.ConnectionRefusedError):
        return "connection refused"
    if isinstance(failure_value, ierror.DNSLookupError):
        return "the host name does not resolve"
    if isinstance(failure_value, (ierror.TimeoutError, ierror.ConnectingCancelledError)):
        return "the connection attempt timed out"
    if isinstance(failure_value, ierror.ConnectError):
        detail = failure_value.osError or (failure_value.args[0] if failure_value.args else None)
        return f"cannot connect ({detail})" if detail else "cannot connect"
    if isinstance(failure_value, (ResponseNeverReceived, ResponseFailed)):
        reasons = getattr(failure_value, "reasons", []) or []
        detail = "; ".join(r.getErrorMessage() for r in reasons) or "connection closed"
        return f"the connection broke before an answer ({detail})"
    if isinstance(failure_value, (ierror.ConnectionLost, ierror.ConnectionDone, OSError)):
        return f"the connection broke ({failure_value})"
    return None


async def bounded(reactor, coroutine, timeout: float):
    """Await ``coroutine``, cancelled after ``timeout`` seconds with a :class:`defer.TimeoutError`.

    A cancelled Agent request fails with ``ResponseNeverReceived``, not
    ``CancelledError``: ``onTimeoutCancel`` turns whatever the cancel left into
    the timeout (addTimeout calls it only when its own timer fired).
    """

    def timed_out(result: object, seconds: float) -> Failure:
        return Failure(defer.TimeoutError(f"no answer within {seconds:g} s"))

    return await defer.Deferred.fromCoroutine(coroutine).addTimeout(timeout, reactor, onTimeoutCancel=timed_out)


@attrs.define(eq=False)
class AdminClient:
    """Calls to the admin API, each bounded by ``timeout`` seconds, over treq."""

    _reactor: Any
    target: AdminTarget
    _token: str | None = attrs.field(default=None, repr=False)
    timeout: float = HTTP_TIMEOUT
    _http: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        from treq.client import HTTPClient

        # Not persistent: a command makes one or two calls and leaves nothing open.
        pool = HTTPConnectionPool(self._reactor, persistent=False)
        if self.target.unix_path:
            agent = Agent.usingEndpointFactory(
                self._reactor, _UnixEndpoints(self._reactor, self.target.unix_path, self.timeout), pool=pool
            )
        else:
            agent = Agent(self._reactor, pool=pool, connectTimeout=self.timeout)
        self._http = HTTPClient(agent)

    async def status(self) -> dict:
        return await self.call("GET", "/status")

    async def hold(self, **body: Any) -> dict:
        return await self.call("POST", "/yield", {k: v for k, v in body.items() if v is not None})

    async def release(self, source: str | None = None, upstream: str | None = None) -> dict:
        body = {k: v for k, v in (("source", source), ("upstream", upstream)) if v is not None}
        return await self.call("POST", "/resume", body)

    async def reload(self) -> dict:
        """``POST /reload``: the outcome of the handover to a new process (its pid, version, what went over)."""
        return await self.call("POST", "/reload")

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        """The JSON answer of one call; :class:`CliError` with the right exit status otherwise."""
        try:
            code, raw = await bounded(self._reactor, self._exchange(method, path, body), self.timeout)
        except Exception as e:
            why = why_unreachable(e, self.timeout)
            if why is None:
                raise
            raise CliError(
                f"cannot reach the admin API at {self.target.describe()}: {why}.\n"
                "Is the proxy running (twistd -n yieldproxy)? If it listens elsewhere, "
                "say where with --admin URL (or YIELDPROXY_ADMIN, or --config FILE).",
                EXIT_UNREACHABLE,
            ) from None
        return self._decode(code, raw)

    async def _exchange(self, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
        headers = {b"accept": [b"application/json"]}
        if self._token is not None:
            headers[b"authorization"] = [b"Bearer " + self._token.encode("utf-8")]
        kwargs: dict[str, Any] = {}
        if method != "GET":
            kwargs["json"] = body or {}
        response = await self._http.request(
            method, self.target.url + path, headers=headers, allow_redirects=False,
            reactor=self._reactor, **kwargs,
        )
        return response.code, await response.content()

    def _decode(self, code: int, raw: bytes) -> dict:
        """The answer as :func:`yieldproxy.tools.broker.read_answer` reads it (the broker library's), with the CLI's hints."""
        try:
            return read_answer(code, raw, self.target.describe(), self._token is not None, keys=("state", "reloaded"))
        except AdminError as e:
            message = e.message
            if e.server_message is None:
                message += "\nIs --admin the admin listener (default port 11436), not the proxy (11435) or Ollama?"
            elif e.status == 401 and self._token is None:
                message += "\n(use --token-file FILE, YIELDPROXY_TOKEN or YIELDPROXY_TOKEN_FILE)"
            raise CliError(message, EXIT_ERROR) from None
