"""The files one process owns at a time, and that change hands at a reload's commit: the pidfile and the holds file.

The new process writes neither before its commit: twistd runs it with no
pidfile of its own (tap.py: its twistd would refuse to start beside the
running one's), and it reads the holds file at start but only writes it
from the commit on (:class:`ClaimedAtCommit`), so a new process that never
commits never wrote either.  Who writes what when: docs/operating.md (the
table of *Reload: a new process takes everything over*).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Iterable

import attrs
from twisted.logger import Logger

if TYPE_CHECKING:
    from ..holdstore import HoldStore

log = Logger()


@attrs.define(eq=False)
class PidFile:
    """The pidfile of this proxy (None: it has none)."""

    path: str | None
    #: Tells twistd not to remove the file as it exits (it names another process then).
    _keep_at_exit: Callable[[], None] = lambda: None
    #: This process wrote it (a process a reload started): it removes it at its end, unless it handed over.
    _mine: bool = False

    def take(self) -> None:
        """Name this process in the file (at the commit of a process a reload started), atomically."""
        if self.path is None:
            return
        directory = os.path.dirname(self.path) or "."
        try:
            fd, temporary = tempfile.mkstemp(dir=directory, prefix=".pidfile-")
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            os.replace(temporary, self.path)
        except OSError as e:
            log.error("reload: cannot write the pidfile {path} ({error}); it still names the old process",
                      path=self.path, error=e.strerror or str(e))
            return
        self._mine = True

    def give_up(self) -> None:
        """Another process names itself in the file now: this one leaves it as it is at its end."""
        self._mine = False
        self._keep_at_exit()

    def remove_if_mine(self) -> None:
        """At this process's end: remove the file if this process wrote it and it still names it."""
        if not self._mine or self.path is None:
            return
        self._mine = False
        with contextlib.suppress(OSError, ValueError):
            with open(self.path) as f:
                named = int(f.read().strip() or 0)
            if named == os.getpid():
                os.unlink(self.path)


class ClaimedAtCommit:
    """A holds file (holdstore.HoldStore) read now and written only from :meth:`claim` on.

    Until then each change is only remembered; :meth:`claim` writes the last one (the first write is the
    claim).  Everything else is the store's own."""

    def __init__(self, store: HoldStore):
        self._store = store
        self._claimed = False
        self._latest: list | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def save(self, holds: Iterable[Any]) -> bool:
        """Write ``holds`` once claimed; before, remember them: the file is the old process's to keep, and
        as current as it writes it (True: no start here doubts it for not being written)."""
        if self._claimed:
            return bool(self._store.save(holds))
        self._latest = list(holds)
        return True

    def set_aside(self) -> Any:
        """Not before the claim: the file is still the old process's to keep."""
        return self._store.set_aside() if self._claimed else None

    def claim(self) -> None:
        """This process owns the holds now: write them (the claim), and every change from now on."""
        if self._claimed:
            return
        self._claimed = True
        if self._latest is not None:
            self._store.save(self._latest)
