"""What the proxy adds over a direct call: latency, throughput, CPU per request.

One run, side by side, against the same backend:

* the simulated Ollama (``python -m yieldproxy.sim --latency 0 --parallel 64``)
  in its own process, and a yieldproxy in front of it in another;
* concurrency 1: a raw-socket keep-alive client alternates one direct call and
  one proxied call (``POST /api/embed``, small body), swapping the order every
  pair, so drift and noise hit both sides alike; p50/p99 of each side and the
  difference;
* concurrency 16: ``wrk`` (C, one thread, keep-alive, Lua script for the POST
  body) in short rounds alternating direct and proxied; requests/s, p50/p99
  from wrk's histogram, and the ratio;
* proxy CPU per proxied request: utime+stime of the proxy process
  (/proc/PID/stat) over each phase, divided by the requests it relayed.

Targets: added p50 at c=1 <= 0.3 ms; throughput at c=16 >= 85 % of direct;
proxy CPU <= 0.5 ms per request.

    .venv/bin/python bench/latency.py [--pairs 2000] [--rounds 3] [--seconds 4] [--profile FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _common import (
    SMALL_EMBED,
    Children,
    Conn,
    cpu_seconds,
    header,
    percentile,
    post,
    start_proxy,
    start_sim,
    verdict,
)

TARGET_ADDED_P50_MS = 0.3
TARGET_THROUGHPUT_RATIO = 0.85
TARGET_CPU_MS = 0.5

WRK_LUA = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {\\"requests\\": %%d, \\"duration_us\\": %%d, \\"p50_us\\": %%.1f, \\"p99_us\\": %%.1f, " ..
    "\\"socket_errors\\": %%d, \\"status_errors\\": %%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def children_cpu() -> float:
    """CPU seconds of reaped children (wrk), to show the load generator's own load."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ---------------------------------------------------------------------------
# Concurrency 1: alternate direct and proxied calls.


def concurrency_one(direct_port: int, proxy_port: int, proxy_pid: int, pairs: int, max_seconds: float) -> dict:
    raw = post("/api/embed", SMALL_EMBED)
    conns = {"direct": Conn(direct_port), "proxy": Conn(proxy_port)}
    samples: dict[str, list[float]] = {"direct": [], "proxy": []}
    try:
        # Warm up: imports, pools, caches, the sim's model "load".
        for side in ("direct", "proxy"):
            for _ in range(200):
                status, _, _ = conns[side].request(raw)
                assert status == 200, (side, status)
        cpu0 = cpu_seconds(proxy_pid)
        deadline = time.monotonic() + max_seconds
        done = 0
        while done < pairs and time.monotonic() < deadline:
            order = ("direct", "proxy") if done % 2 == 0 else ("proxy", "direct")
            for side in order:
                t0 = time.perf_counter_ns()
                status, _, _ = conns[side].request(raw)
                t1 = time.perf_counter_ns()
                if status != 200:
                    raise RuntimeError(f"{side}: status {status}")
                samples[side].append((t1 - t0) / 1e6)
            done += 1
        cpu = cpu_seconds(proxy_pid) - cpu0
    finally:
        for c in conns.values():
            c.close()
    out = {"pairs": done, "proxy_cpu_ms_per_request": cpu * 1000 / max(1, done)}
    # The difference within each pair (taken moments apart) is a second, less noise-prone view.
    out["pair_diff_median"] = statistics.median(x - d for d, x in zip(samples["direct"], samples["proxy"]))
    for side, values in samples.items():
        values.sort()
        out[side] = {"p50": percentile(values, 50), "p99": percentile(values, 99), "mean": statistics.fmean(values)}
    return out


# ---------------------------------------------------------------------------
# Concurrency 16: wrk rounds (or Python threads when wrk is missing).


def wrk_round(wrk: str, lua: str, port: int, conns: int, seconds: float) -> dict:
    cmd = [wrk, "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "5s", "-s", lua,
           f"http://127.0.0.1:{port}/api/embed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
    for line in proc.stdout.splitlines():
        if line.startswith("WRKJSON "):
            result = json.loads(line[len("WRKJSON "):])
            result["p50_ms"] = result.pop("p50_us") / 1000
            result["p99_ms"] = result.pop("p99_us") / 1000
            result["seconds"] = result.pop("duration_us") / 1e6
            return result
    raise RuntimeError(f"wrk gave no result (exit {proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}")


def threads_round(port: int, conns: int, seconds: float, max_requests: int = 200_000) -> dict:
    """A fallback load generator: ``conns`` threads with a keep-alive socket each."""
    raw = post("/api/embed", SMALL_EMBED)
    latencies: list[list[float]] = [[] for _ in range(conns)]
    errors = [0] * conns
    stop_at = time.monotonic() + seconds
    per_thread = max_requests // conns

    def worker(i: int) -> None:
        c = Conn(port)
        try:
            mine = latencies[i]
            while time.monotonic() < stop_at and len(mine) < per_thread:
                t0 = time.perf_counter_ns()
                status, _, _ = c.request(raw)
                mine.append((time.perf_counter_ns() - t0) / 1e6)
                if status != 200:
                    errors[i] += 1
        finally:
            c.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    elapsed = time.monotonic() - t0
    values = sorted(v for chunk in latencies for v in chunk)
    return {
        "requests": len(values), "seconds": elapsed, "p50_ms": percentile(values, 50),
        "p99_ms": percentile(values, 99), "socket_errors": 0, "status_errors": sum(errors),
    }


def concurrency_n(direct_port, proxy_port, proxy_pid, sim_pid, conns, rounds, seconds) -> dict:
    wrk = shutil.which("wrk")
    lua_file = None
    if wrk:
        fd, lua_file = tempfile.mkstemp(suffix=".lua", prefix="yieldproxy-bench-")
        with os.fdopen(fd, "w") as f:
            f.write(WRK_LUA % SMALL_EMBED.decode())
    try:
        def run(port):
            return wrk_round(wrk, lua_file, port, conns, seconds) if wrk else threads_round(port, conns, seconds)

        # A short warm-up round each way (new connections, pools filled).
        run(direct_port)
        run(proxy_port)
        sides = {"direct": [], "proxy": []}
        cpu = {"direct": {"proxy": 0.0, "sim": 0.0, "loadgen": 0.0}, "proxy": {"proxy": 0.0, "sim": 0.0, "loadgen": 0.0}}
        for r in range(rounds):
            order = ("direct", "proxy") if r % 2 == 0 else ("proxy", "direct")
            for side in order:
                p0, s0, g0 = cpu_seconds(proxy_pid), cpu_seconds(sim_pid), children_cpu()
                result = run(direct_port if side == "direct" else proxy_port)
                cpu[side]["proxy"] += cpu_seconds(proxy_pid) - p0
                cpu[side]["sim"] += cpu_seconds(sim_pid) - s0
                cpu[side]["loadgen"] += children_cpu() - g0
                sides[side].append(result)
    finally:
        if lua_file:
            os.unlink(lua_file)
    out = {"loadgen": "wrk -t1" if wrk else "python threads (wrk not installed: apt-get install -y wrk)"}
    for side, results in sides.items():
        requests = sum(r["requests"] for r in results)
        secs = sum(r["seconds"] for r in results)
        out[side] = {
            "requests": requests,
            "seconds": secs,
            "rps": requests / secs,
            "p50": statistics.median(r["p50_ms"] for r in results),
            "p99": statistics.median(r["p99_ms"] for r in results),
            "errors": sum(r["socket_errors"] + r["status_errors"] for r in results),
            "cpu_share": {k: v / secs for k, v in cpu[side].items()},
        }
    out["proxy_cpu_ms_per_request"] = cpu["proxy"]["proxy"] * 1000 / max(1, out["proxy"]["requests"])
    out["sim_cpu_ms_per_request"] = cpu["direct"]["sim"] * 1000 / max(1, out["direct"]["requests"])
    return out


# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2000, help="direct+proxied pairs at concurrency 1")
    p.add_argument("--pair-seconds", type=float, default=20.0, help="time bound of the concurrency-1 phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="wrk rounds per side at concurrency 16")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per wrk round")
    p.add_argument("--profile", default="", help="run the proxy under cProfile, write stats here")
    p.add_argument("--context-latency", type=float, default=0.02,
                   help="also measure c=16 throughput with this backend latency (s; 0: skip)")
    args = p.parse_args(argv)

    with Children() as children:
        sim, sim_port = start_sim(children)
        extra = ["--profile", args.profile] if args.profile else []
        proxy, proxy_port, _ = start_proxy(children, sim_port, *extra)
        c1 = concurrency_one(sim_port, proxy_port, proxy.pid, args.pairs, args.pair_seconds)
        cn = concurrency_n(sim_port, proxy_port, proxy.pid, sim.pid, args.concurrency, args.rounds, args.seconds)
        errors = proxy.log_tail(4000)
        context = None
        if args.context_latency > 0:
            sim2, sim2_port = start_sim(children, "--latency", str(args.context_latency), name="sim-latency")
            proxy2, proxy2_port, _ = start_proxy(children, sim2_port, name="proxy-latency")
            context = concurrency_n(sim2_port, proxy2_port, proxy2.pid, sim2.pid, args.concurrency, 2, 3.0)

    header("yieldproxy latency: direct to the sim vs through the proxy (POST /api/embed, small body)")
    print(f"proxy code: {proxy.src}; sim and proxy each in its own process; {os.cpu_count()} cores")
    print(f"{'':34}{'direct':>10}{'proxy':>10}{'added':>10}{'ratio':>8}")
    d, x = c1["direct"], c1["proxy"]
    print(f"c=1 ({c1['pairs']} alternated pairs)")
    for q in ("p50", "p99", "mean"):
        print(f"  latency {q:<24}{d[q]:>8.3f}ms{x[q]:>8.3f}ms{x[q] - d[q]:>8.3f}ms{x[q] / d[q]:>8.2f}")
    print(f"  added, median of per-pair differences{'':>14}{c1['pair_diff_median']:>8.3f}ms")
    d, x = cn["direct"], cn["proxy"]
    print(f"c={args.concurrency} ({args.rounds} alternated rounds of {args.seconds:g}s each way, {cn['loadgen']})")
    for q in ("p50", "p99"):
        print(f"  latency {q:<24}{d[q]:>8.3f}ms{x[q]:>8.3f}ms{x[q] - d[q]:>8.3f}ms{x[q] / d[q]:>8.2f}")
    print(f"  throughput (req/s)              {d['rps']:>10.0f}{x['rps']:>10.0f}{'':>10}{x['rps'] / d['rps']:>8.2f}")
    print(f"  errors                          {d['errors']:>10}{x['errors']:>10}")
    print(f"  CPU share (cores) proxy         {d['cpu_share']['proxy']:>10.2f}{x['cpu_share']['proxy']:>10.2f}")
    print(f"                    sim           {d['cpu_share']['sim']:>10.2f}{x['cpu_share']['sim']:>10.2f}")
    print(f"                    load generator{d['cpu_share']['loadgen']:>10.2f}{x['cpu_share']['loadgen']:>10.2f}"
          f"   (machine: {os.cpu_count()} cores)")
    print(f"proxy CPU per proxied request: c=1 {c1['proxy_cpu_ms_per_request']:.3f} ms, "
          f"c={args.concurrency} {cn['proxy_cpu_ms_per_request']:.3f} ms "
          f"(the sim itself: {cn['sim_cpu_ms_per_request']:.3f} ms per direct request)")

    if context:
        d, x = context["direct"], context["proxy"]
        print(f"context: c={args.concurrency}, backend latency {args.context_latency * 1000:g} ms "
              f"(2 alternated rounds of 3s each way; not a target)")
        for q in ("p50", "p99"):
            print(f"  latency {q:<24}{d[q]:>8.3f}ms{x[q]:>8.3f}ms{x[q] - d[q]:>8.3f}ms{x[q] / d[q]:>8.2f}")
        print(f"  throughput (req/s)              {d['rps']:>10.0f}{x['rps']:>10.0f}{'':>10}{x['rps'] / d['rps']:>8.2f}")
        print(f"  proxy CPU per request           {'':>10}{context['proxy_cpu_ms_per_request']:>8.3f}ms")

    added = c1["proxy"]["p50"] - c1["direct"]["p50"]
    ratio = cn["proxy"]["rps"] / cn["direct"]["rps"]
    cpu = max(c1["proxy_cpu_ms_per_request"], cn["proxy_cpu_ms_per_request"])
    print()
    print("targets")
    print(f"  [{verdict(added <= TARGET_ADDED_P50_MS)}] added latency at c=1, p50: {added:.3f} ms (target <= {TARGET_ADDED_P50_MS} ms)")
    print(f"  [{verdict(ratio >= TARGET_THROUGHPUT_RATIO)}] throughput at c={args.concurrency}: {ratio:.0%} of direct "
          f"(target >= {TARGET_THROUGHPUT_RATIO:.0%})")
    print(f"  [{verdict(cpu <= TARGET_CPU_MS)}] proxy CPU per request: {cpu:.3f} ms (target <= {TARGET_CPU_MS} ms)")
    if cn["proxy"]["errors"] or cn["direct"]["errors"]:
        print("errors seen; proxy log tail:\n" + errors, file=sys.stderr)
    if args.profile:
        print(f"proxy profile written to {args.profile} (python -m pstats {args.profile})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
