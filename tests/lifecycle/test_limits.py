"""The open-file budget at start (issue 10, finding 6), with getrlimit/setrlimit injected."""

from __future__ import annotations

import re
import resource
from pathlib import Path

import pytest_twisted
from twisted.logger import LogLevel, formatEvent, globalLogPublisher

from helpers import config_with
from yieldproxy.config import Config, from_dict, proxy_max_connections
from yieldproxy.lifecycle.limits import RESERVE, fd_budget, fit_fd_limit

NOFILE = resource.RLIMIT_NOFILE
INFINITY = resource.RLIM_INFINITY
UNIT = Path(__file__).resolve().parents[2] / "etc" / "systemd" / "yieldproxy.service"


class Limits:
    """A process's RLIMIT_NOFILE: ``setrlimit`` obeys the rules the kernel does."""

    def __init__(self, soft, hard, refuse: bool = False):
        self.soft, self.hard, self.refuse = soft, hard, refuse
        self.calls = []

    def getrlimit(self, which):
        assert which == NOFILE
        return self.soft, self.hard

    def setrlimit(self, which, limits):
        assert which == NOFILE
        self.calls.append(limits)
        soft, hard = limits
        if self.refuse:
            raise OSError(1, "Operation not permitted")
        if hard != self.hard or (self.hard != INFINITY and soft > self.hard):
            raise ValueError("not allowed to raise maximum limit")
        self.soft = soft


def test_the_default_config_needs_more_than_the_usual_soft_limit():
    config = Config()
    cap = proxy_max_connections(config)
    assert cap == config.parking.max_parked + 1024
    budget = fd_budget(config, Limits(1024, 524288).getrlimit, Limits(1024, 524288).setrlimit)
    assert budget.need == 2 * cap + config.admin.max_connections + config.upstream.max_connections + RESERVE
    assert budget.need > 1024


def test_the_soft_limit_is_raised_as_far_as_needed_and_the_cap_kept():
    limits = Limits(1024, 524288)
    budget = fd_budget(Config(), limits.getrlimit, limits.setrlimit)
    assert limits.calls == [(budget.need, 524288)] and limits.soft == budget.need
    assert budget.soft_before == 1024 and budget.soft == budget.need
    assert budget.max_connections == proxy_max_connections(Config()) and budget.warnings == ()
    # An unlimited hard limit, likewise; a soft limit already high enough is left alone.
    unlimited = Limits(1024, INFINITY)
    assert fd_budget(Config(), unlimited.getrlimit, unlimited.setrlimit).soft == budget.need
    roomy = Limits(10**6, 10**6)
    assert fd_budget(Config(), roomy.getrlimit, roomy.setrlimit).warnings == () and roomy.calls == []


def test_a_hard_limit_too_low_for_the_defaults_sizes_them_to_it_without_a_warning():
    """Every default start on a machine whose hard limit is 20,000 logged two warnings."""
    limits = Limits(1024, 20000)
    budget = fd_budget(Config(), limits.getrlimit, limits.setrlimit)
    assert limits.soft == 20000 and budget.warnings == ()
    others = 64 + 64 + RESERVE
    assert budget.max_connections == (20000 - others) // 2
    # What fits: every client connection with its upstream connection, and the rest.
    assert 2 * budget.max_connections + others <= 20000
    # The parked queue can fill: room is kept for requests in flight and passthrough calls.
    assert budget.max_parked == budget.max_connections - 1024
    assert f"at most {budget.max_connections} client connections" in budget.sized
    assert f"{budget.max_parked} parked requests (not 10000)" in budget.sized
    # A tiny limit keeps half of what fits for parked requests.
    tiny = Limits(1024, 1024)
    small = fd_budget(Config(), tiny.getrlimit, tiny.setrlimit)
    assert small.warnings == () and small.max_parked == small.max_connections - small.max_connections // 2 >= 1


def test_explicit_settings_the_hard_limit_cannot_meet_are_warned_about():
    limits = Limits(1024, 4096)
    budget = fd_budget(from_dict({"parking": {"max_parked": 10000}}), limits.getrlimit, limits.setrlimit)
    others = 64 + 64 + RESERVE
    assert budget.max_connections == (4096 - others) // 2 and budget.max_parked == 10000
    first, second = budget.warnings
    assert "open-file limit is 4096" in first and "LimitNOFILE=" in first and "lower parking.max_parked" in first
    assert f"taking at most {budget.max_connections} client connections" in first
    assert "parking.max_parked (10000)" in second and "can never fill" in second
    # An explicit connection cap: its own warning; the default parked ceiling follows it quietly.
    limits = Limits(1024, 4096)
    budget = fd_budget(from_dict({"proxy": {"max_connections": 5000}}), limits.getrlimit, limits.setrlimit)
    [warning] = budget.warnings
    assert "lower proxy.max_connections" in warning and budget.max_parked < budget.max_connections
    # A cap the operator set below the default parked ceiling: the ceiling follows it, no warning.
    roomy = Limits(1024, 10**6)
    budget = fd_budget(from_dict({"proxy": {"max_connections": 2000}}), roomy.getrlimit, roomy.setrlimit)
    assert budget.warnings == () and budget.max_connections == 2000 and budget.max_parked == 1000


def test_a_refused_setrlimit_is_a_warning_not_a_crash():
    limits = Limits(1024, 524288, refuse=True)
    budget = fd_budget(Config(), limits.getrlimit, limits.setrlimit)
    assert budget.soft == 1024 and budget.max_connections == (1024 - 64 - 64 - RESERVE) // 2
    assert "could not raise the open-file limit from 1024" in budget.warnings[0]


def test_fit_fd_limit_logs_and_returns_the_cap_that_fits():
    lines = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        limits = Limits(1024, 2048)
        config = fit_fd_limit(config_with(proxy={"max_connections": 5000}), limits.getrlimit, limits.setrlimit)
        roomy = Limits(1024, 10**6)
        unchanged = fit_fd_limit(Config(), roomy.getrlimit, roomy.setrlimit)
    finally:
        globalLogPublisher.removeObserver(observer)
    assert config.proxy.max_connections == (2048 - 64 - 64 - RESERVE) // 2
    assert unchanged == Config()
    assert any(line.startswith("open-file limit raised from 1024 to 2048") for line in lines)
    assert any("below the" in line and "proxy.max_connections" in line for line in lines)


def test_a_default_start_on_a_machine_with_a_hard_limit_of_20000_logs_no_warning():
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        limits = Limits(1024, 20000)
        config = fit_fd_limit(Config(), limits.getrlimit, limits.setrlimit)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert [formatEvent(e) for e in events if e.get("log_level") == LogLevel.warn] == []
    [sized] = [formatEvent(e) for e in events if "sized to it" in formatEvent(e)]
    assert "open-file limit is 20000" in sized and "LimitNOFILE=" in sized
    assert config.parking.max_parked < config.proxy.max_connections <= (20000 - 64 - 64 - RESERVE) // 2
    assert config.explicit == frozenset()  # still the defaults: a reload sizes them again


def test_the_systemd_unit_gives_the_default_config_enough_descriptors():
    limit = re.search(r"^LimitNOFILE=(\d+)$", UNIT.read_text(encoding="utf-8"), re.M)
    assert limit, "no LimitNOFILE= in the unit"
    budget = fd_budget(Config(), lambda which: (1024, 1024), lambda which, limits: None)
    assert int(limit.group(1)) >= budget.need


@pytest_twisted.ensureDeferred
async def test_at_the_cap_fitted_to_the_open_file_limit_every_client_gets_an_answer():
    """A proxy whose hard open-file limit (500) fits a few dozen client connections; 200 more clients connect, then send.

    The cap is the one ``fit_fd_limit`` derives, in a process that really
    has only those descriptors: each client is served or gets a 503 with
    Retry-After (the listener pauses accepting while 64 are being
    refused), none a bare close (with 30,000 clients and a hard limit of
    20,000, 20,109 got one).
    """
    import os
    import subprocess
    import sys

    from twisted.internet import reactor

    from helpers import in_thread
    from rawhttp import RecordingBackend, connect_then_send, request_bytes

    backend = RecordingBackend()
    port = await backend.listen(reactor)
    nofile = 500
    cap = fd_budget(Config(), lambda which: (nofile, nofile), lambda which, limits: None).max_connections
    assert cap < 100
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1]), str(here.parent), str(here)]))
    child = subprocess.Popen(
        [sys.executable, str(here / "fdlimit_proxy.py"), str(nofile), f"http://127.0.0.1:{port}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        line = await in_thread(reactor, child.stdout.readline, timeout=60)
        ready = re.match(rb"ready proxy=(\d+) cap=(\d+)", line)
        assert ready, line
        assert int(ready.group(2)) == cap
        answers = await in_thread(
            reactor, connect_then_send, int(ready.group(1)), cap + 200, request_bytes(b"GET", b"/api/tags"), 30,
            timeout=90,
        )
        statuses = [answer.status for answer in answers]
        # A client served early leaves an idle kept-alive connection, which a later one may take.
        assert set(statuses) <= {200, 503} and statuses.count(200) >= cap, sorted(statuses)
        assert statuses.count(503) >= 100, sorted(statuses)
        assert all(answer.header(b"retry-after") == b"2" for answer in answers if answer.status == 503)
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
        await backend.stop()
