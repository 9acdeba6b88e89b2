"""A Python API for brokers: hold the GPU for as long as a ``with`` block runs.

A broker (the program that decides who has the GPU) calls ``POST /yield`` and ``POST /resume`` on the admin
API; this module does it for it with the standard library only (no Twisted, no reactor), synchronously
(:class:`Admin`) or under asyncio (:class:`AsyncAdmin`).  The lease, its renewals and what a failed one
does: docs/embedding.md.  It is the one client of the admin API: ``yieldproxy status/yield/resume/reload``
(tools/cli.py) and ``yieldproxy demo`` call it too, from a reactor's thread pool.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from ..text import printable

__all__ = ["Admin", "AsyncAdmin", "Hold", "AsyncHold", "AdminError", "AdminUnreachable", "read_answer"]

log = logging.getLogger("yieldproxy.tools.broker")

#: Seconds each admin call may take.
DEFAULT_TIMEOUT = 10.0
#: A renewal every this fraction of the lease: two more chances before it runs out.
RENEW_FRACTION = 1 / 3
#: After a failed renewal, the next try comes this fraction of the lease later (at most a second).
RETRY_FRACTION = 1 / 10
#: What a 200 of each call must carry (:func:`read_answer`); every other call answers with the status.
_ANSWER_KEYS = {"/reload": ("reloaded",)}


class AdminError(Exception):
    """The admin API refused a call, or answered something that is not the admin API.

    ``status`` is the HTTP status (None when nothing answered); ``server_message``
    is the API's own ``{"error": ...}`` text when it gave one.
    """

    def __init__(self, message: str, status: int | None = None, server_message: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.server_message = server_message


class AdminUnreachable(AdminError):
    """Nothing answered: refused, timed out, or the connection broke."""


def read_answer(code: int, raw: bytes, where: str, token_given: bool, keys: tuple[str, ...] = ("state",)) -> dict:
    """The JSON object of an admin API answer, or :class:`AdminError` saying what went wrong.

    A 200 must carry one of ``keys`` (``/status``, ``/yield`` and ``/resume``
    answer with the status, which has ``state``; ``/reload`` with its outcome,
    which has ``reloaded``); anything else is an error, with the server's
    message when it sent one.
    """
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        payload = None
    if code == 200 and isinstance(payload, dict) and any(key in payload for key in keys):
        return payload
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        server = printable(payload["error"])
        message = f"the admin API at {where} answered {code}: {server}"
        if code == 401:
            message += " (the token given was refused)" if token_given else " (no token was given)"
        raise AdminError(message, code, server)
    snippet = printable(raw[:200].decode("utf-8", "replace").strip()) or "(empty)"
    raise AdminError(f"{where} answered {code} with something that is not the admin API: {snippet}", code)


def _why(error: BaseException, timeout: float) -> str:
    """A short reason for getting no answer at all."""
    reason = getattr(error, "reason", error)
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return "the host name does not resolve"
    return f"the connection failed ({reason})"


class Admin:
    """The admin API of one proxy, called synchronously (urllib).

    ``url`` is the admin listener (``http://127.0.0.1:11436`` by default in
    the proxy's config), or ``unix:PATH`` for one on a unix socket; ``token`` the admin token, if the proxy has one
    (``admin.token_file``).  Every call is bounded by ``timeout`` seconds and
    raises :class:`AdminUnreachable` or :class:`AdminError` rather than
    returning something that is not an answer.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout = timeout
        #: The socket's path, for ``unix:PATH``; None for an http:// URL.
        self._unix_path = self.url[len("unix:"):] if self.url.startswith("unix:") else None
        if self._unix_path == "":
            raise ValueError("unix: needs a socket path, as in unix:/run/yieldproxy/admin.sock")

    def __repr__(self) -> str:
        return f"Admin({self.url!r})"

    def status(self) -> dict:
        """``GET /status``: the state, the holds, what is parked (docs/admin-api.md)."""
        return self.call("GET", "/status")

    def yield_gpu(
        self, source: str = "api", reason: str = "", for_seconds: float | None = None,
        expected_seconds: float | None = None, upstream: str | None = None, timeout: float | None = None,
    ) -> dict:
        """``POST /yield``: take or renew ``source``'s hold (of ``upstream``, or of all); the new status."""
        body = {
            "source": source, "reason": reason, "for_seconds": for_seconds,
            "expected_seconds": expected_seconds, "upstream": upstream,
        }
        return self.call("POST", "/yield", {k: v for k, v in body.items() if v is not None}, timeout)

    def resume(self, source: str = "api", upstream: str | None = None, timeout: float | None = None) -> dict:
        """``POST /resume``: end ``source``'s hold (of ``upstream``, or all of its holds); the new status."""
        body = {"source": source, "upstream": upstream}
        return self.call("POST", "/resume", {k: v for k, v in body.items() if v is not None}, timeout)

    def reload(self, timeout: float | None = None) -> dict:
        """``POST /reload``: a new process takes everything over; the outcome (its pid, version, what went over)."""
        return self.call("POST", "/reload", timeout=timeout)

    def hold(
        self, source: str, reason: str, lease_seconds: float, upstream: str | None = None,
        expected_seconds: float | None = None, on_error: Callable[[Hold, AdminError], None] | None = None,
    ) -> Hold:
        """A hold for a ``with`` block: taken on entry, renewed while it runs, resumed on exit."""
        return Hold(self, source, reason, lease_seconds, upstream, expected_seconds, on_error)

    def call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """One call's JSON answer; :class:`AdminError` (or :class:`AdminUnreachable`) otherwise.

        A 503 with ``Retry-After`` (the proxy says: not now, ask again; during a reload, the holds on their
        way to the new process) is asked again after that many seconds, while ``timeout`` allows."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        headers = {"Accept": "application/json"}
        data = None
        if method != "GET":
            headers["Content-Type"] = "application/json"
            data = json.dumps(body or {}).encode("utf-8")
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        while True:
            left = max(0.01, deadline - time.monotonic())
            try:
                code, raw, retry_after = self._once(method, path, data, headers, left)
            except http.client.HTTPException as e:
                # A body cut short, a status line that is not HTTP; first, as RemoteDisconnected is an OSError too.
                raise AdminUnreachable(
                    f"cannot reach the admin API at {self.url}: the answer broke off or is not HTTP ({e!r})"
                ) from None
            except (urllib.error.URLError, OSError) as e:
                # The reason names the call's whole timeout, not what was left of it for this try.
                raise AdminUnreachable(f"cannot reach the admin API at {self.url}: {_why(e, timeout)}") from None
            wait = _seconds(retry_after) if code == 503 else None
            if wait is None or time.monotonic() + wait >= deadline:
                return read_answer(code, raw, self.url, self._token is not None, _ANSWER_KEYS.get(path, ("state",)))
            time.sleep(wait)

    def _once(self, method: str, path: str, data: bytes | None, headers: dict, timeout: float):
        """One request: its status, its body and its Retry-After; ``URLError``, ``OSError`` or ``HTTPException``
        when nothing answered."""
        if self._unix_path is not None:
            return self._once_unix(self._unix_path, method, path, data, headers, timeout)
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with _OPENER.open(request, timeout=timeout) as response:
                return response.status, response.read(), response.headers.get("Retry-After")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("Retry-After")

    def _once_unix(self, socket_path: str, method: str, path: str, data: bytes | None, headers: dict, timeout: float):
        """One request over the unix socket at ``socket_path`` (``Host: localhost``, which the listener answers)."""
        connection = _UnixConnection(socket_path, timeout)
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            return response.status, response.read(), response.getheader("Retry-After")
        finally:
            connection.close()


class _UnixConnection(http.client.HTTPConnection):
    """An HTTP connection to a unix socket: urllib has none."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        """Connect within the timeout.  A unix socket whose accept queue is full refuses a connect at once with
        EAGAIN (Linux does not wait as it does for TCP): that is "not yet", asked again until the timeout."""
        timeout = self.timeout if isinstance(self.timeout, (int, float)) else 10.0
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock.connect(self._socket_path)
            except BlockingIOError:
                sock.close()
                if time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
                continue
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            return


def _seconds(retry_after: str | None) -> float | None:
    """A ``Retry-After`` of seconds (its other form, a date, is not the admin API's), at most a minute."""
    try:
        seconds = float(retry_after) if retry_after is not None else None
    except ValueError:
        return None
    if seconds is None or not seconds >= 0:
        return None
    return min(seconds, 60.0)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is not the admin API: it is reported, not followed (with the token) elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


#: No proxies from the environment (the admin API is local), no redirects.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class Hold:
    """One source's hold, kept for as long as a ``with`` block runs (:meth:`Admin.hold`).

    Renewed every ``lease_seconds / 3`` by a daemon thread; after a failed
    renewal, tried again every tenth of the lease (at most every second).
    """

    def __init__(
        self, admin: Admin, source: str, reason: str, lease_seconds: float, upstream: str | None = None,
        expected_seconds: float | None = None, on_error: Callable[[Hold, AdminError], None] | None = None,
    ):
        if not lease_seconds > 0:
            raise ValueError("lease_seconds must be a positive number of seconds")
        self.admin, self.source, self.reason = admin, source, reason
        self.lease_seconds, self.upstream, self.expected_seconds = float(lease_seconds), upstream, expected_seconds
        self._on_error = on_error
        #: The last renewal's error (None while every renewal succeeded).
        self.error: AdminError | None = None
        #: True once a whole lease passed without a renewal: the proxy may have ended the hold meanwhile.
        self.lost = False
        #: Renewals that succeeded.
        self.renewals = 0
        #: When the last successful take or renewal was sent (``time.monotonic()``).
        self.renewed_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Hold({self.source!r}, lease={self.lease_seconds:g}, lost={self.lost})"

    def _take(self) -> dict:
        """``POST /yield`` with the lease; a renewal is the same call again.

        A renewal sent a whole lease after the last one (this process was
        stopped, or the renewals kept failing) took the hold again: it had
        lapsed in between, so :attr:`lost` is set.
        """
        sent = time.monotonic()
        answer = self.admin.yield_gpu(
            self.source, self.reason, for_seconds=self.lease_seconds, expected_seconds=self.expected_seconds,
            upstream=self.upstream, timeout=self._call_timeout(),
        )
        if self.renewed_at is not None and sent - self.renewed_at >= self.lease_seconds:
            self.lost = True
        self.renewed_at = sent
        return answer

    def _call_timeout(self) -> float:
        """A call may not outlast the time left to renew: at most a quarter of the lease."""
        return max(0.5, min(self.admin.timeout, self.lease_seconds / 4))

    def _next_wait(self) -> float:
        if self.error is None:
            return self.lease_seconds * RENEW_FRACTION
        return min(1.0, self.lease_seconds * RETRY_FRACTION)

    def _renew_once(self) -> None:
        """One renewal; a failure is logged and kept, never raised (the next try comes soon)."""
        try:
            self._take()
        except AdminError as e:
            self.error = e
            if self.renewed_at is not None and time.monotonic() - self.renewed_at >= self.lease_seconds:
                self.lost = True
            log.warning(
                "yieldproxy hold %s: renewing the lease failed%s: %s", self.source,
                " and the lease has run out (the proxy may have resumed)" if self.lost else "", e.message,
            )
            if self._on_error is not None:
                try:
                    self._on_error(self, e)
                except Exception:
                    log.exception("yieldproxy hold %s: the on_error callback failed", self.source)
            return
        if self.error is not None:
            log.warning("yieldproxy hold %s: renewed again after a failure", self.source)
        self.error = None
        self.renewals += 1

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._next_wait()):
            self._renew_once()

    def _begin(self) -> dict:
        """Take the hold for a new block: entered again, its last block's renewals are no measure of this one."""
        self.renewed_at, self.error, self.lost, self.renewals = None, None, False, 0
        return self._take()

    def __enter__(self) -> Hold:
        self._stop = threading.Event()
        self._begin()
        self._thread = threading.Thread(target=self._renew_loop, name=f"yieldproxy-hold-{self.source}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._stop.set()
        if self._thread is not None:
            # A renewal under way ends first, so it cannot take the hold again after the resume.
            self._thread.join(self._call_timeout() + 1)
        self._resume(kind is None)

    def _resume(self, raising: bool) -> None:
        """End the hold; a failure is raised when the block ended well, else logged (the lease ends the hold)."""
        try:
            self.admin.resume(self.source, self.upstream)
        except AdminError as e:
            if raising:
                raise
            log.error("yieldproxy hold %s: resuming failed (the lease ends it): %s", self.source, e.message)


class AsyncAdmin:
    """:class:`Admin` for asyncio: the same calls, awaited (each runs in a worker thread)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.sync = Admin(url, token, timeout)

    @property
    def url(self) -> str:
        return self.sync.url

    def __repr__(self) -> str:
        return f"AsyncAdmin({self.url!r})"

    async def status(self) -> dict:
        return await asyncio.to_thread(self.sync.status)

    async def yield_gpu(self, *args: Any, **kwargs: Any) -> dict:
        return await asyncio.to_thread(self.sync.yield_gpu, *args, **kwargs)

    async def resume(self, *args: Any, **kwargs: Any) -> dict:
        return await asyncio.to_thread(self.sync.resume, *args, **kwargs)

    async def reload(self, *args: Any, **kwargs: Any) -> dict:
        return await asyncio.to_thread(self.sync.reload, *args, **kwargs)

    def hold(
        self, source: str, reason: str, lease_seconds: float, upstream: str | None = None,
        expected_seconds: float | None = None, on_error: Callable[[Hold, AdminError], None] | None = None,
    ) -> AsyncHold:
        """A hold for an ``async with`` block: taken on entry, renewed by a task, resumed on exit."""
        return AsyncHold(Hold(self.sync, source, reason, lease_seconds, upstream, expected_seconds, on_error))


class AsyncHold:
    """A :class:`Hold` kept by an asyncio task; its ``error``, ``lost`` and ``renewals`` read through."""

    def __init__(self, hold: Hold):
        self.hold = hold
        self._task: asyncio.Task | None = None
        self._renewing: asyncio.Future | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hold, name)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.hold._next_wait())
            # Shielded: cancelling the loop at exit does not abandon a renewal half-sent.
            self._renewing = asyncio.ensure_future(asyncio.to_thread(self.hold._renew_once))
            await asyncio.shield(self._renewing)

    async def __aenter__(self) -> AsyncHold:
        await asyncio.to_thread(self.hold._begin)
        self._task = asyncio.get_running_loop().create_task(self._renew_loop())
        return self

    async def __aexit__(self, kind, value, traceback) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._renewing is not None and not self._renewing.done():
            await asyncio.wait([self._renewing])
        await asyncio.to_thread(self.hold._resume, kind is None)
