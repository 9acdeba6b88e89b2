"""The admin API on a Clock: status, yield/resume, leases, auth, metrics.

The admin and proxy apps run under ``StubTreq`` (``tests/inmemory.py``), the
simulated Ollama's resource behind them: a lease runs out when the test moves
the clock past it, not after a sleep.  The admin listener's own limits (body
size, read time, Host) are about the wire and live in ``test_hostile.py`` and
``test_edge.py``.
"""

from __future__ import annotations

from helpers import config_with
from inmemory import Rig, answered


def call(rig: Rig, method: str, path: str, body=None, token=None):
    """One admin call, answered at once."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return rig.call(method, rig.admin_url + path, json=body, headers=headers)


def embed(rig: Rig, text: str = "x"):
    return rig.post("/api/embed", {"model": "all-minilm", "input": text})


def test_healthz_and_status_shape():
    rig = Rig()
    health = call(rig, "GET", "/healthz")
    assert health.code == 200 and health.text() == "ok"
    status = call(rig, "GET", "/status").json()
    assert status["state"] == "available"
    assert status["holds"] == []
    assert status["parked"] == {"interactive": 0, "batch": 0, "long": 0}
    assert status["parked_bytes"] == 0 and status["inflight"] == 0
    assert status["config"]["replay"]["concurrency"] == 4


def test_yield_parks_and_resume_releases():
    rig = Rig()
    answer = call(rig, "POST", "/yield", {"reason": "game", "source": "broker", "expected_seconds": 30})
    status = answer.json()
    assert answer.code == 200 and status["state"] == "yielded"
    hold = status["holds"][0]
    assert hold["source"] == "broker" and hold["reason"] == "game"
    assert status["expected_remaining_seconds"] == 30
    rig.run(1)
    pending = embed(rig)
    assert len(rig.proxy.lot) == 1
    status = call(rig, "GET", "/status").json()
    assert status["parked"]["batch"] == 1 and status["parked_bytes"] > 0
    assert status["expected_remaining_seconds"] == 29
    # Another source's resume does not end the broker's hold.
    status = call(rig, "POST", "/resume", {}).json()
    assert status["state"] == "yielded"
    assert not answered(pending)
    status = call(rig, "POST", "/resume", {"source": "broker"}).json()
    assert status["state"] in ("draining", "available")
    rig.turn()
    assert rig.result(pending).code == 200
    assert rig.clock.getDelayedCalls() == []


def test_lease_runs_out_by_itself():
    rig = Rig()
    call(rig, "POST", "/yield", {"for_seconds": 0.3})
    assert rig.proxy.state.yielded
    rig.run(0.299)
    assert rig.proxy.state.yielded
    rig.run(0.001)
    assert not rig.proxy.state.yielded
    assert rig.clock.getDelayedCalls() == []


def test_bad_admin_requests_get_400_with_a_reason():
    rig = Rig()
    for body, fragment in [
        (b"{not json", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b'{"for_seconds": -1}', "for_seconds must be a positive number"),
        (b'{"expected_seconds": "soon"}', "expected_seconds must be a positive number"),
        (b'{"source": ""}', "source must not be empty"),
        (b'{"colour": "red"}', "unknown field"),
    ]:
        answer = rig.call(
            "POST", rig.admin_url + "/yield", data=body, headers={"Content-Type": "application/json"}
        )
        assert answer.code == 400, body
        assert fragment in answer.json()["error"]
    assert not rig.proxy.state.yielded
    missing = call(rig, "GET", "/nope")
    assert missing.code == 404
    wrong_method = call(rig, "GET", "/yield")
    assert wrong_method.code == 405


def test_token_guards_every_route_but_healthz():
    rig = Rig(token="s3cret")
    assert call(rig, "GET", "/healthz").code == 200
    for method, path in [("GET", "/status"), ("GET", "/metrics"), ("POST", "/yield"), ("POST", "/resume")]:
        denied = call(rig, method, path, token="wrong")
        assert denied.code == 401
        assert "s3cret" not in denied.text()
        assert call(rig, method, path).code == 401
    assert not rig.proxy.state.yielded
    allowed = call(rig, "POST", "/yield", {}, token="s3cret")
    assert allowed.code == 200 and rig.proxy.state.yielded


def test_metrics_exposition_reflects_the_state():
    rig = Rig(config_with(admin={"known_sources": ("game",)}))
    call(rig, "POST", "/yield", {"source": "game", "expected_seconds": 60})
    pending = embed(rig)
    assert len(rig.proxy.lot) == 1
    answer = call(rig, "GET", "/metrics")
    assert answer.header("content-type")[0].startswith("text/plain")
    text = answer.text()
    assert "yieldproxy_yield_active 1.0" in text
    assert 'yieldproxy_parked_requests{class="batch"} 1.0' in text
    assert 'yieldproxy_hold_active{source="game"} 1.0' in text
    assert 'yieldproxy_hold_expected_seconds{source="game"} 60.0' in text
    assert 'yieldproxy_yields_total{source="game"} 1.0' in text
    call(rig, "POST", "/resume", {"source": "game"})
    assert rig.result(pending).code == 200
    text = call(rig, "GET", "/metrics").text()
    assert "yieldproxy_yield_active 0.0" in text
    assert 'yieldproxy_replay_total{class="batch",outcome="ok"} 1.0' in text
    assert 'yieldproxy_requests_total{class="batch",code="200"} 1.0' in text
    assert "yieldproxy_yield_seconds_count 1.0" in text


# -- hold sources and durations are bounded (issue 10, findings 7 and 8f) --------------


def test_hold_sources_are_validated_bounded_and_counted_under_bounded_labels():
    rig = Rig(config_with(admin={"max_holds": 4}))
    for source in ("evil\nGPU available: source=api", "two words", "x" * 65, 7):
        answer = call(rig, "POST", "/yield", {"source": source})
        assert answer.code == 400, source
        assert "source" in answer.json()["error"]
        answer = call(rig, "POST", "/resume", {"source": source})
        assert answer.code == 400, source
    assert not rig.proxy.state.yielded
    # 300 yield/resume pairs, each with a source of its own: /metrics stays the same size.
    before = len(call(rig, "GET", "/metrics").body)
    for n in range(300):
        assert call(rig, "POST", "/yield", {"source": f"job-{n}"}).code == 200
        assert call(rig, "POST", "/resume", {"source": f"job-{n}"}).code == 200
    text = call(rig, "GET", "/metrics").text()
    assert len(text) < before + 500, (before, len(text))
    assert 'yieldproxy_yields_total{source="other"} 300.0' in text
    assert "job-" not in text
    # At most max_holds holds from callers at once; a renewal still works.
    for n in range(4):
        assert call(rig, "POST", "/yield", {"source": f"b{n}"}).code == 200
    refused = call(rig, "POST", "/yield", {"source": "b4"})
    assert refused.code == 409 and "admin.max_holds" in refused.json()["error"]
    assert call(rig, "POST", "/yield", {"source": "b0", "for_seconds": 60}).code == 200
    assert [h.source for h in rig.proxy.state.holds] == ["b0", "b1", "b2", "b3"]


def test_hold_durations_are_bounded_and_retry_after_stays_sane():
    rig = Rig()
    for body in ({"expected_seconds": 1e308}, {"for_seconds": 1e308}, {"expected_seconds": 604801}):
        answer = call(rig, "POST", "/yield", body)
        assert answer.code == 400, body
        assert "at most 604800 seconds" in answer.json()["error"]
    assert not rig.proxy.state.yielded
    answer = call(rig, "POST", "/yield", {"source": "game", "expected_seconds": 604800})
    assert answer.code == 200
    # The GPU is away for a week, longer than a batch request may wait: refused at once,
    # with a Retry-After of at most an hour (not 604800, nor 309 digits).
    refused = rig.result(embed(rig))
    assert refused.code == 503
    assert refused.header("retry-after") == ["3600"]


# -- only the operator changes the yield state (issue 10, finding 4) -------------------


def _post(rig: Rig, path: str, headers, body=b'{"source": "web"}'):
    answer = rig.call("POST", rig.admin_url + path, data=body, headers=headers)
    return answer.code, answer.json()


def test_changes_need_a_json_body_and_no_other_web_page():
    """What a web page can send without asking (text/plain, forms) or from another origin is refused."""
    rig = Rig()
    rig.proxy.state.hold("api", "the operator's own hold")
    host = rig.admin_url.removeprefix("http://")
    for path in ("/yield", "/resume", "/fallback/verify"):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            code, body = _post(rig, path, {"Content-Type": content_type})
            assert code == 415 and "application/json" in body["error"], (path, content_type)
        code, body = _post(rig, path, {}, b"")
        assert code == 415, path
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Origin": f"http://{host.replace('127.0.0.1', 'localhost')}"},  # another origin, same machine
            {"Origin": "http://127.0.0.1:1"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Sec-Fetch-Site": "same-site"},  # another port of this host is another program
        ):
            code, body = _post(rig, path, {"Content-Type": "application/json", **headers})
            assert code == 403 and "only the operator" in body["error"], (path, headers)
    assert [(h.source, h.reason) for h in rig.proxy.state.holds] == [("api", "the operator's own hold")]
    # The status page's own origin, a browser's address bar, and programs (no Origin) are fine.
    json_type = {"Content-Type": "application/json; charset=utf-8"}
    code, _ = _post(rig, "/yield", {**json_type, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"})
    assert code == 200
    code, _ = _post(rig, "/resume", {**json_type, "Sec-Fetch-Site": "none"}, b'{"source": "api"}')
    assert code == 200
    code, _ = _post(rig, "/resume", json_type, b"")
    assert code == 200
    assert [h.source for h in rig.proxy.state.holds] == ["web"]


def test_read_only_token_reads_but_cannot_change_anything():
    rig = Rig(token="admin-s3cret", read_token="read-s3cret")
    for path in ("/status", "/metrics", "/history"):
        assert call(rig, "GET", path, token="read-s3cret").code == 200, path
        assert call(rig, "GET", path, token="admin-s3cret").code == 200, path
        assert call(rig, "GET", path).code == 401, path
    for path in ("/yield", "/resume", "/fallback/verify"):
        denied = call(rig, "POST", path, {}, token="read-s3cret")
        assert denied.code == 403, path
        assert "may only read" in denied.json()["error"]
        assert call(rig, "POST", path, {}, token="wrong").code == 401
    assert not rig.proxy.state.yielded
    assert call(rig, "POST", path="/yield", body={}, token="admin-s3cret").code == 200
    assert rig.proxy.state.yielded
