"""
What one simulated server's HTTP API is made of.

The sim's machinery (the parallel cap, model loads, outage modes, the
listener) is the same whichever server it plays; what differs is the API:
its routes, how it reads a request, the JSON it answers and the shape of its
errors.  An :class:`Api` holds exactly that, and :class:`~.server.SimOllama`
(through :class:`Sim`) asks it at each step.  Every route is one of four kinds, the same split the
proxy's classifier follows (docs/servers.md):

* ``batch``: runs the model once over every input (embeddings, rerank,
  classification) and answers one JSON document after ``latency`` plus
  ``per_item_latency`` per input;
* ``generate``: produces text piece by piece (chat, completions), streamed or
  whole;
* ``info``: never touches the model (versions, model lists, health,
  tokenizers), so it answers at once in every mode but ``refuse``;
* ``probe``: a health check that runs the model (TEI's ``/health`` after a
  failure): answered at once, but hung in ``hang`` and reset in ``reset``
  like a model route.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Mapping, Protocol

import attrs
from twisted.web.server import Request

from .jobs import Job
from .models import ModelStore
from .route import Route

JSON = b"application/json; charset=utf-8"
NDJSON = b"application/x-ndjson"
SSE = b"text/event-stream"

#: The route kinds (see the module docstring).
KINDS = ("batch", "generate", "info", "probe")

#: Why the sim itself refuses a request; each :class:`Api` words these its own way.
FAILURES = (
    "bad_request",  # the caller's input is wrong (the message says how)
    "not_found",  # no such path
    "model_not_found",  # no such model (the message is its name as the request gave it)
    "method",  # the path exists, not with this method
    "busy",  # the queue is full
    "outage",  # the GPU failed (mode ``error500``)
    "load_oom",  # this request's own model load does not fit (Ollama's num_ctx)
    "template",  # the caller's template does not parse (Ollama)
    "loading",  # the server is still loading its model (llama.cpp)
    "internal",  # a bug in the sim
)


class Sim(Protocol):
    """What an :class:`Api` reads of the sim playing the server (:class:`~.server.SimOllama` is one).

    The dialects depend on this, not on the server module that imports them.
    """

    latency: float
    parallel: int
    chunk_delay: float
    chunks: int
    dim: int
    default_keep_alive: float
    context_length: int
    max_queue: int
    store: ModelStore
    #: Outage modes of single models, by canonical name (``set_model_mode``).
    model_modes: dict[str, str]

    @property
    def mode(self) -> str: ...

    @property
    def serving(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def served_model(self) -> str: ...

    @property
    def loading(self) -> bool: ...

    def now(self) -> float: ...

    def next_id(self, prefix: str) -> str: ...


class BadRequest(Exception):
    """The caller's request is wrong: answered in the route's error shape, never served.

    ``kind`` lets an API tell its kinds of bad input apart (TEI answers an
    empty batch 400 and an over-long one 422, for instance).
    """

    def __init__(self, message: str, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.kind = kind


@attrs.frozen
class Reply:
    """A whole HTTP answer: status, body, content type."""

    code: int
    body: bytes
    content_type: bytes = JSON
    #: Further headers (a redirect's ``location``, a 405's ``allow``).
    headers: tuple[tuple[bytes, bytes], ...] = ()


def dumps(obj: Any) -> bytes:
    """Compact JSON, as Ollama (and most servers) write it."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj``."""
    return b"data: " + dumps(obj) + b"\n\n"


class Api:
    """
    One server's HTTP API; subclasses fill it in.

    Every method takes the :class:`Sim` playing the server,
    which holds the settings, the models, the clock and the counters: an
    ``Api`` itself keeps no state, so one instance serves any number of sims.
    """

    #: The name ``--api`` takes.
    name: ClassVar[str]
    #: Every path the server answers.
    routes: ClassVar[Mapping[str, Route]]
    #: True when the server loads models on demand, one per request's
    #: ``model`` (Ollama); False when it serves the one model it started
    #: with and ignores the name (TEI, Infinity, llama.cpp).
    loads_on_demand: ClassVar[bool] = False
    #: True when the server answers HTTP while it loads its one model at
    #: start (llama.cpp: 503 "Loading model" meanwhile, see :meth:`while_loading`).
    loads_at_start: ClassVar[bool] = False

    def route(self, path: str, method: str) -> Route | None:
        """The route at ``path`` (for ``method``, where a path has one per method), or None for a 404."""
        return self.routes.get(path)

    def while_loading(self, path: str) -> Reply | None:
        """The answer at ``path`` while the model loads at start; None to serve it as usual."""
        return None

    def front(self, request: Request) -> Reply | None:
        """What the server answers before any handler runs (its CORS check, its router, its body
        decode), or None to go on."""
        return None

    def style_of(self, path: str) -> str:
        """The error shape of a path that is no route (for its 404)."""
        raise NotImplementedError

    def error(self, style: str, failure: str, message: str, job: Job | None = None) -> Reply:
        """The answer to a request the sim refuses.

        ``failure`` is one of :data:`FAILURES`, or the ``kind`` of a
        :class:`BadRequest` this API raised; ``message`` is the bad request's
        (or the template's) own wording, empty otherwise; ``job`` is the
        request once read (None before).
        """
        raise NotImplementedError

    def read(self, request: Request) -> Any:
        """The request's JSON body; :class:`BadRequest` in the server's words."""
        raise NotImplementedError

    def parse(self, sim: Sim, job: Job, body: Any) -> None:
        """Check the body of a model route and fill in ``job``; :class:`BadRequest` if wrong."""
        raise NotImplementedError

    def info(self, sim: Sim, request: Request, route: Route) -> Reply:
        """The answer of an ``info`` route."""
        raise NotImplementedError

    def answer(self, sim: Sim, job: Job) -> Any:
        """The JSON body that answers a ``batch`` job (the model has run)."""
        raise NotImplementedError

    def reply(self, sim: Sim, job: Job, text: str) -> Any:
        """The JSON body that answers a ``generate`` job whole (``stream`` off)."""
        raise NotImplementedError

    def start_stream(self, sim: Sim, job: Job) -> None:
        """Status and headers of a streamed ``generate`` answer."""
        raise NotImplementedError

    def stream_chunk(self, sim: Sim, job: Job, i: int, pieces: list[str]) -> bytes:
        """What a stream writes for piece ``i``; ``i == len(pieces)`` closes it."""
        raise NotImplementedError

    def load_answer(self, sim: Sim, job: Job, reason: str) -> Any:
        """The answer to a request that only loads (``reason`` "load") or unloads a model."""
        raise NotImplementedError
