"""The request log line, the JSON log format, and ``--log-format`` on the twistd plugin."""

from __future__ import annotations

import io
import json

import pytest
import pytest_twisted
import treq
from klein import Klein
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import LogLevel, Logger, capturedLogs, formatEvent
from twisted.python import usage
from twisted.scripts.twistd import ServerOptions

from yieldproxy.observe.requestlog import CLIENT_GONE, JSON_OBSERVER, json_file_observer, log_request
from yieldproxy.tap import Options

TIMEOUT = 30


def test_one_event_with_structured_fields_and_a_readable_line():
    clock = Clock()
    clock.advance(100)

    def handler(request):
        request.setResponseCode(200)
        request.write(b'{"embeddings": [[0.1]]}')
        clock.advance(2.5)
        log_request(request, "batch", 200, "ok", 2.0004, 1, started=100.0, clock=clock)

    app = Klein()
    app.route("/", branch=True)(handler)
    http = StubTreq(app.resource())
    with capturedLogs() as events:
        response = http.post("http://proxy/api/embed?key=secret", data=b'{"input": "x"}')
        http.flush()
    assert response.called
    mine = [e for e in events if e.get("log_namespace") == "yieldproxy.requestlog"]
    assert len(mine) == 1
    event = mine[0]
    assert {k: event[k] for k in ("method", "path", "class", "status", "outcome", "parked_seconds", "attempts", "duration")} == {
        "method": "POST",
        "path": "/api/embed",  # no query string: it may carry secrets
        "class": "batch",
        "status": 200,
        "outcome": "ok",
        "parked_seconds": 2.0,
        "attempts": 1,
        "duration": 2.5,
    }
    assert event["bytes_sent"] == len(b'{"embeddings": [[0.1]]}')
    assert event["log_level"] == LogLevel.info
    assert formatEvent(event) == (
        f"POST /api/embed batch 200 ok parked=2.000s attempts=1 2.500s client={event['client']}"
    )


class FakeRequest:
    """Only what log_request reads: for the edge cases."""

    def __init__(self, path=b"/api/chat", method=b"POST"):
        self.path = path
        self.method = method
        self.sentLength = 0

    def getClientAddress(self):
        from twisted.internet.address import UNIXAddress

        return UNIXAddress(None)


def captured(*args, **kwargs) -> dict:
    events = []
    log_request(*args, logger=Logger(observer=events.append), **kwargs)
    assert len(events) == 1
    return events[0]


def test_abandoned_request_is_logged_as_499_and_server_errors_as_warnings():
    clock = Clock()
    event = captured(FakeRequest(), "interactive", None, "abandoned", 14.2, 0, 0.0, clock)
    assert event["status"] == CLIENT_GONE == 499
    assert event["client"] == "unix"
    assert event["log_level"] == LogLevel.info
    event = captured(FakeRequest(), "batch", 503, "expired", 600.0, 0, 0.0, clock)
    assert event["log_level"] == LogLevel.warn
    event = captured(FakeRequest(), "passthrough", 502, "upstream_error", None, 1, 0.0, clock)
    assert event["parked_seconds"] == 0.0


def test_control_characters_cannot_forge_log_lines():
    event = captured(FakeRequest(path=b"/api/x\nFAKE 200 ok\x1b[31m" + b"a" * 1000), "passthrough", 404, "ok", 0, 1, 0.0, Clock())
    text = formatEvent(event)
    assert "\n" not in text and "\x1b" not in text
    assert "\\n" in event["path"] and len(event["path"]) < 400


def test_json_observer_keeps_failures_and_odd_values_on_one_line():
    out = io.StringIO()
    log = Logger(observer=json_file_observer(out), namespace="t")
    try:
        1 / 0
    except ZeroDivisionError:
        log.failure("it broke: {what}", what=b"bytes\nvalue")
    log.info("odd {thing}", thing=object())
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    broke = json.loads(lines[0])
    assert broke["level"] == "critical" and "ZeroDivisionError" in broke["traceback"]
    assert broke["what"] == "bytes\nvalue" and broke["text"].startswith("it broke")
    assert json.loads(lines[1])["thing"].startswith("<object object")


def test_json_observer_writes_one_object_per_line_with_the_fields_and_the_text():
    out = io.StringIO()
    observer = json_file_observer(out)
    log_request(FakeRequest(), "long", 200, "ok", 30.5, 2, 0.0, Clock(), logger=Logger(observer=observer))
    Logger(observer=observer).info("a plain message with {n} field", n=1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\x1e" not in out.getvalue()
    record = json.loads(lines[0])
    assert record["class"] == "long" and record["status"] == 200 and record["attempts"] == 2
    assert record["parked_seconds"] == 30.5 and record["outcome"] == "ok"
    assert record["level"] == "info" and record["namespace"] == "test_requestlog"
    assert isinstance(record["time"], float)
    assert not [k for k in record if k.startswith("log_")]
    assert record["text"].startswith("POST /api/chat long 200 ok parked=30.500s attempts=2")
    assert json.loads(lines[1])["text"] == "a plain message with 1 field"


# -- --log-format on the twistd plugin ---------------------------------------------------------


def twistd_options(*args) -> ServerOptions:
    options = ServerOptions()
    options.parseOptions(["-n", *args])
    return options


def assert_twistd_usage_error(args, message: str, capsys) -> None:
    """Under twistd a plugin usage error is one line on stderr and exit status 1."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        twistd_options(*args)
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("twistd yieldproxy: ") and message in err and err.count("\n") == 1, err


def test_log_format_json_sets_twistds_logger():
    options = twistd_options("yieldproxy", "--log-format", "json")
    from yieldproxy.observe.requestlog import json_observer, text_observer

    assert options["logger"] is json_observer
    # Text goes through our observer too, so that --log-level applies.
    assert twistd_options("yieldproxy")["logger"] is text_observer
    assert twistd_options("yieldproxy", "--log-format", "text")["logger"] is text_observer
    # twistd's own choice of output wins for text.
    assert twistd_options("--logfile", "/tmp/yp.log", "yieldproxy")["logger"] is None


def test_log_level_drops_debug_events(capsys):
    import io

    from twisted.logger import LogLevel

    from yieldproxy.observe import requestlog

    # The level is in the observer's dotted name twistd imports, not in a module variable.
    assert twistd_options("yieldproxy", "--log-level", "warn")["logger"] == requestlog.at_warn.text
    assert twistd_options("yieldproxy", "--log-format", "json", "--log-level", "error")["logger"] == requestlog.at_error.json
    assert_twistd_usage_error(["yieldproxy", "--log-level", "loud"], "--log-level", capsys)
    assert twistd_options("yieldproxy")["logger"] is requestlog.text_observer
    out = io.StringIO()
    observer = requestlog.json_file_observer(out, requestlog.at_info.level)
    observer({"log_level": LogLevel.debug, "log_format": "noise", "log_namespace": "x", "log_time": 0})
    observer({"log_level": LogLevel.info, "log_format": "kept", "log_namespace": "x", "log_time": 0})
    assert "noise" not in out.getvalue() and "kept" in out.getvalue()


@pytest.mark.parametrize(
    "args, message",
    [
        (["yieldproxy", "--log-format", "xml"], "--log-format: must be text or json"),
        (["--logger", JSON_OBSERVER, "yieldproxy", "--log-format", "json"], "--logger is set too"),
        (["--logfile", "/tmp/yp.log", "yieldproxy", "--log-format", "json"], "drop --logfile"),
    ],
)
def test_log_format_conflicts_are_usage_errors(args, message, capsys):
    assert_twistd_usage_error(args, message, capsys)


def test_plugin_options_alone_raise_usage_errors():
    """Without twistd (no parent options), the UsageError propagates to the caller."""
    with pytest.raises(usage.UsageError, match="--log-format: must be text or json"):
        Options().parseOptions(["--log-format", "xml"])


def test_plugin_options_alone_accept_log_format():
    options = Options()
    options.parseOptions(["--log-format", "json"])
    assert options["log-format"] == "json"


@pytest_twisted.ensureDeferred
async def test_twistd_with_log_format_json_logs_json_lines():
    """A real ``twistd -n yieldproxy --log-format json``: every stdout line is a JSON object."""
    from test_twistd import start_service  # the same launcher as the service tests
    from yieldproxy.tools.sim import SimOllama

    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, proxy, admin = await start_service(sim_port, "--log-format", "json")
    try:
        answer = await treq.post(admin + "/yield", json={"reason": "json check", "source": "test"}, persistent=False)
        assert answer.code == 200
        # A route that passes during the yield (a POST to /api/tags is an unknown route: it
        # would wait out its class's hold bound, 15 s, before its 503).
        response = await treq.get(proxy + "/api/tags", persistent=False).addTimeout(TIMEOUT, reactor)
        assert response.code == 200
        await response.content()
        process.signalProcess("TERM")
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), protocol.output
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
        await sim.stop()
    lines = [line for line in protocol.output.decode().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    texts = [r.get("text", "") for r in records]
    assert any("starting up" in t for t in texts)
    yielded = [r for r in records if r.get("namespace") == "yieldproxy.lot.state" and r.get("source") == "test"]
    assert yielded and yielded[0]["reason"] == "json check"
    [tags] = [r for r in records if r.get("namespace") == "yieldproxy.requestlog"]
    assert (tags["path"], tags["status"], tags["class"]) == ("/api/tags", 200, "passthrough")
    assert any(t == "Server Shut Down." for t in texts)


# -- the call sites in proxy/handler.py, on a Clock through the proxy listener's own site -------------


def test_every_proxied_request_ends_in_one_log_line():
    from helpers import config_with
    from inmemory import Rig

    rig = Rig(config_with(classes={"interactive": {"hold_seconds": 0.3}}))
    with capturedLogs() as events:
        assert rig.call("GET", rig.proxy_url + "/api/tags").code == 200
        bad = rig.result(rig.post("/api/embed", {"model": "m", "input": "x"}, headers={"X-Yield-Class": "nope"}))
        assert bad.code == 400
        rig.proxy.state.hold("game", reason="test")
        parked = rig.post("/api/embed", {"model": "all-minilm", "input": "kept"})
        expiring = rig.post("/api/generate", {"model": "m", "prompt": "p", "stream": False})
        leaving = rig.post("/api/embed", {"model": "all-minilm", "input": "gone"})
        assert len(rig.proxy.lot) == 3
        rig.run(0.1)
        leaving.addErrback(lambda failure: None)
        leaving.cancel()
        rig.run(0.2)
        assert rig.result(expiring).code == 503
        assert len(rig.proxy.lot) == 1
        rig.run(0.2)
        rig.proxy.state.release("game")
        rig.turn()
        assert rig.result(parked).code == 200
    lines = {
        (e["path"], e["outcome"]): e for e in events if e.get("log_namespace") == "yieldproxy.requestlog"
    }
    assert len([e for e in events if e.get("log_namespace") == "yieldproxy.requestlog"]) == 5
    assert set(lines) == {
        ("/api/tags", "ok"),
        ("/api/embed", "bad_request"),
        ("/api/generate", "expired"),
        ("/api/embed", "abandoned"),
        ("/api/embed", "ok"),
    }
    tags_line = lines["/api/tags", "ok"]
    assert (tags_line["class"], tags_line["status"], tags_line["attempts"]) == ("passthrough", 200, 1)
    assert lines["/api/embed", "bad_request"]["status"] == 400
    expired = lines["/api/generate", "expired"]
    assert (expired["class"], expired["status"], expired["attempts"]) == ("interactive", 503, 0)
    assert expired["parked_seconds"] == 0.3
    gone = lines["/api/embed", "abandoned"]
    assert (gone["status"], gone["attempts"]) == (499, 0)
    assert gone["parked_seconds"] == 0.1
    ok = lines["/api/embed", "ok"]
    assert (ok["class"], ok["status"], ok["attempts"], ok["method"]) == ("batch", 200, 1, "POST")
    assert ok["parked_seconds"] == 0.5 and ok["duration"] >= ok["parked_seconds"]
    assert ok["client"] == "127.0.0.1" and ok["bytes_sent"] > 0


def test_text_lines_are_twisteds_classic_lines_request_lines_included():
    """The text observer's fast path for request lines writes exactly what Twisted's formatter would."""
    from twisted.logger import formatEventAsClassicLogText
    from twisted.python.failure import Failure

    from yieldproxy.observe.requestlog import classic_text, text_file_observer

    class Request:
        path = b"/api/embed"
        method = b"POST"
        sentLength = 10

        def getClientAddress(self):
            class Address:
                host = "127.0.0.1"

            return Address()

    events = []
    logger = Logger(namespace="yieldproxy.requestlog", observer=events.append)
    clock = Clock()
    clock.advance(1_700_000_000.75)
    for status in (200, 503, None):
        log_request(Request(), "batch", status, "ok", 1.5, 2, clock.seconds() - 0.2, clock, logger=logger)
    Logger(namespace="other", observer=events.append).info("plain {x}", x=1)
    try:
        1 / 0
    except ZeroDivisionError:
        Logger(namespace="other", observer=events.append).failure("boom", Failure())
    odd = dict(events[0], request_line="two\nlines")
    events += [odd, dict(events[0], log_system="sys"), dict(events[0], log_time=None), dict(events[0], request_line="")]
    for event in events:
        assert classic_text(event) == formatEventAsClassicLogText(event), event
    out = io.StringIO()
    text_file_observer(out)(events[0])
    assert out.getvalue() == formatEventAsClassicLogText(events[0])
    assert " [yieldproxy.requestlog#info] POST /api/embed batch 200 ok parked=1.500s" in out.getvalue()


def test_in_a_pool_each_request_line_names_the_upstream_that_served_it():
    """It named one only for a translated answer: which GPU served a request was not in the log."""
    from treq.testing import StubTreq
    from twisted.internet.task import Clock

    from helpers import clock_cooperator, config_with, pool_config
    from inmemory import MemoryUpstream
    from yieldproxy.observe.metrics import Metrics
    from yieldproxy.proxy.handler import ProxyApp
    from yieldproxy.service import build_heart
    from yieldproxy.tools.sim import SimOllama

    clock = Clock()
    config = pool_config(
        {"name": "desktop", "models": ("all-minilm",)}, {"name": "server", "models": ("all-minilm",)},
        config=config_with(upstream={"detect_outages": False}),
    )
    wires = {name: MemoryUpstream(SimOllama(clock).resource(), clock) for name in ("desktop", "server")}
    metrics = Metrics()
    heart = build_heart(clock, config, metrics, clock_cooperator(clock), lambda spec: (wires[spec.name], None))
    client = StubTreq(ProxyApp(clock, config, heart.scheduler, metrics).resource())

    def call(method, path, **kwargs):
        d = client.request(method, "http://127.0.0.1:11435" + path, **kwargs)
        for _ in range(200):
            client.flush()
            moved = [wire.flush() for wire in wires.values()]
            clock.advance(0)
            if d.called and not any(moved):
                break
        return d

    def lines():
        return [e for e in events if e.get("log_namespace") == "yieldproxy.requestlog"]

    embed = {"json": {"model": "all-minilm", "input": ["hello"]}}
    with capturedLogs() as events:
        assert call("POST", "/api/embed", **embed).result.code == 200
        heart.state.hold("api", "game", scope="desktop")
        assert call("POST", "/api/embed", **embed).result.code == 200
        assert call("GET", "/api/version").result.code == 200
        heart.state.hold("api", "game", scope="server")
        parked = call("POST", "/api/embed", headers={"X-Yield-Max-Wait": "1"}, **embed)
        clock.advance(1.5)
        call("GET", "/api/tags")
        refused = parked.result
    first, second, version, waited, _tags = lines()
    assert (first["upstream"], second["upstream"], version["upstream"]) == ("desktop", "server", "server")
    assert formatEvent(second).endswith(" upstream=server") and "translated" not in second
    # Refused before any attempt: no upstream served it.
    assert refused.code == 503 and waited["outcome"] == "expired"
    assert "upstream" not in waited and "upstream=" not in formatEvent(waited)
