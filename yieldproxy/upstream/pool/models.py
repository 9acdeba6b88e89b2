"""Which models a member serves: the patterns its config names, or the names its model list gives.

A member without ``models`` is asked for its model list at start and every
``upstream.models_refresh_seconds`` (:class:`ModelDiscovery`); until a list has
come, what it serves is unknown (None) and the pool routes by route alone, so
the server answers with its own words (docs/pool.md, "Which upstream a request
goes to").  Names compare as Ollama's do (:func:`~yieldproxy.names.canonical_model`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from ...names import canonical_model
from ...periodic import every

log = Logger()


@attrs.define(eq=False)
class ModelCatalogue:
    """The models one member serves, as configured or as last discovered."""

    #: Shell patterns of request model names (``[[upstreams]] models``).
    patterns: tuple[str, ...] = ()
    #: Request model name -> the member's own name (``[[upstreams]] model_map``).
    model_map: Mapping[str, str] = attrs.Factory(dict)
    #: The names its model list gave last; None until one came (or when ``patterns`` are set).
    discovered: tuple[str, ...] | None = None
    #: Bumped whenever what it serves changes, so cached routing decisions are dropped.
    version: int = 0
    _canonical: frozenset[str] = attrs.field(init=False, factory=frozenset)
    _mapped: dict[str, str] = attrs.field(init=False, factory=dict)
    _listeners: list[Callable[[], None]] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        self._mapped = {canonical_model(k): v for k, v in self.model_map.items()}

    @property
    def static(self) -> bool:
        """True when the config names its models (no discovery)."""
        return bool(self.patterns)

    def serves(self, model: str) -> bool | None:
        """True if it serves ``model``, False if not, None when that is not known yet."""
        canonical = canonical_model(model)
        if canonical in self._mapped:
            return True
        for pattern in self.patterns:
            # As written, as Ollama names it (``all-minilm`` is ``ALL-MINILM:latest``), or a
            # pattern over the tag too (``all-minilm*`` takes ``All-MiniLM:v2``).
            if (
                fnmatchcase(model, pattern) or fnmatchcase(canonical, canonical_model(pattern))
                or fnmatchcase(canonical, pattern.strip().lower())
            ):
                return True
        if self.static:
            return False
        if self.discovered is None:
            return None
        return canonical in self._canonical

    def own_name(self, model: str) -> str | None:
        """The member's name for ``model`` when its ``model_map`` renames it, else None."""
        if not self._mapped:
            return None
        return self._mapped.get(canonical_model(model))

    def names(self) -> list[str]:
        """What to show in ``/status``: the patterns and mapped names, or the discovered list."""
        if self.static or self.discovered is None:
            return [*self.patterns, *(k for k in self.model_map if k not in self.patterns)]
        return [*self.discovered, *(k for k in self.model_map if k not in self.discovered)]

    def update(self, names: tuple[str, ...]) -> None:
        """A model list came: serve what it names from now on."""
        if names == self.discovered:
            return
        self.discovered = tuple(names)
        self._canonical = frozenset(canonical_model(n) for n in names)
        self.version += 1
        for listener in list(self._listeners):
            listener()

    def when_changed(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when what it serves changes (the pool drops its cached eligibility)."""
        self._listeners.append(listener)


@attrs.define(eq=False, slots=False)
class ModelDiscovery(Service):
    """Reads one member's model list at start and on a fixed interval, into its catalogue.

    A list that cannot be read (the server is down, or yielded and stopped)
    leaves the last one in place; the first failure of a run of them is logged.
    """

    _clock: IReactorTime
    _catalogue: ModelCatalogue
    #: ``request(method, path, timeout=)`` of the member's control client.
    #: The member's control client (``UpstreamControl``: ``request(method, path, timeout=)``).
    _control: Any
    #: The member's name, for log lines.
    member: str
    path: str
    parse: Callable[[bytes], tuple[str, ...]]
    interval: float = 60.0
    timeout: float = 10.0
    #: Where else the list may be, asked in order after a 404: the same list under
    #: the API prefixes the server may be mounted under (Infinity's ``--url-prefix``).
    other_paths: tuple[str, ...] = ()
    #: Called with the path that gave the list (a member under an API prefix learns its prefix).
    on_found: Callable[[str], None] = lambda path: None
    #: False: only find where the list is (``on_found``): the member's models are given in config.
    read_models: bool = True
    _loop: LoopingCall | None = None
    _failing: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]  # the service's name; Twisted types it None
        return f"models:{self.member}"

    def startService(self) -> None:
        super().startService()
        self._loop = every(self._clock, self.interval, self.refresh, f"model list of {self.member}")

    def stopService(self) -> None:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def refresh(self) -> Deferred:
        """Read the list once; never fails (a failure keeps the last list)."""
        d = self._read((self.path, *self.other_paths))
        d.addCallback(self._answered)
        d.addErrback(self._failed)
        return d

    def _read(self, paths: tuple[str, ...]) -> Deferred:
        """``(path, answer)`` at the first of ``paths`` that is not a 404 (the last one's, if all are)."""
        d = self._control.request("GET", paths[0], timeout=self.timeout)
        if len(paths) > 1:
            d.addCallback(lambda answer: self._read(paths[1:]) if answer.code == 404 else (paths[0], answer))
        else:
            d.addCallback(lambda answer: (paths[0], answer))
        return d

    def _answered(self, found) -> None:
        path, answer = found
        if answer.code != 200:
            raise ValueError(f"GET {self.path} answered {answer.code}")
        self.on_found(path)
        if not self.read_models:
            self._failing = False
            return
        names = self.parse(answer.body)
        if self._failing or self._catalogue.discovered is None:
            log.info(
                "upstream {member} serves {models}", member=self.member, models=", ".join(names) or "no models",
            )
        self._failing = False
        self._catalogue.update(names)

    def _failed(self, failure) -> None:
        if not self._failing:
            self._failing = True
            log.warn(
                "upstream {member}: cannot read its model list ({why}); keeping the last one",
                member=self.member, why=failure.getErrorMessage(),
            )
