"""The handover's messages between the running process and its successor: framing and records, no I/O.

A frame is ``>II`` (the JSON's length, the blob's length), then a JSON
object, then a blob of bytes the JSON points into (``[offset, length]``
pairs): request heads and bodies travel as bytes, not base64.  A frame that
carries file descriptors says how many in ``"fds"``; they travel beside its
bytes (``SCM_RIGHTS``), in order, and the receiver takes that many from the
ones it has received when the frame is complete (a unix stream socket hands
them over with the first byte of the ``sendmsg`` that carried them, so they
always arrive before their frame ends).

A parked request is sent as a :class:`Carried` record plus the request as
the client sent it, rebuilt (:func:`request_bytes`): the successor feeds
those bytes to a fresh channel on the adopted connection, so the request is
read by the same hardened HTTP layer as any other, and the record gives it
back its class, its place, its arrival and its deadline.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterable, Iterator

import attrs

from ...lot.parking import Standing

#: The frame header: the JSON's length, the blob's length.
HEADER = struct.Struct(">II")
#: The largest JSON part of a frame (a batch of a few hundred records is far below it).
MAX_JSON = 64 * 1024 * 1024
#: The largest blob (a batch is cut well before this: see :data:`BATCH_BYTES`).
MAX_BLOB = 1024 * 1024 * 1024
#: A batch of parked requests is cut after this many bytes of requests...
BATCH_BYTES = 8 * 1024 * 1024
#: ...or this many connections (one file descriptor each): the successor adopts a batch in one reactor
#: turn, so a small batch keeps the connections it accepts meanwhile moving.
BATCH_FDS = 50
#: What the handover speaks: a successor that does not speak it refuses the handover.  3: the two-phase
#: handover (predecessor.py), times on the machine's monotonic clock (clock.py).
PROTOCOL = 3
#: Request headers not sent again: the body is whole now (Content-Length says its size), and a
#: ``100 Continue`` was answered already.
_DROPPED = frozenset({b"content-length", b"transfer-encoding", b"expect"})
#: The headers that frame a body: a request sent with one of them is sent again with its ``Content-Length``.
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})


class BadFrame(Exception):
    """The peer sent something that is not a frame of this protocol."""


def encode(message: dict[str, Any], blob: bytes = b"") -> bytes:
    """One frame: ``message`` (JSON-able) and the bytes it points into."""
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    return HEADER.pack(len(data), len(blob)) + data + blob


@attrs.define(eq=False)
class Decoder:
    """Frames out of a byte stream, as they complete."""

    _buffer: bytearray = attrs.Factory(bytearray)

    def feed(self, data: bytes) -> Iterator[tuple[dict[str, Any], bytes]]:
        """Add ``data``; yield each ``(message, blob)`` completed by it."""
        self._buffer += data
        while len(self._buffer) >= HEADER.size:
            size, blob_size = HEADER.unpack_from(self._buffer)
            if size > MAX_JSON or blob_size > MAX_BLOB:
                raise BadFrame(f"frame too large ({size} + {blob_size} bytes)")
            end = HEADER.size + size + blob_size
            if len(self._buffer) < end:
                return
            try:
                message = json.loads(bytes(self._buffer[HEADER.size:HEADER.size + size]))
            except ValueError as e:
                raise BadFrame(f"not JSON: {e}") from None
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                raise BadFrame("a frame without a type")
            blob = bytes(self._buffer[HEADER.size + size:end])
            del self._buffer[:end]
            yield message, blob


def request_bytes(
    method: bytes, uri: bytes, headers: Iterable[tuple[bytes, Iterable[bytes]]], body: bytes,
    version: bytes = b"HTTP/1.1",
) -> bytes:
    """The request as its client sent it, for the new process to read as the old one did: its line as it
    came (its HTTP version kept: an HTTP/1.0 client expects its connection closed after the answer), its
    headers (repeated ones kept), its whole body.

    Never a line more nor a byte longer than what came, so that a request the old process's edge took
    passes the same limits in the new one's (edge/reader.py: ``max_headers``, ``max_line_bytes``,
    ``max_head_bytes``), and reads there as the same request: each header ``name:value`` (the optional
    whitespace around a value, which no reader keeps, left out); the framing only where the client framed
    a body: its ``Content-Length`` (or its ``Transfer-Encoding: chunked``, the body read whole already,
    which ``Content-Length`` with fewer than 11 digits is shorter than); ``Expect`` left out (its
    ``100 Continue`` was answered).  A request that came without a body and without a length goes
    without them.
    """
    if version not in (b"HTTP/1.0", b"HTTP/1.1"):
        version = b"HTTP/1.1"
    lines = [b"%s %s %s" % (method, uri, version)]
    framed = False
    for name, values in headers:
        lower = name.lower()
        if lower in _DROPPED:
            framed = framed or lower in _FRAMING
            continue
        lines.extend(b"%s:%s" % (name, value) for value in values)
    if body or framed:
        lines.append(b"Content-Length:%d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@attrs.frozen
class Carried:
    """What a parked request keeps across the handover, beside the request itself: when it arrived, and
    its :class:`~yieldproxy.lot.parking.Standing` in line (written flat, one object per request).

    Times are the reactor's clock (``reactor.seconds()``): the machine's
    monotonic clock (clock.py), one clock for both processes on one boot, so
    a deadline stays where it was, whatever the wall clock does meanwhile.
    """

    #: When the request arrived (its log line's duration counts from here).
    started_at: float
    standing: Standing

    def as_json(self) -> dict[str, Any]:
        return {"started_at": self.started_at, **attrs.asdict(self.standing)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Carried":
        fields = {f.name for f in attrs.fields(Standing)}
        unknown = set(data) - fields - {"started_at"}
        if unknown:
            raise BadFrame(f"unknown fields in a parked request's record: {sorted(unknown)}")
        fields_given = {k: v for k, v in data.items() if k != "started_at"}
        try:
            return cls(started_at=data["started_at"], standing=Standing(**fields_given))
        except (KeyError, TypeError) as e:
            raise BadFrame(f"a parked request's record: {e!r}") from None


def cut(records: list[tuple[Any, bytes]]) -> Iterator[list[tuple[Any, bytes]]]:
    """``records`` (each with its bytes) in batches of at most :data:`BATCH_FDS` and about :data:`BATCH_BYTES`."""
    batch: list[tuple[Any, bytes]] = []
    size = 0
    for record in records:
        batch.append(record)
        size += len(record[1])
        if len(batch) >= BATCH_FDS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def pack(records: list[tuple[dict[str, Any], bytes]]) -> tuple[list[dict[str, Any]], bytes]:
    """Records with their bytes -> the records pointing (``"bytes": [offset, length]``) into one blob."""
    out, parts, offset = [], [], 0
    for record, data in records:
        out.append({**record, "bytes": [offset, len(data)]})
        parts.append(data)
        offset += len(data)
    return out, b"".join(parts)


def unpack(records: list[Any], blob: bytes) -> Iterator[tuple[dict[str, Any], bytes]]:
    """The reverse of :func:`pack`."""
    for record in records:
        if not isinstance(record, dict):
            raise BadFrame("a record that is not an object")
        where = record.pop("bytes", None)
        if (
            not isinstance(where, list) or len(where) != 2 or not all(isinstance(n, int) and n >= 0 for n in where)
            or where[0] + where[1] > len(blob)
        ):
            raise BadFrame("a record whose bytes are not in its frame")
        yield record, blob[where[0]:where[0] + where[1]]
