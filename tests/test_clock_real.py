"""A real twistd whose wall clock steps 15 minutes forward, then an hour back (clock.py).

The step is made inside that process only (tests/clockstep_twistd.py replaces
its ``time.time``); the machine's clock is never touched.  On the wall clock
the reactor used to keep, the forward step ended the 600 s lease at once and
expired the parked request; the backward one kept a 5 s dead-man's lease for
an hour.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import pytest_twisted
import treq
from twisted.internet import reactor

from helpers import ChildOutput, free_port, sleep, until_healthy, wait_for
from yieldproxy.tools.sim import SimOllama

pytestmark = pytest.mark.heavy

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 30


async def get(url: str) -> dict:
    response = await treq.get(url, persistent=False).addTimeout(TIMEOUT, reactor)
    return await response.json()


async def post(url: str, body: dict):
    return await treq.post(url, json=body, persistent=False).addTimeout(TIMEOUT, reactor)


@pytest_twisted.ensureDeferred
async def test_a_real_twistd_keeps_leases_and_hold_bounds_through_wall_clock_steps_both_ways(tmp_path):
    sim = SimOllama(reactor)
    sim_port = await sim.listen()
    holds = tmp_path / "holds.json"
    config = tmp_path / "yieldproxy.toml"
    config.write_text(f'[state]\nholds_file = "{holds}"\n')
    proxy_port, admin_port = free_port(), free_port()
    protocol = ChildOutput()
    process = reactor.spawnProcess(
        protocol, sys.executable,
        [sys.executable, os.path.join(HERE, "clockstep_twistd.py"), "-n", "--pidfile=", "yieldproxy",
         "--config", str(config), "--upstream", f"http://127.0.0.1:{sim_port}",
         "--listen", f"tcp:{proxy_port}:interface=127.0.0.1", "--admin", f"tcp:{admin_port}:interface=127.0.0.1"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    admin, proxy = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{proxy_port}"
    output = lambda: protocol.output.decode(errors="replace")  # noqa: E731

    async def step(seconds: float, total: float) -> None:
        process.write(b"%g\n" % seconds)
        said = f"clock stepped by {total:+g} s".encode()
        await wait_for(reactor, lambda: said in protocol.output, timeout=TIMEOUT)
        # The reactor has run its timers since: two history samples taken after the step.
        taken = len((await get(admin + "/history"))["samples"])
        for _ in range(TIMEOUT * 10):
            if len((await get(admin + "/history"))["samples"]) >= taken + 2:
                return
            await sleep(reactor, 0.1)
        raise AssertionError(f"no history sample after the step: {output()}")

    try:
        await until_healthy(reactor, admin, lambda: protocol.ended.called, output, tries=200)
        # twistd schedules nothing before the plugin's makeService switches the reactor: nothing to move.
        assert b"pending call(s) moved" not in protocol.output, output()
        assert (await post(admin + "/yield", {"source": "broker", "reason": "game", "for_seconds": 600})).code == 200
        parked = treq.post(
            proxy + "/api/embed", json={"model": "all-minilm", "input": "parked"}, persistent=False,
        ).addTimeout(120, reactor)
        answered: list = []
        parked.addBoth(lambda result: answered.append(result) or result)
        for _ in range(TIMEOUT * 10):
            if (await get(admin + "/status"))["parked_total"] == 1:
                break
            await sleep(reactor, 0.1)
        before = await get(admin + "/status")
        assert before["parked_total"] == 1, output()

        # 15 minutes forward: the lease (600 s) and the request's hold bound (batch: 600 s) go on.
        await step(15 * 60, 15 * 60)
        after = await get(admin + "/status")
        assert after["state"] == "yielded" and [h["source"] for h in after["holds"]] == ["broker"], output()
        assert after["parked_total"] == 1 and not answered, output()
        assert b"parked past the hold bound" not in protocol.output
        # What it shows is on the wall clock, which did step; what is left is on elapsed time.
        assert 900 <= after["now"] - before["now"] < 900 + TIMEOUT
        [hold] = after["holds"]
        assert 600 - TIMEOUT < hold["expires_at"] - after["now"] <= 600
        written = json.loads(holds.read_text())
        assert written["boot_id"] and written["monotonic_at"] > 0

        # A dead-man's switch of 5 s, then the clock goes an hour back: it ends 5 s on, not an hour on.
        taken = time.monotonic()
        assert (await post(admin + "/yield", {"source": "dead-man", "for_seconds": 5})).code == 200
        await step(-3600, 15 * 60 - 3600)

        async def dead_man_held() -> bool:
            return any(h["source"] == "dead-man" for h in (await get(admin + "/status"))["holds"])

        for _ in range(TIMEOUT * 10):
            if not await dead_man_held():
                break
            await sleep(reactor, 0.1)
        lasted = time.monotonic() - taken
        assert not await dead_man_held(), f"the 5 s lease still held after {lasted:.1f} s: {output()}"
        assert 4.5 <= lasted < 15, lasted
        assert [h["source"] for h in (await get(admin + "/status"))["holds"]] == ["broker"]
        assert not answered

        # The broker gives the GPU back: the request parked all along goes out, once.
        assert (await post(admin + "/resume", {"source": "broker"})).code == 200
        response = await parked
        assert response.code == 200, await response.text()
        assert sim.requests_total["/api/embed"] == 1
        process.signalProcess("TERM")
        assert await protocol.ended.addTimeout(TIMEOUT, reactor) in (0, "SIGTERM"), output()
    finally:
        if not protocol.ended.called:
            process.signalProcess("KILL")
            await protocol.ended
        await sim.stop()
