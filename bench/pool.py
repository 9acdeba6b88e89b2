"""What routing over a pool of three costs a request, against a pool of one (issue 12).

One run, side by side:

* three simulated Ollamas (``python -m yieldproxy.tools.sim --latency 0 --parallel 64``),
  each in its own process, the same settings;
* ``pool1``: a yieldproxy whose ``[[upstreams]]`` is the first sim alone;
  ``pool3``: another whose ``[[upstreams]]`` are the three (every member serves
  the model: each request is routed, least in flight then config order);
  each proxy in its own process; ``direct``: the first sim itself;
* concurrency 1: a raw-socket keep-alive client calls each side once per round
  (``POST /api/embed``, small body), order rotated every round; p50/p99 and
  the added latency over direct (median of the per-round differences);
* concurrency 16: ``wrk`` rounds, one per side, order rotated; requests/s,
  p50/p99, and each proxy's CPU per request (utime+stime over its rounds).

Target: the pool of three's added latency (c=1), CPU per request and
throughput (c=16) within 10 % of the pool of one's, measured in the same run
("adds no measurable cost"; the run-to-run noise of these figures on a shared
machine is about that size).

    .venv/bin/python bench/pool.py [--pairs 2000] [--rounds 3] [--seconds 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from _common import Children, header, start_proxy, start_sim, verdict
from latency import concurrency_n, concurrency_one, ratio

#: The pool of three against the pool of one: at most this much worse on each figure.
TARGET_RATIO = 1.10


def pool_toml(ports: list[int]) -> str:
    """A config whose ``[[upstreams]]`` are the sims on ``ports``."""
    tables = [
        f'[[upstreams]]\nname = "sim{i}"\nurl = "http://127.0.0.1:{port}"\n' for i, port in enumerate(ports, 1)
    ]
    return "\n".join(tables)


def start_pool(children: Children, ports: list[int], workdir: str, name: str):
    path = os.path.join(workdir, f"{name}.toml")
    with open(path, "w") as f:
        f.write(pool_toml(ports))
    # --upstream is the runner's required option; [[upstreams]] in the file is what the proxy uses.
    return start_proxy(children, ports[0], "--config", path, name=name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2000, help="rounds (one call per side) at concurrency 1")
    p.add_argument("--pair-seconds", type=float, default=20.0, help="time bound of the concurrency-1 phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="wrk rounds per side at concurrency 16")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per wrk round")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="yieldproxy-bench-pool-") as workdir, Children() as children:
        sims = [start_sim(children, name=f"sim{i}") for i in (1, 2, 3)]
        sim_ports = [port for _, port in sims]
        pool1, pool1_port, _ = start_pool(children, sim_ports[:1], workdir, "pool1")
        pool3, pool3_port, _ = start_pool(children, sim_ports, workdir, "pool3")
        ports = {"direct": sim_ports[0], "pool1": pool1_port, "pool3": pool3_port}
        relays = {"pool1": pool1.pid, "pool3": pool3.pid}
        sim_pids = {"sim": sims[0][0].pid, "sim2": sims[1][0].pid, "sim3": sims[2][0].pid}
        c1 = concurrency_one(ports, relays, args.pairs, args.pair_seconds)
        cn = concurrency_n(ports, {**sim_pids, **relays}, args.concurrency, args.rounds, args.seconds)
        errors = pool3.log_tail(4000)

    relayed = ["pool1", "pool3"]
    header("yieldproxy pool: a pool of three against a pool of one (POST /api/embed, small body)")
    print(f"proxy code: {pool1.src}; three sims, two proxies, each in its own process; {os.cpu_count()} cores")
    print("pool1: [[upstreams]] = sim1; pool3: [[upstreams]] = sim1, sim2, sim3 (same settings); direct: sim1")
    print(f"{'':34}" + "".join(f"{side:>10}" for side in ports))
    print(f"c=1 ({c1['pairs']} rounds of one call each way, order rotated)")
    for q in ("p50", "p99", "mean"):
        print(f"  latency {q:<24}" + "".join(f"{c1[side][q]:>8.3f}ms" for side in ports))
    print(f"  added, median of per-round diffs{'':>10}" + "".join(f"{c1['added'][side]:>8.3f}ms" for side in relayed))
    print(f"  CPU per request{'':>27}" + "".join(f"{c1['cpu_ms_per_request'][side]:>8.3f}ms" for side in relayed))
    print(f"c={args.concurrency} ({args.rounds} rounds of {args.seconds:g}s each way, order rotated, {cn['loadgen']})")
    for q in ("p50", "p99"):
        print(f"  latency {q:<24}" + "".join(f"{cn[side][q]:>8.3f}ms" for side in ports))
    print("  throughput (req/s)              " + "".join(f"{cn[side]['rps']:>10.0f}" for side in ports))
    print("  errors                          " + "".join(f"{cn[side]['errors']:>10}" for side in ports))
    print(f"  CPU per request{'':>27}" + "".join(f"{cn[side]['cpu_ms_per_request']:>8.3f}ms" for side in relayed))
    for i, who in enumerate([*sim_pids, *relayed, "loadgen"]):
        label = "CPU share (cores) " if i == 0 else ""
        print(f"  {label:<18}{who:<14}" + "".join(f"{cn[side]['cpu_share'][who]:>10.2f}" for side in ports))

    rows = [
        ("added latency, c=1 (round diffs)", c1["added"]["pool3"], c1["added"]["pool1"], False),
        ("latency p50, c=1", c1["pool3"]["p50"], c1["pool1"]["p50"], False),
        ("latency p99, c=1", c1["pool3"]["p99"], c1["pool1"]["p99"], False),
        ("CPU per request, c=1", c1["cpu_ms_per_request"]["pool3"], c1["cpu_ms_per_request"]["pool1"], False),
        (f"latency p50, c={args.concurrency}", cn["pool3"]["p50"], cn["pool1"]["p50"], False),
        (f"latency p99, c={args.concurrency}", cn["pool3"]["p99"], cn["pool1"]["p99"], False),
        (f"CPU per request, c={args.concurrency}", cn["pool3"]["cpu_ms_per_request"],
         cn["pool1"]["cpu_ms_per_request"], False),
        (f"throughput, c={args.concurrency} (req/s)", cn["pool3"]["rps"], cn["pool1"]["rps"], True),
    ]
    print("the pool of three against the pool of one")
    print(f"{'':42}{'pool3':>10}{'pool1':>10}{'ratio':>8}")
    for label, three, one, _ in rows:
        print(f"  {label:<40}{three:>10.3f}{one:>10.3f}{ratio(three, one):>7.2f}x")

    print()
    print("targets")
    targets = [rows[0], rows[3], rows[6], rows[7]]
    for label, three, one, higher_is_better in targets:
        value = ratio(three, one)
        ok = value >= 1 / TARGET_RATIO if higher_is_better else value <= TARGET_RATIO
        bound = f">= {1 / TARGET_RATIO:.2f}x" if higher_is_better else f"<= {TARGET_RATIO:.2f}x"
        print(f"  [{verdict(ok)}] pool of three, {label}: {value:.2f}x the pool of one (target {bound})")
    if any(cn[side]["errors"] for side in ports):
        print("errors seen; pool3 log tail:\n" + errors, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
