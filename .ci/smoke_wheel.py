"""CI's smoke test of an installed wheel (run by .ci/smoke-wheel, from outside the checkout).

With only what the wheel installed into VENV: the plugin is found, the example
config prints and loads, ``yieldproxy ops-files`` writes etc/ of the source
(the unit, the rules, the dashboard, the probe) and will not overwrite an
edited file without --force, and ``twistd -n yieldproxy`` in front of
``yieldproxy sim`` answers ``/healthz``, serves the status page, embeds through
the proxy, parks a request across a yield and replays it on resume, then stops
cleanly on SIGTERM.  Standard library only; every wait is bounded.

Usage: python smoke_wheel.py VENV SOURCE_EXAMPLE_TOML
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

VENV = Path(sys.argv[1]).resolve()
SOURCE_EXAMPLE = Path(sys.argv[2])
BIN = VENV / "bin"
DEADLINE = 30.0


def step(text: str) -> None:
    print(f"smoke-wheel: {text}", flush=True)


def fail(text: str, *children: subprocess.Popen) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
        output = child.stdout.read() if child.stdout else ""
        print(f"--- output of {' '.join(map(str, child.args))}:\n{output}", file=sys.stderr)
    raise SystemExit(f"smoke-wheel: FAILED: {text}")


def run(*argv: str | Path) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise SystemExit(f"smoke-wheel: FAILED: {argv} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, dict(response.headers), response.read()


def ops_files() -> None:
    """``yieldproxy ops-files DIR`` writes etc/ of the source, as the docs use it."""
    step("yieldproxy ops-files writes the unit, the rules, the dashboard and the probe")
    source = SOURCE_EXAMPLE.parent
    expected = {p.relative_to(source).as_posix(): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    for name in ("systemd/yieldproxy.service", "prometheus/yieldproxy-rules.yml", "grafana/yieldproxy-dashboard.json"):
        if name not in expected:
            raise SystemExit(f"smoke-wheel: FAILED: etc/{name} is not in the source")
    out = Path("ops") / "etc"
    run(BIN / "yieldproxy", "ops-files", out)
    written = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    if written != expected:
        differ = sorted(n for n in expected.keys() | written.keys() if expected.get(n) != written.get(n))
        raise SystemExit(f"smoke-wheel: FAILED: ops-files wrote a tree that differs from etc/ in {differ}")
    if not os.access(out / "probes" / "nvidia-game-probe.sh", os.X_OK):
        raise SystemExit("smoke-wheel: FAILED: the probe ops-files wrote is not executable")
    promtool = shutil.which("promtool")
    if promtool is not None:
        run(promtool, "test", "rules", out / "prometheus" / "yieldproxy-rules.test.yml")
    unit = out / "systemd" / "yieldproxy.service"
    unit.write_text("# edited\n", encoding="utf-8")
    refused = subprocess.run([BIN / "yieldproxy", "ops-files", out], capture_output=True, text=True, timeout=60)
    if refused.returncode != 1 or "--force" not in refused.stderr or unit.read_text(encoding="utf-8") != "# edited\n":
        raise SystemExit(f"smoke-wheel: FAILED: ops-files overwrote an edited unit without --force: {refused}")
    run(BIN / "yieldproxy", "ops-files", "--force", out)
    if unit.read_bytes() != expected["systemd/yieldproxy.service"]:
        raise SystemExit("smoke-wheel: FAILED: ops-files --force did not restore the unit")


def main() -> None:
    step("the package is the installed one")
    where = run(BIN / "python", "-c", "import yieldproxy, sys; print(yieldproxy.__file__)").strip()
    if not Path(where).is_relative_to(VENV):
        raise SystemExit(f"smoke-wheel: FAILED: yieldproxy imported from {where}, not from {VENV}")
    if "yieldproxy" not in run(BIN / "twistd", "--help"):
        raise SystemExit("smoke-wheel: FAILED: twistd does not list the yieldproxy plugin")
    if "example-config" not in run(BIN / "twistd", "yieldproxy", "--help"):
        raise SystemExit("smoke-wheel: FAILED: twistd yieldproxy --help does not point to example-config")

    step("yieldproxy example-config is the commented example")
    example = run(BIN / "yieldproxy", "example-config")
    if example != SOURCE_EXAMPLE.read_text(encoding="utf-8"):
        raise SystemExit("smoke-wheel: FAILED: example-config differs from etc/yieldproxy.toml")
    config = Path("yieldproxy.toml")
    config.write_text(example, encoding="utf-8")
    ops_files()

    sim_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    proxy, admin = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}"
    step(f"yieldproxy sim on {sim_port}, twistd -n yieldproxy on {proxy_port} and {admin_port}")
    sim = subprocess.Popen(
        [BIN / "yieldproxy", "sim", "--port", str(sim_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    twistd = subprocess.Popen(
        [
            BIN / "twistd", "-n", "--pidfile=", "yieldproxy", "--config", config,
            "--upstream", f"http://127.0.0.1:{sim_port}",
            "--listen", f"tcp:{proxy_port}:interface=127.0.0.1",
            "--admin", f"tcp:{admin_port}:interface=127.0.0.1",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    children = (twistd, sim)
    try:
        started = time.monotonic()
        while True:
            try:
                if http("GET", admin + "/healthz", timeout=2)[2] == b"ok":
                    break
            except OSError:
                pass
            if twistd.poll() is not None or time.monotonic() - started > DEADLINE:
                fail("the proxy did not become healthy", *children)
            time.sleep(0.1)

        step("the status page (package data) and an embedding through the proxy")
        status, headers, page = http("GET", admin + "/")
        if status != 200 or b"<html" not in page.lower():
            fail(f"GET / gave {status}", *children)
        status, _, body = http("POST", proxy + "/api/embed", {"model": "all-minilm", "input": ["hello"]})
        vectors = json.loads(body)["embeddings"]
        if status != 200 or len(vectors) != 1 or len(vectors[0]) != 384:
            fail(f"POST /api/embed gave {status}: {body[:200]!r}", *children)

        step("a request parked across a yield, replayed on resume")
        run(BIN / "yieldproxy", "--admin", admin, "yield", "--reason", "smoke", "--for", "60")
        answer: list = []
        waiter = threading.Thread(
            target=lambda: answer.append(http("POST", proxy + "/api/embed", {"model": "all-minilm", "input": ["x"]}, 30)),
            daemon=True,
        )
        waiter.start()
        started = time.monotonic()
        while json.loads(http("GET", admin + "/status")[2]).get("parked_total") != 1:
            if time.monotonic() - started > DEADLINE:
                fail("the request was not parked", *children)
            time.sleep(0.05)
        if "parked:     1" not in run(BIN / "yieldproxy", "--admin", admin, "status"):
            fail("yieldproxy status does not show the parked request", *children)
        run(BIN / "yieldproxy", "--admin", admin, "resume")
        waiter.join(DEADLINE)
        if not answer or answer[0][0] != 200 or "X-Yield-Parked-Seconds" not in answer[0][1]:
            fail(f"the parked request was not replayed: {answer!r}", *children)

        step("SIGTERM: a clean stop")
        twistd.send_signal(signal.SIGTERM)
        try:
            output, _ = twistd.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            fail("twistd did not stop on SIGTERM", *children)
        # twistd re-raises SIGTERM once it has shut down cleanly.
        if twistd.returncode not in (0, -signal.SIGTERM) or "Traceback" in output or "Server Shut Down." not in output:
            print(output, file=sys.stderr)
            fail(f"twistd ended with {twistd.returncode}", sim)
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
    step("OK: the wheel installs and serves")


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)
    main()
