"""The status page in a real headless Chromium, against a real stack on 127.0.0.1.

Chromium runs as a child process of the reactor (``spawnProcess``), so the
proxy keeps answering the page's fetches while the browser renders it.
``--dump-dom`` gives the DOM after the page's scripts ran (virtual time lets
its two-second polling run twice without waiting); ``--screenshot`` gives a
PNG, decoded here with zlib alone, to check that the chart was really drawn.

Skipped when Chromium is missing, unless ``CI`` is set (then it fails).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
import zlib
from html.parser import HTMLParser

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol

from helpers import free_port, release_every_hold, required_tool, sleep, start_stack, wait_for

# Real sockets and processes for many seconds: scripts/test starts this module first (conftest.py).
pytestmark = pytest.mark.heavy

TIMEOUT = 30
#: The parked requests' bound: they stay parked through several Chromium runs, which take 10 s
#: and more each on a loaded machine (30 s cancelled them mid-test, emptying the lot).
PARKED_TIMEOUT = 150
TOKEN = "page-test-token-0123456789"
#: Tall enough for the cards, who waits, the holds and the chart in one screenshot.
WIDTH, HEIGHT = 1200, 1100
#: Colours from status.css: the yield band and the batch line.
YIELD_BAND = (0xFF, 0xD8, 0xD3)
BATCH = (0xD4, 0x57, 0x0B)
REASON = 'boss fight <img src=x onerror="document.title=1">'


def chromium_path() -> str:
    return required_tool("chromium", "chromium-browser", "google-chrome", install="apt-get install chromium")


# -- running Chromium ---------------------------------------------------------


class _Collect(ProcessProtocol):
    def __init__(self):
        self.out = b""
        self.err = b""
        self.ended: Deferred = Deferred()

    def outReceived(self, data):
        self.out += data

    def errReceived(self, data):
        self.err += data

    def processEnded(self, reason):
        self.ended.callback(reason.value.exitCode)


async def chromium(url: str, *mode: str, timeout: float = 60) -> bytes:
    """Run headless Chromium on ``url`` with ``mode`` flags; its stdout."""
    binary = chromium_path()
    with tempfile.TemporaryDirectory(prefix="yp-chromium-") as profile:
        args = [
            binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
            f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=5000", *mode, url,
        ]
        protocol = _Collect()
        process = reactor.spawnProcess(protocol, binary, args, env={**os.environ, "LANG": "C.UTF-8"})
        killer = reactor.callLater(timeout, process.signalProcess, "KILL")
        try:
            code = await protocol.ended
        finally:
            if killer.active():
                killer.cancel()
        assert code == 0, f"chromium exited {code}: {protocol.err.decode(errors='replace')[-2000:]}"
        return protocol.out


# -- reading what it rendered -----------------------------------------------------


class Dom(HTMLParser):
    """The elements of a dumped DOM that carry an id or a class, with their text."""

    VOID = {"meta", "link", "input", "br", "img", "hr", "col", "rect", "line", "path"}

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[dict] = []
        self._open: list[dict] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, **{k: v or "" for k, v in attrs}, "text": ""}
        self.elements.append(element)
        if tag not in self.VOID:
            self._open.append(element)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, **{k: v or "" for k, v in attrs}, "text": ""})

    def handle_endtag(self, tag):
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i]["tag"] == tag:
                del self._open[i:]
                break

    def handle_data(self, data):
        for element in self._open:
            element["text"] += data

    def by_id(self, id_: str) -> dict:
        found = [e for e in self.elements if e.get("id") == id_]
        assert len(found) == 1, f"expected one #{id_}, found {len(found)}"
        return found[0]

    def with_class(self, name: str) -> list[dict]:
        return [e for e in self.elements if name in e.get("class", "").split()]


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    channels = 3 if color == 2 else 4
    stride = width * channels
    raw = zlib.decompress(idat)
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
                line[i] = (line[i] + pred) & 0xFF
        previous = line
        rgb = bytes(line) if channels == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3)
        rows.append(rgb)
    return width, height, rows


def count_pixels(rows: list[bytes], top: int, bottom: int, match) -> int:
    count = 0
    for row in rows[top:bottom]:
        for x in range(0, len(row), 3):
            if match(row[x], row[x + 1], row[x + 2]):
                count += 1
    return count


def near(colour, tolerance=12):
    return lambda r, g, b: abs(r - colour[0]) <= tolerance and abs(g - colour[1]) <= tolerance and abs(b - colour[2]) <= tolerance


# -- the tests -----------------------------------------------------------------------


async def yielded_stack_with_history():
    """A stack with a token, sampling every 0.2 s, yielded with 4 batch and 2 long requests parked."""
    stack = await start_stack(reactor, token=TOKEN, history_interval=0.2)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    history = stack.proxy.history
    # Samples taken: three before the yield (0.6 s of history)...
    await wait_for(reactor, lambda: len(history) >= 3)
    answer = await treq.post(
        stack.admin_url + "/yield", json={"reason": REASON, "source": "game", "for_seconds": 600},
        headers=auth, persistent=False,
    ).addTimeout(TIMEOUT, reactor)
    assert answer.code == 200
    pending = [
        treq.post(stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": f"t{i}"}, persistent=False)
        .addTimeout(PARKED_TIMEOUT, reactor)
        for i in range(4)
    ] + [
        treq.post(
            stack.proxy_url + "/api/generate", json={"model": "m", "prompt": "p", "stream": False},
            headers={"X-Yield-Class": "long"}, persistent=False,
        ).addTimeout(PARKED_TIMEOUT, reactor)
        for _ in range(2)
    ]
    await wait_for(reactor, lambda: len(stack.proxy.lot) == 6)
    # ...and eight with the six parked (1.6 s), whatever the machine's load.
    parked_from = len(history)
    await wait_for(reactor, lambda: len(history) >= parked_from + 8)
    return stack, pending, auth


@pytest_twisted.ensureDeferred
async def test_page_shows_the_yield_its_hold_and_draws_it():
    chromium_path()
    stack, pending, auth = await yielded_stack_with_history()
    try:
        url = f"{stack.admin_url}/#token={TOKEN}"
        dom = Dom((await chromium(url, "--dump-dom")).decode("utf-8"))

        state = dom.by_id("state")
        assert state["data-state"] == "yielded" and state["text"] == "yielded"
        assert "held by game" in dom.by_id("state-detail")["text"]
        assert dom.by_id("token-form").get("hidden") is not None
        holds = dom.with_class("hold")
        assert [h["data-source"] for h in holds] == ["game"]
        # The caller-written reason is shown as text, not run as markup.
        reason = dom.with_class("reason")[0]
        assert reason["text"] == REASON
        assert not [e for e in dom.elements if e["tag"] == "img"]
        assert dom.with_class("expiry")[0]["text"].startswith("in 9 min")
        assert dom.by_id("parked-batch")["data-count"] == "4"
        assert dom.by_id("parked-long")["data-count"] == "2"
        assert dom.by_id("parked-interactive")["data-count"] == "0"
        assert dom.by_id("inflight")["text"] == "0"

        # Who waits: every parked request, in arrival order, with its route, model, client and bound.
        assert dom.by_id("waiting-section").get("hidden") is None
        # (The six were sent at once: their order is the order they came in.)
        waiting = dom.with_class("parked-request")
        assert [w["data-position"] for w in waiting] == ["1", "2", "3", "4", "5", "6"]
        assert sorted(w["data-class"] for w in waiting) == ["batch"] * 4 + ["long"] * 2
        expected = {
            "batch": ("/api/embed", "all-minilm", "10 min 0 s (hold bound)"),
            "long": ("/api/generate", "m", "1 h 0 min (hold bound)"),
        }
        cells = zip(dom.with_class("route"), dom.with_class("model"), dom.with_class("bound"))
        assert [(r["text"], m["text"], b["text"]) for r, m, b in cells] == [expected[w["data-class"]] for w in waiting]
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", e["text"]) for e in dom.with_class("client"))
        assert dom.by_id("waiting-more").get("hidden") is not None
        # No hold is older than the proxy: no warning.
        assert dom.by_id("restored").get("hidden") is not None
        # The one upstream's strip says what it is.
        # (Its text, then its tooltip's.)
        assert [e["text"] for e in dom.with_class("strip-name")] == ["upstream" "the upstream (proxy.upstream): its state over time"]

        # The chart: one yield band, reaching the right edge (still yielded), and parked lines that rose.
        bands = dom.with_class("yield-band")
        assert len(bands) == 1
        assert float(bands[0]["width"]) > 10
        assert int(dom.by_id("chart")["data-samples"]) >= 8
        batch = dom.by_id("parked-batch-line")
        assert batch["data-max"] == "4" and batch["d"].startswith("M") and "V" in batch["d"]
        assert dom.by_id("parked-long-line")["data-max"] == "2"
        assert dom.by_id("parked-interactive-line")["data-max"] == "0"

        with tempfile.TemporaryDirectory(prefix="yp-shot-") as tmp:
            shot = os.path.join(tmp, "status.png")
            await chromium(url, f"--screenshot={shot}")
            if os.environ.get("YIELDPROXY_KEEP_SCREENSHOT"):
                shutil.copy(shot, os.environ["YIELDPROXY_KEEP_SCREENSHOT"])
            with open(shot, "rb") as f:
                png = f.read()
        # The pixels are read at the end: decoding them here held the reactor for seconds under
        # load, the history took no sample meanwhile, and the chart rightly broke the band at the gap.

        # Resume: the page turns to available, the band stays in the history, the lines come back to 0.
        await treq.post(stack.admin_url + "/resume", json={"source": "game"}, headers=auth, persistent=False)
        for d in pending:
            assert (await d).code == 200
        # Three samples after the resume, the lines back to 0.
        resumed_at = len(stack.proxy.history)
        await wait_for(reactor, lambda: len(stack.proxy.history) >= resumed_at + 3)
        dom = Dom((await chromium(url, "--dump-dom")).decode("utf-8"))
        assert dom.by_id("state")["data-state"] == "available"
        assert dom.by_id("no-holds").get("hidden") is None
        assert len(dom.with_class("yield-band")) == 1
        assert dom.by_id("parked-batch")["data-count"] == "0"
        # The line started at 0 (before the yield) and is back there at its end.
        levels = [float(v) for v in re.findall(r"[MV]\s*(?:[\d.]+\s+)?([\d.]+)", dom.by_id("parked-batch-line")["d"])]
        assert levels[0] == levels[-1] and min(levels) < levels[0]

        # The screenshot taken while yielded: the band and the batch line are drawn.
        width, height, rows = read_png(png)
        assert (width, height) == (WIDTH, HEIGHT)
        # The chart sits in the lower part of the page, under the cards, who waits and the holds table.
        top, bottom = 280, HEIGHT
        band = count_pixels(rows, top, bottom, near(YIELD_BAND, 4))
        line = count_pixels(rows, top, bottom, near(BATCH, 30))
        ink = count_pixels(rows, top, bottom, lambda r, g, b: r + g + b < 600)
        assert band > 2000, f"yield band barely visible: {band} pixels"
        assert line > 100, f"batch line barely visible: {line} pixels"
        assert ink > 1000, f"chart looks empty: {ink} dark pixels"
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_page_warns_of_a_hold_kept_from_the_last_run_and_counts_who_waits_past_the_list():
    """A restart keeps holds: one older than the process is a warning that names it and the command that ends it.
    Twelve parked: the first ten listed, "and 2 more".  The time axis starts where the proxy did, and the
    in-flight line is drawn over the parked ones (at zero they all lie on the axis)."""
    from yieldproxy.lot.state import Hold

    chromium_path()
    stack = await start_stack(reactor, history_interval=0.2)
    pending = []
    try:
        started = stack.proxy.admin_app.started_at
        # What the holds file puts back at start-up (lifecycle/holdstore.py): a hold from an hour ago, no lease.
        stack.proxy.state.restore([Hold("game", "boss fight", since=started - 3600)])
        pending += [
            treq.post(stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": f"t{i}"}, persistent=False)
            .addTimeout(PARKED_TIMEOUT, reactor)
            for i in range(12)
        ]
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 12)
        at = len(stack.proxy.history)
        await wait_for(reactor, lambda: len(stack.proxy.history) >= at + 3)
        shot = os.environ.get("YIELDPROXY_KEEP_SCREENSHOT")
        dom = Dom((await chromium(stack.admin_url + "/", "--dump-dom")).decode("utf-8"))
        if shot:
            await chromium(stack.admin_url + "/", f"--screenshot={shot}.restored.png")

        warning = dom.by_id("restored")
        assert warning.get("hidden") is None and warning["role"] == "alert"
        assert "Kept from before the proxy started" in warning["text"]
        [line] = dom.with_class("restored-hold")
        assert line["data-source"] == "game" and "boss fight" in line["text"] and "no lease" in line["text"]
        assert [e["text"] for e in dom.with_class("resume-command")] == ["yieldproxy resume --source game"]

        assert len(dom.with_class("parked-request")) == 10
        more = dom.by_id("waiting-more")
        assert more.get("hidden") is None and more["text"] == "and 2 more" and more["data-more"] == "2"

        chart = dom.by_id("chart")
        assert float(chart["data-t0"]) >= started - 0.5, (chart["data-t0"], started)
        lines = [e for e in dom.elements if e["tag"] == "path" and e.get("id", "").endswith("-line")]
        assert lines[-1]["id"] == "inflight-line"
    finally:
        release_every_hold(stack.proxy.state)
        for d in pending:
            await d
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_page_without_the_token_asks_for_it_and_shows_nothing():
    chromium_path()
    stack, pending, auth = await yielded_stack_with_history()
    try:
        for url in (stack.admin_url + "/", stack.admin_url + "/#token=wrong"):
            dom = Dom((await chromium(url, "--dump-dom")).decode("utf-8"))
            assert dom.by_id("state")["data-state"] == "locked"
            assert dom.by_id("token-form").get("hidden") is None
            assert dom.by_id("main").get("hidden") is not None
            assert dom.with_class("hold") == []
            assert "boss fight" not in str(dom.elements)
        assert "refused" in dom.by_id("error")["text"]
    finally:
        await treq.post(stack.admin_url + "/resume", json={"source": "game"}, headers=auth, persistent=False)
        for d in pending:
            await d
        await stack.stop()


# -- other web pages cannot change or read anything (issue 10, finding 4) ---------------

ATTACK_PAGE = """<!doctype html>
<html><head><title>cat pictures</title></head><body>
<iframe name="one"></iframe><iframe name="two"></iframe>
<iframe id="page" src="{admin}/"></iframe>
<form id="resume" method="POST" action="{admin}/resume" target="one"></form>
<form id="yield" method="POST" action="{admin}/yield" enctype="text/plain" target="two">
<input name='{{"source": "form", "x": "' value='"}}'></form>
<script>
// What any page can send without a CORS preflight: text/plain, no body, forms.
fetch("{admin}/yield", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
                         body: '{{"source": "page", "reason": "pwned"}}'}});
fetch("{admin}/resume", {{method: "POST", mode: "no-cors"}});
navigator.sendBeacon("{admin}/resume", new Blob(['{{"source": "api"}}'], {{type: "text/plain"}}));
// JSON, as the status page's own buttons send it: another origin needs a CORS preflight, which the API never grants.
fetch("{admin}/yield", {{method: "POST", headers: {{"Content-Type": "application/json"}},
                         body: '{{"source": "cors", "reason": "pwned", "for_seconds": 60}}'}}).catch(() => {{}});
document.getElementById("resume").submit();
document.getElementById("yield").submit();
</script></body></html>
"""


async def serve_page(html: str):
    """A page of another origin, served on its own 127.0.0.1 port: (listening port, port number)."""
    from twisted.internet.endpoints import TCP4ServerEndpoint
    from twisted.web.resource import Resource
    from twisted.web.server import Site

    class Page(Resource):
        isLeaf = True

        def render_GET(self, request):
            request.setHeader(b"content-type", b"text/html; charset=utf-8")
            return html.encode("utf-8")

    listening = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(Page()))
    return listening, listening.getHost().port


@pytest_twisted.ensureDeferred
async def test_a_page_of_another_origin_cannot_yield_or_resume(monkeypatch):
    """Text/plain fetches, a beacon and form posts from another site reach the admin API and are refused."""
    chromium_path()
    from yieldproxy.edge.request import ProxyRequest

    answered = []
    process = ProxyRequest.process

    def spy(request):
        """Note each POST's path and the status it got (or 0 if it was never answered)."""
        if request.method == b"POST":
            request.notifyFinish().addBoth(lambda _: answered.append((request.path.decode(), request.code)))
        process(request)

    monkeypatch.setattr(ProxyRequest, "process", spy)
    stack = await start_stack(reactor)
    listening = None
    try:
        stack.proxy.state.hold("api", "the operator's game")
        listening, port = await serve_page(ATTACK_PAGE.format(admin=stack.admin_url))
        for origin in (f"http://localhost:{port}/", f"http://evil.test:{port}/"):
            await chromium(origin, "--dump-dom", "--host-resolver-rules=MAP evil.test 127.0.0.1")
        assert [(h.source, h.reason) for h in stack.proxy.state.holds] == [("api", "the operator's game")]
        # The browser did send them (two pages, five requests each), and every one was refused.
        await wait_for(reactor, lambda: len(answered) == 10)
        await sleep(reactor, 0.5)
        # The JSON fetch (what the status page's buttons send) never got past its preflight.
        assert len(answered) == 10, answered
        assert all(code in (403, 415) for _, code in answered), answered
        assert {path for path, _ in answered} == {"/yield", "/resume"}
    finally:
        if listening is not None:
            await listening.stopListening()
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_a_rebound_name_reads_nothing():
    """DNS rebinding: a browser that resolves evil.test to 127.0.0.1 gets 403 from both listeners."""
    chromium_path()
    stack, pending, auth = await yielded_stack_with_history()
    try:
        rules = "--host-resolver-rules=MAP evil.test 127.0.0.1"
        for url, key in ((stack.admin_url, "admin.allowed_hosts"), (stack.proxy_url, "proxy.allowed_hosts")):
            for path in ("/status", "/api/ps", "/"):
                rebound = url.replace("127.0.0.1", "evil.test") + path
                text = (await chromium(rebound, "--dump-dom", rules)).decode("utf-8")
                assert key in text and "boss fight" not in text and "yielded" not in text, (rebound, text[:300])
    finally:
        await treq.post(stack.admin_url + "/resume", json={"source": "game"}, headers=auth, persistent=False)
        for d in pending:
            await d
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_page_shows_each_upstream_of_a_pool():
    """Two upstreams, one yielded by name: a row each, with its state, who holds it, its models and its twins."""
    from helpers import start_pool_stack

    chromium_path()
    stack = await start_pool_stack(
        reactor,
        [
            {"name": "desktop", "models": ["llama3.2", "nomic-embed-text"]},
            {"name": "server", "models": ["all-minilm", "nomic-embed-text"], "model_map": {"nomic-embed-text": "other"}},
        ],
        token=TOKEN,
    )
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        answer = await treq.post(
            stack.admin_url + "/yield", json={"source": "game", "upstream": "desktop", "reason": REASON},
            headers=auth, persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert answer.code == 200
        dom = Dom((await chromium(f"{stack.admin_url}/#token={TOKEN}", "--dump-dom")).decode("utf-8"))
        assert dom.by_id("upstreams-section").get("hidden") is None
        rows = dom.with_class("upstream")
        assert [(r["data-upstream"], r["data-state"]) for r in rows] == [("desktop", "yielded"), ("server", "available")]
        assert [r["text"] for r in dom.with_class("held-by")] == ["game", "—"]
        assert [r["text"] for r in dom.with_class("models")] == [
            "llama3.2, nomic-embed-text", "all-minilm, nomic-embed-text",
        ]
        # server's nomic-embed-text is other weights: its twin verification failed.
        assert [r["text"] for r in dom.with_class("twins")] == ["—", "nomic-embed-text: mismatch"]
        # The hold names its upstream; the reason stays text.
        assert [h["text"] for h in dom.with_class("hold-upstream")] == ["desktop"]
        assert dom.with_class("reason")[0]["text"] == REASON
        assert dom.by_id("state")["data-state"] == "available"
        assert dom.by_id("state-detail")["text"].endswith("(desktop yielded)")
        # The yield form offers each upstream by name (or all of them).
        assert dom.by_id("hold-upstream-label").get("hidden") is None
        options = [e for e in dom.elements if e["tag"] == "option" and e.get("value") is not None and e["text"] in ("all", "desktop", "server")]
        assert [(o["value"], o["text"]) for o in options] == [("", "all"), ("desktop", "desktop"), ("server", "server")]
        # Each upstream's state over time, one strip each.
        assert [e["data-upstream"] for e in dom.with_class("upstream-strip")] == ["desktop", "server"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_page_says_unreachable_for_an_upstream_that_never_answered():
    """A single upstream nothing listens on: the page said "available" while every request got 502."""
    chromium_path()
    stack = await start_stack(reactor, upstream=f"http://127.0.0.1:{free_port()}", watchers=True)
    try:
        await wait_for(reactor, lambda: stack.proxy.scheduler.members[0].state_name() == "unreachable")
        dom = Dom((await chromium(stack.admin_url + "/", "--dump-dom")).decode("utf-8"))
        state = dom.by_id("state")
        assert state["data-state"] == "unreachable" and state["text"] == "unreachable"
        assert "not answered" in dom.by_id("state-detail")["text"]
        assert "state-unreachable" in state["class"]
    finally:
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_page_shows_a_model_failing_alone_on_its_upstream_and_why_that_is_no_outage():
    """Issue 24: a broken model's failure, judged by a probe of the model the upstream served, is its own: the
    page lists it under "Models failing alone" with its upstream and the evidence, and shows no hold."""
    from helpers import config_with

    chromium_path()
    stack = await start_stack(reactor, config_with(upstream={"max_attempts": 1}), watchers=True)
    try:
        await wait_for(reactor, lambda: stack.proxy.health.reachable)
        served = await treq.post(
            stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": "x"}, persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert served.code == 200
        await served.content()
        stack.sim.set_model_mode("broken", "error500_unknown")
        broken = await treq.post(
            stack.proxy_url + "/api/embed", json={"model": "broken", "input": "x"}, persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert broken.code == 500
        await broken.content()
        dom = Dom((await chromium(stack.admin_url + "/", "--dump-dom")).decode("utf-8"))
        assert dom.by_id("failing-section").get("hidden") is None
        rows = dom.with_class("failing-model")
        assert [(r["data-model"], r["data-upstream"]) for r in rows] == [("broken:latest", "default")]
        assert [r["text"] for r in dom.with_class("failing-name")] == ["broken"]
        assert dom.with_class("failing-reason")[0]["text"].startswith("unknown_error, ")
        assert [r["text"] for r in dom.with_class("failing-evidence")] == [
            "it serves all-minilm: a probe of /api/embed passed"
        ]
        assert dom.by_id("state")["data-state"] == "available"
    finally:
        await stack.stop()


# -- the page's own buttons, driven through the DevTools protocol (issue 19) -------------------


class DevTools:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fds 3 and 4, NUL-ended JSON), blocking.

    Run it in a thread (``in_thread``): the reactor keeps serving the page meanwhile.
    """

    def __init__(self, timeout: float = 60):
        import subprocess

        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="yp-chromium-", ignore_cleanup_errors=True)
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        args = [
            chromium_path(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", f"--user-data-dir={self._profile.name}", f"--window-size={WIDTH},{HEIGHT}",
            "--remote-debugging-pipe", "about:blank",
        ]
        self._process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-', "sh", *args],
            pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL,
            stderr=open(os.environ["YP_CHROME_LOG"], "wb") if os.environ.get("YP_CHROME_LOG") else subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next = 0
        self.session = None

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        import json
        import select
        import time

        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next:
                    assert "error" not in answer, answer
                    return answer["result"]
            left = deadline - time.monotonic()
            assert left > 0, f"no answer to {method} within {self.timeout} s"
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 65536)
                assert chunk, "chromium closed its pipe"
                self._buffer += chunk

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def run(self, expression: str):
        """The value of a JavaScript expression in the page (a Promise is awaited)."""
        result = self.send(
            "Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}, self.session,
        )
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def until(self, condition: str, timeout: float = 15) -> None:
        """Wait until a JavaScript condition is true in the page (a page still loading is waited for)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.run(f"(() => {{ try {{ return !!({condition}); }} catch (e) {{ return false; }} }})()"):
                    return
            except AssertionError as e:
                if "context" not in str(e):
                    raise  # not a page between two documents
            assert time.monotonic() < deadline, f"not true within {timeout} s: {condition}"
            time.sleep(0.05)

    def close(self) -> None:
        try:
            self._process.kill()
            self._process.wait(10)
        finally:
            os.close(self._to_chrome)
            os.close(self._from_chrome)
            self._profile.cleanup()


READ_TOKEN = "page-test-read-token-0123456789"


@pytest_twisted.ensureDeferred
async def test_the_pages_buttons_yield_and_resume_with_a_reason_and_a_lease():
    """Yield from the page (source, reason, a 2-minute lease), see the hold, Resume it; a read-only token is refused."""
    from helpers import in_thread

    chromium_path()
    stack = await start_stack(reactor, token=TOKEN, read_token=READ_TOKEN, history_interval=0.2)
    holds = lambda: [(h.source, h.reason, h.scope, h.expires_at) for h in stack.proxy.state.holds]  # noqa: E731

    def drive() -> dict:
        seen: dict = {}
        browser = DevTools()
        try:
            browser.open(f"{stack.admin_url}/#token={TOKEN}")
            browser.until("document.getElementById('state').dataset.state === 'available'")
            browser.run(
                "document.getElementById('hold-source').value = 'operator';"
                "document.getElementById('hold-reason').value = 'driver update <b>now</b>';"
                "document.getElementById('hold-lease').value = '2';"
                "document.getElementById('yield-button').click()"
            )
            browser.until("document.querySelector('tr.hold[data-source=operator]')")
            seen["after_yield"] = holds()
            seen["badge"] = browser.run("document.getElementById('state').dataset.state")
            seen["result"] = browser.run("document.getElementById('control-result').textContent")
            seen["reason_shown"] = browser.run("document.querySelector('tr.hold .reason').textContent")
            browser.run("document.querySelector('tr.hold[data-source=operator] button.resume').click()")
            browser.until("!document.getElementById('no-holds').hidden")
            seen["after_resume"] = holds()
            seen["badge_after"] = browser.run("document.getElementById('state').dataset.state")

            # The read-only token shows the state but cannot change it: the API's 403, shown.
            browser.open(f"{stack.admin_url}/#token={READ_TOKEN}")
            browser.until("document.getElementById('state').dataset.state === 'available'")
            browser.run("document.getElementById('yield-button').click()")
            browser.until("document.getElementById('control-result').className === 'failed'")
            seen["read_only"] = browser.run("document.getElementById('control-result').textContent")
            seen["after_read_only"] = holds()
        finally:
            browser.close()
        return seen

    try:
        start = reactor.seconds()
        seen = await in_thread(reactor, drive, timeout=120)
        [(source, reason, scope, expires_at)] = seen["after_yield"]
        assert (source, reason, scope) == ("operator", "driver update <b>now</b>", "*")
        assert start + 100 < expires_at < reactor.seconds() + 121  # a lease of 2 minutes
        assert seen["badge"] == "yielded" and seen["reason_shown"] == "driver update <b>now</b>"
        assert seen["result"].startswith("Yielded: operator holds the GPU for 2 min")
        assert seen["after_resume"] == [] and seen["badge_after"] == "available"
        assert "may only read" in seen["read_only"] and seen["after_read_only"] == []
    finally:
        release_every_hold(stack.proxy.state)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_the_page_shows_what_expired_or_was_refused_and_each_upstreams_history():
    """Lost or refused in the last hour, per class; each upstream's states as strips under the chart."""
    from helpers import config_with

    chromium_path()
    config = config_with(classes={"interactive": {"hold_seconds": 0.3}, "long": {"policy": "reject"}})
    stack = await start_stack(reactor, config=config, history_interval=0.2)
    try:
        stack.proxy.state.hold("game", "boss fight")
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
        expired = [
            await treq.post(stack.proxy_url + "/api/chat", json=chat, persistent=False).addTimeout(TIMEOUT, reactor)
            for _ in range(2)
        ]
        refused = await treq.post(
            stack.proxy_url + "/api/generate", json={"model": "m", "prompt": "p"}, headers={"X-Yield-Class": "long"},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert [r.code for r in expired] == [503, 503] and refused.code == 503
        at = len(stack.proxy.history)
        await wait_for(reactor, lambda: len(stack.proxy.history) >= at + 3)
        stack.proxy.state.release("game")
        at = len(stack.proxy.history)
        await wait_for(reactor, lambda: len(stack.proxy.history) >= at + 3)
        dom = Dom((await chromium(stack.admin_url + "/", "--dump-dom")).decode("utf-8"))
        rows = {r["data-class"]: (r["data-expired"], r["data-rejected"]) for r in dom.with_class("lost")}
        assert rows == {"interactive": ("2", "0"), "batch": ("0", "0"), "long": ("0", "1")}, rows
        [strip] = dom.with_class("upstream-strip")
        assert strip["data-upstream"] == "default"
        bands = [e["data-state"] for e in dom.with_class("upstream-band")]
        assert bands == ["available", "yielded", "available"], bands
    finally:
        release_every_hold(stack.proxy.state)
        await stack.stop()


@pytest_twisted.ensureDeferred
async def test_the_simplest_screenshot_shows_the_state_not_connecting():
    """``chromium --headless --screenshot URL``, no flags that wait for scripts: the served page already says the state."""
    chromium_path()
    stack = await start_stack(reactor)
    try:
        stack.proxy.state.hold("game", "boss fight <i>")
        page = await treq.get(stack.admin_url + "/", persistent=False).addTimeout(TIMEOUT, reactor)
        served = Dom((await page.content()).decode("utf-8"))
        # Without running a script, the page says the state, who holds it and why (escaped), and that it needs JS.
        assert served.by_id("state")["data-state"] == "yielded" and served.by_id("state")["text"] == "yielded"
        assert served.by_id("state-detail")["text"] == "held by game"
        assert "game holds all: boss fight <i>" in served.by_id("summary")["text"]
        assert not [e for e in served.elements if e["tag"] == "i"]
        assert "connecting" not in str(served.elements)
        assert [e for e in served.elements if e["tag"] == "noscript"]

        with tempfile.TemporaryDirectory(prefix="yp-shot-") as tmp:
            shot = os.path.join(tmp, "simplest.png")
            binary = chromium_path()
            protocol = _Collect()
            process = reactor.spawnProcess(
                protocol, binary,
                [binary, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp}/profile",
                 f"--screenshot={shot}", "--window-size=1200,800", stack.admin_url + "/"],
                env={**os.environ, "LANG": "C.UTF-8"},
            )
            killer = reactor.callLater(60, process.signalProcess, "KILL")
            try:
                assert await protocol.ended == 0, protocol.err[-2000:]
            finally:
                if killer.active():
                    killer.cancel()
            if os.environ.get("YIELDPROXY_KEEP_SCREENSHOT"):
                shutil.copy(shot, os.environ["YIELDPROXY_KEEP_SCREENSHOT"] + ".simplest.png")
            with open(shot, "rb") as f:
                width, height, rows = read_png(f.read())
        # The red "yielded" badge is in the header, whether or not the script had its answer yet.
        red = count_pixels(rows, 0, 70, near((0xCF, 0x22, 0x2E), 10))
        assert red > 300, f"no yielded badge in the header: {red} pixels"
    finally:
        release_every_hold(stack.proxy.state)
        await stack.stop()
