"""The status page's history ring buffer, and the admin routes that serve it and the page.

Reactor-free: a Clock drives the sampler; the admin app is exercised through
``StubTreq`` (a real Agent and Site in memory).
"""

from __future__ import annotations

import json

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from helpers import release_every_hold
from yieldproxy.config import Config
from yieldproxy.lot.parking import Entry
from yieldproxy.observe.history import History, Snapshot, snapshot_reader
from yieldproxy.service import build

CLASSES = ("interactive", "batch", "long")


class Reader:
    """A stand-in for the live objects: whatever the test sets is what gets sampled."""

    def __init__(self):
        self.state = "available"
        self.parked = {}
        self.inflight = 0
        self.fail = False
        self.calls = 0

    def __call__(self) -> Snapshot:
        self.calls += 1
        if self.fail:
            raise RuntimeError("boom")
        return Snapshot(self.state, dict(self.parked), self.inflight)


class HistoryTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.reader = Reader()
        self.history = History(self.clock, self.reader, CLASSES, interval=1.0, capacity=5)

    def test_samples_every_interval_while_started(self):
        self.history.startService()
        self.assertEqual(len(self.history), 1)  # at once
        self.reader.state, self.reader.parked, self.reader.inflight = "yielded", {"batch": 3}, 2
        self.clock.advance(1)
        self.clock.advance(1)
        self.assertEqual(len(self.history), 3)
        last = self.history.as_json()["samples"][-1]
        self.assertEqual(
            last, {"t": 1002.0, "state": "yielded", "parked": {"interactive": 0, "batch": 3, "long": 0}, "inflight": 2}
        )
        self.history.stopService()
        self.clock.advance(10)
        self.assertEqual(len(self.history), 3)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_keeps_only_capacity_samples_oldest_dropped(self):
        self.history.startService()
        self.clock.pump([1] * 9)
        times = [s.t for s in self.history.samples()]
        self.assertEqual(times, [1005.0, 1006.0, 1007.0, 1008.0, 1009.0])
        self.history.stopService()

    def test_since_returns_only_newer_samples(self):
        self.history.startService()
        self.clock.pump([1] * 3)
        body = self.history.as_json(since=1001.0)
        self.assertEqual([s["t"] for s in body["samples"]], [1002.0, 1003.0])
        self.assertEqual(self.history.as_json(since=1003.0)["samples"], [])
        self.assertEqual(body["now"], 1003.0)
        self.assertEqual(body["classes"], list(CLASSES))
        self.assertEqual((body["interval"], body["capacity"]), (1.0, 5))
        self.history.stopService()

    def test_a_failing_read_is_logged_and_sampling_goes_on(self):
        self.history.startService()
        self.reader.fail = True
        self.clock.advance(1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertTrue(self.history.running)
        self.reader.fail = False
        self.clock.advance(1)
        self.assertEqual(len(self.history), 2)
        self.history.stopService()

    def test_state_change_adds_a_sample_only_while_running(self):
        self.history.state_changed(True)
        self.assertEqual(len(self.history), 0)
        self.history.startService()
        self.clock.advance(0.25)
        self.reader.state = "yielded"
        self.history.state_changed(True)
        self.assertEqual([(s.t, s.state) for s in self.history.samples()], [(1000.0, "available"), (1000.25, "yielded")])
        self.history.stopService()

    def test_sample_times_strictly_increase(self):
        """A change sampled in the same millisecond as a tick still reads back after it with ``since``."""
        self.history.startService()
        self.reader.state = "yielded"
        self.history.state_changed(True)
        times = [s.t for s in self.history.samples()]
        self.assertEqual(times, [1000.0, 1000.001])
        self.assertEqual([s.state for s in self.history.samples(since=1000.0)], ["yielded"])
        self.history.stopService()

    def test_a_shorter_interval(self):
        history = History(self.clock, self.reader, CLASSES, interval=0.25)
        history.startService()
        self.clock.pump([0.25] * 4)
        self.assertEqual([s.t for s in history.samples()], [1000.0, 1000.25, 1000.5, 1000.75, 1001.0])
        history.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])


class BuiltProxyTests(SynchronousTestCase):
    """The history as ``build()`` wires it: the same numbers as ``/status``."""

    def test_reads_state_and_parked_counts_and_samples_on_yield(self):
        clock = Clock()
        proxy = build(clock, Config())
        proxy.history.startService()
        proxy.state.hold("game", reason="boss fight")
        d = proxy.scheduler.admit(Entry(cls="batch", size=3))
        clock.advance(1)
        samples = proxy.history.as_json()["samples"]
        self.assertEqual([s["state"] for s in samples], ["available", "yielded", "yielded"])
        self.assertEqual(samples[-1]["parked"], {"interactive": 0, "batch": 1, "long": 0})
        proxy.history.stopService()
        d.cancel()
        self.failureResultOf(d)
        release_every_hold(proxy.state)

    def test_lost_counts_expired_and_refused_per_class_and_each_upstreams_state(self):
        clock = Clock()
        proxy = build(clock, Config())
        proxy.history.startService()
        start = clock.seconds()
        metrics = proxy.metrics
        metrics.replay_total.labels("batch", "expired").inc(2)
        metrics.replay_total.labels("batch", "ok").inc(5)
        metrics.rejected_total.labels("interactive", "queue_full").inc()
        metrics.rejected_total.labels("interactive", "over_budget").inc(2)
        proxy.state.hold("game", reason="boss fight")
        clock.advance(1)
        data = proxy.history.as_json()
        self.assertEqual(data["lost"], {
            "since": start,
            "expired": {"interactive": 0, "batch": 2, "long": 0},
            "rejected": {"interactive": 3, "batch": 0, "long": 0},
        })
        self.assertEqual(data["upstreams"], ["default"])
        self.assertEqual([s["upstreams"] for s in data["samples"]],
                         [{"default": "available"}, {"default": "yielded"}, {"default": "yielded"}])
        proxy.history.stopService()
        release_every_hold(proxy.state)

    def test_lost_once_full_counts_only_what_the_buffer_covers(self):
        totals = {"batch": 0}

        def read():
            return Snapshot("available", {}, 0, expired=dict(totals), rejected={"long": 7})

        clock = Clock()
        history = History(clock, read, CLASSES, interval=1.0, capacity=3)
        history.startService()
        totals["batch"] = 4  # before the oldest sample the buffer will keep
        clock.advance(1)
        totals["batch"] = 5
        clock.advance(1)
        self.assertEqual(history.lost()["expired"]["batch"], 5)  # not full: counted from the start
        totals["batch"] = 9
        clock.advance(1)
        lost = history.lost()
        self.assertEqual((lost["since"], lost["expired"]["batch"], lost["rejected"]["long"]), (1.0, 5, 0))
        history.stopService()
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_snapshot_reader_lists_every_class(self):
        class Lot:
            def count_by_class(self):
                return {"long": 2}

        class Scheduler:
            state_name = "draining"
            inflight = 3

        snap = snapshot_reader(Scheduler(), Lot(), CLASSES)()
        self.assertEqual(snap, Snapshot("draining", {"interactive": 0, "batch": 0, "long": 2}, 3))


class AdminPageTests(SynchronousTestCase):
    """``GET /``, ``/static/*`` and ``GET /history`` on the admin app."""

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(500)
        self.proxy = build(self.clock, Config(), token="s3cret")
        self.proxy.history.startService()
        self.clock.advance(1)
        self.clock.advance(1)
        self.http = StubTreq(self.proxy.admin_app.app.resource())

    def tearDown(self):
        self.proxy.history.stopService()

    def get(self, path, token=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = self.successResultOf(self.http.get("http://admin" + path, headers=headers))
        body = self.successResultOf(response.content())
        return response, body

    def test_history_needs_the_token(self):
        for token in (None, "wrong"):
            response, body = self.get("/history", token)
            self.assertEqual(response.code, 401)
            self.assertNotIn(b"s3cret", body)
            self.assertNotIn(b"samples", body)

    def test_history_json_and_since(self):
        response, body = self.get("/history", "s3cret")
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("cache-control"), ["no-store"])
        data = json.loads(body)
        self.assertEqual([s["t"] for s in data["samples"]], [500.0, 501.0, 502.0])
        self.assertEqual(data["samples"][0]["state"], "available")
        response, body = self.get("/history?since=501", "s3cret")
        self.assertEqual([s["t"] for s in json.loads(body)["samples"]], [502.0])

    def test_history_rejects_a_bad_since(self):
        for bad in ("abc", "nan", "inf"):
            response, body = self.get(f"/history?since={bad}", "s3cret")
            self.assertEqual(response.code, 400, bad)
            self.assertIn(b"since", body)

    def test_page_and_its_files_are_public_and_locked_down(self):
        for path, kind in [
            ("/", "text/html"),
            ("/static/index.html", "text/html"),
            ("/static/status.js", "text/javascript"),
            ("/static/status.css", "text/css"),
        ]:
            response, body = self.get(path)
            self.assertEqual(response.code, 200, path)
            self.assertTrue(response.headers.getRawHeaders("content-type")[0].startswith(kind), path)
            csp = response.headers.getRawHeaders("content-security-policy")[0]
            self.assertIn("default-src 'none'", csp)
            self.assertIn("connect-src 'self'", csp)
            self.assertNotIn("unsafe-inline", csp)
            self.assertEqual(response.headers.getRawHeaders("x-content-type-options"), ["nosniff"])
            self.assertTrue(body)
        # The page is the same for everyone: no state, no token in it.
        _, page = self.get("/")
        self.assertNotIn(b"s3cret", page)
        self.assertIn(b'src="static/status.js"', page)

    def test_only_the_page_files_are_served(self):
        for path in ("/static/admin.py", "/static/..%2fadmin.py", "/static/", "/static/nope.js"):
            response, _ = self.get(path)
            self.assertEqual(response.code, 404, path)

    def test_the_page_with_a_token_holds_no_state_and_says_why(self):
        self.proxy.state.hold("game", reason="boss fight")
        _, page = self.get("/")
        self.assertIn(b'data-state="locked">token needed<', page)
        self.assertNotIn(b"game", page)
        self.assertNotIn(b"yielded", page)
        self.assertIn(b"<noscript>", page)
        release_every_hold(self.proxy.state)

    def test_the_page_without_a_token_is_served_with_the_state(self):
        proxy = build(self.clock, Config())
        self.proxy.state.hold("x", reason="x")  # another proxy's hold: not this page's
        proxy.state.hold("game", reason='<img src=x onerror="alert(1)">')
        response = self.successResultOf(StubTreq(proxy.admin_app.app.resource()).get("http://admin/"))
        page = self.successResultOf(response.content()).decode()
        self.assertIn('data-state="yielded">yielded</span>', page)
        self.assertIn('<span id="state-detail">held by game</span>', page)
        self.assertIn("game holds all: &lt;img src=x onerror=&quot;alert(1)&quot;&gt;", page)
        self.assertNotIn("<img", page)
        self.assertNotIn("connecting", page)
        release_every_hold(proxy.state)
        release_every_hold(self.proxy.state)

    def test_the_page_has_no_inline_script_or_style(self):
        """The CSP forbids inline code, so none may creep in."""
        _, page = self.get("/")
        self.assertNotIn(b"<script>", page)
        self.assertNotIn(b"<style", page)
        self.assertNotIn(b" style=", page)
        self.assertNotIn(b" onclick=", page)
        _, script = self.get("/static/status.js")
        self.assertNotIn(b"innerHTML", script)
        self.assertNotIn(b"eval(", script)
