"""How long other requests wait while the proxy reads a 30 MB body for a ``[[routes]]`` model rule.

A rule with ``models`` makes the proxy find the model in every body on its
route; it used to parse the whole body with ``json.loads`` on the reactor
thread, and every other request waited meanwhile (finding 8 of issue 10:
about 2 s for 30 MB).  Now a body over 64 KiB is scanned for its top-level
``model`` key instead (``yieldproxy/servers/gojson.py``).

The proxy (``--config`` with the rule) and the backend (``_stamp_backend.py``,
which answers every request at once) each run in their own process.  For
each body shape a thread sends ``GET /api/tags`` on one keep-alive connection
every 2 ms, while another posts the large body; printed: the large request's
time, and the longest wait of a probe meanwhile (the stall the large body
caused every other caller).  Each shape runs ``--rounds`` times; the worst is
shown.

Target: the longest probe wait <= 250 ms for every shape (a stall a caller
does not notice next to a model call).

    /work/venv/bin/python bench/large_body.py [--rounds 3]
    YIELDPROXY_BENCH_SRC=/path/to/older/tree /work/venv/bin/python bench/large_body.py   # before
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import BENCH, PYTHON, SRC, Children, Conn, get, header, post, start_proxy, verdict

TARGET_MS = 250.0
RULES = """
[[routes]]
path = "/api/embed"
models = ["big-*"]
class = "long"

[[routes]]
path = "/api/chat"
models = ["big-*"]
class = "long"
"""


def bodies() -> dict[str, tuple[str, bytes]]:
    """Shapes a real client sends, and one a hostile client could (route, body)."""
    rng = random.Random(1)
    words = ["".join(rng.choices(string.ascii_letters, k=8)) for _ in range(1000)]
    return {
        "embed, 280k texts": ("/api/embed", json.dumps(
            {"model": "m", "input": [" ".join(rng.choices(words, k=12)) for _ in range(280_000)]}).encode()),
        "embed, 10M token ids": ("/api/embed", json.dumps(
            {"model": "m", "input": "x", "context": [7] * 10_000_000}).encode()),
        "chat, 145k messages": ("/api/chat", json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": " ".join(rng.choices(words, k=20))}
                                        for _ in range(145_000)]}).encode()),
        "hostile, 8M empty arrays": ("/api/embed",
                                     b'{"model":"m","input":"x","x":[' + b",".join([b"[]"] * 8_000_000) + b"]}"),
    }


def one_round(port: int, path: str, body: bytes) -> tuple[int, float, float, int]:
    """(status, seconds for the large request, longest probe wait, probes)."""
    stop = threading.Event()
    waits: list[float] = []

    def probe() -> None:
        conn = Conn(port, timeout=60)
        try:
            while not stop.is_set():
                began = time.monotonic()
                conn.request(get("/api/tags"))
                waits.append(time.monotonic() - began)
                time.sleep(0.002)
        finally:
            conn.close()

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.3)
        conn = Conn(port, timeout=60)
        try:
            began = time.monotonic()
            status, _, _ = conn.request(post(path, body))
            took = time.monotonic() - began
        finally:
            conn.close()
        time.sleep(0.3)
    finally:
        stop.set()
        prober.join()
    return status, took, max(waits), len(waits)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    shapes = bodies()
    ok = True
    with tempfile.TemporaryDirectory() as tmp, Children() as children:
        config = Path(tmp) / "yieldproxy.toml"
        config.write_text(RULES, encoding="utf-8")
        backend = children.start("stamp-backend", [PYTHON, str(BENCH / "_stamp_backend.py")])
        backend_port = int(backend.wait_line(r"listening on 127\.0\.0\.1:(\d+)").group(1))
        proxy, port, _ = start_proxy(children, backend_port, "--config", str(config))
        header(f"Other requests while a large body is read for a model rule (proxy code: {proxy.src})")
        print(f"{'body':<26} {'size':>7} {'large request':>14} {'longest other wait':>19}  target <= {TARGET_MS:.0f} ms")
        for name, (path, body) in shapes.items():
            rounds = [one_round(port, path, body) for _ in range(args.rounds)]
            if any(status != 200 for status, *_ in rounds):
                print(f"{name}: answered {[r[0] for r in rounds]}", file=sys.stderr)
                ok = False
            took = max(r[1] for r in rounds) * 1000
            worst = max(r[2] for r in rounds) * 1000
            ok = ok and worst <= TARGET_MS
            print(f"{name:<26} {len(body) / 1e6:>5.1f}MB {took:>11.0f} ms {worst:>16.0f} ms  {verdict(worst <= TARGET_MS)}")
    print(f"\nsource measured: {SRC}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
