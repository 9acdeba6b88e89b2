"""The successor's side: a process started by a reload takes over its predecessor's sockets and lot.

Started by the running process with ``$YIELDPROXY_SUCCESSION_FD`` naming
its end of a unix socket, it reads (blocking, before its reactor runs) the
predecessor's listening sockets (:class:`Inheritance`), adopts the ones
whose endpoint is unchanged, paused, and builds and starts its service as
any start does.  Then (:class:`TakeOver`) it says ``ready``; the
predecessor stops accepting and releasing, and sends its holds, its parked
requests with their connections, and its idle connections; each is adopted
here (a parked request parks again in its place, with its arrival and
deadline); on ``done`` this process starts accepting and answers
``serving``.  Its config was validated by its own start (the new code's
rules): a refusal goes back to the predecessor as one line
(:func:`refuse`), which keeps running.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, MutableMapping

import attrs
from twisted.logger import Logger

from .. import __version__
from .link import Link, adopt_link
from .sockets import nonblocking_cloexec
from .wire import PROTOCOL, BadFrame, Carried, Decoder, encode, unpack

log = Logger()

#: The environment variable naming the successor's end of the handover's socket.
ENV = "YIELDPROXY_SUCCESSION_FD"
#: Seconds the successor waits for its predecessor's first frame (it is sent before the successor starts).
FIRST_FRAME_SECONDS = 30.0


def _read_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    """One whole frame from a blocking socket, with the descriptors that came with it."""
    decoder = Decoder()
    fds: list[int] = []
    while True:
        data, received, _flags, _address = socket.recv_fds(sock, 1 << 16, 64)
        fds.extend(received)
        if not data:
            raise BadFrame("the running process closed the handover's socket")
        for message, blob in decoder.feed(data):
            return message, blob, fds


@attrs.define(eq=False)
class Inheritance:
    """What a process started by a reload gets from the one it replaces, before it starts."""

    sock: socket.socket
    #: ``key`` (``proxy.listen``, ``admin.listen``) -> (endpoint description, descriptor, family).
    listeners: dict[str, tuple[str, int, int]]
    #: The predecessor's pid and version.
    pid: int
    version: str

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str], timeout: float = FIRST_FRAME_SECONDS) -> "Inheritance | None":
        """The inheritance ``environ`` names (the variable is removed: this process's own successor gets its own),
        or None for a plain start.  Raises :class:`BadFrame` if the predecessor sent no usable first frame."""
        raw = environ.pop(ENV, None)
        if raw is None:
            return None
        sock = socket.socket(fileno=int(raw))
        sock.settimeout(timeout)
        message, _blob, fds = _read_frame(sock)
        if message.get("type") != "listeners" or message.get("protocol") != PROTOCOL:
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"expected the listeners of protocol {PROTOCOL}, got {message.get('type')!r}")
        listeners = {}
        for item, fd in zip(message.get("listeners", []), fds):
            nonblocking_cloexec(fd)
            listeners[str(item["key"])] = (str(item["description"]), fd, int(item["family"]))
        return cls(sock, listeners, int(message["pid"]), str(message["version"]))

    def listening(self, key: str, description: str) -> tuple[int, int] | None:
        """The predecessor's socket for ``key`` when its endpoint is ``description`` (unchanged), else None."""
        found = self.listeners.get(key)
        if found is None or found[0] != description:
            return None
        del self.listeners[key]
        return found[1], found[2]

    def close_unused(self) -> None:
        """Close the sockets of listeners whose endpoint changed (this process bound its own)."""
        for _description, fd, _family in self.listeners.values():
            os.close(fd)
        self.listeners.clear()


def refuse(environ: MutableMapping[str, str], why: str) -> bool:
    """Tell the predecessor this process will not start (its config or options are refused), in one line.

    True when there was a predecessor to tell (it logs the line and keeps running).
    """
    raw = environ.get(ENV)
    if raw is None:
        return False
    try:
        with socket.socket(fileno=int(raw)) as sock:
            sock.settimeout(5)
            sock.sendall(encode({"type": "refused", "error": why, "fds": 0}))
    except (OSError, ValueError):
        return False
    return True


class _Adopting:
    """The factory of an adopted connection: its listener's channel, never refused for the connection cap
    (the connection was accepted, and counted, already; the cap counts it again from now on)."""

    def __init__(self, site):
        self._site = site

    def buildProtocol(self, addr):
        return self._site.connection_for(addr)


@attrs.define(eq=False)
class TakeOver:
    """Adopts what the predecessor hands over, as it comes (see the module docstring)."""

    _reactor: Any
    _inheritance: Inheritance
    #: ``proxy`` and ``admin``: the listeners (their factories serve adopted connections).
    _listeners: dict[str, Any]
    #: ``adopt(channel, carried, data)`` of the proxy app.
    _adopt: Callable[[Any, Carried, bytes], None]
    #: ``restore(message)``: holds and twins as the predecessor had them.
    _restore: Callable[[dict[str, Any]], None]
    started_at: float = attrs.field(factory=time.time)
    adopted: int = 0
    connections: int = 0
    _link: Link | None = None
    _accepting: bool = False
    _serving: bool = False

    @property
    def done(self) -> bool:
        """The predecessor has handed everything over (or is gone)."""
        return self._serving

    def start(self) -> None:
        """Say ``ready`` to the predecessor (this process is up, its listeners adopted and paused)."""
        self._inheritance.close_unused()
        self._link = adopt_link(self._reactor, self._inheritance.sock, self._message)
        self._link.closed.addCallback(self._lost)
        self._link.send({"type": "ready", "pid": os.getpid(), "version": __version__, "protocol": PROTOCOL})

    def _message(self, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        kind = message["type"]
        if kind == "state":
            self._restore(message)
        elif kind == "parked":
            self._take_parked(message, blob, fds)
        elif kind == "connections":
            self._take_connections(message, fds)
        elif kind == "accept":
            self._accept()
            assert self._link is not None
            self._link.send({"type": "accepting"})
        elif kind == "done":
            self._serve()
            assert self._link is not None
            self._link.send({"type": "serving", "pid": os.getpid(), "version": __version__})
        else:
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"unknown frame {kind!r}")

    def _take_parked(self, message: dict[str, Any], blob: bytes, fds: list[int]) -> None:
        records = list(unpack(message.get("records", []), blob))
        if len(records) != len(fds):
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"{len(records)} parked requests with {len(fds)} connections")
        factory = _Adopting(self._listeners["proxy"].factory)
        began = time.monotonic()
        for (record, data), fd in zip(records, fds):
            family = int(record.pop("family"))
            carried = Carried.from_json(record)
            try:
                transport = self._reactor.adoptStreamConnection(fd, family, factory)
            finally:
                os.close(fd)
            self._adopt(transport.protocol, carried, data)
            self.adopted += 1
        self._ack(message)
        log.debug("reload: adopted {count} parked requests in {ms:.1f} ms ({total} so far)",
                  count=len(records), ms=(time.monotonic() - began) * 1000, total=self.adopted)

    def _take_connections(self, message: dict[str, Any], fds: list[int]) -> None:
        records = message.get("records", [])
        if len(records) != len(fds):
            for fd in fds:
                os.close(fd)
            raise BadFrame(f"{len(records)} connections with {len(fds)} descriptors")
        for record, fd in zip(records, fds):
            listener = self._listeners[str(record["listener"])]
            try:
                self._reactor.adoptStreamConnection(fd, int(record["family"]), _Adopting(listener.factory))
            finally:
                os.close(fd)
            self.connections += 1
        self._ack(message)

    def _ack(self, message: dict[str, Any]) -> None:
        """The predecessor may close its copies of the descriptors of frame ``id`` now."""
        assert self._link is not None
        self._link.send({"type": "took", "id": message.get("id")})

    def _accept(self) -> None:
        """Accept new connections: the predecessor has stopped, and this process has its holds."""
        if self._accepting:
            return
        self._accepting = True
        for listener in self._listeners.values():
            listener.resume()

    def _serve(self) -> None:
        if self._serving:
            return
        self._serving = True
        self._accept()
        log.info(
            "reload: took over from pid {pid} (version {old}): {parked} parked requests, {connections} connections; "
            "now serving as pid {me} (version {version})",
            pid=self._inheritance.pid, old=self._inheritance.version, parked=self.adopted,
            connections=self.connections, me=os.getpid(), version=__version__,
        )

    def _lost(self, _: object) -> None:
        """The predecessor is gone (it exited, or gave up on this process): whatever came is served here."""
        if not self._serving:
            log.warn("reload: the process this one replaces (pid {pid}) went before it was done handing over",
                     pid=self._inheritance.pid)
            self._serve()
