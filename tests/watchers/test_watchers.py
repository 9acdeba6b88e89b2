"""Watchers: the state file, signals, the command probe and outage detection.

Clock-driven where the logic allows (state file, outage rules, the command
loop with an injected spawner); real processes, sockets and a real-client
burst where that is the point (probe timeouts, SIGUSR1 to twistd, a backend
that crashes with nobody declaring a yield).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import attrs
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError, ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.python.failure import Failure

from helpers import config_with, in_thread, make_core, sleep, start_stack, wait_for
from inmemory import Rig, answered
from rawhttp import LogCapture
from test_burst import Burst, assert_clean
from test_chaos import MemoryBurst
from yieldproxy.lot.parking import Entry
from yieldproxy.lot.state import YieldState
from yieldproxy.observe.metrics import Metrics
from yieldproxy.servers.base import ModelCall
from yieldproxy.upstream.health import UpstreamHealth
from yieldproxy.upstream.served import ServedRecord
from yieldproxy.watchers.command import CommandWatcher
from yieldproxy.watchers.outage import MAX_PROBES, VERDICT_SECONDS, OutageWatcher
from yieldproxy.watchers.signals import SignalWatcher, StopSignals
from yieldproxy.watchers.state_file import StateFileWatcher, parse_content

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "etc" / "probes" / "nvidia-game-probe.sh"
TIMEOUT = 30


def errors(metrics: Metrics, watcher: str) -> float:
    return metrics.registry.get_sample_value("yieldproxy_watcher_errors_total", {"watcher": watcher}) or 0.0


def sources(state: YieldState) -> list[str]:
    return [h.source for h in state.holds]


# -- the state file ------------------------------------------------------------------


def file_watcher(tmp_path, clock=None, state=None, metrics=None, poll=1.0):
    clock = clock or Clock()
    state = state or YieldState(clock)
    metrics = metrics or Metrics()
    path = tmp_path / "gpu-yielded"
    watcher = StateFileWatcher(clock, state, metrics, str(path), poll)
    return watcher, path, clock, state, metrics


def test_state_file_holds_while_the_file_exists(tmp_path):
    watcher, path, clock, state, metrics = file_watcher(tmp_path)
    watcher.startService()
    assert not state.yielded
    path.touch()
    clock.advance(0.5)
    assert not state.yielded  # seen at the next poll, not before
    clock.advance(0.5)
    assert sources(state) == ["file"]
    assert state.holds[0].reason == f"state file {path}"
    assert state.expected_end() is None
    path.unlink()
    clock.advance(1)
    assert not state.yielded
    watcher.stopService()
    assert clock.getDelayedCalls() == []
    assert errors(metrics, "file") == 0


def test_state_file_content_gives_the_reason_and_the_expected_end(tmp_path):
    watcher, path, clock, state, metrics = file_watcher(tmp_path)
    clock.advance(100)
    path.write_text(json.dumps({"reason": "game: elden ring", "expected_seconds": 3600}))
    watcher.startService()  # the first look is at once
    hold = state.holds[0]
    assert (hold.source, hold.reason, hold.expected_end) == ("file", "game: elden ring", 3700)
    clock.advance(1)
    assert state.holds[0].expected_end == 3700  # unchanged content is not read again
    path.write_text(json.dumps({"reason": "game: a longer one", "expected_seconds": 7200}))
    os.utime(path, ns=(0, 10**9))  # a new mtime even on a coarse clock
    clock.advance(1)
    hold = state.holds[0]
    assert (hold.reason, hold.expected_end, hold.since) == ("game: a longer one", 7302, 100)
    watcher.stopService()
    assert state.yielded  # stopping the watcher does not give the GPU back
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"game", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"reason": 5}', "reason is not a string"),
        (b'{"expected_seconds": -3}', "expected_seconds is not a positive number"),
        (b'{"expected_seconds": "soon"}', "expected_seconds is not a positive number"),
    ],
)
def test_bad_state_file_content_is_logged_and_counted_and_still_holds(tmp_path, content, problem):
    assert problem in parse_content(content)[2]
    watcher, path, clock, state, metrics = file_watcher(tmp_path)
    path.write_bytes(content)
    watcher.startService()
    assert sources(state) == ["file"]
    assert errors(metrics, "file") == 1
    clock.advance(5)
    assert errors(metrics, "file") == 1  # counted once per content, not once per poll
    watcher.stopService()
    assert clock.getDelayedCalls() == []


def test_empty_and_partial_state_files_are_fine():
    assert parse_content(b"") == (None, None, None)
    assert parse_content(b'{"reason": "render", "extra": true}') == ("render", None, None)
    assert parse_content(b'{"expected_seconds": 90}') == (None, 90.0, None)


def test_state_file_flapping_keeps_the_parked_order(tmp_path):
    """Gone and back, quickly or not, the lot keeps its order: the watcher only holds and releases."""
    core = make_core(concurrency=1)
    watcher, path, _, _, _ = file_watcher(tmp_path, core.clock, core.state, core.metrics, poll=1.0)
    path.touch()
    watcher.startService()
    released = []
    entries = [Entry(cls="batch") for _ in range(6)]
    for entry in entries:
        core.scheduler.admit(entry).addCallback(lambda e: released.append(e.seq))
    # Gone and back between two polls: never noticed, nothing moves.
    path.unlink()
    path.touch()
    core.run(1.5)
    assert released == [] and core.state.yielded
    # Gone long enough to be seen: the head of the line goes (concurrency 1).
    path.unlink()
    core.run(1.0)
    assert released == [entries[0].seq]
    # Back before the next release: the rest stays parked, in order.
    path.touch()
    core.run(1.0)
    assert core.scheduler.state_name == "yielded"
    core.scheduler.finished(seconds=0.01)
    core.run(1.0)
    assert released == [entries[0].seq]
    assert [e.seq for e in core.lot.entries()] == [e.seq for e in entries[1:]]
    path.unlink()
    for _ in range(100):
        core.run(0.2)
        if core.replayer.inflight:
            core.scheduler.finished(seconds=0.01)
        if len(released) == len(entries) and not core.replayer.inflight:
            break
    assert released == [e.seq for e in entries]
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


@pytest_twisted.ensureDeferred
async def test_state_file_is_seen_at_once_with_inotify(tmp_path):
    from twisted.python.runtime import platform

    if not platform.supportsINotify():
        pytest.skip("no inotify here")
    state = YieldState(reactor)
    path = tmp_path / "gpu-yielded"
    watcher = StateFileWatcher(reactor, state, Metrics(), str(path), poll_seconds=60, inotify_reactor=reactor)
    watcher.startService()
    try:
        assert watcher.status()["inotify"]
        path.write_text('{"reason": "launcher"}')
        await wait_for(reactor, lambda: state.yielded, timeout=5)
        assert state.holds[0].reason == "launcher"
        path.unlink()
        await wait_for(reactor, lambda: not state.yielded, timeout=5)
    finally:
        watcher.stopService()


# -- signals -------------------------------------------------------------------------


class ImmediateReactor:
    """``callFromThread`` that runs the call at once (the handler is called directly)."""

    def callFromThread(self, f, *args):
        f(*args)


def test_sigusr1_holds_and_sigusr2_releases():
    state = YieldState(Clock())
    watcher = SignalWatcher(ImmediateReactor(), state, Metrics())
    watcher._on_signal(signal.SIGUSR1, None)
    assert sources(state) == ["signal"] and state.holds[0].reason == "SIGUSR1 received"
    watcher._on_signal(signal.SIGUSR1, None)  # a repeat is a renewal, not a second hold
    assert sources(state) == ["signal"]
    state.hold("api", "broker")
    watcher._on_signal(signal.SIGUSR2, None)
    assert sources(state) == ["api"]  # SIGUSR2 ends only the signal hold
    watcher._on_signal(signal.SIGUSR2, None)  # nothing to end: logged, harmless
    assert sources(state) == ["api"]


def test_signal_handlers_stay_through_the_stop_and_uninstall_puts_back_the_previous_ones():
    """The default action of SIGUSR1/SIGUSR2 ends the process: a stopped watcher (a graceful stop
    still draining) keeps handling them, and still takes and ends the hold."""
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    state = YieldState(Clock())
    watcher = SignalWatcher(ImmediateReactor(), state, Metrics())
    watcher.startService()
    try:
        assert signal.getsignal(signal.SIGUSR1) == watcher._on_signal
        assert signal.getsignal(signal.SIGUSR2) == watcher._on_signal
        watcher.stopService()
        assert signal.getsignal(signal.SIGUSR1) == watcher._on_signal
        assert signal.getsignal(signal.SIGUSR2) == watcher._on_signal
        watcher._on_signal(signal.SIGUSR1, None)
        assert sources(state) == ["signal"]
        # Started again (an application restarting the service): the previous handler is still the first one.
        watcher.startService()
        watcher.stopService()
        watcher._on_signal(signal.SIGUSR2, None)
        assert sources(state) == []
    finally:
        watcher.uninstall()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before


@pytest_twisted.ensureDeferred
async def test_sigusr1_and_sigusr2_to_a_twistd_process(tmp_path):
    from test_twistd import start_service
    from yieldproxy.tools.sim import SimOllama

    config = tmp_path / "y.toml"
    config.write_text("[watchers]\nsignals = true\n")
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, proxy, admin = await start_service(sim_port, "--config", str(config))

    async def status():
        response = await treq.get(admin + "/status", persistent=False).addTimeout(TIMEOUT, reactor)
        return await response.json()

    async def until(predicate):
        for _ in range(200):
            body = await status()
            if predicate(body):
                return body
            await sleep(reactor, 0.05)
        raise AssertionError(f"status never matched: {body}")

    try:
        process.signalProcess(signal.SIGUSR1)
        body = await until(lambda s: s["state"] == "yielded")
        assert [h["source"] for h in body["holds"]] == ["signal"]
        assert body["watchers"]["signal"]["holding"] is True
        process.signalProcess(signal.SIGUSR2)
        body = await until(lambda s: s["state"] == "available")
        assert body["holds"] == []
        assert not protocol.ended.called, protocol.output
        process.signalProcess("TERM")
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), protocol.output
        assert b"GPU yielded: source=signal reason='SIGUSR1 received'" in protocol.output
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


# -- the command probe ---------------------------------------------------------------


class FakeProcess:
    """What the injected spawner returns: records the kill."""

    def __init__(self, protocol, args):
        self.protocol = protocol
        self.args = args
        self.pid = 4242
        self.signals: list[str] = []
        self.closed = False

    def signalProcess(self, name):
        self.signals.append(name)

    def loseConnection(self):
        self.closed = True

    def end(self, exit_code=0, output=b"", signal_number=None):
        self.protocol.outReceived(output)
        if exit_code == 0 and signal_number is None:
            reason = ProcessDone(0)
        else:
            reason = ProcessTerminated(exitCode=None if signal_number else exit_code, signal=signal_number)
        self.protocol.processEnded(Failure(reason))


def fake_command_watcher(**options):
    clock = Clock()
    state = YieldState(clock)
    metrics = Metrics()
    runs: list[FakeProcess] = []

    def spawn(protocol, executable, args, env):
        runs.append(FakeProcess(protocol, args))
        return runs[-1]

    watcher = CommandWatcher(clock, state, metrics, "game-probe", spawn=spawn, **options)
    return watcher, runs, clock, state, metrics


def test_command_probe_exit_status_drives_the_hold():
    watcher, runs, clock, state, metrics = fake_command_watcher(interval=5, timeout=2)
    watcher.startService()
    assert len(runs) == 1 and runs[0].args[-1] == "game-probe"
    runs[0].end(0, b"eldenring.exe is using the GPU\n")
    assert sources(state) == ["command"]
    assert state.holds[0].reason == "eldenring.exe is using the GPU"
    clock.advance(5)
    runs[1].end(0)  # still yes: the hold stays, not retaken
    assert state.holds[0].reason == "eldenring.exe is using the GPU"
    clock.advance(5)
    runs[2].end(1)
    assert not state.yielded
    clock.advance(5)
    runs[3].end(0)
    assert state.yielded
    # Neither yes nor no: an error, counted, and the state stays as it was.
    clock.advance(5)
    runs[4].end(2, b"nvidia-smi not found on PATH\n")
    assert state.yielded and errors(metrics, "command") == 1
    assert watcher.status()["last_answer"] == "error"
    assert "nvidia-smi not found" in watcher.status()["last_detail"]
    clock.advance(5)
    runs[5].end(signal_number=9)
    assert state.yielded and errors(metrics, "command") == 2
    clock.advance(5)
    runs[6].end(1)
    assert not state.yielded
    watcher.stopService()
    assert clock.getDelayedCalls() == []
    assert errors(metrics, "command") == 2


def test_command_probe_timeout_kills_it_keeps_the_state_and_the_loop_goes_on():
    watcher, runs, clock, state, metrics = fake_command_watcher(interval=5, timeout=2)
    watcher.startService()
    runs[0].end(0)
    assert state.yielded
    clock.advance(5)
    assert len(runs) == 2
    clock.advance(2)  # no answer within the timeout
    assert runs[1].signals == ["KILL"] and runs[1].closed
    assert state.yielded and errors(metrics, "command") == 1
    assert "no answer within 2s" in watcher.status()["last_detail"]
    runs[1].end(signal_number=9)  # the kill lands later: already counted, nothing changes
    assert errors(metrics, "command") == 1
    clock.advance(3)
    assert len(runs) == 3  # the loop still runs
    runs[2].end(1)
    assert not state.yielded
    watcher.stopService()
    assert clock.getDelayedCalls() == []


def test_command_probe_that_cannot_start_is_counted_and_retried():
    clock = Clock()
    state = YieldState(clock)
    metrics = Metrics()

    def broken_spawn(*args, **kwargs):
        raise OSError("fork failed")

    watcher = CommandWatcher(clock, state, metrics, "probe", interval=1, spawn=broken_spawn)
    watcher.startService()
    clock.advance(1)
    clock.advance(1)
    assert errors(metrics, "command") == 3
    assert "cannot start it: fork failed" in watcher.status()["last_detail"]
    watcher.stopService()
    assert clock.getDelayedCalls() == []


def test_stopping_kills_a_run_in_progress():
    watcher, runs, clock, state, metrics = fake_command_watcher(interval=5, timeout=2)
    watcher.startService()
    watcher.stopService()
    assert runs[0].signals == ["KILL"]
    assert clock.getDelayedCalls() == []
    assert not state.yielded and errors(metrics, "command") == 0


@pytest_twisted.ensureDeferred
async def test_real_command_probe_answers(tmp_path):
    answer = tmp_path / "answer"
    state = YieldState(reactor)
    metrics = Metrics()
    watcher = CommandWatcher(reactor, state, metrics, f"echo checking; exit $(cat {answer})", timeout=5)
    steps = [("0", True, 0), ("1", False, 0), ("0", True, 0), ("3", True, 1), ("1", False, 1)]
    for code, yielded, errors_so_far in steps:
        answer.write_text(code)
        await watcher.probe_once().addTimeout(TIMEOUT, reactor)
        assert state.yielded is yielded, (code, watcher.status())
        assert errors(metrics, "command") == errors_so_far


@pytest_twisted.ensureDeferred
async def test_real_command_probe_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "pid"
    state = YieldState(reactor)
    state.hold("command", "from an earlier run")
    metrics = Metrics()
    # The shell starts a child and waits: killing only the shell would leave the child.
    command = f"sleep 30 & echo $! > {pid_file}; wait"
    watcher = CommandWatcher(reactor, state, metrics, command, timeout=0.5)
    await watcher.probe_once().addTimeout(TIMEOUT, reactor)
    # Ended by its own timeout, not by the 30 s child: the watcher says so, and the child is gone.
    assert watcher.status()["last_detail"] == "no answer within 0.5s; killed it"
    assert errors(metrics, "command") == 1 and state.yielded  # unknown: the state is kept
    child = int(pid_file.read_text())
    await wait_for(reactor, lambda: not _alive(child), timeout=5)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest_twisted.ensureDeferred
async def test_real_command_loop_survives_failing_runs():
    state = YieldState(reactor)
    metrics = Metrics()
    watcher = CommandWatcher(reactor, state, metrics, "echo broken >&2; exit 7", interval=0.1, timeout=5)
    watcher.startService()
    try:
        await wait_for(reactor, lambda: watcher.runs >= 3, timeout=TIMEOUT)
        assert errors(metrics, "command") >= 3 and not state.yielded
        assert "exited 7" in watcher.status()["last_detail"] and "broken" in watcher.status()["last_detail"]
    finally:
        watcher.stopService()
    assert watcher._loop is None


@pytest.mark.parametrize(
    "apps, names, code, says",
    [
        ("/usr/bin/ollama\nZ:\\Games\\EldenRing.exe\n", ["eldenring.exe"], 0, "EldenRing.exe is using the GPU"),
        ("/usr/bin/ollama\n", ["eldenring.exe", "blender*"], 1, ""),
        ("/opt/blender/blender-4.2\n", ["blender*"], 0, "blender-4.2 is using the GPU"),
        ("", ["game"], 1, ""),
    ],
)
def test_nvidia_game_probe_script(tmp_path, apps, names, code, says):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s' '{apps}'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run([str(PROBE), *names], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == code, result
    assert result.stdout.strip() == says


def test_nvidia_game_probe_script_errors(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    missing = subprocess.run([str(PROBE), "game"], capture_output=True, text=True, env=env, timeout=30)
    assert missing.returncode == 2 and "nvidia-smi not found" in missing.stderr
    usage = subprocess.run([str(PROBE)], capture_output=True, text=True, env=env, timeout=30)
    assert usage.returncode == 2 and "usage" in usage.stderr
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'\nexit 9\n"
    )
    fake.chmod(0o755)
    env["PATH"] = f"{tmp_path}:/usr/bin:/bin"
    broken = subprocess.run([str(PROBE), "game"], capture_output=True, text=True, env=env, timeout=30)
    assert broken.returncode == 3 and "could not communicate" in broken.stderr


# -- outage detection ----------------------------------------------------------------


class FakeCheck:
    """The outage probe: each call is a Deferred the test fires (True: the upstream serves the call)."""

    def __init__(self):
        self.calls: list[Deferred] = []
        self.targets: list = []

    def __call__(self, call=None) -> Deferred:
        self.calls.append(Deferred())
        self.targets.append(call)
        return self.calls[-1]


def outage_watcher(**options):
    check = FakeCheck()
    # The health judges with its watcher, as service.build wires them.
    core = make_core()
    core = attrs.evolve(
        core, health=UpstreamHealth(
            "http://upstream.invalid", judge=lambda reason, call=None: watcher.judge(reason, call),
            record=ServedRecord(core.clock),
        ),
    )
    watcher = OutageWatcher(core.clock, core.state, core.health, check, core.metrics, **options)
    return watcher, check, core


def verdict(d: Deferred):
    """The value a fired verdict Deferred holds (the test fails if it has not fired)."""
    results = []
    d.addBoth(results.append)
    assert results, "the verdict is still pending"
    return results[0]


EMBED_CALL = ModelCall("/api/embed", "all-minilm")


def test_no_outage_hold_for_an_upstream_that_never_answered():
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].errback(ConnectionRefusedError())  # the probe at start
    for reason in ("refused", "connect", "reset"):
        assert verdict(core.health.report(reason)) is False
    assert not core.state.yielded and not watcher.reachable
    assert len(check.calls) == 1
    assert core.clock.getDelayedCalls() == []
    watcher.stopService()


def test_outage_hold_is_taken_when_a_probe_confirms_probed_with_backoff_and_ended_by_a_pass():
    watcher, check, core = outage_watcher(interval=0.5, max_interval=2)
    watcher.startService()
    check.calls[0].callback(True)
    assert watcher.reachable
    assert verdict(core.health.report("status_502")) is False
    assert len(check.calls) == 1
    # Slow is not down: a timeout is judged by a probe (a wedged runner times out every call),
    # and a passing probe says the request was merely slow.
    slow = core.health.report("timeout")
    assert len(check.calls) == 2 and not slow.called
    check.calls[1].callback(True)
    assert verdict(slow) is False and not core.state.yielded
    del check.calls[1], check.targets[1]
    # A refused connection starts a probe; the failures wait for its verdict, no hold yet.
    first = core.health.report("refused")
    second = core.health.report("reset")  # joins the same probe
    assert len(check.calls) == 2 and check.targets[1] is None
    assert not core.state.yielded
    assert not first.called and not second.called
    check.calls[1].errback(ConnectionRefusedError())
    assert sources(core.state) == ["outage"]
    assert core.state.holds[0].reason == "upstream failing (the health path fails)"
    assert verdict(first) is True and verdict(second) is True
    # Held: later failures are forgiven at once, with no probe of their own.
    assert verdict(core.health.report("reset")) is True
    assert len(check.calls) == 2
    # Probes after 0.5, 1 and 2 seconds, each failing; then 2 again (the cap).
    for delay in (0.5, 1, 2):
        before = len(check.calls)
        core.clock.advance(delay - 0.01)
        assert len(check.calls) == before
        core.clock.advance(0.01)
        assert len(check.calls) == before + 1
        check.calls[-1].callback(False)
        assert core.state.yielded
    core.clock.advance(2)
    check.calls[-1].callback(True)
    assert not core.state.yielded
    # Real traffic succeeds: the next outage starts with quick probes again.
    core.health.report(None)
    core.health.report("status_503")
    check.calls[-1].callback(False)
    assert core.state.yielded
    core.clock.advance(0.5)
    assert len(check.calls) == 8
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []
    assert core.state.yielded  # stopping does not end the hold
    assert check.calls[-1].called  # the probe in flight was cancelled
    # Stopped: nothing judges the failures any more, and nothing is probed.
    assert verdict(core.health.report("refused")) is False and len(check.calls) == 8
    assert core.sample("yieldproxy_outage_probes_total", upstream="default", probe="health", result="down") == 5
    assert core.sample("yieldproxy_outage_probes_total", upstream="default", probe="health", result="up") == 3


def test_a_request_that_fails_alone_is_counted_and_takes_no_hold():
    """Its own input broke its call: the probe of the model it was served before passes, so no outage; the pass
    is believed for VERDICT_SECONDS, so its retries cost no probe of their own."""
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    core.health.served(EMBED_CALL)
    judged = core.health.report("gpu_error", EMBED_CALL)
    assert check.targets[-1] == EMBED_CALL
    check.calls[-1].callback(True)
    assert verdict(judged) is False
    for _ in range(4):
        core.clock.advance(VERDICT_SECONDS / 5)
        assert verdict(core.health.report("gpu_error", EMBED_CALL)) is False
    assert len(check.calls) == 2
    assert not core.state.yielded
    assert core.sample("yieldproxy_yields_total", source="outage") == 0
    assert core.sample(
        "yieldproxy_failures_alone_total", upstream="default", reason="gpu_error", evidence="probe",
    ) == 5
    # Past it, the next failure is probed again.
    core.clock.advance(VERDICT_SECONDS)
    core.health.report("gpu_error", EMBED_CALL)
    assert len(check.calls) == 3
    check.calls[-1].callback(True)
    assert core.clock.getDelayedCalls() == []
    watcher.stopService()


def test_a_burst_of_distinct_model_names_cannot_start_a_probe_storm():
    """Failures of many distinct calls at once (a client naming 50 models, or one model in 50 spellings) all
    wait on one probe of the model the upstream served: a burst never sends the GPU a model call per name."""
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    core.health.served(EMBED_CALL)
    judged = [core.health.report("gpu_error", ModelCall("/api/embed", f"model-{i}")) for i in range(50)]
    assert check.targets[1:] == [EMBED_CALL]
    assert not any(d.called for d in judged)
    # The probe fails: the upstream is down, the hold explains every failure waiting.
    check.calls[1].callback(False)
    assert sources(core.state) == ["outage"]
    assert [verdict(d) for d in judged] == [True] * 50
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


def test_with_nothing_known_one_model_fails_alone_and_several_start_at_most_max_probes():
    """Nothing served yet and no probe model: the first model's failure is its own (no probe, nobody held);
    the next models' failures are "several models fail", each probing its own call, at most MAX_PROBES at
    once, the rest waiting on the first in flight; the first that fails holds."""
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    judged = [core.health.report("gpu_error", ModelCall("/api/embed", f"model-{i}")) for i in range(50)]
    assert verdict(judged[0]) is False
    assert core.sample("yieldproxy_failures_alone_total", upstream="default", reason="gpu_error", evidence="none") == 1
    probes = len(check.calls) - 1
    assert 1 <= probes <= MAX_PROBES, probes
    assert check.targets[1] == ModelCall("/api/embed", "model-1")
    assert not any(d.called for d in judged[1:])
    check.calls[1].callback(False)
    assert sources(core.state) == ["outage"]
    assert [verdict(d) for d in judged[1:]] == [True] * 49
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


def test_failures_joining_another_calls_probe_count_when_it_passes():
    """A failure past MAX_PROBES that waits on another call's probe: a pass says the upstream serves,
    so the attempt counts (as a request failing alone), and nothing is held."""
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    judged = [core.health.report("gpu_error", ModelCall("/api/embed", f"model-{i}")) for i in range(3 * MAX_PROBES)]
    # The first fails alone at once (nothing known); the others fail with it: several models.
    assert len(check.calls) - 1 == MAX_PROBES
    for probe in check.calls[1:]:
        probe.callback(True)
    assert [verdict(d) for d in judged] == [False] * len(judged)
    assert not core.state.yielded
    # The probes are done: the next failure gets a probe of its own call again.
    core.health.report("gpu_error", ModelCall("/api/embed", "model-x"))
    assert check.targets[-1] == ModelCall("/api/embed", "model-x")
    check.calls[-1].callback(True)
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


def test_an_outage_revealed_by_model_calls_ends_only_when_such_a_call_works_again():
    """/api/version answering proves nothing about the runner: only a model call of the failing kind ends it."""
    watcher, check, core = outage_watcher(interval=0.5, max_interval=4)
    watcher.startService()
    check.calls[0].callback(True)
    core.health.served(EMBED_CALL)
    judged = [core.health.report("gpu_error", EMBED_CALL) for _ in range(3)]
    assert len(check.calls) == 2 and check.targets[1] == EMBED_CALL
    check.calls[1].callback(False)
    assert [verdict(d) for d in judged] == [True, True, True]
    assert sources(core.state) == ["outage"]
    # Every later probe is the model call, never the health path.
    for delay in (0.5, 1, 2, 4, 4):
        core.clock.advance(delay)
        assert check.targets[-1] == EMBED_CALL
        check.calls[-1].callback(False)
        assert core.state.yielded
    core.clock.advance(4)
    check.calls[-1].callback(True)
    assert not core.state.yielded
    assert watcher.status()["outage_probe"] is None
    assert core.sample("yieldproxy_outage_probes_total", upstream="default", probe="model", result="down") == 6
    assert core.clock.getDelayedCalls() == []
    watcher.stopService()


def test_the_probes_of_a_held_outage_ask_in_turn_for_the_models_it_served_so_one_broken_model_cannot_keep_it():
    """The outage was confirmed by a probe of the model served most recently (of equal standing); if that model
    stays broken while the GPU is back, the follow-ups ask for the other models it served too, and a pass
    ends the hold.  The failing request's own model is never probed."""
    watcher, check, core = outage_watcher(interval=0.5, max_interval=0.5)
    watcher.startService()
    check.calls[0].callback(True)
    older, newer = ModelCall("/api/embed", "older"), ModelCall("/api/chat", "newer")
    core.health.served(older)
    core.health.served(newer)
    judged = core.health.report("timeout", ModelCall("/api/embed", "stuck"))
    assert check.targets[-1] == newer
    check.calls[-1].callback(False)
    assert verdict(judged) is True and sources(core.state) == ["outage"]
    assert watcher.status()["outage_probes"] == ["/api/chat with model newer", "/api/embed with model older"]
    core.clock.advance(0.5)
    # One step probes them at once (up to PROBES_PER_STEP).
    assert check.targets[-2:] == [newer, older]
    check.calls[-2].callback(False)  # newer stays broken...
    assert core.state.yielded
    check.calls[-1].callback(True)  # ...while the GPU serves older again
    assert not core.state.yielded
    assert ModelCall("/api/embed", "stuck") not in check.targets
    # newer failed while older served: it fails alone, and is no evidence about the GPU from now on.
    assert core.health.failing.get("newer", core.clock.seconds()) is not None
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


def test_model_probes_wait_while_another_source_holds_the_gpu():
    """Nothing reaches a yielded GPU: not even the outage watcher's own probe."""
    watcher, check, core = outage_watcher(interval=0.5, max_interval=0.5)
    watcher.startService()
    check.calls[0].callback(True)
    core.health.served(EMBED_CALL)
    core.health.report("gpu_error", EMBED_CALL)
    check.calls[1].callback(False)
    core.state.hold("api", "game")
    calls = len(check.calls)
    core.clock.advance(5)
    assert len(check.calls) == calls
    core.state.release("api")
    core.clock.advance(0.5)
    assert len(check.calls) == calls + 1 and check.targets[-1] == EMBED_CALL
    check.calls[-1].callback(True)
    assert not core.state.yielded
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


def test_no_outage_hold_or_probe_while_another_source_holds():
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    core.state.hold("api", "game")
    assert verdict(core.health.report("refused")) is True  # the GPU is lent away: explained
    assert verdict(core.health.report("gpu_error", EMBED_CALL)) is True
    assert sources(core.state) == ["api"] and len(check.calls) == 1
    core.state.release("api")
    core.health.report("refused")
    check.calls[-1].errback(ConnectionRefusedError())
    assert sources(core.state) == ["outage"]
    watcher.stopService()
    assert core.clock.getDelayedCalls() == []


def test_a_verdict_abandoned_by_its_client_is_forgotten_and_stopping_decides_the_rest():
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    gone = core.health.report("gpu_error", EMBED_CALL)
    waiting = core.health.report("gpu_error", EMBED_CALL)
    gone.cancel()
    gone.addErrback(lambda f: None)
    watcher.stopService()
    assert verdict(waiting) is False  # nobody decides any more: the attempt counts
    assert not core.state.yielded
    assert core.clock.getDelayedCalls() == []


def test_an_outage_hold_ended_by_hand_stops_the_probing():
    watcher, check, core = outage_watcher()
    watcher.startService()
    check.calls[0].callback(True)
    core.health.report("refused")
    check.calls[-1].errback(ConnectionRefusedError())
    assert core.state.yielded
    core.state.release("outage")  # POST /resume {"source": "outage"}
    core.clock.advance(0.5)
    assert len(check.calls) == 2
    assert core.clock.getDelayedCalls() == []
    watcher.stopService()


def held_by(proxy) -> set[str]:
    """The sources of every hold taken since start (``yieldproxy_yields_total``)."""
    return {
        sample.labels["source"]
        for metric in proxy.metrics.registry.collect()
        if metric.name == "yieldproxy_yields"
        for sample in metric.samples
        if sample.name == "yieldproxy_yields_total" and sample.value
    }


@pytest.mark.parametrize("mode", ["refuse", "reset"])
@pytest_twisted.ensureDeferred
async def test_outage_without_a_declared_yield_loses_nothing(mode):
    """The backend fails mid-burst and nobody yields: the proxy holds by itself, and every caller succeeds.

    Here the backend goes away on the wire (its port closed, its connections reset) under real
    ollama clients; a GPU that fails in its own words is the in-memory test below."""
    config = config_with(replay={"concurrency": 4})
    stack = await start_stack(reactor, config, watchers=True, latency=0.01, parallel=4)
    try:
        burst = Burst(stack.proxy_url, [f"outage {mode} {i}" for i in range(240)], concurrency=16)
        running = in_thread(reactor, burst.run, timeout=120)
        await wait_for(reactor, lambda: burst.done >= 40, timeout=60)
        await stack.sim.set_mode(mode)
        await wait_for(reactor, lambda: stack.proxy.state.hold_of("outage") is not None, timeout=10)
        # Every caller's request is held in the lot: none in flight to the failing backend, none failed.
        await wait_for(reactor, lambda: len(stack.proxy.lot) == 16, timeout=10)
        await stack.sim.set_mode("ok")
        await running
        assert_clean(burst, stack)
        assert not stack.proxy.state.yielded
        assert held_by(stack.proxy) == {"outage"}
        assert stack.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "upstream_error"}) == 0
    finally:
        await stack.stop()


def test_a_gpu_outage_without_a_declared_yield_loses_nothing():
    """The GPU fails mid-burst (every model call gets Ollama's out-of-memory 500) and nobody yields: the
    proxy holds by itself, and every caller succeeds.  In memory, on a Clock (tests/inmemory.py)."""
    config = config_with(replay={"concurrency": 4})
    rig = Rig(config, watchers=True, latency=0.01, parallel=4)
    rig.start()
    burst = MemoryBurst(rig, [f"outage error500 {i}" for i in range(240)], concurrency=16)
    burst.start()
    rig.until(lambda: burst.done >= 40, 60)
    rig.sim.set_mode("error500")
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    # Every caller's request is held in the lot: none in flight to the failing backend, none failed.
    rig.until(lambda: len(rig.proxy.lot) == 16, 10)
    rig.sim.set_mode("ok")
    rig.until(lambda: burst.finished, 120)
    assert_clean(burst, rig)
    assert not rig.proxy.state.yielded
    assert held_by(rig.proxy) == {"outage"}
    assert rig.sample("yieldproxy_replay_total", **{"class": "batch", "outcome": "upstream_error"}) == 0
    rig.stop()
    assert rig.clock.getDelayedCalls() == []


def test_an_outage_before_the_first_request_is_an_outage_too():
    """The health probe at start counts as an answer: the first caller waits instead of failing.
    In memory, on a Clock: the sim's ``refuse`` aborts every request on arrival there."""
    rig = Rig(config_with(), watchers=True)
    rig.start()
    outage = next(s for s in rig.proxy.watchers if s.name == "watcher:outage")
    rig.until(lambda: outage.reachable, 10)
    rig.sim.set_mode("refuse")
    pending = rig.post("/api/embed", {"model": "all-minilm", "input": "first"})
    rig.until(lambda: rig.proxy.state.hold_of("outage") is not None, 10)
    # The first caller waits in the lot behind the hold instead of failing.
    rig.until(lambda: len(rig.proxy.lot) == 1, 10)
    assert not answered(pending)
    rig.sim.set_mode("ok")
    rig.until(lambda: answered(pending), TIMEOUT)
    assert rig.result(pending).code == 200
    rig.until(lambda: not rig.proxy.state.yielded, 10)
    rig.stop()
    assert rig.clock.getDelayedCalls() == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_twisted.ensureDeferred
async def test_never_reachable_upstream_keeps_giving_a_fast_502():
    config = config_with(upstream={"max_attempts": 2, "retry_backoff_seconds": 0.1})
    stack = await start_stack(reactor, config, upstream=f"http://127.0.0.1:{_closed_port()}", watchers=True)
    try:
        for _ in range(2):
            response = await treq.post(
                stack.proxy_url + "/api/embed", json={"model": "all-minilm", "input": "x"}, persistent=False
            ).addTimeout(TIMEOUT, reactor)
            assert response.code == 502
            # Answered straight, never parked behind an outage hold (no wall-clock bound needed).
            assert response.headers.getRawHeaders("x-yield-parked-seconds") is None
        assert not stack.proxy.state.yielded
        assert stack.sample("yieldproxy_yields_total", source="outage") == 0
    finally:
        await stack.stop()


# -- the state log line ----------------------------------------------------------------


def test_each_state_change_is_one_log_line():
    """Source, reason, parked per class and how long the previous state lasted, in one line each."""
    from twisted.logger import formatEvent, globalLogPublisher

    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        core = make_core(concurrency=1)
        core.clock.advance(10)
        core.state.hold("api", "game")
        for cls in ("batch", "batch", "interactive"):
            core.scheduler.admit(Entry(cls=cls))
        core.clock.advance(5)
        core.state.release("api")
        for _ in range(3):
            core.run(0.01)
            core.scheduler.finished(seconds=0.01)
        core.run(0.01)
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [
        formatEvent(e) for e in events if e.get("log_namespace", "").startswith("yieldproxy") and "log_format" in e
    ]
    state_lines = [line for line in lines if line.startswith(("GPU ", "lot drained"))]
    assert state_lines[:2] == [
        "GPU yielded: source=api reason='game'; now yielded, parked none, in flight 0 (previous state lasted 10.0s)",
        "GPU available: source=api reason='game'; now draining, parked batch=2, interactive=1, in flight 0 "
        "(previous state lasted 5.0s)",
    ]
    assert len(state_lines) == 3
    assert state_lines[2].startswith("lot drained: now available, in flight 1 (draining lasted 0.0")
    assert core.clock.getDelayedCalls() == []


@pytest_twisted.ensureDeferred
async def test_real_command_probe_that_leaves_a_child_behind(tmp_path):
    """The shell answered, but a child it started keeps our pipe open: the answer counts, the child dies."""
    pid_file = tmp_path / "pid"
    state = YieldState(reactor)
    metrics = Metrics()
    watcher = CommandWatcher(reactor, state, metrics, f"sleep 30 & echo $! > {pid_file}; exit 0", timeout=0.5)
    await watcher.probe_once().addTimeout(TIMEOUT, reactor)
    assert state.yielded and errors(metrics, "command") == 0
    await wait_for(reactor, lambda: not _alive(int(pid_file.read_text())), timeout=5)


def test_stop_signals_catch_a_second_sigterm_and_unhandled_sigusr_during_the_stop():
    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    before = {signum: signal.getsignal(signum) for signum in watched}

    def own_handler(signum, frame):
        """An application's (or twistd --logfile's) SIGUSR2 handler: left alone."""

    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, own_handler)
        stopper = StopSignals(ImmediateReactor(), 30.0)
        stopper.startService()
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]  # nothing changes until the stop
        stopper.stopService()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            assert signal.getsignal(signum) == stopper._on_signal
        assert signal.getsignal(signal.SIGUSR2) is own_handler
        with LogCapture() as logs:
            stopper._on_signal(signal.SIGTERM, None)
            stopper._on_signal(signal.SIGUSR1, None)
        lines = [formatEvent(e) for e in logs.events]
        assert lines[0].startswith("SIGTERM received while already stopping: ignored") and "30s" in lines[0]
        assert lines[1] == "SIGUSR1 received while stopping: ignored (watchers.signals is off)"
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
