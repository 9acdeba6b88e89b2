"""``yieldproxy yield/resume --upstream NAME`` and the status table's row per upstream (issue 12)."""

from __future__ import annotations

import pytest_twisted
from twisted.internet import reactor

from helpers import start_pool_stack
from test_cli import run_cli
from yieldproxy.tools.cli import format_status


def test_status_prints_a_row_per_upstream_of_a_pool():
    status = {
        "state": "available", "now": 100.0, "holds": [{"source": "file", "since": 90.0, "upstream": "desktop"}],
        "parked": {"batch": 2}, "parked_total": 2, "parked_bytes": 10, "inflight": 3,
        "upstreams": [
            {"name": "desktop", "state": "yielded", "use": "always", "inflight": 0, "waiting": 2,
             "holds": [{"source": "file"}], "models": ["all-minilm:latest", "llama3.1:8b"]},
            {"name": "cpu", "state": "available", "use": "when_others_yielded", "inflight": 3, "waiting": 0,
             "holds": [], "models": ["all-minilm"]},
        ],
    }
    lines = format_status(status).splitlines()
    table = lines[lines.index("upstreams:  2"):]
    assert table[1].split() == ["UPSTREAM", "STATE", "USE", "HELD", "BY", "IN", "FLIGHT", "WAITING", "MODELS"]
    assert table[2].split() == ["desktop", "yielded", "always", "file", "0", "2", "all-minilm:latest,", "llama3.1:8b"]
    assert table[3].split() == ["cpu", "available", "standby", "-", "3", "0", "all-minilm"]
    assert "twins:" not in format_status(status)
    # A pool of one prints no such table: the lines above say it all.
    status["upstreams"] = status["upstreams"][:1]
    assert "upstreams:" not in format_status(status)


def test_status_prints_each_twin_and_whether_it_serves_embeddings():
    status = {
        "state": "available", "now": 100.0, "holds": [], "parked": {}, "parked_total": 0, "inflight": 0,
        "upstreams": [
            {"name": "desktop", "state": "available", "use": "always", "holds": [], "models": ["all-minilm"],
             "twins": {"all-minilm": {"state": "reference", "reference": "desktop"}}},
            {"name": "server", "state": "available", "use": "always", "holds": [], "models": ["all-minilm"],
             "twins": {"all-minilm": {"state": "mismatch", "reference": "desktop", "worst_cosine": 0.0123,
                                      "age_seconds": 65.0}}},
        ],
    }
    lines = format_status(status).splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("twins:")):]
    assert table[1].split() == ["TWIN", "MODEL", "STATE", "REFERENCE", "WORST", "COSINE", "VERIFIED"]
    assert table[2].split()[:5] == ["server", "all-minilm", "mismatch", "desktop", "0.012300"]
    assert table[2].endswith("ago") and len(table) == 3


@pytest_twisted.ensureDeferred
async def test_yield_and_resume_one_upstream_from_the_command_line():
    stack = await start_pool_stack(reactor, [{"name": "desktop"}, {"name": "server"}])
    try:
        result = await run_cli("--admin", stack.admin_url, "yield", "--upstream", "desktop", "--reason", "game")
        assert result.code == 0, result.both
        assert [(h.source, h.scope) for h in stack.proxy.state.holds] == [("api", "desktop")]
        result = await run_cli("--admin", stack.admin_url, "status")
        assert result.code == 0, result.both
        assert "desktop   yielded" in result.out and "server    available" in result.out
        result = await run_cli("--admin", stack.admin_url, "yield", "--upstream", "laptop")
        assert result.code == 1 and "unknown upstream 'laptop'; the upstreams are desktop, server" in result.both
        result = await run_cli("--admin", stack.admin_url, "resume", "--upstream", "desktop")
        assert result.code == 0, result.both
        assert stack.proxy.state.holds == []
    finally:
        await stack.stop()
