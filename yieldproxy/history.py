"""The last hour of the proxy's state, one sample a second, for the status page.

Prometheus keeps the long history; this ring buffer is for the person looking
at ``GET /`` on the admin listener who wants to see "what happened in the last
few minutes" without a Prometheus at hand.  It holds at most ``capacity``
samples (3600 at one a second: an hour, about a megabyte) and forgets the
oldest first.

Each sample is ``{t, state, parked: {class: count}, inflight}``, taken on the
injected clock while the service runs (:func:`~yieldproxy.periodic.every`:
one bad read is logged and the sampling goes on).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from .periodic import every

log = Logger()

#: One sample a second.
DEFAULT_INTERVAL = 1.0
#: An hour of samples at the default interval.
DEFAULT_CAPACITY = 3600


@attrs.frozen
class Snapshot:
    """What one sample records, read from the live objects."""

    state: str
    parked: dict[str, int]
    inflight: int


@attrs.frozen
class Sample:
    """One point of history: a :class:`Snapshot` and when it was taken."""

    t: float
    state: str
    #: Counts per class, in the order of :attr:`History.classes`.
    parked: tuple[int, ...]
    inflight: int


@attrs.define(eq=False, slots=False)
class History(Service):
    """A ring buffer of :class:`Sample`, filled every ``interval`` seconds while the service runs."""

    _clock: IReactorTime
    #: Reads the current state; called once per sample.
    _read: Callable[[], Snapshot]
    classes: tuple[str, ...]
    interval: float = DEFAULT_INTERVAL
    capacity: int = DEFAULT_CAPACITY
    _samples: collections.deque = attrs.field(init=False)
    _loop: LoopingCall | None = attrs.field(init=False, default=None)

    name = "history"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        self._samples = collections.deque(maxlen=self.capacity)

    def __len__(self) -> int:
        return len(self._samples)

    def startService(self) -> None:
        """Sample now, then every :attr:`interval` seconds."""
        super().startService()
        self._loop = every(self._clock, self.interval, self.sample, "history: taking a sample")

    def stopService(self) -> None:
        """Stop sampling; the samples taken so far stay readable."""
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def sample(self) -> None:
        """Take one sample.  Never raises: a failure is logged and the loop goes on."""
        try:
            snap = self._read()
            parked = tuple(int(snap.parked.get(cls, 0)) for cls in self.classes)
            # Milliseconds are plenty, and a rounded ``t`` reads back exactly
            # as the ``since`` of the page's next poll.  Strictly increasing,
            # so a poll's ``since`` never hides a sample taken in the same ms.
            t = round(self._clock.seconds(), 3)
            if self._samples and t <= self._samples[-1].t:
                t = round(self._samples[-1].t + 0.001, 3)
            self._samples.append(Sample(t, snap.state, parked, int(snap.inflight)))
        except Exception:
            log.failure("history: taking a sample failed (sampling goes on)")

    def state_changed(self, yielded: bool = True) -> None:
        """An extra sample when the GPU is taken or given back, so the chart's yield bands start and end on time.

        Given to :meth:`YieldState.observe`; does nothing while stopped.
        """
        if self.running:
            self.sample()

    def samples(self, since: float | None = None) -> list[Sample]:
        """The samples taken after ``since`` (all of them when None), oldest first."""
        if since is None:
            return list(self._samples)
        newer: list[Sample] = []
        # Newest are at the right: walk back only as far as needed, so a page
        # polling every two seconds costs two samples, not an hour of them.
        for sample in reversed(self._samples):
            if sample.t <= since:
                break
            newer.append(sample)
        newer.reverse()
        return newer

    def as_json(self, since: float | None = None) -> dict[str, Any]:
        """The ``GET /history`` body."""
        return {
            "now": self._clock.seconds(),
            "interval": self.interval,
            "capacity": self.capacity,
            "classes": list(self.classes),
            "samples": [self._sample_json(s) for s in self.samples(since)],
        }

    def _sample_json(self, sample: Sample) -> dict[str, Any]:
        return {
            "t": sample.t,
            "state": sample.state,
            "parked": dict(zip(self.classes, sample.parked)),
            "inflight": sample.inflight,
        }


def snapshot_reader(gate, lot, replayer, classes: Iterable[str]) -> Callable[[], Snapshot]:
    """The reader :func:`~yieldproxy.service.build` gives :class:`History`: the same numbers as ``/status``."""
    names = tuple(classes)

    def read() -> Snapshot:
        parked = dict.fromkeys(names, 0)
        parked.update(lot.count_by_class())
        return Snapshot(gate.state_name, parked, replayer.inflight)

    return read
