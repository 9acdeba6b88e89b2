"""Named states moved by a table that drives them: the house idiom (docs/architecture.md, "Named states").

As h11's ``_state.py``: a :class:`Moves` table says what each event does in each state,
``(state, event) -> next state``; an owner (a :class:`Machine`) changes state only by
:meth:`Machine.fire`, and an event the table does not name in the current state raises
:class:`Unexpected`, naming both.  Where a state owns something, the owner takes it in a method
``_enter_<STATE>`` and gives it back in ``_leave_<STATE>`` (found by name when the class is made,
as Twisted's ``_newclient`` dispatches per state); they run only when the state changes.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, ClassVar, Generic, Hashable, Mapping, TypeVar

S = TypeVar("S", bound=Hashable)
E = TypeVar("E", bound=Hashable)
_Hooks = dict[Any, Callable[[Any], None]]
#: A move: the new state, the hook of the state left and the hook of the state entered (None: none).
_Step = tuple[Any, "Callable[[Any], None] | None", "Callable[[Any], None] | None"]


class Named(Enum):
    """An Enum of states or events that hashes by identity: each member is one object, equal only to itself,
    so a table's lookup needs no call of Enum's own ``__hash__`` (which hashes the member's name in Python).
    For the machines that move on every request."""

    __hash__ = object.__hash__


class Unexpected(RuntimeError):
    """An event the table does not name in the current state: a bug in the owner, never the peer's."""

    def __init__(self, machine: str, state: object, event: object):
        super().__init__(f"{machine} cannot take {event!r} in state {_name(state)}")
        self.state, self.event = state, event


class Moves(Generic[S, E]):
    """A machine's table, ``{(state, event): next state}``; :attr:`states`: every state it names."""

    __slots__ = ("name", "table", "states", "next")

    def __init__(self, name: str, table: Mapping[tuple[S, E], S]):
        self.name = name
        self.table = dict(table)
        self.states = frozenset(state for state, _ in table) | frozenset(table.values())
        #: By state, then by event: a move looks up without building a tuple.
        self.next: dict[S, dict[E, S]] = {state: {} for state in self.states}
        for (state, event), new in table.items():
            self.next[state][event] = new


def _name(state: Hashable) -> str:
    return state.name if isinstance(state, Enum) else str(state)


class Machine(Generic[S, E]):
    """An owner of one named ``state``, moved only by :meth:`fire` along its class's ``moves``."""

    __slots__ = ("state",)
    moves: ClassVar[Moves[Any, Any]]
    #: By state, then by event: the new state and the hooks to run (None: none), found when the class is made.
    __steps: ClassVar[dict[Any, dict[Any, _Step]]] = {}
    state: S

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        states = {_name(state): state for state in cls.moves.states} if hasattr(cls, "moves") else {}
        enter: _Hooks = {}
        leave: _Hooks = {}
        for attr in dir(cls):
            for prefix, hooks in (("_enter_", enter), ("_leave_", leave)):
                if attr.startswith(prefix):
                    if attr[len(prefix):] not in states:
                        raise TypeError(f"{cls.__name__}.{attr}: no such state in its moves")
                    hooks[states[attr[len(prefix):]]] = getattr(cls, attr)
        if states:
            cls.__steps = {
                old: {
                    event: (new, None, None) if new == old else (new, leave.get(old), enter.get(new))
                    for event, new in events.items()
                }
                for old, events in cls.moves.next.items()
            }

    def fire(self, event: E) -> S:
        """Move as the table says on ``event`` (leave, then enter, hooks) and return the new state."""
        new: S
        try:
            new, leave, enter = self.__steps[self.state][event]
        except KeyError:
            raise Unexpected(self.moves.name, self.state, event) from None
        if leave is not None:
            leave(self)
        self.state = new
        if enter is not None:
            enter(self)
        return new
