"""The packaged service: ``twistd -n yieldproxy`` as a real process, and its graceful stop.

What twistd decides from its command line alone (the usage and config errors,
one line and exit 1) runs twistd's own main in this process, up to where it
would start the service (:func:`twistd_parses`); starting, listening (or
failing to), logging and signals run a real ``twistd`` process.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import attrs
import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import ChildOutput, free_port, sleep, until_healthy, wait_for
from yieldproxy.tools.sim import SimOllama

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
TIMEOUT = 30


def run_twistd(*args) -> tuple[object, ChildOutput]:
    protocol = ChildOutput()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = reactor.spawnProcess(
        protocol, TWISTD, [TWISTD, "-n", "--pidfile=", "yieldproxy", *args], env=env
    )
    return process, protocol


def test_twistd_lists_the_plugin():
    result = subprocess.run([TWISTD, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "yieldproxy" in result.stdout


def twistd_until_exit(*args) -> subprocess.CompletedProcess:
    """``twistd -n yieldproxy ARGS`` expected to stop by itself (a start-up error)."""
    return subprocess.run(
        [TWISTD, "-n", "--pidfile=", "yieldproxy", *args], capture_output=True, text=True, timeout=60,
    )


@attrs.frozen
class Parsed:
    returncode: int | str | None
    stdout: str
    stderr: str


@pytest.fixture
def twistd_parses(monkeypatch, capsys):
    """``twistd -n --pidfile= yieldproxy ARGS`` in this process: twistd's own main (``app.run`` with its
    ``ServerOptions``, the plugin found as twistd finds it), expected to exit while parsing; were it to get
    as far as running the service, it does not run and the test fails."""

    def parse(*args: str) -> Parsed:
        from twisted.application import app
        from twisted.scripts.twistd import ServerOptions

        monkeypatch.setattr(sys, "argv", [TWISTD, "-n", "--pidfile=", "yieldproxy", *args])
        capsys.readouterr()
        ran: list = []
        with pytest.raises(SystemExit) as exited:
            app.run(ran.append, ServerOptions)
        assert ran == []
        out, err = capsys.readouterr()
        return Parsed(exited.value.code, out, err)

    return parse


def test_bad_config_stops_twistd_with_the_key_named(tmp_path, twistd_parses):
    path = tmp_path / "y.toml"
    path.write_text("[replay]\nconcurrency = 0\n")
    result = twistd_parses("--config", str(path))
    assert result.returncode == 1
    # One line: not after twistd's listing of every option.
    assert result.stderr == f"twistd yieldproxy: {path}: replay.concurrency: must be >= 1, got 0\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, line",
    [
        (["--listen", "bogus:1"], "proxy.listen: not a valid endpoint (Unknown endpoint type: 'bogus'): 'bogus:1'"),
        (["--listen", "22450"], "proxy.listen: not a valid endpoint (Unknown endpoint type: '22450'): '22450'; "
         "did you mean 'tcp:22450'? (add ':interface=127.0.0.1' to listen on this machine only)"),
        (["--admin", "127.0.0.1:22451"], "admin.listen: not a valid endpoint (Unknown endpoint type: '127.0.0.1'): "
         "'127.0.0.1:22451'; did you mean 'tcp:22451:interface=127.0.0.1'?"),
        (["--log-format", "xml"], "--log-format: must be text or json, got 'xml'"),
        (["--bogus"], "option --bogus not recognized (twistd yieldproxy --help lists the options)"),
        (["--listen"], "option --listen requires argument (twistd yieldproxy --help lists the options)"),
    ],
)
def test_usage_errors_are_one_line(args, line, twistd_parses):
    result = twistd_parses(*args)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", f"twistd yieldproxy: {line}\n")


@pytest.fixture
def taken_port():
    """A port on 127.0.0.1 that another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "case", ["proxy port in use", "admin port in use", "port out of range", "missing socket directory", "bad interface"]
)
def test_a_listener_that_cannot_start_is_one_line(case, taken_port, tmp_path):
    """What only fails when the listeners bind: one critical line naming the key and why, exit 1."""
    free = f"tcp:{free_port()}:interface=127.0.0.1"
    taken = f"tcp:{taken_port}:interface=127.0.0.1"
    missing = f"unix:{tmp_path}/missing/proxy.sock"
    listen, admin, line = {
        "proxy port in use": (taken, free, f"proxy.listen {taken!r}: cannot listen: address already in use"),
        "admin port in use": (free, taken, f"admin.listen {taken!r}: cannot listen: address already in use"),
        "port out of range": ("tcp:99999", free, "proxy.listen 'tcp:99999': cannot listen: the port must be 0-65535"),
        "missing socket directory": (
            missing, free, f"proxy.listen {missing!r}: cannot listen: the directory {tmp_path}/missing does not exist"
        ),
        "bad interface": (
            "tcp:0:interface=999.1.1.1", free,
            "proxy.listen 'tcp:0:interface=999.1.1.1': cannot listen: the interface is neither an IP address",
        ),
    }[case]
    result = twistd_until_exit("--upstream", "http://127.0.0.1:9", "--listen", listen, "--admin", admin)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output and "stderr#" not in output, output
    [error] = [text for text in output.splitlines() if "#critical]" in text]
    assert error.split("#critical] ", 1)[1].startswith(line), output
    # twistd's two start lines, the admin listener's three when the proxy one fails (Twisted's two and
    # its own "admin listening on"; and the proxy site's own "starting on" line, for a unix socket),
    # and the error (and, where the machine's hard limit is below what the defaults need, the
    # open-file line).
    lines = [text for text in output.splitlines() if "[yieldproxy.lifecycle.limits#" not in text]
    assert len(lines) <= 7, output


async def _started(run, sim_port: int, *extra, **env: str):
    """A twistd child started by ``run`` (a pipe's or a terminal's) in front of the sim, once it answers:
    its process, its output and its two ports."""
    proxy_port, admin_port = free_port(), free_port()
    process, protocol = run(
        "--upstream", f"http://127.0.0.1:{sim_port}",
        "--listen", f"tcp:{proxy_port}:interface=127.0.0.1",
        "--admin", f"tcp:{admin_port}:interface=127.0.0.1",
        *extra, **env,
    )
    await until_healthy(
        reactor, f"http://127.0.0.1:{admin_port}", lambda: protocol.ended.called,
        lambda: protocol.output.decode(errors="replace"), tries=200,
    )
    return process, protocol, proxy_port, admin_port


async def start_service(sim_port: int, *extra):
    process, protocol, proxy_port, admin_port = await _started(run_twistd, sim_port, *extra)
    return process, protocol, f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}"


@pytest_twisted.ensureDeferred
async def test_sigterm_answers_parked_requests_before_exit():
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, proxy, admin = await start_service(sim_port)
    try:
        ok = await treq.post(proxy + "/api/embed", json={"model": "all-minilm", "input": "a"}).addTimeout(TIMEOUT, reactor)
        assert ok.code == 200
        await treq.post(admin + "/yield", json={"reason": "game", "expected_seconds": 40}).addTimeout(TIMEOUT, reactor)
        parked = [
            treq.post(proxy + "/api/embed", json={"model": "all-minilm", "input": f"p{i}"}, persistent=False).addTimeout(TIMEOUT, reactor)
            for i in range(3)
        ]

        async def parked_count():
            status = await (await treq.get(admin + "/status", persistent=False)).json()
            return status["parked_total"]

        for _ in range(100):
            if await parked_count() == 3:
                break
            await sleep(reactor, 0.05)
        process.signalProcess("TERM")
        for d in parked:
            response = await d
            assert response.code == 503
            assert int(response.headers.getRawHeaders("retry-after")[0]) >= 1
            assert "shutting down" in (await response.json())["error"]
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), protocol.output
        assert b"Server Shut Down." in protocol.output
        assert sim.requests_total["/api/embed"] == 1
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_sigterm_lets_in_flight_requests_finish():
    sim = SimOllama(reactor, latency=1.0)
    sim_port = await sim.listen()
    process, protocol, proxy, admin = await start_service(sim_port)
    try:
        pending = treq.post(proxy + "/api/embed", json={"model": "all-minilm", "input": "slow"}, persistent=False).addTimeout(TIMEOUT, reactor)
        await wait_for(reactor, lambda: sim.in_flight == 1)
        process.signalProcess("TERM")
        response = await pending
        assert response.code == 200
        assert (await response.json())["embeddings"]
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), protocol.output
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_quickstart_log_sample_is_what_twistd_logs():
    """docs/quickstart.md shows the lines that say where it listens: they must be the real ones."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "quickstart.md").read_text(encoding="utf-8")
    sample = re.search(r"It logs where it listens.*?\n```\n(.*?)```", page, re.S)
    assert sample, "docs/quickstart.md: no log sample after 'It logs where it listens'"
    lines = [line.removeprefix("... ") for line in sample.group(1).splitlines()]
    assert len(lines) == 4 and "11436" in lines[0] + lines[1] and "11435" in lines[2] + lines[3], lines
    assert "admin listening on" in lines[1] and "proxy listening on" in lines[3], lines
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, proxy, admin = await start_service(sim_port)
    try:
        proxy_port, admin_port = proxy.rsplit(":", 1)[1], admin.rsplit(":", 1)[1]
        expected_lines = [line.replace("11435", proxy_port).replace("11436", admin_port) for line in lines]
        try:
            await wait_for(reactor, lambda: expected_lines[-1].encode() in protocol.output, timeout=5)
        except AssertionError:
            pass  # reported below, with the output
        output = protocol.output.decode(errors="replace")
        position = 0
        for expected in expected_lines:
            found = output.find(expected, position)
            assert found >= 0, f"{expected!r} not logged (in this order):\n{output}"
            position = found + len(expected)
        process.signalProcess("TERM")
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), protocol.output
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_the_start_says_which_listener_is_which_and_catches_an_upstream_url_with_an_api_path():
    """Both sites log "ProxySite starting on N"; an upstream URL ending in /api made every request a 404, silently."""
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol = run_twistd(
        "--upstream", f"http://127.0.0.1:{sim_port}/api",
        "--listen", f"tcp:{(proxy_port := free_port())}:interface=127.0.0.1",
        "--admin", f"tcp:{(admin_port := free_port())}:interface=127.0.0.1",
    )
    try:
        await wait_for(reactor, lambda: b"admin listening on" in protocol.output and b"proxy listening on" in protocol.output,
                       timeout=TIMEOUT)
        lines = protocol.output.decode(errors="replace").splitlines()
        [proxy] = [line for line in lines if "proxy listening on" in line]
        [admin] = [line for line in lines if "admin listening on" in line]
        assert f"proxy listening on 127.0.0.1:{proxy_port} (proxy.listen = " in proxy
        assert f"admin listening on 127.0.0.1:{admin_port} (admin.listen = " in admin
        [warning] = [line for line in lines if "ends in" in line]
        assert "#warn]" in warning and f"proxy.upstream = 'http://127.0.0.1:{sim_port}/api'" in warning
        assert f"probably 'http://127.0.0.1:{sim_port}'" in warning
    finally:
        process.signalProcess("TERM")
        await protocol.ended.addTimeout(TIMEOUT, reactor)
        await sim.stop()


# -- a proxy run in a terminal (lifecycle/hangup.py) -----------------------------------------------------------


def run_twistd_in_a_terminal(*args, **env: str) -> tuple[object, ChildOutput]:
    """``twistd -n yieldproxy ARGS`` on a pseudo-terminal of its own, as a shell in a terminal window starts it: the
    terminal is its stdin, stdout and stderr, and its controlling terminal (closing it is ``loseConnection``)."""
    protocol = ChildOutput()
    environ = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "INVOCATION_ID")}
    process = reactor.spawnProcess(
        protocol, TWISTD, [TWISTD, "-n", "--pidfile=", "yieldproxy", *args],
        env={**environ, "PYTHONUNBUFFERED": "1", **env}, usePTY=True,
    )
    return process, protocol


async def start_in_a_terminal(sim_port: int, **env: str):
    return await _started(run_twistd_in_a_terminal, sim_port, **env)


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def end_every_process_on(port: int) -> None:
    """End every process this test started for the admin listener on ``port``: the first, and any new process a
    reload started (no child of this one), found by its command line."""
    import signal

    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                mine = f"tcp:{port}:interface=127.0.0.1".encode() in f.read()
        except (OSError, ValueError):
            continue
        if mine and entry.isdigit():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.kill(int(entry), sig)
                except ProcessLookupError:
                    break


@pytest_twisted.ensureDeferred
async def test_closing_its_terminal_stops_the_proxy_and_answers_what_is_parked():
    """The terminal closed: no process left serving (a reload took the hang-up for one and a new process, with no
    terminal, served on), the parked requests answered as a stop answers them; and a reload asked of a proxy in
    a terminal is refused in one line that says how to restart it."""
    from yieldproxy.tools.broker import Admin
    from yieldproxy.tools.cli import CliError, Settings, call_admin

    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, proxy_port, admin_port = await start_in_a_terminal(sim_port)
    admin, proxy = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{proxy_port}"
    try:
        await treq.post(admin + "/yield", json={"reason": "game"}, persistent=False).addTimeout(TIMEOUT, reactor)
        parked = [
            treq.post(proxy + "/api/embed", json={"model": "all-minilm", "input": f"p{i}"}, persistent=False)
            .addTimeout(TIMEOUT, reactor)
            for i in range(2)
        ]

        async def status():
            return await (await treq.get(admin + "/status", persistent=False)).json()

        for _ in range(100):
            if (await status())["parked_total"] == 2:
                break
            await sleep(reactor, 0.05)
        with pytest.raises(CliError) as refused:
            await call_admin(reactor, Settings(admin, None, TIMEOUT), Admin.reload)
        assert "answered 501: this proxy" in refused.value.message and "runs in a terminal" in refused.value.message
        assert "restart it instead" in refused.value.message
        assert "\n" not in refused.value.message
        assert (await status())["pid"] == process.pid

        process.loseConnection()  # the terminal window closed
        for d in parked:
            response = await d
            assert response.code == 503
            assert "shutting down" in (await response.json())["error"]
        code = await protocol.ended.addTimeout(TIMEOUT, reactor)
        assert code == 0, protocol.output
        assert not listening(proxy_port) and not listening(admin_port)
        assert sim.requests_total.get("/api/embed", 0) == 0
    finally:
        end_every_process_on(admin_port)
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_a_hangup_of_a_service_reloads_even_with_a_terminal(tmp_path):
    """Told to notify systemd (a ``Type=notify`` unit), SIGHUP is a reload as before: a new process serves."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    process, protocol, proxy_port, admin_port = await start_in_a_terminal(sim_port, NOTIFY_SOCKET=str(tmp_path / "notify"))
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        process.signalProcess("HUP")
        new = None
        for _ in range(300):
            try:
                new = (await (await treq.get(admin + "/status", persistent=False).addTimeout(5, reactor)).json())["pid"]
            except Exception:
                new = None
            if new not in (None, process.pid):
                break
            await sleep(reactor, 0.1)
        assert new not in (None, process.pid), protocol.output
        # The old process exits (the new one keeps the terminal open, so only its exit is seen).
        await wait_for(reactor, lambda: not os.path.exists(f"/proc/{process.pid}"), timeout=TIMEOUT)
        assert listening(proxy_port)
    finally:
        end_every_process_on(admin_port)
        process.loseConnection()
        notify.close()
        await sim.stop()


def test_twistd_yieldproxy_version_names_yieldproxy(twistd_parses):
    from twisted import __version__ as twisted_version

    from yieldproxy import __version__

    parsed = twistd_parses("--version")
    assert parsed.returncode == 0, parsed
    assert parsed.stdout == f"yieldproxy {__version__} (Twisted {twisted_version})\n", parsed


#: The ``yieldproxy`` console script pip installed next to this Python.
YIELDPROXY = os.path.join(os.path.dirname(sys.executable), "yieldproxy")


@pytest_twisted.ensureDeferred
async def test_yieldproxy_serve_starts_the_proxy_in_the_foreground():
    """``yieldproxy serve [options]`` is ``twistd -n --pidfile= yieldproxy [options]``: it serves, and stops on SIGTERM."""
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    proxy_port, admin_port = free_port(), free_port()
    protocol = ChildOutput()
    process = reactor.spawnProcess(
        protocol, YIELDPROXY,
        [YIELDPROXY, "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
         "--listen", f"tcp:{proxy_port}:interface=127.0.0.1", "--admin", f"tcp:{admin_port}:interface=127.0.0.1"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        await until_healthy(
            reactor, f"http://127.0.0.1:{admin_port}", lambda: protocol.ended.called,
            lambda: protocol.output.decode(errors="replace"), tries=200,
        )
        response = await treq.post(
            f"http://127.0.0.1:{proxy_port}/api/embed", json={"model": "all-minilm", "input": "a"}, persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert response.code == 200
        process.signalProcess("TERM")
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), protocol.output
        assert b"Server Shut Down." in protocol.output
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
        await sim.stop()


def test_yieldproxy_serve_says_a_usage_error_in_one_line():
    result = subprocess.run([YIELDPROXY, "serve", "--listen", "24445"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result
    assert result.stdout == "", result
    assert result.stderr.strip().splitlines() == [
        "twistd yieldproxy: proxy.listen: not a valid endpoint (Unknown endpoint type: '24445'): '24445'; "
        "did you mean 'tcp:24445'? (add ':interface=127.0.0.1' to listen on this machine only)"
    ], result


@pytest_twisted.ensureDeferred
async def test_a_restart_warns_of_each_hold_it_kept_and_how_to_end_it(tmp_path):
    """Restarted to "reset" it, the proxy is still yielded: each kept hold is a warning at start, with its resume."""
    config = tmp_path / "yieldproxy.toml"
    config.write_text(f'[state]\nholds_file = "{tmp_path / "holds.json"}"\n')
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    try:
        process, protocol, proxy, admin = await start_service(sim_port, "--config", str(config))
        try:
            response = await treq.post(admin + "/yield", json={"reason": "steam", "source": "game", "for_seconds": 600},
                                       persistent=False).addTimeout(TIMEOUT, reactor)
            assert response.code == 200
            await response.content()
            assert b"kept from the last run" not in protocol.output
        finally:
            process.signalProcess("TERM")
            await protocol.ended.addTimeout(TIMEOUT, reactor)
        process, protocol, proxy, admin = await start_service(sim_port, "--config", str(config))
        try:
            lines = protocol.output.decode(errors="replace").splitlines()
            [warning] = [line for line in lines if "kept from the last run" in line]
            assert "#warn]" in warning, warning
            assert ("still yielded: the hold of source game (reason 'steam', lease ends in " in warning
                    and "'yieldproxy resume --source game' ends it" in warning), warning
        finally:
            process.signalProcess("TERM")
            await protocol.ended.addTimeout(TIMEOUT, reactor)
    finally:
        await sim.stop()


@pytest_twisted.ensureDeferred
async def test_the_first_screen_of_the_example_config_is_where_it_listens_and_nothing_else(tmp_path):
    """``yieldproxy example-config`` used as it is: no warning, no open-file line, no ``Starting factory <... at
    0x...>`` per listener (nor its ``Stopping factory``) in a start, a request and a stop."""
    from yieldproxy.tools.cli import example_config

    config = tmp_path / "yieldproxy.toml"
    config.write_text(example_config())
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    try:
        process, protocol, proxy, admin = await start_service(sim_port, "--config", str(config))
        try:
            response = await treq.post(proxy + "/api/embed", json={"model": "all-minilm", "input": "a"},
                                       persistent=False).addTimeout(TIMEOUT, reactor)
            assert response.code == 200
            await response.content()
        finally:
            process.signalProcess("TERM")
            await protocol.ended.addTimeout(TIMEOUT, reactor)
    finally:
        await sim.stop()
    lines = protocol.output.decode(errors="replace").splitlines()
    assert not [line for line in lines if re.search(r"#(warn|error|critical)\]|Traceback|object at 0x", line)], lines
    first_screen = lines[:next(i for i, line in enumerate(lines) if "proxy listening on" in line) + 1]
    said = [re.sub(r"^\S+ \[[^]]+\] ", "", line) for line in first_screen]
    # twistd's two lines (its version, its reactor), then each listener's two.
    assert len(said) == 6 and said[0].startswith("twistd ") and said[1].startswith("reactor class: "), said
    assert [re.sub(r"\d+", "N", text.split(" (", 1)[0]) for text in said[2:]] == [
        "ProxySite starting on N", "admin listening on N.N.N.N:N", "ProxySite starting on N",
        "proxy listening on N.N.N.N:N",
    ], said
