"""The holds file: every hold written when it changes, read back at start, so a restart (a crash too) keeps them.

A broker that took a 600 s lease believes it holds the GPU for 600 s; a
proxy that forgot it across a restart would send the next embedding to a GPU
a game has.  So each change of the holds (taken, renewed, ended, run out) is
written at once, atomically (a temporary file, ``fsync``, ``rename``, then
``fsync`` of the directory): after a ``kill -9`` or a power cut the file
holds either the old holds or the new ones, never half of each.

What is written: each hold's source, reason, start, the upstream it holds,
``expires_at`` and ``expected_end``, as absolute times of the proxy's clock
(wall-clock seconds under the real reactor).  At start a lease that ran out
meanwhile is gone (:meth:`~yieldproxy.state.YieldState.restore`).

What is not: the holds of the watchers that find their truth again by
themselves, ``outage`` (the probe), ``loading`` (a member stuck loading its
model: its health checks), ``file`` (the state file) and ``command`` (the
command).  They re-assert on start as they always did, and
a hold restored from a watcher that is no longer configured would never
end.  ``signal`` holds are kept: nothing re-reads a signal.

Other parts may keep a section of their own in the same file, a top-level
key beside ``holds`` (:meth:`HoldStore.keep_section`): the record of the
models each upstream served (served.py) is the ``served`` section.  Each is
written with the holds and handed back at start to its owner, who reads it
tolerantly; a section never makes the file refused.

A file that cannot be read as a holds file of this version (not JSON, cut
short, another format, a newer version, unreadable) is refused with one
error line naming it, moved aside to ``NAME.refused``, and the proxy starts
*yielded*, with a hold of source ``restart`` bound by
``state.restart_hold_seconds``: when in doubt, send no work to a GPU that
may be taken.  ``yieldproxy resume --source restart`` ends it sooner.

One process writes the file at a time: each start writes it at once,
claiming it (its pid and the time), and a process that finds the file
claimed later by another stops writing it.  After a reload the old process
lives on while its requests in flight finish, with its own copy of the
holds: a lease the broker renewed at the new process runs out in that copy,
and writing that would erase the renewal.  A claim by a process that is no
longer running takes nothing away: a second proxy started by mistake with the
same file claims it while it builds, then exits (its port is taken), and the
running proxy writes the file again at its next change.

Where: ``state.holds_file``, or by default a file named after the two
listen endpoints (:func:`holds_path`), so a restart with the same command
line finds its holds and two proxies on one machine never see each other's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from .config import Config
from .names import COMMAND_SOURCE, FILE_SOURCE, LOADING_SOURCE, OUTAGE_SOURCE, RESTART_SOURCE
from .state import ALL, Hold, YieldState, check_source

__all__ = ["HoldStore", "Loaded", "PERSISTED_FORMAT", "VERSION", "holds_path", "keep_holds"]

log = Logger()

#: The ``format`` field of a holds file: a file of something else is refused, not read.
PERSISTED_FORMAT = "yieldproxy-holds"
#: The version this code writes and reads; any other is refused.
VERSION = 1
#: Holds whose watcher finds its truth again at start: not written (see the module's docstring).
NOT_KEPT = frozenset((OUTAGE_SOURCE, LOADING_SOURCE, FILE_SOURCE, COMMAND_SOURCE))
#: The largest holds file read: a week of holds is a few KB; a bigger file is not ours.
MAX_BYTES = 1024 * 1024


def holds_path(config: Config, environ: Mapping[str, str]) -> Path:
    """Where this proxy's holds live: ``state.holds_file``, or its default.

    The default directory is ``$STATE_DIRECTORY`` (systemd's
    ``StateDirectory=``; its first entry), else ``$XDG_STATE_HOME/yieldproxy``,
    else ``~/.local/state/yieldproxy``.  The file is named from a hash of
    ``proxy.listen`` and ``admin.listen``: the same command line finds the
    same file, two proxies with different listeners never share one.
    """
    if config.state.holds_file:
        return Path(os.path.expanduser(config.state.holds_file))
    state_directory = (environ.get("STATE_DIRECTORY") or "").split(":")[0]
    xdg = environ.get("XDG_STATE_HOME") or ""
    if state_directory:
        directory = Path(state_directory)
    elif os.path.isabs(xdg):
        directory = Path(xdg) / "yieldproxy"
    else:
        home = environ.get("HOME") or os.path.expanduser("~")
        directory = Path(home) / ".local" / "state" / "yieldproxy"
    listeners = f"{config.proxy.listen}\n{config.admin.listen}".encode()
    return directory / f"holds-{hashlib.sha256(listeners).hexdigest()[:16]}.json"


class Refused(Exception):
    """The file is there but is not a holds file this version can read; the message says why."""


@attrs.frozen
class Loaded:
    """What was found at start: the holds, or why the file was refused."""

    holds: tuple[Hold, ...] = ()
    #: Why the file was refused (None: read, or no file yet).
    refused: str | None = None
    #: The other top-level sections of the file, as read (see :meth:`HoldStore.keep_section`).
    sections: Mapping[str, Any] = attrs.Factory(dict)


@attrs.define(eq=False)
class HoldStore:
    """Reads and writes one holds file."""

    _clock: IReactorTime
    path: Path = attrs.field(converter=Path)
    #: This process: written in the file with :attr:`claimed_at`, to tell who writes it now.
    pid: int = attrs.Factory(os.getpid)
    #: When this process first wrote the file (it writes at start): a later claim by another
    #: process (a reload's new process) means this one writes it no more.
    claimed_at: float | None = None
    #: True once another process claimed the file after this one.
    superseded: bool = False
    #: The holds last written, as written: an unchanged set is not written again.
    _last: list[dict[str, Any]] | None = None
    #: True after a failed write, until one succeeds (one log line per run of failures).
    _failing: bool = False
    #: Whether process ``pid`` runs: a later claim by one that does not is void (see the module's docstring).
    running: Callable[[int], bool] = attrs.field(default=attrs.Factory(lambda: _running))
    #: Sections kept beside the holds: name -> (what to write, read when writing; who reads it back).
    _sections: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = attrs.Factory(dict)
    #: The sections last written, as written.
    _last_sections: dict[str, Any] | None = None

    def keep_section(self, name: str, write: Callable[[], Any], read: Callable[[Any], None]) -> None:
        """Keep the top-level section ``name`` in the file: ``write()`` gives its JSON value each time the file
        is written, ``read(value)`` takes what the file had at start (None when it had none)."""
        if name in _HOLDS_KEYS:
            raise ValueError(f"{name!r} is a key of the holds file itself")
        self._sections[name] = (write, read)

    def restore_sections(self, loaded: Loaded) -> None:
        """Hand each kept section what ``loaded`` had of it (nothing from a refused file)."""
        for name, (_, read) in self._sections.items():
            read(loaded.sections.get(name))

    def load(self) -> Loaded:
        """The holds in the file; none if there is no file; :attr:`Loaded.refused` if it is not one we can read."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            # No file, or a path no file can be at (so none was written there): nothing was held.
            return Loaded()
        except OSError as e:
            return Loaded(refused=f"cannot read it: {e.strerror or e}")
        try:
            holds = _parse(data)
        except Refused as e:
            return Loaded(refused=str(e))
        return Loaded(tuple(h for h in holds if h.source not in NOT_KEPT), sections=_sections(data))

    def save(self, holds: Iterable[Hold]) -> bool:
        """Write ``holds`` (those worth keeping) if they differ from the last written; True if the file is current.

        The first write always happens (it claims the file for this process).
        After another process claimed it later (a reload's new process, which
        has the holds now), nothing more is written: a lease that runs out in
        this process's old copy must not erase the new process's renewal.
        Never raises: a failure is logged (once until a write succeeds again),
        the proxy goes on, and the next change tries again.
        """
        kept = [_as_json(h) for h in holds if h.source not in NOT_KEPT]
        sections = {name: write() for name, (write, _) in self._sections.items()}
        if self.claimed_at is not None:
            if kept == self._last and sections == self._last_sections:
                return not self.superseded
            if self._claimed_later():
                return False
        claimed_at = self.claimed_at if self.claimed_at is not None else self._clock.seconds()
        document = {
            "format": PERSISTED_FORMAT, "version": VERSION, "written_at": self._clock.seconds(),
            "pid": self.pid, "claimed_at": claimed_at, "holds": kept, **sections,
        }
        try:
            _write_atomically(self.path, json.dumps(document, indent=1).encode() + b"\n")
        except OSError as e:
            if not self._failing:
                self._failing = True
                log.error(
                    "holds file {path}: cannot write it ({error}); holds are not kept across a restart until it can be",
                    path=str(self.path), error=e.strerror or str(e),
                )
            return False
        if self._failing:
            self._failing = False
            log.info("holds file {path}: written again", path=str(self.path))
        self.claimed_at = claimed_at
        self._last = kept
        self._last_sections = sections
        return True

    def _claimed_later(self) -> bool:
        """True (and logged, once) when another process, still running, claimed the file after this one did.

        A claim by a process that is gone is void: this process claims the file
        again with its next write (logged).
        """
        try:
            with open(self.path, "rb") as f:
                document = json.loads(f.read(MAX_BYTES))
            pid, claimed_at = document.get("pid"), document.get("claimed_at")
        except (OSError, ValueError, AttributeError):
            return False  # gone or unreadable: this process writes it again
        if pid == self.pid or not isinstance(claimed_at, (int, float)) or self.claimed_at is None:
            return False
        if claimed_at <= self.claimed_at:
            return False
        if not isinstance(pid, int) or not self.running(pid):
            self.superseded = False
            self.claimed_at = None  # the next write claims it anew, later than the void claim
            log.warn(
                "holds file {path}: claimed by pid {pid}, which is gone (a second start that failed?); "
                "this process writes it again",
                path=str(self.path), pid=pid,
            )
            return False
        if self.superseded:
            return True
        self.superseded = True
        log.info(
            "holds file {path}: written by pid {pid} now (a reload's new process, or another proxy given the same "
            "file); this process writes it no more",
            path=str(self.path), pid=pid,
        )
        return True

    def set_aside(self) -> Path | None:
        """Move a refused file to ``NAME.refused`` (kept for a look, out of the way of the next write)."""
        aside = self.path.with_name(self.path.name + ".refused")
        try:
            os.replace(self.path, aside)
        except OSError:
            return None
        return aside


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it runs, as another user
    return pid > 0


def keep_holds(state: YieldState, store: HoldStore, restart_hold_seconds: float) -> None:
    """Restore the holds of the last run into ``state`` and write every change from now on.

    Called once by the composition root (service.py), after everything that
    reacts to the yield state is connected, so a restored hold sets off what
    a new one would.
    """
    loaded = store.load()
    store.restore_sections(loaded)
    state.on_holds_changed(store.save)
    if loaded.refused is None:
        restored = state.restore(loaded.holds)
        if restored:
            log.info("holds file {path}: {count} hold(s) restored", path=str(store.path), count=len(restored))
        # The file now says what is held (leases run out meanwhile, outage holds of an older file are gone),
        # and that this process writes it.
        store.save(state.holds)
        return
    aside = store.set_aside()
    log.error(
        "holds file {path} refused ({why}){aside}; starting yielded (hold source restart) for up to {bound:g}s "
        "or until `yieldproxy resume --source restart`: when in doubt, no work goes to a GPU that may be taken",
        path=str(store.path), why=loaded.refused, aside=f", moved to {aside}" if aside else "",
        bound=restart_hold_seconds,
    )
    state.hold(
        RESTART_SOURCE, f"holds file {store.path} refused at start ({loaded.refused})", for_seconds=restart_hold_seconds,
    )


def _as_json(hold: Hold) -> dict[str, Any]:
    return {
        "source": hold.source,
        "reason": hold.reason,
        "since": hold.since,
        "upstream": None if hold.scope == ALL else hold.scope,
        "expires_at": hold.expires_at,
        "expected_end": hold.expected_end,
    }


def _parse(data: bytes) -> list[Hold]:
    """The holds of a holds file's bytes, or :class:`Refused` saying what is wrong."""
    if len(data) > MAX_BYTES:
        raise Refused(f"larger than {MAX_BYTES} bytes: not a holds file")
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused(f"not JSON: {e}") from None
    if not isinstance(document, dict) or document.get("format") != PERSISTED_FORMAT:
        raise Refused(f"not a yieldproxy holds file (no \"format\": \"{PERSISTED_FORMAT}\")")
    version = document.get("version")
    if version != VERSION:
        raise Refused(f"version {version!r}, this yieldproxy reads version {VERSION}")
    entries = document.get("holds")
    if not isinstance(entries, list):
        raise Refused("\"holds\" is not a list")
    return [_hold(entry, i) for i, entry in enumerate(entries)]


#: The holds file's own top-level keys: any other is a kept section (:meth:`HoldStore.keep_section`).
_HOLDS_KEYS = frozenset({"format", "version", "written_at", "pid", "claimed_at", "holds"})


def _sections(data: bytes) -> dict[str, Any]:
    """The top-level keys of a holds file (read already by :func:`_parse`) that are not its own."""
    document = json.loads(data)
    return {k: v for k, v in document.items() if k not in _HOLDS_KEYS}


def _hold(entry: Any, index: int) -> Hold:
    where = f"holds[{index}]"
    if not isinstance(entry, dict):
        raise Refused(f"{where} is not an object")
    try:
        source = check_source(entry.get("source"))
    except ValueError as e:
        raise Refused(f"{where}.source: {e}") from None
    reason, upstream = entry.get("reason", ""), entry.get("upstream")
    if not isinstance(reason, str):
        raise Refused(f"{where}.reason is not a string")
    if upstream is not None and (not isinstance(upstream, str) or not upstream or upstream == ALL):
        raise Refused(f"{where}.upstream is not an upstream's name")
    return Hold(
        source=source,
        reason=reason,
        since=_time(entry.get("since"), f"{where}.since"),
        expected_end=_optional_time(entry.get("expected_end"), f"{where}.expected_end"),
        expires_at=_optional_time(entry.get("expires_at"), f"{where}.expires_at"),
        scope=ALL if upstream is None else upstream,
    )


def _time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Refused(f"{where} is not a time")
    return float(value)


def _optional_time(value: Any, where: str) -> float | None:
    return None if value is None else _time(value, where)


def _write_atomically(path: Path, data: bytes) -> None:
    """``data`` in ``path``, or the old content: write a temporary file, fsync it, rename it over, fsync the directory."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    try:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return
        raise
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
