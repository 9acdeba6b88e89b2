"""The request log: one line per proxied request, and the JSON log format.

Each request that ends (answered, refused, failed, or abandoned by its client)
gives one :mod:`twisted.logger` event in the ``yieldproxy.requestlog``
namespace.  Its fields are structured, so the JSON observer
(``--log-format json``) keeps them as JSON keys::

    {"method": "POST", "path": "/api/embed", "class": "batch", "status": 200,
     "outcome": "ok", "parked_seconds": 12.402, "attempts": 1,
     "duration": 12.431, "client": "127.0.0.1", "bytes_sent": 3301, ...}

and the text observer (the default) renders the same event as::

    POST /api/embed batch 200 ok parked=12.402s attempts=1 12.431s client=127.0.0.1

``outcome`` is ``ok`` (the upstream answered, whatever its status),
``upstream_error``, ``expired``, ``abandoned`` (the client went away),
``slow_client`` (dropped: its unread answer passed a buffer bound),
``shutdown``, ``fallback``, or the reason a request was refused at once
(``queue_full``, ``over_budget``, ``policy``, ``too_large``, ``bad_request``):
the labels of ``yieldproxy_replay_total`` and ``yieldproxy_rejected_total``.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
)

log = Logger()

#: The status logged for a request whose client went away before any answer
#: (nginx's "client closed request"); no such status is ever sent.
CLIENT_GONE = 499

_MAX_PATH = 300


def _printable(text: str, limit: int) -> str:
    """Escape control characters (no forged log lines) and cut very long values."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


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
) -> dict[str, Any]:
    """Log that ``request`` ended; returns the event's fields.

    :param cls: ``interactive``, ``batch``, ``long`` or ``passthrough``.
    :param status: the HTTP status the client got, or None when it got none
        (it went away first): logged as :data:`CLIENT_GONE`.
    :param outcome: how it ended (see the module docstring).
    :param parked_seconds: total time parked (None or 0 when never parked).
    :param attempts: upstream attempts made (0 when refused before any).
    :param started: ``clock.seconds()`` when the request arrived.

    Answers of 500 and above are logged at ``warn``, the rest at ``info``.
    """
    path = request.path.decode("latin-1") if isinstance(request.path, bytes) else str(request.path)
    method = request.method.decode("latin-1") if isinstance(request.method, bytes) else str(request.method)
    fields = {
        "method": _printable(method, 16),
        "path": _printable(path, _MAX_PATH),
        "class": cls,
        "status": CLIENT_GONE if status is None else int(status),
        "outcome": outcome,
        "parked_seconds": round(float(parked_seconds or 0.0), 3),
        "attempts": int(attempts),
        "duration": round(max(0.0, clock.seconds() - started), 3),
        "client": _client(request),
        "bytes_sent": int(getattr(request, "sentLength", 0) or 0),
    }
    level = LogLevel.warn if fields["status"] >= 500 else LogLevel.info
    # The text form is rendered here, once, with an f-string (the fields are in
    # the event too): a format string run through string.Formatter by every
    # observer cost about a tenth of a millisecond per request.
    line = (
        f"{fields['method']} {fields['path']} {cls} {fields['status']} {outcome} "
        f"parked={fields['parked_seconds']:.3f}s attempts={fields['attempts']} "
        f"{fields['duration']:.3f}s client={fields['client']}"
    )
    logger.emit(level, "{request_line}", request_line=line, **fields)
    return fields


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
        and event.get("log_format") == "{request_line}"
        and "log_failure" not in event
        and event.get("log_system") is None
    ):
        level = event.get("log_level")
        system = f"{event.get('log_namespace', '-')}#{level.name if level is not None else '-'}"
        text = line.replace("\n", "\n\t")
        return f"{_stamp(event.get('log_time'))} [{system}] {text}\n"
    return formatEventAsClassicLogText(event)


def text_file_observer(out: IO[str]) -> ILogObserver:
    """twistd's text lines (``textFileLogObserver``) on ``out``, with :func:`classic_text`."""
    return FileLogObserver(out, classic_text)


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
    record: dict[str, Any] = {
        "time": event.get("log_time"),
        "level": getattr(level, "name", None),
        "namespace": event.get("log_namespace"),
        "text": formatEvent(event),
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


def json_file_observer(out: IO[str]) -> ILogObserver:
    """A :class:`FileLogObserver` writing one flat JSON object per line to ``out``.

    Unlike :func:`twisted.logger.jsonFileLogObserver` (made for reloading
    events with ``eventsFromJSONLogFile``), the object is meant for people and
    log shippers: ``time`` (epoch seconds), ``level`` (``debug`` .. ``critical``),
    ``namespace`` (the module that logged), ``text`` (the rendered message),
    ``traceback`` (for failures), then the event's own fields as they are
    (for the request log: ``method``, ``path``, ``class``, ``status``, ...).
    No RFC 7464 record separator: ``jq``, ``journalctl -o cat`` and shippers
    read it line by line.
    """
    return FileLogObserver(out, _as_json_line)


#: The dotted names twistd's ``--logger`` takes for each format.
JSON_OBSERVER = "yieldproxy.requestlog.json_observer"
TEXT_OBSERVER = "yieldproxy.requestlog.text_observer"
LOG_LEVELS = ("debug", "info", "warn", "error")

#: The least level written; ``--log-level`` sets it before twistd builds its logger.
log_level = LogLevel.info


def _at_level(observer: ILogObserver) -> ILogObserver:
    """Drop events below :data:`log_level` (twistd itself filters nothing)."""
    return FilteringLogObserver(observer, [LogLevelFilterPredicate(defaultLogLevel=log_level)])


def json_observer() -> ILogObserver:
    """The JSON format on stdout: ``twistd --logger yieldproxy.requestlog.json_observer``.

    Called by twistd before it redirects ``sys.stdout`` into the log, so this
    is the real stdout (the journal, under systemd).
    """
    return _at_level(json_file_observer(sys.stdout))


def text_observer() -> ILogObserver:
    """twistd's usual text lines on stdout, without the events below :data:`log_level`."""
    return _at_level(text_file_observer(sys.stdout))
