"""The admin API over real sockets: status, yield/resume, leases, auth, metrics."""

from __future__ import annotations

import json

import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import sleep, start_stack, wait_for

TIMEOUT = 30


def call(method, url, body=None, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
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
            answer = await treq.post(stack.admin_url + "/yield", data=body).addTimeout(TIMEOUT, reactor)
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
    stack = await start_stack(reactor)
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
