"""The proxy listener's entry (proxy/resource.py's ``KleinEntry``) answers every request as Klein's own resource does.

A Klein app of every kind of route (a resource answered at once, bytes, a
string, a Deferred, a coroutine, an error, an error handler, a redirect, a
method it does not allow, a URL it builds) is served twice, through Klein's
``KleinResource`` and through ``KleinEntry``, each with its own instance of
the app; generated sequences of requests must get the same answers, and
each route's function must run the same times with the same arguments.
"""

from __future__ import annotations

import attrs
from hyperlink import DecodedURL, EncodedURL
from hypothesis import example, given, settings, strategies as st
from klein import Klein
from klein.interfaces import IKleinRequest
from klein.resource import KleinResource
from treq.testing import StubTreq
from twisted.internet.defer import succeed
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from werkzeug.exceptions import NotFound
from werkzeug.routing import BaseConverter

from yieldproxy.proxy.resource import KleinEntry, _RoutedRequest, asks_no_klein_request


class _Leaf(Resource):
    """Says where Klein left the request's path (prepath/postpath), and answers later or at once."""

    isLeaf = True

    def __init__(self, later: bool = False):
        super().__init__()
        self._later = later

    def render(self, request):
        text = b"leaf %r %r" % (request.prepath, request.postpath)
        if not self._later:
            return text
        request.write(text)
        request.finish()
        return NOT_DONE_YET


class _Broken(Resource):
    isLeaf = True

    def render(self, request):
        raise ValueError("a resource that fails to render")


class _Tree(Resource):
    """A resource with a child, so the route's answer is walked (``getChildForRequest``)."""

    def __init__(self):
        super().__init__()
        self.putChild(b"kid", _Leaf())

    def getChild(self, path, request):
        return _Leaf()

    def render(self, request):
        return b"tree"


class _Parts(BaseConverter):
    """A converter whose value a route can change (a list): each request must get its own."""

    def to_python(self, value):
        return value.split(",")

    def to_url(self, value):
        return ",".join(value)


@attrs.define
class _Toy:
    """One instance of an app with every kind of route; ``calls`` records each route function's run."""

    calls: list = attrs.Factory(list)
    app = Klein()
    app.url_map.converters["parts"] = _Parts

    def _ran(self, request, name: str, *args) -> None:
        self.calls.append((name, request.method, request.path, tuple(request.prepath), *args))

    @app.route("/leaf", branch=True)
    def leaf(self, request):
        self._ran(request, "leaf", tuple(IKleinRequest(request).branch_segments))
        return _Leaf(later=request.method == b"POST")

    @app.route("/tree", branch=True)
    def tree(self, request):
        self._ran(request, "tree")
        return _Tree()

    @app.route("/plain/<path:rest>")
    @asks_no_klein_request
    def plain(self, request, rest):
        self._ran(request, "plain", rest)
        return _Leaf(later=request.method == b"POST")

    @app.route("/later/tree", branch=True)
    def later_tree(self, request):
        self._ran(request, "later-tree")
        return succeed(_Tree())

    @app.route("/parts/<parts:items>")
    def parts(self, request, items):
        self._ran(request, "parts", tuple(items))
        items.append("seen")
        return repr(items)

    @app.route("/bytes")
    def some_bytes(self, request):
        self._ran(request, "bytes")
        return b"some bytes"

    @app.route("/text/<name>")
    def text(self, request, name):
        self._ran(request, "text", name)
        return f"hello {name}"

    @app.route("/deferred")
    def deferred(self, request):
        self._ran(request, "deferred")
        return succeed(b"later")

    @app.route("/coroutine")
    async def coroutine(self, request):
        self._ran(request, "coroutine")
        return b"awaited"

    @app.route("/url")
    def url(self, request):
        self._ran(request, "url")
        return IKleinRequest(request).url_for("text", {"name": "x"}, force_external=True)

    @app.route("/post-only", methods=["POST"])
    def post_only(self, request):
        self._ran(request, "post-only")
        return b"posted"

    @app.route("/dir/")
    def directory(self, request):
        self._ran(request, "dir")
        return b"a directory"

    @app.route("/missing")
    def missing(self, request):
        self._ran(request, "missing")
        raise NotFound()

    @app.route("/boom")
    def boom(self, request):
        self._ran(request, "boom")
        raise ZeroDivisionError("a bug")

    @app.route("/broken")
    def broken(self, request):
        self._ran(request, "broken")
        return _Broken()

    @app.handle_errors(NotFound)
    def not_found(self, request, failure):
        self._ran(request, "not_found")
        request.setResponseCode(404)
        return b"not here"


PATHS = (
    "/leaf", "/leaf/", "/leaf/a/b", "/leaf//a", "/leaf/%61", "/leaf/%FF", "/tree/kid", "/tree/other", "/tree",
    "/later/tree/kid", "/later/tree/x/y", "/plain/a", "/plain/a/b", "/plain/",
    "/bytes", "/bytes/", "/text/bob", "/text/%C3%A9", "/deferred", "/coroutine", "/url", "/post-only", "/dir",
    "/dir/", "/missing", "/boom", "/broken", "/nowhere", "/", "//leaf", "/leaf/../bytes", "/parts/a,b",
)
HOSTS = (b"127.0.0.1", b"example.com:8080", b"[::1]:80", b"localhost:443", b"caf\xc3\xa9.example", b"\xff.example")


def _answers(resource, requests) -> list:
    http = StubTreq(resource)
    answers = []
    for method, host, path in requests:
        # An encoded URL, decoded lazily: every treq from the floor up sends a path that is not UTF-8 (%FF) as it is.
        url = DecodedURL(EncodedURL.from_text(f"http://127.0.0.1{path}"), lazy=True)
        d = http.request(method, url, headers={b"Host": [host]}, allow_redirects=False)
        http.flush()
        [response] = _results(d)
        [body] = _results(response.content())
        headers = sorted(
            (name.lower(), tuple(values)) for name, values in response.headers.getAllRawHeaders()
            if name.lower() != b"date"
        )
        answers.append((response.code, headers, body))
    return answers


def _results(d) -> list:
    out: list = []
    d.addBoth(out.append)
    return out


@settings(max_examples=60, deadline=None)
@example([("POST", b"127.0.0.1", "/post-only"), ("GET", b"127.0.0.1", "/post-only"), ("POST", b"127.0.0.1", "/post-only")])
@example([("GET", b"127.0.0.1", "/url"), ("GET", b"example.com:8080", "/url"), ("GET", b"[::1]:80", "/url")])
@example([("GET", b"127.0.0.1", "/text/a"), ("GET", b"127.0.0.1", "/text/b"), ("GET", b"127.0.0.1", "/text/a")])
@example([("GET", b"127.0.0.1", "/leaf/a"), ("GET", b"\xff.example", "/leaf/a"), ("POST", b"127.0.0.1", "/leaf/a")])
@example([("GET", b"127.0.0.1", "/parts/a,b"), ("GET", b"127.0.0.1", "/parts/a,b")])
@example([("GET", b"127.0.0.1", "/dir"), ("GET", b"127.0.0.1", "/dir/"), ("GET", b"127.0.0.1", "/dir")])
@given(st.lists(st.tuples(st.sampled_from(("GET", "POST", "HEAD")), st.sampled_from(HOSTS), st.sampled_from(PATHS)),
                min_size=1, max_size=8))
def test_every_request_is_answered_as_klein_answers_it_and_each_route_runs_once(requests):
    klein, entry = _Toy(), _Toy()
    expected = _answers(KleinResource(klein.app), requests)
    assert _answers(KleinEntry(entry.app), requests) == expected
    assert entry.calls == klein.calls


def test_a_route_that_answers_with_a_resource_is_rendered_without_klein_s_deferreds_or_finish_watchers(monkeypatch):
    """Klein's own render asks for two ``notifyFinish`` Deferreds per request; an answer that is already
    there needs neither, nor any other Deferred."""
    import klein._resource
    from twisted.web.server import Request

    toy = _Toy()
    watchers: list = []
    deferreds: list = []
    real_notify = Request.notifyFinish
    monkeypatch.setattr(Request, "notifyFinish", lambda self: watchers.append(self) or real_notify(self))
    real_maybe = klein._resource.maybeDeferred
    monkeypatch.setattr(klein._resource, "maybeDeferred", lambda *a, **kw: deferreds.append(a) or real_maybe(*a, **kw))
    http = StubTreq(KleinEntry(toy.app))
    for path in ("/leaf/a", "/tree/kid"):
        [response] = _results(http.get(f"http://127.0.0.1{path}"))
        http.flush()
        assert response.code == 200
    assert (watchers, deferreds) == ([], [])
    [response] = _results(http.get("http://127.0.0.1/bytes"))  # not a resource: Klein's own way
    http.flush()
    assert response.code == 200 and len(watchers) == 2 and deferreds


def test_a_route_that_asks_nothing_of_klein_s_request_adapter_gets_none(monkeypatch):
    """A route marked ``asks_no_klein_request`` (the proxy's) is run with no request adapter made for it; any
    other route gets the entry's own, which binds the app's map when asked (the answers of both kinds:
    :func:`test_every_request_is_answered_as_klein_answers_it_and_each_route_runs_once`)."""
    made: list = []
    real = _RoutedRequest.__init__
    monkeypatch.setattr(_RoutedRequest, "__init__", lambda self, request, *a: made.append(request) or real(self, request, *a))
    http = StubTreq(KleinEntry(_Toy().app))
    for path in ("/plain/a", "/plain/a/b", "/leaf/a", "/url"):
        [response] = _results(http.get(f"http://127.0.0.1{path}"))
        http.flush()
        assert response.code == 200
    assert [request.path for request in made] == [b"/leaf/a", b"/url"]


def test_an_ascii_host_is_known_to_be_utf_8_without_parsing_the_host_header(monkeypatch):
    """Klein decodes the server name as UTF-8; an ASCII ``Host`` (any client's) is known to decode without
    ``getRequestHostname`` parsing it per request, and a host that is not ASCII is still asked (its answers:
    :func:`test_every_request_is_answered_as_klein_answers_it_and_each_route_runs_once`)."""
    from twisted.web.server import Request

    asked: list = []
    real = Request.getRequestHostname
    monkeypatch.setattr(Request, "getRequestHostname", lambda self: asked.append(self) or real(self))
    http = StubTreq(KleinEntry(_Toy().app))
    for host in (b"127.0.0.1", b"example.com:8080", b"caf\xc3\xa9.example"):
        [response] = _results(http.get("http://127.0.0.1/leaf/a", headers={b"Host": [host]}))
        http.flush()
        assert response.code == 200
    assert len(asked) == 1


def test_a_request_that_says_its_host_is_utf_8_is_not_asked_for_its_host(monkeypatch):
    """The listener's request says its Host is UTF-8 (``host_is_utf8``: edge/request.py refuses any other
    before the resource sees it): the entry reads no Host header of such a request; of any other, it does."""
    from twisted.web.server import Request

    asked: list = []
    real = Request.getHeader
    monkeypatch.setattr(Request, "getHeader", lambda self, name: asked.append(name) or real(self, name))
    http = StubTreq(KleinEntry(_Toy().app))
    for says in (False, True, True):
        monkeypatch.setattr(Request, "host_is_utf8", says, raising=False)
        [response] = _results(http.get("http://127.0.0.1/leaf/a", headers={b"Host": [b"127.0.0.1"]}))
        http.flush()
        assert response.code == 200
    assert asked.count(b"host") == 1


def test_a_route_added_after_requests_were_routed_takes_the_requests_it_matches():
    app = Klein()

    @app.route("/", branch=True)
    def anything(request):
        return b"any path"

    http = StubTreq(KleinEntry(app))

    def get(path: str) -> bytes:
        [response] = _results(http.get(f"http://127.0.0.1{path}"))
        http.flush()
        [body] = _results(response.content())
        return body

    assert get("/late") == b"any path"

    @app.route("/late")
    def late(request):
        return b"a late route"

    assert get("/late") == b"a late route" and get("/other") == b"any path"


def test_the_routes_kept_are_bounded_in_number_and_length():
    """Clients choose the paths: however many and however long they send, the entry keeps a bounded memo."""
    app = Klein()

    @app.route("/", branch=True)
    def anything(request):
        return _Leaf()

    entry = KleinEntry(app)
    http = StubTreq(entry)
    paths = [f"/p{i}" for i in range(KleinEntry.ROUTES_KEPT + 10)] + ["/" + "x" * 4000]
    for path in paths:
        [response] = _results(http.get(f"http://127.0.0.1{path}"))
        http.flush()
        assert response.code == 200
    kept = entry._routes
    assert 0 < len(kept) <= KleinEntry.ROUTES_KEPT
    assert max(len(path_info) for _, _, path_info in kept) <= KleinEntry.PATH_KEPT
