"""Every request's outcome is written once: its facts on one record, said by each path, closed in one place.

The property is checked at every moment a client may leave a request's life
(parked, released, its attempt running, its answer drained), on the proxy's
own site driven by a Clock; the pieces (:class:`RequestFacts`,
:meth:`Outcomes.close`, :data:`BACK_IN_LINE`) are checked alone.
"""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from helpers import config_with, declaring
from inmemory import Rig
from yieldproxy.lot.parking import Entry
from yieldproxy.observe.metrics import Metrics
from yieldproxy.proxy.back_in_line import BACK_IN_LINE, back_in_line
from yieldproxy.proxy.facts import HANDED_OVER, RequestFacts
from yieldproxy.proxy.outcome import Outcomes
from yieldproxy.upstream.attempt import RetryableFailure
from yieldproxy.upstream.verdict import Verdict

EMBED = {"model": "all-minilm", "input": ["kept"]}


def _total(rig: Rig, name: str) -> float:
    """Every sample of counter ``name`` (its ``_total`` series), whatever its labels."""
    return sum(
        sample.value
        for metric in rig.proxy.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name
    )


def line_class(line: dict) -> str:
    return line["class"]


def _steps(parked: bool) -> list:
    """The moments of one embedding request's life: each a step the clock takes (the sim answers after 1 s)."""
    waiting = [lambda rig: rig.run(0.1)] * 3 if parked else []
    release = [lambda rig: (rig.proxy.state.release("game"), rig.turn())] if parked else []
    return [*waiting, *release, *[lambda rig: rig.run(0.25)] * 6]


@pytest.mark.parametrize("parked", [True, False], ids=["parked", "sent at once"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "passthrough"])
def test_a_request_left_at_any_moment_of_its_life_is_counted_and_logged_once(parked, gated):
    config = config_with(upstream={"detect_outages": False})
    if not gated:
        config = declaring("/api/embed", config=config, cls="passthrough")
    seen = []
    for leave_at in range(len(_steps(parked)) + 1):
        rig = Rig(config, latency=1.0)
        if parked:
            rig.proxy.state.hold("game", reason="test")
        with capturedLogs() as events:
            d = rig.post("/api/embed", EMBED)
            d.addErrback(lambda failure: None)
            for at, step in enumerate(_steps(parked)):
                if at == leave_at:
                    d.cancel()
                step(rig)
            rig.run(5.0)  # whatever is left runs out
        lines = [e for e in events if e.get("log_namespace") == "yieldproxy.requestlog"]
        assert len(lines) == 1, (leave_at, lines)
        assert _total(rig, "yieldproxy_requests_total") == 1, leave_at
        assert _total(rig, "yieldproxy_replay_total") == (1 if parked and gated else 0), leave_at
        assert line_class(lines[0]) == ("batch" if gated else "passthrough")
        line = lines[0]
        if leave_at == len(_steps(parked)):
            assert (line["status"], line["outcome"]) == (200, "ok"), line
        else:
            assert line["outcome"] in ("abandoned", "ok"), line
            assert (line["status"] == 499) == (line["outcome"] == "abandoned"), line
        assert len(rig.proxy.lot) == 0
        seen.append((line["outcome"], line["attempts"]))
    # Left while parked (no attempt yet), while its one attempt ran, or once answered.
    outcomes = [outcome for outcome, _ in seen]
    assert outcomes == sorted(outcomes) and outcomes[0] == "abandoned" and outcomes[-1] == "ok", seen
    assert ("abandoned", 1) in seen and (("abandoned", 0) in seen) == (parked and gated), seen


def test_the_proxy_hangs_its_facts_on_a_request_as_one_record_of_its_own():
    """Not attributes of its own on Twisted's Request, set from several modules."""
    rig = Rig(config_with(upstream={"detect_outages": False}))
    requests = []
    handle = rig.proxy.proxy_app._handle
    rig.proxy.proxy_app._entry._handle = lambda request: requests.append(request) or handle(request)
    assert rig.result(rig.post("/api/embed", EMBED)).code == 200
    (request,) = requests
    assert isinstance(request.facts, RequestFacts)
    assert {"started_at", "served_by", "translated_by"} & set(vars(request)) == set()
    assert (request.facts.cls, request.facts.status, request.facts.outcome) == ("batch", 200, "ok")
    assert request.facts.written


def _outcomes() -> tuple[Outcomes, Metrics, Clock]:
    clock, metrics = Clock(), Metrics()

    class Scheduler:
        def retry_after(self) -> int:
            return 7

    return Outcomes(clock, metrics, Scheduler()), metrics, clock  # type: ignore[arg-type]


class _Request:
    path = b"/api/embed"
    method = b"POST"
    sentLength = 0

    def getClientAddress(self):
        return None


def test_an_outcome_is_written_once_however_often_it_is_closed():
    outcomes, metrics, _ = _outcomes()
    facts = RequestFacts(0.0, cls="batch", entry=Entry(cls="batch", was_parked=True))
    with capturedLogs() as events:
        outcomes.close(_Request(), facts)  # nothing said (a bug): the error handler answers, not this
        facts.say(200, "ok", 1)
        facts.gone()  # said already: a client leaving afterwards changes nothing
        for _ in range(3):
            outcomes.close(_Request(), facts)
    assert [(e["status"], e["outcome"]) for e in events] == [(200, "ok")]
    assert metrics.registry.get_sample_value("yieldproxy_requests_total", {"class": "batch", "code": "200"}) == 1
    assert metrics.registry.get_sample_value("yieldproxy_replay_total", {"class": "batch", "outcome": "ok"}) == 1


def test_a_client_gone_with_nothing_said_is_abandoned_and_a_handed_over_request_is_not_written_here():
    outcomes, metrics, _ = _outcomes()
    gone = RequestFacts(0.0, cls="batch", attempts=2, entry=Entry(cls="batch", was_parked=True))
    handed = RequestFacts(0.0, cls="batch", outcome=HANDED_OVER)
    slow = RequestFacts(0.0, cls="batch", entry=Entry(cls="batch", was_parked=True))
    slow.say(None, "slow_client", 1, replay="abandoned")
    with capturedLogs() as events:
        for facts in (gone, handed, slow):
            facts.gone()
            outcomes.close(_Request(), facts)
    assert [(e["status"], e["outcome"], e["attempts"]) for e in events] == [(499, "abandoned", 2), (499, "slow_client", 1)]
    assert metrics.registry.get_sample_value("yieldproxy_replay_total", {"class": "batch", "outcome": "abandoned"}) == 2
    assert not handed.written


class _Health:
    def __init__(self):
        self.told: list = []

    def not_ready(self, detail, call):
        self.told.append(("not_ready", detail, call))


class _Member:
    name = "m"

    def __init__(self):
        self.health = _Health()
        self.refusals = 0

    def refused(self):
        self.refusals += 1


#: What each "back in line" verdict counts and tells, as the handler's six branches did:
#: (upstream_failures, forgiven_attempts, retries, told the member).
_ROWS = {
    Verdict.STANDBY: (0, 0, 0, None),
    Verdict.NOT_READY: (1, 0, 1, "not_ready"),
    Verdict.HELD: (1, 1, 1, None),
    Verdict.ELSEWHERE: (0, 0, 1, None),
    Verdict.PASS_OVER: (0, 0, 1, "refused"),
    Verdict.FORGIVEN: (0, 1, 1, None),
}


@pytest.mark.parametrize("decided", list(_ROWS), ids=lambda v: v.name)
def test_each_back_in_line_verdict_forgives_the_attempt_and_counts_what_its_row_says(decided):
    assert set(BACK_IN_LINE) == set(_ROWS)
    metrics, member = Metrics(), _Member()
    entry = Entry(cls="batch", attempts=1)
    failure = RetryableFailure("busy", "it said busy")
    with capturedLogs() as events:
        back_in_line(BACK_IN_LINE[decided], metrics, entry, member, failure, lambda: "the call")  # type: ignore[arg-type]
    failures, forgiven, retries, told = _ROWS[decided]
    sample = metrics.registry.get_sample_value
    assert (sample("yieldproxy_upstream_failures_total", {"class": "batch", "reason": "busy"}) or 0) == failures
    assert (sample("yieldproxy_forgiven_attempts_total", {"class": "batch"}) or 0) == forgiven
    assert (sample("yieldproxy_retries_total", {"class": "batch"}) or 0) == retries
    assert (entry.attempts, entry.forgiven, entry.failed_on) == (1, 1, "m")
    assert member.health.told == ([("not_ready", "it said busy", "the call")] if told == "not_ready" else [])
    assert member.refusals == (1 if told == "refused" else 0)
    texts = [e["log_format"].format(**e) for e in events]
    assert (texts == []) == (decided in (Verdict.STANDBY, Verdict.PASS_OVER))
    assert all(t.endswith("not counted: it said busy") for t in texts)
