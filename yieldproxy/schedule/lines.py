"""A line per pool member of the parked entries it is eligible for, so its drainer never walks the lot.

Each member's line is split by class, then by *kind of entry*: its routing (one shared value per
route, class and model) and the member its last attempt failed on.  Whether a member may take an
entry depends on nothing else (:meth:`~.scheduler.Scheduler.may_take`), so :meth:`Lines.heads` asks
about the first entry of each kind only: a long line of entries a member may not take costs one
question, and parking stays O(1) per request.
"""

from __future__ import annotations

import bisect
from typing import Callable

import attrs

from ..lot.parking import Entry, remove_from

#: The count (:meth:`Lines.waiting_for`) of parked entries only standby members are eligible for.
STANDBY_ONLY = "*standby-only*"

Kind = tuple[int, "str | None"]


def kind_of(entry: Entry) -> Kind:
    """An entry's kind: its routing by identity (every entry of a kind holds it, so it lives while its
    line does) and the member its last attempt failed on; neither changes while it is parked."""
    return (id(entry.routing), entry.failed_on)


@attrs.define(eq=False)
class Lines:
    """Per member, per class, per kind, the parked entries it is eligible for, in arrival order."""

    _lines: dict[str, dict[str, dict[Kind, list[Entry]]]] = attrs.Factory(dict)
    #: Parked entries each member is eligible for: "does anybody wait for me" in O(1).
    _waiting: dict[str, int] = attrs.Factory(dict)

    def add(self, entry: Entry) -> None:
        """``entry`` parked (the scheduler parked it)."""
        kind = kind_of(entry)
        for member in entry.eligible:
            bisect.insort(self._lines.setdefault(member, {}).setdefault(entry.cls, {}).setdefault(kind, []), entry)
        self._count(entry, +1)

    def remove(self, entry: Entry) -> None:
        """``entry`` left the lot, whichever way (the lot's ``when_out``)."""
        kind = kind_of(entry)
        for member in entry.eligible:
            kinds = self._lines[member][entry.cls]
            line = kinds[kind]
            remove_from(line, entry)
            if not line:
                del kinds[kind]
        self._count(entry, -1)

    def _count(self, entry: Entry, sign: int) -> None:
        waiting = self._waiting
        for member in entry.eligible:
            waiting[member] = waiting.get(member, 0) + sign
        if entry.routing is not None and entry.routing.standby_only:
            waiting[STANDBY_ONLY] = waiting.get(STANDBY_ONLY, 0) + sign

    def waiting_for(self, member: str) -> int:
        """Parked entries ``member`` is eligible for (available or not); with :data:`STANDBY_ONLY`,
        those only standby members are eligible for."""
        return self._waiting.get(member, 0)

    def heads(self, member: str, may_take: Callable[[Entry], bool]) -> dict[str, Entry]:
        """``member``'s first entry per class that ``may_take`` allows, asking it once per kind."""
        heads: dict[str, Entry] = {}
        for cls, kinds in self._lines.get(member, {}).items():
            best = None
            for line in kinds.values():
                first = line[0]
                if (best is None or first.seq < best.seq) and may_take(first):
                    best = first
            if best is not None:
                heads[cls] = best
        return heads

    def takeable(self, member: str, may_take: Callable[[Entry], bool]) -> int:
        """How many entries on ``member``'s line ``may_take`` allows now (for ``/status`` and a scrape)."""
        return sum(
            len(line) for kinds in self._lines.get(member, {}).values() for line in kinds.values() if may_take(line[0])
        )
