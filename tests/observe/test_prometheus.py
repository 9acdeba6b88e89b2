"""A real Prometheus scrapes a real stack through a yield, and reads the story back.

Debian's ``prometheus`` runs as a child of the reactor on a free 127.0.0.1
port with its own TSDB in a temporary directory, scraping the admin listener
every second with the read-only token from a file (the recipe of
``etc/prometheus/prometheus.yml``: a scraper cannot yield or resume), and loading ``etc/prometheus/yieldproxy-rules.yml``.
Values are read back through its HTTP query API, as a dashboard would.

Skipped when prometheus is missing, unless ``CI`` is set (then it fails).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import ChildOutput, free_port, required_tool, sleep, start_pool_stack, start_stack, wait_for

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 30
TOKEN = "prometheus-test-token-0123456789"
#: What Prometheus is given: admin.read_token_file's token.
READ_TOKEN = "prometheus-read-only-token-0123456789"
PARKED = 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(ROOT, "etc", "prometheus", "yieldproxy-rules.yml")


def prometheus_path() -> str:
    return required_tool("prometheus", install="apt-get install prometheus")


def write_config(directory: str, admin_url: str, token: str = READ_TOKEN) -> str:
    token_file = os.path.join(directory, "yieldproxy.token")
    with open(token_file, "w") as f:
        f.write(token + "\n")
    os.chmod(token_file, 0o600)
    target = admin_url.removeprefix("http://")
    # JSON is YAML: no YAML writer needed.
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [RULES],
        "scrape_configs": [
            {
                "job_name": "yieldproxy",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [target]}],
                "authorization": {"type": "Bearer", "credentials_file": token_file},
            }
        ],
    }
    path = os.path.join(directory, "prometheus.yml")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path


class Prometheus:
    """One prometheus process and its query API."""

    def __init__(self, binary: str, directory: str, config: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.protocol = ChildOutput()
        args = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={os.path.join(directory, 'data')}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.process = reactor.spawnProcess(self.protocol, binary, args, env={"PATH": os.environ.get("PATH", "")})

    async def ready(self) -> None:
        for _ in range(300):
            if self.protocol.ended.called:
                raise AssertionError(f"prometheus exited: {self.protocol.output.decode(errors='replace')}")
            try:
                response = await treq.get(self.url + "/-/ready", persistent=False).addTimeout(2, reactor)
                await response.content()
                if response.code == 200:
                    return
            except Exception:
                pass
            await sleep(reactor, 0.1)
        raise AssertionError("prometheus did not become ready in 30 s")

    async def api(self, path: str, **params) -> dict:
        response = await treq.get(self.url + path, params=params, persistent=False).addTimeout(TIMEOUT, reactor)
        body = await response.json()
        assert body["status"] == "success", body
        return body["data"]

    async def value(self, query: str) -> float | None:
        """The single value of an instant query, or None when it has no series."""
        result = (await self.api("/api/v1/query", query=query))["result"]
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    async def until(self, query: str, expected: float, timeout: float = 20) -> None:
        """Poll ``query`` until it equals ``expected`` (scrapes are one second apart)."""
        seen = None
        for _ in range(int(timeout / 0.25)):
            seen = await self.value(query)
            if seen == expected:
                return
            await sleep(reactor, 0.25)
        raise AssertionError(f"{query} is {seen}, expected {expected}, after {timeout}s")

    async def stop(self) -> None:
        if self.protocol.ended.called:
            return
        self.process.signalProcess("TERM")
        killer = reactor.callLater(15, self.process.signalProcess, "KILL")
        try:
            await self.protocol.ended
        finally:
            if killer.active():
                killer.cancel()


@pytest_twisted.ensureDeferred
async def test_prometheus_sees_the_yield_the_parked_requests_and_the_replay():
    binary = prometheus_path()
    stack = await start_stack(reactor, token=TOKEN, read_token=READ_TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prometheus = None
    pending = []
    with tempfile.TemporaryDirectory(prefix="yp-prometheus-") as directory:
        try:
            prometheus = Prometheus(binary, directory, write_config(directory, stack.admin_url))
            await prometheus.ready()
            await prometheus.until('up{job="yieldproxy"}', 1)
            await prometheus.until("yieldproxy_yield_active", 0)

            answer = await treq.post(
                stack.admin_url + "/yield", json={"source": "game", "reason": "boss fight", "expected_seconds": 60},
                headers=auth, persistent=False,
            ).addTimeout(TIMEOUT, reactor)
            assert answer.code == 200
            pending = [
                treq.post(stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": f"p{i}"}, persistent=False)
                .addTimeout(TIMEOUT * 2, reactor)
                for i in range(PARKED)
            ]
            await wait_for(reactor, lambda: len(stack.proxy.lot) == PARKED)

            await prometheus.until("sum(yieldproxy_parked_requests)", PARKED)
            assert await prometheus.value('yieldproxy_parked_requests{class="batch"}') == PARKED
            assert await prometheus.value("yieldproxy_yield_active") == 1
            assert await prometheus.value('yieldproxy_hold_active{source="game"}') == 1
            assert await prometheus.value('yieldproxy_hold_expected_seconds{source="game"}') == 60
            assert await prometheus.value("yieldproxy_parked_capacity") == stack.proxy.config.parking.max_parked

            # The shipped rules load and evaluate cleanly against the real series.
            groups = (await prometheus.api("/api/v1/rules"))["groups"]
            assert [g["name"] for g in groups] == ["yieldproxy"]
            rules = groups[0]["rules"]
            assert len(rules) >= 10
            for _ in range(40):
                rules = (await prometheus.api("/api/v1/rules"))["groups"][0]["rules"]
                if all(r["health"] == "ok" for r in rules):
                    break
                await sleep(reactor, 0.25)
            assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
            # Nothing here is bad enough to alert (the thresholds are minutes long).
            firing = [a for a in (await prometheus.api("/api/v1/alerts"))["alerts"] if a["state"] == "firing"]
            assert firing == []

            answer = await treq.post(
                stack.admin_url + "/resume", json={"source": "game"}, headers=auth, persistent=False
            ).addTimeout(TIMEOUT, reactor)
            assert answer.code == 200
            for d in pending:
                assert (await d).code == 200
            pending = []

            await prometheus.until("sum(yieldproxy_parked_requests)", 0)
            await prometheus.until("yieldproxy_yield_active", 0)
            await prometheus.until('sum(yieldproxy_replay_total{outcome="ok"})', PARKED)
            assert await prometheus.value('yieldproxy_hold_active{source="game"}') is None
            # "game" is not among admin.known_sources: counted under "other", so labels stay bounded.
            assert await prometheus.value('yieldproxy_yields_total{source="other"}') == 1
            assert await prometheus.value('sum(yieldproxy_requests_total{class="batch",code="200"})') == PARKED
        finally:
            if prometheus is not None:
                await prometheus.stop()
            for d in pending:
                d.addErrback(lambda failure: None)
                d.cancel()
            await stack.stop()


def availability_query() -> str:
    """The dashboard's "Upstream availability" query, its variables set to all (2 available, 1 held, 0 out)."""
    with open(os.path.join(ROOT, "etc", "grafana", "yieldproxy-dashboard.json"), encoding="utf-8") as f:
        panels = json.load(f)["panels"]
    [expr] = [t["expr"] for p in panels if p.get("title") == "Upstream availability" for t in p["targets"]]
    for var in ("$job", "$instance", "$upstream"):
        expr = expr.replace(var, ".*")
    return expr


async def by_upstream(prometheus: Prometheus, query: str) -> dict[str, float]:
    result = (await prometheus.api("/api/v1/query", query=query))["result"]
    return {r["metric"]["upstream"]: float(r["value"][1]) for r in result}


async def alert_query(prometheus: Prometheus, alert: str) -> list[dict]:
    """The labels of the series the shipped rule ``alert``'s expression gives now (its ``for`` aside)."""
    rules = (await prometheus.api("/api/v1/rules"))["groups"][0]["rules"]
    [query] = [r["query"] for r in rules if r.get("name") == alert]
    result = (await prometheus.api("/api/v1/query", query=query))["result"]
    return [{k: v for k, v in r["metric"].items() if k not in ("job", "instance", "__name__")} for r in result]


async def until_alert_query(prometheus: Prometheus, alert: str, expected: list[dict], timeout: float = 20) -> None:
    seen = None
    for _ in range(int(timeout / 0.25)):
        seen = await alert_query(prometheus, alert)
        if seen == expected:
            return
        await sleep(reactor, 0.25)
    raise AssertionError(f"{alert}'s expression gives {seen}, expected {expected}, after {timeout}s")


@pytest_twisted.ensureDeferred
async def test_the_pool_alerts_read_the_real_per_upstream_series():
    """A pool of two, one of them unreachable: the shipped per-upstream rules' expressions, on real scrapes.

    The unreachable upstream is picked out (no hold on it) while the other
    serves; a game on the other makes the whole pool unavailable; a request
    parked behind them is not a stalled lot. The dashboard's availability
    panel reads the same series as out (0), held (1) and available (2).
    """
    binary = prometheus_path()
    # Bound, never listening: connections to it are refused, and no other process can take the port.
    closed_socket = socket.socket()
    closed_socket.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{closed_socket.getsockname()[1]}"
    # Both name the model, so a is tried first (not passed over once b's model list is read).
    stack = await start_pool_stack(
        reactor, [{"name": "a", "url": closed, "models": ["all-minilm"]}, {"name": "b", "models": ["all-minilm"]}], token=TOKEN
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prometheus = None
    parked = None
    with tempfile.TemporaryDirectory(prefix="yp-prometheus-") as directory:
        try:
            prometheus = Prometheus(binary, directory, write_config(directory, stack.admin_url, token=TOKEN))
            await prometheus.ready()
            await prometheus.until('up{job="yieldproxy"}', 1)
            for i in range(3):
                # Chat, not embeddings: b is a's unverified twin (a never answered), so it serves none of those.
                chat = {"model": "all-minilm", "messages": [{"role": "user", "content": f"b{i}"}], "stream": False}
                answer = await treq.post(stack.proxy_url + "/api/chat", json=chat, persistent=False).addTimeout(
                    TIMEOUT, reactor
                )
                assert answer.code == 200
                await answer.content()
            await wait_for(reactor, lambda: stack.proxy.scheduler.members[0].unreachable, timeout=TIMEOUT)

            await prometheus.until('yieldproxy_upstream_available{upstream="a"}', 0)
            await prometheus.until('yieldproxy_upstream_available{upstream="b"}', 1)
            await until_alert_query(prometheus, "YieldproxyUpstreamUnavailable", [{"upstream": "a"}])
            assert await alert_query(prometheus, "YieldproxyNoUpstreamAvailable") == []
            assert await alert_query(prometheus, "YieldproxyLotStalled") == []
            assert await by_upstream(prometheus, availability_query()) == {"a": 0, "b": 2}

            # b games: nothing serves, and not only because of a yield; b itself is no "unavailable" upstream.
            answer = await treq.post(
                stack.admin_url + "/yield", json={"source": "game", "upstream": "b"}, headers=auth, persistent=False
            ).addTimeout(TIMEOUT, reactor)
            assert answer.code == 200
            chat = {"model": "all-minilm", "messages": [{"role": "user", "content": "parked"}], "stream": False}
            parked = treq.post(stack.proxy_url + "/api/chat", json=chat, persistent=False).addTimeout(
                TIMEOUT * 2, reactor
            )
            await wait_for(reactor, lambda: len(stack.proxy.lot) == 1)
            await prometheus.until('yieldproxy_upstream_waiting_requests{upstream="b"}', 1)
            await until_alert_query(prometheus, "YieldproxyNoUpstreamAvailable", [{}])
            assert await alert_query(prometheus, "YieldproxyUpstreamUnavailable") == [{"upstream": "a"}]
            assert await by_upstream(prometheus, availability_query()) == {"a": 0, "b": 1}
            assert await alert_query(prometheus, "YieldproxyLotStalled") == []

            answer = await treq.post(
                stack.admin_url + "/resume", json={"source": "game"}, headers=auth, persistent=False
            ).addTimeout(TIMEOUT, reactor)
            assert answer.code == 200
            assert (await parked).code == 200
            parked = None
            await prometheus.until('yieldproxy_upstream_attempts_total{upstream="b",outcome="ok"}', 4)
            await until_alert_query(prometheus, "YieldproxyNoUpstreamAvailable", [])
            assert await alert_query(prometheus, "YieldproxyLotStalled") == []
            rules = (await prometheus.api("/api/v1/rules"))["groups"][0]["rules"]
            assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
        finally:
            if prometheus is not None:
                await prometheus.stop()
            if parked is not None:
                parked.addErrback(lambda failure: None)
                parked.cancel()
            await stack.stop()
            closed_socket.close()
