"""Instructions per relayed request, this tree's proxy against another tree's (not a test).

CPU time on a shared machine moves by more than the differences between two
trees; the instructions a process runs do not.  Each proxy runs under
valgrind's callgrind twice, once relaying ``--few`` small embeddings and once
``--many`` (concurrency 1, a raw keep-alive socket), then stops; the
difference of the two runs' instruction counts (``Ir``), divided by the
difference of the calls, is what one request costs, start-up and shutdown
cancelled out.  Cache and branch costs are not in the count: this says how
much work each tree does, not how long it takes (``latency.py`` measures that).

    .venv/bin/python bench/instructions.py --base ../base [--few 100] [--many 600] [--also DIR ...]
"""
from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from _common import BENCH, PYTHON, SMALL_EMBED, SRC, Children, Conn, post, start_sim


def run_counted(children: Children, sim_port: int, name: str, src: Path, out: Path, calls: int) -> int:
    """Instructions a proxy of ``src`` runs from its start to its stop, relaying ``calls`` requests."""
    child = children.start(name, [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
        PYTHON, str(BENCH / "_proxy_runner.py"), "--upstream", f"http://127.0.0.1:{sim_port}",
    ], src)
    port = int(child.wait_line(r"ready proxy=(\d+) admin=\d+ pid=\d+", timeout=900).group(1))
    conn = Conn(port, timeout=120)
    try:
        for _ in range(calls):
            status, _h, _b = conn.request(post("/api/embed", SMALL_EMBED))
            assert status == 200, status
    finally:
        conn.close()
    child.stop(timeout=300)
    m = re.search(r"^totals:\s*(\d+)", out.read_text(errors="replace"), re.M)
    if m is None:
        raise RuntimeError(f"no totals in {out}")
    return int(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the other tree (e.g. a git worktree of an older commit)")
    p.add_argument("--also", nargs="*", default=[], help="more trees, each counted the same way")
    p.add_argument("--this", action=argparse.BooleanOptionalAction, default=True, help="count this tree")
    p.add_argument("--few", type=int, default=100)
    p.add_argument("--many", type=int, default=600)
    args = p.parse_args()
    trees = {"base": Path(args.base).resolve()}
    if args.this:
        trees["this"] = SRC
    trees.update({Path(d).name: Path(d).resolve() for d in args.also})
    out = Path(tempfile.mkdtemp(prefix="instructions-"))
    per: dict[str, float] = {}
    with Children() as children:
        _sim, sim_port = start_sim(children)
        for name, src in trees.items():
            few = run_counted(children, sim_port, f"{name}-few", src, out / f"{name}-few.cg", args.few)
            many = run_counted(children, sim_port, f"{name}-many", src, out / f"{name}-many.cg", args.many)
            per[name] = (many - few) / (args.many - args.few)
            print(f"{name}: {per[name]:,.0f} instructions a request ({src})", flush=True)
    for name in trees:
        if name != "base":
            print(f"{name} / base: {per[name] / per['base']:.3f} x")


if __name__ == "__main__":
    main()
