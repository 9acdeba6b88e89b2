"""The scheduler's lines (schedule/lines.py) are an index of the lot: after any sequence of events they
say exactly what the lot holds, and every release goes to a member that may take it, in the lot's order."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from twisted.internet.defer import CancelledError

from helpers import make_pool_core
from yieldproxy.lot.parking import PARKED, Entry, Refused

MEMBERS = ("a", "b", "cpu")
ROUTES = (("/api/embed", "batch"), ("/api/chat", "interactive"), ("/api/generate", "batch"))

events = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, len(ROUTES) - 1)),
        st.tuples(st.just("hold"), st.sampled_from(MEMBERS)),
        st.tuples(st.just("resume"), st.sampled_from(MEMBERS)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("leave"), st.integers(0, 50)),
        st.tuples(st.just("wait"), st.floats(0.0, 2.0)),
    ),
    max_size=60,
)


def _check(core, released_to_ok: list[str]) -> None:
    """The lines against the lot, recounted from scratch."""
    parked = [e for e in core.lot.entries() if e.state is PARKED]
    assert len(parked) == len(core.lot)
    for name in MEMBERS:
        assert core.scheduler.waiting_for(name) == sum(name in e.eligible for e in parked)
        heads = core.scheduler._lines.heads(name, lambda entry: True)
        expected: dict[str, Entry] = {}
        for entry in parked:
            if name in entry.eligible and entry.cls not in expected:
                expected[entry.cls] = entry
        assert heads == expected
    assert released_to_ok == []


@settings(max_examples=150, deadline=None)
@given(events)
def test_the_lines_say_what_the_lot_holds_and_each_release_goes_where_it_may(script):
    core = make_pool_core({"name": "a"}, {"name": "b"}, {"name": "cpu", "use": "when_others_yielded"})
    held: set[str] = set()
    running: list[Entry] = []
    waiting: list = []
    wrong: list[str] = []

    def went(entry: Entry) -> None:
        # The member it was let out to may take it (checked as it goes: the scheduler decided so just now).
        if entry.released_to not in entry.eligible:
            wrong.append(f"{entry.seq} went to {entry.released_to}, eligible {entry.eligible}")
        running.append(entry)

    def admit(entry: Entry) -> None:
        try:
            d = core.scheduler.admit(entry)
        except Refused:
            return
        d.addCallbacks(went, lambda f: f.trap(CancelledError, Exception) and None)
        waiting.append(d)

    for event in script:
        kind = event[0]
        if kind == "admit":
            path, cls = ROUTES[event[1]]
            admit(Entry(cls=cls, routing=core.scheduler.routing("POST", path, cls, None)))
        elif kind == "hold" and event[1] not in held:
            held.add(event[1])
            core.state.hold("test", scope=event[1])
        elif kind == "resume" and event[1] in held:
            held.discard(event[1])
            core.state.release("test", event[1])
        elif kind == "finish" and running:
            entry = running.pop(event[1] % len(running))
            core.scheduler.finished(failed=event[2], seconds=0.01, member=entry.released_to)
            if event[2]:
                # A retryable failure: back to its place, as the proxy app sends it, another member first.
                entry.attempts += 1
                entry.failed_on = entry.released_to
                admit(entry)
        elif kind == "leave":
            parked = [d for d in waiting if not d.called]
            if parked:
                parked[event[1] % len(parked)].cancel()
        elif kind == "wait":
            core.run(event[1])
        _check(core, wrong)
    core.scheduler.stop()
