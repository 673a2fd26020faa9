"""Output taken from an agent's pipe and sent from its file: the zero-copy path (``splice``,
``sendfile``) and the portable one give the same bytes, offsets and frames."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd import _output, _stream
from trio_agentd._output import INLINE_MAX, RAW_CHUNK_MAX, STDERR, TAKE_MAX, TurnOutput
from trio_agentd._protocol import Event, encode
from trio_agentd._stream import MessageStream
from trio_agentd._syncconn import _Conn
from trio_agentd.agents import ExecAgent, ExitStatus, ShellAgent, Stderr, TurnContext, Waiting

DEADLINE = 20.0  # outer bound of the test that runs a shell
DATA = random.Random(7).randbytes(3 * TAKE_MAX + 12345)


@pytest.fixture(params=[True, False], ids=["zero-copy", "portable"])
def zero_copy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and not _output.ZERO_COPY:
        pytest.fail("this system has no os.splice/os.sendfile: the zero-copy path is untested")
    monkeypatch.setattr(_output, "ZERO_COPY", request.param)
    return bool(request.param)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def _available(fd: int) -> int:
    import fcntl
    import termios

    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")


def _take_all(out: TurnOutput, r: int, w: int, data: bytes) -> list[tuple[int, bool]]:
    """Feed ``data`` through the pipe in pieces the pipe holds; what each take returned."""
    taken: list[tuple[int, bool]] = []
    view = memoryview(data)
    while view:
        view = view[os.write(w, view[:65536]) :]
        while (size := _available(r)) > 0:
            count, got = out.take(r, size)
            taken.append((count, got is not None))
            if got is not None:
                assert len(got) == count
    return taken


def test_take_keeps_every_byte_in_order_and_spills_past_the_inline_size(
    tmp_path: Path, pipe: tuple[int, int], zero_copy: bool
) -> None:
    out = TurnOutput(tmp_path / "1.out")
    try:
        taken = _take_all(out, *pipe, DATA)
        assert out.size == len(DATA)
        assert sum(count for count, _ in taken) == len(DATA)
        assert out.file_fd is not None
        assert b"".join(piece for _, piece in out.read()) == DATA
        assert (tmp_path / "1.out").read_bytes() == DATA
        assert out.result_fields() == {"output": str(tmp_path / "1.out"), "bytes": len(DATA)}
        if zero_copy:
            # in memory, bytes are read; once in the file they never come through Python
            first_spliced = next(i for i, (_, copied) in enumerate(taken) if not copied)
            assert sum(c for c, _ in taken[:first_spliced]) > INLINE_MAX
            assert not any(copied for _, copied in taken[first_spliced:])
        else:
            assert all(copied for _, copied in taken)
    finally:
        out.close()


def test_take_of_a_small_output_keeps_it_in_memory_either_way(
    tmp_path: Path, pipe: tuple[int, int], zero_copy: bool
) -> None:
    out = TurnOutput(tmp_path / "1.out")
    assert _take_all(out, *pipe, b"hello\n") == [(6, True)]
    assert out.file_fd is None
    assert out.result_fields() == {"reply": "hello\n", "bytes": 6}
    assert not (tmp_path / "1.out").exists()


def test_take_from_an_empty_pipe_takes_nothing(
    tmp_path: Path, pipe: tuple[int, int], zero_copy: bool
) -> None:
    out = TurnOutput(tmp_path / "1.out")
    try:
        _take_all(out, *pipe, DATA[: INLINE_MAX + 1])  # spilled
        assert out.take(pipe[0], 100)[0] == 0
        assert out.size == INLINE_MAX + 1
    finally:
        out.close()


def test_take_into_a_full_disk_raises_the_os_error_and_keeps_the_size(
    tmp_path: Path, pipe: tuple[int, int], zero_copy: bool
) -> None:
    import resource

    out = TurnOutput(tmp_path / "1.out")
    r, w = pipe
    try:
        _take_all(out, r, w, DATA[: INLINE_MAX + 1])
        os.write(w, b"x" * 1000)
        # the file may grow no further (EFBIG, as ENOSPC or EDQUOT would be), briefly
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (out.size, limits[1]))
        try:
            with pytest.raises(OSError, match="File too large"):
                out.take(r, 1000)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        assert out.size == INLINE_MAX + 1
    finally:
        out.close()


async def _send_and_receive(
    sender: trio.abc.Stream, receiver: trio.abc.Stream, fd: int, at: int, count: int
) -> Event:
    tx, rx = MessageStream(sender), MessageStream(receiver)
    got: list[object] = []

    async def receive() -> None:
        got.append(await rx.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await tx.send_event_file(3, {"kind": "chunk", "at": at}, fd, at, count)
    [msg] = got
    assert isinstance(msg, Event)
    return msg


@pytest.mark.parametrize(
    ("at", "count"), [(0, RAW_CHUNK_MAX), (INLINE_MAX + 7, 1), (5, RAW_CHUNK_MAX - 5)]
)
async def test_send_event_file_over_a_socket_carries_the_file_bytes_raw(
    tmp_path: Path, zero_copy: bool, at: int, count: int
) -> None:
    path = tmp_path / "1.out"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    a, b = trio.socket.socketpair()
    try:
        msg = await _send_and_receive(trio.SocketStream(a), trio.SocketStream(b), fd, at, count)
    finally:
        os.close(fd)
        a.close()
        b.close()
    assert msg.id == 3
    assert msg.event == {"kind": "chunk", "at": at, "data": DATA[at : at + count]}


async def test_send_event_file_over_a_stream_that_is_no_socket_reads_the_file(
    tmp_path: Path, zero_copy: bool
) -> None:
    path = tmp_path / "1.out"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    a, b = trio.testing.memory_stream_pair()
    try:
        msg = await _send_and_receive(a, b, fd, 10, RAW_CHUNK_MAX)
    finally:
        os.close(fd)
    assert msg.event["data"] == DATA[10 : 10 + RAW_CHUNK_MAX]


async def test_send_event_file_of_a_cut_file_fails_with_an_os_error(
    tmp_path: Path, zero_copy: bool
) -> None:
    path = tmp_path / "1.out"
    path.write_bytes(DATA[:1000])
    fd = os.open(path, os.O_RDONLY)
    a, b = trio.socket.socketpair()
    try:
        with pytest.raises(OSError, match="ended early"):
            await MessageStream(trio.SocketStream(a)).send_event_file(
                3, {"kind": "chunk", "at": 0}, fd, 0, 2000)
    finally:
        os.close(fd)
        a.close()
        b.close()


SCRIPT = "cat r.bin; echo oops >&2; printf tail"


@pytest.mark.parametrize("kind", ["shell", "exec"])
async def test_a_turn_offers_its_pipes_and_the_host_takes_every_byte_apart(
    tmp_path: Path, zero_copy: bool, kind: str
) -> None:
    (tmp_path / "r.bin").write_bytes(DATA)
    agent: ShellAgent | ExecAgent = (
        ShellAgent() if kind == "shell" else ExecAgent(["/bin/sh", "-c", SCRIPT]))
    ctx = TurnContext(session_id="s1", turn=1, cwd=tmp_path, session_dir=tmp_path, pipes=True)
    outs = {False: TurnOutput(tmp_path / "1.out"), True: TurnOutput(tmp_path / "1.err", STDERR)}
    statuses: list[int] = []
    offered = 0
    try:
        with trio.fail_after(DEADLINE):
            chunks = agent.turn(SCRIPT, ctx)
            assert isinstance(chunks, AsyncGenerator)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if isinstance(chunk, Waiting):
                        offered += 1
                        outs[chunk.stderr].take(chunk.fd, chunk.size)
                    elif isinstance(chunk, ExitStatus):
                        statuses.append(chunk.code)
                    elif isinstance(chunk, Stderr):
                        data = chunk.data
                        outs[True].add(data.encode() if isinstance(data, str) else data)
                    else:
                        outs[False].add(chunk.encode() if isinstance(chunk, str) else chunk)
    finally:
        if isinstance(agent, ShellAgent):
            await agent.aclose()
        for out in outs.values():
            out.close()
    assert offered > 0
    assert statuses == [0]
    assert (tmp_path / "1.out").read_bytes() == DATA + b"tail"
    assert outs[True].result_fields() == {"stderr": "oops\n", "stderr_bytes": 5}


class _CountingSocket:
    """A socket end that records how many bytes each ``recv`` and ``recv_into`` took."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.recvs: list[int] = []
        self.recv_intos: list[int] = []

        self.after_recv: list[bytes] = []  # sent to this end (by ``peer``) after each recv
        self.peer: socket.socket | None = None

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.sock.gettimeout()

    def recv(self, size: int, flags: int = 0) -> bytes:
        data = self.sock.recv(size, flags)
        if not flags & socket.MSG_PEEK:
            self.recvs.append(len(data))
            if self.after_recv and self.peer is not None:
                self.peer.sendall(self.after_recv.pop(0))
        return data

    def recv_into(self, buf: memoryview) -> int:
        n = self.sock.recv_into(buf)
        self.recv_intos.append(n)
        return n


def test_the_blocking_client_reads_a_raw_payload_past_its_frame_buffer() -> None:
    size = 100_000  # all of it fits in the socket at once, with the next frame after it
    header = encode(Event(id=1, event={"kind": "chunk", "at": 0}, raw=size))
    a, b = socket.socketpair()
    try:
        b.sendall(header + DATA[:size] + header)
        counted = _CountingSocket(a)
        conn = _Conn(counted)  # type: ignore[arg-type]
        first = conn.read_message(5.0)
        b.sendall(DATA[:size])
        second = conn.read_message(5.0)
    finally:
        a.close()
        b.close()
    assert first is not None
    assert second is not None
    assert first["event"]["data"] == DATA[:size]
    assert second["event"]["data"] == DATA[:size]
    # each line read alone; each payload, all there, read in one go into its own bytes,
    # never through the frame buffer
    assert counted.recvs == [len(header), size, len(header), size]
    assert counted.recv_intos == []


def test_the_blocking_client_reads_a_payload_that_comes_in_pieces_into_a_buffer_of_its_own(
) -> None:
    size = 100_000
    header = encode(Event(id=1, event={"kind": "chunk", "at": 0}, raw=size))
    a, b = socket.socketpair()
    try:
        b.sendall(header + DATA[:1000])
        counted = _CountingSocket(a)
        counted.peer = b
        counted.after_recv = [b"", DATA[1000:size] + header]  # the rest after the first piece
        conn = _Conn(counted)  # type: ignore[arg-type]
        msg = conn.read_message(5.0)
        assert conn.buf == b""
        b.sendall(DATA[:size])
        again = conn.read_message(5.0)
    finally:
        a.close()
        b.close()
    assert msg is not None
    assert again is not None
    assert msg["event"]["data"] == DATA[:size]
    assert again["event"]["data"] == DATA[:size]
    assert counted.recvs == [len(header), 1000, len(header), size]
    assert sum(counted.recv_intos) == size - 1000


async def test_send_event_file_on_a_socket_closed_under_it_is_a_closed_resource_not_a_disk_error(
    tmp_path: Path, zero_copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "1.out"
    path.write_bytes(DATA[:1000])
    fd = os.open(path, os.O_RDONLY)
    a, b = trio.socket.socketpair()
    stream = trio.SocketStream(a)
    send_header = stream.send_all
    write_header = _stream._write

    async def send_then_close(data: bytes | bytearray | memoryview) -> None:
        await send_header(data)
        a.close()  # as another task's drop of the connection does, between header and bytes

    async def write_then_close(sock: trio.socket.SocketType, data: bytes) -> None:
        await write_header(sock, data)
        a.close()

    stream.send_all = send_then_close  # type: ignore[method-assign]
    monkeypatch.setattr(_stream, "_write", write_then_close)  # the zero-copy path's header
    try:
        with pytest.raises(trio.ClosedResourceError):
            await MessageStream(stream).send_event_file(3, {"kind": "chunk", "at": 0}, fd, 0, 1000)
    finally:
        os.close(fd)
        b.close()


async def test_a_run_of_file_events_arrives_whole_and_in_order_with_room_made_for_it(
    tmp_path: Path, zero_copy: bool
) -> None:
    path = tmp_path / "1.out"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    a, b = trio.socket.socketpair()
    default = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    spans = [(0, RAW_CHUNK_MAX), (RAW_CHUNK_MAX, RAW_CHUNK_MAX), (2 * RAW_CHUNK_MAX, 17)]
    got: list[object] = []
    try:
        tx, rx = MessageStream(trio.SocketStream(a)), MessageStream(trio.SocketStream(b))

        async def receive() -> None:
            for _ in spans:
                got.append(await rx.receive())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await tx.send_events_file(
                3, [({"kind": "chunk", "at": at}, at, n) for at, n in spans], fd)
        widened = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    finally:
        os.close(fd)
        a.close()
        b.close()
    assert [m.event for m in got if isinstance(m, Event)] == [
        {"kind": "chunk", "at": at, "data": DATA[at : at + n]} for at, n in spans]
    if zero_copy:  # a streaming socket holds more than one chunk in flight
        assert widened > default
        assert widened >= min(_stream.SEND_BUFFER, RAW_CHUNK_MAX * 4)


def test_an_output_named_by_a_str_spills_to_that_file(tmp_path: Path) -> None:
    # (the worker's turns name their files with a str: no Path per turn)
    out = TurnOutput(str(tmp_path / "1.out"))
    try:
        data = b"x" * (INLINE_MAX + 1)
        out.add(data)
        assert (tmp_path / "1.out").read_bytes() == data
        assert b"".join(piece for _, piece in out.read()) == data
        assert out.result_fields() == {"output": str(tmp_path / "1.out"), "bytes": len(data)}
    finally:
        out.close()
