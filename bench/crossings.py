"""How often one parked embedding request crosses between the lot and the pool, followed with a profiler.

The clock-driven heart (``service.build_heart``: yield state, lot, members, drainers and whatever
decides between them) is built on a ``Clock`` with a pool of ``--members``; ``--requests``
embedding requests park under a hold of all, the hold ends, the drainers let them out and each
exchange is reported finished, as the proxy app does.  ``sys.setprofile`` sees every call made
meanwhile; a call *crosses* when its caller's code is on one side and the callee's on the other:

* ``lot/pool``: the lot proper (lot/parking.py, lot/replay.py, and in a checkout older than the
  scheduler its gate.py) against the pool (upstream/pool/);
* ``packages``: all of lot/ (the yield state too) against all of upstream/;
* ``turns``: not calls but turns of the walk: each time the code running next is on the other
  side (lot proper or pool) from the last code of either that ran, whatever ran between
  (a scheduler above both, the proxy app's stand-in here).

It needs nothing but the package, so the same script measures any checkout (run it with that
checkout's Python, from its root).  tests/test_rooms.py holds the first figure to at most 3.

    .venv/bin/python bench/crossings.py [--members 2] [--requests 50]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import attrs
from twisted.internet.task import Clock

from yieldproxy.config import Config, MemberConfig
from yieldproxy.lot.parking import Entry
from yieldproxy.observe.metrics import Metrics
from yieldproxy.service import build_heart, one_step_cooperator

_PACKAGE = os.path.dirname(os.path.abspath(sys.modules["yieldproxy"].__file__ or ""))


def _sides(path: str) -> tuple[str | None, str | None]:
    """(side in the ``lot/pool`` count, side in the ``packages`` count) of a code file, or None."""
    if not path.startswith(_PACKAGE + os.sep):
        return None, None
    parts = path[len(_PACKAGE) + 1:].split(os.sep)
    package = parts[0] if parts[0] in ("lot", "upstream") else None
    if parts[0] == "lot" and parts[-1] in ("parking.py", "replay.py", "gate.py"):
        return "lot", package
    if parts[:2] == ["upstream", "pool"]:
        return "pool", package
    return None, package


def walk(members: int = 2, requests: int = 50) -> dict[str, float]:
    """Crossings per request of each count, for ``requests`` parked embeddings over ``members``."""
    config = attrs.evolve(Config(), upstreams=tuple(
        MemberConfig(name=f"m{i}", url=f"http://127.0.0.1:{20000 + i}") for i in range(members)
    ))
    clock = Clock()
    heart = build_heart(clock, config, Metrics(), one_step_cooperator(clock))
    state, scheduler = heart.state, heart.scheduler
    sides: dict[str, tuple[str | None, str | None]] = {}
    crossings: Counter[str] = Counter()
    last: list[str | None] = [None]

    def side(code) -> tuple[str | None, str | None]:
        found = sides.get(code.co_filename)
        if found is None:
            found = sides[code.co_filename] = _sides(code.co_filename)
        return found

    def profile(frame, event, arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = side(frame.f_code), side(frame.f_back.f_code)
        if callee[0]:
            if last[0] is not None and callee[0] != last[0]:
                crossings["turns"] += 1
            last[0] = callee[0]
        if callee[0] and caller[0] and callee[0] != caller[0]:
            crossings["lot/pool"] += 1
        if callee[1] and caller[1] and callee[1] != caller[1]:
            crossings["packages"] += 1

    state.hold("bench", "a yield")
    entries = [Entry(cls="batch", routing=scheduler.routing("POST", "/api/embed", "batch", "all-minilm"))
               for _ in range(requests)]
    sys.setprofile(profile)
    try:
        parked = [scheduler.admit(entry) for entry in entries]
        state.release("bench")
        done = 0
        for _ in range(100 * requests):
            clock.advance(0.001)
            for entry, d in zip(entries, parked):
                if d is not None and d.called:
                    scheduler.finished(seconds=0.01, member=entry.released_to)
                    done += 1
            parked = [None if d is None or d.called else d for d in parked]
            if done == requests:
                break
    finally:
        sys.setprofile(None)
    assert done == requests, f"{done} of {requests} released"
    return {name: crossings[name] / requests for name in ("lot/pool", "packages", "turns")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    figures = walk(args.members, args.requests)
    print(f"{args.requests} parked embedding requests over {args.members} member(s), calls across per request:")
    for name, value in figures.items():
        print(f"  {name:<10} {value:6.1f}")


if __name__ == "__main__":
    main()
