"""A stream cut mid-way ends with the proxy's error as a record of its own, never glued to half of one.

An upstream that dies mid-stream may have sent half a record (half an SSE
event, half an NDJSON line) as its last bytes.  The relay writes a stream's
records whole (yieldproxy/upstream/records.py), so the closing error of
docs/guarantees.md always follows a whole record and the client reads it;
a stream that ends cleanly reaches the client byte for byte.  Checked on
generated streams, each cut at every kind of place and delivered in
generated pieces, through the proxy on a Clock.
"""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from inmemory import Rig
from rawhttp import ScriptedBackend, parse_response, request_bytes
from yieldproxy.upstream.records import MAX_HELD, RECORD_ENDS, WholeRecords

SETTINGS = settings(max_examples=200, deadline=None, database=None)

#: The forms of stream, each with its content type and how a JSON record is written in it.
FORMS = {
    "sse": (b"text/event-stream", lambda doc: b"data: " + json.dumps(doc).encode() + b"\n\n"),
    "sse_crlf": (b"text/event-stream", lambda doc: b"data: " + json.dumps(doc).encode() + b"\r\n\r\n"),
    "ndjson": (b"application/x-ndjson", lambda doc: json.dumps(doc).encode() + b"\n"),
}

documents = st.lists(
    st.dictionaries(st.sampled_from(["content", "role", "n"]), st.text(max_size=40) | st.integers(), min_size=1),
    min_size=1, max_size=8,
)


def _records(form: str, body: bytes) -> list:
    """The JSON documents of a stream's body, one per whole record (SSE: its ``data:``)."""
    if form == "ndjson":
        return [json.loads(line) for line in body.split(b"\n") if line]
    events = body.replace(b"\r\n", b"\n").split(b"\n\n")
    assert events[-1] == b"", f"the body ends mid-event: {events[-1]!r}"
    return [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def _through_the_proxy(content_type: bytes, body: bytes, cuts: list[int], then: str) -> tuple[object, object]:
    """The proxy's answer (and its rig) to a streaming chat whose upstream sends ``body`` in chunks split at
    ``cuts``, then ends its answer (``then == "end"``) or closes the connection mid-answer (``"close"``)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type
    wire = head + _chunked(_split(body, cuts))
    if then == "end":
        wire += b"0\r\n\r\n"
    rig = Rig(upstream=ScriptedBackend((wire, "close")))
    chat = json.dumps({"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    peer = rig.raw()
    path = b"/api/chat" if content_type.endswith(b"ndjson") else b"/v1/chat/completions"
    peer.send(request_bytes(b"POST", path, [(b"Content-Type", b"application/json")], chat))
    rig.turn()
    rig.run(1)
    answer, rest = parse_response(peer.data)
    assert answer is not None and rest == b"", peer.data  # a complete chunked answer: its last chunk came
    return answer, rig


@SETTINGS
@given(
    form=st.sampled_from(sorted(FORMS)), docs=documents, cut=st.floats(0, 1, exclude_max=True),
    pieces=st.lists(st.integers(0, 2000), max_size=6),
)
def test_a_stream_cut_anywhere_ends_with_its_whole_records_then_the_error_record(form, docs, cut, pieces):
    content_type, record = FORMS[form]
    whole = [record(d) for d in docs]
    body = b"".join(whole)
    sent = body[: max(1, int(cut * len(body)))]  # at least one byte: with none the attempt is retried
    answer, rig = _through_the_proxy(content_type, sent, pieces, "close")
    *got, error = _records(form, answer.body)
    # Every record that came whole, in order, and nothing of the half one.
    complete = 0
    while complete < len(whole) and len(b"".join(whole[: complete + 1])) <= len(sent):
        complete += 1
    assert got == docs[:complete]
    message = error["error"] if form == "ndjson" else error["error"]["message"]
    assert message.startswith("upstream failed mid-answer"), error
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="broken") == 1


@SETTINGS
@given(
    form=st.sampled_from(sorted(FORMS)), docs=documents, pieces=st.lists(st.integers(0, 2000), max_size=6),
    unterminated=st.booleans(),
)
def test_a_stream_that_ends_cleanly_reaches_the_client_byte_for_byte(form, docs, pieces, unterminated):
    content_type, record = FORMS[form]
    body = b"".join(record(d) for d in docs)
    if unterminated:
        body = body.rstrip(b"\r\n")  # a last record with no end: it goes out all the same
    answer, rig = _through_the_proxy(content_type, body, pieces, "end")
    assert answer.body == body
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="default", outcome="ok") == 1


@given(
    form=st.sampled_from(sorted(RECORD_ENDS)),
    data=st.binary(max_size=300).map(lambda b: b.replace(b"x", b"\n")),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_whole_records_lose_nothing_and_write_only_up_to_a_record_end(form, data, cuts):
    records = WholeRecords(RECORD_ENDS[form])
    written = []
    for piece in _split(data, cuts):
        out = records.whole(piece)
        if out:
            assert out.endswith(RECORD_ENDS[form]), out
        written.append(out)
    assert b"".join(written) + records.rest() == data


def test_a_record_longer_than_the_bound_goes_out_as_it_comes():
    records = WholeRecords(RECORD_ENDS["sse"])
    assert records.whole(b"data: " + b"a" * 1000) == b""
    long = b"a" * MAX_HELD
    assert records.whole(long) == b"data: " + b"a" * 1000 + long and records.held == 0
    assert records.whole(b"\n\ndata: {") == b"\n\n" and records.held == len(b"data: {")
