"""What the proxy app asks of admission, named here until it names the scheduler itself.

Admission, the choice of member and release are the scheduler's (yieldproxy/schedule/scheduler.py,
whose ``Scheduler`` is what ``service.build`` passes as the proxy app's gate).
"""

from __future__ import annotations

from typing import Protocol

from twisted.internet.defer import Deferred

from .parking import Entry, Refused


class Gate(Protocol):
    """The proxy app's questions and news about admission."""

    @property
    def reject_status(self) -> int: ...
    def admit(self, entry: Entry) -> Deferred[Entry]: ...
    def finished(self, failed: bool = False, seconds: float | None = None, member: str | None = None) -> None: ...
    def explain(self, refusal: Refused, entry: Entry | None = None) -> Refused: ...
    def number_adopted(self, entry: Entry) -> None: ...
    def retry_after(self) -> int: ...
