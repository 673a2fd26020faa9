"""The JSON-lines codec and the size-bounded line splitter (trio_agentd._protocol)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._protocol import (
    MAX_FRAME,
    OPS,
    Auth,
    AuthOk,
    Dropped,
    ErrorBody,
    Event,
    FrameTooLarge,
    Hello,
    LineBuffer,
    Message,
    Request,
    Response,
    WorkerHello,
    decode,
    encode,
    error_of,
    fail,
    ok,
)
from trio_agentd._text import CONTROL_CODEPOINTS

# --- strategies -------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
# names (ids, ops, client ids) carry no control or bidi-control characters
names = st.text(
    st.characters(exclude_characters=[chr(c) for c in CONTROL_CODEPOINTS], codec="utf-8"),
    max_size=20,
)
request_ids: st.SearchStrategy[str | int] = names | st.integers(
    min_value=-(2**63), max_value=2**63 - 1
)


# --- encode / decode --------------------------------------------------------------------------

SAMPLE_MESSAGES: list[Message] = [
    Hello(
        protocol=1,
        app_version="0.1.0",
        generation="ab" * 16,
        pid=4242,
        start_id="boot:123",
        socket="/run/user/1000/trio-agentd/daemon.sock",
        capabilities=["prompt", "stream"],
    ),
    Hello(protocol=1, app_version="0.1.0", generation="g", pid=1, start_id=None, socket="/s"),
    Request(id=7, op="ping"),
    Request(id="c-1", op="prompt", client_id="cli", args={"session": "s1", "text": "hi\nthere"}),
    Response(id=7, ok=True, result={"pong": True}),
    Response(id=None, ok=True, result=None),
    Response(
        id="x",
        ok=False,
        error=ErrorBody(code="unknown_op", message="no such op", details={"op": "frob"}),
    ),
    Event(id=3, event={"chunk": "partial output"}),
    WorkerHello(session="s1", pid=99, start_id="sid"),
    Auth(token="tok", generation="gen", pid=10, start_id=None, socket="/s"),
    AuthOk(session="s1", pid=99),
    Dropped(code="supervisor_generation_stale", message="stale"),
]


@pytest.mark.parametrize("msg", SAMPLE_MESSAGES, ids=lambda m: type(m).__name__)
def test_encode_decode_round_trip(msg: Message) -> None:
    frame = encode(msg)
    assert frame.endswith(b"\n")
    assert frame.count(b"\n") == 1
    assert decode(frame[:-1]) == msg


def test_encode_is_the_wire_format_of_the_spec() -> None:
    assert encode(Request(id=1, op="ping")) == b'{"type":"request","id":1,"op":"ping"}\n'
    assert encode(ok(1, None)) == b'{"type":"response","id":1,"ok":true,"result":null}\n'
    assert encode(Event(id="r", event={"a": 1})) == b'{"type":"event","id":"r","event":{"a":1}}\n'


def test_decode_fills_defaults_of_a_minimal_request() -> None:
    msg = decode(b'{"type":"request","id":5,"op":"status"}')
    assert msg == Request(id=5, op="status", client_id="", args={})


def test_decode_refuses_unknown_fields_of_a_request() -> None:
    with pytest.raises(AgentdError, match="unknown field `future_field`") as info:
        decode(b'{"type":"request","id":1,"op":"ping","future_field":[1,2]}')
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_decode_ignores_unknown_fields_of_other_messages() -> None:
    # a newer supervisor's hello or response must still reach an older client
    msg = decode(b'{"type":"response","id":1,"ok":true,"future_field":[1,2]}')
    assert msg == Response(id=1, ok=True)


def test_decode_response_without_result_leaves_it_unset() -> None:
    msg = decode(b'{"type":"response","id":1,"ok":true}')
    assert isinstance(msg, Response)
    assert msg.result is msgspec.UNSET
    assert msg.error is msgspec.UNSET


@given(
    request_id=request_ids,
    op=names,
    client_id=names,
    args=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
)
def test_request_round_trip_is_one_line(
    request_id: str | int, op: str, client_id: str, args: dict[str, Any]
) -> None:
    msg = Request(id=request_id, op=op, client_id=client_id, args=args)
    frame = encode(msg)
    # Newlines in strings are escaped, so a frame is exactly one line.
    assert frame.index(b"\n") == len(frame) - 1
    assert decode(frame[:-1]) == msg
    assert LineBuffer().feed(frame) == [frame[:-1]]


@pytest.mark.parametrize(
    ("line", "prefix"),
    [
        # not JSON
        (b"", "malformed JSON"),
        (b"nope", "malformed JSON"),
        (b'{"type":"request"', "malformed JSON"),
        (b'{"type":"request","id":1,"op":"ping"} trailing', "malformed JSON"),
        (b'{"type":"request","id":"\xff","op":"ping"}', "malformed JSON"),
        # not an object
        (b"[1]", "invalid message"),
        (b"1", "invalid message"),
        (b'"request"', "invalid message"),
        (b"null", "invalid message"),
        # no type / unknown type / type of the wrong type
        (b"{}", "invalid message"),
        (b'{"type":"nope","id":1}', "invalid message"),
        (b'{"type":5}', "invalid message"),
        # a field of the wrong type, or missing
        (b'{"type":"request","id":true,"op":"ping"}', "invalid message"),
        (b'{"type":"request","id":1.5,"op":"ping"}', "invalid message"),
        (b'{"type":"request","id":1,"op":7}', "invalid message"),
        (b'{"type":"request","id":1,"op":"ping","args":[]}', "invalid message"),
        (b'{"type":"request","id":1}', "invalid message"),
        (b'{"type":"response","id":1,"ok":"yes"}', "invalid message"),
        (
            b'{"type":"hello","protocol":"1","app_version":"x","generation":"g","pid":1,'
            b'"start_id":null,"socket":"/s"}',
            "invalid message",
        ),
    ],
)
def test_decode_errors_are_bad_request(line: bytes, prefix: str) -> None:
    with pytest.raises(AgentdError) as info:
        decode(line)
    assert info.value.code == "bad_request"
    assert info.value.message.startswith(prefix + ": ")
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__ is True


def test_decode_error_names_the_bad_field() -> None:
    with pytest.raises(AgentdError, match=r"\$\.args"):
        decode(b'{"type":"request","id":1,"op":"ping","args":"x"}')


@given(st.binary(max_size=64))
def test_decode_of_arbitrary_bytes_is_a_message_or_bad_request(line: bytes) -> None:
    outcome: object
    try:
        outcome = decode(line)
    except AgentdError as exc:
        outcome = exc.code
    assert outcome == "bad_request" or type(outcome) in {
        Hello,
        Request,
        Response,
        Event,
        WorkerHello,
        Auth,
        AuthOk,
        Dropped,
    }


# --- responses --------------------------------------------------------------------------------


def test_ok_builds_a_successful_response() -> None:
    assert ok("r1", [1, 2]) == Response(id="r1", ok=True, result=[1, 2])


def test_fail_carries_code_message_and_details() -> None:
    err = AgentdError(ErrorCode.OWNERSHIP_LOST, "lost it", {"cause": "revoked"})
    resp = fail(9, err)
    assert resp == Response(
        id=9,
        ok=False,
        error=ErrorBody(code="ownership_lost", message="lost it", details={"cause": "revoked"}),
    )
    assert resp.result is msgspec.UNSET


def test_error_of_round_trips_a_failure_through_the_wire() -> None:
    err = AgentdError(ErrorCode.UNKNOWN_SESSION, "no session s9", {"session": "s9"})
    resp = decode(encode(fail(4, err))[:-1])
    assert isinstance(resp, Response)
    back = error_of(resp)
    assert (back.code, back.message, back.details) == (
        "unknown_session",
        "no session s9",
        {"session": "s9"},
    )


def test_error_of_a_failed_response_without_body_is_internal() -> None:
    err = error_of(Response(id=1, ok=False))
    assert err.code == "internal"
    assert err.message == "failed response without an error body"


def _dispatched_ops() -> set[str]:
    """The op names ``Dispatcher.run_op`` matches on, read from its source."""
    import ast
    from pathlib import Path

    from trio_agentd import _supervisorops

    tree = ast.parse(Path(_supervisorops.__file__).read_text())
    run_op = next(n for n in ast.walk(tree)
                  if isinstance(n, ast.AsyncFunctionDef) and n.name == "run_op")
    match = next(n for n in ast.walk(run_op) if isinstance(n, ast.Match))
    ops: set[str] = set()
    for case in match.cases:
        pattern = case.pattern
        if isinstance(pattern, ast.MatchValue) and isinstance(pattern.value, ast.Constant):
            assert isinstance(pattern.value.value, str)
            ops.add(pattern.value.value)
    return ops


def test_ops_are_the_ops_the_supervisor_serves() -> None:
    # one list: the supervisor serves every op of OPS and no other (its unknown_op error names
    # OPS); a case added to the dispatch without its op in OPS fails here
    assert _dispatched_ops() == OPS
    assert {"ping", "prompt", "route", "remove_session", "shutdown"} <= OPS


# --- LineBuffer -------------------------------------------------------------------------------


def test_max_frame_is_one_mib() -> None:
    assert MAX_FRAME == 1024 * 1024


def test_linebuffer_splits_lines_across_feeds() -> None:
    buf = LineBuffer(limit=10)
    assert buf.feed(b"ab\ncd") == [b"ab"]
    assert buf.pending == 2
    assert buf.feed(b"\n") == [b"cd"]
    assert buf.pending == 0


def test_linebuffer_returns_several_lines_and_empty_lines() -> None:
    buf = LineBuffer(limit=10)
    assert buf.feed(b"a\n\nbc\nd") == [b"a", b"", b"bc"]
    assert buf.pending == 1
    assert buf.feed(b"") == []
    assert buf.pending == 1
    assert buf.feed(b"e\n") == [b"de"]


def test_linebuffer_accepts_a_line_of_exactly_the_limit() -> None:
    buf = LineBuffer(limit=5)
    assert buf.feed(b"12345") == []
    assert buf.pending == 5
    assert buf.feed(b"\n") == [b"12345"]


def test_linebuffer_refuses_a_complete_line_one_byte_over_the_limit() -> None:
    buf = LineBuffer(limit=5)
    with pytest.raises(FrameTooLarge) as info:
        buf.feed(b"123456\n")
    assert info.value.code == "frame_too_large"
    assert info.value.details == {"limit": 5}
    assert "5-byte frame limit" in info.value.message


def test_linebuffer_refuses_an_unfinished_line_as_soon_as_it_is_over() -> None:
    buf = LineBuffer(limit=5)
    assert buf.feed(b"ok\n12345") == [b"ok"]
    with pytest.raises(FrameTooLarge):
        buf.feed(b"6")


def test_linebuffer_refuses_an_over_limit_line_after_good_ones_in_one_chunk() -> None:
    buf = LineBuffer(limit=3)
    with pytest.raises(FrameTooLarge):
        buf.feed(b"abc\nabcd\n")


def test_frame_too_large_is_an_agentd_error() -> None:
    assert issubclass(FrameTooLarge, AgentdError)


def test_default_limit_is_max_frame() -> None:
    buf = LineBuffer()
    line = b"x" * MAX_FRAME
    assert buf.feed(line + b"\n") == [line]
    with pytest.raises(FrameTooLarge) as info:
        LineBuffer().feed(line + b"x")
    assert info.value.details == {"limit": MAX_FRAME}


def test_linebuffer_many_small_feeds_of_a_long_line() -> None:
    buf = LineBuffer(limit=4096)
    for _ in range(4096):
        assert buf.feed(b"y") == []
    assert buf.pending == 4096
    assert buf.feed(b"\n") == [b"y" * 4096]
    with pytest.raises(FrameTooLarge):
        buf.feed(b"z" * 4097)


LIMIT = 16
line_bytes = st.binary(max_size=LIMIT).map(lambda b: b.replace(b"\n", b"."))


def _chunks(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces: list[bytes] = []
    prev = 0
    for p in [*points, len(stream)]:
        pieces.append(stream[prev:p])
        prev = p
    return pieces


@given(
    lines=st.lists(line_bytes, max_size=12),
    tail=line_bytes,
    cuts=st.lists(st.integers(min_value=0, max_value=12 * (LIMIT + 1) + LIMIT), max_size=20),
)
def test_linebuffer_any_split_yields_the_same_lines(
    lines: list[bytes], tail: bytes, cuts: list[int]
) -> None:
    stream = b"".join(line + b"\n" for line in lines) + tail
    buf = LineBuffer(limit=LIMIT)
    got: list[bytes] = []
    for piece in _chunks(stream, cuts):
        got += buf.feed(piece)
    assert got == lines
    assert buf.pending == len(tail)


@given(
    before=st.lists(line_bytes, max_size=6),
    big=st.binary(min_size=LIMIT + 1, max_size=3 * LIMIT).map(lambda b: b.replace(b"\n", b".")),
    terminated=st.booleans(),
    after=st.lists(line_bytes, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=12 * (LIMIT + 1)), max_size=20),
)
def test_linebuffer_over_limit_line_always_raises_as_soon_as_known(
    before: list[bytes], big: bytes, terminated: bool, after: list[bytes], cuts: list[int]
) -> None:
    head = b"".join(line + b"\n" for line in before)
    stream = head + big
    if terminated:
        stream += b"\n" + b"".join(line + b"\n" for line in after)
    # The line is known to be too large once limit + 1 of its bytes have arrived.
    known_at = len(head) + LIMIT + 1
    newline_ends: list[int] = []  # stream offset just past each good line's newline
    offset = 0
    for line in before:
        offset += len(line) + 1
        newline_ends.append(offset)
    buf = LineBuffer(limit=LIMIT)
    got: list[bytes] = []
    end = 0
    for piece in _chunks(stream, cuts):
        end += len(piece)
        if end >= known_at:
            with pytest.raises(FrameTooLarge):
                buf.feed(piece)
            break
        got += buf.feed(piece)
        # Complete good lines come out in the feed that completes them.
        assert got == before[: sum(1 for e in newline_ends if e <= end)]
    else:
        raise AssertionError("the stream never reached the limit")


def test_hello_carries_the_home_and_an_older_hello_without_it_still_decodes() -> None:
    old = decode(b'{"type":"hello","protocol":1,"app_version":"0.1.0","generation":"g",'
                 b'"pid":1,"start_id":null,"socket":"/s"}')
    assert isinstance(old, Hello)
    assert old.home is None
    new = Hello(protocol=1, app_version="0.1.0", generation="g", pid=1, start_id=None,
                socket="/s", home="/h")
    frame = encode(new)
    assert b'"home":"/h"' in frame
    assert decode(frame[:-1]) == new
