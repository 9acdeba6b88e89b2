"""The house idiom for named states (yieldproxy/states.py): a table that drives, hooks per state."""

from __future__ import annotations

import ast
import enum
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from yieldproxy.states import Machine, Moves, Named, Unexpected


class Door(enum.Enum):
    SHUT = "shut"
    OPEN = "open"
    LOCKED = "locked"


SHUT, OPEN, LOCKED = Door.SHUT, Door.OPEN, Door.LOCKED
EVENTS = ("push", "pull", "lock", "unlock", "kick")

DOOR = Moves[Door, str]("a door", {
    (SHUT, "push"): OPEN,
    (OPEN, "pull"): SHUT,
    (OPEN, "push"): OPEN,  # pushing an open door: nothing happens, no hook runs
    (SHUT, "lock"): LOCKED,
    (LOCKED, "unlock"): SHUT,
})


class Doorway(Machine[Door, str]):
    """A door whose open state owns a draught: taken on entering, given back on leaving."""

    moves = DOOR

    def __init__(self) -> None:
        self.state = SHUT
        self.log: list[str] = []

    def _enter_OPEN(self) -> None:
        self.log.append("draught on")

    def _leave_OPEN(self) -> None:
        assert self.state is OPEN  # a leave hook sees the state it leaves
        self.log.append("draught off")

    def _enter_LOCKED(self) -> None:
        self.log.append(f"locked from {self.state.value}")


def test_fire_moves_as_the_table_says_and_returns_the_new_state():
    door = Doorway()
    assert door.fire("push") is OPEN and door.state is OPEN
    assert door.fire("push") is OPEN  # a move to itself
    assert door.fire("pull") is SHUT and door.fire("lock") is LOCKED
    assert door.log == ["draught on", "draught off", "locked from locked"]


def test_an_event_the_table_does_not_name_raises_naming_the_machine_the_state_and_the_event():
    door = Doorway()
    with pytest.raises(Unexpected, match=r"^a door cannot take 'kick' in state SHUT$") as caught:
        door.fire("kick")
    assert caught.value.state is SHUT and caught.value.event == "kick"
    assert door.state is SHUT and door.log == []
    assert isinstance(caught.value, RuntimeError)


def test_the_table_knows_every_state_it_names_even_one_with_no_way_out():
    moves = Moves[str, str]("a fuse", {("whole", "blow"): "blown"})
    assert moves.states == frozenset({"whole", "blown"})
    assert moves.next == {"whole": {"blow": "blown"}, "blown": {}}


def test_a_hook_for_a_state_the_table_does_not_name_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"Ajar._enter_AJAR: no such state"):
        class Ajar(Machine[Door, str]):
            moves = DOOR

            def _enter_AJAR(self) -> None:
                pass

    with pytest.raises(TypeError, match="no such state"):
        class NoTable(Machine[str, str]):
            def _leave_x(self) -> None:
                pass


def test_plain_string_states_name_their_hooks_by_their_value():
    class Lamp(Machine[str, str]):
        moves = Moves[str, str]("a lamp", {("off", "switch"): "on", ("on", "switch"): "off"})

        def __init__(self) -> None:
            self.state = "off"
            self.lit = 0

        def _enter_on(self) -> None:
            self.lit += 1

    lamp = Lamp()
    lamp.fire("switch")
    lamp.fire("switch")
    lamp.fire("switch")
    assert lamp.state == "on" and lamp.lit == 2


@given(st.lists(st.sampled_from(EVENTS), max_size=30))
def test_every_sequence_of_events_follows_the_table_or_raises_and_leaves_the_state_alone(events):
    """At every moment: a named move is made (hooks exactly when the state changes), any other raises."""
    door = Doorway()
    for event in events:
        old = door.state
        before = list(door.log)
        expected = DOOR.table.get((old, event))
        if expected is None:
            with pytest.raises(Unexpected):
                door.fire(event)
            assert door.state is old and door.log == before
            continue
        assert door.fire(event) is expected and door.state is expected
        hooks = door.log[len(before):]
        if expected is old:
            assert hooks == []
        else:
            assert hooks == (["draught off"] if old is OPEN else []) + (
                ["draught on"] if expected is OPEN else ["locked from locked"] if expected is LOCKED else []
            )
        assert (door.log.count("draught on") - door.log.count("draught off")) == (door.state is OPEN)


# -- the machines that use it ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent / "yieldproxy"
#: The modules whose named states follow the house idiom: every move fired through a table.
DRIVEN = (
    "edge/h1client.py", "edge/connection.py", "upstream/pool/member.py", "upstream/attempt.py",
    "lifecycle/succession/predecessor.py", "lifecycle/succession/takeover.py", "tools/demo.py",
)
#: Where an owner gives its first state (an attrs class gives it as a field's default).
FIRST = ("__init__",)


def state_assignments(source: str) -> list[int]:
    """Lines that set an attribute named ``state`` anywhere but where an owner gives its first (:data:`FIRST`)."""
    lines = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            targets = []
            if isinstance(child, ast.Assign):
                targets = [t for target in child.targets for t in ast.walk(target)]
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            if function not in FIRST and any(isinstance(t, ast.Attribute) and t.attr == "state" for t in targets):
                lines.append(child.lineno)
            visit(child, function)

    visit(ast.parse(source), None)
    return lines


def test_the_finder_of_direct_moves_finds_them():
    assert state_assignments("class A:\n    def __init__(self):\n        self.state = 1\n") == []
    assert state_assignments("def f(x):\n    x.state = 2\n    a, x.state = 1, 2\n") == [2, 3]
    assert state_assignments("def f(x):\n    if x:\n        x.state += 1\n") == [3]


@pytest.mark.parametrize("path", DRIVEN)
def test_a_driven_machine_moves_only_by_firing_an_event_through_its_table(path):
    source = (ROOT / path).read_text()
    assert "Machine[" in source and "Moves(" in source
    assert state_assignments(source) == []


class _Swing(Named):
    IN = "in"
    OUT = "out"


def test_named_states_hash_by_identity_and_drive_a_table_as_any_enum():
    """A :class:`Named` member is its own hash (no Python call per lookup), still equal only to itself and
    found by its value; a machine on such states moves as on any Enum's."""

    class Swinging(Machine[_Swing, str]):
        moves = Moves("a swing", {(_Swing.IN, "push"): _Swing.OUT, (_Swing.OUT, "pull"): _Swing.IN})

        def __init__(self) -> None:
            self.state = _Swing.IN

    for member in _Swing:
        assert hash(member) == object.__hash__(member)
        assert _Swing(member.value) is member and member != member.value
    swing = Swinging()
    assert [swing.fire("push"), swing.fire("pull")] == [_Swing.OUT, _Swing.IN]
    with pytest.raises(Unexpected):
        swing.fire("pull")


def test_the_machines_every_request_moves_hash_their_states_by_identity():
    """The listener's connection, an attempt's two sides and a parked request move on every request: their
    states are :class:`Named`, so each move's lookup costs no call of Enum's own ``__hash__``."""
    from yieldproxy.edge.connection import State
    from yieldproxy.lot.parking import Stay
    from yieldproxy.upstream.attempt import Answer, Client

    for states in (State, Answer, Client, Stay):
        assert issubclass(states, Named), states
        assert all(hash(member) == object.__hash__(member) for member in states)
