"""The proxy listener's resource: the request handler called directly, Klein's router only for odd paths.

The proxy app has one route (every path goes to the same handler), so what
Klein does per request (an ``IKleinRequest`` adapter and a werkzeug
``MapAdapter`` bound to it, four Deferreds and a few closures) buys nothing
on a path it would match anyway, and it is held for as long as the request
is: during a long yield, thousands of parked requests each kept about 2 KB
of it (issue 11).  So a path already in canonical form (the one
:func:`yieldproxy.proxy.target.parse_target` takes as it is: safe bytes, single
slashes, no dot segment, no trailing slash), which Klein's branch route on
``/`` always matches, goes to the handler here, with Klein's own handling
of the outcome:

* the handler's bytes are written, and the request finished unless it is
  already (or the client went away);
* a client that goes away cancels the handler (its ``CancelledError`` is
  not logged);
* any other failure (a bug) is logged with its traceback and answered by
  ``on_error`` (the proxy's 500 in the API's JSON shape, with its request
  log line) when nothing was written yet, else Twisted's
  ``processingFailed``; once the request is over, it is only logged.

Any other path (percent-escapes, repeated slashes, dot segments...) still
goes through Klein, whose router and ``NotFound`` handler decide it as
before.
"""

from __future__ import annotations

from inspect import iscoroutine
from typing import Any, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.python import log
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from .target import _CANONICAL_PATH


class ProxyResource(Resource):
    """Calls ``handle(request)`` for a canonical path; ``routed`` renders the rest.

    ``handle`` returns the answer (bytes or None, the request's status and
    headers set), or a coroutine that finds it.
    """

    isLeaf = True

    def __init__(
        self, handle: Callable[[Any], Any], routed: Resource, on_error: Callable[[Any], bytes] | None = None
    ):
        super().__init__()
        self._handle = handle
        self._routed = routed
        self._on_error = on_error

    def render(self, request):
        path = request.path
        if not _CANONICAL_PATH.fullmatch(path):
            return self._routed.render(request)
        try:
            answer = self._handle(request)
        except Exception:
            self._failed(Failure(), request)
            return NOT_DONE_YET
        if not iscoroutine(answer):
            _write(answer, request)
            return NOT_DONE_YET
        d = Deferred.fromCoroutine(answer)
        if not d.called:
            if hasattr(type(request), "handler"):
                # Cancelled by the request if the client goes away first (ProxyRequest.connectionLost):
                # a notifyFinish Deferred per request, kept while it is parked, costs more.
                request.handler = d
            else:
                request.notifyFinish().addErrback(lambda _: d.cancel())
        d.addCallbacks(_write, self._failed, callbackArgs=(request,), errbackArgs=(request,))
        return NOT_DONE_YET

    def _failed(self, failure: Failure, request) -> None:
        _done(request)
        try:
            if _over(request):
                if not failure.check(CancelledError):
                    log.err(failure, "Unhandled Error Processing Request.")
                return
            if self._on_error is None or request.startedWriting:
                request.processingFailed(failure)
                return
            log.err(failure, "Unhandled Error Processing Request.")
            _write(self._on_error(request), request)
        except Exception:
            log.err(None, "Unhandled Error writing response")


def _over(request) -> bool:
    """Finished, or the client is gone (a listener's request says so: edge/request.py; any other has lost
    its channel then)."""
    return bool(request.finished or getattr(request, "gone", False) or request.channel is None)


def _done(request) -> None:
    if hasattr(type(request), "handler"):
        request.handler = None


def _write(result, request) -> None:
    _done(request)
    try:
        if isinstance(result, str):
            result = result.encode("utf-8")
        if isinstance(result, bytes):
            request.write(result)
        if not _over(request):
            request.finish()
    except Exception:
        log.err(None, "Unhandled Error writing response")
