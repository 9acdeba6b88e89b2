"""The proxy listener's entry: Klein routes every request, a leaf resource answers it.

:class:`KleinEntry` routes as Klein's own ``KleinResource`` does, without the per-request work that
decides nothing (tests/proxy/test_klein_entry.py holds the two to the same answers; bench/klein_entry.py
measures the difference).  :class:`HandlerResource`, the leaf, runs the handler and writes its outcome.
"""

from __future__ import annotations

from types import CoroutineType
from typing import Any, Callable
from weakref import ref

from klein import Klein
from klein.interfaces import IKleinRequest
from klein.resource import KleinResource
from twisted.internet.defer import CancelledError, Deferred
from twisted.python import log
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource, getChildForRequest
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer


class KleinEntry(KleinResource):
    """A Klein app's resource that renders a route's resource as soon as the route returns it.

    Klein's render binds the app's werkzeug map to each request and sends
    even an immediate answer through a chain of Deferreds and watchers.
    Here the map's match of a request target (method, script name, path
    info: all that decides it) is kept, for up to :attr:`ROUTES_KEPT`
    targets; the map is bound for a request only when a route asks for it
    (``IKleinRequest(request).mapper``, ``url_for``); and a resource the
    route returns at once (the proxy's route always does) is rendered there
    and then, without Klein's two ``maybeDeferred`` and two ``notifyFinish``
    watchers.  Anything else (a URL that is not UTF-8, a path the map
    refuses or redirects, a route answering bytes, a Deferred or an error)
    is answered by Klein's own render, the route's answer in hand.
    """

    #: Targets whose route is kept (clients choose the paths: past this many, the memo starts again).
    ROUTES_KEPT = 256
    #: The longest path info kept (an API's paths are short; a client may send 16 KB ones).
    PATH_KEPT = 256

    def __init__(self, app: Klein):
        super().__init__(app)
        #: (method, script name, path info) -> (endpoint, its arguments, path segments its route takes, whether
        #: it may ask for Klein's request adapter).
        self._routes: dict[tuple[bytes, bytes, bytes], tuple[str, dict[str, Any], int, bool]] = {}
        #: The app's map and endpoints (Klein keeps each one object, added to in place): read per request.
        self._map, self._endpoint_table = app.url_map, app.endpoints
        #: The app's routes when the memo was started: a route added since starts it again.
        self._endpoints = len(app.endpoints)

    def render(self, request):
        app = self._app
        script_name, path_info = _paths(request)
        route = self._route(request.method, script_name, path_info)
        if route is None or not (getattr(request, "host_is_utf8", False) or _host_is_utf8(request)):
            # NotFound, MethodNotAllowed, a redirect, a URL that is not UTF-8: Klein decides again, and answers.
            return super().render(request)
        endpoint, kwargs, segments, adapter = route
        if adapter:
            request.setComponent(IKleinRequest, _RoutedRequest(request, app, script_name, path_info))
        prepath, postpath = len(request.prepath), request.postpath
        request.prepath.extend(postpath[:segments])
        request.postpath = postpath[segments:]
        try:
            answer = app.execute_endpoint(endpoint, request, **kwargs)
            if IResource.providedBy(answer):
                request.render(answer if answer.isLeaf else getChildForRequest(answer, request))
                return NOT_DONE_YET
        except Exception:
            answer = Failure()
        # Klein's own render takes it from here, from the top: routed again, the route's answer already in hand.
        del request.prepath[prepath:]
        request.postpath = postpath
        return KleinResource(_Answered(app, answer)).render(request)

    def _route(
        self, method: bytes, script_name: bytes, path_info: bytes
    ) -> tuple[str, dict[str, Any], int, bool] | None:
        """The route the app's map matches (endpoint, arguments, segments, adapter), or None: Klein's render decides.

        Without host matching, the map matches on the method and the path
        info alone (the server name and the scheme only build URLs, and a
        redirect, which raises, is never kept).
        """
        if self._map.host_matching:
            return None
        routes = self._routes
        if len(self._endpoint_table) != self._endpoints:
            routes.clear()
            self._endpoints = len(self._endpoint_table)
        key = (method, script_name, path_info)
        kept = routes.get(key)
        if kept is not None:
            return kept
        try:
            mapper = self._map.bind(
                "", script_name.decode("utf-8"), path_info=path_info.decode("utf-8"),
                default_method=method.decode("utf-8"), url_scheme="http",
            )
            rule, kwargs = mapper.match(return_rule=True)
        except Exception:
            return None
        function = self._endpoint_table[rule.endpoint]
        segments = getattr(function, "segment_count", None)
        if segments is None:  # a route function Klein did not mark: not one this knows how to run
            return None
        route = (rule.endpoint, dict(kwargs), segments, not getattr(function, "asks_no_klein_request", False))
        # The arguments go to every request of the target: kept only when none can be changed by a route
        # (and a long path is not kept).
        if len(path_info) <= self.PATH_KEPT and all(type(value) in (str, int, float) for value in kwargs.values()):
            if len(routes) >= self.ROUTES_KEPT:
                routes.clear()
            routes[key] = route
        return route


@implementer(IKleinRequest)
class _RoutedRequest:
    """Klein's request adapter, its ``mapper`` (the app's map bound to the request, as Klein's render binds it)
    made when first asked for."""

    def __init__(self, request, app: Klein, script_name: bytes, path_info: bytes):
        self.branch_segments = [""]
        self._request = ref(request)
        self._app = app
        self._paths = (script_name, path_info)
        self._mapper: Any = None

    @property
    def mapper(self) -> Any:
        if self._mapper is None:
            request = self._request()
            if request is None:
                raise RuntimeError("the request is gone")
            scheme, server_name = _server(request)
            script_name, path_info = (p.decode("utf-8") for p in self._paths)
            self._mapper = self._app.url_map.bind(
                server_name, script_name, path_info=path_info, default_method=request.method.decode("utf-8"),
                url_scheme=scheme,
            )
        return self._mapper

    @mapper.setter
    def mapper(self, mapper: Any) -> None:
        self._mapper = mapper

    def url_for(
        self, endpoint: str, values: Any = None, method: str | None = None, force_external: bool = False,
        append_unknown: bool = True,
    ) -> str:
        return self.mapper.build(endpoint, values, method, force_external, append_unknown)


class _Answered:
    """A Klein app whose route has run already: its function's answer (a value, or the Failure it raised) is
    what the route gives Klein's render, once, without running the function a second time."""

    def __init__(self, app: Klein, answer: Any):
        self._app = app
        self._answer = answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)

    def execute_endpoint(self, endpoint: str, request, *args: Any, **kwargs: Any) -> Any:
        answer, self._answer = self._answer, None
        if isinstance(answer, Failure):
            answer.raiseException()
        return answer


def _paths(request) -> tuple[bytes, bytes]:
    """The script name and the path info, as Klein's render makes them of the request's prepath and postpath."""
    script_name = b""
    if request.prepath:
        script_name = b"/".join(request.prepath)
        if not script_name.startswith(b"/"):
            script_name = b"/" + script_name
    path_info = b""
    if request.postpath:
        path_info = b"/".join(request.postpath)
        if not path_info.startswith(b"/"):
            path_info = b"/" + path_info
    return script_name, path_info


def _server(request) -> tuple[str, str]:
    """The scheme and the server name (with the port, unless it is the scheme's) as Klein's render reads them."""
    server_name = request.getRequestHostname()
    port = getattr(request.getHost(), "port", 0)
    secure = bool(request.isSecure())
    if (secure, port) not in ((True, 443), (False, 80), (False, 0), (True, 0)):
        server_name = b"%s:%d" % (server_name, port)
    return "https" if secure else "http", server_name.decode("utf-8")


def _host_is_utf8(request) -> bool:
    """Whether the server name Klein's render decodes (``getRequestHostname``) is UTF-8: it is a part of the
    ``Host`` header, so an ASCII header (any client's) says so without the header being parsed.  (A request
    that says so itself, the listener's ``host_is_utf8``, is not asked: edge/request.py refused any other.)"""
    raw = request.getHeader(b"host")
    if raw is not None and raw.isascii():
        return True
    host = request.getRequestHostname()
    return host.isascii() or _utf8(host)


def _utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def asks_no_klein_request(route: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a route function (under its ``@app.route``) that never asks for Klein's request adapter
    (``IKleinRequest``): :class:`KleinEntry` makes none for its requests, so a parked one holds nothing
    of Klein, and none is made and let go per request."""
    route.asks_no_klein_request = True  # type: ignore[attr-defined]
    return route


class HandlerResource(Resource):
    """Calls ``handle(request)`` and writes its answer.

    ``handle`` returns the answer (bytes or None, the request's status and
    headers set), or a coroutine that finds it.  The answer is written and
    the request finished unless it is already (or the client went away); a
    client that goes away cancels the handler (its ``CancelledError`` is not
    logged); any other failure (a bug) is logged with its traceback and
    answered by ``on_error`` (the proxy's 500 in the API's JSON shape) when
    nothing was written yet, else by Twisted's ``processingFailed``; once
    the request is over, it is only logged.
    """

    isLeaf = True

    def __init__(self, handle: Callable[[Any], Any], on_error: Callable[[Any], bytes] | None = None):
        super().__init__()
        self._handle = handle
        self._on_error = on_error

    def render(self, request):
        listens = hasattr(type(request), "handler")  # _listeners(request), inline: asked of every request
        if listens:
            # Klein's finish watchers (two Deferreds and their closures per request): its routing is over,
            # and a listener's request is cancelled through ``handler``, never through notifyFinish.
            del request.notifications[:]
        try:
            answer = self._handle(request)
        except Exception:
            self._failed(Failure(), request)
            return NOT_DONE_YET
        if not isinstance(answer, CoroutineType):
            _write(answer, request)
            return NOT_DONE_YET
        d = Deferred.fromCoroutine(answer)
        if not d.called:
            if listens:
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
    if hasattr(type(request), "handler"):  # _done(request), inline: every request's answer comes here
        request.handler = None
    try:
        if isinstance(result, str):
            result = result.encode("utf-8")
        if isinstance(result, bytes):
            request.write(result)
        if not _over(request):
            request.finish()
    except Exception:
        log.err(None, "Unhandled Error writing response")
