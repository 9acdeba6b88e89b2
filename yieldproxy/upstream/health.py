"""What the proxy knows about one upstream's health, kept in one place (one per upstream).

* **reachable**: the upstream has answered since the proxy started.  Until
  then a refused connection is a configuration error (a wrong URL, a backend
  not started yet), answered 502 at once, not an outage worth waiting out.
* **the outage verdict** on a failed attempt, decided by its outage watcher
  while it runs (watchers/outage.py); without one, no failure is forgiven.
* **not ready**: its server says it is still loading its model
  (:meth:`UpstreamHealth.not_ready`); no outage, but the pool member stops
  taking requests until a model call is answered (:meth:`UpstreamHealth.served`).
* **what it serves**, and the models judged failing *alone*
  (:attr:`UpstreamHealth.record`, :attr:`UpstreamHealth.failing`).

The proxy app reports every attempt here (:meth:`UpstreamHealth.report`);
the outage watcher registers as the judge and as a listener while it runs.
"""

from __future__ import annotations

from typing import Callable

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from ..callbacks import call_each
from ..servers.base import ModelCall
from .failing import FailingModels
from .served import ServedRecord

log = Logger()

#: ``judge(reason, call)``: a Deferred firing True when an outage explains the failure.
Judge = Callable[[str, ModelCall | None], "Deferred[bool]"]


@attrs.define(eq=False)
class UpstreamHealth:
    """Reachability and outage verdicts of one upstream."""

    #: The upstream's URL, for log lines.
    url: str
    #: True once the upstream has answered since the proxy started.
    reachable: bool = False
    #: Decides the verdicts (its outage watcher's ``judge``, given by the composition root;
    #: None: no failure is forgiven).
    _judge: Judge | None = None
    _listeners: list[Callable[[str | None], None]] = attrs.Factory(list)
    _not_ready_listeners: list[Callable[[str, ModelCall | None], None]] = attrs.Factory(list)
    _served_listeners: list[Callable[[], None]] = attrs.Factory(list)
    _unanswered_listeners: list[Callable[[str], None]] = attrs.Factory(list)
    _model_listeners: list[Callable[[ModelCall, float | None], None]] = attrs.Factory(list)
    #: The models it answered 2xx (:meth:`served`), kept across restarts and reloads.
    record: ServedRecord = attrs.Factory(ServedRecord)
    #: The models judged failing alone (the outage watcher notes them; a 2xx ends each note).
    failing: FailingModels = attrs.Factory(FailingModels)

    def answered(self) -> None:
        """The upstream answered (a request or a probe): it is reachable from now on."""
        self.reachable = True

    def not_ready(self, why: str, call: ModelCall | None = None) -> None:
        """It answered, and its server says it is not ready yet (loading its model): tell who listens.

        ``call``: the model call that was answered so (None: its health path, or not known).
        """
        self.answered()
        call_each(log, "upstream not-ready listener failed", self._not_ready_listeners, why, call)

    def when_not_ready(self, listener: Callable[[str, ModelCall | None], None]) -> None:
        """Call ``listener(why, call)`` each time an answer reads as not ready (see :meth:`not_ready`)."""
        self._not_ready_listeners.append(listener)

    def served(self, call: ModelCall | None = None, began: float | None = None) -> None:
        """A model call (a request let out of the lot) was answered: :meth:`report` of a success, and
        whoever waits for its model to have loaded hears it (:meth:`when_served`).

        ``call``: the call it answered 2xx, kept in :attr:`record` (and its model fails no more); None
        for any other answer (an error relayed to its sender, a 404 for a model it lacks), which shows
        the upstream answers, not that the call works.  ``began``: when its attempt began (the proxy
        clock's ``seconds()``), for whoever weighs it as evidence of the GPU at that time; None: not known.
        """
        # What report(None) does, without the Deferred nobody reads: every answer comes here.
        self.reachable = True
        call_each(log, "upstream health listener failed", self._listeners, None)
        if call is not None:
            self.record.served(call)
            if self.failing:
                self.failing.served(call.model)
            call_each(log, "upstream model listener failed", self._model_listeners, call, began)
        call_each(log, "upstream served listener failed", self._served_listeners)

    def listen_models(self, listener: Callable[[ModelCall, float | None], None]) -> None:
        """Call ``listener(call, began)`` each time a model call is answered 2xx (:meth:`served`), until :meth:`forget_models`:
        the one evidence that disproves an outage of the whole upstream."""
        self._model_listeners.append(listener)

    def forget_models(self, listener: Callable[[ModelCall, float | None], None]) -> None:
        if listener in self._model_listeners:
            self._model_listeners.remove(listener)

    def unanswered(self, why: str) -> None:
        """A probe could not reach it (refused, no answer in time): while it has never answered,
        whoever listens hears it (its pool member then reads ``unreachable``)."""
        if self.reachable:
            return
        call_each(log, "upstream unanswered listener failed", self._unanswered_listeners, why)

    def when_unanswered(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(why)`` when a probe could not reach it before it ever answered (see :meth:`unanswered`)."""
        self._unanswered_listeners.append(listener)

    def when_served(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` each time a model call is answered (see :meth:`served`)."""
        self._served_listeners.append(listener)

    def report(self, failure_reason: str | None, call: ModelCall | None = None) -> Deferred[bool]:
        """How an attempt went (any class, passthrough too): None for an answer, else the failure's reason.

        For a failure, the Deferred fires with the verdict: True when a
        recognised outage explains it, so the attempt does not count against
        the request; False when the request failed on its own (or nothing
        judges outages).  ``call`` says what failed (a
        :class:`~yieldproxy.servers.base.ModelCall`, or None), so the judge can
        weigh it against what the upstream is known to serve.  The Deferred never fails; cancelling
        it only stops waiting.
        """
        if failure_reason is None:
            self.answered()
        call_each(log, "upstream health listener failed", self._listeners, failure_reason)
        if failure_reason is None or self._judge is None:
            return succeed(False)
        try:
            return self._judge(failure_reason, call)
        except Exception:
            log.failure("outage judge failed")
            return succeed(False)

    def listen(self, listener: Callable[[str | None], None]) -> None:
        """Call ``listener(failure_reason)`` with every attempt's result, until :meth:`forget`."""
        self._listeners.append(listener)

    def forget(self, listener: Callable[[str | None], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

