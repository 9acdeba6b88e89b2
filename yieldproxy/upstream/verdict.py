"""Why an attempt failed, and what becomes of its request: the one verdict on a failed attempt.

Pure: no I/O, no clock, no logging, nothing kept.  The proxy app's attempt loop
(proxy/attempts.py) gathers the :class:`Facts`, asks :func:`verdict` and does what it
says; the replayer's pace follows :func:`slows_replay`.  The outage probe is the outage
watcher's: the verdict only says when to ask it (:attr:`Verdict.ASK_JUDGE`).  Each
:class:`Reason` is the metric label it names, spelt here once.  The verdict's rows, in
their order: docs/architecture.md, "The verdict on a failed attempt".
"""

from __future__ import annotations

import enum

import attrs

from ..servers.base import BUSY, CALLER, GPU, NOT_READY


class Reason(enum.StrEnum):
    """Why an attempt failed (a metric label: the value is the word)."""

    #: The upstream refused the connection.
    REFUSED = "refused"
    #: Any other failure to connect (no route, a name not found, the connect timeout).
    CONNECT = "connect"
    #: The connection ended after the request was written, before the whole answer.
    RESET = "reset"
    #: No first byte of the answer's body within the attempt timeout.
    TIMEOUT = "timeout"
    #: The upstream began its answer, then sent nothing for ``upstream.stall_timeout_seconds``.
    STALL = "stall"
    #: The answer was cut after part of it reached the client (never retried).
    BROKEN = "broken"
    #: A 502 or a 503 not in its server's busy words.
    STATUS_502 = "status_502"
    STATUS_503 = "status_503"
    #: Its server's own words for a GPU (or backend) failure.
    GPU_ERROR = "gpu_error"
    #: Its server's own words for "too loaded now" (a 429, or a 503).
    BUSY = "busy"
    #: A 5xx in words no list has.
    UNKNOWN_ERROR = "unknown_error"
    #: A 5xx whose words its server blames on the caller's input.
    CALLER_ERROR = "caller_error"
    #: An answer that could not be read (bad framing; a translated answer that is not the vectors asked).
    BAD_ANSWER = "bad_answer"


#: 5xx answers whose words do not, alone, make a failure of the upstream: ``unknown_error`` (the
#: outage judge decides; the caller gets the answer when it passes) and ``caller_error`` (relayed at
#: once).  Both go back to the lot only while a hold covers the upstream; they neither slow the
#: replay down nor count as an attempt's outcome until judged.
MAYBE_THE_CALLERS = frozenset({Reason.UNKNOWN_ERROR, Reason.CALLER_ERROR})
#: Failures that may mean "the upstream (or its GPU) is down": the outage watcher probes them.  A
#: timeout or a stall too: a wedged runner fails every call that way, while a request that is merely
#: slow sees the probe pass and counts its attempt.
OUTAGE_REASONS = frozenset({
    Reason.REFUSED, Reason.CONNECT, Reason.RESET, Reason.TIMEOUT, Reason.STALL,
    Reason.GPU_ERROR, Reason.STATUS_503, Reason.UNKNOWN_ERROR,
})
#: Failures that say nothing about any model: the connection itself failed.
CONNECTION_REASONS = frozenset({Reason.REFUSED, Reason.CONNECT, Reason.RESET})
#: Failures of a member that was never reached: before it ever answered, a configuration error.
NOT_CONNECTED = frozenset({Reason.REFUSED, Reason.CONNECT})
#: Failures the caller hears as a gateway timeout (504); any other is a bad gateway (502).
TIMED_OUT = frozenset({Reason.TIMEOUT, Reason.STALL})
#: Counted answers that could not be read a request may get before it gives up: each try runs the
#: model again, and waiting explains no unreadable answer.
MAX_UNREADABLE = 1

_STATUS = {502: Reason.STATUS_502, 503: Reason.STATUS_503}


def status_reason(code: int) -> str:
    """The reason of an error status failed on as such: ``status_502``, ``status_503``, ``status_<code>``."""
    return _STATUS.get(code) or f"status_{code}"


def judged_reason(code: int, words: str) -> str | None:
    """The reason an error answer fails for, from its status and what its server read in it
    (:data:`~yieldproxy.servers.base.JUDGEMENTS`); None: it is the caller's, relayed as it is.

    Busy words (a 429 or a 503) are ``busy``; any other 502/503 ``status_502``/``status_503``;
    the server's GPU words ``gpu_error``; any other 5xx ``caller_error`` when its server blames the
    caller, else ``unknown_error``.  A 4xx in neither busy nor GPU words is the caller's.
    """
    if words == BUSY:
        return Reason.BUSY
    if code == 502 or code == 503:
        return _STATUS[code]
    if words == GPU:
        return Reason.GPU_ERROR
    if code >= 500:
        return Reason.CALLER_ERROR if words == CALLER else Reason.UNKNOWN_ERROR
    return None


def slows_replay(reason: str) -> bool:
    """Whether a failure slows its member's drainer down (its backoff): an answer that may yet be the
    caller's does not."""
    return reason not in MAYBE_THE_CALLERS


def judged_later(reason: str, standby: bool) -> bool:
    """Whether an attempt's outcome is counted once the verdict is known (``ok`` when relayed), not as
    it ends: a 5xx that may yet be the caller's, on a member whose errors are shown."""
    return reason in MAYBE_THE_CALLERS and not standby


def gateway_status(reason: str) -> int:
    """The proxy's own status for a request that gives up on ``reason``: 504 after a timeout or a stall, else 502."""
    return 504 if reason in TIMED_OUT else 502


class Verdict(enum.Enum):
    """What becomes of a request whose attempt failed before anything reached its client."""

    #: The ``[fallback]`` member's errors are never shown: back in line, not counted, not given to it again.
    STANDBY = "standby"
    #: Its server is still loading its model: the member is not ready; back in line, not counted.
    NOT_READY = "not_ready"
    #: A hold covers the member and explains the failure: back in line, not counted.
    HELD = "held"
    #: Busy: ask the pool whether another member may take it now, then decide again.
    ASK_POOL = "ask_pool"
    #: Busy, and another member may take it now: back in line, not counted; that one takes it first.
    ELSEWHERE = "elsewhere"
    #: The upstream's answer is the caller's: relay it as it came.
    RELAY = "relay"
    #: Ask the outage judge (its health's ``report``: a probe may run), then decide again.
    ASK_JUDGE = "ask_judge"
    #: Never answered since the start, and another member may serve it: passed over, not counted.
    PASS_OVER = "pass_over"
    #: Never answered since the start, and no other member may: a 502 at once (the attempt counts).
    UNREACHABLE = "unreachable"
    #: A recognised outage explains it: back in line behind the hold, not counted.
    FORGIVEN = "forgiven"
    #: The attempt counts; the request goes back in line for another.
    RETRY = "retry"
    #: The attempt counts and was the last: a 502 or a 504 (:func:`gateway_status`) naming why.
    GIVE_UP = "give_up"
    #: The attempt counts and was the last: the server's own answer (its GPU words) is relayed.
    GIVE_UP_RELAY = "give_up_relay"


#: The verdicts after which the attempt counts against ``upstream.max_attempts``.
COUNTED = frozenset({Verdict.RETRY, Verdict.GIVE_UP, Verdict.GIVE_UP_RELAY, Verdict.UNREACHABLE})


@attrs.frozen
class Facts:
    """What the verdict on one failed attempt rests on, each fact as its owner tells it.

    Built once per failed attempt (never on the way of an answer that succeeds), and again with
    what an ``ASK_*`` verdict asked for (``attrs.evolve``).
    """

    #: Why the attempt failed (a :class:`Reason`, or ``status_<code>``).
    reason: str
    #: What its server read in its answer (``Server.judge``); None when it gave no answer.
    words: str | None = None
    #: The answer's status; None when it gave no answer.
    code: int | None = None
    #: The member's errors are never shown (the ``[fallback]``'s standby member).
    standby: bool = False
    #: A hold covers the member (``YieldState``; read again once the judge has answered).
    held: bool = False
    #: Another eligible member that has not answered it busy may take it now (the pool);
    #: None: not asked yet.
    elsewhere: bool | None = None
    #: The outage judge's answer: True when a recognised outage explains the failure;
    #: None: not asked yet.
    outage: bool | None = None
    #: The member has answered since the proxy started (its ``UpstreamHealth``).
    reachable: bool = True
    #: Another eligible member is not passed over as unreachable (the pool).
    others_reachable: bool = False
    #: Attempts of the request counted so far, and answers it got that could not be read (this one not included).
    attempts: int = 0
    unreadable: int = 0
    #: ``upstream.max_attempts``.
    max_attempts: int = 5
    #: Its wait bound is spent (its class's hold bound, or its caller's X-Yield-Max-Wait: the outage
    #: verdict was not waited for past it).
    out_of_time: bool = False


def reported(facts: Facts) -> str:
    """The reason the judge hears and the failure counts as: a busy 503 that no other member takes
    is judged as any 503."""
    if facts.reason == Reason.BUSY and facts.code == 503:
        return Reason.STATUS_503
    return facts.reason


def verdict(facts: Facts) -> Verdict:
    """What becomes of the request (docs/architecture.md's table, in its order)."""
    if facts.standby:
        return Verdict.STANDBY
    if facts.outage is None:
        return _before_the_judge(facts)
    return _after_the_judge(facts)


def _before_the_judge(facts: Facts) -> Verdict:
    if facts.words == NOT_READY:
        return Verdict.NOT_READY
    if facts.held:
        return Verdict.HELD
    reason = facts.reason
    if reason == Reason.BUSY:
        if facts.elsewhere is None:
            return Verdict.ASK_POOL
        if facts.elsewhere:
            return Verdict.ELSEWHERE
        if facts.code != 503:
            return Verdict.RELAY
        return Verdict.ASK_JUDGE
    if reason == Reason.CALLER_ERROR:
        return Verdict.RELAY
    return Verdict.ASK_JUDGE


def _after_the_judge(facts: Facts) -> Verdict:
    outage = facts.outage
    reason = facts.reason
    if not outage and facts.held:
        return Verdict.HELD
    if not outage and reason == Reason.UNKNOWN_ERROR:
        return Verdict.RELAY
    if reason in NOT_CONNECTED and not facts.reachable:
        return Verdict.PASS_OVER if facts.others_reachable else Verdict.UNREACHABLE
    if outage:
        return Verdict.FORGIVEN
    unreadable = facts.unreadable + (reason == Reason.BAD_ANSWER)
    if facts.attempts + 1 < facts.max_attempts and unreadable <= MAX_UNREADABLE and not facts.out_of_time:
        return Verdict.RETRY
    if reason == Reason.GPU_ERROR and facts.code is not None:
        return Verdict.GIVE_UP_RELAY
    return Verdict.GIVE_UP
