"""The request log: one line per proxied request, and the JSON log format.

Each request that ends (answered, refused, failed, or abandoned by its client)
gives one :mod:`twisted.logger` event in the ``yieldproxy.requestlog``
namespace, with structured fields, which the JSON observer keeps as JSON keys
and the text observer (the default) renders on one line.  The fields, the
outcomes and both formats: docs/operating.md ("The request log", "JSON logs").
"""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Any

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import (
    ILogObserver,
    LogLevel,
    Logger,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
)
from zope.interface import implementer

from ..text import printable

#: The request log's namespace: operators filter on it (docs/operating.md), so it is spelt here,
#: not taken from the module's name.
NAMESPACE = "yieldproxy.requestlog"
log = Logger(namespace=NAMESPACE)

#: The format of a request line's event: its text is rendered once, in ``request_line``.
_REQUEST_FORMAT = "{request_line}"
#: The status logged for a request whose client went away before any answer
#: (nginx's "client closed request"); no such status is ever sent.
CLIENT_GONE = 499

_MAX_PATH = 300


def _client(request) -> str:
    peer = request.getClientAddress()
    host = getattr(peer, "host", None)
    if host is not None:
        return str(host)
    name = getattr(peer, "name", None)  # a unix socket peer
    return "unix" if name is None or isinstance(name, bytes) else str(name)


def log_request(
    request,
    cls: str,
    status: int | None,
    outcome: str,
    parked_seconds: float | None,
    attempts: int,
    started: float,
    clock: IReactorTime,
    logger: Logger = log,
    served_by: str | None = None,
    translated_by: str | None = None,
) -> dict[str, Any]:
    """Log that ``request`` ended; returns the event (its fields, and Twisted's ``log_*`` keys).

    :param cls: ``interactive``, ``batch``, ``long`` or ``passthrough``.
    :param status: the HTTP status the client got, or None when it got none
        (it went away first): logged as :data:`CLIENT_GONE`.
    :param outcome: how it ended (docs/operating.md, "The request log").
    :param parked_seconds: total time parked (None or 0 when never parked).
    :param attempts: upstream attempts made (0 when refused before any).
    :param started: ``clock.seconds()`` when the request arrived.
    :param served_by: the pool member its last attempt went to (a pool of several).
    :param translated_by: the member that answered it in another dialect (upstream/translated_attempt.py).

    Answers of 500 and above are logged at ``warn``, the rest at ``info``.
    """
    path = request.path.decode("latin-1") if isinstance(request.path, bytes) else str(request.path)
    method = request.method.decode("latin-1") if isinstance(request.method, bytes) else str(request.method)
    if not (len(method) <= 16 and method.isprintable()):
        method = printable(method, 16)
    if not (len(path) <= _MAX_PATH and path.isprintable()):
        path = printable(path, _MAX_PATH)
    code = CLIENT_GONE if status is None else int(status)
    parked = round(float(parked_seconds or 0.0), 3)
    attempts = int(attempts)
    duration = round(max(0.0, clock.seconds() - started), 3)
    client = _client(request)
    # The event Logger.emit would make, handed to its observer directly: emit
    # checks its level against LogLevel.iterconstants(), which sorts the levels
    # on every call, and builds the event from keyword arguments twice.  The
    # text form is rendered here, once, with an f-string (the fields are in the
    # event too): a format string run through string.Formatter by every
    # observer cost about a tenth of a millisecond per request.
    event = {
        "method": method,
        "path": path,
        "class": cls,
        "status": code,
        "outcome": outcome,
        "parked_seconds": parked,
        "attempts": attempts,
        "duration": duration,
        "client": client,
        "bytes_sent": int(getattr(request, "sentLength", 0) or 0),
        "request_line": (
            f"{method} {path} {cls} {code} {outcome} parked={parked:.3f}s attempts={attempts} "
            f"{duration:.3f}s client={client}"
            + (f" upstream={served_by}" if served_by else "")
            + (f" translated={translated_by}" if translated_by else "")
        ),
        "log_logger": logger,
        "log_level": LogLevel.warn if code >= 500 else LogLevel.info,
        "log_namespace": logger.namespace,
        "log_source": logger.source,
        "log_format": _REQUEST_FORMAT,
        "log_time": time.time(),
    }
    if served_by:
        event["upstream"] = served_by
    if translated_by:
        event["translated"] = translated_by
    logger.observer(event)
    return event


# -- output formats (``--log-format``) ------------------------------------------------------

#: The last second formatted by :func:`_stamp`, and its text.
_last_stamp: tuple[int, str] = (-1, "")


def _stamp(when: float | None) -> str:
    """``formatTime(when)``, formatted once per second (the format has no finer unit)."""
    global _last_stamp
    if when is None:
        return formatTime(None)
    second = int(when // 1)
    if _last_stamp[0] != second:
        _last_stamp = (second, formatTime(second))
    return _last_stamp[1]


def classic_text(event: dict) -> str | None:
    """An event as twistd's text line (``formatEventAsClassicLogText``), request lines made cheaply.

    Twisted's formatter runs every event's format string through
    ``string.Formatter`` and formats its time from scratch: about 40 µs for
    each request-log line, a tenth of the proxy's CPU per request.  A request
    line is already rendered (:func:`log_request`), so it only needs the
    time (made once per second) and the system; every other event goes
    through Twisted's formatter.  The text is the same either way.
    """
    line = event.get("request_line")
    if (
        line
        and isinstance(line, str)
        and event.get("log_format") == _REQUEST_FORMAT
        and "log_failure" not in event
        and event.get("log_system") is None
    ):
        level = event.get("log_level")
        system = f"{event.get('log_namespace', '-')}#{level.name if level is not None else '-'}"
        text = line.replace("\n", "\n\t")
        return f"{_stamp(event.get('log_time'))} [{system}] {text}\n"
    return formatEventAsClassicLogText(event)


@implementer(ILogObserver)
class LogLines:
    """Each event at ``level`` or above, as ``format_event`` renders it, written to ``out`` and flushed.

    What a :class:`~twisted.logger.FileLogObserver` behind a level filter
    does, in one call: every request adds a line, so every layer counts.
    Without a ``level``, every event; with one, events without a level or a
    namespace are dropped, as ``LogLevelFilterPredicate`` drops them.
    """

    def __init__(self, out: IO[str], format_event, level: LogLevel | None = None):
        self._write = out.write
        self._flush = out.flush
        self._format = format_event
        self._levels = None if level is None else frozenset(each for each in LogLevel.iterconstants() if each >= level)

    def __call__(self, event: dict) -> None:
        levels = self._levels
        if levels is not None and (event.get("log_level") not in levels or event.get("log_namespace") is None):
            return
        text = self._format(event)
        if text:
            self._write(text)
            self._flush()


def text_file_observer(out: IO[str], level: LogLevel | None = None) -> ILogObserver:
    """twistd's text lines (``textFileLogObserver``) on ``out``, with :func:`classic_text`."""
    return LogLines(out, classic_text, level)


LOG_FORMATS = ("text", "json")


#: Keys already folded into ``text``: the legacy ``twisted.python.log`` ones, and the request line.
_LEGACY_KEYS = frozenset({"message", "system", "isError", "time", "why", "failure", "format", "request_line"})


def _json_default(value: Any) -> Any:
    """Field values JSON cannot hold (bytes, objects) become text rather than breaking the line."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def _as_json_line(event: dict) -> str:
    """One event as one line of JSON: when, how bad, where from, the text, then its own fields."""
    level = event.get("log_level")
    line = event.get("request_line")
    if not (line and isinstance(line, str) and event.get("log_format") == _REQUEST_FORMAT):
        line = formatEvent(event)  # a request line is rendered already (what formatEvent would give)
    record: dict[str, Any] = {
        "time": event.get("log_time"),
        "level": getattr(level, "name", None),
        "namespace": event.get("log_namespace"),
        "text": line,
    }
    failure = event.get("log_failure")
    if failure is not None:
        try:
            record["traceback"] = failure.getTraceback()
        except Exception:
            record["traceback"] = repr(failure)
    for key, value in event.items():
        if key.startswith("log_") or key in _LEGACY_KEYS or key in record:
            continue
        record[key] = value
    return json.dumps(record, default=_json_default, ensure_ascii=False) + "\n"


def json_file_observer(out: IO[str], level: LogLevel | None = None) -> ILogObserver:
    """One flat JSON object per line to ``out`` (events at ``level`` or above; its keys: docs/operating.md).

    Unlike :func:`twisted.logger.jsonFileLogObserver` (made for reloading
    events with ``eventsFromJSONLogFile``), the object is meant for people and
    log shippers, with no RFC 7464 record separator: ``jq``, ``journalctl -o cat``
    and shippers read it line by line.
    """
    return LogLines(out, _as_json_line, level)


#: The dotted names twistd's ``--logger`` takes for each format, at the default level (info).
JSON_OBSERVER = "yieldproxy.observe.requestlog.json_observer"
TEXT_OBSERVER = "yieldproxy.observe.requestlog.text_observer"
LOG_LEVELS = ("debug", "info", "warn", "error")


@attrs.frozen
class Observers:
    """The observer factories twistd's ``--logger`` names, at one least level.

    twistd imports ``--logger`` by its dotted name and calls it with no
    argument, so the level is part of the name
    (``yieldproxy.observe.requestlog.at_warn.json``), not a module variable set
    beforehand: see :func:`observer_name`.
    """

    level: LogLevel

    def json(self) -> ILogObserver:
        """The JSON format on stdout (see :func:`json_observer`)."""
        return json_file_observer(sys.stdout, self.level)

    def text(self) -> ILogObserver:
        """twistd's usual text lines on stdout, without the events below the level."""
        return text_file_observer(sys.stdout, self.level)


at_debug = Observers(LogLevel.debug)
at_info = Observers(LogLevel.info)
at_warn = Observers(LogLevel.warn)
at_error = Observers(LogLevel.error)


def json_observer() -> ILogObserver:
    """The JSON format on stdout: ``twistd --logger yieldproxy.observe.requestlog.json_observer``.

    Called by twistd before it redirects ``sys.stdout`` into the log, so this
    is the real stdout (the journal, under systemd).
    """
    return at_info.json()


def text_observer() -> ILogObserver:
    """twistd's usual text lines on stdout, without the events below info."""
    return at_info.text()


def observer_name(fmt: str, level: str) -> str:
    """The dotted name for twistd's ``--logger``: format ``json`` or ``text`` at ``level`` (:data:`LOG_LEVELS`)."""
    if level == "info":
        return JSON_OBSERVER if fmt == "json" else TEXT_OBSERVER
    return f"yieldproxy.observe.requestlog.at_{level}.{fmt}"
