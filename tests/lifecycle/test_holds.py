"""The holds file (lifecycle/holdstore.py): every hold written when it changes, read back at start, on a Clock."""

from __future__ import annotations

import json
import os
import stat

import pytest
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent

from helpers import embedded
from inmemory import Rig, answered
from rawhttp import LogCapture
from yieldproxy.config import Config, ConfigError, MemberConfig, from_dict
from yieldproxy.lifecycle.holdstore import PERSISTED_FORMAT, VERSION, HoldStore, holds_path, keep_holds
from yieldproxy.lot.state import ALL, Hold, YieldState

MODEL = "all-minilm"


def clock_at(seconds: float) -> Clock:
    clock = Clock()
    clock.advance(seconds)
    return clock


def written(path) -> list[dict]:
    document = json.loads(path.read_text())
    assert (document["format"], document["version"]) == (PERSISTED_FORMAT, VERSION)
    return document["holds"]


def started(path, at: float, **state_options) -> tuple[Clock, YieldState, HoldStore]:
    """A proxy's yield state at start, at clock time ``at``, with its holds kept in ``path``."""
    clock = clock_at(at)
    state = YieldState(clock, **state_options)
    store = HoldStore(clock, path)
    keep_holds(state, store, restart_hold_seconds=600)
    return clock, state, store


def holds_of(state: YieldState) -> list[tuple]:
    return [(h.source, h.scope, h.since, h.expires_at, h.expected_end) for h in state.holds]


# -- the store -------------------------------------------------------------------------


def test_every_change_is_written_at_once_and_atomically(tmp_path):
    path = tmp_path / "state" / "holds.json"
    clock, state, _ = started(path, at=1000)
    # Written at start already: a place that cannot be written shows in the log at start, not at the first yield.
    assert written(path) == []
    state.hold("broker", "game", expected_seconds=300, for_seconds=600)
    assert written(path) == [
        {"source": "broker", "reason": "game", "since": 1000, "upstream": None, "expires_at": 1600, "expected_end": 1300}
    ]
    # Only its owner reads it; no temporary file is left behind.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["holds.json"]
    clock.advance(100)
    state.hold("broker", for_seconds=600)  # a renewal moves the lease
    assert [h["expires_at"] for h in written(path)] == [1700]
    state.hold("signal", "SIGUSR1 received")
    assert [h["source"] for h in written(path)] == ["broker", "signal"]
    state.release("broker")
    assert [h["source"] for h in written(path)] == ["signal"]
    state.release("signal")
    assert written(path) == []
    state.stop()
    assert clock.getDelayedCalls() == []


def test_a_lease_that_runs_out_is_written_as_gone(tmp_path):
    path = tmp_path / "holds.json"
    clock, state, _ = started(path, at=0)
    state.hold("broker", for_seconds=60)
    clock.advance(60)
    assert state.holds == [] and written(path) == []
    assert clock.getDelayedCalls() == []


def test_watcher_holds_that_find_their_truth_again_are_not_written(tmp_path):
    """outage (the probe), loading (health checks), file (the state file) and command re-assert at start;
    a kept one could outlive its watcher."""
    path = tmp_path / "holds.json"
    _, state, store = started(path, at=0)
    for source in ("outage", "loading", "file", "command"):
        state.hold(source, "watcher")
    assert written(path) == []
    state.hold("signal", "SIGUSR1 received")
    assert [h["source"] for h in written(path)] == ["signal"]
    before = path.stat().st_mtime_ns, path.read_bytes()
    # A watcher re-asserting or ending its own hold rewrites nothing.
    state.hold("file", "watcher")
    state.release("outage")
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before


def test_an_unchanged_set_of_holds_is_not_written_again(tmp_path):
    path = tmp_path / "holds.json"
    clock, state, store = started(path, at=0)
    state.hold("broker", "game")
    first = path.read_bytes()
    clock.advance(5)
    assert store.save(state.holds)
    assert path.read_bytes() == first  # written_at did not move: no write


def test_a_write_that_fails_is_logged_once_and_the_proxy_goes_on(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    path = blocker / "holds.json"
    with LogCapture() as logs:
        # The start writes the file: a place that cannot be written shows at once.
        _, state, store = started(path, at=0)
        assert state.holds == []
        state.hold("broker", "one", for_seconds=60)
        state.hold("other", "two")
        state.release("other")
    errors = [formatEvent(e) for e in logs.events if e.get("log_level") == LogLevel.error]
    assert len(errors) == 1 and str(path) in errors[0] and "cannot write" in errors[0]
    assert [h.source for h in state.holds] == ["broker"]
    # The directory comes back: the next change is written, and it says so.
    blocker.unlink()
    blocker.mkdir()
    with LogCapture() as logs:
        state.hold("broker", for_seconds=60)
    assert [h["source"] for h in written(path)] == ["broker"]
    assert any("written again" in formatEvent(e) for e in logs.events)
    state.stop()


# -- at start --------------------------------------------------------------------------


def test_holds_come_back_as_they_were_with_their_lease_on_the_clock(tmp_path):
    path = tmp_path / "holds.json"
    clock, state, _ = started(path, at=1000)
    state.hold("broker", "game", expected_seconds=300, for_seconds=600)
    state.hold("signal", "SIGUSR1 received")
    before = holds_of(state)
    state.stop()  # the graceful stop ends no hold
    # Started again 100 s later (a restart, or a crash: the file is the same).
    clock, state, _ = started(path, at=1100)
    assert holds_of(state) == before and state.yielded
    assert state.yielded_since == 1000
    clock.advance(499)
    assert [h.source for h in state.holds] == ["broker", "signal"]
    clock.advance(1)  # the lease ends when it would have, not 600 s after the restart
    assert [h.source for h in state.holds] == ["signal"]
    assert [h["source"] for h in written(path)] == ["signal"]
    state.release("signal")
    assert clock.getDelayedCalls() == []


def test_a_lease_that_ran_out_while_the_proxy_was_down_is_gone(tmp_path):
    path = tmp_path / "holds.json"
    _, state, _ = started(path, at=0)
    state.hold("broker", "game", for_seconds=600)
    state.hold("operator", "maintenance")
    state.stop()
    with LogCapture() as logs:
        clock, state, _ = started(path, at=600)
    assert [h.source for h in state.holds] == ["operator"]
    assert [h["source"] for h in written(path)] == ["operator"]  # the file says what is held
    assert any("lease ran out 0s ago" in formatEvent(e) for e in logs.events)
    state.release("operator")
    assert clock.getDelayedCalls() == []


def test_an_outage_hold_in_the_file_is_not_carried_over(tmp_path):
    """Even a file that holds one (written by hand, or by a future version) does not decide an outage: the probe does."""
    path = tmp_path / "holds.json"
    path.write_text(json.dumps({"format": PERSISTED_FORMAT, "version": VERSION, "holds": [
        {"source": "outage", "reason": "upstream failing", "since": 5, "upstream": None},
        {"source": "broker", "reason": "game", "since": 6, "upstream": None},
    ]}))
    clock, state, _ = started(path, at=10)
    assert [h.source for h in state.holds] == ["broker"]


def test_a_hold_of_an_upstream_no_longer_configured_is_dropped(tmp_path):
    path = tmp_path / "holds.json"
    _, state, _ = started(path, at=0, members=("desktop", "laptop"))
    state.hold("broker", "game", scope="laptop")
    state.hold("broker", "everything")
    state.stop()
    with LogCapture() as logs:
        _, state, _ = started(path, at=1, members=("desktop",))
    assert [(h.source, h.scope) for h in state.holds] == [("broker", ALL)]
    assert any("no upstream 'laptop' any more" in formatEvent(e) for e in logs.events)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{\"format\": \"yieldproxy-holds\", \"vers", "not JSON"),
        (b"\xff\xfe garbage", "not JSON"),
        (b"[]", "not a yieldproxy holds file"),
        (b"{\"format\": \"something-else\", \"version\": 1, \"holds\": []}", "not a yieldproxy holds file"),
        (b"{\"format\": \"yieldproxy-holds\", \"version\": 2, \"holds\": []}", "version 2, this yieldproxy reads version 1"),
        (b"{\"format\": \"yieldproxy-holds\", \"holds\": []}", "version None"),
        (b"{\"format\": \"yieldproxy-holds\", \"version\": 1, \"holds\": {}}", "\"holds\" is not a list"),
        (b"{\"format\": \"yieldproxy-holds\", \"version\": 1, \"holds\": [{\"source\": \"a\\nb\", \"since\": 1}]}",
         "holds[0].source"),
        (b"{\"format\": \"yieldproxy-holds\", \"version\": 1, \"holds\": [{\"source\": \"a\", \"since\": \"x\"}]}",
         "holds[0].since is not a time"),
        (b"{\"format\": \"yieldproxy-holds\", \"version\": 1, \"holds\": [{\"source\": \"a\", \"since\": 1, "
         b"\"expires_at\": NaN}]}", "holds[0].expires_at is not a time"),
        (b" " * (1024 * 1024 + 1), "larger than"),
    ],
)
def test_a_file_that_cannot_be_read_is_refused_in_one_line_and_the_proxy_starts_yielded(tmp_path, content, why):
    path = tmp_path / "holds.json"
    path.write_bytes(content)
    with LogCapture() as logs:
        clock, state, _ = started(path, at=50)
    [line] = [formatEvent(e) for e in logs.events if e.get("log_level") >= LogLevel.warn]
    assert line.startswith(f"holds file {path} refused (") and why in line, line
    assert f"moved to {path}.refused" in line and "yieldproxy resume --source restart" in line
    assert (tmp_path / "holds.json.refused").read_bytes() == content  # kept for a look
    # Yielded, by a hold of source restart bounded by state.restart_hold_seconds.
    [hold] = state.holds
    assert state.yielded and (hold.source, hold.expires_at) == ("restart", 650)
    assert str(path) in hold.reason
    # Written like any hold: a crash while in doubt is still in doubt at the next start.
    assert [h["source"] for h in written(path)] == ["restart"]
    clock.advance(600)
    assert not state.yielded and written(path) == []
    assert clock.getDelayedCalls() == []


def test_an_unreadable_file_is_refused_too(tmp_path):
    path = tmp_path / "holds.json"
    path.mkdir()  # reading it fails (as root, a mode 000 file would still read)
    with LogCapture():
        _, state, _ = started(path, at=0)
    assert [h.source for h in state.holds] == ["restart"]


def test_an_operator_ends_the_restart_hold(tmp_path):
    path = tmp_path / "holds.json"
    path.write_text("corrupt")
    with LogCapture():
        clock, state, _ = started(path, at=0)
    assert state.release("restart")
    assert not state.yielded and written(path) == []
    assert clock.getDelayedCalls() == []


# -- where the file is -------------------------------------------------------------------


def test_the_default_file_is_named_after_the_listeners_under_the_state_directory(tmp_path):
    config = Config()
    other = config.with_overrides(**{"proxy.listen": "tcp:21435:interface=127.0.0.1"})
    systemd = holds_path(config, {"STATE_DIRECTORY": "/var/lib/yieldproxy:/var/lib/other", "HOME": "/home/u"})
    assert systemd.parent == tmp_path.root / type(tmp_path)("var/lib/yieldproxy")
    assert systemd.name.startswith("holds-") and systemd.suffix == ".json"
    # The same command line finds the same file; other listeners another.
    assert holds_path(config, {"STATE_DIRECTORY": "/var/lib/yieldproxy"}) == systemd
    assert holds_path(other, {"STATE_DIRECTORY": "/var/lib/yieldproxy"}) != systemd
    admin = config.with_overrides(**{"admin.listen": "unix:/run/yieldproxy/admin.sock"})
    assert holds_path(admin, {"STATE_DIRECTORY": "/var/lib/yieldproxy"}) != systemd
    assert str(holds_path(config, {"XDG_STATE_HOME": "/x/state", "HOME": "/home/u"}).parent) == "/x/state/yieldproxy"
    # A relative XDG_STATE_HOME is invalid (the spec says to ignore it).
    assert str(holds_path(config, {"XDG_STATE_HOME": "rel", "HOME": "/home/u"}).parent) == (
        "/home/u/.local/state/yieldproxy"
    )
    assert str(holds_path(config, {"HOME": "/home/u"}).parent) == "/home/u/.local/state/yieldproxy"


def test_state_holds_file_sets_it():
    config = from_dict({"state": {"holds_file": "/srv/yp/holds.json"}})
    assert str(holds_path(config, {"STATE_DIRECTORY": "/var/lib/yieldproxy"})) == "/srv/yp/holds.json"
    home = from_dict({"state": {"holds_file": "~/holds.json"}})
    assert holds_path(home, {}) == type(holds_path(home, {}))(os.path.expanduser("~/holds.json"))


@pytest.mark.parametrize(
    "table, message",
    [
        ({"holds_file": "holds.json"}, "state.holds_file: must be an absolute path"),
        ({"restart_hold_seconds": 0}, "state.restart_hold_seconds: must be >= 1"),
        ({"restart_hold_seconds": 700000}, "state.restart_hold_seconds"),
        ({"dir": "/x"}, "state.dir: unknown key"),
    ],
)
def test_state_keys_are_checked(table, message):
    with pytest.raises(ConfigError) as e:
        from_dict({"state": table}, "y.toml")
    assert str(e.value).startswith(f"y.toml: {message}")


# -- the whole proxy, on a Clock ------------------------------------------------------------


def test_a_brokers_lease_survives_a_restart_and_the_next_embedding_parks_unsent(tmp_path):
    path = tmp_path / "holds.json"
    clock = clock_at(1000)
    rig = Rig(reactor=clock, holds=HoldStore(clock, path))
    answer = rig.call("POST", rig.admin_url + "/yield", json={"source": "broker", "reason": "game", "for_seconds": 600})
    assert answer.code == 200
    # The process ends (a graceful stop or a kill -9: the file was written when the hold was taken).
    clock = clock_at(1100)
    rig = Rig(reactor=clock, holds=HoldStore(clock, path))
    status = rig.call("GET", rig.admin_url + "/status").json()
    assert status["state"] == "yielded"
    assert [(h["source"], h["since"], h["expires_at"]) for h in status["holds"]] == [("broker", 1000, 1600)]
    d = rig.post("/api/embed", {"model": MODEL, "input": ["after the restart"]})
    rig.run(499.9)
    assert not answered(d) and embedded(rig.sim) == {}
    assert rig.proxy.lot.count_by_class() == {"batch": 1}
    rig.run(0.1)  # the lease runs out where it would have: the parked request goes out once
    assert rig.result(d).code == 200
    assert embedded(rig.sim) == {"after the restart": 1}


def test_a_pool_keeps_holds_of_one_upstream(tmp_path):
    path = tmp_path / "holds.json"
    members = (MemberConfig(name="desktop", url="http://127.0.0.1:1"), MemberConfig(name="laptop", url="http://127.0.0.1:2"))
    config = Config(upstreams=members)
    clock = clock_at(0)
    rig = Rig(config, reactor=clock, holds=HoldStore(clock, path))
    rig.call("POST", rig.admin_url + "/yield", json={"source": "game", "upstream": "laptop"})
    assert [h["upstream"] for h in written(path)] == ["laptop"]
    clock = clock_at(10)
    rig = Rig(config, reactor=clock, holds=HoldStore(clock, path))
    assert [(h.source, h.scope) for h in rig.proxy.state.holds] == [("game", "laptop")]
    assert rig.proxy.state.yielded_for("laptop") and not rig.proxy.state.yielded_for("desktop")


def test_hold_is_a_frozen_value_the_store_reads_back_whole(tmp_path):
    """Every field of a Hold is in the file: a new field must be added to the format (and its version)."""
    path = tmp_path / "holds.json"
    clock = clock_at(7)
    store = HoldStore(clock, path)
    hold = Hold("broker", "r", since=1.5, expected_end=9.0, expires_at=8.0, scope="desktop")
    assert store.save([hold])
    assert store.load().holds == (hold,)
    assert set(written(path)[0]) == {"source", "reason", "since", "upstream", "expires_at", "expected_end"}
    assert len(Hold.__attrs_attrs__) == 6


def test_a_process_that_another_claimed_the_file_after_writes_it_no_more(tmp_path):
    """A reload's old process lives on with its own copy of the holds; what runs out there must not be written."""
    path = tmp_path / "holds.json"
    old_clock, old_state, old_store = started(path, at=0)
    old_store.pid = 100
    old_store.running = lambda pid: pid == 200  # the new process runs (its pid is made up, as the old one's)
    old_state.hold("broker", "game", for_seconds=8)
    # The new process starts (the old one is still running), claims the file, and the broker renews there.
    new_clock = clock_at(2)
    new_state, new_store = YieldState(new_clock), HoldStore(new_clock, path, pid=200)
    keep_holds(new_state, new_store, restart_hold_seconds=600)
    assert json.loads(path.read_text())["pid"] == 200
    new_state.hold("broker", for_seconds=600)
    with LogCapture() as logs:
        old_clock.advance(8)  # the old copy's lease runs out
    assert old_state.holds == [] and old_store.superseded
    assert [(h["source"], h["expires_at"]) for h in written(path)] == [("broker", 602)]
    assert [formatEvent(e) for e in logs.events if "writes it no more" in formatEvent(e)] == [
        f"holds file {path}: written by pid 200 now (a reload's new process, or another proxy given the same file); "
        "this process writes it no more"
    ]
    # The new process goes on writing.
    new_state.release("broker")
    assert written(path) == []
    new_state.stop()
    assert old_clock.getDelayedCalls() == [] and new_clock.getDelayedCalls() == []


def test_an_older_claim_written_last_does_not_take_the_file_back(tmp_path):
    """Both processes may write at the same moment: the one that claimed the file later keeps writing it."""
    path = tmp_path / "holds.json"
    _, old_state, old_store = started(path, at=0)
    old_store.pid = 100
    old_store.running = lambda pid: pid == 200  # the new process runs (its pid is made up, as the old one's)
    new_clock = clock_at(5)
    new_state, new_store = YieldState(new_clock), HoldStore(new_clock, path, pid=200)
    keep_holds(new_state, new_store, restart_hold_seconds=600)
    # The old process's write lands just after the new one's claim (it checked just before).
    path.write_text(json.dumps({
        "format": PERSISTED_FORMAT, "version": VERSION, "pid": 100, "claimed_at": 0, "holds": [
            {"source": "stale", "reason": "", "since": 0, "upstream": None},
        ],
    }))
    new_state.hold("broker", "game")
    assert [h["source"] for h in written(path)] == ["broker"]
    assert json.loads(path.read_text())["pid"] == 200 and not new_store.superseded
    # And the old process, at its next change, sees the newer claim.
    old_state.hold("other", "x")
    assert old_store.superseded and [h["source"] for h in written(path)] == ["broker"]


def test_a_claim_by_a_process_that_is_gone_takes_nothing_away(tmp_path):
    """A second proxy started by mistake with the same holds file claims it while it builds, then dies (its port is
    taken): the running proxy must go on writing its holds, or a resume it takes later is lost at the next restart."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(gone.stdout)
    path = tmp_path / "holds.json"
    _, running_state, running_store = started(path, at=0)
    running_state.hold("api", "a game")
    # The mistaken second start: it claims the file at build time, then exits (address in use).
    second_clock = clock_at(5)
    keep_holds(YieldState(second_clock), HoldStore(second_clock, path, pid=dead_pid), restart_hold_seconds=600)
    assert json.loads(path.read_text())["pid"] == dead_pid
    with LogCapture() as logs:
        running_state.release("api")
    assert not running_store.superseded
    assert written(path) == [] and json.loads(path.read_text())["pid"] == os.getpid()
    assert any(f"pid {dead_pid}" in formatEvent(e) and "gone" in formatEvent(e) for e in logs.events)
    # The file is this process's again: a later claim by a running process still takes it.
    running_state.hold("api", "again")
    assert [h["source"] for h in written(path)] == ["api"]


# -- what is at the path, what is in it (issue 26) ---------------------------------------------------


def refusal_line(logs) -> str:
    [line] = [formatEvent(e) for e in logs.events if e.get("log_level") >= LogLevel.error]
    return line


def test_a_fifo_at_the_path_is_refused_at_once_not_waited_on(tmp_path):
    """Opened without blocking: a FIFO nobody writes would have hung the start before the proxy listened."""
    import threading

    path = tmp_path / "holds.json"
    os.mkfifo(path)
    done: list = []
    logs = LogCapture()
    with logs:
        start = threading.Thread(target=lambda: done.append(started(path, at=50)), daemon=True)
        start.start()
        start.join(timeout=30)
    if start.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the blocked open returns, and the thread ends
        start.join(timeout=30)
        pytest.fail("the start waited on the FIFO at the holds file's path")
    [(clock, state, _)] = done
    line = refusal_line(logs)
    assert line.startswith(f"holds file {path} refused (not a regular file (a FIFO))"), line
    assert [h.source for h in state.holds] == ["restart"] and state.yielded
    assert stat.S_ISFIFO(os.lstat(f"{path}.refused").st_mode)  # moved aside; the holds are in a new file
    assert [h["source"] for h in written(path)] == ["restart"]


def test_a_directory_or_a_link_at_the_path_is_refused_in_one_line(tmp_path):
    path = tmp_path / "holds.json"
    path.mkdir()
    with LogCapture() as logs:
        _, state, _ = started(path, at=0)
    assert "refused (not a regular file (a directory))" in refusal_line(logs)
    assert [h.source for h in state.holds] == ["restart"]
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with LogCapture() as logs:
        _, state, _ = started(link, at=0)
    assert "refused (a symbolic link: " in refusal_line(logs)
    assert [h.source for h in state.holds] == ["restart"]
    assert (tmp_path / "elsewhere.json").read_text() == "{}"  # what it pointed at is left alone


class CountingWriter:
    """The store's writer, counted; told to, it fails as a full disk does."""

    def __init__(self):
        self.writes = 0
        self.failing: OSError | None = None

    def __call__(self, path, data: bytes) -> None:
        if self.failing is not None:
            raise self.failing
        self.writes += 1
        from yieldproxy.lifecycle.holdstore import _write_atomically

        _write_atomically(path, data)


def test_thousands_of_holds_are_restored_with_one_write(tmp_path):
    path = tmp_path / "holds.json"
    path.write_text(json.dumps({"format": PERSISTED_FORMAT, "version": VERSION, "written_at": 100, "holds": [
        {"source": f"broker-{i}", "reason": "r", "since": 100, "upstream": None, "expires_at": 700}
        for i in range(5000)
    ]}))
    clock = clock_at(200)
    state, writer = YieldState(clock), CountingWriter()
    keep_holds(state, HoldStore(clock, path, write=writer), restart_hold_seconds=600)
    assert len(state.holds) == 5000 and writer.writes == 1
    assert len(written(path)) == 5000
    state.stop()


@pytest.mark.parametrize(
    "hold, why",
    [
        ({"since": 1e12}, "holds[0].since is "),
        ({"since": 100, "expected_end": 1e18}, "holds[0].expected_end is more than a week after the file was written"),
        ({"since": 100, "expires_at": 100 + 8 * 24 * 3600}, "holds[0].expires_at is more than a week after"),
        ({"since": 100, "expires_at": 40}, "holds[0].expires_at is before its since"),
        ({"since": 100, "expected_end": float("inf")}, "holds[0].expected_end is not a time"),
        ({"since": 100, "reason": "x" * 5000}, "holds[0].reason is longer than 4096 characters"),
        ({"since": 100, "upstream": "a\nb"}, "holds[0].upstream is not an upstream's name"),
        ({"since": 100, "upstream": "u" * 65}, "holds[0].upstream is not an upstream's name"),
    ],
)
def test_values_out_of_range_are_refused(tmp_path, hold, why):
    path = tmp_path / "holds.json"
    text = json.dumps({"format": PERSISTED_FORMAT, "version": VERSION, "written_at": 150, "holds": [
        {"source": "broker", "reason": "", "upstream": None, **hold},
    ]})
    path.write_text(text)
    with LogCapture() as logs:
        _, state, _ = started(path, at=200)
    line = refusal_line(logs)
    assert line.startswith(f"holds file {path} refused (") and why in line, line
    assert [h.source for h in state.holds] == ["restart"]


def test_a_since_in_the_future_of_a_file_without_written_at_is_refused(tmp_path):
    path = tmp_path / "holds.json"
    path.write_text(json.dumps({"format": PERSISTED_FORMAT, "version": VERSION, "holds": [
        {"source": "broker", "reason": "", "since": 500, "upstream": None},
    ]}))
    with LogCapture() as logs:
        _, state, _ = started(path, at=200)
    assert "holds[0].since is 300s after the file was written" in refusal_line(logs)


def test_keys_of_another_part_are_kept_when_the_file_is_written_again(tmp_path):
    """Another record may live in the file beside the holds (issue 24's served models, a newer version's)."""
    path = tmp_path / "holds.json"
    path.write_text(json.dumps({"format": PERSISTED_FORMAT, "version": VERSION, "written_at": 0, "holds": [],
                                "served_models": {"default": ["all-minilm"]}}))
    _, state, _ = started(path, at=10)
    state.hold("broker", "game")
    assert json.loads(path.read_text())["served_models"] == {"default": ["all-minilm"]}
    assert [h["source"] for h in written(path)] == ["broker"]


def test_a_hold_that_ended_while_writes_failed_does_not_come_back(tmp_path):
    """The disk filled (or went read-only) after the hold was written; it ended; the proxy stopped.  The file
    still has the hold, with no lease: restored, it would hold the GPU for ever.  The start doubts it instead."""
    path = tmp_path / "holds.json"
    clock, state, writer = clock_at(0), None, CountingWriter()
    state = YieldState(clock)
    keep_holds(state, HoldStore(clock, path, write=writer), restart_hold_seconds=600)
    state.hold("operator", "maintenance")  # no lease
    assert [h["source"] for h in written(path)] == ["operator"]
    writer.failing = OSError(28, "No space left on device")
    with LogCapture() as logs:
        state.release("operator")
    assert "cannot write it (No space left on device)" in refusal_line(logs)
    assert (tmp_path / "holds.json.unsaved").exists()
    # The process stops; the disk has room again; the next start.
    clock = clock_at(30)
    state = YieldState(clock)
    with LogCapture() as logs:
        keep_holds(state, HoldStore(clock, path), restart_hold_seconds=600)
    line = refusal_line(logs)
    assert line.startswith(f"holds file {path} doubted (a write of it failed at 1970-01-01 00:00:00 UTC "
                           "(No space left on device), so it may still hold holds that ended since)"), line
    assert "starting yielded (hold source restart)" in line
    [hold] = state.holds
    assert (hold.source, hold.expires_at) == ("restart", 630) and "doubted at start" in hold.reason
    # The stale file is set aside; the new one says what is held now, so the marker goes.
    assert [h["source"] for h in json.loads((tmp_path / "holds.json.refused").read_text())["holds"]] == ["operator"]
    assert [h["source"] for h in written(path)] == ["restart"]
    assert not (tmp_path / "holds.json.unsaved").exists()
    # And the start after that trusts the file again.
    state.stop()
    _, state, _ = started(path, at=40)
    assert [(h.source, h.expires_at) for h in state.holds] == [("restart", 630)]


def test_a_write_that_fails_for_real_leaves_the_marker_and_the_next_success_removes_it(tmp_path):
    """Not injected: the path became a directory (as an immutable file or a full disk, the rename fails)."""
    path = tmp_path / "holds.json"
    _, state, _ = started(path, at=0)
    os.unlink(path)
    path.mkdir()
    with LogCapture():
        state.hold("broker", "game")
    assert (tmp_path / "holds.json.unsaved").exists()
    path.rmdir()
    with LogCapture():
        state.release("broker")
    assert written(path) == [] and not (tmp_path / "holds.json.unsaved").exists()


def test_a_start_that_cannot_write_the_file_it_found_doubts_it(tmp_path):
    """A read-only disk takes no marker either: the file cannot be known to be current, so it is not trusted."""
    path = tmp_path / "holds.json"
    _, state, _ = started(path, at=0)
    state.hold("operator", "maintenance")
    clock = clock_at(10)
    writer = CountingWriter()
    writer.failing = OSError(30, "Read-only file system")
    state = YieldState(clock)
    with LogCapture() as logs:
        keep_holds(state, HoldStore(clock, path, write=writer), restart_hold_seconds=600)
    doubted = [formatEvent(e) for e in logs.events if "doubted" in formatEvent(e)]
    assert len(doubted) == 1 and "it cannot be written now (Read-only file system)" in doubted[0], doubted
    assert [h.source for h in state.holds] == ["restart"]


def test_no_file_and_no_marker_is_nothing_held_even_where_nothing_can_be_written(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with LogCapture():
        _, state, _ = started(blocker / "holds.json", at=0)
    assert state.holds == []


def test_a_reloads_new_process_restores_the_file_it_will_write_only_from_the_commit(tmp_path):
    """A reload's new process reads the holds file at start and writes it only from the commit (the old
    process keeps it until then: lifecycle/succession/claims.py).  Not writing it yet is no failed write: the file is
    not doubted, no ``restart`` hold is taken, and the claim writes what the holds are by then."""
    from yieldproxy.lifecycle.succession.claims import ClaimedAtCommit

    path = tmp_path / "holds.json"
    clock, state, _ = started(path, at=1000)
    state.hold("broker", "game", for_seconds=600)
    before = holds_of(state)
    written_before = path.read_bytes()
    state.stop()
    clock = clock_at(1010)
    state = YieldState(clock)
    store = ClaimedAtCommit(HoldStore(clock, path))
    with LogCapture() as logs:
        keep_holds(state, store, restart_hold_seconds=600)
    assert holds_of(state) == before and logs.errors() == []
    assert path.read_bytes() == written_before  # not written before the commit
    state.release("broker")
    assert path.read_bytes() == written_before
    store.claim()
    assert written(path) == []
