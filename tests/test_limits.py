"""The open-file budget at start (issue 10, finding 6), with getrlimit/setrlimit injected."""

from __future__ import annotations

import re
import resource
from pathlib import Path

from twisted.logger import formatEvent, globalLogPublisher

from helpers import config_with
from yieldproxy.config import Config, proxy_max_connections
from yieldproxy.limits import RESERVE, fd_budget, fit_fd_limit

NOFILE = resource.RLIMIT_NOFILE
INFINITY = resource.RLIM_INFINITY
UNIT = Path(__file__).resolve().parent.parent / "etc" / "systemd" / "yieldproxy.service"


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


def test_a_hard_limit_too_low_lowers_the_cap_and_says_so():
    limits = Limits(1024, 4096)
    budget = fd_budget(Config(), limits.getrlimit, limits.setrlimit)
    assert limits.soft == 4096
    others = 64 + 64 + RESERVE
    assert budget.max_connections == (4096 - others) // 2
    # What fits: every client connection with its upstream connection, and the rest.
    assert 2 * budget.max_connections + others <= 4096
    first, second = budget.warnings
    assert "open-file limit is 4096" in first and "LimitNOFILE=" in first
    assert f"taking at most {budget.max_connections} client connections" in first
    assert "parking.max_parked (10000)" in second


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


def test_the_systemd_unit_gives_the_default_config_enough_descriptors():
    limit = re.search(r"^LimitNOFILE=(\d+)$", UNIT.read_text(encoding="utf-8"), re.M)
    assert limit, "no LimitNOFILE= in the unit"
    budget = fd_budget(Config(), lambda which: (1024, 1024), lambda which, limits: None)
    assert int(limit.group(1)) >= budget.need
