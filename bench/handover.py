"""Reload with a full lot: how long from SIGHUP to the new code serving, and the pause clients see.

A real ``twistd -n yieldproxy`` in front of the simulated Ollama (each in its
own process).  Each round: ``POST /yield``; N connections each send one
``POST /api/embed`` and are parked; a client thread keeps sending
``GET /api/version`` (a route that never parks, answered by the backend) on
a fresh connection each time, and records how long each took; SIGHUP to the
proxy.  Printed:

* ``SIGHUP -> serving``: from the signal until ``GET /status`` answers from
  the new process (its pid).  Most of it is the new process starting Python
  and its imports, during which the old process still serves.
* ``handover``: from the new process's ``ready`` to its ``committed``
  (the old process's log line): the lot goes over while the old process
  still accepts and serves (lifecycle/succession/predecessor.py's two phases).
* ``accepting paused``: the commit's round trip, while neither process
  accepts and new connections wait in the listening socket's backlog.
* ``client pause``: the longest ``GET /api/version`` round trip during the
  reload (a fresh connection each: connect, request, answer), against the
  median before it.
* after ``POST /resume``: every parked request's status (all 200 expected),
  and the old process gone.

    .venv/bin/python bench/handover.py [--parked 1000 10000]

10,000 parked needs more than 20,000 descriptors in the proxy (it budgets
two a connection, lifecycle/limits.py): where the hard limit is lower, the proxy
takes fewer connections, the rest are answered 503 at once, and the row
says how many parked.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import statistics
import sys
import threading
import time

from _common import BENCH, PYTHON, Children, Conn, admin_call, get, header, start_sim, wait_parked
from parked_memory import open_parked, read_all

TWISTD = os.path.join(os.path.dirname(PYTHON), "twistd")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pinger(threading.Thread):
    """``GET /api/version`` on a fresh connection, again and again: (start, seconds) of each, and failures."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.samples: list[tuple[float, float]] = []
        self.failures: list[str] = []
        self.running = True

    def run(self) -> None:
        while self.running:
            began = time.monotonic()
            try:
                conn = Conn(self.port, timeout=30)
                try:
                    status, _, _ = conn.request(get("/api/version"))
                finally:
                    conn.close()
                if status != 200:
                    self.failures.append(f"status {status}")
            except OSError as e:
                self.failures.append(type(e).__name__)
            self.samples.append((began, time.monotonic() - began))
            time.sleep(0.005)


def pid_of(admin_port: int) -> int:
    return int(admin_call(admin_port, "GET", "/status")["pid"])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def one_round(parked: int) -> dict:
    with Children() as children:
        _, sim_port = start_sim(children)
        proxy_port, admin_port = free_port(), free_port()
        config = children.logdir / "yieldproxy.toml"
        config.write_text(
            f"[parking]\nmax_parked = {parked}\nmax_parked_bytes = {parked * 4096}\n"
            f"[proxy]\nmax_connections = {parked + 200}\n"
            "[classes.batch]\nmax_parked = 0\n"
        )
        proxy = children.start("proxy", [
            TWISTD, "-n", "--pidfile=", "yieldproxy", "--config", str(config),
            "--upstream", f"http://127.0.0.1:{sim_port}",
            "--listen", f"tcp:{proxy_port}:interface=127.0.0.1:backlog=1024",
            "--admin", f"tcp:{admin_port}:interface=127.0.0.1",
        ])
        proxy.wait_line(r"proxy listening on 127\.0\.0\.1:%d" % proxy_port, timeout=60)
        first = pid_of(admin_port)
        admin_call(admin_port, "POST", "/yield", {"reason": "bench", "source": "bench"})
        body = b'{"model":"all-minilm","input":"hello world"}'
        raw = (
            b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        sel, socks = open_parked(proxy_port, parked, raw, timeout=120)
        status = admin_call(admin_port, "GET", "/status")
        deadline = time.monotonic() + 60
        while status["parked_total"] < len(socks) and time.monotonic() < deadline:
            time.sleep(0.05)
            status = admin_call(admin_port, "GET", "/status")
        held = status["parked_total"]
        pinger = Pinger(proxy_port)
        pinger.start()
        time.sleep(1.0)
        began = time.monotonic()
        os.kill(first, signal.SIGHUP)
        new = first
        while new == first and time.monotonic() - began < 120:
            try:
                new = pid_of(admin_port)
            except OSError:
                pass
            time.sleep(0.005)
        serving = time.monotonic() - began
        line = proxy.wait_line(
            r"handed over to pid \d+ .*?: (\d+) parked requests.*the handover itself ([\d.]+)s, "
            r"accepting paused ([\d.]+)s", timeout=60,
        )
        wait_parked(admin_port, held, timeout=30)
        time.sleep(1.0)
        pinger.running = False
        pinger.join(35)
        before = [seconds for start, seconds in pinger.samples if start < began]
        # From SIGHUP until a second after the commit (the new process accepts as soon as it has the holds,
        # and makes the lot's connections again meanwhile).
        handed_at = began + serving + float(line.group(2))
        during = [seconds for start, seconds in pinger.samples if began <= start <= handed_at + 1]
        admin_call(admin_port, "POST", "/resume", {"source": "bench"})
        statuses = read_all(sel, socks, timeout=120)
        deadline = time.monotonic() + 30
        while not gone(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The new process is the old one's child, not ours: ended here by its pid.
        os.kill(new, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not gone(new) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {
            "asked": parked, "parked": held, "handed": int(line.group(1)), "serving": serving,
            "handover": float(line.group(2)), "paused": float(line.group(3)), "median_before": statistics.median(before) if before else float("nan"),
            "pause": max(during) if during else float("nan"), "pings": len(during),
            "failures": pinger.failures, "statuses": statuses, "old_gone": gone(first),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parked", type=int, nargs="+", default=[1000, 10000])
    args = p.parse_args(argv)
    header("Reload (SIGHUP) with a full lot")
    print(f"proxy code: {BENCH.parent}")
    ok = True
    for parked in args.parked:
        r = one_round(parked)
        answered = r["statuses"].get(200, 0)
        ok &= not r["failures"] and answered == r["parked"] and r["old_gone"]
        print(
            f"parked {r['parked']:>6} (asked {r['asked']}, handed over {r['handed']}): "
            f"SIGHUP -> serving {r['serving']:.2f}s, handover {r['handover'] * 1000:.0f} ms "
            f"(accepting paused {r['paused'] * 1000:.0f} ms), "
            f"client pause {r['pause'] * 1000:.0f} ms (median before {r['median_before'] * 1000:.1f} ms, "
            f"{r['pings']} pings during), failed pings {dict(collections.Counter(r['failures']))}, "
            f"answers after resume {dict(sorted(r['statuses'].items()))}, old process gone {r['old_gone']}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
