"""The admin API over real sockets: status, yield/resume, leases, auth, metrics."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import config_with, sleep, start_stack, wait_for

TIMEOUT = 30


JSON = {"Content-Type": "application/json"}


def call(method, url, body=None, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is not None:
        headers.update(JSON)
    data = None if body is None else json.dumps(body).encode()
    return treq.request(method, url, data=data, headers=headers, persistent=False).addTimeout(TIMEOUT, reactor)


@pytest_twisted.ensureDeferred
async def test_healthz_and_status_shape():
    stack = await start_stack(reactor)
    try:
        health = await call("GET", stack.admin_url + "/healthz")
        assert health.code == 200 and await health.text() == "ok"
        status = await (await call("GET", stack.admin_url + "/status")).json()
        assert status["state"] == "available"
        assert status["holds"] == []
        assert status["parked"] == {"interactive": 0, "batch": 0, "long": 0}
        assert status["parked_bytes"] == 0 and status["inflight"] == 0
        assert status["config"]["replay"]["concurrency"] == 4
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_yield_parks_and_resume_releases():
    stack = await start_stack(reactor)
    try:
        answer = await call(
            "POST", stack.admin_url + "/yield", {"reason": "game", "source": "broker", "expected_seconds": 30}
        )
        status = await answer.json()
        assert answer.code == 200 and status["state"] == "yielded"
        hold = status["holds"][0]
        assert hold["source"] == "broker" and hold["reason"] == "game"
        assert 29 < status["expected_remaining_seconds"] <= 30
        pending = treq.post(stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": "x"}).addTimeout(TIMEOUT, reactor)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
        status = await (await call("GET", stack.admin_url + "/status")).json()
        assert status["parked"]["batch"] == 1 and status["parked_bytes"] > 0
        # Another source's resume does not end the broker's hold.
        status = await (await call("POST", stack.admin_url + "/resume", {})).json()
        assert status["state"] == "yielded"
        status = await (await call("POST", stack.admin_url + "/resume", {"source": "broker"})).json()
        assert status["state"] in ("draining", "available")
        assert (await pending).code == 200
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_lease_runs_out_by_itself():
    stack = await start_stack(reactor)
    try:
        await call("POST", stack.admin_url + "/yield", {"for_seconds": 0.3})
        assert stack.proxy.state.yielded
        await sleep(reactor, 0.5)
        assert not stack.proxy.state.yielded
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_bad_admin_requests_get_400_with_a_reason():
    stack = await start_stack(reactor)
    try:
        for body, fragment in [
            (b"{not json", "not valid JSON"),
            (b"[1]", "JSON object"),
            (b'{"for_seconds": -1}', "for_seconds must be a positive number"),
            (b'{"expected_seconds": "soon"}', "expected_seconds must be a positive number"),
            (b'{"source": ""}', "source must not be empty"),
            (b'{"colour": "red"}', "unknown field"),
        ]:
            answer = await treq.post(stack.admin_url + "/yield", data=body, headers=JSON).addTimeout(TIMEOUT, reactor)
            assert answer.code == 400, body
            assert fragment in (await answer.json())["error"]
        assert not stack.proxy.state.yielded
        missing = await call("GET", stack.admin_url + "/nope")
        assert missing.code == 404
        wrong_method = await call("GET", stack.admin_url + "/yield")
        assert wrong_method.code == 405
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_token_guards_every_route_but_healthz():
    stack = await start_stack(reactor, token="s3cret")
    try:
        assert (await call("GET", stack.admin_url + "/healthz")).code == 200
        for method, path in [("GET", "/status"), ("GET", "/metrics"), ("POST", "/yield"), ("POST", "/resume")]:
            denied = await call(method, stack.admin_url + path, token="wrong")
            assert denied.code == 401
            assert "s3cret" not in await denied.text()
            assert (await call(method, stack.admin_url + path)).code == 401
        assert not stack.proxy.state.yielded
        allowed = await call("POST", stack.admin_url + "/yield", {}, token="s3cret")
        assert allowed.code == 200 and stack.proxy.state.yielded
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_metrics_exposition_reflects_the_state():
    stack = await start_stack(reactor, config_with(admin={"known_sources": ("game",)}))
    try:
        await call("POST", stack.admin_url + "/yield", {"source": "game", "expected_seconds": 60})
        pending = treq.post(stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": "x"}).addTimeout(TIMEOUT, reactor)
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
        answer = await call("GET", stack.admin_url + "/metrics")
        assert answer.headers.getRawHeaders("content-type")[0].startswith("text/plain")
        text = await answer.text()
        assert "yieldproxy_yield_active 1.0" in text
        assert 'yieldproxy_parked_requests{class="batch"} 1.0' in text
        assert 'yieldproxy_hold_active{source="game"} 1.0' in text
        assert 'yieldproxy_hold_expected_seconds{source="game"} 60.0' in text
        assert 'yieldproxy_yields_total{source="game"} 1.0' in text
        await call("POST", stack.admin_url + "/resume", {"source": "game"})
        await pending
        text = await (await call("GET", stack.admin_url + "/metrics")).text()
        assert "yieldproxy_yield_active 0.0" in text
        assert 'yieldproxy_replay_total{class="batch",outcome="ok"} 1.0' in text
        assert 'yieldproxy_requests_total{class="batch",code="200"} 1.0' in text
        assert "yieldproxy_yield_seconds_count 1.0" in text
    finally:
        await stack.stop()


# -- hold sources and durations are bounded (issue 10, findings 7 and 8f) --------------


@pytest_twisted.ensureDeferred
async def test_hold_sources_are_validated_bounded_and_counted_under_bounded_labels():
    stack = await start_stack(reactor, config_with(admin={"max_holds": 4}))
    try:
        for source in ("evil\nGPU available: source=api", "two words", "x" * 65, 7):
            answer = await call("POST", stack.admin_url + "/yield", {"source": source})
            assert answer.code == 400, source
            assert "source" in (await answer.json())["error"]
            answer = await call("POST", stack.admin_url + "/resume", {"source": source})
            assert answer.code == 400, source
        assert not stack.proxy.state.yielded
        # 300 yield/resume pairs, each with a source of its own: /metrics stays the same size.
        before = len(await (await call("GET", stack.admin_url + "/metrics")).content())
        for n in range(300):
            assert (await call("POST", stack.admin_url + "/yield", {"source": f"job-{n}"})).code == 200
            assert (await call("POST", stack.admin_url + "/resume", {"source": f"job-{n}"})).code == 200
        text = await (await call("GET", stack.admin_url + "/metrics")).text()
        assert len(text) < before + 500, (before, len(text))
        assert 'yieldproxy_yields_total{source="other"} 300.0' in text
        assert "job-" not in text
        # At most max_holds holds from callers at once; a renewal still works.
        for n in range(4):
            assert (await call("POST", stack.admin_url + "/yield", {"source": f"b{n}"})).code == 200
        refused = await call("POST", stack.admin_url + "/yield", {"source": "b4"})
        assert refused.code == 409 and "admin.max_holds" in (await refused.json())["error"]
        assert (await call("POST", stack.admin_url + "/yield", {"source": "b0", "for_seconds": 60})).code == 200
        assert [h.source for h in stack.proxy.state.holds] == ["b0", "b1", "b2", "b3"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_hold_durations_are_bounded_and_retry_after_stays_sane():
    stack = await start_stack(reactor)
    try:
        for body in ({"expected_seconds": 1e308}, {"for_seconds": 1e308}, {"expected_seconds": 604801}):
            answer = await call("POST", stack.admin_url + "/yield", body)
            assert answer.code == 400, body
            assert "at most 604800 seconds" in (await answer.json())["error"]
        assert not stack.proxy.state.yielded
        answer = await call("POST", stack.admin_url + "/yield", {"source": "game", "expected_seconds": 604800})
        assert answer.code == 200
        # The GPU is away for a week, longer than a batch request may wait: refused at once,
        # with a Retry-After of at most an hour (not 604800, nor 309 digits).
        refused = await treq.post(
            stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": "x"}, persistent=False
        ).addTimeout(TIMEOUT, reactor)
        assert refused.code == 503
        assert refused.headers.getRawHeaders("retry-after") == ["3600"]
        await refused.content()
    finally:
        await stack.stop()


# -- only the operator changes the yield state (issue 10, finding 4) -------------------


async def _post(url, headers, body=b'{"source": "web"}'):
    answer = await treq.post(url, data=body, headers=headers, persistent=False).addTimeout(TIMEOUT, reactor)
    return answer.code, await answer.json()


@pytest_twisted.ensureDeferred
async def test_changes_need_a_json_body_and_no_other_web_page():
    """What a web page can send without asking (text/plain, forms) or from another origin is refused."""
    stack = await start_stack(reactor)
    try:
        stack.proxy.state.hold("api", "the operator's own hold")
        host = stack.admin_url.removeprefix("http://")
        for path in ("/yield", "/resume", "/fallback/verify"):
            url = stack.admin_url + path
            for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                code, body = await _post(url, {"Content-Type": content_type})
                assert code == 415 and "application/json" in body["error"], (path, content_type)
            code, body = await _post(url, {}, b"")
            assert code == 415, path
            for headers in (
                {"Origin": "http://evil.example"},
                {"Origin": "null"},
                {"Origin": f"http://{host.replace('127.0.0.1', 'localhost')}"},  # another origin, same machine
                {"Origin": "http://127.0.0.1:1"},
                {"Sec-Fetch-Site": "cross-site"},
                {"Sec-Fetch-Site": "same-site"},  # another port of this host is another program
            ):
                code, body = await _post(url, {"Content-Type": "application/json", **headers})
                assert code == 403 and "only the operator" in body["error"], (path, headers)
        assert [(h.source, h.reason) for h in stack.proxy.state.holds] == [("api", "the operator's own hold")]
        # The status page's own origin, a browser's address bar, and programs (no Origin) are fine.
        json_type = {"Content-Type": "application/json; charset=utf-8"}
        code, _ = await _post(stack.admin_url + "/yield", {**json_type, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"})
        assert code == 200
        code, _ = await _post(stack.admin_url + "/resume", {**json_type, "Sec-Fetch-Site": "none"}, b'{"source": "api"}')
        assert code == 200
        code, _ = await _post(stack.admin_url + "/resume", json_type, b"")
        assert code == 200
        assert [h.source for h in stack.proxy.state.holds] == ["web"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_read_only_token_reads_but_cannot_change_anything():
    stack = await start_stack(reactor, token="admin-s3cret", read_token="read-s3cret")
    try:
        for path in ("/status", "/metrics", "/history"):
            assert (await call("GET", stack.admin_url + path, token="read-s3cret")).code == 200, path
            assert (await call("GET", stack.admin_url + path, token="admin-s3cret")).code == 200, path
            assert (await call("GET", stack.admin_url + path)).code == 401, path
        for path in ("/yield", "/resume", "/fallback/verify"):
            denied = await call("POST", stack.admin_url + path, {}, token="read-s3cret")
            assert denied.code == 403, path
            assert "may only read" in (await denied.json())["error"]
            assert (await call("POST", stack.admin_url + path, {}, token="wrong")).code == 401
        assert not stack.proxy.state.yielded
        assert (await call("POST", stack.admin_url + "/yield", {}, token="admin-s3cret")).code == 200
        assert stack.proxy.state.yielded
    finally:
        await stack.stop()
