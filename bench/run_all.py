"""Run every benchmark, one after the other, and print their figures.

Each runs in its own process with a time limit, so one that hangs or fails
does not stop the others; the exit status is non-zero if any failed.

    .venv/bin/python bench/run_all.py [--only latency,resume_latency]

Set YIELDPROXY_BENCH_SRC=DIR to measure another source tree than this checkout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
#: name -> time limit in seconds (each is meant to take under ~2 minutes).
SCRIPTS = {
    "latency": 240,
    "parked_memory": 240,
    "resume_latency": 180,
    "large_body": 180,
    "pool": 180,
    "reader": 120,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated names among: " + ", ".join(SCRIPTS))
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SCRIPTS)
    unknown = set(names) - set(SCRIPTS)
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")

    results = {}
    for name in names:
        print(f"\n### bench/{name}.py", flush=True)
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(BENCH / f"{name}.py")], cwd=str(BENCH))
        try:
            code = proc.wait(timeout=SCRIPTS[name])
        except subprocess.TimeoutExpired:
            # SIGTERM first: the script turns it into SystemExit and stops its children.
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = "timeout"
        results[name] = (code, time.monotonic() - started)

    print("\n### summary")
    for name, (code, seconds) in results.items():
        state = "ok" if code == 0 else f"FAILED ({code})"
        print(f"  {name:<16} {state:<14} {seconds:6.1f}s")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
