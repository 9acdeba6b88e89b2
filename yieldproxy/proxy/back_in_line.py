"""Back in line, not counted: the verdicts after which a failed attempt returns to its place in the lot.

Six verdicts mean the same move for six reasons (docs/architecture.md, "The verdict on a failed
attempt"); :data:`BACK_IN_LINE` says, for each, what is counted, logged and told the member, and
:func:`back_in_line` does it.
"""

from __future__ import annotations

from typing import Callable

import attrs
from twisted.logger import Logger

from ..lot.parking import Entry
from ..observe.metrics import Metrics
from ..servers import ModelCall
from ..upstream.attempt import RetryableFailure
from ..upstream.pool.member import Member
from ..upstream.verdict import Verdict

log = Logger()

#: The log line of an attempt on a member passed over; ``{what}`` is the reason's own words.
_PASSED_OVER = "{cls} attempt on upstream {name} {what}, not counted: {detail}"
#: The log line of an attempt forgiven in an outage the judge recognised.
_IN_AN_OUTAGE = "{cls} attempt failed ({reason}) in a recognised outage, not counted: {detail}"


@attrs.frozen
class Reason:
    """Why a failed attempt goes back in line, and what that counts, logs and tells its member."""

    #: Counted in ``upstream_failures_total`` under the failure's reason.
    failure: bool = False
    #: Counted in ``forgiven_attempts_total``.
    forgiven: bool = False
    #: Counted in ``retries_total`` (the standby's failures are never shown, not even as a retry).
    retry: bool = True
    #: The log line (``{cls}``, ``{name}``, ``{reason}``, ``{detail}``, ``{what}``), or None: none.
    words: str | None = None
    #: ``{what}``: the reason's own words (``{reason}`` in them is the failure's).
    what: str = ""
    #: The member is told: ``not_ready`` (its health probes it), ``refused`` (checked again on its own), or None.
    tell: str | None = None


#: Verdict -> why it goes back in line.  Any other verdict counts the attempt, answers, or retries counted.
BACK_IN_LINE: dict[Verdict, Reason] = {
    # The fallback's errors are never shown; it is not given the request again (Scheduler.may_take, schedule/scheduler.py).
    Verdict.STANDBY: Reason(retry=False),
    Verdict.NOT_READY: Reason(failure=True, words=_PASSED_OVER, what="found it not ready", tell="not_ready"),
    Verdict.HELD: Reason(failure=True, forgiven=True, words=_PASSED_OVER, what="failed ({reason}) while it is held"),
    Verdict.ELSEWHERE: Reason(words=_PASSED_OVER, what="found it busy, trying another"),
    # Never reached since start, but the pool has others that may serve it.
    Verdict.PASS_OVER: Reason(tell="refused"),
    Verdict.FORGIVEN: Reason(forgiven=True, words=_IN_AN_OUTAGE),
}


def back_in_line(
    reason: Reason, metrics: Metrics, entry: Entry, member: Member, failure: RetryableFailure,
    call: Callable[[], ModelCall | None],
) -> None:
    """The failed attempt goes back to its place in the lot for ``reason``, not counted: ``call`` is what
    failed, for a member told it is not ready (its probe tests the same call)."""
    cls = entry.cls
    if reason.failure:
        metrics.upstream_failures_total.labels(cls, failure.reason).inc()
    if reason.tell == "not_ready":
        member.health.not_ready(failure.detail, call())
    elif reason.tell == "refused":
        member.refused()
    entry.failed_on = member.name
    entry.forgiven += 1
    if reason.forgiven:
        metrics.forgiven_attempts_total.labels(cls).inc()
    if reason.retry:
        metrics.retries_total.labels(cls).inc()
    if reason.words is not None:
        log.info(
            reason.words, cls=cls, name=member.name, reason=failure.reason, detail=failure.detail,
            what=reason.what.format(reason=failure.reason),
        )
