"""What an upstream is known to serve: the record an outage verdict rests on.

An outage probe asks for a model the upstream is *known* to serve (upstream/evidence.py);
:class:`ServedRecord` is that knowledge, one per upstream, owned by its
:class:`~yieldproxy.upstream.health.UpstreamHealth`, and no client can fill or empty it:
only a model call answered 2xx enters, one entry per canonical name, ordered by a
standing earned in distinct minutes of use (a burst of new names earns little), bounded
with the least standing out first.  :class:`RecordKeeper` keeps it in the holds file and
across a reload.  The rules: docs/watchers.md, "What an outage rests on".
"""

from __future__ import annotations

import collections
import json
import math
from typing import Any, Callable, Iterable

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ..callbacks import call_each
from ..clock import cancel
from ..names import canonical_model
from ..servers.base import ModelCall

log = Logger()

#: Models kept per upstream, at most (a deployment serves a handful).
MAX_MODELS = 64
#: The longest model name kept (Ollama's longest valid name is about 350 + 80 + 80 + 80 characters,
#: but none in use comes near; a longer name is nobody's model).
MAX_NAME = 256
#: Seconds between a model's first service and a later one for it to count as in real use.
IN_USE_AFTER = 60.0
#: Seconds of one step of standing: a model served in this many distinct spans earns as many points.
STANDING_MINUTE = 60.0
#: Seconds in which standing fades by a factor e (a model served no more loses its standing over days).
STANDING_FADES = 24 * 3600.0
#: Seconds a change of the record waits before it is written (:class:`RecordKeeper`): a burst of
#: new names costs one write, not one per request.
WRITE_DELAY = 5.0


@attrs.define(eq=False)
class ServedModel:
    """One model the upstream served: its last call (route and the name it was asked for) and when."""

    #: The canonical name (the record's key).
    model: str
    #: The last call of it served whose kind a probe can reproduce (route, the upstream's own name for it).
    call: ModelCall
    #: When it was first served here (or restored), and last.
    first: float
    last: float
    #: Calls of it served.
    served: int = 1
    #: Served again at least :data:`IN_USE_AFTER` after ``first`` (what ``/status`` shows).
    in_use: bool = False
    #: Points of standing as of :attr:`minute` (one per distinct minute served in, fading: :func:`standing_at`).
    standing: float = 1.0
    #: The minute (``time // STANDING_MINUTE``) of the last point; None: none since it was redefined.
    minute: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "path": self.call.path, "name": self.call.model,
            "first": self.first, "last": self.last, "served": self.served, "in_use": self.in_use,
            "standing": self.standing, "minute": self.minute,
        }

    def standing_at(self, now: float) -> float:
        """Its standing at ``now``: its points, faded since the minute of the last one."""
        if self.minute is None:
            return self.standing
        faded = max(0.0, now - self.minute * STANDING_MINUTE)
        return self.standing * math.exp(-faded / STANDING_FADES)

    def earn(self, now: float) -> bool:
        """Served at ``now``: a point, unless it earned one in this minute already (then False)."""
        minute = int(now // STANDING_MINUTE)
        if minute == self.minute:
            return False
        self.standing = self.standing_at(now) + 1.0
        self.minute = minute
        return True


def _always(call: ModelCall) -> bool:
    return True


@attrs.define(eq=False)
class ServedRecord:
    """The models one upstream served, least recently served first (see the module docstring)."""

    _clock: IReactorTime | None = None
    #: ``probeable(call)``: whether a probe can reproduce a call of this kind (the server's minimal call).
    _probeable: Callable[[ModelCall], bool] = _always
    max_models: int = MAX_MODELS
    _entries: collections.OrderedDict[str, ServedModel] = attrs.field(init=False, factory=collections.OrderedDict)
    _listeners: list[Callable[[], None]] = attrs.field(init=False, factory=list)

    def _now(self) -> float:
        return self._clock.seconds() if self._clock is not None else 0.0

    def probeable(self, call: ModelCall) -> bool:
        """Whether a probe can make a call of ``call``'s kind (its server's minimal call)."""
        return self._probeable(call)

    def __len__(self) -> int:
        return len(self._entries)

    def when_changed(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when a model enters or leaves the record, or earns a point of standing (at most
        once a minute per model, not on each call)."""
        self._listeners.append(listener)

    def served(self, call: ModelCall) -> None:
        """The upstream answered ``call`` 2xx: it serves that model (refreshed, or entered)."""
        if len(call.model) > MAX_NAME:
            return
        key = canonical_model(call.model)
        now = self._now()
        entry = self._entries.get(key)
        if entry is not None:
            # Every answer comes here: the common case (the same call again) costs a lookup and no more.
            entry.last = max(entry.last, now)
            entry.served += 1
            earned = entry.earn(now)
            if call != entry.call and self._probeable(call):
                entry.call = call
            self._entries.move_to_end(key)
            if not entry.in_use and now - entry.first >= IN_USE_AFTER:
                entry.in_use = True
            if earned:
                self._changed()
            return
        if not self._probeable(call):
            return  # nothing a probe could ask of it
        self._make_room()
        self._entries[key] = ServedModel(key, call, now, now, standing=1.0, minute=int(now // STANDING_MINUTE))
        self._changed()

    def _make_room(self) -> None:
        """Past the bound: the entry of least standing leaves (the least recently served among equals)."""
        now = self._now()
        while len(self._entries) >= self.max_models:
            # Least recently served first: ``min`` keeps the first of equals.
            victim = min(self._entries.values(), key=lambda e: e.standing_at(now))
            del self._entries[victim.model]

    def redefined(self, model: str) -> None:
        """A model-management call defined ``model`` anew: what it was served as says nothing of it now."""
        entry = self._entries.get(canonical_model(model))
        if entry is None:
            return
        entry.standing, entry.minute, entry.in_use = 0.0, None, False
        entry.first = self._now()
        self._changed()

    def deleted(self, model: str) -> None:
        """``model`` was deleted: nothing is served under its name any more."""
        if self._entries.pop(canonical_model(model), None) is not None:
            self._changed()

    def recent(self) -> list[ServedModel]:
        """Every entry, the most recently served first."""
        return list(reversed(self._entries.values()))

    def calls(self, excluding: str | None = None) -> list[ModelCall]:
        """The calls to probe with, the model of most standing first (the most recently served among
        equals); ``excluding``: not that model's."""
        skip = canonical_model(excluding) if excluding is not None else None
        now = self._now()
        ranked = sorted(reversed(self._entries.values()), key=lambda e: -e.standing_at(now))
        return [e.call for e in ranked if e.model != skip]

    def as_json(self) -> list[dict[str, Any]]:
        """The entries, least recently served first (the order :meth:`restore` keeps)."""
        return [e.as_json() for e in self._entries.values()]

    def restore(self, entries: Any, where: str = "the record of served models") -> int:
        """Take what :meth:`as_json` wrote (here, or in another process); entries already here keep what is
        newer.  Anything malformed is skipped, logged once with ``where``; returns the entries taken."""
        if entries is None:
            return 0
        if not isinstance(entries, list):
            log.warn("{where}: not a list of served models; starting with none", where=where)
            return 0
        now = self._now()
        taken = 0
        bad = 0
        for item in entries:
            entry = _entry(item, now)
            if entry is None:
                bad += 1
                continue
            mine = self._entries.get(entry.model)
            if mine is not None:
                if entry.last > mine.last:
                    mine.call, mine.last = entry.call, entry.last
                mine.first = min(mine.first, entry.first)
                mine.served = max(mine.served, entry.served)
                mine.in_use = mine.in_use or entry.in_use
                if entry.standing_at(now) > mine.standing_at(now):
                    mine.standing, mine.minute = entry.standing, entry.minute
                continue
            self._make_room()
            self._entries[entry.model] = entry
            taken += 1
        # Least recently served first, whichever process served them.
        ordered = sorted(self._entries.values(), key=lambda e: e.last)
        self._entries = collections.OrderedDict((e.model, e) for e in ordered)
        if bad:
            log.warn("{where}: {bad} malformed entr{ies} skipped", where=where, bad=bad, ies="y" if bad == 1 else "ies")
        if taken:
            self._changed()
        return taken

    def _changed(self) -> None:
        call_each(log, "served record listener failed", self._listeners)


def _entry(item: Any, now: float) -> ServedModel | None:
    """One entry of :meth:`ServedRecord.as_json`, checked; None when it is not one."""
    if not isinstance(item, dict):
        return None
    path, name = item.get("path"), item.get("name")
    if not isinstance(path, str) or not path.startswith("/") or not isinstance(name, str) or not name:
        return None
    if len(name) > MAX_NAME or len(path) > MAX_NAME:
        return None
    first, last = _time(item.get("first"), now), _time(item.get("last"), now)
    if first is None or last is None:
        return None
    served = item.get("served", 1)
    if isinstance(served, bool) or not isinstance(served, int) or served < 1:
        return None
    in_use = item.get("in_use") is True
    # Written before standing was kept: a point, and one more for a model in use.
    standing, minute = item.get("standing", 2.0 if in_use else 1.0), item.get("minute", int(last // STANDING_MINUTE))
    if isinstance(standing, bool) or not isinstance(standing, (int, float)) or not 0 <= standing < math.inf:
        return None
    if minute is not None and (isinstance(minute, bool) or not isinstance(minute, int)):
        return None
    if minute is not None:
        minute = min(minute, int(now // STANDING_MINUTE))
    return ServedModel(
        canonical_model(name), ModelCall(path, name), min(first, last), last, served, in_use, float(standing), minute,
    )


#: Model-management routes, and the fields of their bodies that name the model they define anew (Ollama's
#: handlers read ``cmp.Or(req.Model, req.Name)``, and ``req.Destination`` for a copy).
_REDEFINING = {"/api/create": ("model", "name"), "/api/pull": ("model", "name"), "/api/copy": ("destination",)}
_DELETING = {"/api/delete": ("model", "name")}
#: The routes that define or delete a model by name.
MANAGEMENT_PATHS = frozenset(_REDEFINING) | frozenset(_DELETING)


def redefined_by(path: str, body: bytes) -> tuple[str | None, str | None]:
    """What a model-management call on ``path`` answered 2xx did: ``(model defined anew, model deleted)``,
    each None when none.  ``body`` is the call's body as sent (JSON keys matched as Go matches them:
    in any case, the last of duplicates)."""
    fields = _REDEFINING.get(path) or _DELETING.get(path)
    if fields is None:
        return None, None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(value, dict):
        return None, None
    lowered = {k.lower(): v for k, v in value.items()}
    name = next((lowered[f] for f in fields if isinstance(lowered.get(f), str) and lowered[f]), None)
    if name is None:
        return None, None
    return (None, name) if path in _DELETING else (name, None)


def _time(value: Any, now: float) -> float | None:
    """A time written by :meth:`ServedModel.as_json`, at most ``now``; None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return min(float(value), now)


#: The section of the holds file the records are written in.
SECTION = "served"


@attrs.define(eq=False, slots=False)
class RecordKeeper(Service):
    """Writes every upstream's record into the holds file (lifecycle/holdstore.py) when one changes, and reads them back.

    The section is ``{"<upstream>": {"url": ..., "models": [...]}}``; an
    upstream whose URL changed since it was written starts with an empty
    record (another server under that name).  A change is written at once,
    and at most once every :data:`WRITE_DELAY` seconds (a burst of changes
    costs one write more, when the delay is over), and what is pending when
    the proxy stops (:meth:`flush`).  Without a holds file (``write`` None)
    nothing is written.
    """

    _clock: IReactorTime
    #: ``(name, url, record)`` of each upstream.
    _records: tuple[tuple[str, str, ServedRecord], ...]
    #: Writes the holds file (with this section in it, read from :meth:`section`); None: no file.
    _write: Callable[[], object] | None
    _timer: IDelayedCall | None = None
    #: When it last wrote.
    _written_at: float | None = None

    name = "served-record"  # type: ignore[assignment]  # Twisted types Service.name as None

    def stopService(self) -> None:
        """The proxy stops: what is pending is written now (after the drain: the last answers are in)."""
        super().stopService()  # type: ignore[no-untyped-call]  # Twisted leaves it unannotated
        self.flush()

    @classmethod
    def of(
        cls, clock: IReactorTime, records: Iterable[tuple[str, str, ServedRecord]], write: Callable[[], object] | None,
    ) -> "RecordKeeper":
        keeper = cls(clock, tuple(records), write)
        for _, _, record in keeper._records:
            record.when_changed(keeper.changed)
        return keeper

    def section(self) -> dict[str, Any]:
        """What the holds file's ``served`` section says now."""
        return {name: {"url": url, "models": record.as_json()} for name, url, record in self._records}

    def restore(self, section: Any, where: str) -> None:
        """Take a ``served`` section (of a holds file, or of a reload's handover); tolerant (see the class)."""
        if section is None:
            return
        if not isinstance(section, dict):
            log.warn("{where}: the record of served models is not an object; every upstream starts with none",
                     where=where)
            return
        for name, url, record in self._records:
            value = section.get(name)
            if not isinstance(value, dict):
                continue
            if value.get("url") != url:
                continue  # another server under that name now: what it served says nothing
            record.restore(value.get("models"), f"{where}: upstream {name}")

    def changed(self) -> None:
        """A record changed: write it now, or once the delay since the last write is over."""
        if self._write is None or self._timer is not None:
            return
        now = self._clock.seconds()
        if self._written_at is None or now - self._written_at >= WRITE_DELAY:
            self._written(now)
            return
        self._timer = self._clock.callLater(self._written_at + WRITE_DELAY - now, self.flush)

    def flush(self) -> None:
        """Write now what is pending (the proxy stops, or the delay is over)."""
        timer, self._timer = self._timer, None
        if timer is None:
            return
        cancel(timer)
        self._written(self._clock.seconds())

    def _written(self, now: float) -> None:
        assert self._write is not None  # only called with a file to write
        self._written_at = now
        self._write()
