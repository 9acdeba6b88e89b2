"""Control-plane calls to the upstream: health probes, ``/api/ps``, model loads and unloads.

These are the proxy's own small requests, not forwarded traffic, so they get
their own client (:class:`~yieldproxy.upstream.attempt.Upstream`, the same lean
HTTP/1.1 client as the hop) that keeps no connection for reuse: a probe
during an outage must not pick up a stale pooled connection, and the
forwarding pool's limits stay for callers.  Each call has a timeout on the
injected reactor (``Deferred.addTimeout``) and reads the whole (small) body.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator, NoReturn

import attrs
from twisted.internet.defer import CancelledError, Deferred, fail

from ..edge.h1client import Collector, H1Error
from .attempt import Upstream, describe_failure, failure_reason
from .translation import BackendError
from .verdict import Reason

#: A control call that takes longer than this is given up (unless the caller says otherwise).
DEFAULT_TIMEOUT = 10.0
#: Control answers are small (``/api/ps`` lists a few models); more than this is cut.
MAX_BODY_BYTES = 1024 * 1024
#: Sent with every control call: each goes on a connection of its own.
_HEADERS = ((b"User-Agent", b"yieldproxy"), (b"Accept", b"application/json"), (b"Connection", b"close"))
_JSON_HEADERS = (*_HEADERS, (b"Content-Type", b"application/json"))


class ControlTimeout(Exception):
    """A control-plane call got no complete answer in time."""


@attrs.frozen
class Answer:
    """The status and body of one control-plane call."""

    code: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.body)


class UpstreamControl:
    """Small JSON calls to the configured upstream, each bounded in time."""

    def __init__(self, reactor: Any, url: str, *, endpoint: Any = None):
        self._reactor = reactor
        self.url = url.rstrip("/")
        self._endpoint = endpoint
        self._upstream: Upstream | None = None

    def _get_upstream(self) -> Upstream:
        """Built on first use, so building a proxy on a Clock never touches sockets."""
        if self._upstream is None:
            self._upstream = Upstream(
                self._reactor, self.url, max_connections=0, connect_timeout=DEFAULT_TIMEOUT, endpoint=self._endpoint
            )
        return self._upstream

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = DEFAULT_TIMEOUT,
        max_body: int = MAX_BODY_BYTES,
    ) -> Deferred[Answer]:
        """``method path`` with an optional JSON ``body``; fails with :class:`ControlTimeout` after ``timeout``.

        ``max_body``: the most of the answer read (a twin verification's
        vectors are larger than a control answer).

        Other failures are the client's (:class:`~yieldproxy.edge.h1client.H1Error`).
        """
        upstream = self._get_upstream()
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode("utf-8")
        try:
            d = upstream.client.request(
                method.encode("ascii"), upstream.target(path.encode("utf-8")),
                _HEADERS if body is None else _JSON_HEADERS, data, Collector(max_body), replayable=False,
            )
        except ValueError:
            return fail()
        d.addCallback(lambda response: Answer(response.code, response.body or b""))

        def timed_out(result: object, seconds: float) -> NoReturn:
            raise ControlTimeout(f"{method} {path}: no answer from {self.url} within {seconds:g}s")

        return d.addTimeout(timeout, self._reactor, onTimeoutCancel=timed_out)


@contextlib.contextmanager
def backend_errors(url: str, passing: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """What an embedding call of the proxy's own to ``url`` raises, as a :class:`BackendError`: its timeout,
    the client's failure (by :func:`failure_reason`), anything else as ``error``.  A cancellation, a
    BackendError already and ``passing`` go through as they are."""
    passed: tuple[type[BaseException], ...] = (BackendError, CancelledError, *passing)
    try:
        yield
    except passed:
        raise
    except ControlTimeout as e:
        raise BackendError(Reason.TIMEOUT, str(e)) from None
    except H1Error as e:
        raise BackendError(failure_reason(e), describe_failure(e, url)) from None
    except Exception as e:
        raise BackendError("error", f"{url} failed: {type(e).__name__}: {e}") from None
