"""
A simulated Ollama backend for the demo, the benchmarks and the tests.

No Ollama binary and no GPU can be reached where yieldproxy is built and
tested, yet the proxy must be checked against something that speaks Ollama's
API, serves a bounded number of requests at once, and can fail the ways a
real GPU server fails.  :class:`SimOllama` is that something:

* it answers the model routes (``/api/embed``, ``/api/embeddings``,
  ``/v1/embeddings``, ``/api/chat``, ``/api/generate``,
  ``/v1/chat/completions``, ``/v1/completions``) with deterministic content,
  so a test can recompute every vector (:func:`expected_embedding`) and every
  reply (:func:`expected_reply`) that came through the proxy;
* it serves at most ``parallel`` requests at once (like
  ``OLLAMA_NUM_PARALLEL``) and counts what it saw (``in_flight``,
  ``peak_in_flight``, ``peak_serving``, ``requests_total``,
  ``texts_embedded``), so a test can check the proxy's replay cap and prove
  that no text was embedded twice;
* it can be switched at run time into an outage (:meth:`SimOllama.set_mode`):
  ``refuse``, ``error500`` (``/api/version`` answers while every model call
  gets Ollama's runner out-of-memory 500), ``hang`` or ``reset``;
* it fails single requests the way Ollama does for their own input: a
  ``template`` it cannot parse gets a 500 quoting the template's parse error
  (:func:`template_error`), and an ``options.num_ctx`` above ``max_num_ctx``
  gets a load out-of-memory 500 (:data:`LOAD_OOM_ERROR`) while other calls work.

Every timer goes through the injected reactor, so the logic runs under a
:class:`twisted.internet.task.Clock` too.  Only :func:`main` touches the
global reactor.
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime
import hashlib
import json
import math
import re
import struct
import sys
from typing import Any, Callable, Iterable, Sequence

import attrs
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IListeningPort
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from .names import canonical_model

__all__ = [
    "BUSY_ERROR",
    "DEFAULT_CHAT_MODEL",
    "DEFAULT_EMBED_MODEL",
    "LOAD_OOM_ERROR",
    "MODES",
    "OOM_ERROR",
    "SIM_VERSION",
    "SimOllama",
    "SimRequest",
    "canonical_model",
    "count_tokens",
    "decode_base64_f32",
    "encode_base64_f32",
    "expected_embedding",
    "expected_embedding_f32",
    "expected_reply",
    "main",
    "messages_prompt",
    "parse_keep_alive",
    "template_error",
    "to_float32",
]

_log = Logger()

MODES = ("ok", "refuse", "error500", "hang", "reset")
"""The outage modes :meth:`SimOllama.set_mode` accepts."""

OOM_ERROR = "llama runner process has terminated: CUDA error: out of memory"
"""The error a model request gets in ``error500`` mode, in Ollama's wording."""

LOAD_OOM_ERROR = "llama runner process has terminated: cudaMalloc failed: out of memory"
"""What a request whose ``num_ctx`` passes ``max_num_ctx`` gets: its own load does not fit."""

BUSY_ERROR = "server busy, please try again.  maximum pending requests exceeded"
"""Ollama's 503 once ``OLLAMA_MAX_QUEUE`` requests wait (see ``max_queue``)."""

SIM_VERSION = "0.12.0-sim"
DEFAULT_EMBED_MODEL = "all-minilm"
DEFAULT_CHAT_MODEL = "llama3.2"

_FOREVER = math.inf
_JSON = b"application/json; charset=utf-8"
_NDJSON = b"application/x-ndjson"
_SSE = b"text/event-stream"


# ---------------------------------------------------------------------------
# Deterministic content: what tests recompute.


def _raw_embedding(text: str, model: str, dim: int) -> list[float]:
    """
    Pseudo-random values in [-1, 1) from sha256(model, text) and a counter.

    Each block adds 8 values, so the first ``d`` values do not depend on
    ``dim``: ``dimensions`` truncation and a smaller ``dim`` agree.
    """
    if dim < 1:
        raise ValueError(f"dim must be at least 1, not {dim}")
    seed = hashlib.sha256(
        canonical_model(model).encode("utf-8")
        + b"\0"
        + text.encode("utf-8", "surrogatepass")
    ).digest()
    out: list[float] = []
    counter = 0
    while len(out) < dim:
        block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        out.extend(v / 2147483648.0 for v in struct.unpack("<8i", block))
        counter += 1
    return out[:dim]


def expected_embedding(
    text: str, model: str = DEFAULT_EMBED_MODEL, dim: int = 384
) -> list[float]:
    """
    The vector the sim answers for ``text``: deterministic, L2-normalised.

    Tests recompute it to check every vector that came through the proxy.
    With ``dimensions`` the sim answers ``expected_embedding(text, model,
    dimensions)``, which is the full vector truncated and renormalised, as
    Ollama does.
    """
    raw = _raw_embedding(text, model, dim)
    norm = math.sqrt(math.fsum(v * v for v in raw))
    return [v / norm for v in raw]


def to_float32(vector: Sequence[float]) -> list[float]:
    """Round each value through float32, as a base64 answer carries it."""
    n = len(vector)
    return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *vector)))


def expected_embedding_f32(
    text: str, model: str = DEFAULT_EMBED_MODEL, dim: int = 384
) -> list[float]:
    """:func:`expected_embedding` rounded through float32 (base64 answers)."""
    return to_float32(expected_embedding(text, model, dim))


def encode_base64_f32(vector: Sequence[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def decode_base64_f32(data: str) -> list[float]:
    """The inverse of :func:`encode_base64_f32`, for tests and benchmarks."""
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


_TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """A stand-in tokenizer (words and punctuation) for the usage counts."""
    return len(_TOKEN.findall(text))


_WORDS = (
    "the", "gpu", "came", "back", "and", "every", "parked", "request",
    "was", "answered", "in", "order", "while", "tokens", "kept", "flowing",
)


def expected_reply(
    prompt: str, model: str = DEFAULT_CHAT_MODEL, chunks: int = 5
) -> list[str]:
    """
    The pieces the sim streams for ``prompt``; joined, the whole reply.

    For chat routes the prompt is :func:`messages_prompt` of the messages.
    """
    seed = hashlib.sha256(
        canonical_model(model).encode("utf-8")
        + b"\0reply\0"
        + prompt.encode("utf-8", "surrogatepass")
    ).digest()
    pieces = []
    for i in range(chunks):
        word = _WORDS[seed[i % len(seed)] % len(_WORDS)]
        pieces.append(word if i == 0 else " " + word)
    return pieces


def _content_text(content: Any) -> str:
    """OpenAI lets content be a list of parts; keep the text ones."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def messages_prompt(messages: Iterable[dict[str, Any]]) -> str:
    """The text a chat reply is derived from: ``role: content`` lines."""
    return "\n".join(
        f"{m.get('role', 'user')}: {_content_text(m.get('content'))}"
        for m in messages
    )


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
    return _FOREVER if seconds < 0 else seconds


def _iso(t: float) -> str:
    """RFC 3339 the way Ollama writes its timestamps."""
    if math.isinf(t):
        return "2318-01-01T00:00:00Z"
    return (
        datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
        .isoformat()
        .replace("+00:00", "Z")
    )


def _ns(seconds: float) -> int:
    """Ollama reports durations in integer nanoseconds."""
    return max(0, int(round(seconds * 1e9)))


def _model_details(name: str) -> tuple[dict[str, Any], int]:
    """Plausible ``details`` and size, so clients that parse them are happy."""
    lowered = name.lower()
    if any(k in lowered for k in ("minilm", "embed", "bge", "e5")):
        family, params, size = "bert", "23M", 45_960_996
    else:
        family, params, size = "llama", "3.2B", 2_019_393_189
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": params,
        "quantization_level": "F16" if family == "bert" else "Q4_K_M",
    }
    return details, size


def _digest(name: str) -> str:
    """A stable stand-in for a model's blob digest."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------
# Bookkeeping objects.


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


class _BadRequest(Exception):
    """A 400 with this message, in the route's error shape."""


@attrs.frozen
class _Route:
    """What a path is: its methods, whether it needs the model, its API."""

    methods: tuple[str, ...]
    kind: str  # "model" or "info"
    style: str  # "ollama" or "openai"
    op: str


_ROUTES: dict[str, _Route] = {
    "/api/embed": _Route(("POST",), "model", "ollama", "embed"),
    "/api/embeddings": _Route(("POST",), "model", "ollama", "embeddings"),
    "/v1/embeddings": _Route(("POST",), "model", "openai", "v1_embeddings"),
    "/api/chat": _Route(("POST",), "model", "ollama", "chat"),
    "/api/generate": _Route(("POST",), "model", "ollama", "generate"),
    "/v1/chat/completions": _Route(("POST",), "model", "openai", "v1_chat"),
    "/v1/completions": _Route(("POST",), "model", "openai", "v1_completions"),
    "/": _Route(("GET", "HEAD"), "info", "ollama", "root"),
    "/api/version": _Route(("GET", "HEAD"), "info", "ollama", "version"),
    "/api/tags": _Route(("GET", "HEAD"), "info", "ollama", "tags"),
    "/api/ps": _Route(("GET", "HEAD"), "info", "ollama", "ps"),
    "/v1/models": _Route(("GET", "HEAD"), "info", "openai", "v1_models"),
    "/_sim/stats": _Route(("GET", "HEAD"), "info", "ollama", "stats"),
}

_EMBED_OPS = ("embed", "embeddings", "v1_embeddings")

#: Names a Go template may call: text/template's builtins and keywords, and
#: the functions Ollama adds (``template/template.go``, ``funcs``).
_TEMPLATE_NAMES = frozenset(
    "if else end range with define template block break continue nil true false "
    "and or not len index slice eq ne lt le gt ge print printf println html js urlquery call "
    "json currentDate yesterdayDate toTypeScriptType".split()
)
_TEMPLATE_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_TEMPLATE_WORD = re.compile(r"(?:^|[|(\s])([A-Za-z_][A-Za-z0-9_]*)")
_TEMPLATE_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`')


def template_error(text: str) -> str | None:
    """Go's parse error for a ``template`` Ollama could not parse, in Go's words; None if it parses.

    Only the two mistakes a caller makes most (an unknown function, an
    unclosed action) are recognised; the message quotes the caller's
    template, as Ollama's 500 does (``server/routes.go``: ``template.Parse``).
    """
    for number, line in enumerate(text.split("\n"), start=1):
        if line.count("{{") > line.count("}}"):
            return f"template: :{number}: unclosed action"
        for action in _TEMPLATE_ACTION.findall(line):
            for word in _TEMPLATE_WORD.findall(_TEMPLATE_STRING.sub('""', action)):
                if word not in _TEMPLATE_NAMES:
                    return f'template: :{number}: function "{word}" not defined'
    return None


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


@attrs.define(eq=False)
class _LoadedModel:
    """A model in (simulated) VRAM; expires lazily, no timer needed."""

    name: str
    loaded_at: float
    expires_at: float
    busy: int = 0


@attrs.define(eq=False)
class _Loading:
    """A model load in progress, shared by every request that needs it."""

    started: float
    delayed: IDelayedCall | None = None
    waiters: list[_Job] = attrs.Factory(list)


class _TrackedConnection(ProtocolWrapper):
    """A connection the sim can abort, with Nagle off (see STYLE pitfall 9)."""

    def makeConnection(self, transport: Any) -> None:
        set_no_delay = getattr(transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
        super().makeConnection(transport)


class _TrackingFactory(WrappingFactory):
    """
    Knows every open connection, so ``refuse``, ``stop`` can abort them all,
    including idle keep-alive ones a client pool holds.
    """

    protocol = _TrackedConnection
    noisy = False

    def __init__(self, wrapped: Site) -> None:
        super().__init__(wrapped)
        self._idle_waiters: list[defer.Deferred[None]] = []

    def unregisterProtocol(self, p: Any) -> None:
        """A connection closed: wake :meth:`when_idle` waiters if none is left."""
        super().unregisterProtocol(p)
        if not self.protocols:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def abort_all(self) -> None:
        """Reset every open connection (``refuse``, ``stop``)."""
        for p in list(self.protocols):
            p.transport.abortConnection()

    def when_idle(self) -> defer.Deferred[None]:
        """Fires once no connection is open."""
        if not self.protocols:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._idle_waiters.append(d)
        return d


class _QuietSite(Site):
    """A Site without the access log and its once-a-second timer."""

    noisy = False
    displayTracebacks = False

    def startFactory(self) -> None:
        pass

    def stopFactory(self) -> None:
        pass

    def log(self, request: Any) -> None:
        pass


class _SimResource(Resource):
    """The ``twisted.web`` face of a :class:`SimOllama`: every path."""

    isLeaf = True

    def __init__(self, sim: SimOllama) -> None:
        super().__init__()
        self._sim = sim

    def render(self, request: Request) -> bytes | int:
        """Every method and path goes to the sim's dispatcher."""
        return self._sim._render(request)


def _non_negative(instance: Any, attribute: Any, value: float) -> None:
    """attrs validator: delays and sizes cannot be negative."""
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, not {value!r}")


def _at_least_one(instance: Any, attribute: Any, value: int) -> None:
    """attrs validator: counts that must be positive."""
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, not {value!r}")


# ---------------------------------------------------------------------------
# The simulated backend.


@attrs.define(eq=False)
class SimOllama:
    """
    A simulated Ollama: deterministic answers, a parallel cap, outage modes.

    :param reactor: ``IReactorTime`` (and ``IReactorTCP`` for
        :meth:`listen`); a :class:`~twisted.internet.task.Clock` is enough
        when the resource is driven in memory.
    :param latency: seconds each model request takes once served (for
        chat/generate: before the first chunk).
    :param per_item_latency: extra seconds per input text (embed routes).
    :param parallel: requests served at once, like ``OLLAMA_NUM_PARALLEL``;
        the rest wait in the sim's own FIFO.
    :param chunk_delay: seconds between streamed lines (chat/generate).
    :param chunks: content pieces per reply; a stream has one more line, the
        closing ``done`` one.
    :param dim: embedding dimension.
    :param load_seconds: model load time, paid on first use after an unload.
    :param default_keep_alive: seconds a model stays loaded after its last
        request, when the request does not say.
    :param context_length: tokens per input; longer inputs are refused only
        with ``truncate: false``, as Ollama does.
    :param max_queue: requests that may wait for a slot, like
        ``OLLAMA_MAX_QUEUE``; one more is answered 503 :data:`BUSY_ERROR`.
    :param max_num_ctx: the largest ``options.num_ctx`` whose load fits in
        (simulated) VRAM; a request asking for more fails alone with
        :data:`LOAD_OOM_ERROR`, as a real one does (0: no limit).
    :param models: model names ``/api/tags`` lists from the start.
    :param history_size: how many :class:`SimRequest` records to keep.
    :param mode: the initial outage mode (see :data:`MODES`).
    """

    _reactor: Any = attrs.field(alias="reactor")
    latency: float = attrs.field(default=0.0, validator=_non_negative)
    per_item_latency: float = attrs.field(default=0.0, validator=_non_negative)
    parallel: int = attrs.field(default=4, validator=_at_least_one)
    chunk_delay: float = attrs.field(default=0.0, validator=_non_negative)
    chunks: int = attrs.field(default=5, validator=_at_least_one)
    dim: int = attrs.field(default=384, validator=_at_least_one)
    load_seconds: float = attrs.field(default=0.0, validator=_non_negative)
    default_keep_alive: float = attrs.field(default=300.0, validator=_non_negative)
    context_length: int = attrs.field(default=512, validator=_at_least_one)
    max_queue: int = attrs.field(default=512, validator=_non_negative)
    max_num_ctx: int = attrs.field(default=0, validator=_non_negative)
    models: tuple[str, ...] = attrs.field(
        default=(DEFAULT_EMBED_MODEL, DEFAULT_CHAT_MODEL), converter=tuple
    )
    history_size: int = attrs.field(default=10_000, validator=_at_least_one)
    _mode: str = attrs.field(
        default="ok", alias="mode", validator=attrs.validators.in_(MODES)
    )

    requests_total: collections.Counter[str] = attrs.field(
        init=False, repr=False, factory=collections.Counter
    )
    """Requests seen, by path (every path, known or not)."""
    texts_embedded: collections.Counter[str] = attrs.field(
        init=False, repr=False, factory=collections.Counter
    )
    """Every text embedded and answered, with how many times."""
    mode_hits: collections.Counter[tuple[str, str]] = attrs.field(
        init=False, repr=False, factory=collections.Counter
    )
    """Requests by (mode on arrival, path)."""
    outcomes: collections.Counter[str] = attrs.field(
        init=False, repr=False, factory=collections.Counter
    )
    """Finished requests by :attr:`SimRequest.outcome`."""
    history: collections.deque[SimRequest] = attrs.field(init=False, repr=False)
    peak_in_flight: int = attrs.field(init=False, repr=False, default=0)
    peak_serving: int = attrs.field(init=False, repr=False, default=0)

    _jobs: set[_Job] = attrs.field(init=False, repr=False, factory=set)
    _waiting: collections.deque[_Job] = attrs.field(
        init=False, repr=False, factory=collections.deque
    )
    _serving: set[_Job] = attrs.field(init=False, repr=False, factory=set)
    _pumping: bool = attrs.field(init=False, repr=False, default=False)
    _loaded: dict[str, _LoadedModel] = attrs.field(init=False, repr=False, factory=dict)
    _loading: dict[str, _Loading] = attrs.field(init=False, repr=False, factory=dict)
    _known: dict[str, None] = attrs.field(init=False, repr=False, factory=dict)
    _serial: int = attrs.field(init=False, repr=False, default=0)
    _factory: _TrackingFactory | None = attrs.field(init=False, repr=False, default=None)
    _port: IListeningPort | None = attrs.field(init=False, repr=False, default=None)
    _port_number: int | None = attrs.field(init=False, repr=False, default=None)
    _interface: str = attrs.field(init=False, repr=False, default="127.0.0.1")
    _listening: bool = attrs.field(init=False, repr=False, default=False)
    _port_lock: defer.DeferredLock = attrs.field(
        init=False, repr=False, factory=defer.DeferredLock
    )

    def __attrs_post_init__(self) -> None:
        self.history = collections.deque(maxlen=self.history_size)
        for name in self.models:
            self._known[canonical_model(name)] = None

    # -- public state ------------------------------------------------------

    @property
    def mode(self) -> str:
        """The current outage mode; change it with :meth:`set_mode`."""
        return self._mode

    @property
    def in_flight(self) -> int:
        """Model requests received and not yet answered (queued, served, hung)."""
        return len(self._jobs)

    @property
    def serving(self) -> int:
        """Model requests holding one of the ``parallel`` slots."""
        return len(self._serving)

    @property
    def queued(self) -> int:
        """Model requests waiting in the sim's FIFO for a slot."""
        return len(self._waiting)

    @property
    def open_connections(self) -> int:
        """TCP connections open to the listener now (idle keep-alive ones too)."""
        return len(self._factory.protocols) if self._factory is not None else 0

    @property
    def port(self) -> int | None:
        """The bound TCP port (kept while ``refuse`` closes it), or None."""
        return self._port_number

    @property
    def url(self) -> str:
        """``http://interface:port`` of the listener."""
        if self._port_number is None:
            raise RuntimeError("not listening")
        return f"http://{self._interface}:{self._port_number}"

    def reset_peak(self) -> None:
        """Start the peaks afresh from what is in flight now."""
        self.peak_in_flight = len(self._jobs)
        self.peak_serving = len(self._serving)

    def loaded_models(self) -> list[str]:
        """Canonical names of the models loaded now (what ``/api/ps`` lists)."""
        self._prune()
        return sorted(self._loaded)

    def resource(self) -> Resource:
        """The ``twisted.web`` resource serving every route of this sim."""
        return _SimResource(self)

    def stats(self) -> dict[str, Any]:
        """The counters as plain JSON data (also at ``GET /_sim/stats``)."""
        return {
            "mode": self._mode,
            "in_flight": self.in_flight,
            "serving": self.serving,
            "queued": self.queued,
            "open_connections": self.open_connections,
            "peak_in_flight": self.peak_in_flight,
            "peak_serving": self.peak_serving,
            "requests_total": dict(self.requests_total),
            "outcomes": dict(self.outcomes),
            "texts_embedded": sum(self.texts_embedded.values()),
            "distinct_texts_embedded": len(self.texts_embedded),
            "loaded": self.loaded_models(),
        }

    # -- listening and modes -------------------------------------------------

    def listen(
        self, port: int = 0, interface: str = "127.0.0.1"
    ) -> defer.Deferred[int]:
        """
        Listen on ``interface:port`` (0 picks a free port).

        The sim owns its port so that ``refuse`` can close it and reopen the
        same one.

        :returns: a Deferred firing with the bound port number.
        """
        if self._listening:
            raise RuntimeError("already listening")
        self._listening = True
        self._interface = interface
        if self._factory is None:
            self._factory = _TrackingFactory(
                _QuietSite(self.resource(), reactor=self._reactor, timeout=None)
            )

        def bind() -> Any:
            listening = self._reactor.listenTCP(
                port, self._factory, interface=interface
            )
            self._port = listening
            self._port_number = listening.getHost().port
            if self._mode == "refuse":
                return self._close_port().addCallback(lambda _: self._port_number)
            return self._port_number

        def failed(f: Any) -> Any:
            self._listening = False
            return f

        return self._port_lock.run(bind).addErrback(failed)

    def set_mode(self, mode: str) -> defer.Deferred[None]:
        """
        Switch the outage mode.

        ``reset`` and ``refuse`` abort every model request in flight;
        ``refuse`` also closes the listening port and every open connection;
        leaving ``refuse`` listens again on the same port.  Requests already
        queued or served keep going through ``error500`` and ``hang``: those
        modes apply to requests that arrive afterwards.  A request that hit
        ``hang`` stays hung after the mode changes back, until its client
        leaves, ``reset``/``refuse`` aborts it, or :meth:`stop`.  Without a
        port of its own (the resource driven in memory), ``refuse`` aborts
        each request on arrival.

        :returns: a Deferred that fires once the port is closed or open again
            (at once when the port is not involved).
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        old, self._mode = self._mode, mode
        if mode in ("reset", "refuse"):
            outcome = "reset" if mode == "reset" else "refused"
            for job in list(self._jobs):
                self._abort_job(job, outcome)
        if self._listening and mode == "refuse" and old != "refuse":
            return self._port_lock.run(self._close_port)
        if self._listening and old == "refuse" and mode != "refuse":
            return self._port_lock.run(self._open_port)
        return defer.succeed(None)

    def stop(self) -> defer.Deferred[None]:
        """
        Stop listening, abort every connection, cancel every timer.

        :returns: a Deferred that fires once the port is closed and every
            connection is gone.
        """
        self._listening = False
        for job in list(self._jobs):
            self._abort_job(job, "stopped")
        for loading in self._loading.values():
            if loading.delayed is not None and loading.delayed.active():
                loading.delayed.cancel()
        self._loading.clear()
        if self._factory is None:
            return defer.succeed(None)
        return self._port_lock.run(self._close_port)

    def _close_port(self) -> defer.Deferred[None]:
        """Stop accepting, then abort what is open; fires when all is closed."""
        waits: list[defer.Deferred[Any]] = []
        port, self._port = self._port, None
        if port is not None:
            waits.append(defer.maybeDeferred(port.stopListening))
        if self._factory is not None:
            self._factory.abort_all()
            waits.append(self._factory.when_idle())
        return defer.gatherResults(waits, consumeErrors=True).addCallback(
            lambda _: None
        )

    def _open_port(self) -> None:
        """Listen again on the port ``refuse`` closed."""
        if self._port is None and self._listening:
            self._port = self._reactor.listenTCP(
                self._port_number, self._factory, interface=self._interface
            )

    # -- dispatch ------------------------------------------------------------

    def _render(self, request: Request) -> bytes | int:
        """Count, record, then route by path; model routes answer later."""
        path = request.path.decode("latin-1")
        method = request.method.decode("latin-1")
        now = self._reactor.seconds()
        mode = self._mode
        self.requests_total[path] += 1
        self.mode_hits[(mode, path)] += 1
        record = SimRequest(method=method, path=path, mode=mode, received_at=now)
        self.history.append(record)
        route = _ROUTES.get(path)
        style = route.style if route else ("openai" if path.startswith("/v1/") else "ollama")

        if mode == "refuse":
            # Only reached without our own port (e.g. in memory): drop it.
            return self._abort_request(request, record, "refused")
        if route is None:
            return self._error(request, record, 404, style, "404 page not found", "not_found")
        if method not in route.methods:
            return self._error(request, record, 405, style, "405 method not allowed", "bad_request")
        if route.kind == "info":
            return self._info(request, record, route)
        if mode == "reset":
            return self._abort_request(request, record, "reset")

        try:
            body = self._read_json(request)
            job = self._parse(request, record, route, body, now)
        except _BadRequest as e:
            return self._error(request, record, 400, style, str(e), "bad_request")
        record.model = job.model
        record.texts = len(job.texts)

        if mode == "error500":
            return self._error(request, record, 500, style, OOM_ERROR, "error500")
        if self.max_num_ctx and job.num_ctx > self.max_num_ctx:
            # This request's own context does not fit: its load fails, the GPU is fine.
            return self._error(request, record, 500, style, LOAD_OOM_ERROR, "error500")
        if job.template_error is not None:
            # Ollama loads the model, then parses the caller's template: a 500 quoting it.
            return self._error(request, record, 500, style, job.template_error, "template_error")
        if job.load_only and job.keep_alive == 0:
            return self._unload(request, record, job)
        if len(self._serving) >= self.parallel and len(self._waiting) >= self.max_queue:
            return self._error(request, record, 503, style, BUSY_ERROR, "busy")

        self._jobs.add(job)
        self.peak_in_flight = max(self.peak_in_flight, len(self._jobs))
        request.notifyFinish().addBoth(self._request_gone, job)
        if mode == "hang":
            job.state = "hung"
            return NOT_DONE_YET
        job.state = "queued"
        self._waiting.append(job)
        self._pump()
        return NOT_DONE_YET

    def _finish_record(self, record: SimRequest, outcome: str) -> None:
        """Note how a request ended, for tests to read."""
        record.outcome = outcome
        record.finished_at = self._reactor.seconds()
        self.outcomes[outcome] += 1

    def _abort_request(self, request: Request, record: SimRequest, outcome: str) -> int:
        """A TCP reset instead of an answer."""
        self._finish_record(record, outcome)
        request.transport.abortConnection()
        return NOT_DONE_YET

    def _error(
        self,
        request: Request,
        record: SimRequest,
        code: int,
        style: str,
        message: str,
        outcome: str,
    ) -> bytes:
        """An error in the route's API shape (Ollama's or OpenAI's)."""
        self._finish_record(record, outcome)
        request.setResponseCode(code)
        request.setHeader(b"content-type", _JSON)
        return _dumps(_error_body(style, code, message))

    def _read_json(self, request: Request) -> dict[str, Any]:
        """The request body as a JSON object, or a 400 in Ollama's words."""
        raw = request.content.read() if request.content is not None else b""
        if not raw.strip():
            raise _BadRequest("missing request body")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _BadRequest(f"invalid character in request body: {e}") from None
        if not isinstance(body, dict):
            raise _BadRequest("json: cannot unmarshal into a request object")
        return body

    def _parse(
        self,
        request: Request,
        record: SimRequest,
        route: _Route,
        body: dict[str, Any],
        now: float,
    ) -> _Job:
        """Validate a model request the way Ollama does; build its job."""
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise _BadRequest("model is required")
        try:
            keep_alive = parse_keep_alive(body.get("keep_alive"), self.default_keep_alive)
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        job = _Job(
            request=request,
            record=record,
            route=route,
            model=model,
            key=canonical_model(model),
            keep_alive=keep_alive,
            arrived=now,
        )
        options = body.get("options")
        if isinstance(options, dict) and isinstance(options.get("num_ctx"), int):
            job.num_ctx = options["num_ctx"]
        op = route.op
        if op in _EMBED_OPS:
            self._parse_embed(job, body)
        elif op == "generate":
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise _BadRequest("prompt must be a string")
            job.prompt = prompt
            job.load_only = prompt == ""
            job.stream = body.get("stream", True) is not False
            template = body.get("template")
            if isinstance(template, str) and template and not job.load_only:
                job.template_error = template_error(template)
        elif op == "chat":
            messages = body.get("messages") or []
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise _BadRequest("messages must be a list of objects")
            job.prompt = messages_prompt(messages)
            job.load_only = not messages
            job.stream = body.get("stream", True) is not False
        elif op == "v1_chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) for m in messages
            ):
                raise _BadRequest("messages is required and must be a list of objects")
            job.prompt = messages_prompt(messages)
            self._parse_v1_stream(job, body)
        elif op == "v1_completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise _BadRequest("prompt must be a string")
            job.prompt = prompt
            self._parse_v1_stream(job, body)
        return job

    def _parse_v1_stream(self, job: _Job, body: dict[str, Any]) -> None:
        """OpenAI streams only when asked (``stream: true``)."""
        job.stream = body.get("stream") is True
        options = body.get("stream_options")
        job.include_usage = isinstance(options, dict) and options.get("include_usage") is True

    def _parse_embed(self, job: _Job, body: dict[str, Any]) -> None:
        """Inputs of the three embed routes, with their own rules."""
        op = job.route.op
        if op == "embeddings":
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise _BadRequest("prompt must be a string")
            job.texts = [prompt] if prompt else []
            job.load_only = not prompt
            return
        raw = body.get("input")
        if op == "embed" and raw is None:
            raw = []
        if isinstance(raw, str):
            texts = [raw]
        elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
            texts = list(raw)
        else:
            raise _BadRequest("invalid input type")
        if op == "v1_embeddings":
            if not texts:
                raise _BadRequest("invalid input")
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise _BadRequest(f"invalid encoding format: {fmt!r}")
            job.encoding_format = fmt
        job.texts = texts
        job.load_only = not texts
        dimensions = body.get("dimensions")
        if dimensions is not None:
            if not isinstance(dimensions, int) or isinstance(dimensions, bool):
                raise _BadRequest("dimensions must be an integer")
            if 0 < dimensions < self.dim:
                job.dimensions = dimensions
        if body.get("truncate") is False:
            for text in texts:
                if count_tokens(text) > self.context_length:
                    raise _BadRequest("input length exceeds maximum context length")

    # -- the queue -----------------------------------------------------------

    def _pump(self) -> None:
        """Start queued jobs, oldest first, while a slot is free."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._waiting and len(self._serving) < self.parallel:
                self._start(self._waiting.popleft())
        finally:
            self._pumping = False

    def _start(self, job: _Job) -> None:
        """A slot is free: load the model if need be, then do the work."""
        job.state = "serving"
        job.started = self._reactor.seconds()
        self._serving.add(job)
        self.peak_serving = max(self.peak_serving, len(self._serving))
        self._prune()
        self._known[job.key] = None
        if job.key in self._loaded:
            self._model_ready(job)
            return
        if self.load_seconds <= 0:
            self._loaded[job.key] = _LoadedModel(job.key, job.started, job.started)
            self._model_ready(job)
            return
        loading = self._loading.get(job.key)
        if loading is None:
            loading = _Loading(started=job.started)
            loading.delayed = self._reactor.callLater(
                self.load_seconds, self._load_done, job.key
            )
            self._loading[job.key] = loading
        loading.waiters.append(job)

    def _load_done(self, key: str) -> None:
        """The model is loaded: every request that waited for it proceeds."""
        loading = self._loading.pop(key)
        now = self._reactor.seconds()
        self._loaded[key] = _LoadedModel(key, now, now + self.default_keep_alive)
        for job in list(loading.waiters):
            if job.state == "serving":
                job.load_wait = now - job.started
                self._model_ready(job)

    def _model_ready(self, job: _Job) -> None:
        """The model is in memory: schedule the answer."""
        self._loaded[job.key].busy += 1
        job.holds_model = True
        op = job.route.op
        if job.load_only:
            self._guarded(job, self._answer_load, job)
        elif op in _EMBED_OPS:
            delay = self.latency + self.per_item_latency * len(job.texts)
            self._after(job, delay, self._answer_embed, job)
        elif job.stream:
            self._after(job, self.latency, self._stream_step, job, 0)
        else:
            delay = self.latency + self.chunk_delay * self.chunks
            self._after(job, delay, self._answer_reply, job)

    def _after(self, job: _Job, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Run a step of ``job`` after ``delay`` (at once when 0)."""
        if delay <= 0:
            self._guarded(job, fn, *args)
        else:
            job.timer = self._reactor.callLater(delay, self._guarded, job, fn, *args)

    def _guarded(self, job: _Job, fn: Callable[..., None], *args: Any) -> None:
        """A bug in one step must answer its request, not leave it hanging."""
        job.timer = None
        if job.state != "serving":
            return
        try:
            fn(*args)
        except Exception:
            _log.failure("sim step failed for {path}", path=job.record.path)
            if job.state == "serving":
                if job.headers_sent:
                    self._abort_job(job, "error500")
                else:
                    body = _error_body(job.route.style, 500, "sim internal error")
                    self._reply_json(job, 500, body, "error500")

    def _request_gone(self, result: Any, job: _Job) -> None:
        """notifyFinish fired: answered, or the client went away."""
        self._retire(job, "ok" if job.answered else "abandoned")

    def _retire(self, job: _Job, outcome: str) -> None:
        """Release everything a job holds; idempotent."""
        if job.state == "done":
            return
        previous, job.state = job.state, "done"
        if job.timer is not None and job.timer.active():
            job.timer.cancel()
        job.timer = None
        self._jobs.discard(job)
        if previous == "queued":
            try:
                self._waiting.remove(job)
            except ValueError:
                pass
        self._finish_record(job.record, outcome)
        if previous == "serving":
            self._serving.discard(job)
            loading = self._loading.get(job.key)
            if loading is not None and job in loading.waiters:
                loading.waiters.remove(job)
            if job.holds_model:
                self._release_model(job)
            self._pump()

    def _abort_job(self, job: _Job, outcome: str) -> None:
        """Drop a job's connection with a TCP reset."""
        transport = job.request.transport
        self._retire(job, outcome)
        if transport is not None:
            transport.abortConnection()

    # -- models --------------------------------------------------------------

    def _prune(self) -> None:
        """Forget models whose keep-alive ran out (lazy: no timers)."""
        now = self._reactor.seconds()
        for name in [n for n, m in self._loaded.items() if m.busy == 0 and m.expires_at <= now]:
            del self._loaded[name]

    def _release_model(self, job: _Job) -> None:
        """The keep-alive clock starts when a model's last request ends."""
        job.holds_model = False
        model = self._loaded.get(job.key)
        if model is None:
            return
        model.busy = max(0, model.busy - 1)
        model.expires_at = self._reactor.seconds() + job.keep_alive
        self._prune()

    def _unload(self, request: Request, record: SimRequest, job: _Job) -> bytes:
        """``keep_alive: 0`` and nothing to do: how Ollama unloads a model."""
        model = self._loaded.get(job.key)
        if model is not None:
            if model.busy:
                model.expires_at = self._reactor.seconds()
            else:
                del self._loaded[job.key]
        self._finish_record(record, "ok")
        request.setHeader(b"content-type", _JSON)
        return _dumps(self._load_body(job, "unload"))

    def _load_body(self, job: _Job, reason: str) -> dict[str, Any]:
        """The answer to a load-only or unload request, per route."""
        now = self._reactor.seconds()
        op = job.route.op
        if op == "embed":
            return {
                "model": job.model,
                "embeddings": [],
                "total_duration": _ns(now - job.arrived),
                "load_duration": _ns(job.load_wait),
                "prompt_eval_count": 0,
            }
        if op == "embeddings":
            return {"embedding": []}
        body: dict[str, Any] = {"model": job.model, "created_at": _iso(now)}
        if op == "chat":
            body["message"] = {"role": "assistant", "content": ""}
        else:
            body["response"] = ""
        body["done"] = True
        body["done_reason"] = reason
        return body

    # -- answers -------------------------------------------------------------

    def _reply_json(self, job: _Job, code: int, body: Any, outcome: str = "ok") -> None:
        """Answer a job with one JSON document and free its slot."""
        data = _dumps(body)
        request = job.request
        request.setResponseCode(code)
        request.setHeader(b"content-type", _JSON)
        request.setHeader(b"content-length", b"%d" % len(data))
        job.headers_sent = True
        request.write(data)
        self._end(job, outcome)

    def _end(self, job: _Job, outcome: str = "ok") -> None:
        """Finish the response; ``answered`` tells notifyFinish it was not abandoned."""
        job.answered = True
        if not job.request.finished:
            job.request.finish()
        self._retire(job, outcome)

    def _answer_load(self, job: _Job) -> None:
        """A load-only request: the model is in memory now."""
        self._reply_json(job, 200, self._load_body(job, "load"))

    def _vector(self, job: _Job, text: str) -> list[float]:
        """The vector for ``text``, honouring the request's ``dimensions``."""
        return expected_embedding(text, job.model, job.dimensions or self.dim)

    def _answer_embed(self, job: _Job) -> None:
        """Answer one of the three embed routes in its own shape."""
        now = self._reactor.seconds()
        vectors = [self._vector(job, text) for text in job.texts]
        self.texts_embedded.update(job.texts)
        tokens = sum(count_tokens(t) for t in job.texts)
        op = job.route.op
        if op == "embed":
            body: dict[str, Any] = {
                "model": job.model,
                "embeddings": vectors,
                "total_duration": _ns(now - job.arrived),
                "load_duration": _ns(job.load_wait),
                "prompt_eval_count": tokens,
            }
        elif op == "embeddings":
            body = {"embedding": vectors[0]}
        else:
            encode = encode_base64_f32 if job.encoding_format == "base64" else (lambda v: v)
            body = {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": encode(v)}
                    for i, v in enumerate(vectors)
                ],
                "model": job.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        self._reply_json(job, 200, body)

    def _durations(self, job: _Job) -> dict[str, Any]:
        """The timing fields of Ollama's final chat/generate object."""
        now = self._reactor.seconds()
        return {
            "total_duration": _ns(now - job.arrived),
            "load_duration": _ns(job.load_wait),
            "prompt_eval_count": count_tokens(job.prompt),
            "prompt_eval_duration": _ns(self.latency),
            "eval_count": self.chunks,
            "eval_duration": _ns(self.chunk_delay * self.chunks),
        }

    def _usage(self, job: _Job) -> dict[str, int]:
        """OpenAI's usage block for a reply."""
        prompt = count_tokens(job.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.chunks,
            "total_tokens": prompt + self.chunks,
        }

    def _completion_id(self, prefix: str) -> str:
        """Unique ids per sim, for OpenAI completion objects."""
        self._serial += 1
        return f"{prefix}-{self._serial}"

    def _answer_reply(self, job: _Job) -> None:
        """A whole reply at once (``stream: false``)."""
        text = "".join(expected_reply(job.prompt, job.model, self.chunks))
        now = self._reactor.seconds()
        op = job.route.op
        if op in ("chat", "generate"):
            body: dict[str, Any] = {"model": job.model, "created_at": _iso(now)}
            if op == "chat":
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["response"] = text
            body.update({"done": True, "done_reason": "stop"})
            body.update(self._durations(job))
        elif op == "v1_chat":
            body = {
                "id": self._completion_id("chatcmpl"),
                "object": "chat.completion",
                "created": int(now),
                "model": job.model,
                "system_fingerprint": "fp_ollama",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": self._usage(job),
            }
        else:
            body = {
                "id": self._completion_id("cmpl"),
                "object": "text_completion",
                "created": int(now),
                "model": job.model,
                "system_fingerprint": "fp_ollama",
                "choices": [{"text": text, "index": 0, "finish_reason": "stop"}],
                "usage": self._usage(job),
            }
        self._reply_json(job, 200, body)

    def _stream_step(self, job: _Job, i: int) -> None:
        """Write line ``i`` of a stream; the line after the last piece closes it."""
        request = job.request
        op = job.route.op
        openai = op.startswith("v1_")
        if not job.headers_sent:
            request.setResponseCode(200)
            request.setHeader(b"content-type", _SSE if openai else _NDJSON)
            if openai:
                request.setHeader(b"cache-control", b"no-cache")
                job.stream_id = self._completion_id("chatcmpl" if op == "v1_chat" else "cmpl")
            job.headers_sent = True
        pieces = expected_reply(job.prompt, job.model, self.chunks)
        if openai:
            request.write(b"".join(self._sse_lines(job, i, pieces)))
        else:
            request.write(_dumps(self._ndjson_line(job, i, pieces)) + b"\n")
        if i < len(pieces):
            self._after(job, self.chunk_delay, self._stream_step, job, i + 1)
        else:
            self._end(job)

    def _ndjson_line(self, job: _Job, i: int, pieces: list[str]) -> dict[str, Any]:
        """Ollama's streamed object for line ``i``; the last carries ``done``."""
        done = i >= len(pieces)
        piece = "" if done else pieces[i]
        line: dict[str, Any] = {"model": job.model, "created_at": _iso(self._reactor.seconds())}
        if job.route.op == "chat":
            line["message"] = {"role": "assistant", "content": piece}
        else:
            line["response"] = piece
        line["done"] = done
        if done:
            line["done_reason"] = "stop"
            line.update(self._durations(job))
        return line

    def _sse_lines(self, job: _Job, i: int, pieces: list[str]) -> list[bytes]:
        """OpenAI chunks of line ``i``; the last adds usage and ``[DONE]``."""
        done = i >= len(pieces)
        chat = job.route.op == "v1_chat"
        base = {
            "id": job.stream_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(self._reactor.seconds()),
            "model": job.model,
            "system_fingerprint": "fp_ollama",
        }
        piece = "" if done else pieces[i]
        finish = "stop" if done else None
        if chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": piece}, "finish_reason": finish}
        else:
            choice = {"text": piece, "index": 0, "finish_reason": finish}
        out = [_sse(dict(base, choices=[choice]))]
        if done:
            if job.include_usage:
                out.append(_sse(dict(base, choices=[], usage=self._usage(job))))
            out.append(b"data: [DONE]\n\n")
        return out

    # -- info routes -----------------------------------------------------------

    def _info(self, request: Request, record: SimRequest, route: _Route) -> bytes:
        """Routes that never touch the model; they answer in every mode but refuse."""
        self._finish_record(record, "ok")
        if route.op == "root":
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"Ollama is running"
        if route.op == "version":
            body: Any = {"version": SIM_VERSION}
        elif route.op == "tags":
            body = {"models": [self._model_entry(name) for name in self._known]}
        elif route.op == "ps":
            self._prune()
            body = {"models": [self._ps_entry(m) for m in self._loaded.values()]}
        elif route.op == "v1_models":
            body = {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "library"}
                    for name in self._known
                ],
            }
        else:
            body = self.stats()
        request.setHeader(b"content-type", _JSON)
        return _dumps(body)

    def _model_entry(self, name: str) -> dict[str, Any]:
        """A model as ``/api/tags`` lists it."""
        details, size = _model_details(name)
        return {
            "name": name,
            "model": name,
            "modified_at": _iso(0),
            "size": size,
            "digest": _digest(name),
            "details": details,
        }

    def _ps_entry(self, model: _LoadedModel) -> dict[str, Any]:
        """A loaded model as ``/api/ps`` lists it."""
        entry = self._model_entry(model.name)
        del entry["modified_at"]
        entry["expires_at"] = _iso(_FOREVER if model.busy else model.expires_at)
        entry["size_vram"] = entry["size"]
        entry["context_length"] = self.context_length
        return entry


def _dumps(obj: Any) -> bytes:
    """Compact JSON, as Ollama writes it."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def _sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj``."""
    return b"data: " + _dumps(obj) + b"\n\n"


def _error_body(style: str, code: int, message: str) -> dict[str, Any]:
    """Ollama's ``{"error": "..."}`` or OpenAI's ``{"error": {...}}``."""
    if style == "ollama":
        return {"error": message}
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
    }.get(code, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


# ---------------------------------------------------------------------------
# Command line.


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {port}")
    return port


def _parser(prog: str = "python -m yieldproxy.sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="A simulated Ollama backend (deterministic answers, outage modes).",
    )
    p.add_argument("--port", type=_port, default=11434, help="TCP port, 0 for any free one (default 11434)")
    p.add_argument("--interface", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per model request")
    p.add_argument("--per-item-latency", type=float, default=0.0, help="extra seconds per input text")
    p.add_argument("--parallel", type=int, default=4, help="requests served at once (OLLAMA_NUM_PARALLEL)")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between streamed chunks")
    p.add_argument("--chunks", type=int, default=5, help="content chunks per reply")
    p.add_argument("--dim", type=int, default=384, help="embedding dimension")
    p.add_argument("--load-seconds", type=float, default=0.0, help="model load time")
    p.add_argument("--mode", choices=MODES, default="ok", help="initial outage mode")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SimOllama keyword arguments the command line gives."""
    return {
        "latency": args.latency,
        "per_item_latency": args.per_item_latency,
        "parallel": args.parallel,
        "chunk_delay": args.chunk_delay,
        "chunks": args.chunks,
        "dim": args.dim,
        "load_seconds": args.load_seconds,
        "mode": args.mode,
    }


def _run(reactor: Any, args: argparse.Namespace, prog: str) -> defer.Deferred[None]:
    """Listen, say where, and serve until the reactor stops.

    A port that cannot be bound (in use, say) ends it with one line naming
    the option, and exit status 1.
    """
    from .listen_errors import interface_at_fault, why_cannot_listen

    sim = SimOllama(reactor, **_settings(args))
    forever: defer.Deferred[None] = defer.Deferred()

    def bound(port: int) -> defer.Deferred[None]:
        print(f"listening on {args.interface}:{port}", flush=True)
        reactor.addSystemEventTrigger("before", "shutdown", sim.stop)
        return forever

    def cannot_listen(failure: Any) -> None:
        option = f"--interface {args.interface}" if interface_at_fault(failure.value) else f"--port {args.port}"
        print(
            f"{prog}: {option}: cannot listen on {args.interface}:{args.port}: {why_cannot_listen(failure.value)}",
            file=sys.stderr,
        )
        raise SystemExit(1)

    return sim.listen(args.port, args.interface).addCallbacks(bound, cannot_listen)


def main(argv: Sequence[str] | None = None, prog: str = "python -m yieldproxy.sim") -> None:
    """``python -m yieldproxy.sim`` (``prog`` names it in messages): the only place that uses the global reactor."""
    from twisted.internet import task
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        # Validate the settings before binding anything.
        SimOllama(None, **_settings(args))
    except ValueError as e:
        parser.error(str(e))
    globalLogBeginner.beginLoggingTo(
        [
            FilteringLogObserver(
                textFileLogObserver(sys.stderr),
                [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)],
            )
        ],
        redirectStandardIO=False,
    )
    task.react(_run, (args, prog))


if __name__ == "__main__":
    main()
