"""The last hour of the proxy's state, one sample a second, for the status page.

Prometheus keeps the long history; this ring buffer is for the person looking
at ``GET /`` on the admin listener without a Prometheus at hand.  It holds at
most ``capacity`` samples and forgets the oldest first, sampling on the
injected (elapsed) clock (:func:`~yieldproxy.periodic.every`).  A sample's
``t`` is shown on the wall clock with the offset of the moment it is read
(clock.py), so after a wall-clock step the whole hour moves with it, and
stays in order.  The samples and ``GET /history``'s fields: docs/admin-api.md.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from ..clock import WallClock
from ..periodic import every

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
    #: Running totals per class: parked requests that expired, requests refused at once.
    expired: dict[str, int] = attrs.field(factory=dict)
    rejected: dict[str, int] = attrs.field(factory=dict)
    #: Each upstream's state (``/status`` ``upstreams[*].state``), by name.
    upstreams: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class Sample:
    """One point of history: a :class:`Snapshot` and when it was taken."""

    t: float
    state: str
    #: Counts per class, in the order of :attr:`History.classes`.
    parked: tuple[int, ...]
    inflight: int
    #: Running totals per class, in the order of :attr:`History.classes`.
    expired: tuple[int, ...] = ()
    rejected: tuple[int, ...] = ()
    #: States in the order of :attr:`History.upstreams`.
    upstreams: tuple[str, ...] = ()


@attrs.define(eq=False, slots=False)
class History(Service):
    """A ring buffer of :class:`Sample`, filled every ``interval`` seconds while the service runs."""

    _clock: IReactorTime
    #: Reads the current state; called once per sample.
    _read: Callable[[], Snapshot]
    classes: tuple[str, ...]
    interval: float = DEFAULT_INTERVAL
    capacity: int = DEFAULT_CAPACITY
    #: The upstreams whose state each sample records, in ``/status`` order.
    upstreams: tuple[str, ...] = ()
    #: Where the times are shown on the wall clock (None: as the elapsed clock has them).
    wall: WallClock | None = None
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
            self._samples.append(Sample(
                t, snap.state, parked, int(snap.inflight),
                tuple(int(snap.expired.get(cls, 0)) for cls in self.classes),
                tuple(int(snap.rejected.get(cls, 0)) for cls in self.classes),
                tuple(str(snap.upstreams.get(name, "unknown")) for name in self.upstreams),
            ))
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
        """The ``GET /history`` body; ``since`` is a sample's ``t`` as an earlier answer showed it."""
        # Whole milliseconds, as ``t`` is: a ``t`` shown reads back as exactly the sample's.
        offset = 0.0 if self.wall is None else round(self.wall.offset(), 3)
        lost = self.lost()
        if lost["since"] is not None:
            lost["since"] = round(lost["since"] + offset, 3)
        return {
            "now": self._clock.seconds() + offset,
            "wall_offset": offset,
            "interval": self.interval,
            "capacity": self.capacity,
            "classes": list(self.classes),
            "upstreams": list(self.upstreams),
            "lost": lost,
            "samples": [
                self._sample_json(s, offset) for s in self.samples(None if since is None else round(since - offset, 3))
            ],
        }

    def lost(self) -> dict[str, Any]:
        """Expired and refused requests per class over the samples held (the last hour, once full).

        The difference between the newest sample's running totals and the
        oldest's; while the buffer is not yet full it holds every sample since
        the start, when the totals were zero, so the oldest counts from zero.
        """
        zero = {"since": None, "expired": dict.fromkeys(self.classes, 0), "rejected": dict.fromkeys(self.classes, 0)}
        if not self._samples:
            return zero
        first, last = self._samples[0], self._samples[-1]
        full = len(self._samples) == self.capacity

        def between(newest: tuple[int, ...], oldest: tuple[int, ...]) -> dict[str, int]:
            base = oldest if full and len(oldest) == len(newest) else (0,) * len(newest)
            return {cls: max(0, n - b) for cls, n, b in zip(self.classes, newest, base)}

        return {
            "since": first.t,
            "expired": between(last.expired, first.expired) if last.expired else zero["expired"],
            "rejected": between(last.rejected, first.rejected) if last.rejected else zero["rejected"],
        }

    def _sample_json(self, sample: Sample, offset: float = 0.0) -> dict[str, Any]:
        out = {
            "t": round(sample.t + offset, 3) if offset else sample.t,
            "state": sample.state,
            "parked": dict(zip(self.classes, sample.parked)),
            "inflight": sample.inflight,
        }
        if self.upstreams:
            out["upstreams"] = dict(zip(self.upstreams, sample.upstreams))
        return out


def snapshot_reader(scheduler, lot, classes: Iterable[str], metrics=None) -> Callable[[], Snapshot]:
    """The reader :func:`~yieldproxy.service.build` gives :class:`History`: the same numbers as ``/status``.

    ``scheduler`` has the state's name and ``inflight``; when it has ``members``,
    each one's state is read too.  With ``metrics``, the running totals of
    expired and refused requests are read from its counters.
    """
    names = tuple(classes)

    def read() -> Snapshot:
        parked = dict.fromkeys(names, 0)
        parked.update(lot.count_by_class())
        upstreams = {m.name: m.state_name() for m in getattr(scheduler, "members", ())}
        expired: dict[str, int] = {}
        rejected: dict[str, int] = {}
        if metrics is not None:
            expired = _totals(metrics.replay_total, lambda labels: labels.get("outcome") == "expired")
            rejected = _totals(metrics.rejected_total, lambda labels: True)
        return Snapshot(scheduler.state_name, parked, scheduler.inflight, expired, rejected, upstreams)

    return read


def _totals(counter, wanted: Callable[[dict[str, str]], bool]) -> dict[str, int]:
    """A counter's ``_total`` samples summed by their ``class`` label, those ``wanted`` only."""
    totals: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and wanted(sample.labels):
                cls = sample.labels.get("class", "")
                totals[cls] = totals.get(cls, 0) + int(sample.value)
    return totals
