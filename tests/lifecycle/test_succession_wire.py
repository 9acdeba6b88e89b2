"""The handover's frames and records (lifecycle/succession/wire.py): sans-IO, so they are checked here byte by byte."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import assume, example, given, settings, strategies as st
from twisted.web.http_headers import Headers

from helpers import config_with
from inmemory import Rig
from yieldproxy.edge.reader import BodyData, ChunkAnnounced, EndOfMessage, Refusal, RequestHead, RequestReader
from yieldproxy.edge.site import ProxySite
from yieldproxy.lifecycle.succession.wire import (
    BATCH_FDS,
    HEADER,
    BadFrame,
    Carried,
    Decoder,
    cut,
    encode,
    pack,
    request_bytes,
    unpack,
)
from yieldproxy.lot.parking import Standing
from yieldproxy.upstream.attempt import upstream_request_headers


def test_frames_come_out_whole_however_the_bytes_are_cut():
    frames = [encode({"type": "a", "n": i}, bytes([i]) * i) for i in range(5)]
    stream = b"".join(frames)
    for step in (1, 3, 7, len(stream)):
        decoder = Decoder()
        out = []
        for start in range(0, len(stream), step):
            out.extend(decoder.feed(stream[start:start + step]))
        assert out == [({"type": "a", "n": i}, bytes([i]) * i) for i in range(5)]


@pytest.mark.parametrize("frame", [
    HEADER.pack(5, 0) + b"notjs",
    HEADER.pack(2, 0) + b"[]",
    HEADER.pack(2, 0) + b"{}",
    HEADER.pack(1 << 30, 0),
])
def test_what_is_not_a_frame_is_refused(frame):
    with pytest.raises(BadFrame):
        list(Decoder().feed(frame))


def test_a_request_is_sent_again_whole_with_its_length_and_without_its_framing():
    data = request_bytes(
        b"POST", b"/api/embed?x=1",
        [(b"Host", [b"127.0.0.1"]), (b"Transfer-Encoding", [b"chunked"]), (b"Expect", [b"100-continue"]),
         (b"X-Twice", [b"a", b"b"]), (b"Content-Length", [b"999"])],
        b'{"input": "x"}',
    )
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.split(b"\r\n") == [
        b"POST /api/embed?x=1 HTTP/1.1", b"Host:127.0.0.1", b"X-Twice:a", b"X-Twice:b", b"Content-Length:14",
    ]
    assert body == b'{"input": "x"}'
    assert request_bytes(b"GET", b"/api/tags", [], b"") == b"GET /api/tags HTTP/1.1\r\n\r\n"


def test_records_point_into_one_blob_and_come_back_as_they_went():
    records = [({"n": i}, b"x" * i) for i in range(4)]
    packed, blob = pack(records)
    assert blob == b"x" * 6
    assert list(unpack(packed, blob)) == records
    with pytest.raises(BadFrame):
        list(unpack([{"bytes": [5, 5]}], blob))


def test_batches_are_cut_by_descriptors_and_by_bytes():
    many = [({}, b"") for _ in range(BATCH_FDS * 2 + 1)]
    assert [len(batch) for batch in cut(many)] == [BATCH_FDS, BATCH_FDS, 1]
    big = [({}, b"x" * (5 * 1024 * 1024)) for _ in range(3)]
    assert [len(batch) for batch in cut(big)] == [2, 1]


def test_what_a_parked_request_carries_is_checked():
    standing = Standing(cls="batch", max_wait=5.0, attempts=1, deadline=601.0, failed_on="gpu")
    carried = Carried(started_at=1.0, standing=standing)
    assert Carried.from_json(carried.as_json()) == carried
    # One flat object per request on the wire.
    assert carried.as_json() == {"started_at": 1.0, **attrs.asdict(standing)}
    with pytest.raises(BadFrame):
        Carried.from_json({**carried.as_json(), "surprise": 1})
    with pytest.raises(BadFrame):
        Carried.from_json({"cls": "batch"})
    with pytest.raises(BadFrame):
        Carried.from_json({"started_at": 1.0})
    with pytest.raises(BadFrame):
        Carried.from_json({"started_at": 1.0})


def test_reload_needs_the_admin_token_and_json_and_a_proxy_started_by_twistd():
    rig = Rig(config_with(), token="s3cret")
    assert rig.call("POST", rig.admin_url + "/reload", json={}).code == 401
    headers = {"Authorization": "Bearer s3cret"}
    assert rig.call("POST", rig.admin_url + "/reload", data=b"x", headers=headers).code == 415
    answer = rig.call("POST", rig.admin_url + "/reload", json={}, headers=headers)
    assert answer.code == 501 and "not started by twistd" in answer.json()["error"]


def test_the_new_process_takes_the_holds_as_they_were_and_drops_those_the_old_one_ended():
    """``restore`` (the ``state`` frame): a carried hold keeps its start and lease end; a caller's hold the
    holds file still had but the old process ended meanwhile ends; a watcher's own hold is left to its watcher."""
    from yieldproxy.lifecycle.succession import Setup, Succession

    rig = Rig(config_with())
    clock, state = rig.clock, rig.proxy.state
    clock.advance(1000)
    state.hold("ended-meanwhile", "read from the holds file")
    state.hold("file", "the state file says so")
    succession = Succession(
        clock, Setup(("twistd",), {}, lambda: None), {}, {}, rig.proxy.proxy_app, rig.proxy.lot, rig.proxy.scheduler,
        state,
    )
    succession.restore({"holds": [
        {"source": "broker", "reason": "game", "since": 900.0, "expires_at": 1100.0, "expected_end": None,
         "scope": "*"},
        {"source": "gone", "reason": "", "since": 950.0, "expires_at": None, "expected_end": None, "scope": "x"},
    ], "twins": []})
    holds = {h.source: h for h in state.holds}
    assert set(holds) == {"broker", "file"}
    assert (holds["broker"].since, holds["broker"].expires_at) == (900.0, 1100.0)
    clock.advance(100)  # its lease runs out when it would have in the old process
    assert {h.source for h in state.holds} == {"file"}


def test_an_adopted_request_parks_ahead_of_arrivals_with_its_arrival_and_deadline():
    """``ProxyApp.adopt``: the request is read again on its (adopted) connection, and parks with what it
    carried: its class, its first park and deadline (not the reload's time), its place ahead of what
    arrived here; it expires when it would have in the old process."""
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    rig = Rig(config_with())
    clock = rig.clock
    clock.advance(10_000)
    rig.proxy.state.hold("game")
    arrived = rig.post("/api/embed", {"model": "all-minilm", "input": "arrived here"})
    rig.turn()
    assert len(rig.proxy.lot) == 1
    channel = rig.proxy.proxy_app.site().buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    transport = StringTransport()
    channel.makeConnection(transport)
    now = clock.seconds()
    carried = Carried(
        started_at=now - 100,
        standing=Standing(cls="interactive", parked_seconds=99.0, first_parked=now - 99, deadline=now + 20),
    )
    body = b'{"model": "all-minilm", "input": "from the old process"}'
    rig.proxy.proxy_app.adopt(
        channel, carried, {"state": "fresh"}, request_bytes(b"POST", b"/api/embed", [(b"Host", [b"127.0.0.1:11435"])], body),
    )
    first, second = rig.proxy.lot.entries()
    assert first.cls == "interactive" and (first.first_parked, first.deadline) == (now - 99, now + 20)
    assert second.cls == "batch"
    clock.advance(20)
    rig.turn()
    answer = transport.value()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"parked past the hold bound (119s" in answer
    assert [e.cls for e in rig.proxy.lot.entries()] == ["batch"]  # the arrival waits on
    rig.proxy.state.release("game")
    rig.turn()
    assert rig.result(arrived).code == 200


def test_the_twins_verifications_go_over_for_the_same_upstreams_only():
    """A verified twin stays verified in the new process when its name and URL (and its reference's) are the
    same; one whose URL changed is verified again there."""
    from helpers import pool_config
    from yieldproxy.lifecycle.succession import Setup, Succession
    from yieldproxy.upstream.pool.twins import TwinCheck

    def succession(config):
        rig = Rig(config)
        p = rig.proxy
        return rig, Succession(
            rig.clock, Setup(("twistd",), {}, lambda: None), {}, {}, p.proxy_app, p.lot, p.scheduler, p.state, p.twins,
        )

    members = ({"name": "gpu", "models": ("all-minilm",)}, {"name": "cpu", "models": ("all-minilm",)})
    old_rig, old = succession(pool_config(*members))
    check = TwinCheck(reference="gpu", result="ok", at=5.0, worst_cosine=0.9999, dimension=384)
    old_rig.proxy.twins.checks[("cpu", "all-minilm:latest")] = check
    snapshot = old.snapshot()

    same_rig, same = succession(pool_config(*members))
    same.restore(snapshot)
    assert same_rig.proxy.twins.checks == {("cpu", "all-minilm:latest"): check}

    moved = ({"name": "gpu", "models": ("all-minilm",)}, {"name": "cpu", "url": "http://127.0.0.1:29999",
                                                          "models": ("all-minilm",)})
    moved_rig, changed = succession(pool_config(*moved))
    changed.restore(snapshot)
    assert moved_rig.proxy.twins.checks == {}


def test_a_hold_change_asked_of_a_process_that_handed_its_holds_over_is_refused_503_with_retry_after():
    """Once a reload handed the holds to a new process, ``POST /yield`` and ``POST /resume`` asked of the old one
    (on a connection it still has, its new process gone) change nothing and say so: 503, Retry-After 1."""
    rig = Rig(config_with())
    headers = {"Content-Type": "application/json"}
    rig.proxy.admin_app.holds_elsewhere = lambda: "this process (pid 1) has handed the holds over to pid 2"
    for path in ("/yield", "/resume"):
        answer = rig.call("POST", rig.admin_url + path, json={"source": "broker"}, headers=headers)
        assert answer.code == 503 and answer.headers.getRawHeaders(b"retry-after") == [b"1"], path
        assert "handed the holds over to pid 2" in answer.json()["error"]
    assert rig.proxy.state.holds == []
    rig.proxy.admin_app.holds_elsewhere = lambda: None
    assert rig.call("POST", rig.admin_url + "/yield", json={"source": "broker"}, headers=headers).code == 200
    assert [h.source for h in rig.proxy.state.holds] == ["broker"]


def test_a_signal_handled_once_the_holds_are_another_processs_takes_no_hold():
    """The signal watcher asks who owns the holds as it handles a signal, not as it comes: a SIGUSR1 that came
    just before a reload's commit and is handled after it takes no hold the new process would not have."""
    import signal

    from yieldproxy.observe.metrics import Metrics
    from yieldproxy.watchers.signals import SignalWatcher

    rig = Rig(config_with())
    watcher = SignalWatcher(rig.clock, rig.proxy.state, Metrics())
    watcher.holds_elsewhere = lambda: "this process has handed the holds over to pid 2"
    watcher.handle(signal.SIGUSR1)
    assert rig.proxy.state.holds == []
    watcher.holds_elsewhere = lambda: None
    watcher.handle(signal.SIGUSR1)
    assert [h.source for h in rig.proxy.state.holds] == ["signal"]


# -- a parked request sent again reads as the same request -------------------------------------------------

LIMITS = ProxySite.reader_limits
_TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1, max_size=12)


def _read(data: bytes) -> tuple[RequestHead, bytes] | Refusal:
    """What an edge reads from ``data`` (edge/reader.py, with the proxy listener's limits)."""
    reader = RequestReader(LIMITS)
    reader.feed(data)
    head, body = None, []
    while True:
        event = reader.next_event()
        if isinstance(event, Refusal):
            return event
        if isinstance(event, RequestHead):
            head = event
        elif isinstance(event, BodyData):
            body.append(event.data)
        elif isinstance(event, EndOfMessage):
            assert head is not None
            return head, b"".join(body)
        elif not isinstance(event, ChunkAnnounced):
            raise AssertionError(f"{event!r}: the request is not whole")


def _request_headers(head: RequestHead) -> Headers:
    """The headers as the edge gives them to the proxy (edge/connection.py: each line added as it came)."""
    headers = Headers()
    for name, value in head.headers:
        headers.addRawHeader(name, value)
    return headers


def _forwarded(head: RequestHead, body: bytes) -> tuple:
    """What the proxy sends upstream for it: its line, the headers it forwards (upstream/attempt.py), its body."""
    return head.method, head.target, head.version, upstream_request_headers(_request_headers(head)), body


@st.composite
def received(draw) -> bytes:
    """A request as a client may send it, its head up to the listener's limits: bodiless or with a body (a
    length, chunked, with ``Expect``), headers repeated, with or without whitespace around each value."""
    method = draw(st.sampled_from([b"POST", b"GET", b"PUT", b"DELETE"]))
    target = b"/api/embed" + draw(st.sampled_from([b"", b"?x=1", b"?" + b"q" * 300]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    framing = draw(st.sampled_from(["none", "length", "zero", "chunked"]))
    body = draw(st.binary(min_size=1, max_size=64)) if framing in ("length", "chunked") else b""
    framing_lines = {"none": [], "zero": [b"Content-Length: 0"], "length": [b"Content-Length: %d" % len(body)],
                     "chunked": [b"Transfer-Encoding: chunked"]}[framing]
    if framing != "none" and version == b"HTTP/1.1" and draw(st.booleans()):
        framing_lines.append(b"Expect: 100-continue")
    names = draw(st.lists(_TOKEN.map(lambda t: b"X-" + t.encode()), min_size=1, max_size=5))
    count = draw(st.sampled_from([1, 10, LIMITS.max_headers - len(framing_lines)]))
    spaced = draw(st.sampled_from([b"", b" ", b"  "]))
    lines = [b"%s:%s%s" % (names[i % len(names)], spaced, b"v%d" % i) for i in range(count)]
    # The last header brings the head to its limit, or just under it.
    line_bytes = len(b"%s %s %s" % (method, target, version)) + sum(map(len, lines)) + sum(map(len, framing_lines))
    room = LIMITS.max_head_bytes - line_bytes - draw(st.sampled_from([0, 1, 4, 2000]))
    if room > len(lines[-1]):
        lines[-1] += b"f" * min(room - len(lines[-1]), LIMITS.max_line_bytes - len(lines[-1]))
    lines[draw(st.integers(0, len(lines) - 1)):0] = framing_lines
    head = b"\r\n".join([b"%s %s %s" % (method, target, version), *lines]) + b"\r\n\r\n"
    if framing == "chunked":
        return head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head + body


#: The two of the report: a bodiless POST with 100 header lines, and one whose head is 16,380 bytes.
_HUNDRED_LINES = b"POST /api/embed HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(100)) + b"\r\n"
_LINE = b"POST /api/embed HTTP/1.1"
_NEAR_THE_LIMIT = _LINE + b"\r\nX-Pad: " + b"p" * (16380 - len(_LINE) - len(b"X-Pad: ")) + b"\r\n\r\n"


@settings(max_examples=300, deadline=None)
@example(_HUNDRED_LINES)
@example(_NEAR_THE_LIMIT)
@given(received())
def test_a_request_sent_again_is_read_as_the_same_request_whatever_its_head(data):
    """What the old process would forward, the new one forwards (nothing refused for the limits, nothing
    added, nothing lost): the request rebuilt from what the old process read (connections._rebuilt) read
    again as the new process reads it."""
    old = _read(data)
    assume(not isinstance(old, Refusal))  # the old process refused it: nothing parked, nothing sent on
    head, body = old
    again = request_bytes(head.method, head.target, _request_headers(head).getAllRawHeaders(), body, head.version)
    new = _read(again)
    assert not isinstance(new, Refusal), (new, len(again))
    assert _forwarded(*new) == _forwarded(head, body)
    assert (new[0].length is None) == (head.length is None and not head.chunked)
