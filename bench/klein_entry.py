"""What the Klein entry costs: CPU per request and bytes per parked request, in this process.

The proxy listener's resource is the Klein app's (``ProxyApp.resource``:
``KleinEntry``, proxy/resource.py); its one route hands each request to the
handler's leaf resource.  Here the same requests go through the in-memory
rig (``tests/inmemory.py``: the whole proxy on a Clock, the simulated Ollama
behind it, no sockets) three times: with the proxy's entry (``klein``), with
Klein's own ``KleinResource`` of the same app (``klein-own``), and with the
leaf alone as the listener's resource (``leaf``, Klein skipped).  The
differences to ``leaf`` are what each way through Klein costs:

* **CPU**: ``--requests`` ``POST /api/embed`` (small body, ``Connection:
  close``), each answered 200 before the next; CPU time of the process
  (``time.process_time``) per request, the two entries alternating, best of
  ``--rounds``;
* **parked**: the upstream yielded, ``--parked`` requests with a 1 KB body
  are parked; bytes the process holds for them (tracemalloc, the rig's own
  objects left out) per request.

    .venv/bin/python bench/klein_entry.py [--requests 2000] [--rounds 3] [--parked 500]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc

from _common import SRC

sys.path.insert(0, str(SRC))  # the tree measured (YIELDPROXY_BENCH_SRC, else this checkout)
sys.path.insert(0, str(SRC / "tests"))

from klein.resource import KleinResource  # noqa: E402

from inmemory import Rig  # noqa: E402
from yieldproxy.proxy.handler import ProxyApp  # noqa: E402

ENTRIES = ("klein", "klein-own", "leaf")


def rig(entry: str) -> Rig:
    """A rig whose listener's resource is the proxy's Klein entry (``klein``), Klein's own resource of the
    same app (``klein-own``), or the handler's leaf (``leaf``)."""
    real = ProxyApp.resource
    if entry == "leaf":
        ProxyApp.resource = lambda app: app._entry  # type: ignore[method-assign]
    elif entry == "klein-own":
        ProxyApp.resource = lambda app: KleinResource(app.app)  # type: ignore[method-assign]
    try:
        return Rig()
    finally:
        ProxyApp.resource = real  # type: ignore[method-assign]


def request(body: bytes) -> bytes:
    return (
        b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def send(r: Rig, raw: bytes):
    peer = r.raw()
    peer.send(raw)
    r.turn()
    return peer


def cpu_per_request(r: Rig, count: int) -> float:
    raw = request(json.dumps({"model": "all-minilm", "input": "hello world"}).encode())
    start = time.process_time()
    for _ in range(count):
        peer = send(r, raw)
        if not peer.data.startswith(b"HTTP/1.1 200 "):
            raise SystemExit(f"not answered 200: {peer.data[:200]!r}")
    return (time.process_time() - start) / count


def bytes_per_parked(r: Rig, count: int) -> float:
    raw = request(json.dumps({"model": "all-minilm", "input": "x" * 950}).encode())
    for _ in range(5):
        send(r, raw)
    r.proxy.state.hold("bench")
    peers = [send(r, raw) for _ in range(50)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        peers += [send(r, raw) for _ in range(count)]
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    if len(r.proxy.lot) != count + 50:
        raise SystemExit(f"{len(r.proxy.lot)} parked, not {count + 50}")
    rig_only = [tracemalloc.Filter(False, p) for p in ("*/iosim.py", "*/inmemory.py", tracemalloc.__file__)]
    diff = after.filter_traces(rig_only).compare_to(before.filter_traces(rig_only), "filename")
    return sum(stat.size_diff for stat in diff) / count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests per entry and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parked", type=int, default=500, help="requests parked per entry")
    args = p.parse_args()
    rigs = {entry: rig(entry) for entry in ENTRIES}
    for r in rigs.values():
        cpu_per_request(r, 50)  # warm-up
    best = {entry: float("inf") for entry in ENTRIES}
    for n in range(args.rounds):
        for entry in ENTRIES[n % 3:] + ENTRIES[:n % 3]:
            best[entry] = min(best[entry], cpu_per_request(rigs[entry], args.requests))
    parked = {entry: bytes_per_parked(rig(entry), args.parked) for entry in ENTRIES}
    print(f"source: {SRC}")
    print(f"{'entry':<10}{'CPU us/request':>16}{'bytes/parked':>14}")
    for entry in ENTRIES:
        print(f"{entry:<10}{best[entry] * 1e6:>16.1f}{parked[entry]:>14.0f}")
    for entry in ENTRIES[:-1]:
        print(
            f"{entry}'s cost: {(best[entry] - best['leaf']) * 1e6:+.1f} us per request, "
            f"{parked[entry] - parked['leaf']:+.0f} bytes per parked request"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
