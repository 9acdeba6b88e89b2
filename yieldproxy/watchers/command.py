"""The command probe: a shell command, run every few seconds, says whether the GPU is taken.

The contract is grep's: exit status 0 means "yielded", 1 "not yielded",
anything else is an error and the state stays what it was (docs/watchers.md,
"The command probe").  Each run starts in its own process group, so a
timeout kills the whole pipeline (a hung ``nvidia-smi`` under the shell too),
not only the shell.  A probe never overlaps the previous one, and a failing
probe never stops the loop.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from ..clock import cancel
from ..lot.state import ALL, YieldState
from ..names import COMMAND_SOURCE
from ..observe.metrics import Metrics
from ..periodic import every

log = Logger()

SOURCE = COMMAND_SOURCE
#: Output kept from one run, for the hold's reason and the error log.
OUTPUT_LIMIT = 4096
#: The same error is logged again at most this often (a broken probe runs every few seconds).
ERROR_LOG_EVERY = 60.0

#: Runs the command through /bin/sh as the leader of a new process group.
_LAUNCHER = (
    "import os, sys\n"
    "os.setpgid(0, 0)\n"
    "try:\n"
    "    os.execv('/bin/sh', ['/bin/sh', '-c', sys.argv[1]])\n"
    "except OSError as e:\n"
    "    sys.stderr.write('cannot run /bin/sh: %s\\n' % e)\n"
    "    os._exit(127)\n"
)


class _Run(ProcessProtocol):
    """One probe run: its output (bounded) and how it ended."""

    def __init__(self) -> None:
        self.output = bytearray()
        self.ended: Deferred = Deferred()
        self.timed_out = False
        #: The process group to kill: the launcher's pid, which leads it.
        self.group: int | None = None
        #: How the shell itself ended, before every pipe closed.
        self.exited = None

    def outReceived(self, data: bytes) -> None:
        room = OUTPUT_LIMIT - len(self.output)
        if room > 0:
            self.output += data[:room]

    errReceived = outReceived

    def processExited(self, reason) -> None:
        self.exited = reason.value

    def processEnded(self, reason) -> None:
        if not self.ended.called:
            self.ended.callback(reason.value)

    def text(self) -> str:
        return self.output.decode("utf-8", "replace").strip()


@attrs.define(eq=False, slots=False)
class CommandWatcher(Service):
    """Runs :attr:`command` every :attr:`interval` seconds and holds the GPU while it says so."""

    #: ``IReactorTime`` and ``IReactorProcess``.
    _reactor: Any
    _state: YieldState
    _metrics: Metrics
    command: str
    interval: float = 5.0
    timeout: float = 10.0
    #: ``spawn(protocol, executable, args, env)``; default ``reactor.spawnProcess``.
    spawn: Callable | None = None
    #: What the last run said: ``yielded``, ``available`` or ``error``; None before the first.
    last_answer: str | None = None
    last_detail: str = ""
    runs: int = 0
    _loop: LoopingCall | None = None
    _current: tuple | None = None
    _error_logged: tuple[str, float] | None = None
    _errors_unlogged: int = 0
    _stopped: bool = False
    #: Whose GPU the hold takes: one pool member, or all (``*``: the global ``watchers.command``).
    scope: str = ALL

    name = "watcher:command"  # type: ignore[assignment]  # Twisted types Service.name as None

    def __attrs_post_init__(self) -> None:
        if self.scope != ALL:
            self.name = f"watcher:command:{self.scope}"

    def startService(self) -> None:
        super().startService()
        self._loop = every(self._reactor, self.interval, self.probe_once, "command probe step")
        log.info(
            "command watcher: running {command!r} every {interval:g}s (timeout {timeout:g}s)",
            command=self.command,
            interval=self.interval,
            timeout=self.timeout,
        )

    def stopService(self) -> None:
        """Stop the loop and kill a run in progress; a hold taken stays."""
        super().stopService()
        self._stopped = True
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._current is not None:
            run, transport, timer = self._current
            cancel(timer)
            self._kill(run, transport)
            if not run.ended.called:
                run.ended.callback(None)

    def status(self) -> dict:
        return {
            "command": self.command,
            "last_answer": self.last_answer,
            "last_detail": self.last_detail,
            "runs": self.runs,
            "holding": self._state.hold_of(SOURCE, self.scope) is not None,
        }

    def probe_once(self) -> Deferred:
        """Run the command once and act on its answer.  The Deferred never fails."""
        d = Deferred.fromCoroutine(self._probe())

        def failed(failure):
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            log.failure("command probe step failed", failure)

        return d.addErrback(failed)

    async def _probe(self) -> None:
        answer, detail = await self._run()
        self.runs += 1
        if self._stopped:
            return
        self._apply(answer, detail)

    async def _run(self) -> tuple[str, str]:
        """``(answer, detail)`` of one run."""
        run = _Run()
        spawn = self.spawn or self._reactor.spawnProcess
        try:
            transport = spawn(
                run, sys.executable, [sys.executable, "-I", "-c", _LAUNCHER, self.command], env=dict(os.environ)
            )
        except Exception as e:
            return "error", f"cannot start it: {e}"
        # Kept: the transport forgets its pid once the shell is reaped, but a
        # child it left behind still holds the group (and our pipes).
        run.group = getattr(transport, "pid", None)
        timer = self._reactor.callLater(self.timeout, self._time_out, run, transport)
        self._current = (run, transport, timer)
        try:
            ended = await run.ended
        finally:
            self._current = None
            cancel(timer)
        output = run.text()
        if run.timed_out:
            return "error", f"no answer within {self.timeout:g}s; killed it{_tail(output)}"
        if isinstance(ended, ProcessDone):
            return "yielded", output.splitlines()[0][:200] if output else ""
        if isinstance(ended, ProcessTerminated):
            if ended.exitCode == 1:
                return "available", output
            if ended.signal is not None:
                return "error", f"killed by signal {ended.signal}{_tail(output)}"
            return "error", f"exited {ended.exitCode} (0 means yielded, 1 not yielded){_tail(output)}"
        return "error", f"ended without a status ({ended!r})"

    def _time_out(self, run: _Run, transport) -> None:
        """Kill a run that did not answer in time; the loop goes on.

        A shell that exited but left a child holding its output open did
        answer: its status counts, and the child is killed with the group.
        """
        run.timed_out = run.exited is None
        self._kill(run, transport)
        try:
            transport.loseConnection()
        except Exception:
            pass
        if not run.ended.called:
            run.ended.callback(run.exited)

    def _kill(self, run: _Run, transport) -> None:
        """SIGKILL the run's whole process group (it leads its own), else the process."""
        if self.spawn is None and run.group is not None:
            try:
                os.killpg(run.group, signal.SIGKILL)
                return
            except (ProcessLookupError, PermissionError):
                pass  # not a group leader yet (killed within its first milliseconds)
        if getattr(transport, "pid", None) is None:
            return
        try:
            transport.signalProcess("KILL")
        except Exception:
            pass

    def _apply(self, answer: str, detail: str) -> None:
        """Hold, release, or (on an error) leave the state alone."""
        previous, self.last_answer, self.last_detail = self.last_answer, answer, detail
        if answer == "error":
            self._metrics.watcher_errors_total.labels(SOURCE).inc()
            self._log_error(detail)
            return
        if self._error_logged is not None:
            log.info("command probe answers again ({answer})", answer=answer)
            self._error_logged, self._errors_unlogged = None, 0
        if answer == "yielded":
            if self._state.hold_of(SOURCE, self.scope) is None:
                self._state.hold(SOURCE, detail or f"command {self.command!r} exited 0", scope=self.scope)
        elif self._state.hold_of(SOURCE, self.scope) is not None:
            self._state.release(SOURCE, self.scope)
        if answer != previous:
            log.debug("command probe: {answer}", answer=answer)

    def _log_error(self, detail: str) -> None:
        """Log a probe error, but the same one at most once a minute."""
        now = self._reactor.seconds()
        if self._error_logged is not None:
            text, at = self._error_logged
            if text == detail and now - at < ERROR_LOG_EVERY:
                self._errors_unlogged += 1
                return
        repeated = f" (and {self._errors_unlogged} times more since the last report)" if self._errors_unlogged else ""
        log.warn(
            "command probe {command!r} failed: {detail}{repeated}; keeping the state as it is",
            command=self.command,
            detail=detail,
            repeated=repeated,
        )
        self._error_logged, self._errors_unlogged = (detail, now), 0


def _tail(output: str) -> str:
    """The end of the run's output, for an error message."""
    if not output:
        return ""
    return ": " + output[-300:].replace("\n", " | ")
