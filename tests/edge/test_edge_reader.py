"""The edge's request reader (yieldproxy/edge/reader.py): its table of states, each event, each rule.

Every input here is read whole, a byte at a time and in random pieces
(``readercases.read``), and must give the same events each way; the
invariants every step keeps (nothing raised, no event without progress, every
byte fed read or waiting) are checked by ``readercases.drive`` throughout.
The rules themselves, with the words of each refusal, are
``readercases.RULES`` (the listener's answers from before the edge was the
proxy's own); the fuzzers are
``tests/edge/test_edge_reader_fuzz.py``.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

import attrs
import pytest
from hypothesis import given, strategies as st

from readercases import CHUNKED, POST, RULES, drive, pieces_of, read, splits
from yieldproxy.edge import reader as reader_module
from yieldproxy.edge.reader import (
    DEFAULT_LIMITS,
    NEED_DATA,
    PAUSED,
    STATES,
    TRANSITIONS,
    BodyData,
    ChunkAnnounced,
    Closed,
    EndOfMessage,
    Incomplete,
    Limits,
    Refusal,
    RequestHead,
    RequestReader,
)

EDGE = Path(__file__).resolve().parents[2] / "yieldproxy" / "edge"
#: What can happen to a reader: an event's kind, or one of these two.
HAPPENINGS = {"bytes", "start_next"} | {cls.__name__ for cls in (
    RequestHead, ChunkAnnounced, BodyData, EndOfMessage, Refusal, Incomplete, Closed)}


def head(data: bytes, **limits) -> RequestHead:
    events = read(data, Limits(**limits)).events
    assert type(events[0]) is RequestHead, events
    return events[0]


def refusal(data: bytes, **limits) -> Refusal:
    events = read(data, Limits(**limits)).events
    assert type(events[-1]) is Refusal, events
    return events[-1]


# -- the table, on its own ------------------------------------------------------------------


def _moves() -> dict[str, set[str]]:
    moves: dict[str, set[str]] = {state: set() for state in STATES}
    for (state, _), target in TRANSITIONS.items():
        moves[state].add(target)
    return moves


def _reachable(start: str) -> set[str]:
    moves = _moves()
    seen = {start}
    todo = deque([start])
    while todo:
        for target in moves[todo.popleft()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_table_names_only_states_and_happenings_that_exist():
    for (state, happened), target in TRANSITIONS.items():
        assert state in STATES and target in STATES
        assert happened in HAPPENINGS, happened
    # Every happening moves the reader somewhere.
    assert {happened for _, happened in TRANSITIONS} == HAPPENINGS


def test_every_state_is_reachable_from_idle():
    assert _reachable("idle") == set(STATES)


def test_the_only_dead_ends_are_error_and_closed_and_every_other_state_gets_back_to_idle():
    moves = _moves()
    assert {state for state in STATES if not moves[state]} == {"error", "closed"}
    for state in set(STATES) - {"error", "closed"}:
        assert "idle" in _reachable(state), state
        # ...and can end in either way too: refused or closed.
        assert {"error", "closed"} <= _reachable(state), state


def test_done_is_left_by_start_next_only_and_start_next_leaves_done_only():
    assert {h for (s, h) in TRANSITIONS if s == "done"} == {"start_next"}
    assert {s for (s, h) in TRANSITIONS if h == "start_next"} == {"done"}
    assert TRANSITIONS["done", "start_next"] == "idle"


def test_a_request_can_be_refused_or_cut_wherever_it_is_read():
    for state in ("head", "body"):
        assert TRANSITIONS[state, "Refusal"] == "error"
        assert TRANSITIONS[state, "Incomplete"] == "closed"
    # ...and nowhere else: between requests a close is a Closed, not an Incomplete.
    assert {s for (s, h) in TRANSITIONS if h in ("Refusal", "Incomplete")} == {"head", "body"}
    assert {s for (s, h) in TRANSITIONS if h == "Closed"} == {"idle"}


def test_a_head_comes_once_per_request_and_a_body_only_after_it():
    assert {s for (s, h) in TRANSITIONS if h == "RequestHead"} == {"head"}
    assert {s for (s, h) in TRANSITIONS if h in ("BodyData", "ChunkAnnounced", "EndOfMessage")} == {"body"}
    assert TRANSITIONS["head", "RequestHead"] == "body" and TRANSITIONS["body", "EndOfMessage"] == "done"


def test_a_move_the_table_lacks_raises_and_moves_nothing():
    reader = RequestReader()
    with pytest.raises(RuntimeError, match="start_next in state idle"):
        reader.start_next()
    assert reader.state == "idle"
    reader._state = "done"
    with pytest.raises(RuntimeError, match="RequestHead in state done"):
        reader._to("RequestHead")
    assert reader.state == "done"


class _Recording(RequestReader):
    """A reader that records each move it makes."""

    __slots__ = ("moves",)

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self.moves: list[tuple[str, str]] = []
        super().__init__(limits)

    def _to(self, happened: str) -> None:
        self.moves.append((self._state, happened))
        super()._to(happened)


@pytest.mark.parametrize("pieces", [True, False], ids=["whole", "bytewise"])
def test_every_move_of_the_table_is_made_by_some_input(pieces):
    """The table holds no move the reader never makes: each is made by one of these inputs."""
    inputs = [
        (b"GET / HTTP/1.1\r\n\r\n", True),  # idle-bytes, head-RequestHead, body-EndOfMessage, done-start_next, idle-Closed
        (POST + b"Content-Length: 2\r\n\r\nhi", True),  # body-BodyData
        (CHUNKED + b"2\r\nhi\r\n0\r\n\r\n", True),  # body-ChunkAnnounced
        (b"GET / HTTP/1.1\r\nX\r\n\r\n", True),  # head-Refusal
        (CHUNKED + b"zz\r\n", True),  # body-Refusal
        (b"GET / HT", True),  # head-Incomplete
        (POST + b"Content-Length: 2\r\n\r\nh", True),  # body-Incomplete
    ]
    made = set()
    for data, eof in inputs:
        reader = _Recording()
        drive([data] if pieces else [data[i : i + 1] for i in range(len(data))], eof=eof, reader=reader)
        made.update(reader.moves)
    assert made == set(TRANSITIONS)


@pytest.mark.parametrize(
    "data",
    [rule.data for rule in RULES[::7]] + [
        POST + b"Content-Length: 3\r\n\r\nabc" + CHUNKED + b"1\r\nz\r\n0\r\n\r\n", b"GET / HTTP/1.1\r\n\r\nGET", b"",
    ],
)
def test_every_event_is_a_move_of_the_table(data):
    """Each event the reader returns it returned through _to: one move, named as the event, per event."""
    reader = _Recording()
    reader.feed(data)
    reader.feed_eof()
    while True:
        before = len(reader.moves)
        event = reader.next_event()
        if event is PAUSED:
            if reader.state != "done":
                break
            reader.start_next()
            assert reader.moves[-1] == ("done", "start_next")
            continue
        moves = reader.moves[before:]
        if moves and moves[0][1] == "bytes":
            moves = moves[1:]
        assert moves == [(moves[0][0] if moves else None, type(event).__name__)], (event, moves)


@given(st.sampled_from([b"GET", b"HEAD", b"POST"]), st.sampled_from([b"/api/embed", b"/v1/embeddings?x=1"]),
       st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]), st.lists(st.integers(1, 40), max_size=8))
def test_the_request_line_is_known_from_its_end_to_the_next_request_however_the_bytes_come(method, target, version, cuts):
    """A refusal answers in the shape and version of the request line (edge/refusal.py): the reader knows that
    line from the moment it is read, through the body, a refusal in it and the request's end, whichever way the
    head was read (whole at once, or line by line), and forgets it for the next request."""
    line = (method, target, version)
    data = b"%s %s %s\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n" % line
    reader = RequestReader()
    assert reader.request_line is None
    seen_line = False
    for piece in pieces_of(data, cuts):
        reader.feed(piece)
        while (event := reader.next_event()) is not NEED_DATA and event is not PAUSED:
            assert reader.request_line == line, event
        seen_line = seen_line or data.index(b"\r\n") < reader.consumed
        assert reader.request_line == (line if seen_line else None)
    assert reader.state == "error" and reader.request_line == line
    reader = RequestReader()
    reader.feed(b"%s %s %s\r\n\r\n" % line)
    assert type(reader.next_event()) is RequestHead and type(reader.next_event()) is EndOfMessage
    assert reader.request_line == line
    reader.start_next()
    assert reader.request_line is None


# -- events -----------------------------------------------------------------------------------


def test_a_request_without_a_body_is_its_head_then_its_end():
    data = b"GET /api/tags?x=1 HTTP/1.1\r\nHost: 127.0.0.1:11434\r\nUser-Agent: t\r\n\r\n"
    outcome = read(data)
    assert outcome.events == (
        RequestHead(
            b"GET", b"/api/tags?x=1", b"HTTP/1.1", ((b"Host", b"127.0.0.1:11434"), (b"User-Agent", b"t")),
            None, False, True, False, len(data),
        ),
        EndOfMessage(),
        Closed(),
    )
    assert outcome.state == "closed"


def test_headers_keep_their_names_as_sent_their_order_and_repeats_values_lose_their_blanks():
    data = b"GET / HTTP/1.1\r\nhOsT: a\r\nX-A: 1\r\nx-a:2\r\nX-B:\r\nX-C: \t in  side \t\r\nX-A: 3\r\n\r\n"
    assert head(data).headers == (
        (b"hOsT", b"a"), (b"X-A", b"1"), (b"x-a", b"2"), (b"X-B", b""), (b"X-C", b"in  side"), (b"X-A", b"3"),
    )


def test_values_may_hold_obs_text_and_controls_but_nul_cr_lf_vt_ff():
    assert head(b"GET / HTTP/1.1\r\nX: caf\xc3\xa9 \x01\x7f\xff\r\n\r\n").headers == ((b"X", b"caf\xc3\xa9 \x01\x7f\xff"),)
    for bad in (b"\x00", b"\r", b"\x0b", b"\x0c"):
        assert refusal(b"GET / HTTP/1.1\r\nX: a" + bad + b"b\r\n\r\n").status == 400


def test_a_content_length_body_is_its_bytes_then_the_end():
    data = POST + b"Content-Length: 11\r\n\r\nhello world"
    events = read(data).events
    assert events[0].length == 11 and not events[0].chunked
    assert events[1:] == (BodyData(b"hello world"), EndOfMessage(), Closed())


def test_content_length_zero_ends_at_once_and_says_so():
    events = read(POST + b"Content-Length: 0\r\n\r\n").events
    assert events[0].length == 0 and events[1:] == (EndOfMessage(), Closed())
    # Leading zeros are digits too (up to 18 of them).
    assert head(POST + b"Content-Length: 000000000000000005\r\n\r\nabcde").length == 5


def test_a_body_arriving_alone_is_handed_on_without_a_copy():
    reader = RequestReader()
    reader.feed(POST + b"Content-Length: 10\r\n\r\n")
    assert type(reader.next_event()) is RequestHead
    assert reader.next_event() is NEED_DATA
    piece = b"0123456789"
    reader.feed(piece)
    event = reader.next_event()
    assert event == BodyData(piece) and event.data is piece
    assert reader.next_event() == EndOfMessage()


def test_a_body_after_its_head_in_one_piece_is_one_slice():
    reader = RequestReader()
    reader.feed(POST + b"Content-Length: 5000\r\n\r\n" + b"b" * 5000 + b"GET / HTTP/1.1\r\n\r\n")
    assert type(reader.next_event()) is RequestHead
    assert reader.next_event() == BodyData(b"b" * 5000)
    assert reader.next_event() == EndOfMessage() and reader.read_ahead == b"GET / HTTP/1.1\r\n\r\n"


def test_a_chunked_body_announces_each_chunk_and_drops_extensions_and_trailers():
    data = CHUNKED + b"3;name=value;x\r\nabc\r\n10\r\n0123456789abcdef\r\n0;last\r\nX-T: 1\r\nX-U: 2\r\n\r\n"
    events = read(data).events
    assert events[0].chunked and events[0].length is None
    assert events[1:] == (
        ChunkAnnounced(3), BodyData(b"abc"), ChunkAnnounced(16), BodyData(b"0123456789abcdef"), EndOfMessage(), Closed(),
    )


def test_a_chunk_is_announced_before_its_bytes_come():
    """So a body too large for its limit is refused at the size line, not after the limit's worth of bytes."""
    reader = RequestReader()
    reader.feed(CHUNKED + b"%x\r\n" % (1 << 40))
    assert type(reader.next_event()) is RequestHead
    assert reader.next_event() == ChunkAnnounced(1 << 40)
    assert reader.next_event() is NEED_DATA


def test_chunk_sizes_take_up_to_16_hex_digits_in_either_case():
    events = read(CHUNKED + b"00000000000000Aa\r\n" + b"x" * 0xAA + b"\r\n0\r\n\r\n").events
    assert events[1] == ChunkAnnounced(0xAA)


def test_pipelined_requests_wait_in_read_ahead_until_start_next():
    first = POST + b"Content-Length: 3\r\n\r\nabc"
    second = b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n"
    third = b"GET /third HTTP/1.1\r\n"
    reader = RequestReader()
    reader.feed(first + second + third)
    assert [type(reader.next_event()) for _ in range(3)] == [RequestHead, BodyData, EndOfMessage]
    assert reader.state == "done" and reader.read_ahead == second + third
    for _ in range(3):
        assert reader.next_event() is PAUSED
    assert reader.consumed == len(first)
    reader.start_next()
    assert reader.state == "idle" and reader.read_ahead == second + third
    event = reader.next_event()
    assert event.target == b"/second" and event.head_bytes == len(second)
    assert reader.next_event() == EndOfMessage() and reader.read_ahead == third
    reader.start_next()
    assert reader.next_event() is NEED_DATA and reader.state == "head"
    reader.feed_eof()
    assert reader.next_event() == Incomplete() and reader.state == "closed"


def test_several_requests_read_through_in_any_cut_are_the_same_requests():
    data = (
        POST + b"Content-Length: 3\r\n\r\nabc"
        + b"\r\n"  # the one empty line skipped before a request line
        + CHUNKED + b"1\r\nz\r\n0\r\n\r\n"
        + b"GET /last HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    events = read(data).events
    heads = [e for e in events if type(e) is RequestHead]
    assert [h.target for h in heads] == [b"/api/embed", b"/api/embed", b"/last"]
    assert heads[1].head_bytes == 2 + len(CHUNKED)
    assert [h.keep_alive for h in heads] == [True, True, False]
    assert events[-1] == Closed()


@pytest.mark.parametrize(
    "version, connection, keep_alive",
    [
        (b"HTTP/1.1", None, True),
        (b"HTTP/1.1", b"keep-alive", True),
        (b"HTTP/1.1", b"close", False),
        (b"HTTP/1.1", b"CLOSE", False),
        (b"HTTP/1.1", b"keep-alive, close", False),
        (b"HTTP/1.1", b"close,foo", False),  # Twisted splits at spaces only: it kept this one open
        (b"HTTP/1.1", b"foo close", False),  # h11 splits at commas only: it keeps this one open
        (b"HTTP/1.1", b"closed", True),
        (b"HTTP/1.1", b"x-close", True),
        (b"HTTP/1.0", None, False),
        (b"HTTP/1.0", b"keep-alive", False),  # as Twisted: an HTTP/1.0 connection is never kept
    ],
)
def test_keep_alive_is_http_1_1_without_a_close_token(version, connection, keep_alive):
    extra = b"Connection: %s\r\n" % connection if connection is not None else b""
    assert head(b"GET / " + version + b"\r\nHost: x\r\n" + extra + b"\r\n").keep_alive is keep_alive


def test_a_close_token_in_any_connection_header_closes():
    assert head(b"GET / HTTP/1.1\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n").keep_alive is False


@pytest.mark.parametrize(
    "version, expects, expect_continue",
    [
        (b"HTTP/1.1", [b"100-continue"], True),
        (b"HTTP/1.1", [b"100-Continue"], True),
        (b"HTTP/1.1", [], False),
        (b"HTTP/1.1", [b"something"], False),
        (b"HTTP/1.1", [b"something", b"100-continue"], False),  # as Twisted: the first Expect only
        (b"HTTP/1.0", [b"100-continue"], False),  # RFC 9110 10.1.1: ignored in HTTP/1.0
    ],
)
def test_expect_continue_as_twisted_reads_it(version, expects, expect_continue):
    lines = b"".join(b"Expect: %s\r\n" % value for value in expects)
    data = b"POST / " + version + b"\r\n" + lines + b"Content-Length: 1\r\n\r\nx"
    assert head(data).expect_continue is expect_continue


def test_one_empty_line_before_a_request_line_is_skipped_and_counted_in_its_head():
    data = b"\r\nGET / HTTP/1.1\r\n\r\n"
    assert head(data).head_bytes == len(data)
    assert refusal(b"\r\n" + data).status == 400


def test_any_token_is_a_method_and_any_visible_ascii_a_target():
    h = head(b"M-SEARCH! *?a=%20b&c=[d]{e}|~ HTTP/1.1\r\n\r\n")
    assert (h.method, h.target) == (b"M-SEARCH!", b"*?a=%20b&c=[d]{e}|~")
    assert head(b"get http://example.com:80/x HTTP/1.0\r\n\r\n").target == b"http://example.com:80/x"


def test_the_client_closing_between_requests_is_closed_and_within_one_incomplete():
    assert read(b"").events == (Closed(),)
    assert read(b"GET / HTTP/1.1\r\n\r\n").events[-1] == Closed()
    for cut in (b"G", b"GET / HTTP/1.1\r\n", b"\r\n", POST + b"Content-Length: 5\r\n\r\nab", CHUNKED + b"5\r\nab",
                CHUNKED + b"5", CHUNKED + b"0\r\n", CHUNKED + b"0\r\nX-T: 1\r\n"):
        outcome = read(cut)
        assert outcome.events[-1] == Incomplete() and outcome.state == "closed", cut


def test_a_closed_or_incomplete_reader_reads_nothing_more_and_takes_no_more_bytes():
    for data in (b"", b"GET"):
        reader = RequestReader()
        reader.feed(data)
        reader.feed_eof()
        assert type(reader.next_event()) in (Closed, Incomplete)
        assert reader.next_event() is PAUSED and reader.state == "closed"
        assert reader.read_ahead == b"" and reader.consumed == len(data)
        with pytest.raises(RuntimeError, match="after the end"):
            reader.feed(b"more")


def test_after_a_refusal_it_drops_what_it_is_fed():
    reader = RequestReader()
    reader.feed(b"GET / HTTP/1.1\r\nBad Line\r\nmore")
    assert reader.next_event() == Refusal(400, "malformed HTTP request", "bad_request")
    assert reader.state == "error" and reader.read_ahead == b""
    reader.feed(b"x" * 1000)
    assert reader.consumed == len(b"GET / HTTP/1.1\r\nBad Line\r\nmore") + 1000
    assert reader.read_ahead == b"" and reader.next_event() is PAUSED
    reader.feed_eof()
    assert reader.next_event() is PAUSED and reader.state == "error"


def test_a_refusal_comes_as_soon_as_a_line_breaks_a_rule_not_at_the_end_of_the_head():
    reader = RequestReader()
    reader.feed(b"GET / HTTP/1.1\r\nBad Line\r\n")
    assert type(reader.next_event()) is Refusal


def test_nothing_is_read_until_asked():
    reader = RequestReader()
    reader.feed(b"GET / HTTP/1.1\r\n\r\n")
    assert reader.state == "idle" and reader.consumed == 0
    reader.feed_eof()
    assert reader.state == "idle"


# -- rules and limits -----------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=[rule.id for rule in RULES])
def test_each_rule_is_refused_the_same_in_any_cut(rule):
    outcome = read(rule.data)
    assert [e for e in outcome.events if type(e) is Refusal] == [Refusal(rule.status, rule.message, rule.code)]
    assert outcome.events[-1] == Refusal(rule.status, rule.message, rule.code)
    assert outcome.state == "error" and outcome.read_ahead == b""
    if rule.today is not None or rule.whole is not None:
        assert rule.why, f"{rule.id}: the reader answers otherwise than today's listener, and the table says not why"


def test_a_bare_lf_is_refused_when_it_comes_not_when_the_line_would_end():
    for data in (b"GET / HTTP/1.1\n", b"GET / HTTP/1.1\r\nX: 1\n", CHUNKED + b"3\n", CHUNKED + b"3\r\nabc\r\n0\r\nX: 1\n"):
        reader = RequestReader()
        reader.feed(data)
        events = []
        while (event := reader.next_event()) is not PAUSED:
            assert event is not NEED_DATA, data
            events.append(event)
        assert reader.state == "error" and "bare LF" in events[-1].message


def test_the_rule_broken_first_is_answered_whatever_comes_after():
    # A bare LF within the line limit beats the line's length; past it, the length wins.
    assert refusal(b"GET /" + b"q" * 100 + b"\n" + b"q" * 20000).status == 400
    assert refusal(b"GET /" + b"q" * 20000 + b"\n").status == 414
    # A bad line before a head too large: the bad line.
    assert refusal(b"GET / HTTP/1.1\r\nBad\r\n" + b"X: " + b"x" * 20000 + b"\r\n\r\n").status == 400
    # 17 digits of size come before a bare LF after them.
    assert refusal(CHUNKED + b"1" * 17 + b"\n").message.startswith("a chunk size of more than")
    assert refusal(CHUNKED + b"1" * 16 + b"\n").message.startswith("a chunk line ends in a bare LF")


@pytest.mark.parametrize("limit", [14, 15, 40])
def test_a_request_line_up_to_max_line_bytes_passes_and_one_more_byte_is_a_414(limit):
    line = b"GET /" + b"a" * (limit - len(b"GET / HTTP/1.1")) + b" HTTP/1.1"
    assert len(line) == limit
    assert head(line + b"\r\n\r\n", max_line_bytes=limit).target.startswith(b"/")
    assert refusal(b"GET /a" + line[5:] + b"\r\n\r\n", max_line_bytes=limit).status == 414
    # Unfinished: max_line_bytes + 1 bytes may be the line and its CR; one more, and it is too long.
    assert read(b"GET /a" + line[5:], Limits(max_line_bytes=limit)).events == (Incomplete(),)
    assert refusal(b"GET /aa" + line[5:], max_line_bytes=limit).status == 414


def test_the_default_limits_are_todays_at_their_edges():
    target = b"/" + b"q" * (16384 - len(b"GET / HTTP/1.1"))
    line = b"GET " + target + b" HTTP/1.1"
    assert len(line) == 16384
    assert head(line + b"\r\n\r\n").target == target
    assert refusal(line.replace(b"GET", b"GETS") + b"\r\n\r\n").status == 414
    # A head of exactly 16384 bytes of lines passes (its CRLFs are not counted), one more byte is a 431.
    lines = [b"GET / HTTP/1.1"] + [b"X-%02d: %s" % (i, b"v" * 1000) for i in range(16)]
    filler = 16384 - sum(map(len, lines)) - len(b"X-Fill: ")
    lines.append(b"X-Fill: " + b"f" * filler)
    data = b"\r\n".join(lines) + b"\r\n\r\n"
    assert len(head(data).headers) == 17
    assert refusal(data.replace(b"X-Fill: ", b"X-Fill: f")) == Refusal(431, "request headers larger than 16384 bytes", "headers_too_large")
    # 100 header lines pass, 101 are a 431.
    hundred = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(100))
    assert len(head(hundred + b"\r\n").headers) == 100
    assert refusal(hundred + b"X-100: v\r\n\r\n").message == "more than 100 request headers"


def test_small_limits_at_their_edges():
    limits = dict(max_head_bytes=40, max_line_bytes=30, max_headers=2, max_chunk_line=6, max_trailer_bytes=12)
    assert head(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\n\r\n", **limits)
    assert refusal(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n", **limits).status == 431  # 3 headers
    assert refusal(b"GET / HTTP/1.1\r\nA: " + b"a" * 28 + b"\r\n\r\n", **limits).message.startswith("a header line")
    assert refusal(b"GET / HTTP/1.1\r\nA: " + b"a" * 20 + b"\r\nB: 12\r\n\r\n", **limits).message.startswith("request headers")
    chunked = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    limits["max_head_bytes"] = 100
    assert read(chunked + b"1;abcd\r\nx\r\n0\r\n\r\n", Limits(**limits)).events[-2] == EndOfMessage()
    assert refusal(chunked + b"1;abcde\r\nx\r\n0\r\n\r\n", **limits).status == 400  # 7 > 6
    # Trailers: 12 bytes with their CRLFs and the empty line ending them pass; one more does not.
    assert read(chunked + b"0\r\nA: 1\r\nB:\r\n\r\n", Limits(**limits)).events[-2] == EndOfMessage()
    assert refusal(chunked + b"0\r\nA: 1\r\nB: \r\n\r\n", **limits).status == 400
    assert read(chunked + b"0\r\nAB: 1234\r\n\r\n", Limits(**limits)).events[-2] == EndOfMessage()
    assert refusal(chunked + b"0\r\nAB: 12345\r\n\r\n", **limits).status == 400
    assert refusal(chunked + b"0\r\nAB: 123456\r\n\r\n", **limits).status == 400  # its line fits, not the end
    # In the order the bytes come: 11 bytes and the CRLF still needed are past 12 before a bare LF after them...
    assert refusal(chunked + b"0\r\nAB: 1234567\n", **limits).message == "malformed HTTP request"
    # ...and a bare LF as the 11th byte wins the tie.
    assert refusal(chunked + b"0\r\nAB: 123456\n", **limits).message.startswith("a chunk line ends in a bare LF")


@pytest.mark.parametrize("field", attrs.fields(Limits), ids=lambda f: f.name)
def test_a_limit_must_be_a_whole_number_of_at_least_one(field):
    for bad in (0, -1, 1.5, "10", None):
        with pytest.raises(ValueError, match=field.name):
            Limits(**{field.name: bad})


@pytest.mark.parametrize("size", [300, 3000])
def test_a_head_dribbled_a_byte_at_a_time_is_read_as_the_same_head(size):
    """Short lines, and lines longer than what the reader keeps as bytes before it grows a buffer in place."""
    count = 12000 // size
    data = POST + b"".join(b"X-%d: %s\r\n" % (i, b"v" * size) for i in range(count)) + b"Content-Length: 2\r\n\r\nhi"
    whole = drive([data])
    assert drive([data[i : i + 1] for i in range(len(data))]) == whole
    assert drive(pieces_of(data, range(0, len(data), 7))) == whole
    assert len(whole.events[0].headers) == count + 2 and whole.events[1] == BodyData(b"hi")


# -- the package ------------------------------------------------------------------------------


def test_the_edge_imports_only_the_standard_library_attrs_twisted_and_zope():
    """The package docstring's rule: nothing of the proxy's but the house's named-states idiom
    (yieldproxy/states.py, itself the standard library only), so the edge can be read and fuzzed alone
    (zope.interface: the upstream client's ``@implementer``, as Twisted's own)."""
    allowed = set(sys.stdlib_module_names) | {"attrs", "twisted", "zope", "__future__"}
    for path in sorted(EDGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    inside = node.level == 1 or (node.level == 2 and node.module == "states")
                    assert inside, f"{path.name} imports from outside yieldproxy.edge: {ast.unparse(node)}"
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_splits_cover_whole_bytewise_and_random_cuts():
    """The helper every test here reads through cuts as it says (a test of the test's own tool)."""
    cuttings = splits(b"abcdef", seed=1)
    assert cuttings[0] == [b"abcdef"] and cuttings[1] == [b"a", b"b", b"c", b"d", b"e", b"f"]
    assert all(b"".join(c) == b"abcdef" for c in cuttings)
    assert reader_module.STATES == STATES
