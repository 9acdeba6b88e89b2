"""A member verified under terms of its own: the ``[fallback]``'s pairs, as the twin verifier keeps them.

The twin verifier (:mod:`.twins`) finds a pool's pairs itself and verifies
them under ``[verification]``.  A :class:`Contract` names pairs it is given
instead: one twin member, the models it serves under its own names, the
terms (probe texts, cosine, interval, age), the two sides' embedding
clients and when it may run.  The verifier runs them in its one pass, on its
one timer; this module holds what they promise (docs/fallback.md).
"""

from __future__ import annotations

from typing import Awaitable, Callable, Mapping, Protocol

import attrs
from twisted.internet.defer import Deferred

from ...names import canonical_model
from ..translation import EmbedRequest, Embeddings
from ..vectors import Verification


class Embedder(Protocol):
    """One side of a verification (its URL and API shape): the vectors of ``request`` under its name ``model``."""

    url: str
    api: str

    def embed(self, request: EmbedRequest, model: str) -> Awaitable[Embeddings]: ...


@attrs.frozen
class Terms:
    """What a contract's verification holds to."""

    probe_texts: tuple[str, ...]
    min_cosine: float
    interval: float
    max_age: float


@attrs.define(eq=False)
class Contract:
    """Member ``twin`` against ``reference`` for each of ``models`` (the reference's name -> the twin's),
    embedded through ``sides``, only while ``may_run``; and what its last verifications said."""

    twin: str
    reference: str
    models: Mapping[str, str]
    terms: Terms
    sides: tuple[Embedder, Embedder]
    may_run: Callable[[], bool]
    #: The last verification of each model, by its reference name.
    verifications: dict[str, Verification] = attrs.Factory(dict)
    #: When each model is next due (absent: now).
    due_at: dict[str, float] = attrs.Factory(dict)
    #: Those waiting for the run asked on demand, and that run's results while it runs (None: none runs).
    waiters: list[Deferred] = attrs.Factory(list)
    results: dict[str, Verification] | None = None
    #: A run stopped or could not start because ``may_run`` said no: it runs once it may.
    postponed: bool = False
    _keys: dict[str, str] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._keys = {canonical_model(name): name for name in self.models}

    @property
    def running(self) -> bool:
        return self.results is not None

    def mapped(self, model: str) -> str | None:
        """The reference's name under which ``model`` is mapped, or None."""
        if model in self.models:
            return model
        return self._keys.get(canonical_model(model))

    def usable(self, model: str, now: float) -> bool:
        """Its last verification of ``model`` passed and is recent enough."""
        v = self.verifications.get(model)
        return v is not None and v.ok and now - v.at <= self.terms.max_age

    def due(self, now: float) -> list[str]:
        """The models whose verification is due."""
        return [model for model in self.models if self.due_at.get(model, now) <= now]


__all__ = ["Contract", "Embedder", "Terms"]
