"""
Tests for :mod:`yieldproxy.tools.cli`, the ``yieldproxy`` command.

The command runs in this process (:func:`run_cli`: :func:`yieldproxy.tools.cli.main`
with its output captured and its command run on the test's reactor) against
the admin app of a real proxy listening on 127.0.0.1 (or a unix socket) in
the same reactor.  A few run as real processes, where the process is the
subject: the installed console script against a real admin API, a fresh
interpreter that must not import the reactor, and ``yieldproxy sim`` (which
runs its own reactor and logging).  Every await is bounded.  Pure helpers
(endpoint parsing, the status table, argument errors) are tested in process.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
from hypothesis import given, strategies as st
from twisted.internet import defer, threads
from twisted.internet.endpoints import TCP4ServerEndpoint, UNIXServerEndpoint
from twisted.python.failure import Failure

from helpers import release_every_hold
from yieldproxy.config import Config
from yieldproxy.service import build
from yieldproxy.tools import cli, demo
from yieldproxy.tools.broker import Admin

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-admin-token-0123456789"
TIMEOUT = 30.0
#: The console script pip installed next to this Python.
INSTALLED = Path(sys.executable).parent / "yieldproxy"


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


@attrs.frozen
class Result:
    code: int
    out: str
    err: str

    @property
    def both(self) -> str:
        return self.out + self.err


def _exit_status(code: object) -> int:
    """What a process exiting with ``SystemExit(code)`` returns: None is 0, a message is 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


@attrs.define
class OnThisReactor:
    """``react`` for :func:`yieldproxy.tools.cli.main` in a test: the command runs on the test's running reactor
    (not a new one, which ``task.react`` would start); :attr:`finished` fires with its exit status, as
    ``task.react`` would have exited with it."""

    finished: defer.Deferred | None = None

    def __call__(self, main: Any, argv: tuple = ()) -> None:
        def status(result: object) -> int:
            if isinstance(result, Failure):
                if result.check(SystemExit):
                    return _exit_status(result.value.code)
                result.printTraceback(file=sys.stderr)
                return 1
            return 0

        self.finished = defer.ensureDeferred(main(_reactor(), *argv)).addBoth(status)


async def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 25.0) -> Result:
    """``yieldproxy ARGS`` in this process, with a clean YIELDPROXY_* environment: its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    here = OnThisReactor()
    saved = dict(os.environ)
    with redirect_stdout(out), redirect_stderr(err):
        try:
            for name in [name for name in os.environ if name.startswith("YIELDPROXY_")]:
                del os.environ[name]
            os.environ.update(env or {})
            try:
                cli.main(list(args), react=here)
                code = 0
            except SystemExit as e:
                code = _exit_status(e.code)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if here.finished is not None:
            code = await here.finished.addTimeout(timeout, _reactor())
    return Result(code, out.getvalue(), err.getvalue())


async def run_process(*command: str, env: dict[str, str] | None = None, timeout: float = 25.0) -> Result:
    """Run a real command in a thread (the reactor keeps serving), this checkout first on its path."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("YIELDPROXY_")}
    # The working tree, not whatever copy is installed in site-packages.
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    full_env.update(env or {})

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(list(command), capture_output=True, text=True, env=full_env, timeout=timeout)

    done = await threads.deferToThread(run).addTimeout(timeout + 5, _reactor())
    return Result(done.returncode, done.stdout, done.stderr)


class AdminServer:
    """The admin app of a ``build(reactor, Config())`` proxy, on a real socket."""

    def __init__(self, token: str | None = None) -> None:
        self.proxy = build(_reactor(), Config(), token=token)
        self.port: Any = None
        self.url = ""

    async def start(self, unix_path: Path | None = None) -> "AdminServer":
        if unix_path is None:
            endpoint = TCP4ServerEndpoint(_reactor(), 0, interface="127.0.0.1")
        else:
            endpoint = UNIXServerEndpoint(_reactor(), str(unix_path))
        self.port = await endpoint.listen(self.proxy.admin_app.site()).addTimeout(TIMEOUT, _reactor())
        if unix_path is None:
            self.url = f"http://127.0.0.1:{self.port.getHost().port}"
        else:
            self.url = f"unix:{unix_path}"
        return self

    async def close(self) -> None:
        release_every_hold(self.proxy.state)
        self.proxy.replayer.stop()
        try:
            if self.port is not None:
                await self.port.stopListening()
        finally:
            await self.proxy.upstream.close().addTimeout(TIMEOUT, _reactor())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Against a running admin API.


@pytest_twisted.ensureDeferred
async def test_yield_status_resume() -> None:
    server = await AdminServer().start()
    try:
        admin = ("--admin", server.url)
        yielded_at = _reactor().seconds()
        r = await run_cli("yield", *admin, "--for", "60", "--expected", "30",
                          "--reason", "nightly training", "--source", "trainer")
        assert r.code == 0, r
        assert r.out.startswith("state: yielded"), r
        assert "trainer (nightly training, lease ends in" in r.out
        assert server.proxy.state.yielded

        # The common options work before the command too.
        r = await run_cli(*admin, "status")
        assert r.code == 0, r
        # The server counts down from 30 s as the CLI starts and asks (seconds each under load).
        back = re.search(r"^state:\s+yielded \(expected back in (\d+)s\)", r.out, re.M)
        assert back, r.out
        assert 30 - (_reactor().seconds() - yielded_at) - 1 <= int(back.group(1)) <= 30, r.out
        assert re.search(r"^\s+trainer\s+nightly training\s+\S+\s+in \d\ds\s+in \d\ds$", r.out, re.M), r.out
        assert "SOURCE" in r.out and "parked:     0 (batch 0, interactive 0, long 0), 0 B" in r.out
        assert "in flight:  0" in r.out

        r = await run_cli("status", "--json", *admin)
        assert r.code == 0, r
        status = json.loads(r.out)
        assert status["state"] == "yielded"
        assert [(h["source"], h["reason"]) for h in status["holds"]] == [("trainer", "nightly training")]

        r = await run_cli("status", "--exit-code", *admin)
        assert r.code == cli.EXIT_YIELDED == 4, r

        # Resuming another source (api, which holds nothing) leaves the hold; the line says who holds it.
        r = await run_cli("resume", *admin)
        assert r.code == cli.EXIT_NO_HOLD, r
        assert "the holds are: trainer" in r.err, r

        r = await run_cli("resume", "--source", "trainer", *admin)
        assert r.code == 0, r
        assert r.out.strip() == "state: available | 0 parked, 0 in flight"
        assert not server.proxy.state.yielded

        r = await run_cli("status", "--exit-code", *admin)
        assert r.code == 0, r
        assert "holds:      none" in r.out and re.search(r"^state:\s+available$", r.out, re.M)
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_the_installed_command_runs_against_a_real_admin_api(tmp_path: Path) -> None:
    """The console script pip installed, as a process of its own, against an admin API on a real unix socket."""
    assert INSTALLED.is_file(), f"no {INSTALLED}: install the package (scripts/ensure-venv)"
    server = await AdminServer(token=TOKEN).start(unix_path=tmp_path / "admin.sock")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    try:
        r = await run_process(str(INSTALLED), "yield", "--admin", server.url, "--source", "trainer",
                              env={"YIELDPROXY_TOKEN_FILE": str(token_file)})
        assert r.code == 0 and r.out.startswith("state: yielded | held by trainer"), r
        assert server.proxy.state.yielded and TOKEN not in r.both
        r = await run_process(str(INSTALLED), "status", "--exit-code", "--admin", server.url,
                              env={"YIELDPROXY_TOKEN": TOKEN})
        assert r.code == cli.EXIT_YIELDED, r
        assert re.search(r"^\s+trainer\s", r.out, re.M), r.out
    finally:
        await server.close()


async def run_into_a_closed_pipe(*command: str, env: dict[str, str]) -> Result:
    """A real command whose stdout is a pipe nobody reads any more (``| head`` after its lines): its exit status
    and stderr."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("YIELDPROXY_")}
    full_env.update(env)

    def run() -> subprocess.CompletedProcess:
        read, write = os.pipe()
        os.close(read)
        try:
            return subprocess.run(list(command), stdout=write, stderr=subprocess.PIPE, text=True, env=full_env,
                                  timeout=25)
        finally:
            os.close(write)

    done = await threads.deferToThread(run).addTimeout(30, _reactor())
    return Result(done.returncode, "", done.stderr)


@pytest_twisted.ensureDeferred
async def test_a_reader_that_goes_away_ends_the_output_quietly_with_the_command_s_own_status() -> None:
    """``yieldproxy status | head -3``: no BrokenPipeError traceback; the exit status is the command's, whether the
    write fails at once (unbuffered) or in the last flush (a pipe's block buffer)."""
    server = await AdminServer().start()
    try:
        server.proxy.state.hold("game", "steam")
        commands = [
            (("status",), 0), (("status", "--json"), 0), (("status", "--exit-code"), cli.EXIT_YIELDED),
            (("--help",), 0), (("--version",), 0), (("example-config",), 0),
            (("yield", "--source", "trainer"), 0), (("resume", "--source", "trainer"), 0),
        ]
        for unbuffered in ("1", ""):
            for args, status in commands:
                r = await run_into_a_closed_pipe(
                    str(INSTALLED), *args, env={"YIELDPROXY_ADMIN": server.url, "PYTHONUNBUFFERED": unbuffered},
                )
                assert (r.code, r.err) == (status, ""), (args, unbuffered, r)
        assert [h.source for h in server.proxy.state.holds] == ["game"]
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_resuming_a_source_that_holds_nothing_exits_5_naming_the_holds() -> None:
    """``yieldproxy resume --source gmae`` (for game) exited 0 in silence, and the real hold stayed."""
    server = await AdminServer().start()
    try:
        admin = ("--admin", server.url)
        server.proxy.state.hold("game", "steam")
        r = await run_cli("resume", "--source", "gmae", *admin)
        assert (r.code, r.out) == (cli.EXIT_NO_HOLD, ""), r
        assert r.err == "yieldproxy: no hold of source 'gmae' to end; the holds are: game; did you mean --source game?\n"
        assert server.proxy.state.yielded
        r = await run_cli("resume", "--source", "game", *admin)
        assert r.code == 0 and r.out.startswith("state: available"), r
        r = await run_cli("resume", "--source", "game", *admin)
        assert r.code == cli.EXIT_NO_HOLD, r
        assert r.err == "yieldproxy: no hold of source 'game' to end; no hold is taken (state: available)\n", r
    finally:
        await server.close()


@given(
    typed=st.from_regex(r"[a-z][a-z0-9._-]{0,20}", fullmatch=True),
    held=st.lists(st.from_regex(r"[a-z][a-z0-9._-]{0,20}", fullmatch=True), max_size=4, unique=True),
    upstream=st.sampled_from([None, "desktop"]),
)
def test_the_nothing_to_resume_line_is_one_line_naming_every_hold(typed, held, upstream) -> None:
    status = {"state": "yielded" if held else "available",
              "holds": [{"source": h, "upstream": None} for h in held]}
    line = cli.nothing_to_resume(status, typed, upstream)
    assert "\n" not in line and repr(typed) in line
    assert all(h in line for h in held)
    assert ("no hold is taken" in line) == (not held)
    if upstream:
        assert f"on upstream {upstream!r}" in line


@pytest_twisted.ensureDeferred
async def test_token_missing_wrong_and_right(tmp_path: Path) -> None:
    server = await AdminServer(token=TOKEN).start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-token\n")
    try:
        admin = ("--admin", server.url)
        r = await run_cli("status", *admin)
        assert r.code == 1, r
        assert "answered 401: missing or wrong admin token" in r.err
        assert "no token was given" in r.err

        r = await run_cli("yield", "--token-file", str(wrong_file), *admin)
        assert r.code == 1, r
        assert "401" in r.err and "the token given was refused" in r.err
        assert "not-the-token" not in r.both
        assert not server.proxy.state.yielded

        r = await run_cli("status", *admin, env={"YIELDPROXY_TOKEN": "wrong-from-env"})
        assert r.code == 1 and "wrong-from-env" not in r.both, r

        r = await run_cli("yield", "--token-file", str(token_file), *admin)
        assert r.code == 0, r
        assert server.proxy.state.yielded

        r = await run_cli("status", *admin, env={"YIELDPROXY_TOKEN_FILE": str(token_file)})
        assert r.code == 0 and "api" in r.out, r

        # The config file gives both the admin address and the token file.
        config = tmp_path / "yieldproxy.toml"
        port = server.port.getHost().port
        config.write_text(
            f'[admin]\nlisten = "tcp:{port}:interface=127.0.0.1"\ntoken_file = "{token_file}"\n'
        )
        r = await run_cli("resume", "--config", str(config))
        assert r.code == 0, r
        assert r.out.startswith("state: available")
        for result in (r,):
            assert TOKEN not in result.both
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_admin_on_a_unix_socket(tmp_path: Path) -> None:
    server = await AdminServer().start(unix_path=tmp_path / "admin.sock")
    try:
        r = await run_cli("yield", "--admin", server.url, "--source", "unixy")
        assert r.code == 0 and "held by unixy" in r.out, r
        config = tmp_path / "yieldproxy.toml"
        config.write_text(f'[admin]\nlisten = "unix:{tmp_path / "admin.sock"}"\n')
        r = await run_cli("status", "--config", str(config))
        assert r.code == 0 and "unixy" in r.out, r
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_yield_and_resume_ask_again_while_a_reload_hands_the_holds_over() -> None:
    """While a reload hands the holds to a new process, the admin API answers ``POST /yield`` and ``POST /resume``
    with 503 and ``Retry-After: 1``: the command asks again after it, as the broker library does, and only past
    ``--timeout`` is the 503 its error (exit 1)."""
    server = await AdminServer().start()
    handing_over = "this process (pid 1) has handed the holds over to pid 2, which answers from now on"
    moved: list[str] = []
    server.proxy.admin_app.holds_elsewhere = lambda: moved.pop() if moved else None
    try:
        admin = ("--admin", server.url)
        moved.append(handing_over)
        r = await run_cli("yield", *admin, "--source", "trainer")
        assert r.code == 0 and r.out.startswith("state: yielded | held by trainer"), r
        assert moved == [] and server.proxy.state.yielded
        moved.append(handing_over)
        r = await run_cli("resume", *admin, "--source", "trainer")
        assert r.code == 0 and r.out.startswith("state: available"), r
        assert moved == [] and not server.proxy.state.yielded

        moved.extend([handing_over] * 5)
        r = await run_cli("yield", *admin, "--timeout", "0.5")
        assert r.code == 1 and f"answered 503: {handing_over}: ask again" in r.err, r
        assert not server.proxy.state.yielded
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_reload_prints_the_handover_and_a_refused_one_exits_1_with_its_line() -> None:
    """``yieldproxy reload``: the outcome of ``POST /reload`` on one line; a refusal's error line, exit 1."""
    from yieldproxy.lifecycle.succession import ReloadRefused

    server = await AdminServer().start()
    outcome = {"reloaded": True, "old_pid": 41, "old_version": "1.0", "pid": 42, "version": "1.1",
               "parked_handed_over": 7, "connections_handed_over": 3, "seconds": 0.25}
    answers = [defer.fail(ReloadRefused("/etc/yieldproxy/yieldproxy.toml: parking.max_parked must be at least 1")),
               defer.succeed(outcome)]
    server.proxy.admin_app.reload = lambda: answers.pop()
    try:
        r = await run_cli("reload", "--admin", server.url)
        assert (r.code, r.err) == (0, ""), r
        assert r.out == ("reloaded: pid 41 (version 1.0) -> pid 42 (version 1.1): 7 parked requests and 3 idle "
                         "connections handed over in 0.25s\n"), r
        r = await run_cli("reload", "--admin", server.url)
        assert r.code == 1 and r.out == "", r
        assert "answered 400: /etc/yieldproxy/yieldproxy.toml: parking.max_parked must be at least 1" in r.err, r
    finally:
        await server.close()


@pytest_twisted.ensureDeferred
async def test_unreachable_admin(tmp_path: Path) -> None:
    socket_path = tmp_path / "nobody.sock"
    r = await run_cli("status", "--admin", f"unix:{socket_path}")
    assert r.code == cli.EXIT_UNREACHABLE, r
    assert f"cannot reach the admin API at unix:{socket_path}: " in r.err and "twistd -n yieldproxy" in r.err, r

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    r = await run_cli("status", "--admin", url)
    assert r.code == cli.EXIT_UNREACHABLE == 3, r
    assert f"cannot reach the admin API at {url}: connection refused" in r.err
    assert "twistd -n yieldproxy" in r.err and "--admin" in r.err

    # Something accepts connections but never answers: the timeout ends it.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        r = await run_cli("yield", "--admin", url, "--timeout", "0.2", env={"YIELDPROXY_TOKEN": TOKEN})
    assert r.code == 3, r
    assert "no answer within 0.2 s" in r.err
    assert TOKEN not in r.both

    # YIELDPROXY_ADMIN is used when --admin is not given.
    r = await run_cli("status", env={"YIELDPROXY_ADMIN": f"127.0.0.1:{port}"})
    assert r.code == 3 and f"http://127.0.0.1:{port}" in r.err, r


@pytest_twisted.ensureDeferred
async def test_demo_survives_a_yield() -> None:
    r = await run_cli(
        "demo", "--texts", "300", "--concurrency", "16", "--yield-after", "0.3", "--yield-for", "1",
        "--deadline", "40", timeout=45,
    )
    assert r.code == 0, r
    assert re.search(r"^\s+sent\s+300$", r.out, re.M), r.out
    assert re.search(r"^\s+ok\s+300$", r.out, re.M), r.out
    assert re.search(r"^\s+failed\s+0$", r.out, re.M), r.out
    assert re.search(r"^\s+wrong vectors\s+0$", r.out, re.M), r.out
    assert re.search(r"time parked\s+GPU yielded 1\.\d\d s; 16 requests parked", r.out), r.out
    peak = re.search(r"peak backend\s+(\d+) replayed at once \(replay cap 4\)", r.out)
    assert peak and 1 <= int(peak.group(1)) <= 4, r.out
    assert "result: OK" in r.out
    # Not a TTY: plain progress lines on stderr, and the admin calls it made.
    assert "POST /yield" in r.err and "POST /resume" in r.err and "\r" not in r.err


@pytest_twisted.ensureDeferred
async def test_sim_subcommand_delegates() -> None:
    r = await run_cli("sim", "--help")
    assert r.code == 0, r
    assert "simulated Ollama" in r.out and "--parallel" in r.out
    # It names itself as it was called.
    assert r.out.startswith("usage: yieldproxy sim ") and "python -m" not in r.out


@pytest_twisted.ensureDeferred
async def test_sim_on_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = await run_process(sys.executable, "-m", "yieldproxy.tools.cli", "sim", "--port", str(port))
    assert (r.code, r.out) == (1, ""), r
    assert r.err == (
        f"yieldproxy sim: --port {port}: cannot listen on 127.0.0.1:{port}: "
        "address already in use (another process listens there)\n"
    )


@pytest_twisted.ensureDeferred
async def test_example_config_prints_the_commented_example() -> None:
    r = await run_cli("example-config")
    assert r.code == 0, r
    assert r.out == (REPO / "etc" / "yieldproxy.toml").read_text(encoding="utf-8")


def test_demo_help_is_about_the_demo(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "every request got its right vector" in out
    # The demo runs its own proxy: nothing about finding an admin API or its token.
    assert "YIELDPROXY_TOKEN" not in out and "--admin" not in out and "status --exit-code" not in out


# ---------------------------------------------------------------------------
# In process: arguments, parsing, formatting.


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["yield", "--for", "-5"],
        ["yield", "--expected", "soon"],
        ["status", "--verbose"],
        ["demo", "--texts", "0"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == cli.EXIT_USAGE == 2
    assert "usage:" in capsys.readouterr().err


def test_version_is_yieldproxy_s(capsys: pytest.CaptureFixture) -> None:
    from yieldproxy import __version__

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"yieldproxy {__version__}\n"


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for line in ("0  done", "1  the admin API answered", "2  usage error", "3  the admin API could not be reached",
                 "4  only with \"status --exit-code\""):
        assert line in out
    assert "YIELDPROXY_TOKEN" in out and "YIELDPROXY_ADMIN" in out


def test_bad_token_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", "--token-file", str(tmp_path / "missing")])
    assert exited.value.code == 2
    assert "--token-file: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    "endpoint, url, unix",
    [
        ("tcp:11436:interface=127.0.0.1", "http://127.0.0.1:11436", None),
        ("tcp:port=9000:interface=0.0.0.0", "http://127.0.0.1:9000", None),
        ("tcp:9000", "http://127.0.0.1:9000", None),
        (r"tcp6:9000:interface=\:\:1", "http://[::1]:9000", None),
        ("unix:/run/yieldproxy/admin.sock:mode=660", "unix:/run/yieldproxy/admin.sock", "/run/yieldproxy/admin.sock"),
        ("unix:address=/tmp/a.sock", "unix:/tmp/a.sock", "/tmp/a.sock"),
    ],
)
def test_admin_target_from_endpoint(endpoint: str, url: str, unix: str | None) -> None:
    """The URL the broker library's Admin takes (``unix:PATH`` for a socket), and the socket it reaches."""
    assert cli.admin_target_from_endpoint(endpoint) == url
    assert Admin(url)._unix_path == unix


@given(
    path=st.lists(st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True), min_size=1, max_size=4),
    colon=st.booleans(),
    options=st.lists(st.sampled_from(["mode=660", "lockfile=0", "backlog=50"]), max_size=2),
    named=st.booleans(),
)
def test_every_unix_endpoint_reaches_its_socket_through_the_broker_library(path, colon, options, named) -> None:
    """``admin.listen = "unix:PATH[:OPTION...]"`` (a colon in PATH escaped as Twisted's endpoint strings escape it),
    and ``--admin`` with the same: the broker library's Admin goes to PATH, whatever the options."""
    socket_path = "/" + "/".join(path) + (":x" if colon else "")
    escaped = socket_path.replace(":", "\\:")
    endpoint = ":".join(["unix", ("address=" if named else "") + escaped, *options])
    url = cli.admin_target_from_endpoint(endpoint)
    assert url is not None and Admin(url)._unix_path == socket_path
    assert cli.admin_target_from_option(endpoint) == url


@given(port=st.integers(1, 65535), host=st.sampled_from(["", "0.0.0.0", "127.0.0.1", "10.1.2.3"]),
       named=st.booleans())
def test_every_tcp_endpoint_is_a_url_of_its_port(port, host, named) -> None:
    endpoint = "tcp:" + (f"port={port}" if named else str(port)) + (f":interface={host}" if host else "")
    url = cli.admin_target_from_endpoint(endpoint)
    assert url == f"http://{host if host not in ('', '0.0.0.0') else '127.0.0.1'}:{port}"
    assert Admin(url)._unix_path is None


def test_admin_target_unknown_endpoint() -> None:
    assert cli.admin_target_from_endpoint("ssl:11436:privateKey=k.pem") is None
    assert cli.admin_target_from_endpoint("tcp:0") is None


def test_admin_option_forms() -> None:
    assert cli.admin_target_from_option("127.0.0.1:9") == "http://127.0.0.1:9"
    assert cli.admin_target_from_option("http://h:9/") == "http://h:9"
    assert cli.admin_target_from_option("unix:/run/y/admin.sock:mode=660") == "unix:/run/y/admin.sock"
    with pytest.raises(cli.CliError) as bad:
        cli.admin_target_from_option("ftp://h:9")
    assert bad.value.code == 2


def test_format_status_sanitises_and_aligns() -> None:
    status = {
        "state": "yielded",
        "now": 1000.0,
        "expected_remaining_seconds": 125.0,
        "holds": [
            {"source": "file", "reason": "", "since": 1000.0 - 3700, "expires_at": None, "expected_end": None},
            {"source": "api", "reason": "evil\x1b[2Jreason", "since": 990.0, "expires_at": 1030.0,
             "expected_end": 1125.0},
        ],
        "parked": {"batch": 12, "interactive": 1, "long": 0},
        "parked_total": 13,
        "parked_bytes": 3 * 1024 + 512,
        "inflight": 2,
    }
    text = cli.format_status(status)
    assert "\x1b" not in text
    assert "state:      yielded (expected back in 2m 05s)" in text
    assert "  file    -                  1h 01m    -           -\n" in text
    assert "  api     evil\\x1b[2Jreason  10s       in 30s      in 2m 05s" in text
    assert "parked:     13 (batch 12, interactive 1, long 0), 3.5 KiB" in text
    assert "in flight:  2" in text
    assert cli.format_one_line(status) == (
        "state: yielded | held by file; api (evil\\x1b[2Jreason, lease ends in 30s) "
        "| expected back in 2m 05s | 13 parked, 2 in flight"
    )


def test_no_reactor_at_import() -> None:
    code = "import sys, yieldproxy.tools.cli; sys.exit('twisted.internet.reactor' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=20).returncode == 0


def test_max_overlap() -> None:
    assert demo.max_overlap([]) == 0
    assert demo.max_overlap([(0, 1), (1, 2), (2, 3)]) == 1  # back to back is not at once
    assert demo.max_overlap([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3


def test_token_help_says_which_is_a_file_and_which_is_the_token(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--token-file FILE a file holding the token" in out
    assert "$YIELDPROXY_TOKEN the token itself (not a file)" in out
    assert "$YIELDPROXY_TOKEN_FILE a file holding the token" in out
    assert "admin.read_token_file" in out


def test_status_takes_the_read_only_token_and_changes_the_admin_token(tmp_path: Path) -> None:
    admin, read = tmp_path / "admin.token", tmp_path / "read.token"
    admin.write_text("admin-s3cret\n")
    read.write_text("read-s3cret\n")
    config = tmp_path / "y.toml"
    config.write_text(f"[admin]\ntoken_file = '{admin}'\nread_token_file = '{read}'\n")
    parser = cli.build_parser()
    for command, token in (("status", "read-s3cret"), ("yield", "admin-s3cret"), ("resume", "admin-s3cret")):
        args = parser.parse_args([command, "--config", str(config)])
        assert cli.resolve_settings(args, {}).token == token, command
    # Without a read-only token, status uses the admin token as before.
    config.write_text(f"[admin]\ntoken_file = '{admin}'\n")
    assert cli.resolve_settings(parser.parse_args(["status", "--config", str(config)]), {}).token == "admin-s3cret"


@pytest.mark.parametrize("source", ["two words", "line\nbreak", "x" * 65, "-dash"])
def test_source_option_follows_the_api_rule(source: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["yield", "--source", source])
    assert exited.value.code == 2
    assert "--source" in capsys.readouterr().err


def test_bounded_turns_a_cancelled_request_into_a_timeout_on_the_clock():
    """A cancelled Agent request fails with ResponseNeverReceived, not CancelledError: still a timeout."""
    from twisted.internet.defer import Deferred, TimeoutError
    from twisted.internet.task import Clock
    from twisted.python.failure import Failure
    from twisted.trial.unittest import SynchronousTestCase
    from twisted.web.client import ResponseNeverReceived

    from yieldproxy.tools.demo import bounded

    check = SynchronousTestCase()
    clock = Clock()
    answer: Deferred = Deferred(lambda d: d.errback(ResponseNeverReceived([Failure(Exception("cancelled"))])))

    async def exchange():
        return await answer

    d = Deferred.fromCoroutine(bounded(clock, exchange(), 2.0))
    clock.advance(1.9)
    check.assertNoResult(d)
    clock.advance(0.1)
    assert "no answer within 2 s" in str(check.failureResultOf(d, TimeoutError).value)
    assert clock.getDelayedCalls() == []

    # An answer in time is the answer, and leaves no timer behind.
    in_time: Deferred = Deferred()

    async def quick():
        return await in_time

    d = Deferred.fromCoroutine(bounded(clock, quick(), 2.0))
    in_time.callback("ok")
    assert check.successResultOf(d) == "ok"
    assert clock.getDelayedCalls() == []
