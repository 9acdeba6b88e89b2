"""
Models in (simulated) memory: loads on demand, keep-alive, expiry.

Ollama loads a model on its first request, shares that one load among every
request that waits for it, keeps the model while requests use it and for
``keep_alive`` seconds after the last one, then unloads it.  The handover
(unload before a yield, preload after) and the sim's ``/api/ps`` rest on
exactly that; :class:`ModelStore` is it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import attrs
from twisted.internet.interfaces import IDelayedCall

#: A keep-alive that never runs out (Ollama's negative ``keep_alive``).
FOREVER = math.inf

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6,
    "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
}


def parse_keep_alive(value: Any, default: float) -> float:
    """
    Ollama's ``keep_alive``: seconds, or a Go duration such as ``"5m"``.

    Returns seconds; ``0`` means unload after answering, and a negative value
    means keep the model loaded forever (returned as ``math.inf``).

    :raises ValueError: with Go's wording, for a value Ollama would refuse.
    """
    if value is None:
        return default
    if isinstance(value, bool):
        raise ValueError(f"invalid keep_alive {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f'time: invalid duration "{value}"') from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        raise ValueError(f"invalid keep_alive {value!r}")
    return FOREVER if seconds < 0 else seconds


@attrs.define(eq=False)
class LoadedModel:
    """A model in (simulated) VRAM; expires lazily, no timer needed."""

    name: str
    expires_at: float
    busy: int = 0


@attrs.define(eq=False)
class _Load:
    """A model load in progress, shared by every request that needs it."""

    timer: IDelayedCall
    waiters: list[tuple[object, Callable[[], None]]] = attrs.Factory(list)


@attrs.define(eq=False)
class ModelStore:
    """
    Which models are loaded, the way Ollama keeps them.

    :param clock: ``IReactorTime``: loads take ``load_seconds`` on it.
    :param load_seconds: how long a load takes (0: at once).
    :param default_keep_alive: seconds a model loaded by a load stays, when
        nothing else says.
    """

    _clock: Any
    load_seconds: float
    default_keep_alive: float
    #: Load times of single models (by name), for the others ``load_seconds``.
    load_seconds_of: dict[str, float] = attrs.field(init=False, factory=dict)
    _loaded: dict[str, LoadedModel] = attrs.field(init=False, factory=dict)
    _loads: dict[str, _Load] = attrs.field(init=False, factory=dict)
    _known: dict[str, None] = attrs.field(init=False, factory=dict)

    def know(self, name: str) -> None:
        """List ``name`` among the models the server has (``/api/tags``)."""
        self._known[name] = None

    def forget(self, name: str) -> None:
        """``name`` was deleted: no longer listed, and unloaded."""
        self._known.pop(name, None)
        self._loaded.pop(name, None)

    def known(self) -> list[str]:
        """Every model the server has, in the order it learnt them."""
        return list(self._known)

    def has(self, name: str) -> bool:
        """True when the server has the model ``name`` (a canonical name: ``content.canonical_model``)."""
        return name in self._known

    def loaded(self) -> list[LoadedModel]:
        """The models loaded now (what ``/api/ps`` lists)."""
        self.prune()
        return list(self._loaded.values())

    def loaded_names(self) -> list[str]:
        """Names of the models loaded now, sorted."""
        self.prune()
        return sorted(self._loaded)

    def prune(self) -> None:
        """Forget models whose keep-alive ran out (lazy: no timers)."""
        now = self._clock.seconds()
        for name in [n for n, m in self._loaded.items() if m.busy == 0 and m.expires_at <= now]:
            del self._loaded[name]

    def load(self, name: str, waiter: object, ready: Callable[[], None]) -> None:
        """Call ``ready`` once ``name`` is loaded: now, or when its (shared) load ends.

        ``waiter`` names the request waiting, for :meth:`cancel`.
        """
        if name in self._loaded:
            ready()
            return
        load_seconds = self.load_seconds_of.get(name, self.load_seconds)
        if load_seconds <= 0:
            self._loaded[name] = LoadedModel(name, self._clock.seconds())
            ready()
            return
        load = self._loads.get(name)
        if load is None:
            load = _Load(self._clock.callLater(load_seconds, self._load_done, name))
            self._loads[name] = load
        load.waiters.append((waiter, ready))

    def cancel(self, name: str, waiter: object) -> None:
        """``waiter`` no longer waits for the load of ``name`` (it went away)."""
        load = self._loads.get(name)
        if load is not None:
            load.waiters[:] = [(w, r) for w, r in load.waiters if w is not waiter]

    def hold(self, name: str) -> None:
        """A request uses the (loaded) model: it cannot expire meanwhile."""
        self._loaded[name].busy += 1

    def release(self, name: str, keep_alive: float) -> None:
        """A request is done with the model: its keep-alive starts now."""
        model = self._loaded.get(name)
        if model is None:
            return
        model.busy = max(0, model.busy - 1)
        model.expires_at = self._clock.seconds() + keep_alive
        self.prune()

    def unload(self, name: str) -> None:
        """Unload now, or as soon as its last request ends (``keep_alive: 0``)."""
        model = self._loaded.get(name)
        if model is not None:
            if model.busy:
                model.expires_at = self._clock.seconds()
            else:
                del self._loaded[name]

    def stop(self) -> None:
        """Cancel every load in progress; nobody waits for them any more."""
        for load in self._loads.values():
            if load.timer.active():
                load.timer.cancel()
        self._loads.clear()

    def _load_done(self, name: str) -> None:
        """The model is loaded: every request that waited for it proceeds."""
        load = self._loads.pop(name)
        self._loaded[name] = LoadedModel(name, self._clock.seconds() + self.default_keep_alive)
        for _, ready in list(load.waiters):
            ready()
