"""Which evidence judges a failed model call: the decision table of the outage verdict.

Pure: no I/O, no clock, no logging.  The outage watcher (watchers/outage.py) asks
:func:`evidence_for` what to probe when a call fails in a way an outage may explain, and
:func:`follow_ups` what to probe while the ``outage`` hold lasts.  An outage of the whole
upstream rests on evidence about its GPU, never on the one model a failing request named:
that model may be stuck, too big or broken, and a hold taken on its word could park
everyone for ever.  The verdict on a failed attempt (upstream/verdict.py) only says when to
ask.  The table, in its order: docs/watchers.md, "What an outage rests on".
"""

from __future__ import annotations

from typing import Sequence

import attrs

from ..names import canonical_model
from ..servers.base import ModelCall
from .verdict import CONNECTION_REASONS

#: Probe :attr:`Evidence.call` (None: the health path): a failure is an outage, a pass says the failure is the call's own.
PROBE = "probe"
#: Nothing is known about the GPU: the failure is the call's own, no probe.
ALONE = "alone"
#: The models probed in turn while an outage hold lasts, at most: every model of a full record
#: (upstream/served.py's ``MAX_MODELS``) and the confirming call.
MAX_FOLLOW_UPS = 65


@attrs.frozen
class Evidence:
    """What judges a failure: :data:`PROBE` a call (None: the health path), or :data:`ALONE`; and why, in words."""

    action: str
    call: ModelCall | None = None
    why: str = ""


def _same(a: ModelCall, model: str) -> bool:
    return canonical_model(a.model) == canonical_model(model)


def evidence_for(
    reason: str,
    call: ModelCall | None,
    *,
    operator: ModelCall | None = None,
    known: Sequence[ModelCall] = (),
    others_failing: Sequence[str] = (),
) -> Evidence:
    """What judges a failure of ``call`` for ``reason`` (the table: docs/watchers.md, "What an outage rests on").

    ``operator``: the operator's probe model's call, if one is named.
    ``known``: the calls of the models the upstream served, the most recently
    served first.  ``others_failing``: the names of other models judged
    failing lately on this upstream.
    """
    if call is None:
        return Evidence(PROBE, None, "the request named no model: the health path")
    if operator is not None:
        return Evidence(PROBE, operator, "the operator's probe model")
    others = [k for k in known if not _same(k, call.model)]
    if others:
        return Evidence(PROBE, others[0], "a model it served lately")
    own = next((k for k in known if _same(k, call.model)), None)
    if own is not None:
        return Evidence(PROBE, own, "the only model it is known to serve")
    if reason in CONNECTION_REASONS:
        return Evidence(PROBE, None, "the connection failed: the health path")
    if others_failing:
        return Evidence(PROBE, call, f"other models fail too ({', '.join(sorted(others_failing))})")
    return Evidence(ALONE, None, "no model is known to work on this upstream to probe with")


def follow_ups(
    confirmed: ModelCall | None,
    *,
    operator: ModelCall | None = None,
    known: Sequence[ModelCall] = (),
    failing: Sequence[ModelCall] = (),
) -> tuple[ModelCall | None, ...]:
    """The calls probed in turn while the outage hold ``confirmed``'s probe took lasts; the first that passes ends it.

    The operator's probe model alone when one is named; else the confirming
    call, then every other model the upstream served, the one of most
    standing first (or, when it served none, the other models that failed),
    at most :data:`MAX_FOLLOW_UPS`: an outage of the whole upstream means no
    model serves, so one that answers ends it, and no set of models that stay
    broken (a client's own copies, made to fail) can keep the hold while
    another the upstream served works.  An outage the health path confirmed
    is probed there.
    """
    if confirmed is None:
        return (None,)
    if operator is not None:
        return (operator,)
    calls: list[ModelCall] = [confirmed]
    for other in (known or failing):
        if len(calls) >= MAX_FOLLOW_UPS:
            break
        if not any(_same(c, other.model) for c in calls):
            calls.append(other)
    return tuple(calls)
