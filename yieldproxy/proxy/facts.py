"""What the proxy knows of one request while it lives, and how it ended: one record, on ``request.facts``.

Each path of the handler only *says* how the request ended (:meth:`RequestFacts.say`);
:meth:`Outcomes.close <yieldproxy.proxy.outcome.Outcomes.close>` writes it once.
"""

from __future__ import annotations

import attrs

from ..lot.classify import PASSTHROUGH
from ..lot.parking import Entry

#: :attr:`RequestFacts.outcome` of a request taken by the process that replaces this one: it ends there.
HANDED_OVER = "handed_over"


@attrs.define(eq=False)
class RequestFacts:
    """One request's facts: set by the proxy app, read by its outcome writer and the succession's hand-over."""

    #: ``clock.seconds()`` when it arrived (an adopted request keeps its first arrival).
    started_at: float
    cls: str = PASSTHROUGH
    #: Its place in the lot, once it has one: its parked seconds, and its outcome counts as a replay.
    entry: Entry | None = None
    #: The pool member its last attempt went to, and the one that answered it translated.
    served_by: str | None = None
    translated_by: str | None = None
    #: Upstream attempts made so far: what the log says if the client leaves now.
    attempts: int = 0
    #: The status the client got; None: none (it left first).
    status: int | None = None
    #: How it ended (observe/requestlog.py's outcomes), None while nothing is said.
    outcome: str | None = None
    #: The ``replay_total`` outcome when it differs from :attr:`outcome` (a slow client counts ``abandoned``).
    replay: str | None = None
    #: True once its outcome is written: a request is counted and logged once.
    written: bool = False

    def say(self, status: int | None, outcome: str, attempts: int, replay: str | None = None) -> None:
        """How the request ended; written once, by whoever closes it."""
        self.status = status
        self.outcome = outcome
        self.attempts = attempts
        self.replay = replay

    def gone(self) -> None:
        """The client went away: ``abandoned``, unless how it ended was said already."""
        if self.outcome is None:
            self.say(None, "abandoned", self.attempts)
