"""Holds per upstream: keyed by (source, scope), a scope being one member or all of them (issue 12)."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from yieldproxy.lot.state import ALL, TooManyHolds, UnknownScope, YieldState


def pool_state(clock=None, **kwargs) -> YieldState:
    return YieldState(clock or Clock(), members=("desktop", "server", "cpu"), standby={"cpu"}, **kwargs)


def test_a_hold_of_one_upstream_yields_that_one_only():
    state = pool_state()
    changes = []
    state.observe(changes.append)
    state.hold("api", "game", scope="desktop")
    assert state.yielded_for("desktop")
    assert not state.yielded_for("server") and not state.yielded_for("cpu")
    # The proxy-wide "yielded" needs every member that is not standby held.
    assert not state.yielded and changes == []
    state.hold("api", "backup", scope="server")
    assert state.yielded and changes == [True]
    assert not state.yielded_for("cpu")


def test_a_hold_without_an_upstream_holds_every_member_but_the_standby_ones():
    state = pool_state()
    state.hold("api", "game")
    assert state.yielded
    assert state.yielded_for("desktop") and state.yielded_for("server")
    # A CPU copy kept for yields is not itself yielded by a hold that names no member.
    assert not state.yielded_for("cpu")
    state.hold("api", "maintenance", scope="cpu")
    assert state.yielded_for("cpu")


def test_each_member_gets_its_own_log_lines_only_when_the_pool_names_its_members():
    for names_members, lines in ((True, ["upstream desktop yielded", "upstream desktop available"]), (False, [])):
        state = pool_state(names_members=names_members)
        with capturedLogs() as events:
            state.hold("file", scope="desktop")
            state.release("file", "desktop")
        said = [formatEvent(e).split(":")[0] for e in events if formatEvent(e).startswith("upstream ")]
        assert said == lines


def test_member_observers_see_each_flip_once():
    state = pool_state()
    flips = []
    state.observe_members(lambda member, yielded: flips.append((member, yielded)))
    state.hold("file", scope="desktop")
    state.hold("api")  # desktop is held already: only server flips
    assert flips == [("desktop", True), ("server", True)]
    flips.clear()
    state.release("file", "desktop")  # still held by api's hold of all
    assert flips == []
    state.release("api")
    assert flips == [("desktop", False), ("server", False)]


def test_sources_and_scopes_are_separate_holds():
    state = pool_state()
    state.hold("api", "game", scope="desktop")
    state.hold("api", "all of them")
    assert [(h.source, h.scope) for h in state.holds] == [("api", "desktop"), ("api", ALL)]
    assert state.hold_of("api", "desktop").reason == "game"
    assert state.hold_of("api").reason == "all of them"
    assert state.release("api", "desktop") is True
    assert state.yielded_for("desktop")  # the hold of all still applies
    assert state.release("api", "desktop") is False


def test_release_source_ends_every_hold_of_that_source():
    state = pool_state()
    state.hold("api", scope="desktop")
    state.hold("api", scope="cpu")
    state.hold("file", scope="server")
    assert state.release_source("api") == 2
    assert [(h.source, h.scope) for h in state.holds] == [("file", "server")]


def test_an_unknown_upstream_is_refused_naming_the_known_ones():
    state = pool_state()
    with pytest.raises(UnknownScope, match="unknown upstream 'laptop'; the upstreams are desktop, server, cpu"):
        state.hold("api", scope="laptop")
    assert state.holds == []


def test_expected_end_per_member_and_the_soonest_back():
    clock = Clock()
    state = pool_state(clock)
    state.hold("api", expected_seconds=60, scope="desktop")
    state.hold("broker", expected_seconds=30, scope="server")
    assert state.expected_end(["desktop"]) == 60
    assert state.expected_end(["server"]) == 30
    # The soonest back among the members asked about.
    assert state.expected_end() == 30
    # One that may come back any moment makes the estimate worthless.
    state.hold("file", scope="server")
    assert state.expected_end(["server"]) is None
    assert state.expected_end() is None
    # A member that is not held has no end.
    assert state.expected_end(["cpu"]) is None


def test_leases_run_out_per_source_and_scope():
    clock = Clock()
    state = pool_state(clock)
    state.hold("broker", for_seconds=10, scope="desktop")
    state.hold("broker", for_seconds=20, scope="server")
    clock.advance(10)
    assert not state.yielded_for("desktop") and state.yielded_for("server")
    clock.advance(10)
    assert state.holds == []
    assert clock.getDelayedCalls() == []


def test_max_holds_counts_each_source_and_scope():
    state = pool_state(max_holds=2)
    state.hold("a", scope="desktop")
    state.hold("a", scope="server")
    with pytest.raises(TooManyHolds):
        state.hold("a")
    # Renewing one of them is always allowed; the watchers are never refused.
    state.hold("a", "renewed", scope="desktop")
    state.hold("outage", scope="cpu")
    assert len(state.holds) == 3


def test_a_pool_of_one_reads_as_before():
    """proxy.upstream is the one member, default: a hold of it is the GPU's."""
    clock = Clock()
    state = YieldState(clock)
    assert state.members == ("default",)
    changes = []
    state.observe(changes.append)
    state.hold("outage", scope="default")
    state.hold("api", expected_seconds=30)
    assert state.yielded and state.yielded_for("default") and changes == [True]
    state.release("outage", "default")
    state.release("api")
    assert not state.yielded and changes == [True, False]


def test_holds_json_names_the_upstream():
    state = pool_state()
    state.hold("api", scope="desktop")
    state.hold("file")
    assert [h.as_json()["upstream"] for h in state.holds] == ["desktop", None]
