"""A request as the sim keeps it: its record and, for model routes, its job."""

from __future__ import annotations

import attrs
from twisted.internet.interfaces import IDelayedCall
from twisted.web.server import Request

from .routes import _Route

@attrs.define(eq=False)
class SimRequest:
    """
    One request as the sim saw it, kept in :attr:`SimOllama.history`.

    ``mode`` is the mode the request hit on arrival; ``outcome`` is how it
    ended: ``ok``, ``bad_request``, ``not_found``, ``error500``, ``template_error``, ``busy``, ``refused``,
    ``reset``, ``abandoned`` (the client went away, which is how a ``hang``
    request usually ends), ``stopped``, or ``pending`` while unanswered.
    """

    method: str
    path: str
    mode: str
    received_at: float
    model: str | None = None
    texts: int = 0
    outcome: str = "pending"
    finished_at: float | None = None


@attrs.define(eq=False)
class _Job:
    """A model request between arrival and answer."""

    request: Request
    record: SimRequest
    route: _Route
    model: str
    key: str
    keep_alive: float
    arrived: float
    texts: list[str] = attrs.Factory(list)
    prompt: str = ""
    load_only: bool = False
    #: Ollama's 500 for a ``template`` it cannot parse (generate only).
    template_error: str | None = None
    #: The ``num_ctx`` this request asked for (0: the model's default).
    num_ctx: int = 0
    stream: bool = False
    include_usage: bool = False
    encoding_format: str = "float"
    dimensions: int | None = None
    stream_id: str = ""
    state: str = "new"  # new, queued, hung, serving, done
    answered: bool = False
    headers_sent: bool = False
    holds_model: bool = False
    started: float = 0.0
    load_wait: float = 0.0
    timer: IDelayedCall | None = None
