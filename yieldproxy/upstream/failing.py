"""The models judged failing *alone* on one upstream: what ``/status``, the log and a caller's error say.

A model call that fails while the upstream serves other models is that
model's trouble, not an outage (docs/watchers.md, "What an outage rests on").
The outage watcher judges so and notes it here, with the evidence it judged
on; a 2xx answer for the model ends the note.  Nothing here decides anything.
Bounded: :data:`MAX_FAILING` models per upstream (the one judged least
recently goes first), and a model not judged for :data:`SHOWN_SECONDS` is
dropped.  Not persisted: a restart judges again.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import attrs

from ..clock import same
from ..names import canonical_model
from ..servers.base import ModelCall

#: Models noted per upstream, at most.
MAX_FAILING = 32
#: A model whose last failure judged alone is older than this is no longer shown.
SHOWN_SECONDS = 600.0


@attrs.define(eq=False)
class FailingModel:
    """One model judged failing alone: since when, how often, why, and on what evidence."""

    #: Its canonical name (names.canonical_model), and the name it was last asked for.
    model: str
    name: str
    #: The route its last failed call was on.
    path: str
    #: The first failure judged alone since it was last served, and the latest.
    since: float
    last: float
    #: The latest failure's reason (timeout, stall, gpu_error, unknown_error, ...).
    reason: str
    #: Why it was judged alone (a known-good model's probe passed; no model known to probe with).
    evidence: str
    failures: int = 1

    def as_json(self, shown: Callable[[float], float] = same) -> dict[str, Any]:
        """For ``/status``: its times given to ``shown`` (the wall clock people read: clock.py)."""
        return {
            "model": self.model, "name": self.name, "path": self.path, "since": shown(self.since),
            "last": shown(self.last),
            "reason": self.reason, "evidence": self.evidence, "failures": self.failures,
        }


@attrs.define(eq=False)
class FailingModels:
    """The models of one upstream judged failing alone, the one judged most recently last."""

    _entries: collections.OrderedDict[str, FailingModel] = attrs.field(init=False, factory=collections.OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def judged_alone(self, call: ModelCall, reason: str, evidence: str, now: float) -> FailingModel:
        """A failure of ``call`` was judged its own (no outage): note it."""
        key = canonical_model(call.model)
        entry = self._entries.get(key)
        if entry is None:
            while len(self._entries) >= MAX_FAILING:
                self._entries.popitem(last=False)
            entry = self._entries[key] = FailingModel(key, call.model, call.path, now, now, reason, evidence, 0)
        entry.name, entry.path, entry.last, entry.reason, entry.evidence = call.model, call.path, now, reason, evidence
        entry.failures += 1
        self._entries.move_to_end(key)
        return entry

    def served(self, model: str) -> None:
        """The model was answered 2xx: it fails no more."""
        self._entries.pop(canonical_model(model), None)

    def get(self, model: str, now: float) -> FailingModel | None:
        """The note on ``model`` (any spelling), or None (none, or too old)."""
        entry = self._entries.get(canonical_model(model))
        if entry is None or now - entry.last > SHOWN_SECONDS:
            return None
        return entry

    def others(self, model: str | None, now: float, within: float) -> list[FailingModel]:
        """The models other than ``model`` judged failing within the last ``within`` seconds."""
        skip = canonical_model(model) if model is not None else None
        return [e for e in self._entries.values() if e.model != skip and now - e.last <= within]

    def as_json(self, now: float, shown: Callable[[float], float] = same) -> list[dict[str, Any]]:
        """What ``/status`` shows: the models judged failing in the last :data:`SHOWN_SECONDS`, latest first
        (their times given to ``shown``)."""
        for key in [k for k, e in self._entries.items() if now - e.last > SHOWN_SECONDS]:
            del self._entries[key]
        return [e.as_json(shown) for e in reversed(self._entries.values())]
