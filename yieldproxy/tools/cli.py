"""The ``yieldproxy`` command: serve, status, yield, resume, a self-contained demo, a sim, the example config.

``status``, ``yield``, ``resume`` and ``reload`` call the admin API through the
broker library's :class:`~yieldproxy.tools.broker.Admin` (the one client of
it), on the reactor's thread pool, made for people and for scripts: every
call has a timeout, and the exit status says what happened (see
:data:`EPILOG`).  ``demo`` lives in tools/demo.py,
``check-fallback`` in upstream/fallback/check.py, ``sim`` in the sim package.

Only :func:`main` and the command functions it starts touch the global
reactor (through :func:`twisted.internet.task.react`); importing this module
does not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence, TextIO, cast
from urllib.parse import urlsplit

import attrs
from twisted.internet import defer, task, threads

from ..text import printable
from .broker import Admin, AdminError, AdminUnreachable
from .exits import EXIT_ERROR, EXIT_NO_HOLD, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_YIELDED, CliError

__all__ = [
    "EXIT_ERROR", "EXIT_NO_HOLD", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "EXIT_YIELDED", "CliError",
    "admin_target_from_endpoint", "admin_target_from_option", "build_parser", "call_admin", "format_one_line",
    "format_status", "main", "resolve_settings",
]

DEFAULT_ADMIN = "http://127.0.0.1:11436"
#: Seconds each admin API call may take, unless ``--timeout`` says otherwise.
HTTP_TIMEOUT = 10.0

EPILOG = """\
exit status:
  0  done
  1  the admin API answered with an error (its message is printed),
     or the demo found a failed request or a wrong vector
  2  usage error: a bad option, an unreadable --config or token file
  3  the admin API could not be reached: nothing listening at the
     address, or no answer within --timeout seconds
  4  only with "status --exit-code": the GPU is yielded now
  5  only with "resume": the source held nothing, so nothing ended
     (a misspelt --source?); the line names the holds there are

where the admin API is:
  --admin URL, else $YIELDPROXY_ADMIN, else admin.listen of --config FILE
  (tcp: and unix: endpoints), else http://127.0.0.1:11436.
  unix:/path/to/admin.sock reaches an admin listener on a unix socket.

the token (when the proxy has admin.token_file set), the first of:
  --token-file FILE         a file holding the token
  $YIELDPROXY_TOKEN         the token itself (not a file)
  $YIELDPROXY_TOKEN_FILE    a file holding the token
  --config FILE             its admin.token_file; for status, its
                            admin.read_token_file when set (read-only)
  yield, resume and reload need the admin token; status also works with the
  read-only token (admin.read_token_file).  The token is sent as
  "Authorization: Bearer ..." and never printed; there is deliberately no
  option that takes the token itself, so it cannot leak through ps.

examples:
  yieldproxy serve --upstream http://127.0.0.1:11434   # start it here
  yieldproxy status
  yieldproxy yield --for 600 --reason "fine-tuning run" --source trainer
  yieldproxy resume --source trainer
  yieldproxy status --exit-code >/dev/null && run-batch   # only when not yielded
  yieldproxy demo                # no Ollama needed
  yieldproxy sim --port 11434    # a fake Ollama to put the proxy in front of
  yieldproxy example-config > yieldproxy.toml   # every key, commented
  yieldproxy ops-files ./etc     # the systemd unit, Prometheus rules, dashboard
"""

#: ``demo --help``: the demo runs its own proxy, so the admin API notes do not apply.
DEMO_EPILOG = """\
exit status:
  0  every request got its right vector
  1  a request failed, a vector was wrong, or the deadline passed
  2  usage error: a bad option
  130  interrupted (Ctrl-C)

It needs no Ollama and no running proxy: the simulated backend, the proxy
and its admin API run in this process, on free 127.0.0.1 ports it picks.
"""


# ---------------------------------------------------------------------------
# Where the admin API is, and the token.


def _split_endpoint(text: str) -> list[str]:
    """Split a Twisted endpoint string on its unescaped colons (``\\:`` is a colon)."""
    parts, current, escaped = [], [], False
    for ch in text:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def admin_target_from_endpoint(endpoint: str) -> str | None:
    """The URL :class:`~yieldproxy.tools.broker.Admin` reaches an admin listener bound to ``endpoint`` at, if we
    can tell.

    ``tcp:PORT:interface=HOST`` gives ``http://HOST:PORT`` (a wildcard
    interface is reached on loopback); ``unix:PATH[:mode=...]`` gives ``unix:PATH``.
    """
    parts = _split_endpoint(endpoint.strip())
    kind, rest = parts[0].lower(), parts[1:]
    positional = [p for p in rest if "=" not in p]
    named = dict(p.split("=", 1) for p in rest if "=" in p)
    if kind in ("tcp", "tcp6"):
        port = named.get("port") or (positional[0] if positional else "")
        if not port.isdigit() or int(port) == 0:
            return None
        host = named.get("interface", "")
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1" if kind == "tcp" else "::1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"
    if kind == "unix":
        path = named.get("address") or (positional[0] if positional else "")
        return f"unix:{path}" if path else None
    return None


def admin_target_from_option(value: str) -> str:
    """``--admin``/``$YIELDPROXY_ADMIN``: a URL, ``host:port``, or ``unix:PATH``."""
    value = value.strip()
    if value.startswith("unix:"):
        target = admin_target_from_endpoint(value)
        if target is None:
            raise CliError(f"--admin {value!r}: unix: needs a socket path", EXIT_USAGE)
        return target
    url = value if "://" in value else "http://" + value
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        raise CliError(f"--admin {value!r}: the port is not a number", EXIT_USAGE) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(
            f"--admin {value!r}: expected a URL such as http://127.0.0.1:11436, or unix:/path/to/socket",
            EXIT_USAGE,
        )
    return url.rstrip("/")


def _read_token_file(path: str, what: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise CliError(f"{what}: cannot read {path}: {e.strerror or e}", EXIT_USAGE) from None
    if not token:
        raise CliError(f"{what}: {path} is empty", EXIT_USAGE)
    return token


@attrs.frozen
class Settings:
    """What every admin command needs, resolved from options, environment and config."""

    #: The admin listener, as :class:`~yieldproxy.tools.broker.Admin` takes it: a URL, or ``unix:PATH``.
    target: str
    token: str | None = attrs.field(default=None, repr=False)
    timeout: float = HTTP_TIMEOUT
    notes: tuple[str, ...] = ()


def resolve_settings(args: argparse.Namespace, environ: dict[str, str]) -> Settings:
    """Options beat the environment, which beats the config file, which beats the defaults."""
    from ..config import ConfigError, load, read_read_token, read_token

    config = None
    config_path = getattr(args, "config", None)
    if config_path:
        try:
            config = load(config_path)
        except ConfigError as e:
            raise CliError(str(e), EXIT_USAGE) from None
    notes: list[str] = []
    admin = getattr(args, "admin", None) or environ.get("YIELDPROXY_ADMIN")
    if admin:
        target = admin_target_from_option(admin)
    elif config is not None:
        from_config = admin_target_from_endpoint(config.admin.listen)
        target = from_config if from_config is not None else DEFAULT_ADMIN
        if from_config is None:
            notes.append(
                f"admin.listen {config.admin.listen!r} in {config_path} is not a tcp: or unix: "
                f"endpoint; trying {DEFAULT_ADMIN} (use --admin to say where)"
            )
    else:
        target = DEFAULT_ADMIN

    token_file = getattr(args, "token_file", None)
    token: str | None
    if token_file:
        token = _read_token_file(token_file, "--token-file")
    elif environ.get("YIELDPROXY_TOKEN", "").strip():
        token = environ["YIELDPROXY_TOKEN"].strip()
    elif environ.get("YIELDPROXY_TOKEN_FILE"):
        token = _read_token_file(environ["YIELDPROXY_TOKEN_FILE"], "YIELDPROXY_TOKEN_FILE")
    elif config is not None:
        # Least privilege: status only reads, so it takes the read-only token when there is one.
        read_only = getattr(args, "command", None) == "status" and config.admin.read_token_file
        try:
            token = read_read_token(config) if read_only else read_token(config)
        except ConfigError as e:
            raise CliError(str(e), EXIT_USAGE) from None
    else:
        token = None
    timeout = getattr(args, "timeout", None) or HTTP_TIMEOUT
    return Settings(target, token, timeout, tuple(notes))


# ---------------------------------------------------------------------------
# Printing a status.


def format_duration(seconds: float | None) -> str:
    """``4.2s``, ``42s``, ``3m 12s``, ``2h 05m``: short, for tables."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """``rows`` (the first one the heading) as lines indented by two, each column as wide as its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _in(now: float, when: float | None) -> str:
    return "-" if when is None else "in " + format_duration(when - now)


def format_status(status: dict) -> str:
    """The ``status`` table: state, each hold, what is parked and in flight."""
    now = status.get("now") or time.time()
    state = status.get("state", "?")
    holds = status.get("holds") or []
    head = state
    remaining = status.get("expected_remaining_seconds")
    if state == "yielded" and remaining is not None:
        head += f" (expected back in {format_duration(remaining)})"
    elif state == "draining":
        head += " (the GPU is back; parked requests are being replayed)"
    elif state == "unreachable":
        head += " (no upstream has answered since the proxy started: check its url and that it runs)"
    lines = [f"state:      {head}"]
    if holds:
        rows = [("SOURCE", "REASON", "HELD FOR", "LEASE ENDS", "EXPECTED END")]
        for h in holds:
            rows.append((
                printable(h.get("source", ""), 24),
                printable(h.get("reason") or "-", 40),
                format_duration(now - h["since"]) if h.get("since") is not None else "-",
                _in(now, h.get("expires_at")),
                _in(now, h.get("expected_end")),
            ))
        lines.append(f"holds:      {len(holds)}")
        lines.extend(_table(rows))
    else:
        lines.append("holds:      none")
    parked = status.get("parked") or {}
    total = status.get("parked_total", sum(parked.values()))
    per_class = ", ".join(f"{printable(k)} {v}" for k, v in sorted(parked.items()))
    lines.append(f"parked:     {total} ({per_class or 'no classes'}), {format_bytes(status.get('parked_bytes', 0))}")
    lines.append(f"in flight:  {status.get('inflight', 0)}")
    lines.extend(format_upstreams(status.get("upstreams") or []))
    return "\n".join(lines)


def format_upstreams(upstreams: list) -> list[str]:
    """A row per upstream of a pool: its state, who holds it, what it has in flight and waiting, its models.

    Nothing for one upstream (the lines above say it all).
    """
    if len(upstreams) < 2:
        return []
    rows = [("UPSTREAM", "STATE", "USE", "HELD BY", "IN FLIGHT", "WAITING", "MODELS")]
    for u in upstreams:
        holders = sorted({printable(h.get("source", ""), 24) for h in u.get("holds") or []})
        models = [printable(m, 40) for m in u.get("models") or []]
        rows.append((
            printable(u.get("name", ""), 24),
            printable(u.get("state", "?"), 16),
            "standby" if u.get("use") == "when_others_yielded" else "always",
            ", ".join(holders) or "-",
            str(u.get("inflight", 0)),
            str(u.get("waiting", 0)),
            (", ".join(models[:4]) + (f" (+{len(models) - 4})" if len(models) > 4 else "")) or "-",
        ))
    return [f"upstreams:  {len(upstreams)}", *_table(rows), *format_twins(upstreams)]


def format_twins(upstreams: list) -> list[str]:
    """A row per twin of a verified embedding model: whether it serves the model's embeddings, and why not."""
    rows = [("TWIN", "MODEL", "STATE", "REFERENCE", "WORST COSINE", "VERIFIED")]
    for u in upstreams:
        for model, t in (u.get("twins") or {}).items():
            if not isinstance(t, dict) or t.get("state") == "reference":
                continue
            cosine = t.get("worst_cosine")
            rows.append((
                printable(u.get("name", ""), 24),
                printable(model, 40),
                printable(t.get("state", "?"), 16),
                printable(t.get("reference", ""), 24),
                "-" if not isinstance(cosine, (int, float)) else f"{cosine:.6f}",
                "-" if t.get("age_seconds") is None else f"{format_duration(t['age_seconds'])} ago",
            ))
    if len(rows) < 2:
        return []
    return ["twins:      embeddings go to a model's reference or a verified twin", *_table(rows)]


def format_one_line(status: dict) -> str:
    """The state after ``yield`` or ``resume``, on one line."""
    now = status.get("now") or time.time()
    parts = [f"state: {status.get('state', '?')}"]
    holds = status.get("holds") or []
    if holds:
        described = []
        for h in holds:
            extra = [x for x in (
                printable(h.get("reason") or "", 40),
                f"lease ends {_in(now, h['expires_at'])}" if h.get("expires_at") is not None else "",
            ) if x]
            described.append(printable(h.get("source", ""), 24) + (f" ({', '.join(extra)})" if extra else ""))
        parts.append("held by " + "; ".join(described))
    remaining = status.get("expected_remaining_seconds")
    if remaining is not None:
        parts.append(f"expected back in {format_duration(remaining)}")
    parts.append(f"{status.get('parked_total', 0)} parked, {status.get('inflight', 0)} in flight")
    return " | ".join(parts)


# ---------------------------------------------------------------------------
# The admin commands.


async def call_admin(reactor, settings: Settings, call: Callable[[Admin], dict], timeout: float | None = None) -> dict:
    """``call`` on the broker library's :class:`Admin` in the reactor's thread pool (the reactor, which may
    serve the very admin API called, keeps running): its answer, or :class:`CliError` with the exit status and
    a hint for the person at the terminal."""
    admin = Admin(settings.target, settings.token, settings.timeout if timeout is None else timeout)
    try:
        return await threads.deferToThreadPool(reactor, reactor.getThreadPool(), call, admin)
    except AdminUnreachable as e:
        raise CliError(
            f"{e.message}.\n"
            "Is the proxy running (twistd -n yieldproxy)? If it listens elsewhere, "
            "say where with --admin URL (or YIELDPROXY_ADMIN, or --config FILE).",
            EXIT_UNREACHABLE,
        ) from None
    except AdminError as e:
        message = e.message
        if e.server_message is None:
            message += "\nIs --admin the admin listener (default port 11436), not the proxy (11435) or Ollama?"
        elif e.status == 401 and settings.token is None:
            message += "\n(use --token-file FILE, YIELDPROXY_TOKEN or YIELDPROXY_TOKEN_FILE)"
        raise CliError(message, EXIT_ERROR) from None


async def _status_command(reactor, args: argparse.Namespace, settings: Settings) -> int:
    status = await call_admin(reactor, settings, Admin.status)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    if args.exit_code and status.get("state") == "yielded":
        return EXIT_YIELDED
    return EXIT_OK


async def _yield_command(reactor, args: argparse.Namespace, settings: Settings) -> int:
    status = await call_admin(reactor, settings, lambda admin: admin.yield_gpu(
        source=args.source or "api", reason=args.reason or "", expected_seconds=args.expected,
        for_seconds=args.for_seconds, upstream=args.upstream,
    ))
    print(format_one_line(status))
    return EXIT_OK


async def _resume_command(reactor, args: argparse.Namespace, settings: Settings) -> int:
    status = await call_admin(reactor, settings, lambda admin: admin.resume(args.source or "api", args.upstream))
    if status.get("holds_ended") == 0:  # absent from a proxy older than the field: nothing to tell
        print(f"yieldproxy: {nothing_to_resume(status, args.source or 'api', args.upstream)}", file=sys.stderr)
        return EXIT_NO_HOLD
    print(format_one_line(status))
    return EXIT_OK


def nothing_to_resume(status: dict, source: str, upstream: str | None) -> str:
    """The one line for a resume that ended nothing: the holds there are, and the nearest source to the one typed."""
    import difflib

    holds = status.get("holds") or []
    named = [
        printable(str(h.get("source", "")), 64) + (f" (upstream {printable(str(h['upstream']), 64)})" if h.get("upstream") else "")
        for h in holds
    ]
    what = f"no hold of source {source!r}" + (f" on upstream {upstream!r}" if upstream else "") + " to end"
    if not holds:
        return f"{what}; no hold is taken (state: {status.get('state', '?')})"
    sources = sorted({str(h.get("source", "")) for h in holds})
    nearest = difflib.get_close_matches(source, sources, n=1)
    hint = f"; did you mean --source {nearest[0]}?" if nearest and nearest[0] != source else ""
    return f"{what}; the holds are: {', '.join(named)}{hint}"


#: Seconds ``yieldproxy reload`` waits by default: a new process starts, and a large lot goes over.
RELOAD_TIMEOUT = 120.0


async def _reload_command(reactor, args: argparse.Namespace, settings: Settings) -> int:
    timeout = settings.timeout if hasattr(args, "timeout") else max(settings.timeout, RELOAD_TIMEOUT)
    outcome = await call_admin(reactor, settings, Admin.reload, timeout)
    print(
        f"reloaded: pid {outcome.get('old_pid')} (version {printable(str(outcome.get('old_version')), 40)}) -> "
        f"pid {outcome.get('pid')} (version {printable(str(outcome.get('version')), 40)}): "
        f"{outcome.get('parked_handed_over', 0)} parked requests and {outcome.get('connections_handed_over', 0)} "
        f"idle connections handed over in {outcome.get('seconds', 0)}s"
    )
    return EXIT_OK


# ---------------------------------------------------------------------------
# The command line.


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return _positive(text)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _source(text: str) -> str:
    """``--source``: the admin API's own rule for source names (names.check_source)."""
    from ..names import check_source

    try:
        return check_source(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    # The common options are accepted before and after the command; SUPPRESS keeps
    # the subcommand's copy from overwriting what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("admin API")
    group.add_argument("--admin", metavar="URL", default=argparse.SUPPRESS,
                       help=f"the admin listener: URL or unix:PATH (default $YIELDPROXY_ADMIN, "
                            f"the --config file's admin.listen, or {DEFAULT_ADMIN})")
    group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help="the proxy's TOML config, to find admin.listen and admin.token_file")
    group.add_argument("--token-file", metavar="FILE", default=argparse.SUPPRESS,
                       help="a file holding the token (else $YIELDPROXY_TOKEN, which is the token "
                            "itself, then $YIELDPROXY_TOKEN_FILE, a file; then the config's "
                            "admin.token_file, or admin.read_token_file for status)")
    group.add_argument("--timeout", metavar="SECONDS", type=_positive, default=argparse.SUPPRESS,
                       help=f"give up on the admin API after this long (default {HTTP_TIMEOUT:g})")

    parser = argparse.ArgumentParser(
        prog="yieldproxy",
        description="Start yieldproxy, talk to a running one through its admin API, or try it without Ollama.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=description, parents=[common], epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    status = command("status", "show the state, the holds, what is parked",
                     "Show whether the GPU is yielded, who holds it and why, and what is parked.")
    status.add_argument("--json", action="store_true", help="print the admin API's JSON as it is")
    status.add_argument("--exit-code", action="store_true",
                        help="exit 4 when the GPU is yielded (for: yieldproxy status --exit-code && run-batch)")

    hold = command("yield", "yield the GPU: park model requests until resume",
                   "Take (or renew) a hold on the GPU: model requests are parked until every hold ends.")
    hold.add_argument("--for", dest="for_seconds", metavar="SECONDS", type=_positive,
                      help="a lease: the hold ends by itself after this long unless renewed")
    hold.add_argument("--expected", metavar="SECONDS", type=_positive,
                      help="how long the GPU is likely to be away (for Retry-After and early rejection)")
    hold.add_argument("--reason", metavar="TEXT", help="shown in status and the logs")
    hold.add_argument("--source", metavar="NAME", type=_source,
                      help="whose hold this is (default api): letters, digits, '.', '_', '-', up to 64")
    hold.add_argument("--upstream", metavar="NAME", type=_source,
                      help="hold this upstream of the pool alone (default: every upstream)")

    resume = command("resume", "end a hold: replay the parked requests once no hold is left",
                     "End one source's hold; the GPU is back once no source holds it.")
    resume.add_argument("--source", metavar="NAME", type=_source, help="whose hold to end (default api)")
    resume.add_argument("--upstream", metavar="NAME", type=_source,
                        help="end the source's hold of this upstream only (default: every hold of the source)")

    command("reload", "re-read the config and run the installed code, losing no request",
            "Ask the running proxy to re-read its config and hand everything (listeners, parked requests, "
            "holds) over to a new process running the installed code.  A config it refuses is named in one "
            "line and the running proxy keeps going (exit 1).")

    demo = sub.add_parser(
        "demo", help="a burst through a proxy and a simulated Ollama, with a yield in the middle",
        description=(
            "Start a simulated Ollama and a proxy in this process, send a burst of embedding "
            "requests through the proxy, yield and resume the GPU over the admin API in the middle, "
            "and check every vector.  Exits 0 only if every request got its right vector."
        ),
        epilog=DEMO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--texts", type=_count, default=2000, metavar="N", help="requests to send (default 2000)")
    demo.add_argument("--concurrency", type=_count, default=32, metavar="C", help="requests at a time (default 32)")
    demo.add_argument("--yield-after", type=_non_negative, default=1.0, metavar="SECONDS",
                      help="yield this long after the burst starts, or once half of it is sent "
                           "if that comes first (default 1.0)")
    demo.add_argument("--yield-for", type=_positive, default=3.0, metavar="SECONDS",
                      help="resume this long after yielding (default 3.0)")
    demo.add_argument("--latency", type=_non_negative, default=0.002, metavar="SECONDS",
                      help="the simulated backend's time per request (default 0.002)")
    demo.add_argument("--deadline", type=_positive, default=None, metavar="SECONDS",
                      help="stop, failed, after this long whatever happens "
                           "(default 60 + the yield + 20 ms a text)")

    sub.add_parser(
        "serve", add_help=False,
        help="start the proxy in the foreground (try: yieldproxy serve --help)",
        description="Start the proxy in this terminal: twistd -n --pidfile= yieldproxy [options].",
    )

    sub.add_parser(
        "sim", add_help=False,
        help="run a simulated Ollama (try: yieldproxy sim --help)",
        description="Run the simulated Ollama backend (the same as python -m yieldproxy.tools.sim).",
    )

    sub.add_parser(
        "example-config", help="print the commented example config (every key at its default)",
        description=(
            "Print the commented example configuration, etc/yieldproxy.toml of the source, which "
            "sets every key to its default.  Save it, keep what you change, and start the proxy "
            "with it: yieldproxy example-config > yieldproxy.toml; "
            "yieldproxy serve --config yieldproxy.toml"
        ),
    )

    ops = sub.add_parser(
        "ops-files", help="write the systemd unit, the Prometheus rules and the Grafana dashboard into DIR",
        description=(
            "Write etc/ of the source tree, as this installation carries it, into DIR: "
            "yieldproxy.toml, systemd/yieldproxy.service, prometheus/ (the alert rules, their "
            "promtool tests, an example prometheus.yml), grafana/yieldproxy-dashboard.json and "
            "probes/nvidia-game-probe.sh.  docs/operating.md and docs/metrics.md use them from "
            "there.  A file that differs from this version's copy is not overwritten without "
            "--force (then nothing is written, exit 1)."
        ),
    )
    ops.add_argument("dir", metavar="DIR", help="where to write them (made if missing)")
    ops.add_argument("--force", action="store_true", help="overwrite files that differ")

    check = sub.add_parser(
        "check-fallback", help="verify the CPU fallback against the primary (exit 1 if it fails)",
        description=(
            "Embed fallback.probe_texts on the primary (proxy.upstream) and on the fallback (fallback.url) "
            "for each model in fallback.models, and print the table: dimensions and cosine per text. "
            "Works with fallback.enabled = false, to check a fallback before turning it on.  "
            "Exit 0 when every model passes, 1 when any fails, 2 on a config problem."
        ),
    )
    check.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help="the proxy's TOML config, with its [fallback] section")
    return parser


def version_line() -> str:
    """``yieldproxy --version``: this package's version (``twistd yieldproxy --version`` says it too)."""
    from .. import __version__

    return f"yieldproxy {__version__}"


def twistd_command() -> list[str]:
    """How to run twistd with this interpreter: the ``twistd`` script installed beside ``yieldproxy`` (or the
    interpreter), else twistd's own entry point through this interpreter."""
    for directory in (os.path.dirname(os.path.abspath(sys.argv[0])), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "twistd")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return [candidate]
    return [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()"]


def serve(options: Sequence[str]) -> NoReturn:
    """``yieldproxy serve [options]``: the proxy in the foreground, twistd being the engine (this process
    becomes ``twistd -n --pidfile= yieldproxy [options]``: signals, reloads and exit status are twistd's)."""
    command = [*twistd_command(), "-n", "--pidfile=", "yieldproxy", *options]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(command[0], command)
    except OSError as e:
        print(f"yieldproxy serve: cannot start twistd ({command[0]}): {e.strerror}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def example_config() -> str:
    """The commented example config, from an installed wheel or from a source tree (as the ops files are)."""
    from .opsfiles import ops_file

    try:
        return ops_file("yieldproxy.toml").decode("utf-8")
    except CliError:
        raise CliError("the example config is missing from this installation (etc/yieldproxy.toml in the source)") from None


def _run(reactor, command, args: argparse.Namespace, finished: list):
    """One command under ``react``: its exit status (kept in ``finished`` too), its error message on stderr."""

    async def run() -> None:
        try:
            code = await command(reactor, args)
        except CliError as e:
            print(f"yieldproxy: {e.message}", file=sys.stderr)
            code = e.code
        except Exception:
            traceback.print_exc()
            code = EXIT_ERROR
        finished.append(code)
        if code:
            raise SystemExit(code)

    return defer.Deferred.fromCoroutine(run())


class _ReaderMayLeave:
    """The command's stdout: when its reader goes away (``yieldproxy status | head -3``), the rest of the output
    goes nowhere, quietly, and the command ends with the status it would have had.

    Python ignores SIGPIPE, so a write to a closed pipe raises :class:`BrokenPipeError` wherever it happens: in
    a ``print``, or in the flush as the interpreter exits (a traceback, and exit 1 or 120).  This catches it on
    every write and flush, and points the descriptor at ``/dev/null`` as the Python docs' recipe for SIGPIPE
    does, so that no later flush fails again.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _reader_may_leave() -> Iterator[None]:
    """sys.stdout as :class:`_ReaderMayLeave` meanwhile, when it is a real file (not a test's capture)."""
    stream = sys.stdout
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    wrapped = _ReaderMayLeave(stream)
    sys.stdout = cast(TextIO, wrapped)
    try:
        yield
    finally:
        wrapped.flush()
        sys.stdout = stream


def main(argv: Sequence[str] | None = None, *, react: Callable[..., None] = task.react) -> None:
    """The ``yieldproxy`` console script.

    :param react: runs a command's function on a reactor and ends the
        process with its exit status, as :func:`twisted.internet.task.react`
        (the default) does; the tests give one that runs the command on
        their own, already running, reactor.
    """
    with _reader_may_leave():
        try:
            _main(list(sys.argv[1:] if argv is None else argv), react)
        except CliError as e:
            print(f"yieldproxy: {e.message}", file=sys.stderr)
            raise SystemExit(e.code) from None


def _main(argv: list[str], react: Callable[..., None]) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        serve(extra)
    if args.command == "sim":
        from .sim import main as sim_main

        sim_main(extra, prog="yieldproxy sim")
        return
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "example-config":
        sys.stdout.write(example_config())
        return

    if args.command == "ops-files":
        from .opsfiles import ops_files_command

        raise SystemExit(ops_files_command(args.dir, args.force))

    if args.command == "check-fallback":
        from ..upstream.fallback import check_command

        raise SystemExit(check_command(getattr(args, "config", None)))

    finished: list[int] = []
    if args.command == "demo":
        from .demo import demo_command

        try:
            react(_run, (demo_command, args, finished))
        except SystemExit as e:
            # Interrupted (Ctrl-C stops the reactor): not a success.
            if not finished and not e.code:
                print("yieldproxy: demo interrupted", file=sys.stderr)
                raise SystemExit(130) from None
            raise
        return

    settings = resolve_settings(args, dict(os.environ))
    for note in settings.notes:
        print(f"yieldproxy: note: {note}", file=sys.stderr)
    command = {
        "status": _status_command, "yield": _yield_command, "resume": _resume_command, "reload": _reload_command,
    }[args.command]
    react(_run, (lambda reactor, args: command(reactor, args, settings), args, finished))


if __name__ == "__main__":
    main()
