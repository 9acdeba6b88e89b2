"""The proxy listener's entry: Klein routes every request, a leaf resource answers it.

:meth:`ProxyApp.resource <yieldproxy.proxy.handler.ProxyApp.resource>` is
the Klein app's own resource.  Its one route returns :class:`HandlerResource`
(through :func:`routed`), which Klein renders before its own ``render``
returns, so Klein's per-request chain and closures are done with before the
handler awaits anything.  What Klein would still leave on a parked request
(its ``IKleinRequest`` adapter holding the werkzeug ``MapAdapter``, and two
``notifyFinish`` watchers) is let go once routing is over.  The handler's
outcome is handled here:

* the handler's bytes are written, and the request finished unless it is
  already (or the client went away);
* a client that goes away cancels the handler (its ``CancelledError`` is
  not logged);
* any other failure (a bug) is logged with its traceback and answered by
  ``on_error`` (the proxy's 500 in the API's JSON shape, with its request
  log line) when nothing was written yet, else Twisted's
  ``processingFailed``; once the request is over, it is only logged.
"""

from __future__ import annotations

from inspect import iscoroutine
from typing import Any, Callable

from klein.interfaces import IKleinRequest
from twisted.internet.defer import CancelledError, Deferred
from twisted.python import log
from twisted.python.components import Componentized
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET


def routed(request, entry: HandlerResource) -> HandlerResource:
    """A route's answer once Klein has matched it: ``entry``, with Klein's request adapter (and the
    ``MapAdapter`` it holds) let go, since nothing asks for it after routing."""
    if isinstance(request, Componentized):
        request.unsetComponent(IKleinRequest)
    return entry


class HandlerResource(Resource):
    """Calls ``handle(request)`` and writes its answer.

    ``handle`` returns the answer (bytes or None, the request's status and
    headers set), or a coroutine that finds it.
    """

    isLeaf = True

    def __init__(self, handle: Callable[[Any], Any], on_error: Callable[[Any], bytes] | None = None):
        super().__init__()
        self._handle = handle
        self._on_error = on_error

    def render(self, request):
        if _listeners(request):
            # Klein's finish watchers (two Deferreds and their closures per request): its routing is over,
            # and a listener's request is cancelled through ``handler``, never through notifyFinish.
            del request.notifications[:]
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
            if _listeners(request):
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


def _listeners(request) -> bool:
    """A request of the listener's own kind (edge/request.py): it cancels ``handler`` when its client goes."""
    return hasattr(type(request), "handler")


def _done(request) -> None:
    if _listeners(request):
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
