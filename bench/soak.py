"""Soak: hours of mixed traffic through one proxy process, a yield every minute; does anything leak?

The simulated Ollama (``python -m yieldproxy.tools.sim``) and a yieldproxy
(``_proxy_runner.py``, the checkout's code) each run in their own process.
This process drives them with:

* embedding callers (``POST /api/embed``, keep-alive raw sockets, one thread
  each), every vector checked against the sim's deterministic answer;
* streaming chat callers (``POST /api/chat``, NDJSON), every reply checked;
* a broker that yields the GPU every ``--yield-every`` seconds for
  ``--yield-seconds`` (``POST /yield`` then ``POST /resume`` on the admin
  API), so requests park and replay all through the run.

It samples the proxy's VmRSS and open file descriptors (/proc/PID/status,
/proc/PID/fd) every ``--sample-every`` seconds and prints them at the start
(after a warm-up) and the end, and the outcome accounting: what the callers
saw, and what the proxy's own counters say (``/metrics``), which must add up
(sent = answered + abandoned; nothing parked or in flight at the end).

    .venv/bin/python bench/soak.py [--minutes 30] [--embed-callers 8] [--chat-callers 2]

Exit status 0 when nothing failed, every answer was right, the counters add
up, and RSS and descriptors did not grow past the bounds (``--max-rss-growth-mb``,
``--max-fd-growth``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # the checkout's yieldproxy (for the expected answers)
# The children too: measure the code of this checkout, not an installed copy.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH", "")]))

from _common import Children, Conn, HTTPError, admin_call, get, header, post, rss_bytes, start_proxy, start_sim, verdict  # noqa: E402
from yieldproxy.tools.sim import expected_embedding, expected_reply, messages_prompt  # noqa: E402

MB = 1024 * 1024
MODEL = "all-minilm"
CHAT_MODEL = "llama3.2"


def open_fds(pid: int) -> int:
    """Open file descriptors of a process (/proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Tally:
    """What the callers saw, by kind of request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent = collections.Counter()
        self.ok = collections.Counter()
        self.statuses = collections.Counter()
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.parked = collections.Counter()
        self.latencies: dict[str, list[float]] = collections.defaultdict(list)

    def record(self, kind: str, status: int | None, good: bool, seconds: float, parked: bool, detail: str = ""):
        with self.lock:
            self.sent[kind] += 1
            self.statuses[(kind, status)] += 1
            if parked:
                self.parked[kind] += 1
            if status == 200 and good:
                self.ok[kind] += 1
                self.latencies[kind].append(seconds)
            elif status == 200:
                self.wrong.append(f"{kind}: {detail}")
            else:
                self.errors.append(f"{kind}: {status}: {detail}")


def embed_caller(port: int, tally: Tally, stop: threading.Event, name: str, pause: float) -> None:
    """Embeds unique texts one after the other on one keep-alive connection."""
    rng = random.Random(name)
    conn = None
    n = 0
    while not stop.is_set():
        text = f"soak {name} {n}"
        n += 1
        body = json.dumps({"model": MODEL, "input": [text]}).encode()
        began = time.monotonic()
        status = None
        try:
            if conn is None:
                conn = Conn(port, timeout=120)
            status, headers, payload = conn.request(post("/api/embed", body))
            good = status == 200 and json.loads(payload)["embeddings"][0] == expected_embedding(text, MODEL)
            tally.record("embed", status, good, time.monotonic() - began, b"x-yield-parked-seconds" in headers,
                         "" if good else payload[:200].decode("utf-8", "replace"))
        except (OSError, HTTPError, ValueError, KeyError) as e:
            tally.record("embed", status, False, time.monotonic() - began, False, f"{type(e).__name__}: {e}")
            if conn is not None:
                conn.close()
            conn = None
        time.sleep(rng.uniform(0, pause))
    if conn is not None:
        conn.close()


def one_shot(port: int, tally: Tally, text: str) -> None:
    """One embedding on its own connection (``Connection: close``): connection churn."""
    body = json.dumps({"model": MODEL, "input": [text]}).encode()
    raw = post("/api/embed", body).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    began = time.monotonic()
    status = None
    conn = None
    try:
        conn = Conn(port, timeout=120)
        status, headers, payload = conn.request(raw)
        good = status == 200 and json.loads(payload)["embeddings"][0] == expected_embedding(text, MODEL)
        tally.record("fresh", status, good, time.monotonic() - began, b"x-yield-parked-seconds" in headers,
                     "" if good else payload[:200].decode("utf-8", "replace"))
    except (OSError, HTTPError, ValueError, KeyError) as e:
        tally.record("fresh", status, False, time.monotonic() - began, False, f"{type(e).__name__}: {e}")
    finally:
        if conn is not None:
            conn.close()


def churn_caller(port: int, tally: Tally, stop: threading.Event, name: str, pause: float) -> None:
    """A new connection for every request."""
    rng = random.Random(name)
    n = 0
    while not stop.is_set():
        one_shot(port, tally, f"soak {name} {n}")
        n += 1
        time.sleep(rng.uniform(0, pause))


def chat_caller(port: int, tally: Tally, stop: threading.Event, name: str, pause: float) -> None:
    """Streams chat replies (NDJSON) one after the other on one keep-alive connection."""
    rng = random.Random(name)
    conn = None
    n = 0
    while not stop.is_set():
        messages = [{"role": "user", "content": f"soak {name} question {n}"}]
        n += 1
        body = json.dumps({"model": CHAT_MODEL, "messages": messages, "stream": True}).encode()
        began = time.monotonic()
        status = None
        try:
            if conn is None:
                conn = Conn(port, timeout=120)
            status, headers, payload = conn.request(post("/api/chat", body))
            good = False
            if status == 200:
                lines = [json.loads(line) for line in payload.splitlines() if line.strip()]
                text = "".join(line["message"]["content"] for line in lines)
                good = lines[-1].get("done") is True and text == "".join(
                    expected_reply(messages_prompt(messages), CHAT_MODEL)
                )
            tally.record("chat", status, good, time.monotonic() - began, b"x-yield-parked-seconds" in headers,
                         "" if good else payload[:200].decode("utf-8", "replace"))
        except (OSError, HTTPError, ValueError, KeyError) as e:
            tally.record("chat", status, False, time.monotonic() - began, False, f"{type(e).__name__}: {e}")
            if conn is not None:
                conn.close()
            conn = None
        time.sleep(rng.uniform(0, pause))
    if conn is not None:
        conn.close()


def broker(admin_port: int, proxy_port: int, tally: Tally, stop: threading.Event, every: float, hold: float,
           burst: int, log: list, one_shots: list, phase: dict) -> None:
    """Yields the GPU every ``every`` seconds for ``hold`` seconds; ``burst`` one-shot callers arrive meanwhile."""
    next_yield = time.monotonic() + every
    round_ = 0
    while not stop.wait(max(0.0, next_yield - time.monotonic())):
        began = time.monotonic()
        round_ += 1
        phase["yielded"] = True
        admin_call(admin_port, "POST", "/yield", {"source": "soak", "reason": "soak: a game", "expected_seconds": hold})
        for i in range(burst):
            caller = threading.Thread(target=one_shot, args=(proxy_port, tally, f"soak burst {round_} {i}"), daemon=True)
            caller.start()
            one_shots.append(caller)
        peak = 0
        while time.monotonic() - began < hold and not stop.is_set():
            peak = max(peak, admin_call(admin_port, "GET", "/status")["parked_total"])
            time.sleep(0.25)
        admin_call(admin_port, "POST", "/resume", {"source": "soak"})
        phase["yielded"], phase["resumed_at"] = False, time.monotonic()
        log.append({"at": round(began, 1), "held": round(time.monotonic() - began, 1), "peak_parked": peak})
        next_yield = began + every


def scrape(admin_port: int) -> dict[str, dict[tuple, float]]:
    """``/metrics`` as {family_total: {labels: value}} for the counters and gauges we read."""
    conn = Conn(admin_port)
    try:
        status, _, payload = conn.request(get("/metrics"))
    finally:
        conn.close()
    if status != 200:
        raise HTTPError(f"/metrics: {status}")
    out: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
    pattern = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
    for line in payload.decode().splitlines():
        m = pattern.match(line)
        if not m or line.startswith("#"):
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        out[m.group(1)][labels] = float(m.group(3))
    return out


def by_label(family: dict[tuple, float], label: str) -> dict[str, float]:
    totals: dict[str, float] = collections.Counter()
    for labels, value in family.items():
        totals[dict(labels).get(label, "")] += value
    return dict(totals)


#: Seconds after a resume before the figures count as quiet (the lot drained, its connections closed).
SETTLE_SECONDS = 5.0


def sample(pid: int, phase: dict | None = None) -> tuple[float, int, int, bool]:
    """(time, RSS, fds, quiet): quiet when no yield is on or just over, so samples compare like with like."""
    now = time.monotonic()
    quiet = phase is not None and not phase["yielded"] and now - phase["resumed_at"] >= SETTLE_SECONDS
    return now, rss_bytes(pid), open_fds(pid), quiet


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the run (default 30)")
    p.add_argument("--embed-callers", type=int, default=8)
    p.add_argument("--chat-callers", type=int, default=2)
    p.add_argument("--churn-callers", type=int, default=2, help="callers that open a new connection per request")
    p.add_argument("--burst-per-yield", type=int, default=100, help="one-shot callers arriving during each yield")
    p.add_argument("--pause", type=float, default=0.02, help="most seconds a caller waits between requests")
    p.add_argument("--yield-every", type=float, default=60.0, help="seconds between yields")
    p.add_argument("--yield-seconds", type=float, default=10.0, help="length of each yield")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS/fd samples")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of traffic before the start figures")
    p.add_argument("--max-rss-growth-mb", type=float, default=20.0)
    p.add_argument("--max-fd-growth", type=int, default=8)
    args = p.parse_args(argv)
    duration = args.minutes * 60

    tally = Tally()
    stop = threading.Event()
    yields: list[dict] = []
    one_shots: list[threading.Thread] = []
    phase = {"yielded": False, "resumed_at": 0.0}
    samples: list[tuple[float, int, int]] = []
    with Children() as children:
        sim, sim_port = start_sim(children, "--latency", "0.005", "--chunk-delay", "0.01", "--parallel", "8")
        proxy, proxy_port, admin_port = start_proxy(children, sim_port)
        src = next((line for line in proxy.lines if line.startswith("ready")), "")
        initial = sample(proxy.pid)
        threads = [
            threading.Thread(target=embed_caller, args=(proxy_port, tally, stop, f"e{i}", args.pause), daemon=True)
            for i in range(args.embed_callers)
        ] + [
            threading.Thread(target=chat_caller, args=(proxy_port, tally, stop, f"c{i}", args.pause * 5), daemon=True)
            for i in range(args.chat_callers)
        ] + [
            threading.Thread(target=churn_caller, args=(proxy_port, tally, stop, f"f{i}", args.pause), daemon=True)
            for i in range(args.churn_callers)
        ]
        began = time.monotonic()
        for t in threads:
            t.start()
        broker_thread = threading.Thread(
            target=broker,
            args=(admin_port, proxy_port, tally, stop, args.yield_every, args.yield_seconds, args.burst_per_yield, yields, one_shots, phase),
            daemon=True,
        )
        broker_thread.start()
        time.sleep(min(args.warmup, duration / 4))
        samples.append(sample(proxy.pid, phase))
        next_sample = time.monotonic() + args.sample_every
        while time.monotonic() - began < duration:
            time.sleep(max(0.0, min(next_sample, began + duration) - time.monotonic()))
            if time.monotonic() >= next_sample:
                samples.append(sample(proxy.pid, phase))
                next_sample += args.sample_every
                done = time.monotonic() - began
                print(f"  {done / 60:5.1f} min  RSS {samples[-1][1] / MB:6.1f} MB  fds {samples[-1][2]:4d}  "
                      f"sent {sum(tally.sent.values()):7d}  failed {len(tally.errors)}  wrong {len(tally.wrong)}"
                      f"{'' if samples[-1][3] else '  (in or just after a yield)'}",
                      flush=True)
        stop.set()
        broker_thread.join(args.yield_seconds + 30)
        for t in threads:
            t.join(150)
        for t in one_shots:  # the last burst's callers finish once the lot drains
            t.join(150)
        admin_call(admin_port, "POST", "/resume", {"source": "soak"})
        deadline = time.monotonic() + 30
        while True:
            status = admin_call(admin_port, "GET", "/status")
            if (status["parked_total"] == 0 and status["inflight"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        time.sleep(1.0)
        idle = sample(proxy.pid)
        metrics = scrape(admin_port)
        log_text = proxy.log_tail(10_000_000)
        elapsed = time.monotonic() - began

    # Like with like: the first and last samples taken outside a yield and its drain.
    quiet = [x for x in samples if x[3]] or samples
    start, end = quiet[0], quiet[-1]
    codes = by_label(metrics.get("yieldproxy_requests_total", {}), "code")
    replay = by_label(metrics.get("yieldproxy_replay_total", {}), "outcome")
    rejected = by_label(metrics.get("yieldproxy_rejected_total", {}), "reason")
    retries = sum(metrics.get("yieldproxy_retries_total", {}).values())
    answered = sum(codes.values())
    abandoned = replay.get("abandoned", 0.0)
    sent = sum(tally.sent.values())
    tracebacks = log_text.count("Traceback") + log_text.count("Unhandled error")
    rss_growth = (end[1] - start[1]) / MB
    fd_growth = end[2] - start[2]

    header(f"yieldproxy soak: {elapsed / 60:.1f} min, {args.embed_callers} embedding + {args.chat_callers} "
           f"streaming chat + {args.churn_callers} new-connection callers, a {args.yield_seconds:g} s yield "
           f"every {args.yield_every:g} s with {args.burst_per_yield} more callers arriving in it")
    print(f"  proxy: {src}")
    print(f"  {'':28}{'RSS':>10}{'open fds':>10}")
    print(f"  {'just started':28}{initial[1] / MB:>8.1f}MB{initial[2]:>10d}")
    print(f"  {'start (warm, between yields)':28}{start[1] / MB:>8.1f}MB{start[2]:>10d}   at {(start[0] - began) / 60:.1f} min")
    print(f"  {'end (between yields)':28}{end[1] / MB:>8.1f}MB{end[2]:>10d}   at {(end[0] - began) / 60:.1f} min")
    print(f"  {'end (callers gone, idle)':28}{idle[1] / MB:>8.1f}MB{idle[2]:>10d}")
    print(f"  {'peak of the samples':28}{max(s[1] for s in samples) / MB:>8.1f}MB{max(s[2] for s in samples):>10d}")
    print()
    print("callers saw")
    for kind in sorted(tally.sent):
        lat = sorted(tally.latencies[kind])
        p50 = lat[len(lat) // 2] * 1000 if lat else float("nan")
        p99 = lat[int(len(lat) * 0.99)] * 1000 if lat else float("nan")
        print(f"  {kind:6} sent {tally.sent[kind]:7d}  ok {tally.ok[kind]:7d}  parked {tally.parked[kind]:6d}  "
              f"p50 {p50:7.1f} ms  p99 {p99:8.1f} ms")
    others = {f"{k} {s}": n for (k, s), n in tally.statuses.items() if s != 200}
    print(f"  failures {len(tally.errors)}  wrong answers {len(tally.wrong)}  other statuses {others or 'none'}")
    for line in (tally.errors + tally.wrong)[:10]:
        print(f"    {line}")
    print()
    print("the proxy's counters")
    print(f"  requests_total by code {dict(sorted(codes.items()))}")
    print(f"  replay_total by outcome {dict(sorted(replay.items()))}")
    print(f"  rejected_total {rejected or '{}'}  retries_total {retries:g}")
    print(f"  sent {sent} = answered {answered:g} + abandoned {abandoned:g}: {sent == answered + abandoned}")
    print(f"  at the end: parked {status['parked_total']}, in flight {status['inflight']}, state {status['state']}")
    print(f"  yields {len(yields)}; peak parked per yield "
          f"{[y['peak_parked'] for y in yields][:12]}{' ...' if len(yields) > 12 else ''}")
    print(f"  tracebacks in the proxy's log: {tracebacks}")
    print()
    checks = [
        (len(tally.errors) == 0, f"no caller failed ({len(tally.errors)})"),
        (len(tally.wrong) == 0, f"every answer right ({len(tally.wrong)} wrong)"),
        (sent == answered + abandoned and abandoned == 0, "sent = answered + abandoned (none abandoned)"),
        (status["parked_total"] == 0 and status["inflight"] == 0, "nothing parked or in flight at the end"),
        (len(yields) >= max(1, int(duration // args.yield_every) - 1), f"{len(yields)} yields happened"),
        (rss_growth <= args.max_rss_growth_mb, f"RSS growth {rss_growth:+.1f} MB (bound {args.max_rss_growth_mb:g})"),
        (fd_growth <= args.max_fd_growth, f"fd growth {fd_growth:+d} (bound {args.max_fd_growth})"),
        (tracebacks == 0, f"no traceback in the proxy's log ({tracebacks})"),
    ]
    print("checks")
    for good, text in checks:
        print(f"  [{verdict(good)}] {text}")
    return 0 if all(good for good, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
