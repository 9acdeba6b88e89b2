"""
The job scheduler: the parallel cap, the queue, and every job's timers.

A real GPU server serves a few requests at once and queues the rest
(``OLLAMA_NUM_PARALLEL``, ``OLLAMA_MAX_QUEUE``); the proxy's replay cap is
checked against exactly that.  :class:`Scheduler` is that cap and queue, and
the owner of every timer a job runs on, so that retiring a job (answered,
aborted, or its client gone) always leaves nothing behind.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import attrs
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.web.server import Request

from .route import Route

_log = Logger()


@attrs.define(eq=False)
class SimRequest:
    """
    One request as the sim saw it, kept in :attr:`SimOllama.history`.

    ``mode`` is the mode the request hit on arrival; ``outcome`` is how it
    ended: ``ok``, ``bad_request``, ``not_found``, ``error500``, ``template_error``, ``busy``, ``refused``,
    ``reset``, ``abandoned`` (the client went away, which is how a ``hang``
    request usually ends), ``stopped``, ``loading`` (llama.cpp's 503 while its
    model loads), or ``pending`` while unanswered.
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
class Job:
    """A model request between arrival and answer."""

    request: Request
    record: SimRequest
    route: Route
    arrived: float
    #: Seconds the model stays loaded after this request.
    keep_alive: float
    #: The model name as the request gave it (answers echo it).
    model: str = ""
    #: The name the model is known by (its load, its vectors' seed).
    key: str = ""
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
    #: Options of the API's own (a rerank query, ``return_text``, ``top_n``, ...).
    options: dict[str, Any] = attrs.Factory(dict)
    state: str = "new"  # new, queued, hung, serving, done
    #: The outcome it was answered with; empty while unanswered.
    answered: str = ""
    headers_sent: bool = False
    holds_model: bool = False
    started: float = 0.0
    load_wait: float = 0.0
    timer: IDelayedCall | None = None


@attrs.define(eq=False)
class Scheduler:
    """
    At most ``parallel`` jobs served at once; the rest wait first come, first served.

    :param clock: ``IReactorTime`` for every step's timer.
    :param parallel: jobs served at once.
    :param max_queue: jobs that may wait for a slot (see :meth:`full`).
    :param serve: called when a job gets a slot.
    :param retired: called once when a job is done, however it ended, with
        the outcome and whether it held a slot.
    :param step_failed: called when a step raised, while the job still holds
        its slot, so that its request is answered rather than left hanging.
    """

    _clock: Any
    parallel: int
    max_queue: int
    _serve: Callable[[Job], None]
    _retired: Callable[[Job, str, bool], None]
    _step_failed: Callable[[Job], None]
    peak_in_flight: int = attrs.field(init=False, default=0)
    peak_serving: int = attrs.field(init=False, default=0)
    _jobs: set[Job] = attrs.field(init=False, factory=set)
    _waiting: collections.deque[Job] = attrs.field(init=False, factory=collections.deque)
    _serving: set[Job] = attrs.field(init=False, factory=set)
    _pumping: bool = attrs.field(init=False, default=False)
    #: What :meth:`hold` holds: None (nothing), or the paths whose steps wait (empty: every path).
    _holding: frozenset[str] | None = attrs.field(init=False, default=None)
    _held: list[tuple[Job, Callable[..., None], tuple[Any, ...]]] = attrs.field(init=False, factory=list)

    @property
    def in_flight(self) -> int:
        """Jobs admitted and not yet done (queued, served, hung)."""
        return len(self._jobs)

    @property
    def serving(self) -> int:
        """Jobs holding a slot."""
        return len(self._serving)

    @property
    def queued(self) -> int:
        """Jobs waiting for a slot."""
        return len(self._waiting)

    def full(self) -> bool:
        """Every slot taken and ``max_queue`` waiting: one more is turned away."""
        return len(self._serving) >= self.parallel and len(self._waiting) >= self.max_queue

    def reset_peak(self) -> None:
        """Start the peaks afresh from what is in flight now."""
        self.peak_in_flight = len(self._jobs)
        self.peak_serving = len(self._serving)

    def admit(self, job: Job, hang: bool = False) -> None:
        """Take a job: queued for a slot, or (``hang``) held and never served."""
        self._jobs.add(job)
        self.peak_in_flight = max(self.peak_in_flight, len(self._jobs))
        job.request.notifyFinish().addBoth(self._request_gone, job)
        if hang:
            job.state = "hung"
            return
        job.state = "queued"
        self._waiting.append(job)
        self._pump()

    def after(self, job: Job, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Run a step of ``job`` after ``delay`` (at once when 0)."""
        if delay <= 0:
            self._guarded(job, fn, *args)
        else:
            job.timer = self._clock.callLater(delay, self._guarded, job, fn, *args)

    def retire(self, job: Job, outcome: str) -> None:
        """Release everything a job holds; idempotent."""
        if job.state == "done":
            return
        held_slot = self._leave(job, "done") == "serving"
        self._jobs.discard(job)
        self._retired(job, outcome, held_slot)
        if held_slot:
            self._pump()

    def abort(self, job: Job, outcome: str) -> None:
        """Drop a job's connection with a TCP reset."""
        transport = job.request.transport
        self.retire(job, outcome)
        if transport is not None:
            transport.abortConnection()  # type: ignore[attr-defined]  # a TCP transport

    def unanswered(self) -> list[Job]:
        """The jobs queued or being served whose answer has not begun (not hung ones)."""
        return [job for job in self._jobs if job.state in ("queued", "serving") and not job.headers_sent]

    def hang(self, job: Job) -> bool:
        """Hold a queued or served job unanswered from now on (a runner wedged mid-call), its slot
        freed; True when it held one (its model is the caller's to let go)."""
        if job.state not in ("queued", "serving"):
            return False
        held_slot = self._leave(job, "hung") == "serving"
        if held_slot:
            self._pump()
        return held_slot

    def _leave(self, job: Job, state: str) -> str:
        """Move ``job`` to ``state``, out of the queue or its slot, its timer cancelled; the state it left."""
        if job.timer is not None and job.timer.active():
            job.timer.cancel()
        job.timer = None
        previous, job.state = job.state, state
        if previous == "queued":
            try:
                self._waiting.remove(job)
            except ValueError:
                pass
        self._serving.discard(job)
        return previous

    def hold(self, paths: frozenset[str] = frozenset()) -> None:
        """From now on, a step of a request to ``paths`` (any path when empty) that comes due waits until
        :meth:`release` (see :meth:`SimOllama.hold`)."""
        self._holding = paths

    def release(self) -> None:
        """Hold no more, and run every step held meanwhile, in the order they came due."""
        self._holding = None
        held, self._held = self._held, []
        for job, fn, args in held:
            self._guarded(job, fn, *args)

    @property
    def held(self) -> int:
        """Steps waiting for :meth:`release` (of jobs still served)."""
        return sum(1 for job, _, _ in self._held if job.state == "serving")

    def abort_all(self, outcome: str) -> None:
        """Reset every job's connection (``reset``, ``refuse``, ``stop``)."""
        for job in list(self._jobs):
            self.abort(job, outcome)

    def _pump(self) -> None:
        """Start queued jobs, oldest first, while a slot is free."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._waiting and len(self._serving) < self.parallel:
                job = self._waiting.popleft()
                job.state = "serving"
                job.started = self._clock.seconds()
                self._serving.add(job)
                self.peak_serving = max(self.peak_serving, len(self._serving))
                self._serve(job)
        finally:
            self._pumping = False

    def _guarded(self, job: Job, fn: Callable[..., None], *args: Any) -> None:
        """A bug in one step must answer its request, not leave it hanging."""
        job.timer = None
        if job.state != "serving":
            return
        if self._holding is not None and (not self._holding or job.record.path in self._holding):
            self._held.append((job, fn, args))
            return
        try:
            fn(*args)
        except Exception:
            _log.failure("sim step failed for {path}", path=job.record.path)
            if job.state == "serving":
                self._step_failed(job)

    def _request_gone(self, result: Any, job: Job) -> None:
        """notifyFinish fired: answered (with its own outcome), or the client went away."""
        self.retire(job, job.answered or "abandoned")
