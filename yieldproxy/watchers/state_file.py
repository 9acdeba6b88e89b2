"""The state-file watcher: the GPU is yielded while a file exists (docs/watchers.md, "The state file").

The file's existence is the signal, its content (JSON ``reason`` and
``expected_seconds``) only a detail: bad content is logged and counted, and
the hold is taken anyway.  Polling on the injected clock works everywhere;
where inotify is available it is added on top, so a change is seen at once.
The watcher only takes and ends its own hold, so a file that vanishes and
comes back quickly cannot reorder parked requests.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from ..lot.state import ALL, MAX_HOLD_SECONDS, YieldState
from ..names import FILE_SOURCE
from ..observe.metrics import Metrics
from ..periodic import every

log = Logger()

SOURCE = FILE_SOURCE
#: More than this is not a small JSON note; only this much is read.
MAX_CONTENT_BYTES = 64 * 1024


def parse_content(raw: bytes) -> tuple[str | None, float | None, str | None]:
    """``(reason, expected_seconds, problem)`` from the file's bytes.

    Empty content is fine (no details).  Anything else must be a JSON object;
    unknown keys are ignored, bad values are dropped and named in ``problem``.
    """
    if not raw.strip():
        return None, None, None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return None, None, f"not JSON ({e})"
    if not isinstance(body, dict):
        return None, None, "not a JSON object"
    problems = []
    reason = body.get("reason")
    if reason is not None and not isinstance(reason, str):
        problems.append("reason is not a string")
        reason = None
    expected = body.get("expected_seconds")
    if expected is not None:
        if isinstance(expected, bool) or not isinstance(expected, (int, float)) or not (
            math.isfinite(expected) and expected > 0
        ):
            problems.append("expected_seconds is not a positive number")
            expected = None
        elif expected > MAX_HOLD_SECONDS:
            problems.append(f"expected_seconds is more than {MAX_HOLD_SECONDS:g} (a week)")
            expected = None
        else:
            expected = float(expected)
    return (reason[:500] if reason else None), expected, "; ".join(problems) or None


@attrs.define(eq=False, slots=False)
class StateFileWatcher(Service):
    """Holds the GPU (source ``file``) while :attr:`path` exists."""

    _clock: IReactorTime
    _state: YieldState
    _metrics: Metrics
    path: str
    poll_seconds: float = 1.0
    #: A real reactor to add inotify on (None: polling only, as under a Clock).
    inotify_reactor: object = None
    #: (inode, mtime, size) of the file when last read, so unchanged content is not re-read.
    _seen: tuple | None = None
    _loop: LoopingCall | None = None
    #: The inotify watch (twisted.internet.inotify.INotify), when one runs.
    _notifier: Any = None
    #: Whose GPU the hold takes: one pool member, or all (``*``: the global ``watchers.state_file``).
    scope: str = ALL

    name = "watcher:file"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        if self.scope != ALL:
            self.name = f"watcher:file:{self.scope}"

    def startService(self) -> None:
        super().startService()
        self._loop = every(self._clock, self.poll_seconds, self.check, "state-file watcher step")
        if self.inotify_reactor is not None:
            self._start_inotify()
        log.info(
            "state-file watcher: the GPU is yielded while {path} exists (polled every {poll:g}s{extra})",
            path=self.path,
            poll=self.poll_seconds,
            extra=", and watched with inotify" if self._notifier is not None else "",
        )

    def stopService(self) -> None:
        """Stop watching; an existing hold stays (the file still says yielded)."""
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._notifier is not None:
            self._notifier.loseConnection()
            self._notifier = None

    def status(self) -> dict:
        return {
            "path": self.path,
            "holding": self._state.hold_of(SOURCE, self.scope) is not None,
            "inotify": self._notifier is not None,
        }

    def check(self) -> None:
        """One look at the file: take, renew or end the hold.  Never raises."""
        try:
            self._check()
        except Exception:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("state-file watcher step failed")

    def _check(self) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._seen = None
            if self._state.hold_of(SOURCE, self.scope) is not None:
                log.info("state file {path} is gone: ending the file hold", path=self.path)
                self._state.release(SOURCE, self.scope)
            return
        except OSError as e:
            # Cannot tell (a permission problem on the directory): keep the state as it is.
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.warn("state file {path}: cannot stat it ({error}); keeping the state", path=self.path, error=e)
            return
        signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if signature == self._seen and self._state.hold_of(SOURCE, self.scope) is not None:
            return
        self._seen = signature
        raw = b""
        problem = None
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_CONTENT_BYTES + 1)
        except OSError as e:
            problem = f"cannot read it ({e.strerror or e})"
        if len(raw) > MAX_CONTENT_BYTES:
            raw, problem = b"", f"larger than {MAX_CONTENT_BYTES} bytes"
        reason, expected, content_problem = parse_content(raw) if problem is None else (None, None, None)
        problem = problem or content_problem
        if problem is not None:
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.warn(
                "state file {path}: {problem}; holding the GPU anyway (expected JSON like "
                '{{"reason": "game", "expected_seconds": 3600}}, or an empty file)',
                path=self.path,
                problem=problem,
            )
        self._state.hold(SOURCE, reason or f"state file {self.path}", expected_seconds=expected, scope=self.scope)

    def _start_inotify(self) -> None:
        """Watch the file's directory too, so a change is seen at once; polling stays."""
        try:
            from twisted.internet import inotify
            from twisted.python.filepath import FilePath
            from twisted.python.runtime import platform

            if not platform.supportsINotify():
                return
            directory = FilePath(os.path.dirname(os.path.abspath(self.path)))
            if not directory.isdir():
                log.info(
                    "state file {path}: its directory does not exist yet; polling only", path=self.path
                )
                return
            notifier = inotify.INotify(self.inotify_reactor)
            notifier.startReading()
            mask = (
                inotify.IN_CREATE | inotify.IN_DELETE | inotify.IN_MOVED_FROM | inotify.IN_MOVED_TO
                | inotify.IN_CLOSE_WRITE | inotify.IN_MODIFY | inotify.IN_ATTRIB
            )
            notifier.watch(directory, mask=mask, callbacks=[self._notified])
            self._notifier = notifier
        except Exception:
            log.failure("state file {path}: cannot watch it with inotify; polling only", path=self.path)

    def _notified(self, ignored, filepath, mask) -> None:
        # Event paths come back as bytes whatever the watched path was.
        if os.fsdecode(filepath.basename()) == os.path.basename(self.path):
            self.check()
