"""Profile this tree's proxy and another tree's side by side (not a test).

Starts the sim, this tree's proxy and ``--base DIR``'s proxy, each under
cProfile; sends ``--calls`` small embeddings at concurrency 1 to each, in
turn; stops them and prints, per module, the calls and own time per request
of each tree, largest difference first.

    .venv/bin/python bench/profile_pair.py --base ../base [--calls 3000]
"""
from __future__ import annotations

import argparse
import pstats
import tempfile
from collections import Counter
from pathlib import Path

from _common import SMALL_EMBED, Children, Conn, post, start_proxy, start_sim


def per_module(path: str, requests: int) -> tuple[Counter, Counter]:
    """Calls and own seconds per request, keyed by the module's short name."""
    calls: Counter = Counter()
    own: Counter = Counter()
    for (filename, _line, _name), (_cc, nc, tt, _ct, _callers) in pstats.Stats(path).stats.items():
        key = module_key(filename)
        calls[key] += nc / requests
        own[key] += tt / requests
    return calls, own


def module_key(filename: str) -> str:
    """yieldproxy's modules by their package path; libraries by their top package; builtins as one."""
    if filename == "~":
        return "(builtins)"
    parts = Path(filename).parts
    if "yieldproxy" in parts:
        i = len(parts) - 1 - parts[::-1].index("yieldproxy")
        return "/".join(parts[i:])
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    return Path(filename).name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="profile-pair-"))
    trees = {"this": None, "base": Path(args.base).resolve()}
    with Children() as children:
        _sim, sim_port = start_sim(children)
        procs = {}
        for name, src in trees.items():
            kw = {"src": src} if src else {}
            procs[name] = start_proxy(children, sim_port, "--profile", str(out / f"{name}.prof"), name=name, **kw)
        conns = {name: Conn(port) for name, (_c, port, _a) in procs.items()}
        for i in range(args.calls):
            for name in (("this", "base") if i % 2 else ("base", "this")):
                status, _h, _b = conns[name].request(post("/api/embed", SMALL_EMBED))
                assert status == 200, (name, status)
        for name, (child, _p, _a) in procs.items():
            conns[name].close()
            child.stop()
    stats = {name: per_module(str(out / f"{name}.prof"), args.calls) for name in trees}
    (tc, to), (bc, bo) = stats["this"], stats["base"]
    keys = sorted(set(tc) | set(bc), key=lambda k: -abs(to[k] - bo[k]))
    print(f"per request: calls this {sum(tc.values()):.0f}, base {sum(bc.values()):.0f}; "
          f"own us this {sum(to.values()) * 1e6:.1f}, base {sum(bo.values()) * 1e6:.1f}")
    print(f"{'module':<44}{'calls':>8}{'base':>8}{'own us':>9}{'base':>8}")
    for k in keys[:45]:
        print(f"{k:<44}{tc[k]:>8.1f}{bc[k]:>8.1f}{to[k] * 1e6:>9.2f}{bo[k] * 1e6:>8.2f}")


if __name__ == "__main__":
    main()
