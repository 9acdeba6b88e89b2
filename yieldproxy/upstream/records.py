"""A stream's records, relayed whole: the proxy's closing error never lands inside half of one.

Bytes reach the relay as the network cuts them; written as they came, the
error record that ends a failed stream (docs/guarantees.md) could be glued to
half a record (``{"message": {"conte{"error": ...}``) and the client could
read neither.  So the relay writes a stream's bytes up to the end of its last
whole record and holds the rest until the record's end comes (a client's
reader does nothing with half a record anyway).  At the stream's clean end the
held bytes go out as they are; at a failure they are dropped.  What is held is
bounded (:data:`MAX_HELD`): a longer record goes out as it comes.
"""

from __future__ import annotations

import attrs

from ..errors import stream_form

#: Bytes held back for one record at most; past it they go out as they are.
MAX_HELD = 64 * 1024

#: How each stream form's records end: an NDJSON line at its newline; an SSE event at its blank line
#: (its lines end in LF, CRLF or CR: what servers send, each used throughout a stream).
RECORD_ENDS: dict[str, tuple[bytes, ...]] = {
    "ndjson": (b"\n",),
    "sse": (b"\n\n", b"\r\n\r\n", b"\r\r"),
}


@attrs.define(eq=False)
class WholeRecords:
    """Splits a stream's bytes into what may go out now (whole records) and what waits for its record's end."""

    ends: tuple[bytes, ...]
    _held: bytes = b""

    def whole(self, data: bytes) -> bytes:
        """What of ``data`` (after what was held) may be written now: up to the end of the last whole record."""
        buffer = self._held + data if self._held else data
        cut = 0
        for end in self.ends:
            at = buffer.rfind(end)
            if at >= 0:
                cut = max(cut, at + len(end))
        if len(buffer) - cut > MAX_HELD:
            cut = len(buffer)
        self._held = buffer[cut:]
        return buffer[:cut] if cut < len(buffer) else buffer

    def rest(self) -> bytes:
        """At the stream's clean end: what is still held, to go out as it is."""
        held, self._held = self._held, b""
        return held

    @property
    def held(self) -> int:
        return len(self._held)


def whole_records(content_type: bytes, length: int | None, coded: bool) -> WholeRecords | None:
    """A splitter for a stream the proxy frames itself (no length, no transfer coding) and can end with its
    own error record (NDJSON, SSE); None for any other answer, relayed byte for byte as it comes."""
    if length is not None or coded:
        return None
    form = stream_form(content_type)
    return None if form is None else WholeRecords(RECORD_ENDS[form])
