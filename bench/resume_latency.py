"""Time from ``POST /resume`` to the first released request reaching the backend.

The backend is ``_stamp_backend.py`` (its own process), which records
``time.monotonic()`` when each request's first byte arrives; CLOCK_MONOTONIC
is shared by every process on Linux, so it compares with the benchmark's own
stamp taken just before it sends ``POST /resume`` (on an admin connection
opened beforehand).

Each round: ``POST /yield``; 100 connections each send one ``POST /api/embed``;
wait until ``GET /status`` says all 100 are parked; stamp, ``POST /resume``;
read every answer; fetch the backend's stamps.  Printed: the time to the
first arrival (median, max over the rounds), the time until the resume call
was answered, and the time until all 100 were replayed (at the configured
``replay.concurrency``).

Target: first release reaches the backend <= 5 ms after ``POST /resume``.

    .venv/bin/python bench/resume_latency.py [--rounds 20] [--parked 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _common import (
    BENCH,
    PYTHON,
    Children,
    Conn,
    admin_call,
    embed_body,
    get,
    header,
    post,
    start_proxy,
    verdict,
    wait_parked,
)
from parked_memory import open_parked, read_all

TARGET_FIRST_MS = 5.0


def fetch_stamps(port: int) -> list[float]:
    conn = Conn(port)
    try:
        status, _, body = conn.request(get("/_stamps"))
    finally:
        conn.close()
    assert status == 200, status
    return json.loads(body)["stamps"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--parked", type=int, default=100, help="requests parked per round")
    p.add_argument("--replay-concurrency", type=int, default=0, help="replay.concurrency (0: the default)")
    p.add_argument("--max-seconds", type=float, default=90.0, help="stop starting rounds after this long")
    args = p.parse_args(argv)

    body = embed_body(256)
    raw = (
        b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    rows = []
    failures = 0
    with Children() as children:
        backend = children.start("stamp-backend", [PYTHON, str(BENCH / "_stamp_backend.py")])
        backend_port = int(backend.wait_line(r"listening on 127\.0\.0\.1:(\d+)").group(1))
        extra = ["--replay-concurrency", str(args.replay_concurrency)] if args.replay_concurrency else []
        proxy, proxy_port, admin_port = start_proxy(children, backend_port, *extra)
        concurrency = admin_call(admin_port, "GET", "/status")["config"]["replay"]["concurrency"]

        # Warm up: code paths and the proxy's upstream pool.
        conn = Conn(proxy_port)
        for _ in range(50):
            assert conn.request(post("/api/embed", body))[0] == 200
        conn.close()
        fetch_stamps(backend_port)

        stop_at = time.monotonic() + args.max_seconds
        for _ in range(args.rounds):
            if time.monotonic() > stop_at:
                break
            admin_call(admin_port, "POST", "/yield", {"reason": "bench resume_latency", "source": "bench"})
            sel, socks = open_parked(proxy_port, args.parked, raw, timeout=30.0)
            wait_parked(admin_port, args.parked, timeout=30.0, step=0.02)
            admin = Conn(admin_port)
            resume = post("/resume", b'{"source": "bench"}')
            time.sleep(0.05)  # let the proxy settle after the status polls
            t0 = time.monotonic()
            admin.sock.sendall(resume)
            status, _, _ = admin.read_response()
            t_answer = time.monotonic()
            admin.close()
            statuses = read_all(sel, socks, timeout=30.0)
            t_done = time.monotonic()
            stamps = sorted(fetch_stamps(backend_port))
            ok = status == 200 and statuses.get(200, 0) == args.parked and len(stamps) == args.parked
            if not ok:
                failures += 1
                print(f"round failed: resume {status}, answers {statuses}, {len(stamps)} stamps", file=sys.stderr)
                continue
            rows.append(
                {
                    "first": (stamps[0] - t0) * 1000,
                    "answer": (t_answer - t0) * 1000,
                    "last": (stamps[-1] - t0) * 1000,
                    "done": (t_done - t0) * 1000,
                }
            )

    header(f"yieldproxy resume latency: POST /resume -> first release at the backend ({args.parked} parked)")
    print(f"  proxy code: {proxy.src}; replay.concurrency {concurrency}; {len(rows)} rounds, {failures} failed")
    if not rows:
        return 1
    print(f"  {'':44}{'median':>9}{'min':>9}{'max':>9}")
    for key, label in (
        ("first", "first request reaches the backend"),
        ("answer", "resume call answered (client side)"),
        ("last", f"last of {args.parked} reaches the backend"),
        ("done", f"all {args.parked} answered (client side)"),
    ):
        values = [r[key] for r in rows]
        print(f"  {label:<44}{statistics.median(values):>7.2f}ms{min(values):>7.2f}ms{max(values):>7.2f}ms")
    first_median = statistics.median(r["first"] for r in rows)
    first_max = max(r["first"] for r in rows)
    print()
    print("targets")
    print(f"  [{verdict(first_median <= TARGET_FIRST_MS)}] first release at the backend, median: "
          f"{first_median:.2f} ms (target <= {TARGET_FIRST_MS:g} ms)")
    print(f"  [{verdict(first_max <= TARGET_FIRST_MS)}] first release at the backend, max: "
          f"{first_max:.2f} ms (target <= {TARGET_FIRST_MS:g} ms)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
