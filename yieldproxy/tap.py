"""The twistd plugin: ``twistd -n yieldproxy [--config FILE] [--upstream URL] ...``.

This is the one module that touches the global reactor: everything else takes
it as an argument.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Iterable, cast

from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger
from twisted.python import usage

from .config import ConfigError, load, read_tokens
from .lifecycle.succession.takeover import ENV, refuse
from .lot.state import ALL, Hold
from .observe.requestlog import LOG_FORMATS, LOG_LEVELS, observer_name

log = Logger()

_LOOPBACK_ENDPOINT = re.compile(r"interface=(127\.\d+\.\d+\.\d+|::1|\\:\\:1|localhost)(:|$)")


class Options(usage.Options):
    synopsis = "[--config FILE] [--upstream URL] [--listen ENDPOINT] [--admin ENDPOINT]"
    longdesc = (
        "A reverse proxy for Ollama that parks requests while the GPU is yielded "
        "and replays them, paced, when it returns. Command-line options override the config file."
    )
    optParameters = [
        ["config", "c", None, "TOML config file ('yieldproxy example-config' prints a commented one)."],
        ["upstream", "u", None, "Upstream URL (default http://127.0.0.1:11434)."],
        ["listen", "l", None, "Proxy endpoint (default tcp:11435:interface=127.0.0.1)."],
        ["admin", "a", None, "Admin endpoint (default tcp:11436:interface=127.0.0.1)."],
        ["log-format", None, "text", "Log format: text (twistd's own) or json (one JSON object per line)."],
        ["log-level", None, "info", "Least level logged: debug, info, warn or error."],
    ]

    def opt_version(self) -> None:
        """Print yieldproxy's version (and Twisted's) and exit."""
        from twisted import __version__ as twisted_version

        from . import __version__

        print(f"yieldproxy {__version__} (Twisted {twisted_version})")
        raise SystemExit(0)

    def parseOptions(self, options=None):
        """Under twistd, a usage or config error is one line on stderr and exit status 1.

        twistd itself would print its whole option listing before the error;
        called without twistd (``Options().parseOptions``), the
        :class:`~twisted.python.usage.UsageError` propagates as usual.
        """
        try:
            super().parseOptions(options)
        except usage.UsageError as e:
            if self.parent is None:
                raise
            message = str(e)
            if message.startswith("option "):
                # getopt's own: an unknown option, or one without its value.
                message += " (twistd yieldproxy --help lists the options)"
            if not refuse(os.environ, message):
                print(f"twistd yieldproxy: {message}", file=sys.stderr)
            # else: started by a reload, whose process logs the line and keeps running.
            raise SystemExit(1) from None

    def postOptions(self):
        try:
            config = load(self["config"])
            token, read_token = read_tokens(config)
        except ConfigError as e:
            raise usage.UsageError(str(e)) from None
        if self["upstream"] is not None and config.upstreams:
            raise usage.UsageError(
                "--upstream: the config file has [[upstreams]]; --upstream replaces proxy.upstream, "
                "the one-upstream form (change the url in [[upstreams]] instead)"
            )
        for option, key in (("upstream", "proxy.upstream"), ("listen", "proxy.listen"), ("admin", "admin.listen")):
            if self[option] is not None:
                try:
                    config = config.with_overrides(**{key: self[option]})
                except ValueError as e:
                    raise usage.UsageError(f"--{option}: {e}") from None
        for key, endpoint in (("proxy.listen", config.proxy.listen), ("admin.listen", config.admin.listen)):
            try:
                # Parsing builds the endpoint object only; nothing listens yet.
                serverFromString(None, endpoint)
            except (ValueError, KeyError, TypeError) as e:
                hint = endpoint_hint(endpoint)
                if hint is not None:
                    hint = f"; did you mean {hint!r}?" + (
                        " (add ':interface=127.0.0.1' to listen on this machine only)" if ":interface=" not in hint else ""
                    )
                raise usage.UsageError(f"{key}: not a valid endpoint ({e}): {endpoint!r}{hint or ''}") from None
        if token is None and not admin_is_local(config.admin.listen):
            raise usage.UsageError(
                f"admin.listen: {config.admin.listen!r} is reachable from other hosts; "
                "set admin.token_file (or listen on 127.0.0.1 or a unix socket)"
            )
        self.config = config
        self.token = token
        self.read_token = read_token
        self._set_log_format()
        self._set_succession()

    #: twistd's pidfile, absolute (None: none); see :meth:`_set_succession`.
    pidfile: str | None = None

    def _set_succession(self) -> None:
        """What a reload needs of twistd's own options (lifecycle/succession/claims.py).

        The pidfile names the process that serves.  A process a reload started
        runs twistd without one (its twistd would refuse to start beside the
        running one's pidfile): it takes the file over at its commit.  And it
        stays in the foreground, the child of the process it replaces (a
        twistd started without ``-n`` forked into the background already; its
        successor has nothing to fork away from).
        """
        parent = getattr(self, "parent", None)
        if parent is None:
            return
        pidfile = parent.get("pidfile")
        self.pidfile = os.path.abspath(pidfile) if pidfile else None
        if ENV not in os.environ:
            return
        parent["pidfile"] = ""
        parent["nodaemon"] = True
        # Its predecessor switched to them already (twistd --uid/--gid, started as root): this process
        # runs as them from its start, and could not switch again.
        for key, now in (("uid", os.getuid()), ("gid", os.getgid())):
            if parent.get(key) == now:
                parent[key] = None

    def keep_pidfile(self) -> None:
        """This process handed the pidfile over: twistd leaves it as it exits (it names the new process)."""
        parent = getattr(self, "parent", None)
        if parent is not None:
            parent["pidfile"] = ""

    def _set_log_format(self) -> None:
        """Give twistd the JSON observer by setting its own ``--logger`` option.

        twistd reads ``--logger`` (a dotted name it imports once every option
        is parsed) when it builds its logger, before it calls
        :func:`makeService`, so this is the one clean place to choose the
        observer: ``twistd -n yieldproxy --log-format json`` is exactly
        ``twistd -n --logger yieldproxy.observe.requestlog.json_observer yieldproxy``; the
        least level is part of that name (:func:`~yieldproxy.observe.requestlog.observer_name`).
        """
        fmt = self["log-format"]
        if fmt not in LOG_FORMATS:
            raise usage.UsageError(f"--log-format: must be text or json, got {fmt!r}")
        level = self["log-level"]
        if level not in LOG_LEVELS:
            raise usage.UsageError(f"--log-level: must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        parent = getattr(self, "parent", None)
        if parent is None:
            return
        own_output = parent.get("logger") or parent.get("syslog") or parent.get("logfile") not in (None, "", "-")
        if fmt == "text":
            # twistd's own --logger/--logfile/--syslog, if given, win (unfiltered).
            if not own_output:
                parent["logger"] = observer_name("text", level)
            return
        if parent.get("logger"):
            raise usage.UsageError("--log-format json: twistd's --logger is set too; use one of them")
        if parent.get("syslog"):
            raise usage.UsageError("--log-format json: cannot write JSON to syslog; drop --syslog")
        if parent.get("logfile") not in (None, "", "-"):
            raise usage.UsageError("--log-format json: writes to stdout (the journal under systemd); drop --logfile")
        parent["logger"] = observer_name("json", level)


#: ``[host]:port`` as typed for a listener: an IP address or localhost (any host name after ``http://``).
_HOST_PORT = re.compile(
    r"(?:(?:https?://([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]))|(\[[0-9A-Fa-f:.]+\]|\d{1,3}(?:\.\d{1,3}){3}|localhost))?"
    r":(\d{1,5})/?"
)


def endpoint_hint(text: str) -> str | None:
    """The endpoint string someone who typed ``text`` probably meant: ``22450`` is ``tcp:22450``,
    ``127.0.0.1:22450`` (or ``http://127.0.0.1:22450``) is ``tcp:22450:interface=127.0.0.1``; else None."""
    text = text.strip()
    if text.isdigit():
        return f"tcp:{text}"
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        return None
    named, address, port = match.groups()
    host = named or address
    if not host:
        return f"tcp:{port}"
    host = host.strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    return f"tcp:{port}:interface={host.replace(':', chr(92) + ':')}"


def admin_is_local(endpoint: str) -> bool:
    """True for unix sockets and TCP endpoints bound to a loopback interface."""
    if endpoint.startswith("unix:"):
        return True
    return bool(_LOOPBACK_ENDPOINT.search(endpoint))


def _cannot_reload(options: Options) -> str | None:
    """Why a reload cannot start a successor with this process's command line, if it cannot.

    The successor runs the same command (its pidfile and its daemonising are
    seen to: :meth:`Options._set_succession`).  A chroot cannot be entered
    again from inside it.
    """
    parent = getattr(options, "parent", None)
    if parent is not None and parent.get("chroot"):
        return "reload cannot start a new process inside twistd's --chroot: restart it instead"
    return None


def say_kept_holds(holds: Iterable[Hold], now: float) -> None:
    """One warning per hold a start kept from the last run, saying how to end it: a restart does not reset the
    yield state (docs/operating.md), and someone who restarted the proxy to unstick it must learn so at once."""
    for hold in holds:
        upstream = "" if hold.scope == ALL else f" --upstream {hold.scope}"
        lease = "" if hold.expires_at is None else f", lease ends in {max(0.0, hold.expires_at - now):.0f}s"
        log.warn(
            "still yielded: the hold of source {source}{on} (reason {reason!r}{lease}) is kept from the last run; "
            "'yieldproxy resume --source {source}{upstream}' ends it",
            source=hold.source, on="" if hold.scope == ALL else f" on upstream {hold.scope}",
            reason=hold.reason, lease=lease, upstream=upstream,
        )


def _terminal(options: Options) -> str | None:
    """Which standard stream is a terminal, when this proxy runs as a terminal program (lifecycle/hangup.py).

    Only under twistd: a service built without it keeps its embedder's signals.
    """
    from .lifecycle.hangup import terminal_of

    parent = getattr(options, "parent", None)
    if parent is None:
        return None
    return terminal_of(os.environ, daemonizes=not parent.get("nodaemon"), reloaded=ENV in os.environ)


def makeService(options: Options):
    from twisted.internet import reactor

    from .clock import run_on_monotonic
    from .lifecycle.hangup import HangupStops, why_no_reload
    from .lifecycle.holdstore import HoldStore, holds_path
    from .lifecycle.limits import fit_fd_limit
    from .lifecycle.sdnotify import Notifier, Ready, Watchdog, watchdog_seconds
    from .lifecycle.succession import ClaimedAtCommit, Inheritance, Setup, own_command
    from .lifecycle.succession.wire import BadFrame
    from .service import YieldProxyService, build
    from .upstream.pool.members import url_warnings
    from .watchers.signals import StopSignals

    # Every timer on elapsed time, before anything is scheduled (clock.py).
    run_on_monotonic(reactor)
    # Started by a reload: the running process's listening sockets come first (lifecycle/succession/).
    try:
        inheritance = Inheritance.from_environment(os.environ)
    except (BadFrame, OSError, ValueError) as e:
        print(f"twistd yieldproxy: reload: nothing usable came from the running process ({e})", file=sys.stderr)
        raise SystemExit(1) from None
    notifier = Notifier.from_environment(os.environ)
    # The process's own limit, raised (or the connection cap lowered) before anything listens.
    config = fit_fd_limit(options.config)
    for warning in url_warnings(config):
        log.warn("{warning}", warning=warning)
    store = HoldStore(reactor, holds_path(config, os.environ))
    # Read now, written from the commit on: until then the running process owns the holds (claims.py).
    claimed = ClaimedAtCommit(store) if inheritance is not None else None
    # In a terminal, SIGHUP is the terminal hanging up: the stop, and no reload (lifecycle/hangup.py).
    terminal = _terminal(options)
    setup = Setup(
        own_command(), dict(os.environ), reactor.stop, inheritance,
        notify=notifier.notify, signals=terminal is None,
        unavailable=_cannot_reload(options) or (why_no_reload(terminal, os.getpid()) if terminal else None),
        pidfile=options.pidfile, keep_pidfile=options.keep_pidfile,
        holds=claimed,
    )
    proxy = build(
        reactor, config, token=options.token, read_token=options.read_token, succession=setup,
        # ClaimedAtCommit: the store's own reads and writes, its writes from the commit on.
        holds=cast(HoldStore, claimed) if claimed is not None else store,
    )
    if inheritance is None:
        say_kept_holds(proxy.state.holds, reactor.seconds())
    # systemd (Type=notify): the watchdog is fed from the first start to the last stop (a long
    # drain included); READY=1 once everything runs, the listeners bound (a process a reload
    # started leaves it to its predecessor, which sends MAINPID= with it); STOPPING=1 as the
    # stop begins.  Started in this order, stopped in the reverse one.
    interval = watchdog_seconds(os.environ, os.getpid())
    return YieldProxyService([
        *([Watchdog(reactor, notifier, interval)] if interval is not None and notifier.enabled else []),
        proxy.service,
        Ready(
            notifier, status=f"serving on {config.proxy.listen}, admin on {config.admin.listen}",
            ready=inheritance is None,
        ),
        *([HangupStops(cast(IReactorFromThreads, reactor), reactor.stop)] if terminal else []),
        # The first to stop: a second SIGTERM (or hang-up) during the stop is logged, not a second stop.
        StopSignals(
            cast(IReactorFromThreads, reactor), config.proxy.shutdown_timeout_seconds,
            stop_signals=(signal.SIGTERM, signal.SIGINT, *((signal.SIGHUP,) if terminal else ())),
        ),
    ])
