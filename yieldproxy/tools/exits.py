"""How a ``yieldproxy`` command ends: its exit statuses (the command's ``--help`` lists them), and the error that
carries one with its message for the person at the terminal."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_YIELDED = 4
#: ``resume`` ended no hold: the source (or its hold of that upstream) held nothing.
EXIT_NO_HOLD = 5


class CliError(Exception):
    """A message for the person at the terminal, and the exit status that goes with it."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.message = message
        self.code = code
