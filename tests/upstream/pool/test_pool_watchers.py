"""Each upstream's own watchers and VRAM handover, and the global ones for all (issue 12), on a Clock."""

from __future__ import annotations

import os

from twisted.internet.task import Clock

from helpers import make_pool_core, pool_config
from test_handover import FakeOllama
from test_pool_routing import admit, finish
from yieldproxy.config import HandoverConfig
from yieldproxy.lot.state import ALL
from yieldproxy.service import build, subscribe_handover
from yieldproxy.upstream.vram import Handover


def test_a_members_state_file_yields_it_alone_and_the_global_one_all(tmp_path):
    desktop_file, global_file = tmp_path / "desktop-gaming", tmp_path / "all"
    config = pool_config({"name": "desktop", "state_file": str(desktop_file)}, {"name": "server"})
    config = config.with_overrides(**{"watchers.state_file": str(global_file)})
    clock = Clock()
    proxy = build(clock, config)
    names = {w.name for w in proxy.watchers}
    assert {"watcher:file", "watcher:file:desktop"} <= names
    for watcher in proxy.watchers:
        if watcher.name.startswith("watcher:file"):
            watcher.startService()
    try:
        desktop_file.write_text("")
        clock.advance(1)
        assert [(h.source, h.scope) for h in proxy.state.holds] == [("file", "desktop")]
        assert proxy.state.yielded_for("desktop") and not proxy.state.yielded_for("server")
        global_file.write_text('{"reason": "maintenance"}')
        clock.advance(1)
        assert proxy.state.yielded and {(h.source, h.scope) for h in proxy.state.holds} == {
            ("file", "desktop"), ("file", ALL)
        }
        os.remove(desktop_file)
        clock.advance(1)
        assert [(h.source, h.scope) for h in proxy.state.holds] == [("file", ALL)]
    finally:
        for watcher in proxy.watchers:
            if watcher.running:
                watcher.stopService()
    # /status names each watcher with its upstream.
    assert set(proxy.admin_app.status()["watchers"]) >= {"file", "file:desktop"}


def test_each_ollama_member_unloads_and_preloads_on_its_own_yields():
    core = make_pool_core({"name": "a"}, {"name": "b"})
    scheduler = core.scheduler
    fakes = {name: FakeOllama(core.clock, loaded=["llama3"], load_seconds=0.5) for name in ("a", "b")}
    handovers = []
    for name in ("a", "b"):
        member = scheduler.member(name)
        handover = Handover(
            core.clock, core.state, scheduler.drainer(name), fakes[name], core.metrics,
            HandoverConfig(unload_on_yield=True, preload_models=("llama3",)), member=name, per_member=True,
            release=member,
        )
        subscribe_handover(core.state, handover)
        handover.startService()
        handovers.append(handover)
    assert [h.name for h in handovers] == ["handover:a", "handover:b"]
    # a is busy with a request; b yields: b unloads, a is left alone.
    busy, _ = admit(core)
    assert busy.released_to == "a"
    core.state.hold("api", "game", scope="b")
    core.run(0.1)
    assert fakes["b"].loaded == set() and fakes["a"].loaded == {"llama3:latest"}
    # b comes back: its release waits for its preload; a is untouched.
    core.state.release("api", "b")
    assert scheduler.member("b").state_name() == "handing_over" and not scheduler.member("b").available()
    core.run(1)
    assert fakes["b"].loaded == {"llama3:latest"} and scheduler.member("b").available()
    assert [c for c in fakes["a"].calls if c[1] != "/api/ps"] == []
    finish(core, busy)
    # A hold of all unloads both.
    core.state.hold("broker", "all")
    core.run(0.1)
    assert fakes["a"].loaded == set() == fakes["b"].loaded
    for handover in handovers:
        handover.stopService()


def test_a_members_outage_watcher_holds_it_alone():
    clock = Clock()
    proxy = build(clock, pool_config({"name": "a"}, {"name": "b", "detect_outages": False}))
    outage = [w for w in proxy.watchers if w.name.startswith("watcher:outage")]
    assert [w.name for w in outage] == ["watcher:outage:a"]
    assert outage[0].scope == "a" and outage[0].member == "a"
