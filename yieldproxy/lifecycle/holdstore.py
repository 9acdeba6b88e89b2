"""The holds file: every hold written when it changes, read back at start, so a restart (a crash too) keeps them.

A broker that took a 600 s lease believes it holds the GPU for 600 s; a proxy
that forgot it across a restart would send the next embedding to a GPU a game
has.  So each change is written at once and atomically, times are kept so that
no lease is stretched, and a file that cannot be read, or may be stale, starts
the proxy yielded: when in doubt, send no work to a GPU that may be taken.

What is kept and what is not, the file's format, where it lives, who writes it
during a reload, and how a bad file is refused: docs/operating.md
(*Holds are kept*), docs/configuration.md (``[state]``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from ..clock import WallClock, boot_id, is_monotonic, wall_clock
from ..config import Config
from ..lot.state import ALL, MAX_HOLD_SECONDS, Hold, YieldState
from ..names import COMMAND_SOURCE, FILE_SOURCE, LOADING_SOURCE, OUTAGE_SOURCE, RESTART_SOURCE, check_source

__all__ = [
    "HoldStore", "Loaded", "MARKER_SUFFIX", "PERSISTED_FORMAT", "VERSION", "holds_path", "keep_holds",
]

log = Logger()

#: The ``format`` field of a holds file: a file of something else is refused, not read.
PERSISTED_FORMAT = "yieldproxy-holds"
#: The version this code writes and reads; any other is refused.
VERSION = 1
#: Holds whose watcher finds its truth again at start: not written (see the module's docstring).
NOT_KEPT = frozenset((OUTAGE_SOURCE, LOADING_SOURCE, FILE_SOURCE, COMMAND_SOURCE))
#: The largest holds file read: a week of holds is a few KB; a bigger file is not ours.
MAX_BYTES = 1024 * 1024
#: The longest reason read back (a caller's is at most 500 characters; the restart hold's names a path).
MAX_REASON = 4096
#: How far a time may be past where it can be (clocks read a moment apart, rounding), in seconds.
SLACK = 1.0
#: Beside the file while it may be stale: a write failed since it was last written.
MARKER_SUFFIX = ".unsaved"
#: The keys this version writes; any other top-level key is kept as it was.
_OWN_KEYS = frozenset(("format", "version", "written_at", "pid", "claimed_at", "boot_id", "monotonic_at", "holds"))


def holds_path(config: Config, environ: Mapping[str, str]) -> Path:
    """Where this proxy's holds live: ``state.holds_file``, or its default (docs/configuration.md, ``[state]``:
    the same command line finds the same file, two proxies with different listeners never share one)."""
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
    """What was found at start: the holds (on the elapsed clock), or why the file was refused or doubted."""

    holds: tuple[Hold, ...] = ()
    #: Why the file was refused (None: read, or no file yet).
    refused: str | None = None
    #: Why the file may be stale (None: it says what the last run held, as far as anyone can know).
    stale: str | None = None
    #: Whether there was a file.
    found: bool = False
    #: The other top-level sections of the file, as read (see :meth:`HoldStore.keep_section`).
    sections: Mapping[str, Any] = attrs.Factory(dict)


@attrs.frozen
class _Document:
    """A holds file as read: its holds with their wall-clock times, and how to read those back."""

    holds: list[Hold]
    written_at: float | None
    boot_id: str | None
    monotonic_at: float | None
    claimed_at: float | None
    pid: object
    #: Its top-level keys this version does not know, kept when the file is written again.
    extra: dict[str, Any]


@attrs.define(eq=False)
class HoldStore:
    """Reads and writes one holds file."""

    _clock: IReactorTime
    path: Path = attrs.field(converter=Path)
    #: This process: written in the file with :attr:`claimed_at`, to tell who writes it now.
    pid: int = attrs.Factory(os.getpid)
    #: When this process first wrote the file (it writes at start), on the elapsed clock: a later claim by
    #: another process (a reload's new process) means this one writes it no more.
    claimed_at: float | None = None
    #: True once another process claimed the file after this one.
    superseded: bool = False
    #: The holds last written, as written: an unchanged set is not written again.
    _last: list[dict[str, Any]] | None = None
    #: True after a failed write, until one succeeds (one log line per run of failures).
    _failing: bool = False
    #: Whether process ``pid`` runs: a later claim by one that does not is void (:meth:`_claimed_later`).
    running: Callable[[int], bool] = attrs.field(default=attrs.Factory(lambda: _running))
    #: Sections kept beside the holds: name -> (what to write, read when writing; who reads it back).
    _sections: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = attrs.Factory(dict)
    #: The sections last written, as written.
    _last_sections: dict[str, Any] | None = None

    def keep_section(self, name: str, write: Callable[[], Any], read: Callable[[Any], None]) -> None:
        """Keep the top-level section ``name`` in the file: ``write()`` gives its JSON value each time the file
        is written, ``read(value)`` takes what the file had at start (None when it had none)."""
        if name in _OWN_KEYS:
            raise ValueError(f"{name!r} is a key of the holds file itself")
        self._sections[name] = (write, read)

    def restore_sections(self, loaded: Loaded) -> None:
        """Hand each kept section what ``loaded`` had of it (nothing from a refused file)."""
        for name, (_, read) in self._sections.items():
            read(loaded.sections.get(name))
    #: The wall clock the file's times are written on (default: the one beside the clock, clock.py).
    wall: WallClock = attrs.field(default=attrs.Factory(lambda self: wall_clock(self._clock), takes_self=True))
    #: This boot's id when the clock is the machine's monotonic one (then times read back exactly on this
    #: boot); None where it is not (a test's Clock, a reactor left on the wall clock).
    boot: str | None = attrs.field(default=attrs.Factory(
        lambda self: boot_id() if is_monotonic(self._clock) else None, takes_self=True,
    ))
    #: Writes ``bytes`` to the path, atomically, or raises OSError (tests give one that fails).
    write: Callable[[Path, bytes], None] = attrs.field(factory=lambda: _write_atomically)
    #: Why the last write failed (None: it did not).
    error: str | None = None
    #: Top-level keys of the file read at start that this version does not know (nor a section kept here):
    #: written back as they were.
    _extra: dict[str, Any] = attrs.Factory(dict)
    #: True while the marker may be beside the file (found at start, or left by a failed write).
    _marked: bool = False

    @property
    def marker(self) -> Path:
        """Beside the file while it may be stale (a write failed since it was last written)."""
        return self.path.with_name(self.path.name + MARKER_SUFFIX)

    def load(self) -> Loaded:
        """The holds in the file; none if there is no file; :attr:`Loaded.refused` if it is not one we can read;
        :attr:`Loaded.stale` if a write had failed since it was written."""
        stale = self._marker_says()
        try:
            data = _read(self.path)
        except (FileNotFoundError, NotADirectoryError):
            # No file, or a path no file can be at (so none was written there): nothing was held, unless a
            # write failed (the first one, say) and left its marker.
            return Loaded(stale=stale)
        except Refused as e:
            return Loaded(refused=str(e), found=True)
        except OSError as e:
            return Loaded(refused=f"cannot read it: {e.strerror or e}", found=True)
        try:
            document = _parse(data, self.wall.now())
        except Refused as e:
            return Loaded(refused=str(e), found=True)
        self._extra = document.extra
        if stale is not None:
            return Loaded(stale=stale, found=True, sections=document.extra)
        elapsed = self._reader(document)
        if self._same_boot(document):
            # The times it wrote read the same here ("since" in /status does not move by a microsecond).
            assert document.written_at is not None and document.monotonic_at is not None
            self.wall.adopt(round(document.written_at - document.monotonic_at, 3))
        holds = tuple(
            attrs.evolve(
                h, since=elapsed(h.since),
                expires_at=None if h.expires_at is None else elapsed(h.expires_at),
                expected_end=None if h.expected_end is None else elapsed(h.expected_end),
            )
            for h in document.holds if h.source not in NOT_KEPT
        )
        return Loaded(holds, found=True, sections=document.extra)

    def save(self, holds: Iterable[Hold]) -> bool:
        """Write ``holds`` (those worth keeping) if they differ from the last written; True if the file is current.

        The first write always happens (it claims the file for this process).
        After another process claimed it later (a reload's new process, which
        has the holds now), nothing more is written: a lease that runs out in
        this process's old copy must not erase the new process's renewal.
        Never raises: a failure is logged (once until a write succeeds again),
        leaves the marker beside the file (the next start doubts it), the
        proxy goes on, and the next change tries again.
        """
        shown = self.wall.shown()
        kept = [_as_json(h, shown) for h in sorted(holds, key=_order) if h.source not in NOT_KEPT]
        sections = {name: write() for name, (write, _) in self._sections.items()}
        if self.claimed_at is not None:
            if kept == self._last and sections == self._last_sections and not self._failing:
                return not self.superseded
            if self._claimed_later():
                return False
        now = self._clock.seconds()
        claimed_at = self.claimed_at if self.claimed_at is not None else now
        document: dict[str, Any] = {
            **self._extra,
            **sections,
            "format": PERSISTED_FORMAT, "version": VERSION, "written_at": shown(now),
            "pid": self.pid, "claimed_at": shown(claimed_at),
        }
        if self.boot is not None:
            document.update(boot_id=self.boot, monotonic_at=now)
        document["holds"] = kept
        try:
            self.write(self.path, json.dumps(document, indent=1).encode() + b"\n")
        except OSError as e:
            self.error = e.strerror or str(e)
            if not self._failing:
                self._failing = True
                log.error(
                    "holds file {path}: cannot write it ({error}); holds are not kept across a restart until it can "
                    "be, and a start before then starts yielded (hold source restart)",
                    path=str(self.path), error=self.error,
                )
            self._mark()
            return False
        self.error = None
        if self._failing:
            self._failing = False
            log.info("holds file {path}: written again", path=str(self.path))
        self.claimed_at = claimed_at
        self._last = kept
        self._last_sections = sections
        if self._marked:
            self._unmark()
        return True

    def _reader(self, document: _Document, restoring: bool = True) -> Callable[[float], float]:
        """How the document's wall-clock times read on this process's elapsed clock.

        Written on this boot, by a process whose clock was the monotonic one:
        exactly, with the writer's own offset.  Otherwise, to restore its
        holds, relative to when it was written: the time since then is what
        the wall clock says, never less than nothing (a wall clock that went
        back stretches no lease); to compare a claim with this process's own,
        with the wall clock's offset of now (both were read on it).
        """
        now = self._clock.seconds()
        written_at, monotonic_at = document.written_at, document.monotonic_at
        if self._same_boot(document):
            assert written_at is not None and monotonic_at is not None
            # The writer's offset, to the millisecond as it keeps it (clock.WallClock): its times read back
            # as the very elapsed-clock times it had, and show as the very wall-clock ones.
            offset = round(written_at - monotonic_at, 3)
            return lambda t: t - offset
        if not restoring:
            return self.wall.elapsed_at
        wall_now = self.wall.now()
        written = wall_now if written_at is None else written_at
        since_written = max(0.0, wall_now - written)
        return lambda t: now - since_written - (written - t)

    def _same_boot(self, document: _Document) -> bool:
        """Written on this boot by a process on the monotonic clock (its times read back exactly)."""
        return (
            self.boot is not None and document.boot_id == self.boot and document.written_at is not None
            and document.monotonic_at is not None and document.monotonic_at <= self._clock.seconds() + SLACK
        )

    def _claimed_later(self) -> bool:
        """True (and logged, once) when another process, still running, claimed the file after this one did.

        A claim by a process that is gone is void: this process claims the file
        again with its next write (logged).
        """
        try:
            document = _parse(_read(self.path), self.wall.now())
        except (OSError, Refused):
            return False  # gone or unreadable: this process writes it again
        pid, claimed_at = document.pid, document.claimed_at
        if pid == self.pid or claimed_at is None or self.claimed_at is None:
            return False
        if self._reader(document, restoring=False)(claimed_at) <= self.claimed_at:
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

    # -- the marker: the file may be stale -----------------------------------------------------

    def _marker_says(self) -> str | None:
        """Why the file may be stale, if a failed write left its marker; else None."""
        try:
            fd = os.open(self.marker, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            # Something is there (a link, a directory...): whatever it is, a write failed or someone meddled.
            self._marked = True
            return f"{self.marker} is there ({e.strerror or e}): a write of it failed"
        self._marked = True
        try:
            details = json.loads(os.read(fd, 4096)) if stat.S_ISREG(os.fstat(fd).st_mode) else {}
        except (OSError, ValueError):
            details = {}
        finally:
            os.close(fd)
        error = details.get("error") if isinstance(details, dict) else None
        at = details.get("at") if isinstance(details, dict) else None
        when = f" at {_utc(at)}" if isinstance(at, (int, float)) and math.isfinite(at) else ""
        because = f" ({str(error)[:200]})" if isinstance(error, str) and error else ""
        return f"a write of it failed{when}{because}, so it may still hold holds that ended since"

    def _mark(self) -> None:
        """Leave the marker beside the file (best effort: a read-only disk takes none; a start doubts a file it
        cannot write anyway)."""
        if self._marked:
            return
        body = json.dumps({"at": self.wall.now(), "error": self.error, "pid": self.pid}).encode() + b"\n"
        try:
            fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warn(
                "holds file {path}: cannot leave {marker} either ({error}); a start that can write the file again "
                "would not know it may be stale",
                path=str(self.path), marker=str(self.marker), error=e.strerror or str(e),
            )
            return
        self._marked = True
        try:
            with contextlib.suppress(OSError):  # what failed, for the next start's line; its presence is what counts
                os.write(fd, body)
                os.fsync(fd)
        finally:
            os.close(fd)

    def _unmark(self) -> None:
        """The file says what is held again: the marker goes."""
        try:
            os.unlink(self.marker)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warn(
                "holds file {path}: written, but {marker} cannot be removed ({error}); the next start will doubt "
                "the file", path=str(self.path), marker=str(self.marker), error=e.strerror or str(e),
            )
            return
        self._marked = False


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
    a new one would.  The file is written once at start (it claims the file):
    a file that cannot be written now may be stale, so it is doubted.
    """
    loaded = store.load()
    store.restore_sections(loaded)
    doubt = loaded.refused or loaded.stale
    if doubt is None and loaded.found and not store.save(loaded.holds):
        doubt = (
            f"it cannot be written now ({store.error}), so it may still hold holds that ended after the last "
            "write that failed"
        )
    state.on_holds_changed(store.save)
    if doubt is None:
        restored = state.restore(loaded.holds)
        if restored:
            log.info("holds file {path}: {count} hold(s) restored", path=str(store.path), count=len(restored))
        # The file now says what is held (leases run out meanwhile, outage holds of an older file are gone),
        # and that this process writes it: written only if that differs from what it said.
        store.save(state.holds)
        return
    what = "refused" if loaded.refused is not None else "doubted"
    aside = store.set_aside() if loaded.found else None
    log.error(
        "holds file {path} {what} ({why}){aside}; starting yielded (hold source restart) for up to {bound:g}s "
        "or until `yieldproxy resume --source restart`: when in doubt, no work goes to a GPU that may be taken",
        path=str(store.path), what=what, why=doubt, aside=f", moved to {aside}" if aside else "",
        bound=restart_hold_seconds,
    )
    state.hold(
        RESTART_SOURCE, f"holds file {store.path} {what} at start ({doubt})"[:MAX_REASON],
        for_seconds=restart_hold_seconds,
    )


def _order(hold: Hold) -> tuple[float, str, str]:
    """The file's order: by start, then source and upstream (the same holds are the same bytes)."""
    return (hold.since, hold.source, hold.scope)


def _as_json(hold: Hold, shown: Callable[[float], float]) -> dict[str, Any]:
    return {
        "source": hold.source,
        "reason": hold.reason,
        "since": shown(hold.since),
        "upstream": None if hold.scope == ALL else hold.scope,
        "expires_at": None if hold.expires_at is None else shown(hold.expires_at),
        "expected_end": None if hold.expected_end is None else shown(hold.expected_end),
    }


def _read(path: Path) -> bytes:
    """The file's first bytes, opened without blocking (a FIFO) and without following a link; :class:`Refused`
    for anything that is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused(
                "a symbolic link: each write replaces the file, so point state.holds_file at the file itself"
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Refused(f"not a regular file ({_kind(mode)})")
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a file"


def _parse(data: bytes, wall_now: float) -> _Document:
    """The holds file's bytes as a document, or :class:`Refused` saying what is wrong.

    Its times are checked against when it was written (``written_at``; now,
    for a file without one): no hold began after it, no lease or expected end
    is more than a week past it, or before its hold began.
    """
    if len(data) > MAX_BYTES:
        raise Refused(f"larger than {MAX_BYTES} bytes: not a holds file")
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise Refused(f"not JSON: {e}") from None
    if not isinstance(document, dict) or document.get("format") != PERSISTED_FORMAT:
        raise Refused(f"not a yieldproxy holds file (no \"format\": \"{PERSISTED_FORMAT}\")")
    version = document.get("version")
    if version != VERSION:
        raise Refused(f"version {version!r}, this yieldproxy reads version {VERSION}")
    entries = document.get("holds")
    if not isinstance(entries, list):
        raise Refused("\"holds\" is not a list")
    written_at = _optional_time(document.get("written_at"), "written_at")
    claimed_at = _optional_time(document.get("claimed_at"), "claimed_at")
    monotonic_at = _optional_time(document.get("monotonic_at"), "monotonic_at")
    boot = document.get("boot_id")
    reference = wall_now if written_at is None else written_at
    return _Document(
        holds=[_hold(entry, i, reference) for i, entry in enumerate(entries)],
        written_at=written_at,
        boot_id=boot if isinstance(boot, str) and 0 < len(boot) <= 64 else None,
        monotonic_at=monotonic_at,
        claimed_at=claimed_at,
        pid=document.get("pid"),
        extra={key: value for key, value in document.items() if key not in _OWN_KEYS},
    )


def _hold(entry: Any, index: int, written_at: float) -> Hold:
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
    if len(reason) > MAX_REASON:
        raise Refused(f"{where}.reason is longer than {MAX_REASON} characters")
    if upstream is not None:
        try:
            check_source(upstream)  # an upstream's name follows the same rules as a source's
        except ValueError:
            raise Refused(f"{where}.upstream is not an upstream's name") from None
    since = _time(entry.get("since"), f"{where}.since")
    if since > written_at + SLACK:
        raise Refused(f"{where}.since is {since - written_at:.0f}s after the file was written")
    ends = {}
    for key in ("expires_at", "expected_end"):
        end = ends[key] = _optional_time(entry.get(key), f"{where}.{key}")
        if end is None:
            continue
        if end < since:
            raise Refused(f"{where}.{key} is before its since")
        if end > written_at + MAX_HOLD_SECONDS + SLACK:
            raise Refused(f"{where}.{key} is more than a week after the file was written")
    return Hold(
        source=source,
        reason=reason,
        since=since,
        expected_end=ends["expected_end"],
        expires_at=ends["expires_at"],
        scope=ALL if upstream is None else upstream,
    )


def _time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Refused(f"{where} is not a time")
    return float(value)


def _optional_time(value: Any, where: str) -> float | None:
    return None if value is None else _time(value, where)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _write_atomically(path: Path, data: bytes) -> None:
    """``data`` in ``path``, or the old content: write a temporary file, fsync it, rename it over, fsync the directory."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
        with contextlib.suppress(OSError):
            os.unlink(temporary)
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
