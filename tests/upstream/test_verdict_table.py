"""The verdict on a failed attempt, as a table (yieldproxy/upstream/verdict.py): every row is facts -> verdict, and why.

Pure: no clock, no rig.  The behaviour each verdict stands for is checked end to end where it
happens (test_proxy_app, test_pool_busy, test_pool_not_ready, test_outage, test_verdict,
test_matrix); here the decision itself, row by row, and the names it is made with.
"""

from __future__ import annotations

import ast
import pathlib
import re

import attrs
import pytest

from yieldproxy.servers.base import BUSY, CALLER, GPU, NOT_READY, OK, UPSTREAM
from yieldproxy.upstream.verdict import (
    CONNECTION_REASONS,
    COUNTED,
    MAYBE_THE_CALLERS,
    OUTAGE_REASONS,
    Facts,
    Reason,
    Verdict,
    gateway_status,
    judged_later,
    judged_reason,
    reported,
    slows_replay,
    status_reason,
    verdict,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
R, V = Reason, Verdict


def answered(reason: str, code: int, words: str, **facts) -> Facts:
    return Facts(reason, words, code, **facts)


def judged(facts: Facts, outage: bool, **more) -> Facts:
    """The same facts once the outage judge has answered."""
    return attrs.evolve(facts, outage=outage, **more)


#: (why, facts, verdict): the module docstring's table, in its order.
ROWS = [
    # 1. The legacy fallback's errors are never shown.
    ("the fallback's failure goes back in line, whatever it was", Facts(R.GPU_ERROR, GPU, 500, standby=True), V.STANDBY),
    ("even while held", Facts(R.REFUSED, standby=True, held=True), V.STANDBY),
    ("even its 'loading' answer", answered(R.STATUS_503, 503, NOT_READY, standby=True), V.STANDBY),
    # 2a. Not ready.
    ("a 503 its server reads as loading: the member is not ready", answered(R.STATUS_503, 503, NOT_READY), V.NOT_READY),
    ("not ready comes before a hold", answered(R.STATUS_503, 503, NOT_READY, held=True), V.NOT_READY),
    # 2b. Held.
    ("a hold explains a GPU failure", answered(R.GPU_ERROR, 500, GPU, held=True), V.HELD),
    ("a hold explains a refused connection", Facts(R.REFUSED, held=True, reachable=False), V.HELD),
    ("a hold explains words that blame the caller", answered(R.CALLER_ERROR, 500, CALLER, held=True), V.HELD),
    ("a hold explains a busy answer", answered(R.BUSY, 503, BUSY, held=True), V.HELD),
    ("a hold explains a timeout", Facts(R.TIMEOUT, held=True), V.HELD),
    # 2c. Busy.
    ("busy: first ask the pool for another member", answered(R.BUSY, 429, BUSY), V.ASK_POOL),
    ("busy, another member may take it now", answered(R.BUSY, 503, BUSY, elsewhere=True), V.ELSEWHERE),
    ("busy 429, no other member: relayed with its Retry-After", answered(R.BUSY, 429, BUSY, elsewhere=False), V.RELAY),
    ("busy 503, no other member: judged as any 503", answered(R.BUSY, 503, BUSY, elsewhere=False), V.ASK_JUDGE),
    # 2d, 2e.
    ("words that blame the caller: relayed at once", answered(R.CALLER_ERROR, 500, CALLER), V.RELAY),
    ("words no list has: the judge decides", answered(R.UNKNOWN_ERROR, 500, UPSTREAM), V.ASK_JUDGE),
    ("GPU words: the judge decides", answered(R.GPU_ERROR, 500, GPU), V.ASK_JUDGE),
    ("a plain 503: the judge decides", answered(R.STATUS_503, 503, UPSTREAM), V.ASK_JUDGE),
    ("a refused connection: the judge decides", Facts(R.REFUSED, reachable=False), V.ASK_JUDGE),
    ("a timeout: the judge decides", Facts(R.TIMEOUT), V.ASK_JUDGE),
    ("an unreadable answer: the judge decides", Facts(R.BAD_ANSWER), V.ASK_JUDGE),
    # 3a. A hold that came while the judge decided.
    ("no outage, but a hold came meanwhile", judged(Facts(R.TIMEOUT), False, held=True), V.HELD),
    ("an outage and a hold: forgiven, not held back", judged(Facts(R.TIMEOUT), True, held=True), V.FORGIVEN),
    # 3b.
    ("words no list has, the probe passed: the caller's answer", judged(answered(R.UNKNOWN_ERROR, 500, UPSTREAM), False), V.RELAY),
    ("words no list has, the probe failed: an outage", judged(answered(R.UNKNOWN_ERROR, 500, UPSTREAM), True), V.FORGIVEN),
    # 3c. Never answered since the start.
    ("refused, never answered, another member may serve: passed over", judged(Facts(R.REFUSED, reachable=False, others_reachable=True), False), V.PASS_OVER),
    ("could not connect, never answered, none other: 502 at once", judged(Facts(R.CONNECT, reachable=False), False), V.UNREACHABLE),
    ("never answered comes before a forgiving judge", judged(Facts(R.REFUSED, reachable=False), True), V.UNREACHABLE),
    ("refused by a member that answered before: counted", judged(Facts(R.REFUSED), False), V.RETRY),
    ("a reset is no configuration error", judged(Facts(R.RESET, reachable=False), False), V.RETRY),
    # 3d, 3e.
    ("an outage explains it", judged(answered(R.GPU_ERROR, 500, GPU), True), V.FORGIVEN),
    ("the request failed alone: counted, retried", judged(answered(R.GPU_ERROR, 500, GPU), False), V.RETRY),
    ("its last attempt, in GPU words: the server's own answer", judged(answered(R.GPU_ERROR, 500, GPU, attempts=4), False), V.GIVE_UP_RELAY),
    ("its last attempt, a timeout: gives up", judged(Facts(R.TIMEOUT, attempts=4), False), V.GIVE_UP),
    ("its last attempt, a plain 503: gives up", judged(answered(R.STATUS_503, 503, UPSTREAM, attempts=4), False), V.GIVE_UP),
    ("one attempt allowed: gives up at once", judged(Facts(R.STALL, max_attempts=1), False), V.GIVE_UP),
    ("a first unreadable answer: retried", judged(Facts(R.BAD_ANSWER), False), V.RETRY),
    ("a second unreadable answer: gives up", judged(Facts(R.BAD_ANSWER, attempts=1, unreadable=1), False), V.GIVE_UP),
    ("an unreadable answer before does not end a timeout's retries", judged(Facts(R.TIMEOUT, attempts=1, unreadable=1), False), V.RETRY),
    ("its wait bound spent: a timeout gives up", judged(Facts(R.TIMEOUT, out_of_time=True), False), V.GIVE_UP),
    ("its wait bound spent, in GPU words: the server's own answer", judged(answered(R.GPU_ERROR, 500, GPU, out_of_time=True), False), V.GIVE_UP_RELAY),
    ("its wait bound spent in an outage: back behind the hold (it expires there)", judged(Facts(R.TIMEOUT, out_of_time=True), True), V.FORGIVEN),
    ("its wait bound spent, a 5xx in unknown words: relayed", judged(answered(R.UNKNOWN_ERROR, 500, UPSTREAM, out_of_time=True), False), V.RELAY),
]


@pytest.mark.parametrize(("why", "facts", "expected"), ROWS, ids=[row[0] for row in ROWS])
def test_the_verdict_table(why, facts, expected):
    assert verdict(facts) is expected, why


def test_every_verdict_has_a_row():
    assert {row[2] for row in ROWS} == set(Verdict)


def test_the_counted_verdicts_are_those_that_use_up_an_attempt():
    assert COUNTED == {V.RETRY, V.GIVE_UP, V.GIVE_UP_RELAY, V.UNREACHABLE}


def test_a_busy_503_nobody_else_takes_is_judged_and_counted_as_a_503():
    busy = answered(R.BUSY, 503, BUSY, elsewhere=False)
    assert reported(busy) == R.STATUS_503
    assert reported(answered(R.BUSY, 429, BUSY)) == R.BUSY
    assert reported(Facts(R.TIMEOUT)) == R.TIMEOUT


#: (status, what its server read, the reason it fails for; None: the caller's, relayed).
JUDGED = [
    (429, BUSY, R.BUSY),
    (503, BUSY, R.BUSY),
    (503, UPSTREAM, R.STATUS_503),
    (503, NOT_READY, R.STATUS_503),
    (502, UPSTREAM, R.STATUS_502),
    (500, GPU, R.GPU_ERROR),
    (400, GPU, R.GPU_ERROR),
    (424, GPU, R.GPU_ERROR),
    (500, CALLER, R.CALLER_ERROR),
    (500, UPSTREAM, R.UNKNOWN_ERROR),
    (501, OK, R.UNKNOWN_ERROR),
    (404, CALLER, None),
    (400, UPSTREAM, None),
    (429, UPSTREAM, None),
]


@pytest.mark.parametrize(("code", "words", "reason"), JUDGED)
def test_the_reason_an_error_answer_fails_for(code, words, reason):
    assert judged_reason(code, words) == reason


def test_the_small_rules_beside_the_verdict():
    assert status_reason(502) is R.STATUS_502 and status_reason(503) is R.STATUS_503
    assert status_reason(404) == "status_404"  # the fallback's unshown errors, any code
    assert [gateway_status(r) for r in (R.TIMEOUT, R.STALL, R.REFUSED, R.GPU_ERROR, "status_404")] == [504, 504, 502, 502, 502]
    assert not slows_replay(R.UNKNOWN_ERROR) and not slows_replay(R.CALLER_ERROR)
    assert slows_replay(R.GPU_ERROR) and slows_replay(R.BUSY) and slows_replay("status_404")
    assert judged_later(R.UNKNOWN_ERROR, standby=False) and not judged_later(R.UNKNOWN_ERROR, standby=True)
    assert not judged_later(R.GPU_ERROR, standby=False)
    assert MAYBE_THE_CALLERS == {R.UNKNOWN_ERROR, R.CALLER_ERROR}
    assert CONNECTION_REASONS < OUTAGE_REASONS
    assert R.BUSY not in OUTAGE_REASONS and R.CALLER_ERROR not in OUTAGE_REASONS and R.BAD_ANSWER not in OUTAGE_REASONS


def test_each_reason_is_its_metric_label_as_docs_metrics_md_lists_it():
    """The reasons are part of the metrics API: each is the plain word, and docs/metrics.md names it."""
    documented = set(re.findall(r"`([a-z_0-9]+)`", (ROOT / "docs" / "metrics.md").read_text()))
    for reason in Reason:
        assert str(reason) == reason.value == f"{reason}" and reason == reason.value
        assert reason.value in documented, reason


def test_the_verdict_module_stays_pure():
    """No I/O, no clock, no logging: it imports only enum, attrs and the servers' vocabulary."""
    tree = ast.parse((ROOT / "yieldproxy" / "upstream" / "verdict.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported == {"__future__", "enum", "attrs", "..servers.base"}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"log", "Logger", "print", "open", "reactor"}
