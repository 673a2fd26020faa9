"""Hostile frames and hostile text: decoders, readers, argument checks, terminal output.

Whatever a peer sends, every reader answers or fails with ``AgentdError`` (``bad_request`` on
the daemon's side), never another exception; names are matched in full; tables printed to a
terminal escape control characters.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trio_util import AsyncValue

from trio_agentd import _client, _syncconn
from trio_agentd._aio import Inbox, native
from trio_agentd._aio import MessageStream as ClientStream
from trio_agentd._depth import MAX_DEPTH, nesting_depth
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._protocol import (
    Auth,
    AuthOk,
    Dropped,
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
    fail,
    ok,
    request_id_of,
)
from trio_agentd._session import check_session_id
from trio_agentd._stream import MessageStream
from trio_agentd._supervisor import Supervisor, SupervisorConfig
from trio_agentd._supervisorops import Dispatcher, _guess_id, _opt_str, _str_arg
from trio_agentd._supervisorsessions import SessionTable
from trio_agentd._text import CONTROL_CODEPOINTS, printable
from trio_agentd._workerlink import link_over_stream
from trio_agentd.agents._spec import validate_agent_spec

from ..anyio_support import assert_on, socket_stream_pair
from ..hostile_frames import HOSTILE_FRAMES, VALID_LOOKALIKES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies ---------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=16,
)
hostile_text = st.text(
    st.sampled_from([*map(chr, CONTROL_CODEPOINTS), "a", "Z", "0", ".", "-", "_", "/", " ", "é"])
    | st.characters(codec="utf-8"),
    max_size=24,
)
names = st.text(
    st.characters(exclude_characters=[chr(c) for c in CONTROL_CODEPOINTS], codec="utf-8"),
    max_size=20,
)
request_ids: st.SearchStrategy[str | int] = names | st.integers(-(2**63), 2**63 - 1)
valid_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=16,
)


def _deep(depth: int) -> bytes:
    return b'{"type":"request","id":1,"op":"ping","args":{"a":' + (
        b"[" * (depth - 2) + b"]" * (depth - 2)
    ) + b"}}"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _as_request(frame: bytes) -> Request:
    """What the supervisor's reader does with a line: a request, or bad_request."""
    msg = decode(frame)
    if not isinstance(msg, Request):
        raise AgentdError(ErrorCode.BAD_REQUEST, f"expected a request, got {type(msg).__name__}")
    return msg


def _bad_request(exc: BaseException | None) -> bool:
    return isinstance(exc, AgentdError) and exc.code == ErrorCode.BAD_REQUEST


def _call(fn: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``(result, None)``, or ``(None, the exception)`` whatever its type."""
    try:
        return fn(*args), None
    except Exception as exc:
        return None, exc


# --- the decoder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HOSTILE_FRAMES))
def test_each_hostile_frame_is_one_bad_request(name: str) -> None:
    frame = HOSTILE_FRAMES[name]
    with pytest.raises(AgentdError) as info:
        _as_request(frame)
    assert info.value.code == ErrorCode.BAD_REQUEST
    # and the reply to it can be encoded (a guessed id is always a valid one)
    reply = encode(fail(_guess_id(frame), info.value))
    assert isinstance(decode(reply[:-1]), Response)


@pytest.mark.parametrize("name", sorted(VALID_LOOKALIKES))
def test_valid_lookalikes_decode(name: str) -> None:
    assert isinstance(_as_request(VALID_LOOKALIKES[name]), Request)


def test_deep_nesting_raises_bad_request_not_recursion_error() -> None:
    for depth in (MAX_DEPTH + 1, 1000, 100_000):
        with pytest.raises(AgentdError, match="nested deeper than 64") as info:
            decode(_deep(depth))
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert request_id_of(_deep(depth)) is None
    assert isinstance(decode(_deep(MAX_DEPTH)), Request)


def test_unknown_field_is_named() -> None:
    with pytest.raises(AgentdError, match="unknown field `sesion`"):
        decode(b'{"type":"request","id":1,"op":"ping","sesion":"s"}')


def test_refused_frames_are_answered_with_their_id_when_it_is_valid() -> None:
    assert _guess_id(b'{"type":"request","id":7,"op":5}') == 7
    assert _guess_id(b'{"type":"request","id":"r-1","zzz":1}') == "r-1"
    assert _guess_id(b'{"type":"request","id":"a\\u001b","op":"ping"}') is None
    assert _guess_id(b'{"type":"request","id":1e999,"op":"ping"}') is None
    assert _guess_id(b'{"type":"request","id":' + b"9" * 5000 + b"}") is None
    assert _guess_id(b'{"type":"request","id":9223372036854775808}') is None
    assert _guess_id(b'{"id":true}') is None
    assert _guess_id(b"[" * 100_000) is None


@FUZZ
@given(st.binary(max_size=512))
@example(b"[" * 10_000)
@example(b'{"type":"request","id":1,"op":"ping","args":' + b'{"a":' * 5000)
def test_arbitrary_bytes_decode_to_a_message_or_bad_request(frame: bytes) -> None:
    msg, exc = _call(decode, frame)
    assert exc is None or _bad_request(exc), repr(exc)
    assert exc is not None or isinstance(msg, Hello | Request | Response | Event | WorkerHello
                                         | Auth | AuthOk | Dropped)
    rid = request_id_of(frame)
    assert rid is None or isinstance(encode(ok(rid, None)), bytes)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["type", "id", "op", "client_id", "args", "ok", "result", "event"])
        | st.text(max_size=6),
        json_values,
        max_size=6,
    ),
    st.sampled_from(["request", "response", "event", "hello", None]),
)
def test_arbitrary_json_objects_decode_or_fail_with_bad_request(
    obj: dict[str, Any], kind: str | None
) -> None:
    if kind is not None:
        obj["type"] = kind
    frame = _dumps(obj)
    msg, exc = _call(decode, frame)
    if exc is not None:
        assert _bad_request(exc), repr(exc)
        return
    # what decodes re-encodes to the same message
    assert decode(encode(msg)[:-1]) == msg


@FUZZ
@given(json_values)
def test_arbitrary_json_values_as_args_decode_or_fail_with_bad_request(value: Any) -> None:
    frame = b'{"type":"request","id":1,"op":"ping","args":{"v":' + _dumps(value) + b"}}"
    msg, exc = _call(decode, frame)
    assert exc is None or _bad_request(exc), repr(exc)
    assert exc is not None or isinstance(msg, Request)


@FUZZ
@given(
    request_id=request_ids,
    op=names,
    client_id=names,
    args=st.dictionaries(st.text(max_size=8), valid_values, max_size=4),
)
def test_valid_requests_round_trip(
    request_id: str | int, op: str, client_id: str, args: dict[str, Any]
) -> None:
    msg = Request(id=request_id, op=op, client_id=client_id, args=args)
    frame = encode(msg)
    assert frame.count(b"\n") == 1
    lines = LineBuffer().feed(frame)
    assert lines == [frame[:-1]]
    assert _as_request(lines[0]) == msg


@FUZZ
@given(json_values)
def test_nesting_depth_is_exact_for_valid_json(value: Any) -> None:
    frame = _dumps(value)
    if frame.count(b"[") + frame.count(b"{") > MAX_DEPTH:
        assert nesting_depth(frame) == _depth_of(value)
    else:
        assert nesting_depth(frame) >= _depth_of(value)


def _depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth_of(v) for v in value.values()), default=0)
    return 0


def test_nesting_depth_ignores_brackets_in_strings() -> None:
    text = json.dumps({"s": "[" * 200 + '\\"[{' + "{" * 200, "a": [[1]]}).encode()
    assert nesting_depth(text) == 3


# --- the line splitter ---------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=8), st.integers(1, 200))
def test_line_buffer_splits_any_bytes_or_refuses_an_oversized_line(
    chunks: list[bytes], limit: int
) -> None:
    buf = LineBuffer(limit)
    lines: list[bytes] = []
    for chunk in chunks:
        got, exc = _call(buf.feed, chunk)
        if exc is not None:
            assert isinstance(exc, FrameTooLarge), repr(exc)
            return
        lines += got
    data = b"".join(chunks)
    assert lines == data.split(b"\n")[:-1]
    assert all(len(line) <= limit for line in lines)
    for line in lines:
        _, exc = _call(decode, line)
        assert exc is None or _bad_request(exc), repr(exc)


# --- the supervisor's reader (real read_requests over an in-memory stream) ---------------------


class _Recording(Dispatcher):
    """A supervisor's dispatcher that only records what its reader let through."""

    dispatched: list[Request]

    async def _dispatch(
        self, ms: MessageStream, req: Request, inflight: AsyncValue[int]
    ) -> None:
        self.dispatched.append(req)
        await ms.send(ok(req.id, {"pong": True}))
        inflight.value -= 1


def _config(tmp: Path) -> SupervisorConfig:
    return SupervisorConfig(
        socket=str(tmp / "s.sock"), home=str(tmp / "home"), registry=str(tmp / "reg")
    )


async def test_supervisor_reader_answers_each_hostile_frame_once_and_keeps_reading(
    tmp_path: Path,
) -> None:
    reader = _Recording(Supervisor(_config(tmp_path)), max_clients=1)
    reader.dispatched = []
    client_side, server_side = trio.testing.memory_stream_pair()
    server = MessageStream(server_side)
    client = MessageStream(client_side)
    frames = list(HOSTILE_FRAMES.values())

    async def write() -> None:
        for frame in frames:
            await client.send_raw(frame + b"\n")
        await client.send(Request(id="last", op="ping"))
        await client_side.send_eof()

    replies: list[Message] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        async with trio.open_nursery() as requests:
            await reader.read_requests(server, requests, AsyncValue(0))
        while True:
            with trio.move_on_after(5):
                msg = await client.receive()
            if msg is None:
                break
            replies.append(msg)
            if isinstance(msg, Response) and msg.id == "last":
                break
    assert [r.id for r in reader.dispatched] == ["last"]
    assert len(replies) == len(frames) + 1
    for reply in replies[:-1]:
        assert isinstance(reply, Response)
        assert not reply.ok
        assert not isinstance(reply.error, msgspec.UnsetType)
        assert reply.error.code == ErrorCode.BAD_REQUEST
    assert isinstance(replies[-1], Response)
    assert replies[-1].ok


# --- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["abc\n", "abc\r\n", "\nabc", "abc\x1b", "a" * 65, "", ".x", "../x", "a/b", "a b"]
)
def test_session_ids_are_matched_in_full(bad: str) -> None:
    with pytest.raises(AgentdError) as info:
        check_session_id(bad)
    assert info.value.code == ErrorCode.BAD_REQUEST


@FUZZ
@given(json_values | hostile_text)
def test_argument_checks_raise_only_bad_request(value: Any) -> None:
    args = {"x": value}
    for check in (_str_arg, _opt_str):
        got, exc = _call(check, args, "x")
        assert exc is None or _bad_request(exc), repr(exc)
        assert got is None or (isinstance(got, str) and "\0" not in got)
    _, exc = _call(check_session_id, value)
    assert exc is None or _bad_request(exc), repr(exc)
    assert exc is not None or isinstance(value, str)
    if isinstance(value, str):  # its callers pass it a string (checked by _opt_str first)
        _, exc = _call(validate_agent_spec, value)
        assert exc is None or _bad_request(exc), repr(exc)


@FUZZ
@given(hostile_text)
@example("abc\n")
@example("exec:")
@example("exec:'")
@example("a:b\n")
def test_session_id_and_agent_checks_on_hostile_text(text: str) -> None:
    _, exc = _call(check_session_id, text)
    assert exc is None or _bad_request(exc), repr(exc)
    if exc is None:
        assert text.isascii()
        assert text.isprintable()
    _, exc = _call(validate_agent_spec, text)
    assert exc is None or _bad_request(exc), repr(exc)


def _no_spawn(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Dispatcher:
    """A supervisor's ops: the real argument checks of every op, but no worker spawned."""

    def claim_session(self: SessionTable, session_id: str, meta: dict[str, Any] | None) -> None:
        raise AgentdError("test_no_spawn", f"would create session {session_id!r}")

    monkeypatch.setattr(SessionTable, "claim_session", claim_session)
    return Supervisor(_config(tmp)).dispatcher


_EXPECTED = {ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_SESSION, ErrorCode.UNKNOWN_OP,
             "test_no_spawn"}
arg_values = json_values | hostile_text | st.sampled_from(["s1", "echo", "exec:cat", "/tmp"])


def test_run_op_argument_checks_fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _no_spawn(tmp_path, monkeypatch)

    @FUZZ
    @given(
        op=st.sampled_from(
            ["create_session", "prompt", "kill_session", "retry_session", "shutdown", "ping"]
        ) | names,
        args=st.dictionaries(
            st.sampled_from(["session", "agent", "cwd", "text", "stream", "stop_workers"]),
            arg_values, max_size=5,
        ),
    )
    @example(op="create_session", args={"session": "abc\n"})
    @example(op="create_session", args={"session": "s", "cwd": "/tmp\0x"})
    @example(op="prompt", args={"session": "s", "text": "t", "agent": "exec:cat\0"})
    def run(op: str, args: dict[str, Any]) -> None:
        async def main() -> Exception | None:
            stream = MessageStream(trio.testing.memory_stream_pair()[0])
            try:
                await ops.run_op(stream, Request(id=1, op=op, args=args))
            except Exception as exc:
                return exc
            return None

        exc = trio.run(main)
        assert exc is None or isinstance(exc, AgentdError), repr(exc)
        assert exc is None or exc.code in _EXPECTED, exc

    run()


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("create_session", {"session": "abc\n"}),
        ("create_session", {"session": "s", "cwd": "/tmp\0x"}),
        ("create_session", {"session": "s", "agent": "exec:cat\0"}),
        ("prompt", {"session": "s", "text": "t", "cwd": 5}),
        ("kill_session", {"session": ["s"]}),
    ],
)
async def test_run_op_refuses_hostile_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str, args: dict[str, Any]
) -> None:
    ops = _no_spawn(tmp_path, monkeypatch)
    stream = MessageStream(trio.testing.memory_stream_pair()[0])
    with pytest.raises(AgentdError) as info:
        await ops.run_op(stream, Request(id=1, op=op, args=args))
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert not (tmp_path / "home" / "sessions" / "abc\n").exists()


# --- the clients' readers -----------------------------------------------------------------------


def _sync_conn(frame: bytes) -> _syncconn._Conn:
    """A blocking-client connection whose peer sends ``frame`` and closes."""
    a, b = socket.socketpair()

    def write() -> None:
        with b, contextlib.suppress(OSError):  # the reader may stop early
            b.sendall(frame + b"\n")

    threading.Thread(target=write, daemon=True).start()
    return _syncconn._Conn(a)


@FUZZ
@given(st.binary(max_size=256).filter(lambda b: b"\n" not in b))
@example(b"[" * 100_000)
@example(b'{"a":' + b"[" * 900 + b"]" * 900 + b"}")
@example(b'{"id":' + b"9" * 5000 + b"}")
def test_sync_client_reads_any_frame_as_a_dict_or_agentd_error(frame: bytes) -> None:
    conn = _sync_conn(frame)
    with contextlib.closing(conn):
        msg, exc = _call(conn.read_message, 5)
    assert exc is None or isinstance(exc, AgentdError), repr(exc)
    assert exc is not None or isinstance(msg, dict)


@pytest.mark.parametrize("name", sorted(HOSTILE_FRAMES))
def test_sync_client_turns_hostile_frames_into_agentd_error_or_a_dict(name: str) -> None:
    conn = _sync_conn(HOSTILE_FRAMES[name])
    with contextlib.closing(conn):
        msg, exc = _call(conn.read_message, 5)
    assert exc is None or isinstance(exc, AgentdError), repr(exc)
    assert exc is not None or isinstance(msg, dict)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["type", "id", "ok", "result", "error", "event"]), json_values, max_size=6
    ).map(lambda d: {**d, "id": 1}),
    st.sampled_from(["response", "event"]),
)
@example({"id": 1, "ok": False, "error": "boom"}, "response")
@example({"id": 1, "ok": False, "error": {"code": "x", "details": [1, 2]}}, "response")
@example({"id": 1, "event": [1]}, "event")
def test_sync_client_answers_hostile_responses_with_a_result_or_agentd_error(
    obj: dict[str, Any], kind: str
) -> None:
    obj["type"] = kind
    events: list[dict[str, Any]] = []
    conn = _sync_conn(_dumps(obj))
    with contextlib.closing(conn):
        _, exc = _call(_syncconn._await_response, conn, 1, events.append)
    # a lone event, then the end of the stream: a lost connection (_Lost), retried
    assert exc is None or isinstance(exc, AgentdError | _syncconn._Lost), repr(exc)
    assert all(isinstance(e, dict) for e in events)


def _layout() -> Any:
    from trio_agentd._paths import Layout

    return Layout(home=Path("/nonexistent/home"), socket="/nonexistent/s.sock",
                  registry=Path("/nonexistent/reg"))


async def _hostile_peer(frame: bytes) -> tuple[MessageStream, MessageStream]:
    ours, theirs = trio.testing.memory_stream_pair()
    peer = MessageStream(theirs)
    await peer.send_raw(frame + b"\n")
    await theirs.send_eof()
    return MessageStream(ours), peer


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(HOSTILE_FRAMES))
async def test_async_client_fails_its_calls_with_the_peers_bad_frame(
    name: str, anyio_backend: str
) -> None:
    assert_on(anyio_backend)
    frame = HOSTILE_FRAMES[name]
    ours, theirs = await socket_stream_pair()
    hello = Hello(protocol=1, app_version="x", generation="g", pid=1, start_id=None, socket="/s")
    conn = _client._Connection(ClientStream(ours), hello)
    inbox: Inbox[Response | Event] = Inbox(1, native()[0])
    conn.pending[1] = inbox

    async def hostile_peer() -> None:
        async with theirs:
            await theirs.send(frame + b"\n")

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(hostile_peer)
        await conn.run_reader()  # returns: never raises out of the reader task
    assert conn.closed
    try:
        decode(frame)
    except AgentdError:
        assert conn.error is not None
        assert "bad frame" in conn.error.message
    while await inbox.get() is not None:
        pass  # the pending call's inbox was ended


@pytest.mark.parametrize("name", ["deep_arrays_in_args", "unknown_field", "id_escape", "garbage"])
async def test_worker_link_refuses_a_hostile_hello_with_agentd_error(name: str) -> None:
    ms, _peer = await _hostile_peer(HOSTILE_FRAMES[name])
    with pytest.raises(AgentdError) as info:
        await link_over_stream(
            ms.stream, token="t", generation="g", pid=1, start_id=None, socket="/s"
        )
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE


async def test_worker_link_accepts_a_valid_hello() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    peer = MessageStream(theirs)
    await peer.send(WorkerHello(session="s", pid=2, start_id=None))
    with trio.move_on_after(0.2):  # the peer never confirms auth: the caller bounds the wait
        await link_over_stream(ours, token="t", generation="g", pid=1, start_id=None, socket="/s")
    assert isinstance(await peer.receive(), Auth)


# --- terminal output ----------------------------------------------------------------------------


@given(hostile_text)
def test_printable_leaves_no_control_character(text: str) -> None:
    shown = printable(text)
    assert not any(ord(c) in CONTROL_CODEPOINTS for c in shown)
    if not any(ord(c) in CONTROL_CODEPOINTS for c in text):
        assert shown == text


def test_printable_escapes_visibly() -> None:
    assert printable('exec:printf "\x1b]0;pwned\x07"') == 'exec:printf "\\x1b]0;pwned\\x07"'
    assert printable("a\u202eb\u2066c\x9bd\x7f\n") == "a\\u202eb\\u2066c\\x9bd\\x7f\\x0a"
    assert printable("café ✓") == "café ✓"


def test_text_module_is_cheap_to_import() -> None:
    import subprocess

    code = (
        "import sys, trio_agentd; before = set(sys.modules); import trio_agentd._text;"
        " print(sorted(set(sys.modules) - before - {'trio_agentd._text'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # no trio, no msgspec, not even re


HOSTILE_AGENT = 'exec:printf "\x1b]0;pwned\x07\u202e"'


def test_sessions_table_escapes_every_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_agentd import _cli_sessions

    rows = [{"session": "s1", "agent": HOSTILE_AGENT, "state": "ready\x1b[2J", "pid": 12,
             "restarts": "0\x07", "turns": 1, "idle_s": 3.0}]

    class _Fake:
        def request(self, op: str) -> Any:
            return rows

        def close(self) -> None:
            pass

    monkeypatch.setattr(_cli_sessions, "new_client", lambda layout: _Fake())
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert _cli_sessions.cmd_sessions(_layout(), _args(json=False)) == 0
    text = out.getvalue()
    assert not any(ord(c) in CONTROL_CODEPOINTS for c in text.replace("\n", ""))
    assert "\\x1b]0;pwned\\x07\\u202e" in text
    out.truncate(0)
    out.seek(0)
    assert _cli_sessions.cmd_sessions(_layout(), _args(json=True)) == 0
    assert json.loads(out.getvalue()) == rows  # JSON stays raw


def _args(*, json: bool) -> argparse.Namespace:
    return argparse.Namespace(json=json)


def test_ps_table_escapes_every_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_agentd._doctor import Found
    from trio_agentd._doctor_plan import Hello as SeenHello
    from trio_agentd._doctor_plan import Observation, Status, Verdict
    from trio_agentd._report import print_table

    sock = "/run/x\x1b]0;pwned\x07.sock"
    hello = SeenHello(generation="g", pid=5, start_id=None, protocol=1, app_version="0.1\u202e")
    found = [Found(
        socket=sock, verdict=Verdict(status=Status.ORPHAN_FILE, cause="x\x1b[2J"),
        observation=Observation(socket=sock, socket_file=True, accepts=True, hello=hello),
        record=None, home_proven=False,
    )]
    out = io.StringIO()
    print_table(found, out=out)
    text = out.getvalue()
    assert not any(ord(c) in CONTROL_CODEPOINTS for c in text.replace("\n", "")), text
    assert "\\x1b]0;pwned\\x07" in text


@pytest.mark.anyio
async def test_async_client_request_fails_with_the_bad_frame_not_a_retry(
    anyio_backend: str,
) -> None:
    from trio_agentd.timing import DEFAULT_TIMING

    assert_on(anyio_backend)
    ours, theirs = await socket_stream_pair()
    hello = Hello(protocol=1, app_version="x", generation="g", pid=1, start_id=None, socket="/s")
    conn = _client._Connection(ClientStream(ours), hello)
    peer = ClientStream(theirs)

    async def answer_with_a_deep_frame() -> None:
        async with theirs:
            await peer.receive_line()
            await theirs.send(HOSTILE_FRAMES["deep_arrays_in_args"] + b"\n")

    async with anyio.create_task_group() as tasks:
        client = _client.Client(tasks, _layout(), DEFAULT_TIMING, autostart=False)
        client._conn = conn
        tasks.start_soon(conn.run_reader)
        tasks.start_soon(answer_with_a_deep_frame)
        with pytest.raises(AgentdError, match="bad frame: invalid message: nested deeper"):
            await client._exchange_once(1, "ping", {}, None)
