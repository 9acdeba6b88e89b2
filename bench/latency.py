"""What the proxy adds over a direct call: latency, throughput, CPU per request.

One run, side by side, against the same backend:

* the simulated Ollama (``python -m yieldproxy.tools.sim --latency 0 --parallel 64``)
  in its own process, a yieldproxy in front of it in another, and the *floor*
  in a third: a minimal Klein + ``twisted.web.client.Agent`` pass-through
  (``_floor.py``: persistent pool, TCP_NODELAY both ways, no parking), what
  any Twisted proxy built the obvious way costs;
* concurrency 1: a raw-socket keep-alive client calls each side once per round
  (``POST /api/embed``, small body), rotating the order every round, so drift
  and noise hit every side alike; p50/p99 of each side and the added latency
  (median of the per-round differences to the direct call);
* concurrency 16: ``wrk`` (C, one thread, keep-alive, Lua script for the POST
  body) in short rounds, one per side, order rotated; requests/s, p50/p99 from
  wrk's histogram, and the ratio;
* CPU per relayed request: utime+stime of the proxy's and of the floor's
  process (/proc/PID/stat) over each phase, divided by the requests each
  relayed.

Targets: added p50 at c=1 <= 0.3 ms; throughput at c=16 >= 85 % of direct;
proxy CPU <= 0.5 ms per request; against the floor (issue 25, the proxy's own
HTTP/1.1 edge): CPU per request <= 0.6 x the floor's at c=1 and <= 0.5 x at
c=16, added p50 latency at c=1 <= 0.5 x; added latency at c=16 <= 0.9 x
(issue 11).

    .venv/bin/python bench/latency.py [--pairs 2000] [--rounds 3] [--seconds 4] [--profile FILE] [--base DIR]

``--base DIR`` adds a side: the proxy of another tree (a git worktree of an
older commit), so both trees are measured in the same run.
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
from pathlib import Path

from _common import (
    SMALL_EMBED,
    Children,
    Conn,
    cpu_seconds,
    header,
    percentile,
    post,
    start_floor,
    start_proxy,
    start_sim,
    verdict,
)

TARGET_ADDED_P50_MS = 0.3
TARGET_THROUGHPUT_RATIO = 0.85
TARGET_CPU_MS = 0.5
#: The proxy's CPU per request and added latency, as a multiple of the floor's: issue 25's for CPU at
#: c=1 and c=N and for the added latency at c=1, issue 11's for the added latency at c=N.
TARGET_FLOOR_CPU_C1 = 0.6
TARGET_FLOOR_CPU_CN = 0.5
TARGET_FLOOR_ADDED_C1 = 0.5
TARGET_FLOOR_ADDED_CN = 0.9

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
# Concurrency 1: alternate direct and relayed calls.


def rotated(names: list[str], i: int) -> list[str]:
    """The sides in round ``i``'s order: each side takes each place in turn, so drift hits all alike."""
    k = i % len(names)
    return names[k:] + names[:k]


def concurrency_one(ports: dict[str, int], pids: dict[str, int], pairs: int, max_seconds: float) -> dict:
    """One keep-alive connection per side; rounds of one call to each side, order rotated.

    ``ports`` maps each side (``direct`` first) to its port; ``pids`` maps the
    relaying sides to their process, whose CPU is read over the phase.
    """
    raw = post("/api/embed", SMALL_EMBED)
    names = list(ports)
    conns = {side: Conn(port) for side, port in ports.items()}
    samples: dict[str, list[float]] = {side: [] for side in names}
    try:
        # Warm up: imports, pools, caches, the sim's model "load".
        for side in names:
            for _ in range(200):
                status, _, _ = conns[side].request(raw)
                assert status == 200, (side, status)
        cpu0 = {side: cpu_seconds(pid) for side, pid in pids.items()}
        deadline = time.monotonic() + max_seconds
        done = 0
        while done < pairs and time.monotonic() < deadline:
            for side in rotated(names, done):
                t0 = time.perf_counter_ns()
                status, _, _ = conns[side].request(raw)
                t1 = time.perf_counter_ns()
                if status != 200:
                    raise RuntimeError(f"{side}: status {status}")
                samples[side].append((t1 - t0) / 1e6)
            done += 1
        cpu = {side: cpu_seconds(pid) - cpu0[side] for side, pid in pids.items()}
    finally:
        for c in conns.values():
            c.close()
    out = {"pairs": done, "cpu_ms_per_request": {side: v * 1000 / max(1, done) for side, v in cpu.items()}}
    # The difference within each round (taken moments apart) is a second, less noise-prone view.
    out["added"] = {
        side: statistics.median(x - d for d, x in zip(samples["direct"], samples[side]))
        for side in names if side != "direct"
    }
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


def concurrency_n(ports: dict[str, int], pids: dict[str, int], conns: int, rounds: int, seconds: float) -> dict:
    """wrk rounds, one per side per round, order rotated; CPU of every process over each round.

    ``pids`` holds every process whose CPU share is shown (the sim and each
    relaying side); a side's own CPU per request is its process's CPU over its
    own rounds divided by the requests it relayed.
    """
    wrk = shutil.which("wrk")
    lua_file = None
    if wrk:
        fd, lua_file = tempfile.mkstemp(suffix=".lua", prefix="yieldproxy-bench-")
        with os.fdopen(fd, "w") as f:
            f.write(WRK_LUA % SMALL_EMBED.decode())
    names = list(ports)
    try:
        def run(port):
            return wrk_round(wrk, lua_file, port, conns, seconds) if wrk else threads_round(port, conns, seconds)

        # A short warm-up round each way (new connections, pools filled).
        for side in names:
            run(ports[side])
        results: dict[str, list[dict]] = {side: [] for side in names}
        cpu = {side: {who: 0.0 for who in [*pids, "loadgen"]} for side in names}
        for r in range(rounds):
            for side in rotated(names, r):
                before = {who: cpu_seconds(pid) for who, pid in pids.items()}
                g0 = children_cpu()
                results[side].append(run(ports[side]))
                for who, pid in pids.items():
                    cpu[side][who] += cpu_seconds(pid) - before[who]
                cpu[side]["loadgen"] += children_cpu() - g0
    finally:
        if lua_file:
            os.unlink(lua_file)
    out = {"loadgen": "wrk -t1" if wrk else "python threads (wrk not installed: apt-get install -y wrk)"}
    for side, rs in results.items():
        requests = sum(r["requests"] for r in rs)
        secs = sum(r["seconds"] for r in rs)
        out[side] = {
            "requests": requests,
            "seconds": secs,
            "rps": requests / secs,
            "p50": statistics.median(r["p50_ms"] for r in rs),
            "p99": statistics.median(r["p99_ms"] for r in rs),
            "errors": sum(r["socket_errors"] + r["status_errors"] for r in rs),
            "cpu_share": {k: v / secs for k, v in cpu[side].items()},
            # The side's own process (the sim for direct) per request it answered.
            "cpu_ms_per_request": cpu[side]["sim" if side == "direct" else side] * 1000 / max(1, requests),
        }
    return out


# ---------------------------------------------------------------------------


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2000, help="rounds (one call per side) at concurrency 1")
    p.add_argument("--pair-seconds", type=float, default=20.0, help="time bound of the concurrency-1 phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="wrk rounds per side at concurrency 16")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per wrk round")
    p.add_argument("--profile", default="", help="run the proxy under cProfile, write stats here")
    p.add_argument("--floor-h1", action="store_true",
                   help="also measure the floor's Klein front on yieldproxy.edge.h1client (the proxy's client) "
                        "instead of the Agent")
    p.add_argument("--base", default="",
                   help="also measure the proxy of another source tree (DIR: e.g. a git worktree of an older "
                        "commit) side by side, against the floor and against this tree's proxy")
    p.add_argument("--context-latency", type=float, default=0.02,
                   help="also measure c=16 throughput with this backend latency (s; 0: skip)")
    args = p.parse_args(argv)

    with Children() as children:
        sim, sim_port = start_sim(children)
        extra = ["--profile", args.profile] if args.profile else []
        proxy, proxy_port, _ = start_proxy(children, sim_port, *extra)
        floor, floor_port = start_floor(children, sim_port)
        ports = {"direct": sim_port, "proxy": proxy_port, "floor": floor_port}
        relays = {"proxy": proxy.pid, "floor": floor.pid}
        if args.floor_h1:
            lean_floor, ports["floor-h1"] = start_floor(children, sim_port, client="lean", name="floor-h1")
            relays["floor-h1"] = lean_floor.pid
        if args.base:
            base, ports["base"], _ = start_proxy(children, sim_port, name="base", src=Path(args.base).resolve())
            relays["base"] = base.pid
        c1 = concurrency_one(ports, relays, args.pairs, args.pair_seconds)
        cn = concurrency_n(ports, {"sim": sim.pid, **relays}, args.concurrency, args.rounds, args.seconds)
        errors = proxy.log_tail(4000)
        context = None
        if args.context_latency > 0:
            sim2, sim2_port = start_sim(children, "--latency", str(args.context_latency), name="sim-latency")
            proxy2, proxy2_port, _ = start_proxy(children, sim2_port, name="proxy-latency")
            context = concurrency_n(
                {"direct": sim2_port, "proxy": proxy2_port}, {"sim": sim2.pid, "proxy": proxy2.pid},
                args.concurrency, 2, 3.0,
            )

    relayed = [side for side in ports if side != "direct"]
    added_n = {side: cn[side]["p50"] - cn["direct"]["p50"] for side in relayed}
    header("yieldproxy latency: direct to the sim, through the proxy, through the floor (POST /api/embed, small body)")
    print(f"proxy code: {proxy.src}; sim, proxy and floor each in its own process; {os.cpu_count()} cores")
    print("floor: a minimal Klein + Agent pass-through (bench/_floor.py: persistent pool, TCP_NODELAY, no parking)")
    if args.base:
        print(f"base: the proxy of {base.src}, in its own process")
    if args.floor_h1:
        print("floor-h1: the floor's Klein front on yieldproxy.edge.h1client, the proxy's client (bench/_floor.py --client lean)")
    print(f"{'':34}" + "".join(f"{side:>10}" for side in ports))
    print(f"c=1 ({c1['pairs']} rounds of one call each way, order rotated)")
    for q in ("p50", "p99", "mean"):
        print(f"  latency {q:<24}" + "".join(f"{c1[side][q]:>8.3f}ms" for side in ports))
    print(f"  added, median of per-round diffs{'':>10}" + "".join(f"{c1['added'][side]:>8.3f}ms" for side in relayed))
    print(f"c={args.concurrency} ({args.rounds} rounds of {args.seconds:g}s each way, order rotated, {cn['loadgen']})")
    for q in ("p50", "p99"):
        print(f"  latency {q:<24}" + "".join(f"{cn[side][q]:>8.3f}ms" for side in ports))
    print("  throughput (req/s)              " + "".join(f"{cn[side]['rps']:>10.0f}" for side in ports))
    print(f"  throughput, ratio to direct     {'':>10}" + "".join(
        f"{ratio(cn[side]['rps'], cn['direct']['rps']):>10.2f}" for side in relayed))
    print("  errors                          " + "".join(f"{cn[side]['errors']:>10}" for side in ports))
    for i, who in enumerate(["sim", *relayed, "loadgen"]):
        label = "CPU share (cores) " if i == 0 else ""
        print(f"  {label:<18}{who:<14}" + "".join(f"{cn[side]['cpu_share'][who]:>10.2f}" for side in ports))
    print(f"  {'':<32}(machine: {os.cpu_count()} cores)")

    cpu1 = c1["cpu_ms_per_request"]
    print("CPU per relayed request and added latency, the proxy against the floor")
    print(f"{'':34}{'proxy':>10}{'floor':>10}{'ratio':>10}")
    rows = [
        ("CPU per request, c=1", cpu1["proxy"], cpu1["floor"], TARGET_FLOOR_CPU_C1),
        (f"CPU per request, c={args.concurrency}", cn["proxy"]["cpu_ms_per_request"], cn["floor"]["cpu_ms_per_request"],
         TARGET_FLOOR_CPU_CN),
        ("added latency, c=1 (round diffs)", c1["added"]["proxy"], c1["added"]["floor"], TARGET_FLOOR_ADDED_C1),
        (f"added latency, c={args.concurrency} (p50)", added_n["proxy"], added_n["floor"], TARGET_FLOOR_ADDED_CN),
    ]
    for label, mine, floor_value, _ in rows:
        print(f"  {label:<32}{mine:>8.3f}ms{floor_value:>8.3f}ms{ratio(mine, floor_value):>9.2f}x")
    print(f"  (the sim itself: {cn['direct']['cpu_ms_per_request']:.3f} ms of CPU per direct request)")
    if args.floor_h1:
        print("the floor's front on the proxy's own client, against the floor (not a target)")
        print(f"{'':34}{'floor-h1':>10}{'floor':>10}{'ratio':>10}")
        lean_rows = [
            ("CPU per request, c=1", cpu1["floor-h1"], cpu1["floor"]),
            (f"CPU per request, c={args.concurrency}", cn["floor-h1"]["cpu_ms_per_request"],
             cn["floor"]["cpu_ms_per_request"]),
            ("added latency, c=1 (round diffs)", c1["added"]["floor-h1"], c1["added"]["floor"]),
            (f"added latency, c={args.concurrency} (p50)", added_n["floor-h1"], added_n["floor"]),
        ]
        for label, lean_floor_value, floor_value in lean_rows:
            print(f"  {label:<32}{lean_floor_value:>8.3f}ms{floor_value:>8.3f}ms"
                  f"{ratio(lean_floor_value, floor_value):>9.2f}x")

    if args.base:
        print("this tree's proxy against the base tree's, each also as a ratio of the floor (not a target)")
        print(f"{'':34}{'proxy':>10}{'base':>10}{'ratio':>10}{'proxy/fl':>10}{'base/fl':>10}")
        base_rows = [
            ("CPU per request, c=1", cpu1["proxy"], cpu1["base"], cpu1["floor"]),
            (f"CPU per request, c={args.concurrency}", cn["proxy"]["cpu_ms_per_request"],
             cn["base"]["cpu_ms_per_request"], cn["floor"]["cpu_ms_per_request"]),
            ("added latency, c=1 (round diffs)", c1["added"]["proxy"], c1["added"]["base"], c1["added"]["floor"]),
            (f"added latency, c={args.concurrency} (p50)", added_n["proxy"], added_n["base"], added_n["floor"]),
        ]
        for label, mine, base_value, floor_value in base_rows:
            print(f"  {label:<32}{mine:>8.3f}ms{base_value:>8.3f}ms{ratio(mine, base_value):>9.2f}x"
                  f"{ratio(mine, floor_value):>9.2f}x{ratio(base_value, floor_value):>9.2f}x")

    if context:
        d, x = context["direct"], context["proxy"]
        print(f"context: c={args.concurrency}, backend latency {args.context_latency * 1000:g} ms "
              f"(2 alternated rounds of 3s each way; not a target)")
        print(f"{'':34}{'direct':>10}{'proxy':>10}{'added':>10}{'ratio':>8}")
        for q in ("p50", "p99"):
            print(f"  latency {q:<24}{d[q]:>8.3f}ms{x[q]:>8.3f}ms{x[q] - d[q]:>8.3f}ms{x[q] / d[q]:>8.2f}")
        print(f"  throughput (req/s)              {d['rps']:>10.0f}{x['rps']:>10.0f}{'':>10}{x['rps'] / d['rps']:>8.2f}")
        print(f"  proxy CPU per request           {'':>10}{x['cpu_ms_per_request']:>8.3f}ms")

    added = c1["proxy"]["p50"] - c1["direct"]["p50"]
    throughput = ratio(cn["proxy"]["rps"], cn["direct"]["rps"])
    cpu = max(cpu1["proxy"], cn["proxy"]["cpu_ms_per_request"])
    print()
    print("targets")
    print(f"  [{verdict(added <= TARGET_ADDED_P50_MS)}] added latency at c=1, p50: {added:.3f} ms "
          f"(target <= {TARGET_ADDED_P50_MS} ms)")
    print(f"  [{verdict(throughput >= TARGET_THROUGHPUT_RATIO)}] throughput at c={args.concurrency}: "
          f"{throughput:.0%} of direct (target >= {TARGET_THROUGHPUT_RATIO:.0%})")
    print(f"  [{verdict(cpu <= TARGET_CPU_MS)}] proxy CPU per request: {cpu:.3f} ms (target <= {TARGET_CPU_MS} ms)")
    for label, mine, floor_value, target in rows:
        value = ratio(mine, floor_value)
        print(f"  [{verdict(value <= target)}] proxy {label}: {value:.2f}x the floor (target <= {target}x)")
    if any(cn[side]["errors"] for side in ports):
        print("errors seen; proxy log tail:\n" + errors, file=sys.stderr)
    if args.profile:
        print(f"proxy profile written to {args.profile} (python -m pstats {args.profile})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
