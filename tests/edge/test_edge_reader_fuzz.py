"""The edge's request reader, fuzzed: against itself in every cut, and against h11.

* Whatever the bytes (byte soup near HTTP, valid requests mutated, small
  limits to reach every limit's edge), the reader raises nothing, returns
  events, never loops without reading, and accounts for every byte it was fed
  (``readercases.drive`` checks it at every step); and it reads the same
  events whole, a byte at a time and in random pieces.
* Valid requests (methods, targets, header sets, Content-Length and chunked
  bodies with extensions and trailers, pipelined, cut anywhere) are read as
  h11 reads them: the same method, target, version, headers, body and
  keep-alive.
* On invalid input the reader may be stricter than h11, never looser: every
  request it reads whole, h11 reads too, the same way, ending at the same
  byte.  Where it is stricter on purpose, :data:`STRICTER` lists the case and
  why; where it takes what h11 refuses, :data:`LOOSER_BY_DESIGN` does (each
  is checked to be so: a case that stopped being one fails).

More examples: ``YIELDPROXY_FUZZ_EXAMPLES=5000 pytest tests/edge/test_edge_reader_fuzz.py``.
"""

from __future__ import annotations

import os

import attrs
import h11
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from readercases import drive, pieces_of, splits
from yieldproxy.edge.reader import (
    DEFAULT_LIMITS,
    NEED_DATA,
    PAUSED,
    BodyData,
    Closed,
    EndOfMessage,
    Incomplete,
    Limits,
    Refusal,
    RequestHead,
    RequestReader,
)

EXAMPLES = int(os.environ.get("YIELDPROXY_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
#: h11 without its own limit on a head's size (a limit each server sets: see LOOSER_BY_DESIGN).
H11_UNLIMITED = 10**8

TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
VCHAR = bytes(range(0x21, 0x7F))
OBS_TEXT = bytes(range(0x80, 0x100))
#: Names a generated header never takes: they frame the body, name the host, or switch protocols (h11
#: pauses on an Upgrade), and are drawn apart.
FRAMING = {b"content-length", b"transfer-encoding", b"host", b"connection", b"upgrade", b"expect"}


def _from(alphabet: bytes, min_size: int = 0, max_size: int = 20):
    return st.binary(min_size=min_size, max_size=max_size).map(lambda b: bytes(alphabet[x % len(alphabet)] for x in b))


tokens = _from(TCHAR, 1, 12)
methods = st.one_of(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"get"]), tokens)
targets = st.one_of(
    st.sampled_from([b"/", b"/api/embed", b"/v1/embeddings", b"*", b"http://h:1/x?y=%20"]),
    _from(VCHAR, 0, 40).map(lambda t: b"/" + t),
)
#: A field value: visible characters and obs-text, with blanks inside (and sometimes around: both strip them).
_words = st.lists(_from(VCHAR + OBS_TEXT, 1, 10), max_size=4)
values = st.tuples(st.sampled_from([b"", b" ", b"\t", b"  "]), _words, st.sampled_from([b"", b" ", b" \t"])).map(
    lambda t: t[0] + b" ".join(t[1]) + t[2]
)
names = st.one_of(st.sampled_from([b"Content-Type", b"User-Agent", b"Accept", b"X-A", b"x-a", b"Cookie"]), tokens)
fields = st.lists(st.tuples(names, values), max_size=8).map(lambda fs: [f for f in fs if f[0].lower() not in FRAMING])
extensions = st.lists(
    st.tuples(tokens, st.one_of(st.none(), tokens, _from(VCHAR.replace(b"\\", b"").replace(b'"', b""), 0, 8).map(
        lambda v: b'"' + v + b'"'))),
    max_size=3,
).map(lambda exts: b"".join(b";" + n + (b"=" + v if v is not None else b"") for n, v in exts))


@attrs.frozen
class Request:
    """A valid request, generated: its bytes, and what any reader must read of it."""

    method: bytes
    target: bytes
    version: bytes
    headers: tuple
    body: bytes
    keep_alive: bool
    wire: bytes


@st.composite
def requests(draw) -> Request:
    method, target = draw(methods), draw(targets)
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]))
    headers = list(draw(fields))
    headers.insert(draw(st.integers(0, len(headers))), (draw(st.sampled_from([b"Host", b"host"])), b"127.0.0.1:11434"))
    connection = draw(st.sampled_from([None, b"keep-alive", b"close", b"Keep-Alive, Close", b"TE"]))
    if connection is not None:
        headers.append((b"Connection", connection))
    if draw(st.booleans()):
        headers.append((b"Expect", draw(st.sampled_from([b"100-continue", b"100-Continue"]))))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    if framing == "none":
        body = b""
        wire_body = b""
    elif framing == "length":
        headers.insert(draw(st.integers(0, len(headers))), (draw(st.sampled_from([b"Content-Length", b"content-length"])), b"%d" % len(body)))
        wire_body = body
    else:
        headers.insert(draw(st.integers(0, len(headers))), (b"Transfer-Encoding", draw(st.sampled_from([b"chunked", b"Chunked"]))))
        cuts = sorted(draw(st.lists(st.integers(1, max(1, len(body))), max_size=4)))
        chunks = [c for c in pieces_of(body, cuts) if c]
        wire_body = b"".join(b"%s%s\r\n%s\r\n" % (draw(st.sampled_from([b"%x", b"%X", b"%04x"])) % len(c), draw(extensions), c) for c in chunks)
        trailers = draw(fields)
        wire_body += b"0" + draw(extensions) + b"\r\n" + b"".join(n + b":" + v + b"\r\n" for n, v in trailers) + b"\r\n"
    wire = method + b" " + target + b" " + version + b"\r\n" + b"".join(n + b":" + v + b"\r\n" for n, v in headers) + b"\r\n" + wire_body
    keep_alive = version == b"HTTP/1.1" and (connection is None or b"close" not in connection.lower())
    stripped = tuple((n, v.strip(b" \t")) for n, v in headers)
    return Request(method, target, version, stripped, body, keep_alive, wire)


# -- reading with each ---------------------------------------------------------------------------


def ours(pieces: list[bytes], limits: Limits = DEFAULT_LIMITS) -> tuple[list, bool]:
    """The requests the reader reads: ([(method, target, version, headers, body, keep_alive)], refused)."""
    return _requests(drive(pieces, limits).events)


def _requests(events) -> tuple[list, bool]:
    out = []
    head = None
    body = b""
    for event in events:
        if type(event) is RequestHead:
            head, body = event, b""
        elif type(event) is BodyData:
            body += event.data
        elif type(event) is EndOfMessage:
            assert head is not None
            out.append((head.method, head.target, head.version, head.headers, body, head.keep_alive))
    return out, any(type(event) is Refusal for event in events)


def wires(data: bytes) -> list[tuple[bytes, tuple]]:
    """Each request the reader reads whole in ``data``, with the bytes it took on the wire."""
    reader = RequestReader()
    reader.feed(data)
    reader.feed_eof()
    out = []
    start = 0
    events: list = []
    while True:
        event = reader.next_event()
        if event is PAUSED and reader.state == "done":
            out.append((data[start : reader.consumed], _requests(events)[0][0]))
            reader.start_next()
            start = reader.consumed
            events = []
        elif event is PAUSED or event is NEED_DATA or type(event) in (Refusal, Incomplete, Closed):
            return out
        else:
            events.append(event)


def theirs(pieces: list[bytes], max_size: int = H11_UNLIMITED) -> tuple[list, str | None, bytes]:
    """The requests h11 reads: ([(method, target, version, headers, body, keep_alive)], its error, what it left)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_size)
    out: list = []
    request = None
    body = b""
    feed = list(pieces) + [b""]  # b"": the end of input
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if not feed:
                    return out, None, b""
                conn.receive_data(feed.pop(0))
                continue
            if type(event) is h11.Request:
                request, body = event, b""
            elif type(event) is h11.Data:
                body += bytes(event.data)
            elif type(event) is h11.EndOfMessage:
                assert request is not None
                keep_alive = conn.their_state is h11.DONE
                out.append((
                    request.method, request.target, b"HTTP/" + request.http_version,
                    tuple((bytes(n), bytes(v)) for n, v in request.headers.raw_items()), body, keep_alive,
                ))
                if not keep_alive:
                    return out, None, bytes(conn.trailing_data[0]) + b"".join(feed)
                conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                conn.send(h11.EndOfMessage())
                conn.start_next_cycle()
            elif type(event) is h11.ConnectionClosed:
                return out, None, b""
            elif event is h11.PAUSED:
                return out, None, bytes(conn.trailing_data[0]) + b"".join(feed)
    except h11.RemoteProtocolError as error:
        return out, str(error), b""


def _until_closing(requests: list) -> list:
    """The requests up to the first that does not keep the connection (a connection reads no further), each
    with its Transfer-Encoding in lower case (as h11 gives it: ``Chunked`` is ``chunked``)."""
    out = []
    for method, target, version, headers, body, keep_alive in requests:
        headers = tuple((n, v.lower() if n.lower() == b"transfer-encoding" else v) for n, v in headers)
        out.append((method, target, version, headers, body, keep_alive))
        if not keep_alive:
            break
    return out


# -- every cut alike, whatever the bytes ---------------------------------------------------------------

_soup = st.sampled_from([
    b"GET", b"POST", b" ", b"  ", b"/", b"/x", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"\r\n", b"\r\n\r\n", b"\r", b"\n",
    b"\t", b"\x00", b"\x0b", b":", b"Host: x", b"Content-Length: ", b"Content-Length: 3", b"5", b"0", b"ff", b"1" * 17,
    b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity", b"Connection: close", b"Expect: 100-continue",
    b";a=b", b";\\", b"X: y", b" folded", b"abc", b"x" * 40, b"\xff", b"0\r\n\r\n", b"3\r\nabc\r\n",
])
soups = st.lists(st.one_of(_soup, _soup, _soup, st.binary(max_size=6)), max_size=40).map(b"".join)
small_limits = st.builds(
    Limits, max_head_bytes=st.integers(1, 80), max_line_bytes=st.integers(1, 40), max_headers=st.integers(1, 4),
    max_chunk_line=st.integers(1, 24), max_trailer_bytes=st.integers(1, 24),
)
any_limits = st.one_of(st.just(Limits()), small_limits)


@st.composite
def mutated(draw, many=False):
    """Valid requests (several, with ``many``) with a few bytes put in, taken out or changed."""
    count = draw(st.integers(1, 3)) if many else 1
    data = bytearray(b"".join(draw(requests()).wire for _ in range(count)))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["put", "drop", "change"]))
        if how == "put":
            data[where:where] = draw(_soup)
        elif how == "drop":
            del data[where : where + draw(st.integers(1, 4))]
        else:
            data[where : where + 1] = draw(st.binary(min_size=1, max_size=1))
    return bytes(data)


#: Heads of lines drawn from every framing rule (valid and not), with bodies of every shape after them.
# (The valid ones weigh more: an invalid line refuses the request before its framing is read.)
_request_lines = st.one_of(
    st.sampled_from([b"GET / HTTP/1.1", b"POST /x HTTP/1.1", b"POST /x HTTP/1.0"]),
    st.sampled_from([b"PUT / HTTP/1.2", b"GET /\x7f HTTP/1.1", b"GET  / HTTP/1.1"]),
    st.sampled_from([b"GET / HTTP/1.1", b"POST /x HTTP/1.1", b"POST /x HTTP/1.0"]),
)
_field_lines = st.one_of(
    st.sampled_from([b"Host: x", b"Host: y", b"X-A: 1", b"Connection: close", b"Connection: keep-alive", b"X: caf\xc3\xa9"]),
    st.sampled_from([b"Expect: 100-continue", b"Connection: foo close", b" folded", b"\tX: tab", b"X: a\x0bb", b"X : y", b"Bad"]),
    st.sampled_from([b"Host: x", b"Host: y", b"X-A: 1", b"Connection: close", b"Connection: keep-alive", b"X: caf\xc3\xa9"]),
)
_framing_lines = st.sampled_from([
    b"Content-Length: 3", b"Content-Length: 0", b"Content-Length: 5, 5", b"Content-Length: +3",
    b"Content-Length: 0000000000000000003", b"Transfer-Encoding: chunked", b"transfer-encoding: Chunked",
    b"Transfer-Encoding: identity", b"Transfer-Encoding: gzip, chunked", b"Transfer-Encoding: chunked, chunked",
])
_bodies = st.sampled_from([
    b"", b"abc", b"abcdef", b"0\r\n\r\n", b"3\r\nabc\r\n0\r\n\r\n", b"3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n",
    b"3 \r\nabc\r\n0\r\n\r\n", b"3\r\nabcX", b"0\r\nT: a\r\n b\r\n\r\n", b"0\r\nBad\r\n\r\n", b"1" * 17 + b"\r\n",
])
_fields = st.tuples(st.lists(_field_lines, max_size=4), st.lists(_framing_lines, min_size=1, max_size=2)).flatmap(
    lambda t: st.permutations(t[0] + t[1])
)
framings = st.builds(
    lambda line, fields, body, then: line + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body + then,
    _request_lines, _fields, _bodies, st.sampled_from([b"", b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"]),
)

inputs = st.one_of(framings, soups, mutated(many=True), st.binary(max_size=200))


@FUZZ
@given(data=inputs, limits=any_limits, cuts=st.lists(st.integers(0, 600), max_size=10))
@example(data=b"GET / HTTP/1.1\r\n\r\n", limits=Limits(), cuts=[])
def test_whatever_the_bytes_it_raises_nothing_accounts_for_them_and_reads_them_alike_in_any_cut(data, limits, cuts):
    whole = drive([data], limits)
    assert drive(pieces_of(data, cuts), limits) == whole
    assert drive([data[i : i + 1] for i in range(len(data))], limits) == whole
    # Without the end of input, the same events but the last (a close), in any cut.
    open_ended = drive(pieces_of(data, cuts), limits, eof=False)
    assert open_ended.events == drive([data], limits, eof=False).events
    assert whole.events[: len(open_ended.events)] == open_ended.events


# -- h11, on valid requests ---------------------------------------------------------------------------------


@FUZZ
@given(batch=st.lists(requests(), min_size=1, max_size=4), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_valid_requests_are_read_as_h11_reads_them_in_any_cut(batch, cuts):
    data = b"".join(request.wire for request in batch)
    pieces = pieces_of(data, cuts)
    read_by_us, refused = ours(pieces)
    read_by_h11, error, _ = theirs(pieces)
    assert not refused and error is None, (data, error)
    expected = _until_closing([(r.method, r.target, r.version, r.headers, r.body, r.keep_alive) for r in batch])
    assert _until_closing(read_by_h11) == expected
    assert _until_closing(read_by_us) == expected
    # And a byte at a time, as whole: the same for the reader.
    assert ours([data])[0] == read_by_us


# -- h11, on invalid input: never looser ------------------------------------------------------------------


def _h11_reads_alone(wire: bytes) -> tuple[tuple | None, str | None]:
    """What h11 reads of one request's bytes alone (and that it ends where they end), or why it refuses them."""
    read_by_h11, error, left = theirs([wire])
    if error is not None:
        return None, error
    assert left == b"", ("h11 ends the request elsewhere: smuggling", wire, left)
    assert len(read_by_h11) == 1, (wire, read_by_h11)
    return read_by_h11[0], None


@FUZZ
@given(data=st.one_of(mutated(), mutated(many=True), framings, soups))
def test_every_request_the_reader_takes_h11_takes_the_same_way(data):
    for wire, read_by_us in wires(data):
        read_by_h11, error = _h11_reads_alone(wire)
        if error is not None:
            # Only where the reader is looser by design (LOOSER_BY_DESIGN): an empty line first, the Host.
            if wire.startswith(b"\r\n"):
                read_by_h11, error = _h11_reads_alone(wire[2:])
            hosts = [n for n, _ in read_by_us[3] if n.lower() == b"host"]
            if error is not None and "Host" in error and len(hosts) != 1:
                continue
            assert error is None, ("the reader took what h11 refuses", wire, error)
        method, target, version, headers, body, keep_alive = read_by_us
        assert read_by_h11 is not None
        assert _until_closing([read_by_h11])[0][:5] == _until_closing([read_by_us])[0][:5], (wire, read_by_h11, read_by_us)
        # It may close where h11 keeps the connection (STRICTER), never keep it where h11 closes.
        assert read_by_h11[5] or not keep_alive, wire


GET = b"GET / HTTP/1.1\r\nHost: x\r\n"
POST = b"POST / HTTP/1.1\r\nHost: x\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"

#: Requests h11 reads and the reader refuses, on purpose: (id, bytes, why).
STRICTER = [
    ("folded", GET + b"X: a\r\n b\r\n\r\n", "obsolete line folding: RFC 9112 5.2 lets a server refuse it (the reader's API)"),
    ("folded-trailer", CHUNKED + b"0\r\nX: a\r\n b\r\n\r\n", "as folded"),
    ("cl-and-te", POST + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     "one framing: a body two servers may delimit two ways is a request smuggled past one (RFC 9112 6.1)"),
    ("cl-twice-same", POST + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc", "one framing (as Twisted)"),
    ("cl-list", POST + b"Content-Length: 3, 3\r\n\r\nabc", "one framing (as Twisted)"),
    ("cl-19-digits", POST + b"Content-Length: 0000000000000000003\r\n\r\nabc", "at most 18 digits, under 2**63 (as Go)"),
    ("chunk-17-digits", CHUNKED + b"00000000000000003\r\nabc\r\n0\r\n\r\n", "at most 16 hex digits, 64 bits (as Go)"),
    ("chunk-size-blank", CHUNKED + b"3 \r\nabc\r\n0\r\n\r\n", "the size line is the size and extensions (as Twisted)"),
    ("chunk-ext-backslash", CHUNKED + b"3;a=\\b\r\nabc\r\n0\r\n\r\n", "extension characters as Twisted takes them"),
    ("bare-lf-lines", b"GET / HTTP/1.1\nHost: x\n\n", "lines end in CRLF: a bare LF ends a line for some servers only"),
    ("bare-lf-trailer", CHUNKED + b"0\r\nX: 1\n\r\n", "as bare-lf-lines"),
    ("http-1.2", b"GET / HTTP/1.2\r\nHost: x\r\n\r\n", "HTTP/1.0 and 1.1 only (as Twisted)"),
]
#: Requests h11 keeps the connection for and the reader does not, on purpose: (id, bytes, why).
STRICTER_KEEP_ALIVE = [
    ("close-after-a-blank", GET + b"Connection: foo close\r\n\r\n",
     "a close token among blanks (Twisted's reading) closes too: closing is never wrong"),
]
#: Requests the reader takes and h11 refuses, on purpose: (id, bytes, why, h11 configured with its defaults).
LOOSER_BY_DESIGN = [
    ("empty-line-first", b"\r\n" + GET + b"\r\n",
     "RFC 9112 2.2: a server SHOULD ignore at least one empty line before a request line (as Twisted)"),
    ("no-host", b"GET / HTTP/1.1\r\n\r\n",
     "the Host is not the reader's to check: the listener's host policy answers a request by its Host"),
    ("two-hosts", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
     "the Host is not the reader's: the request refuses more than one with its own 400"),
    # 16356 bytes of lines, 16560 with their CRLFs (h11 sees them before the head ends: its limit bites then).
    ("head-of-16-kib", b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%02d: %s\r\n" % (i, b"v" * 159) for i in range(99)) + b"\r\n",
     "h11's limit counts the CRLFs, the listener's does not (as Twisted): a limit each server sets"),
]


@pytest.mark.parametrize("case, data, why", STRICTER, ids=[c[0] for c in STRICTER])
def test_where_the_reader_is_stricter_than_h11_on_purpose(case, data, why):
    read_by_h11, error, _ = theirs([data])
    assert error is None and len(read_by_h11) == 1, f"{case}: h11 no longer takes it: not a case of STRICTER"
    assert drive([data]).state == "error" and type(drive([data]).events[-1]) is Refusal


@pytest.mark.parametrize("case, data, why", STRICTER_KEEP_ALIVE, ids=[c[0] for c in STRICTER_KEEP_ALIVE])
def test_where_the_reader_closes_and_h11_keeps_the_connection_on_purpose(case, data, why):
    read_by_h11, error, _ = theirs([data])
    assert error is None and read_by_h11[0][-1] is True
    assert ours([data])[0][0][-1] is False


@pytest.mark.parametrize("case, data, why", LOOSER_BY_DESIGN, ids=[c[0] for c in LOOSER_BY_DESIGN])
def test_where_the_reader_takes_what_h11_refuses_on_purpose(case, data, why):
    _, error, _ = theirs([data[:-2], data[-2:]], max_size=16 * 1024)  # h11's default limit
    assert error is not None, f"{case}: h11 takes it now: not a case of LOOSER_BY_DESIGN"
    read_by_us, refused = ours([data])
    assert len(read_by_us) == 1 and not refused


@pytest.mark.parametrize("data", [s[1] for s in STRICTER] + [s[1] for s in LOOSER_BY_DESIGN])
def test_the_listed_cases_read_alike_in_any_cut(data):
    outcomes = [drive(pieces) for pieces in splits(data)]
    assert all(outcome == outcomes[0] for outcome in outcomes)
