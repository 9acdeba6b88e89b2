"""Named states: an attempt's answer and its client, a pool member's condition, a parked entry, a
handover's two processes and the demo's controller.

Each machine is an enum and one table that drives it (yieldproxy/states.py: what each event does
in each state).  Every table is checked on its own, exhaustively (each state with each event),
then each machine is walked through its life as
the code drives it: an Attempt with a fake upstream client and request, a Member and an Entry on
a Clock.  The hold bound the scheduler and the lot share is checked at the end.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import given, strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.web.http_headers import Headers

from helpers import config_with, make_core, make_pool_core
from yieldproxy.edge.h1client import ResponseIncomplete
from yieldproxy.lifecycle.succession.predecessor import (
    COMMITTING,
    HANDED_OVER,
    IDLE,
    PHASE_MOVES,
    PREPARING,
    STARTING,
    Phase,
    Predecessor,
)
from yieldproxy.lifecycle.succession.takeover import ABORTED, STAGE_MOVES, WAITING, Inheritance, Stage, TakeOver
from yieldproxy.lot.parking import ENTRY_MOVES, LEFT, NEW, PARKED, RELEASED, Entry, Refused, Stay, hold_bound
from yieldproxy.names import LOADING_SOURCE
from yieldproxy.states import Unexpected
from yieldproxy.tools import demo
from yieldproxy.upstream.attempt import (
    ANSWER_MOVES,
    AWAITING,
    CLIENT_MOVES,
    ENDED,
    GONE,
    JUDGING,
    OPEN,
    PAUSED,
    RELAYING,
    RESUMED,
    Answer,
    Attempt,
    ClientBuffers,
    ClientTooSlow,
    RelayBroken,
    RetryableFailure,
)
from yieldproxy.upstream.pool.member import CONDITION_MOVES, NOT_READY, REFUSING, SERVING, STUCK, UNANSWERED, Condition
from yieldproxy.upstream.verdict import Reason

# -- the tables ---------------------------------------------------------------------------------------




def _attempt():
    return Attempt(Clock(), Upstream(), Request(Channel()), b"", 5.0, target=b"/api/embed")


def _member():
    return make_pool_core({"name": "a"}, {"name": "b"}).scheduler.member("a")


def test_the_end_states():
    assert ANSWER_MOVES.next[ENDED] == {} and ENTRY_MOVES.next[LEFT] == {}
    assert {CLIENT_MOVES.next[GONE][event] for event in CLIENT_MOVES.next[GONE]} == {GONE}  # said again: stays gone
    # A member has no end: it is stopped (a lifecycle flag), in whatever condition it was.
    assert all(CONDITION_MOVES.next[c] for c in Condition)


def test_an_entrys_table_names_every_stay_and_its_events_make_exactly_its_moves():
    """The entry's table drives (yieldproxy/states.py), as the member's does: each (stay, event) moves where
    it says, any other pair raises and leaves it where it was; and its moves are the ones an entry may make."""
    assert ENTRY_MOVES.states == set(Stay)
    events = {event for _, event in ENTRY_MOVES.table}
    for stay, event in itertools.product(Stay, sorted(events)):
        entry = Entry(cls="batch")
        entry.state = stay
        new = ENTRY_MOVES.table.get((stay, event))
        if new is None:
            with pytest.raises(Unexpected, match=f"cannot take '{event}' in state {stay.name}"):
                entry.fire(event)
            assert entry.state is stay
        else:
            assert entry.fire(event) is new and entry.state is new
    moves = {(old, new) for (old, _), new in ENTRY_MOVES.table.items()}
    assert {(old.value, new.value) for old, new in moves} == {
        ("new", "parked"), ("new", "released"),
        ("parked", "released"), ("parked", "left"), ("parked", "handed"),
        ("released", "parked"),
        ("handed", "left"), ("handed", "parked"),
    }


def test_a_members_table_names_every_condition_and_its_events_make_exactly_its_moves():
    """The member's table drives (yieldproxy/states.py): each (condition, event) moves where it says, any
    other pair raises; and the moves it allows are the ones a member's condition may make."""
    assert CONDITION_MOVES.states == set(Condition)
    events = {event for _, event in CONDITION_MOVES.table}
    for condition, event in itertools.product(Condition, sorted(events)):
        member = _member()
        member.state = condition
        new = CONDITION_MOVES.table.get((condition, event))
        if new is None:
            with pytest.raises(Unexpected, match=f"cannot take '{event}' in state {condition.name}"):
                member.fire(event)
            assert member.condition is condition
        else:
            assert member.fire(event) is new and member.condition is new
    assert {(old.value, new.value) for (old, _), new in CONDITION_MOVES.table.items() if new is not old} == {
        ("serving", "unanswered"), ("serving", "refusing"), ("serving", "not_ready"),
        ("unanswered", "refusing"), ("unanswered", "not_ready"), ("unanswered", "serving"),
        ("refusing", "not_ready"), ("refusing", "serving"),
        ("not_ready", "stuck"), ("not_ready", "serving"),
        ("stuck", "serving"), ("stuck", "not_ready"),
    }


def _answer_of(attempt):
    return attempt


def _client_of(attempt):
    return attempt._side


#: An attempt's two driven tables: its states, the table, where the machine is, and every move it may make.
ATTEMPT_TABLES = {
    "answer": (Answer, ANSWER_MOVES, _answer_of, {
        ("awaiting", "judging"), ("awaiting", "relaying"), ("awaiting", "ended"),
        ("judging", "awaiting"), ("judging", "relaying"), ("judging", "ended"),
        ("relaying", "ended"),
    }),
    "client": (type(OPEN), CLIENT_MOVES, _client_of, {
        ("open", "paused"), ("open", "gone"),
        ("paused", "resumed"), ("paused", "open"),
        ("resumed", "paused"), ("resumed", "open"),
    }),
}


@pytest.mark.parametrize("name", ATTEMPT_TABLES)
def test_an_attempts_tables_name_every_state_and_their_events_make_exactly_their_moves(name):
    """An attempt's tables drive (yieldproxy/states.py): each (state, event) moves where it says, any other
    pair raises; and the moves they allow are the ones an attempt's answer and client side may make."""
    states, moves, machine_of, allowed = ATTEMPT_TABLES[name]
    assert moves.states == set(states)
    events = {event for _, event in moves.table}
    for old, event in itertools.product(states, sorted(events)):
        machine = machine_of(_attempt())
        machine.state = old
        new = moves.table.get((old, event))
        if new is None:
            with pytest.raises(Unexpected, match=f"cannot take '{event}' in state {old.name}"):
                machine.fire(event)
            assert machine.state is old
        else:
            assert machine.fire(event) is new and machine.state is new
    assert {(old.value, new.value) for (old, _), new in moves.table.items() if new is not old} == allowed


# -- a handover's two processes, the demo's controller ------------------------------------------------


class _Nothing:
    """A collaborator the machine under test never calls."""


def _predecessor(told: list | None = None):
    return Predecessor(
        Clock(), ["yieldproxy"], {}, {}, {}, _Nothing(), _Nothing(), lambda: {}, lambda: None,
        on_phase=(told.append if told is not None else lambda phase: None),
    )


def _takeover():
    return TakeOver(Clock(), Inheritance(None, {}, 1, "0"), {}, lambda *a: None, lambda message: None)


def _demo_run():
    required = {f.alias: None for f in attrs.fields(demo._Run) if f.init and f.default is attrs.NOTHING}
    return demo._Run(**required)


#: The driven tables of a handover and of the demo: the states, the table, a fresh owner, every move it may make.
LIFECYCLE_TABLES = {
    "old process": (Phase, PHASE_MOVES, _predecessor, {
        ("idle", "starting"), ("starting", "preparing"), ("preparing", "committing"),
        ("committing", "handed_over"),
        ("preparing", "idle"), ("committing", "idle"),
        ("starting", "idle"), ("handed_over", "idle"),
    }),
    "new process": (Stage, STAGE_MOVES, _takeover, {
        ("waiting", "sending"), ("sending", "committed"), ("sending", "waiting"), ("waiting", "committed"),
        ("committed", "serving"), ("waiting", "aborted"),
    }),
    "demo controller": (demo.Phase, demo.PHASE_MOVES, _demo_run, {("waiting", "yielding")}),
}


@pytest.mark.parametrize("name", LIFECYCLE_TABLES)
def test_a_handovers_and_the_demos_tables_name_every_state_and_their_events_make_exactly_their_moves(name):
    """Each (state, event) of the old process's phase, the new process's stage and the demo's controller
    moves where its table says on the real owner; any other pair raises and moves nothing."""
    states, moves, make, allowed = LIFECYCLE_TABLES[name]
    assert moves.states == set(states)
    events = {event for _, event in moves.table}
    for old, event in itertools.product(states, sorted(events)):
        machine = make()
        machine.state = old
        new = moves.table.get((old, event))
        if new is None:
            with pytest.raises(Unexpected, match=f"cannot take '{event}' in state {old.name}"):
                machine.fire(event)
            assert machine.state is old
        else:
            assert machine.fire(event) is new and machine.state is new
    assert {(old.value, new.value) for (old, _), new in moves.table.items() if new is not old} == allowed


def test_the_first_states_and_the_end_of_a_takeover():
    assert _predecessor().phase is IDLE and _takeover().state is WAITING and _demo_run().state is demo.Phase.WAITING
    # A takeover that let go stays let go, whatever comes; the old process fails back to idle from any phase.
    assert {STAGE_MOVES.next[ABORTED][event] for event in STAGE_MOVES.next[ABORTED]} == {ABORTED}
    assert all(PHASE_MOVES.next[phase]["failed"] is IDLE for phase in Phase)


def test_the_old_process_tells_the_succession_of_each_new_phase_once_and_of_none_that_stays():
    told: list = []
    predecessor = _predecessor(told)
    predecessor._go("failed")  # idle already: nothing moves, nothing is told
    for event in ("reload", "ready", "commit", "taken_back", "failed"):
        predecessor._go(event)
    assert told == [STARTING, PREPARING, COMMITTING, IDLE]
    assert predecessor.phase is IDLE and not predecessor.handed_over
    for event in ("reload", "ready", "commit", "committed"):
        predecessor._go(event)
    assert told[-1] is HANDED_OVER and predecessor.handed_over


def test_a_succession_that_fails_on_a_new_phase_is_logged_and_the_phase_moves_all_the_same():
    def fails(phase):
        raise RuntimeError("the succession's own bug")

    predecessor = Predecessor(
        Clock(), ["yieldproxy"], {}, {}, {}, _Nothing(), _Nothing(), lambda: {}, lambda: None, on_phase=fails,
    )
    with capturedLogs() as events:
        predecessor._go("reload")
    assert predecessor.phase is STARTING
    assert [formatEvent(e) for e in events if e.get("log_failure")] == ["reload: reacting to the handover's starting failed"]


# -- an attempt ----------------------------------------------------------------------------------------


class Client:
    """The upstream client: the test plays the upstream's answer into the attempt (its handler)."""

    def __init__(self):
        self.handler = None
        self.d: Deferred | None = None

    def request(self, method, target, headers, body, handler, replayable=True):
        self.handler = handler
        self.d = Deferred(lambda d: None)
        return self.d


class Upstream:
    url = "http://upstream"

    def __init__(self):
        self.client = Client()

    def target(self, target: bytes) -> bytes:
        return target


@attrs.define
class Head:
    """What the attempt reads of h1client's Response."""

    code: int
    phrase: bytes = b"X"
    headers: list = attrs.Factory(list)
    length: int | None = None
    codings: bytes | None = None

    def stopProducing(self) -> None:
        pass


class Channel:
    """A request's channel; ``writer`` facts (``answer_started``, ``write_blocked``) only when given, as the
    listener's ServerConnection has them; else Twisted's private flag."""

    def __init__(self, _waitingForTransport=False, **writer):
        self._waitingForTransport = _waitingForTransport
        for name, value in writer.items():
            setattr(self, name, value)


class Request:
    method = b"POST"

    def __init__(self, channel):
        self.channel = channel
        self.requestHeaders = Headers()
        self.responseHeaders = Headers()
        self.code = 200
        self.written: list[bytes] = []
        self.producer = None

    def setResponseCode(self, code, phrase=None):
        self.code = code

    def write(self, data):
        self.written.append(data)

    def registerProducer(self, producer, streaming):
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None


def attempt(channel=None, buffers=None, **kw):
    request = Request(channel if channel is not None else Channel())
    upstream = Upstream()
    a = Attempt(Clock(), upstream, request, b"{}", 5.0, target=b"/api/embed", buffers=buffers, **kw)
    outcome: list = []
    a.run().addBoth(outcome.append)
    return a, upstream.client, request, outcome


def test_an_answer_goes_from_awaiting_to_relaying_to_ended():
    a, client, request, outcome = attempt()
    assert a.state is AWAITING and a.client is OPEN
    client.handler.response_started(Head(200))
    assert a.state is AWAITING  # a head alone reaches nobody
    client.handler.body_received(b"first")
    assert a.state is RELAYING and request.written == [b"first"]
    client.d.callback(Head(200))
    assert a.state is ENDED and outcome == [200]


def test_an_error_answer_is_judged_before_anything_reaches_the_client():
    a, client, request, outcome = attempt()
    client.handler.response_started(Head(503))
    assert a.state is JUDGING
    client.handler.body_received(b'{"error": "no"}')
    assert request.written == []
    client.d.callback(Head(503))
    assert a.state is ENDED
    assert outcome[0].check(RetryableFailure) and outcome[0].value.reason == Reason.STATUS_503


def test_an_error_answer_too_long_to_judge_goes_back_to_awaiting_and_is_relayed_whole():
    a, client, request, outcome = attempt()
    client.handler.response_started(Head(500))
    client.handler.body_received(b"x" * (64 * 1024))
    # Judged too long: relayed as any answer, from what was read (AWAITING), so at once RELAYING.
    assert a.state is RELAYING and request.code == 500 and request.written == [b"x" * (64 * 1024)]
    client.d.callback(Head(500))
    assert outcome == [500]


def test_a_failure_once_relaying_ends_the_answer_before_it_a_retry():
    a, client, request, outcome = attempt()
    client.d.errback(ResponseIncomplete("cut"))
    assert outcome[0].check(RetryableFailure) and a.state is ENDED
    a, client, request, outcome = attempt()
    client.handler.response_started(Head(200))
    client.handler.body_received(b"part")
    client.d.errback(ResponseIncomplete("cut"))
    assert outcome[0].check(RelayBroken)


def test_whether_the_answer_started_is_the_response_writers_word():
    """The listener's connection says when the answer's first byte went out; the attempt's own state is
    asked only of a channel that does not say (Twisted's, a test's)."""
    a, client, request, outcome = attempt(Channel(answer_started=True))
    assert a.state is AWAITING  # nothing relayed by this attempt...
    client.d.errback(ResponseIncomplete("cut"))
    assert outcome[0].check(RelayBroken)  # ...but the writer has begun an answer: no retry
    a, client, request, outcome = attempt(Channel(answer_started=None))
    client.d.errback(ResponseIncomplete("cut"))
    assert outcome[0].check(RetryableFailure)


def test_the_client_goes_from_open_to_paused_to_resumed_and_back_to_open_once_it_has_it_all():
    buffers = ClientBuffers(1024, 4096)
    a, client, request, outcome = attempt(Channel(write_blocked=True), buffers=buffers)
    client.handler.response_started(Head(200))
    client.handler.body_received(b"12345")
    assert a.client is PAUSED and request.producer is a and buffers.held == 5
    a.resumeProducing()
    assert a.client is RESUMED and buffers.held == 0
    a.pauseProducing()
    assert a.client is PAUSED
    a.pauseProducing()  # the transport may say it again: nothing moves
    client.handler.body_received(b"678")
    client.d.callback(Head(200))
    assert outcome == [200] and not a.client_has_all()
    drained = a.client_drained()
    a.resumeProducing()
    assert drained.called and a.client is OPEN and request.producer is None and buffers.held == 0


def test_a_client_is_blocked_when_its_writer_says_so_and_never_by_a_private_flag():
    a, client, request, outcome = attempt(Channel(write_blocked=True))
    client.handler.response_started(Head(200))
    client.handler.body_received(b"x")
    assert a.client is PAUSED  # the writer's word
    a, client, request, outcome = attempt(Channel(write_blocked=False, _waitingForTransport=True))
    client.handler.response_started(Head(200))
    client.handler.body_received(b"x")
    assert a.client is OPEN  # the writer's word, not Twisted's private flag
    a, client, request, outcome = attempt(Channel(_waitingForTransport=True))
    client.handler.response_started(Head(200))
    client.handler.body_received(b"x")
    assert a.client is OPEN  # a channel that does not say (a test's, a plain Site's) is never taken as full


def test_a_client_that_leaves_is_gone_and_gets_nothing_more():
    a, client, request, outcome = attempt(Channel(write_blocked=True), buffers=ClientBuffers(1024, 4096))
    client.handler.response_started(Head(200))
    client.handler.body_received(b"1")
    a.stopProducing()
    assert a.client is GONE and request.producer is None
    client.handler.body_received(b"2")
    assert request.written == [b"1"]
    a.stopProducing()  # said twice: nothing moves
    # A channel gone before the first byte: gone, nothing committed.
    a, client, request, outcome = attempt()
    request.channel = None
    client.handler.response_started(Head(200))
    client.handler.body_received(b"1")
    assert a.client is GONE and request.written == [] and request.code == 200
    client.d.callback(Head(200))
    assert a.state is ENDED


#: What may happen to a relaying attempt, in any order: the upstream's pieces and end, the client's
#: transport pausing, resuming or stopping it (it calls them in whatever state it finds the attempt).
LIFE_EVENTS = ("piece", "piece", "pause", "resume", "stop", "end", "drained")


@given(st.lists(st.sampled_from(LIFE_EVENTS), max_size=25))
def test_every_order_of_the_transports_and_the_upstreams_events_keeps_the_client_side_whole(events):
    """At every moment: the attempt is the request's producer exactly while its client side is paused or
    resumed, the bytes it holds for the client are exactly what the buffers count, a gone client gets
    nothing more, and no event is refused by a table (an :class:`Unexpected` would be a bug)."""
    buffers = ClientBuffers(per_response=6, total=100)
    a, client, request, outcome = attempt(Channel(write_blocked=True), buffers=buffers)
    client.handler.response_started(Head(200))
    ended = False
    for event in events:
        written, was = len(request.written), a.client
        if event == "piece" and not ended:
            try:
                client.handler.body_received(b"xy")
            except ClientTooSlow as slow:
                ended = True
                client.d.errback(slow)  # the upstream client aborts and fails the exchange with it
        elif event == "end" and not ended:
            ended = True
            client.d.callback(Head(200))
        elif event == "pause":
            a.pauseProducing()
        elif event == "resume":
            a.resumeProducing()
        elif event == "stop":
            a.stopProducing()
        elif event == "drained" and ended:
            a.client_has_all()  # the proxy app, once the upstream's part is over
        assert (request.producer is a) == (a.client in (PAUSED, RESUMED))
        assert buffers.held == (a._buffered if a.client in (PAUSED, RESUMED) else 0)
        if was is GONE:
            assert a.client is GONE and len(request.written) == written
    if ended:
        assert a.state is ENDED


# -- a pool member -------------------------------------------------------------------------------------


class Health:
    """A control client whose answers the test gives."""

    def __init__(self):
        self.calls: list[Deferred] = []

    def request(self, method, path, body=None, timeout=10.0):
        d: Deferred = Deferred()
        self.calls.append(d)
        return d

    def answer(self, code: int, body: bytes = b"") -> None:
        from yieldproxy.upstream.control import Answer as ControlAnswer

        self.calls[-1].callback(ControlAnswer(code, body))


def test_a_member_goes_unanswered_then_refusing_then_serving_once_it_answers():
    core = make_pool_core({"name": "a"}, {"name": "b"})
    a = core.scheduler.member("a")
    health = a.control = Health()
    assert a.condition is SERVING and a.available()
    a.health.unanswered("connection refused")
    assert a.condition is UNANSWERED and a.state_name() == "unreachable" and a.available()
    a.refused()
    assert a.condition is REFUSING and a.unreachable and not a.available()
    core.run(0.5)
    health.answer(200, b"{}")
    assert a.condition is SERVING and a.available() and a.state_name() == "available"
    core.scheduler.stop()


def test_a_member_goes_not_ready_then_stuck_then_serving_once_its_model_loads():
    core = make_pool_core(
        {"name": "llama", "api": "llamacpp", "models": ("m",)}, {"name": "b", "api": "openai", "models": ("m",)},
        config=config_with(upstream={"not_ready_max_seconds": 5.0}),
    )
    llama = core.scheduler.member("llama")
    llama.control = Health()
    llama.health.not_ready("Loading model")
    assert llama.condition is NOT_READY and llama.state_name() == "not_ready"
    core.run(5)
    assert llama.condition is STUCK and llama.state_name() == "outage"
    assert [h.source for h in core.state.holds_for("llama")] == [LOADING_SOURCE]
    llama.health.served()
    assert llama.condition is SERVING and core.state.holds_for("llama") == []
    core.scheduler.stop()


def test_a_member_stuck_whose_hold_someone_else_ended_serves_again():
    core = make_pool_core(
        {"name": "llama", "api": "llamacpp", "models": ("m",)}, {"name": "b", "api": "openai", "models": ("m",)},
        config=config_with(upstream={"not_ready_max_seconds": 5.0}),
    )
    llama = core.scheduler.member("llama")
    health = llama.control = Health()
    llama.health.not_ready("Loading model")
    core.run(5)
    assert llama.condition is STUCK
    core.state.release(LOADING_SOURCE, "llama")  # POST /resume {"source": "loading"}
    assert llama.available()
    health.answer(503, b"{}")  # the check in flight comes back: it finds the hold gone
    assert llama.condition is SERVING
    core.run(6)
    llama.health.not_ready("Loading model")  # "loading" again, past the bound: a new run
    assert llama.condition is NOT_READY
    core.scheduler.stop()


def test_a_member_that_has_answered_cannot_be_refusing():
    """Passing a member over is for one never reached: a "loading" answer is an answer."""
    a = _member()
    a.health.not_ready("Loading model")
    with pytest.raises(Unexpected, match="cannot take 'refused' in state NOT_READY"):
        a.refused()


# -- an entry ------------------------------------------------------------------------------------------


def test_an_entry_goes_new_released_parked_released_and_leaves_once_expired():
    core = make_core(concurrency=1)
    entry = Entry(cls="batch")
    assert entry.state is NEW
    d = core.scheduler.admit(entry)
    assert d.called and entry.state is RELEASED  # went at once
    core.scheduler.finished(failed=True, seconds=0.01)
    core.state.hold("api", "game")
    d = core.scheduler.admit(entry)  # back after a failed attempt: parks in its place
    assert entry.state is PARKED and not d.called
    core.state.release("api")
    core.run()
    assert d.called and entry.state is RELEASED
    core.scheduler.finished(seconds=0.01)
    core.state.hold("api", "game")
    outcome: list = []
    core.scheduler.admit(entry).addErrback(outcome.append)
    core.run(core.scheduler._classes["batch"].hold_seconds + 1)
    assert entry.state is LEFT and outcome[0].check(Refused)
    with pytest.raises(RuntimeError, match="cannot take 'park' in state LEFT"):
        core.lot.park(entry, 10)


def test_an_entry_whose_client_leaves_leaves_the_lot():
    core = make_core()
    core.state.hold("api", "game")
    entry = Entry(cls="batch")
    d = core.scheduler.admit(entry)
    assert entry.state is PARKED
    d.addErrback(lambda f: f.trap(CancelledError))
    d.cancel()
    assert entry.state is LEFT and len(core.lot) == 0


def test_an_entry_handed_to_a_new_process_parks_again_in_its_place_when_that_one_will_not_have_it():
    """A reload hands a parked entry over (handed); the new process dies before the commit: the entry parks
    here again, ahead of one that came after it (lifecycle/succession/predecessor.py takes the rest back)."""
    from yieldproxy.lot.parking import HANDED, HandedOver

    core = make_core()
    core.state.hold("api", "game")
    first, second = Entry(cls="batch"), Entry(cls="batch")
    handed: list = []
    core.scheduler.admit(first).addErrback(lambda f: handed.append(f.trap(HandedOver)))
    core.scheduler.admit(second)
    core.lot.hand_over(first, lambda *what: None)
    assert handed == [HandedOver] and first.state is HANDED and len(core.lot) == 1
    again = core.scheduler.admit(first)  # the proxy app's loop: it will not be had there
    assert first.state is PARKED and not again.called
    assert core.lot.entries()[0] is first
    core.lot.hand_over(first, lambda *what: None)
    again.addErrback(lambda f: f.trap(HandedOver))
    first.fire("taken")  # had there this time
    with pytest.raises(RuntimeError, match="cannot take 'park' in state LEFT"):
        core.lot.park(first, 10)


# -- the hold bound --------------------------------------------------------------------------------------


def test_the_hold_bound_is_the_class_bound_or_the_callers_when_shorter():
    assert hold_bound(30.0, None) == (30.0, False)
    assert hold_bound(30.0, 10.0) == (10.0, True)
    assert hold_bound(30.0, 0.0) == (0.0, True)
    assert hold_bound(30.0, 30.0) == (30.0, False)
    assert hold_bound(30.0, 60.0) == (30.0, False)


@pytest.mark.parametrize("max_wait", [None, 5.0, 20.0, 60.0])
def test_the_scheduler_refuses_exactly_what_the_lot_would_expire(max_wait):
    """The scheduler's budget against a declared yield and the lot's deadline are one bound."""
    hold = make_core().scheduler._classes["batch"].hold_seconds
    bound, by_caller = hold_bound(hold, max_wait)
    for declared, refused in ((bound, False), (bound + 1, True)):
        core = make_core()
        core.state.hold("api", "game", expected_seconds=declared)
        entry = Entry(cls="batch", max_wait=max_wait)
        if refused:
            with pytest.raises(Refused) as caught:
                core.scheduler.admit(entry)
            assert caught.value.reason == "over_budget"
            assert ("X-Yield-Max-Wait" in caught.value.message) is by_caller
        else:
            core.scheduler.admit(entry)
            assert entry.state is PARKED and entry.deadline == bound and entry.bound_by_caller is by_caller
