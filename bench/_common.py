"""Shared pieces of the benchmarks: child processes, a raw HTTP client, /proc readers.

Everything here talks to 127.0.0.1 only.  Every child is started through
:class:`Children`, whose ``stop_all`` (called in a ``finally``) terminates
each one by its own pid, then kills what is left; the children also get
``PR_SET_PDEATHSIG`` so they die with the benchmark if it is killed.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
#: The source tree measured: this checkout, unless YIELDPROXY_BENCH_SRC names another
#: (children get it first on PYTHONPATH, so a stale copy installed in the venv is not used).
SRC = Path(os.environ.get("YIELDPROXY_BENCH_SRC") or BENCH.parent).resolve()
PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

#: A small embedding request (the latency and throughput benchmarks).
SMALL_EMBED = b'{"model":"nomic-embed-text","input":"hello world"}'


def embed_body(size: int) -> bytes:
    """An /api/embed JSON body of about ``size`` bytes."""
    head = b'{"model":"nomic-embed-text","input":"'
    tail = b'"}'
    return head + b"x" * max(1, size - len(head) - len(tail)) + tail


def post(path: str, body: bytes, host: str = "127.0.0.1") -> bytes:
    """The raw bytes of a keep-alive HTTP/1.1 POST with a JSON body."""
    return (
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), host.encode(), len(body), body)
    )


def get(path: str, host: str = "127.0.0.1") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path.encode(), host.encode())


# ---------------------------------------------------------------------------
# Child processes.


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child if the benchmark dies first (Linux prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Child:
    """One child process whose stdout lines are drained by a thread (a pipe never fills)."""

    def __init__(self, name: str, argv: list[str], logdir: Path, src: Path = SRC):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            preexec_fn=_die_with_parent,
            cwd=str(src),
            env=env,
        )
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float = 20.0) -> re.Match:
        """The first stdout line matching ``pattern``; fails if the child exits or time runs out."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                self._cond.wait(min(left, 0.2))
        raise RuntimeError(
            f"{self.name} did not print /{pattern}/ (exit {self.proc.poll()}); "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()


class Children:
    """Every child a benchmark started; ``stop_all`` ends them, each by its pid."""

    def __init__(self):
        # SIGTERM (run_all's time limit) becomes SystemExit, so `finally`/`with` still stop the children.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        self._children: list[Child] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="yieldproxy-bench-"))

    def start(self, name: str, argv: list[str], src: Path = SRC) -> Child:
        """A child running ``argv`` with the tree ``src`` first on its PYTHONPATH (and as its directory)."""
        child = Child(name, argv, self.logdir, src)
        self._children.append(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self._children):
            try:
                child.stop()
            except Exception as e:  # keep stopping the others
                print(f"warning: stopping {child.name} (pid {child.pid}): {e}", file=sys.stderr)
        self._children.clear()

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop_all()
        if exc_type is None:
            shutil.rmtree(self.logdir, ignore_errors=True)
        else:
            print(f"child logs kept in {self.logdir}", file=sys.stderr)


#: The models the benchmarks' simulated Ollama has (it answers any other name 404, as Ollama does).
SIM_MODELS = ("nomic-embed-text", "all-minilm", "llama3.2")


def start_sim(children: Children, *extra: str, name: str = "sim") -> tuple[Child, int]:
    """The simulated Ollama (``python -m yieldproxy.tools.sim``) on a free port, with :data:`SIM_MODELS`."""
    models = [arg for model in SIM_MODELS for arg in ("--model", model)] if "--model" not in extra else []
    child = children.start(
        name,
        [PYTHON, "-m", "yieldproxy.tools.sim", "--port", "0", "--latency", "0", "--parallel", "64", *models, *extra],
    )
    m = child.wait_line(r"listening on 127\.0\.0\.1:(\d+)")
    return child, int(m.group(1))


def start_proxy(
    children: Children, upstream_port: int, *extra: str, name: str = "proxy", src: Path = SRC
) -> tuple[Child, int, int]:
    """A yieldproxy of the tree ``src`` in front of ``upstream_port``: (child, proxy port, admin port)."""
    child = children.start(
        name,
        [PYTHON, str(BENCH / "_proxy_runner.py"), "--upstream", f"http://127.0.0.1:{upstream_port}", *extra],
        src,
    )
    m = child.wait_line(r"ready proxy=(\d+) admin=(\d+) pid=\d+ src=(\S+) endpoint=(\S+)")
    child.src = m.group(3)
    child.endpoint = m.group(4)
    return child, int(m.group(1)), int(m.group(2))


def start_floor(children: Children, upstream_port: int, client: str = "agent", name: str = "floor") -> tuple[Child, int]:
    """The minimal Klein pass-through (``_floor.py``) in front of ``upstream_port``: (child, port)."""
    child = children.start(
        name,
        [PYTHON, str(BENCH / "_floor.py"), "--upstream-port", str(upstream_port), "--client", client],
    )
    m = child.wait_line(r"ready floor=(\d+) pid=\d+")
    return child, int(m.group(1))


# ---------------------------------------------------------------------------
# /proc readers.


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---------------------------------------------------------------------------
# A small blocking HTTP/1.1 client on a raw socket (keep-alive, no parsing beyond need).


class HTTPError(Exception):
    pass


class Conn:
    """One keep-alive connection; ``request`` sends raw bytes and reads one response."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def close(self) -> None:
        self.sock.close()

    def request(self, raw: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        self.sock.sendall(raw)
        return self.read_response()

    def _fill(self) -> None:
        data = self.sock.recv(262144)
        if not data:
            raise HTTPError("connection closed mid-response")
        self._buf += data

    def read_response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            self._fill()
        head, self._buf = self._buf[:end], self._buf[end + 4 :]
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            while len(self._buf) < n:
                self._fill()
            body, self._buf = self._buf[:n], self._buf[n:]
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            parts = []
            while True:
                while b"\r\n" not in self._buf:
                    self._fill()
                size_line, _, self._buf = self._buf.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                while len(self._buf) < size + 2:
                    self._fill()
                parts.append(self._buf[:size])
                self._buf = self._buf[size + 2 :]
                if size == 0:
                    break
            body = b"".join(parts)
        else:
            raise HTTPError(f"response without a length: {head[:200]!r}")
        return status, headers, body


def admin_call(port: int, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    """One admin API call on a fresh connection; the JSON answer."""
    conn = Conn(port, timeout)
    try:
        if method == "GET":
            raw = get(path)
        else:
            raw = post(path, json.dumps(body or {}).encode())
        status, _, payload = conn.request(raw)
    finally:
        conn.close()
    if status != 200:
        raise HTTPError(f"{method} {path}: {status} {payload[:200]!r}")
    return json.loads(payload)


def wait_parked(admin_port: int, count: int, timeout: float, step: float = 0.05) -> dict:
    """Poll ``GET /status`` until ``parked_total`` reaches ``count``."""
    deadline = time.monotonic() + timeout
    while True:
        status = admin_call(admin_port, "GET", "/status")
        if status["parked_total"] >= count:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {status['parked_total']} of {count} parked after {timeout}s")
        time.sleep(step)


# ---------------------------------------------------------------------------
# Figures.


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, linearly interpolated."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def verdict(ok: bool) -> str:
    return "OK  " if ok else "MISS"


def header(title: str) -> None:
    print()
    print(title)
    print("=" * len(title))
