"""docs/embedding.md's two programs (the proxy in a Twisted and in an asyncio program), run as written.

Each ```python block of the page that calls ``build(`` is run in a child
Python (this checkout first on its path), its ports swapped for free ones
and its upstream for a SimOllama: it must log where it listens, pass a
request through, take a yield on its admin API, and stop cleanly on SIGTERM.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import ChildOutput, free_port, wait_for
from yieldproxy.tools.sim import SimOllama

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "embedding.md"
TIMEOUT = 30


def programs() -> dict[str, str]:
    blocks = re.findall(r"^### (.+?)\n.*?```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    found = {title: code for title, code in blocks if "build(reactor, config)" in code}
    assert set(found) == {"In a Twisted program", "In an asyncio program"}, list(found)
    return found


@pytest.mark.parametrize("title", ["In a Twisted program", "In an asyncio program"])
@pytest_twisted.ensureDeferred
async def test_the_embedding_example_runs(title, tmp_path):
    code = programs()[title]
    assert code.count("11434") == 1 and code.count("11435") == 1 and code.count("11436") == 1
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    proxy_port, admin_port = free_port(), free_port()
    script = tmp_path / "program.py"
    script.write_text(
        code.replace("11434", str(sim_port)).replace("11435", str(proxy_port)).replace("11436", str(admin_port))
    )
    child = ChildOutput()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    process = reactor.spawnProcess(child, sys.executable, [sys.executable, str(script)], env=env, path=str(tmp_path))
    proxy, admin = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}"
    try:
        try:
            await wait_for(reactor, lambda: b"proxy listening on" in child.output or child.ended.called, TIMEOUT)
        finally:
            assert b"proxy listening on" in child.output, child.output.decode(errors="replace")
        answer = await treq.post(
            proxy + "/api/embed", json={"model": "all-minilm", "input": "through the embedded proxy"},
            persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert answer.code == 200 and (await answer.json())["embeddings"]
        answer = await treq.post(
            admin + "/yield", json={"source": "game", "reason": "test"}, persistent=False,
        ).addTimeout(TIMEOUT, reactor)
        assert answer.code == 200 and (await answer.json())["state"] == "yielded"
        process.signalProcess("TERM")
        code = await child.ended.addTimeout(TIMEOUT, reactor)
        output = child.output.decode(errors="replace")
        assert code == 0, output
        assert "Traceback" not in output, output
    finally:
        if not child.ended.called:
            process.signalProcess("KILL")
            await child.ended
        await sim.stop()
