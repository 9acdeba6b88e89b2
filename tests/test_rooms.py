"""The lot and the pool meet only in the scheduler: followed call by call, a parked request crosses
between them at most 3 times (bench/crossings.py measures; issue 33's bound), and no module of
either imports the other's machinery."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _crossings():
    spec = importlib.util.spec_from_file_location("bench_crossings", ROOT / "bench" / "crossings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("members", [1, 2, 3])
def test_a_parked_embedding_crosses_between_the_lot_and_the_pool_at_most_three_times(members):
    figures = _crossings().walk(members, requests=20)
    assert figures["lot/pool"] <= 3 and figures["packages"] <= 3, figures


def test_the_members_import_nothing_of_the_lots_machinery():
    """A member knows itself: of the lot it may take values (an entry, the yield state), never the
    lot, its drainers or admission, which are the scheduler's to drive."""
    machinery = {"ParkingLot", "Replayer", "replay"}
    found = []
    for path in sorted((ROOT / "yieldproxy" / "upstream" / "pool").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.lstrip(".").startswith("lot"):
                names = {alias.name for alias in node.names} | {node.module.rpartition(".")[2]}
                found += [f"{path.name}:{node.lineno} {name}" for name in sorted(names & machinery)]
    assert found == []
