"""``GET /parked``: who waits, a page at a time, on a Clock (issue 32, item 6).

Each parked request as the admin API lists it: its route, model, class,
upstreams, client, how long it has waited, the bound it waits under (its
class's ``hold_seconds`` or its caller's ``X-Yield-Max-Wait``) and its place
in line.  Pages walk the lot in arrival order, each parked request once, and
no page is longer than ``limit`` (at most 500).  A hold older than the process
(kept by the holds file across a restart) says so in ``/status``.
"""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings, strategies as st
from twisted.internet.task import Clock

from helpers import config_with
from inmemory import Rig, answered
from yieldproxy.lifecycle.holdstore import HoldStore

CHAT = {"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}], "stream": False}


def clock_at(seconds: float) -> Clock:
    clock = Clock()
    clock.advance(seconds)
    return clock


def get(rig: Rig, path: str, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return rig.call("GET", rig.admin_url + path, headers=headers)


def embed(rig: Rig, text: str, max_wait: float | None = None):
    headers = {"X-Yield-Max-Wait": f"{max_wait:g}"} if max_wait is not None else {}
    return rig.post("/api/embed", {"model": "all-minilm", "input": text}, headers=headers)


def test_parked_lists_who_waits_and_under_which_bound():
    rig = Rig()
    assert get(rig, "/parked").json() == {
        "total": 0, "offset": 0, "limit": 50, "next_offset": None, "now": rig.clock.seconds(), "parked": [],
    }
    rig.proxy.state.hold("game", "boss fight")
    first = embed(rig, "a")
    rig.run(5)
    second = embed(rig, "b", max_wait=30)
    chat = rig.post("/api/chat", CHAT)
    rig.run(2)
    listing = get(rig, "/parked").json()
    assert listing["total"] == 3 and listing["next_offset"] is None
    rows = listing["parked"]
    assert [(r["position"], r["class_position"], r["class"], r["route"], r["model"]) for r in rows] == [
        (1, 1, "batch", "/api/embed", "all-minilm"),
        (2, 2, "batch", "/api/embed", "all-minilm"),
        (3, 1, "interactive", "/api/chat", "llama3.2"),
    ]
    assert all(r["upstreams"] == ["default"] and re.fullmatch(r"127\.0\.0\.1:\d+", r["client"]) for r in rows)
    assert [r["waited_seconds"] for r in rows] == [7, 2, 2]
    batch_bound = rig.proxy.config.classes["batch"].hold_seconds
    assert (rows[0]["bound_seconds"], rows[0]["bound_by"], rows[0]["remaining_seconds"]) == (
        batch_bound, "hold_seconds", batch_bound - 7,
    )
    assert (rows[1]["bound_seconds"], rows[1]["bound_by"], rows[1]["remaining_seconds"]) == (30, "X-Yield-Max-Wait", 28)
    assert all(r["attempts"] == 0 for r in rows)

    rig.proxy.state.release("game")
    rig.turn()
    assert all(rig.result(d).code == 200 for d in (first, second, chat))
    assert get(rig, "/parked").json()["parked"] == []
    assert rig.clock.getDelayedCalls() == []


def test_parked_pages_and_refuses_bad_arguments_in_one_line():
    rig = Rig()
    rig.proxy.state.hold("game", "")
    pending = [embed(rig, f"t{i}") for i in range(5)]
    page = get(rig, "/parked?limit=2").json()
    assert [r["position"] for r in page["parked"]] == [1, 2] and page["next_offset"] == 2 and page["total"] == 5
    page = get(rig, "/parked?limit=2&offset=4").json()
    assert [r["position"] for r in page["parked"]] == [5] and page["next_offset"] is None
    assert get(rig, "/parked?offset=9").json()["parked"] == []
    for query, fragment in [
        ("limit=0", "limit must be a whole number from 1 to 500, not '0'"),
        ("limit=501", "limit must be a whole number from 1 to 500"),
        ("limit=ten", "limit must be a whole number from 1 to 500, not 'ten'"),
        ("offset=-1", "offset must be a whole number 0 or more, not '-1'"),
        ("offset=1.5", "offset must be a whole number 0 or more"),
    ]:
        refused = get(rig, "/parked?" + query)
        assert refused.code == 400 and fragment in refused.json()["error"], (query, refused.json())
    assert not any(answered(d) for d in pending)
    rig.proxy.state.release("game")
    rig.turn()


def test_parked_needs_a_token_as_every_reading_route_does():
    rig = Rig(token="admin-s3cret", read_token="read-s3cret")
    assert get(rig, "/parked").code == 401
    assert get(rig, "/parked", token="wrong").code == 401
    assert get(rig, "/parked", token="read-s3cret").code == 200
    assert get(rig, "/parked", token="admin-s3cret").code == 200


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from(["batch", "interactive", "long"]), st.one_of(st.none(), st.integers(60, 900))),
        min_size=0, max_size=12,
    ),
    limit=st.integers(1, 5),
)
def test_pages_walk_the_whole_lot_in_arrival_order_each_request_once(arrivals, limit):
    """Whatever parks (any classes, any X-Yield-Max-Wait), walking the pages by ``next_offset`` lists every
    parked request once, in arrival order, each class's place counted in its own line, no page over ``limit``."""
    rig = Rig(config_with(classes={"long": {"hold_seconds": 600}}))
    rig.proxy.state.hold("game", "")
    pending = []
    for i, (cls, max_wait) in enumerate(arrivals):
        headers = {"X-Yield-Class": cls}
        if max_wait is not None:
            headers["X-Yield-Max-Wait"] = str(max_wait)
        pending.append(rig.post("/api/embed", {"model": "all-minilm", "input": f"t{i}"}, headers=headers))
        rig.run(0.5)
    rows, offset = [], 0
    while offset is not None:
        page = get(rig, f"/parked?limit={limit}&offset={offset}").json()
        assert len(page["parked"]) <= limit and page["total"] == len(arrivals)
        rows += page["parked"]
        offset = page["next_offset"]
    assert [r["position"] for r in rows] == list(range(1, len(arrivals) + 1))
    assert [r["class"] for r in rows] == [cls for cls, _ in arrivals]
    seen: dict[str, int] = {}
    for row, (cls, max_wait) in zip(rows, arrivals):
        seen[cls] = seen.get(cls, 0) + 1
        assert row["class_position"] == seen[cls]
        bound = rig.proxy.config.classes[cls].hold_seconds
        by_caller = max_wait is not None and max_wait < bound
        assert row["bound_by"] == ("X-Yield-Max-Wait" if by_caller else "hold_seconds")
        assert row["bound_seconds"] == (max_wait if by_caller else bound)
    rig.proxy.state.release("game")
    rig.turn()
    assert all(answered(d) for d in pending)


def test_a_hold_kept_from_before_the_start_says_so_in_status(tmp_path):
    """A restart keeps holds (the holds file): ``/status`` marks the ones older than the process, for the page."""
    path = tmp_path / "holds.json"
    clock = clock_at(1000)
    rig = Rig(reactor=clock, holds=HoldStore(clock, path))
    rig.call("POST", rig.admin_url + "/yield", json={"source": "game", "reason": "boss fight"})
    assert [h["restored"] for h in get(rig, "/status").json()["holds"]] == [False]
    clock = clock_at(1100)
    rig = Rig(reactor=clock, holds=HoldStore(clock, path))
    rig.call("POST", rig.admin_url + "/yield", json={"source": "broker"})
    holds = get(rig, "/status").json()["holds"]
    assert [(h["source"], h["since"], h["restored"]) for h in holds] == [("game", 1000, True), ("broker", 1100, False)]


def test_the_served_page_warns_of_a_kept_hold_before_any_script_runs(tmp_path):
    """``GET /`` without a token comes with the state filled in: a kept hold is the warning there too, escaped."""
    path = tmp_path / "holds.json"
    clock = clock_at(1000)
    rig = Rig(reactor=clock, holds=HoldStore(clock, path))
    rig.call("POST", rig.admin_url + "/yield", json={"source": "game", "reason": "<b>boss</b> fight"})
    fresh = rig.call("GET", rig.admin_url + "/").text()
    assert '<div id="restored" class="banner restored" role="alert" hidden></div>' in fresh
    clock = clock_at(1100)
    rig = Rig(reactor=clock, holds=HoldStore(clock, path))
    page = rig.call("GET", rig.admin_url + "/").text()
    warning = page.split('<div id="restored"', 1)[1].split("</div>", 1)[0]
    assert "hidden" not in warning.split(">", 1)[0] and "Kept from before the proxy started" in warning
    assert '<code class="resume-command">yieldproxy resume --source game</code>' in warning
    assert "&lt;b&gt;boss&lt;/b&gt; fight" in warning and "<b>" not in warning
