"""The scheduler's words for a refused caller: when to come back, and what kept a request waiting.

Pure: each function is given what it reads (the yield state, the members, the counts) and returns a
number or a sentence; the scheduler (:mod:`.scheduler`) decides when to say them.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from ..config import ClassConfig
from ..lot.parking import Entry, Refused
from ..lot.state import YieldState
from ..names import LOADING_SOURCE, OUTAGE_SOURCE
from ..upstream.pool.member import Member


def whole_seconds(seconds: float) -> int:
    """Retry-After is whole seconds, at least 1; rounding noise must not add one."""
    return max(1, math.ceil(seconds - 1e-6))


def retry_after(state: YieldState, now: float, parked: int, service_seconds: float, slots: int) -> int:
    """Seconds a refused caller should wait: the declared end of the yield when every hold gave one;
    else, while yielded, as long again as it has lasted (at most 300); else the ``parked`` requests
    ahead times the recent service time, spread over the replay ``slots``."""
    if state.yielded:
        end = state.expected_end()
        if end is not None:
            return whole_seconds(end - now)
        since = state.yielded_since if state.yielded_since is not None else now
        return min(300, whole_seconds(now - since))
    return whole_seconds(parked * service_seconds / slots)


def why_the_lot_waits(state: YieldState, members: Sequence[Member], release_held: bool, slots: int) -> str:
    """What keeps the lot waiting right now (one upstream: the GPU, the upstream, the slots)."""
    if state.yielded:
        sources = sorted({hold.source for hold in state.holds})
        if sources == [OUTAGE_SOURCE]:
            return "the upstream was failing and had not recovered in time (outage detected by the proxy)"
        if sources == [LOADING_SOURCE]:
            return "the upstream was still loading its model past upstream.not_ready_max_seconds"
        return f"the GPU was still yielded (held by {', '.join(sources)})"
    loading = [m.name for m in members if m.not_ready]
    if loading:
        return f"the upstream was still loading its model (not ready: {', '.join(loading)})"
    if release_held:
        return "the GPU was back, but the models were still being loaded back onto it"
    return f"the GPU was back, but the requests ahead of this one still held all {slots} replay slots"


def why_no_member(
    state: YieldState, members: Mapping[str, Member], entry: Entry, twin_ok: Callable[[Member, Entry], bool],
) -> str:
    """What kept each member ``entry`` may go to from taking it (in a pool: it may be far from yielded)."""
    reasons = []
    for name in entry.eligible:
        member = members[name]
        said = member.state_name()
        if said == "available" and not twin_ok(member, entry):
            said = f"not a verified twin for {entry.model}'s embeddings"
        elif said == "available":
            said = "busy with the requests ahead of this one"
        elif said == "not_ready":
            said = "still loading its model (not ready)"
        elif said in ("yielded", "outage"):
            sources = sorted({hold.source for hold in state.holds_for(name)})
            said = f"{said} (held by {', '.join(sources)})"
        reasons.append(f"{name} {said}")
    return "no upstream that may serve it was free: " + "; ".join(reasons)


def over_budget(entry: Entry, cls: ClassConfig, remaining: float, by_caller: bool, status: int) -> Refused:
    """The refusal of a request the declared yield outlasts: ``remaining`` seconds, past its bound."""
    if by_caller:
        why = (
            f"wait longer than your X-Yield-Max-Wait: the GPU is expected back in "
            f"{remaining:.0f}s, you allow {entry.max_wait:g}s"
        )
    else:
        why = (
            f"yielded past the hold bound: the GPU is expected back in {remaining:.0f}s, "
            f"{entry.cls} requests are held at most {cls.hold_seconds:g}s"
        )
    return Refused("over_budget", why, status, whole_seconds(remaining))
