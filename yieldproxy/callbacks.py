"""Calling back every listener of an event, whatever the others do (``call_each``)."""

from __future__ import annotations

from typing import Callable, Iterable

from twisted.logger import Logger


def call_each(log: Logger, what: str, listeners: Iterable[Callable[..., object]], *args) -> None:
    """Call each of ``listeners`` with ``args``, from a copy (one may subscribe or leave meanwhile); one
    that raises is logged on ``log`` as ``what`` failed (a plain text, no format fields), and the rest
    are still called."""
    for listener in list(listeners):
        try:
            listener(*args)
        except Exception:
            log.failure(what)
