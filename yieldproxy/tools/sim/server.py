"""
The simulated backend: :class:`SimOllama`, the one object a test holds.

It owns the parts (the :class:`~.jobs.Scheduler`, the
:class:`~.models.ModelStore`, the :class:`~.listening.Listener`), follows
every request through them, and asks the :class:`~.api.Api` of the server it
plays for routes, request checks and answer bodies.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import attrs
from twisted.internet import defer
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from .api import JSON, Api, BadRequest, Reply, Route, dumps
from .content import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL, canonical_model, expected_reply
from .infinity import INFINITY
from .jobs import Job, Scheduler, SimRequest
from .listening import Listener, SimResource
from .llamacpp import LLAMACPP
from .models import ModelStore
from .modes import MODES
from .ollama import OLLAMA
from .tei import TEI

#: The servers the sim can play (``api``), by the name ``--api`` takes.
APIS: dict[str, Api] = {api.name: api for api in (OLLAMA, TEI, INFINITY, LLAMACPP)}

#: The models a sim has when not told: the demo's embedding model and a chat model.
DEFAULT_MODELS = (DEFAULT_EMBED_MODEL, DEFAULT_CHAT_MODEL)

#: The modes one model may be in (:meth:`SimOllama.set_model_mode`).
_MODEL_MODES = ("ok", "hang", "error500", "error500_unknown")

#: Bytes of a whole answer's body a ``stall`` sends before it stops.
STALL_BYTES = 16

#: The outcome a request refused by the sim itself ends with, per failure.
_OUTCOMES = {
    "not_found": "not_found",
    "model_not_found": "not_found",
    "method": "bad_request",
    "busy": "busy",
    "outage": "error500",
    "outage_unknown": "error500",
    "load_oom": "error500",
    "template": "template_error",
    "internal": "error500",
    "loading": "loading",
}


def _non_negative(instance: Any, attribute: Any, value: float) -> None:
    """attrs validator: delays and sizes cannot be negative."""
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, not {value!r}")


def _at_least_one(instance: Any, attribute: Any, value: int) -> None:
    """attrs validator: counts that must be positive."""
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, not {value!r}")


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
    :param models: the models the server has (the default: :data:`DEFAULT_MODELS`), listed,
        described and served; a request naming another gets Ollama's 404, as for a model never
        pulled (:func:`.ollama.model_not_found`).  A server of one model (every ``api`` but
        ``ollama``) serves the first, whatever the request names.
    :param api: the server to play: ``ollama``, ``tei``, ``infinity`` or ``llamacpp``
        (docs/servers.md, *The simulated servers*).  For ``llamacpp``, ``load_seconds`` is its
        start-up load, paid again after ``refuse`` or ``reset`` (a restarted server).
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
    models: tuple[str, ...] = attrs.field(default=DEFAULT_MODELS, converter=tuple)
    api: str = attrs.field(default="ollama", validator=attrs.validators.in_(tuple(APIS)))
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
    """Every text a batch route ran the model on and answered (embedded, ranked, classified), with how many times."""
    mode_hits: collections.Counter[tuple[str, str]] = attrs.field(
        init=False, repr=False, factory=collections.Counter
    )
    """Requests by (mode on arrival, path)."""
    outcomes: collections.Counter[str] = attrs.field(
        init=False, repr=False, factory=collections.Counter
    )
    """Finished requests by :attr:`SimRequest.outcome`."""
    model_modes: dict[str, str] = attrs.field(init=False, repr=False, factory=dict)
    """Outage modes of single models, by canonical name (:meth:`set_model_mode`)."""
    history: collections.deque[SimRequest] = attrs.field(init=False, repr=False)
    store: ModelStore = attrs.field(init=False, repr=False)
    """The models the sim has, and which are loaded."""

    _flavour: Api = attrs.field(init=False, repr=False)
    #: When the start-up load of a ``loads_at_start`` server ends.
    _ready_at: float = attrs.field(init=False, repr=False, default=0.0)
    _scheduler: Scheduler = attrs.field(init=False, repr=False)
    _listener: Listener = attrs.field(init=False, repr=False)
    _serial: int = attrs.field(init=False, repr=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.history = collections.deque(maxlen=self.history_size)
        self._flavour = APIS[self.api]
        # A server with one model loaded at start has no load per request.
        load_seconds = self.load_seconds if self._flavour.loads_on_demand else 0.0
        self.store = ModelStore(self._reactor, load_seconds, self.default_keep_alive)
        for name in self.models:
            self.store.know(canonical_model(name))
        self._scheduler = Scheduler(
            self._reactor,
            self.parallel,
            self.max_queue,
            serve=self._serve,
            retired=self._retired,
            step_failed=self._step_failed,
        )
        self._listener = Listener(self._reactor)
        if self._reactor is not None:  # None: only checking the settings (the command line)
            self._start_loading()

    # -- public state ------------------------------------------------------

    @property
    def mode(self) -> str:
        """The current outage mode; change it with :meth:`set_mode`."""
        return self._mode

    @property
    def in_flight(self) -> int:
        """Model requests received and not yet answered (queued, served, hung)."""
        return self._scheduler.in_flight

    @property
    def serving(self) -> int:
        """Model requests holding one of the ``parallel`` slots."""
        return self._scheduler.serving

    @property
    def queued(self) -> int:
        """Model requests waiting in the sim's FIFO for a slot."""
        return self._scheduler.queued

    @property
    def peak_in_flight(self) -> int:
        """The most model requests in flight at once (since :meth:`reset_peak`)."""
        return self._scheduler.peak_in_flight

    @property
    def peak_serving(self) -> int:
        """The most model requests served at once (since :meth:`reset_peak`)."""
        return self._scheduler.peak_serving

    @property
    def served_model(self) -> str:
        """The one model a single-model server serves: the first of ``models``."""
        return self.models[0] if self.models else DEFAULT_EMBED_MODEL

    @property
    def loading(self) -> bool:
        """A ``loads_at_start`` server is loading its model (at start, or restarted)."""
        return self._flavour.loads_at_start and self._reactor.seconds() < self._ready_at

    @property
    def open_connections(self) -> int:
        """TCP connections open to the listener now (idle keep-alive ones too)."""
        return self._listener.open_connections

    @property
    def port(self) -> int | None:
        """The bound TCP port (kept while ``refuse`` closes it), or None."""
        return self._listener.port

    @property
    def url(self) -> str:
        """``http://interface:port`` of the listener."""
        if self._listener.port is None:
            raise RuntimeError("not listening")
        return f"http://{self._listener.interface}:{self._listener.port}"

    def transports(self) -> list[Any]:
        """The transports of the open TCP connections (tests check their socket options)."""
        return self._listener.transports()

    def now(self) -> float:
        """The sim's clock."""
        return self._reactor.seconds()

    def next_id(self, prefix: str) -> str:
        """An id unique to this sim, for completion objects."""
        self._serial += 1
        return f"{prefix}-{self._serial}"

    def reset_peak(self) -> None:
        """Start the peaks afresh from what is in flight now."""
        self._scheduler.reset_peak()

    def has_model(self, key: str) -> bool:
        """True when a request for the model ``key`` (canonical) is served: a model of ``models``, or any name
        for a server that serves its one model whatever the request names (every ``api`` but ``ollama``)."""
        return not self._flavour.loads_on_demand or self.store.has(key)

    def add_model(self, name: str) -> None:
        """The server has ``name`` from now on (``ollama pull`` done): listed, and served."""
        self.store.know(canonical_model(name))

    def loaded_models(self) -> list[str]:
        """Canonical names of the models loaded now (what ``/api/ps`` lists)."""
        return self.store.loaded_names()

    def resource(self) -> Resource:
        """The ``twisted.web`` resource serving every route of this sim."""
        return SimResource(self._render)

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
            "api": self.api,
        }

    # -- listening and modes -------------------------------------------------

    def listen(self, port: int = 0, interface: str = "127.0.0.1") -> defer.Deferred[int]:
        """Listen on ``interface:port`` (0 picks a free port), a port of its own (listening.py says why).

        :returns: a Deferred firing with the bound port number.
        """
        return self._listener.listen(self.resource, port, interface, lambda: self._mode == "refuse")

    def set_mode(self, mode: str, in_flight: bool = False) -> defer.Deferred[None]:
        """
        Switch the outage mode.

        ``reset`` and ``refuse`` abort every model request in flight;
        ``refuse`` also closes the listening port and every open connection;
        leaving ``refuse`` listens again on the same port.  Requests already
        queued or served keep going through ``error500``, ``hang`` and ``stall``: those
        modes apply to requests that arrive afterwards.  A request that hit
        ``hang`` (or ``stall``) stays so after the mode changes back, until its client
        leaves, ``reset``/``refuse`` aborts it, or :meth:`stop`.  Without a
        port of its own (the resource driven in memory), ``refuse`` aborts
        each request on arrival.  A server that loads its one model at start
        (``api="llamacpp"``) loads it again when it leaves ``refuse`` or
        ``reset``: it was restarted.

        With ``in_flight``, ``error500`` and ``error500_unknown`` also answer
        every request queued or being served whose answer has not begun, as a
        GPU that fails fails every call in progress; ``hang`` and
        ``stall_head`` hold them unanswered (``stall_head`` after their head).

        :returns: a Deferred that fires once the port is closed or open again
            (at once when the port is not involved).
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        old, self._mode = self._mode, mode
        if in_flight and mode in ("error500", "error500_unknown"):
            failure = "outage" if mode == "error500" else "outage_unknown" if self._flavour.name == "ollama" else "internal"
            for job in self._scheduler.unanswered():
                self._send(job, self._flavour.error(job.route.style, failure, "", job), "error500")
        elif in_flight and mode in ("hang", "stall_head"):
            for job in self._scheduler.unanswered():
                if self._scheduler.hang(job):
                    self._let_go_of_model(job)
                if mode == "stall_head":
                    job.request.setHeader(b"content-type", JSON)
                    job.request.write(b"")
                    job.headers_sent = True
        if mode in ("reset", "refuse"):
            self._scheduler.abort_all("reset" if mode == "reset" else "refused")
        elif old in ("reset", "refuse"):
            # The server went down; the one that comes back loads its model again.
            self._start_loading()
        if self._listener.listening and mode == "refuse" and old != "refuse":
            return self._listener.close()
        if self._listener.listening and old == "refuse" and mode != "refuse":
            return self._listener.reopen()
        return defer.succeed(None)

    def set_model_mode(self, model: str, mode: str) -> None:
        """
        Fail the calls of one model (any spelling of it) while the others are served: a model the GPU
        cannot run, as a real server has one.

        ``hang`` (every call of it accepted and never answered: a stuck load), ``error500`` (the
        server's own GPU words: Ollama's out-of-memory 500), ``error500_unknown`` (a 500 in words no
        list has: a broken model file), or ``ok`` (served again).  The global mode
        (:meth:`set_mode`), when not ``ok``, applies on top to every model.
        """
        if mode not in _MODEL_MODES:
            raise ValueError(f"unknown model mode {mode!r}; expected one of {_MODEL_MODES}")
        key = canonical_model(model)
        if mode == "ok":
            self.model_modes.pop(key, None)
        else:
            self.model_modes[key] = mode

    def set_load_seconds(self, model: str, seconds: float) -> None:
        """How long a load of one model takes (a 40 GB model read from a slow disk); the others take ``load_seconds``."""
        if seconds < 0:
            raise ValueError(f"load seconds must not be negative, not {seconds!r}")
        self.store.load_seconds_of[canonical_model(model)] = seconds

    def hold(self, *paths: str) -> None:
        """
        Hold the next step of every model request to ``paths`` (to any path when none is given) until :meth:`release`.

        A step that comes due meanwhile (a whole answer, a stream's first or
        next line, a load) waits; the requests stay in flight, holding their
        slots; requests to other paths go on as usual.  A test holds a request at a point of its choosing for exactly
        as long as it needs (a reload, a lease running out) instead of a
        latency long enough for the worst case.  Releasing and holding again
        at once lets the steps due now run, and holds the ones they schedule
        (a stream's next line, ``chunk_delay`` later).
        """
        self._scheduler.hold(frozenset(paths))

    def release(self) -> None:
        """Run every step :meth:`hold` held, in the order they came due, and hold no more."""
        self._scheduler.release()

    @property
    def held(self) -> int:
        """Steps :meth:`hold` is holding now."""
        return self._scheduler.held

    def stop(self) -> defer.Deferred[None]:
        """
        Stop listening, abort every connection, cancel every timer.

        :returns: a Deferred that fires once the port is closed and every
            connection is gone.
        """
        self._listener.listening = False
        self._scheduler.abort_all("stopped")
        self.store.stop()
        return self._listener.stop()

    def _start_loading(self) -> None:
        """A ``loads_at_start`` server (re)starts: it loads for ``load_seconds`` from now."""
        if self._flavour.loads_at_start:
            self._ready_at = self._reactor.seconds() + self.load_seconds

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
        api = self._flavour
        route = api.route(path, method)
        style = route.style if route else api.style_of(path)

        if mode == "refuse":
            # Only reached without our own port (e.g. in memory): drop it.
            return self._abort_request(request, record, "refused")
        if self.loading:
            loading = api.while_loading(path)
            if loading is not None:
                self._finish_record(record, "loading")
                return self._write_reply(request, loading)
        refused = api.front(request)
        if refused is not None:
            self._finish_record(record, "not_found" if refused.code == 404 else "bad_request")
            return self._write_reply(request, refused)
        if route is None:
            return self._fail(request, record, style, "not_found")
        if method not in route.methods:
            return self._fail(request, record, style, "method")
        if route.kind == "info" or (route.kind == "probe" and mode not in ("hang", "reset", "stall", "stall_head")):
            return self._info(request, record, route)
        if mode == "reset":
            return self._abort_request(request, record, "reset")

        job = Job(request, record, route, arrived=now, keep_alive=self.default_keep_alive)
        if route.kind == "probe":
            # A health check that runs the model hangs with it (and stalls with it: no head).
            self._scheduler.admit(job, hang=True)
            return NOT_DONE_YET
        try:
            api.parse(self, job, api.read(request))
        except BadRequest as e:
            return self._fail(request, record, style, e.kind, str(e))
        record.model = job.model
        record.texts = len(job.texts)
        if not self.has_model(job.key):
            # Ollama looks the model up before it schedules anything: a model it does not have is a 404 in any mode.
            return self._fail(request, record, style, "model_not_found", job.model, job)
        if mode == "ok":
            # This one model may fail while the others are served.
            mode = self.model_modes.get(job.key, "ok")
            record.mode = mode

        if mode == "error500":
            return self._fail(request, record, style, "outage", job=job)
        if mode == "error500_unknown":
            # Words no list has: Ollama's own table has them, the other servers answer their internal 500.
            return self._fail(request, record, style, "outage_unknown" if api.name == "ollama" else "internal", job=job)
        if mode == "stall_head":
            # The head of an answer, then nothing, until the client leaves (or reset/refuse/stop).
            request.setHeader(b"content-type", JSON)
            request.write(b"")
            self._scheduler.admit(job, hang=True)
            return NOT_DONE_YET
        if self.max_num_ctx and job.num_ctx > self.max_num_ctx:
            # This request's own context does not fit: its load fails, the GPU is fine.
            return self._fail(request, record, style, "load_oom", job=job)
        if job.template_error is not None:
            # Ollama loads the model, then parses the caller's template: a 500 quoting it.
            return self._fail(request, record, style, "template", job.template_error, job)
        if job.load_only and job.keep_alive == 0:
            return self._unload(request, record, job)
        if self._scheduler.full():
            return self._fail(request, record, style, "busy", job=job)
        self._scheduler.admit(job, hang=mode in ("hang", "stall"))
        if mode == "stall":
            self._stall_after_head(job)
        return NOT_DONE_YET

    def _finish_record(self, record: SimRequest, outcome: str) -> None:
        """Note how a request ended, for tests to read."""
        record.outcome = outcome
        record.finished_at = self._reactor.seconds()
        self.outcomes[outcome] += 1

    def _abort_request(self, request: Request, record: SimRequest, outcome: str) -> int:
        """A TCP reset instead of an answer."""
        self._finish_record(record, outcome)
        request.transport.abortConnection()  # type: ignore[union-attr]  # a TCP transport
        return NOT_DONE_YET

    def _fail(
        self, request: Request, record: SimRequest, style: str, failure: str, message: str = "", job: Job | None = None
    ) -> bytes:
        """Refuse a request in its API's own error shape."""
        self._finish_record(record, _OUTCOMES.get(failure, "bad_request"))
        return self._write_reply(request, self._flavour.error(style, failure, message, job))

    def _write_reply(self, request: Request, reply: Reply) -> bytes:
        """Status and headers of a whole answer; its body, for ``render`` to return."""
        if reply.code != 200:
            request.setResponseCode(reply.code)
        if reply.content_type:
            request.setHeader(b"content-type", reply.content_type)
        else:
            request.defaultContentType = None  # no Content-Type at all, as Go writes an empty answer
        for name, value in reply.headers:
            request.setHeader(name, value)
        return reply.body

    def _info(self, request: Request, record: SimRequest, route: Route) -> bytes:
        """Routes that never touch the model; they answer in every mode but refuse."""
        if route.op == "stats":
            self._finish_record(record, "ok")
            return self._write_reply(request, Reply(200, dumps(self.stats())))
        reply = self._flavour.info(self, request, route)
        # TEI's /health answers 503 while its GPU fails.
        self._finish_record(record, "ok" if reply.code < 400 else "error500" if reply.code >= 500 else "bad_request")
        return self._write_reply(request, reply)

    def _unload(self, request: Request, record: SimRequest, job: Job) -> bytes:
        """``keep_alive: 0`` and nothing to do: how Ollama unloads a model."""
        self.store.unload(job.key)
        self._finish_record(record, "ok")
        request.setHeader(b"content-type", JSON)
        return dumps(self._flavour.load_answer(self, job, "unload"))

    # -- a job's life ----------------------------------------------------------

    def _serve(self, job: Job) -> None:
        """A slot is free: load the model if need be, then do the work."""
        self.store.prune()
        self.store.load(job.key, job, functools.partial(self._model_ready, job))

    def _model_ready(self, job: Job) -> None:
        """The model is in memory: schedule the answer."""
        if job.state != "serving":
            return
        job.load_wait = self._reactor.seconds() - job.started
        self.store.hold(job.key)
        job.holds_model = True
        after = self._scheduler.after
        if job.load_only:
            after(job, 0, self._answer_whole, job)
        elif job.route.kind == "batch":
            after(job, self.latency + self.per_item_latency * len(job.texts), self._answer_batch, job)
        elif job.stream:
            after(job, self.latency, self._stream_step, job, 0)
        else:
            after(job, self.latency + self.chunk_delay * self.chunks, self._answer_whole, job)

    def _retired(self, job: Job, outcome: str, held_slot: bool) -> None:
        """A job is done: note how, and let go of its model."""
        self._finish_record(job.record, outcome)
        if held_slot:
            self._let_go_of_model(job)

    def _let_go_of_model(self, job: Job) -> None:
        """A job that held a slot needs its model no more: its share of a load under way, or its hold of the model."""
        self.store.cancel(job.key, job)
        if job.holds_model:
            job.holds_model = False
            self.store.release(job.key, job.keep_alive)

    def _step_failed(self, job: Job) -> None:
        """A step raised: a 500 in the route's shape, or a reset once a stream began."""
        if job.headers_sent:
            self._scheduler.abort(job, "error500")
        else:
            self._send(job, self._flavour.error(job.route.style, "internal", "", job), "error500")

    # -- answers -------------------------------------------------------------

    def _send(self, job: Job, reply: Reply, outcome: str = "ok") -> None:
        """Answer a job whole and free its slot."""
        body = self._write_reply(job.request, reply)
        job.request.setHeader(b"content-length", b"%d" % len(body))
        job.headers_sent = True
        job.request.write(body)
        self._end(job, outcome)

    def _end(self, job: Job, outcome: str = "ok") -> None:
        """Finish the response; ``answered`` tells notifyFinish how it ended (not abandoned)."""
        job.answered = outcome
        if not job.request.finished:
            job.request.finish()
        self._scheduler.retire(job, outcome)

    def _whole_body(self, job: Job) -> bytes:
        """The JSON of a job's whole answer: a load's (the model is in memory now), a batch's, or a reply's."""
        if job.load_only:
            return dumps(self._flavour.load_answer(self, job, "load"))
        if job.route.kind == "batch":
            return dumps(self._flavour.answer(self, job))
        return dumps(self._flavour.reply(self, job, "".join(expected_reply(job.prompt, job.key, self.chunks))))

    def _answer_batch(self, job: Job) -> None:
        """The model ran over every input: one JSON answer, its texts counted as embedded."""
        body = self._whole_body(job)
        self.texts_embedded.update(job.texts)
        self._send(job, Reply(200, body))

    def _answer_whole(self, job: Job) -> None:
        """A load, or a reply not streamed: one JSON answer."""
        self._send(job, Reply(200, self._whole_body(job)))

    def _stall_after_head(self, job: Job) -> None:
        """Mode ``stall``: the head of the answer this job would get and its first bytes, then nothing.

        A stream sends its first piece; a whole answer (an embedding, a
        reply with ``stream: false``, a load) its first :data:`STALL_BYTES`
        bytes under the ``Content-Length`` of the whole.  The job stays held
        (as ``hang``) until its client leaves or the sim is stopped.
        """
        request = job.request
        job.headers_sent = True
        if job.stream and not job.load_only and job.route.kind != "batch":
            self._flavour.start_stream(self, job)
            pieces = expected_reply(job.prompt, job.key, self.chunks)
            request.write(self._flavour.stream_chunk(self, job, 0, pieces))
            return
        body = self._whole_body(job)
        request.setResponseCode(200)
        request.setHeader(b"content-type", JSON)
        request.setHeader(b"content-length", b"%d" % len(body))
        request.write(body[:STALL_BYTES])

    def _stream_step(self, job: Job, i: int) -> None:
        """Write piece ``i`` of a stream; the one after the last piece closes it."""
        if not job.headers_sent:
            self._flavour.start_stream(self, job)
            job.headers_sent = True
        pieces = expected_reply(job.prompt, job.key, self.chunks)
        job.request.write(self._flavour.stream_chunk(self, job, i, pieces))
        if i < len(pieces):
            self._scheduler.after(job, self.chunk_delay, self._stream_step, job, i + 1)
        else:
            self._end(job)
