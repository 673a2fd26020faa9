"""The CLI's answer moved from the worker's socket to stdout with ``splice``: every byte exactly
once and in order, whatever stdout is (a pipe, a file, ``/dev/null``, a file opened to append),
a resend's repeat skipped, and a stdout nobody reads stopping the socket's reader."""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_agentd import _cli_io
from trio_agentd._cli_io import Answer, Splice
from trio_agentd._output import RAW_CHUNK_MAX, raw_request
from trio_agentd._protocol import Event, encode
from trio_agentd._syncclient import Output
from trio_agentd._syncconn import _Conn

DATA = random.Random(11).randbytes(20_000_000 + 4321)  # binary, past any buffer
DEADLINE = 30.0  # bound on a thread's join


def _frames(data: bytes, start: int = 0) -> Iterator[bytes]:
    """``data`` as raw chunk events (frame, then bytes), offsets from ``start``."""
    for at in range(0, len(data), RAW_CHUNK_MAX):
        piece = data[at : at + RAW_CHUNK_MAX]
        yield encode(Event(id=1, event={"kind": "chunk", "at": start + at}, raw=len(piece)))
        yield piece


_opened: list[Splice] = []


@pytest.fixture(autouse=True)
def _close_splices() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def _answer_to(fd: int) -> Answer:
    """An :class:`Answer` whose stdout is ``fd``."""
    answer = Answer()
    answer.buffer = None
    answer._splice_checked = True
    answer._splice = Splice.open(fd)
    if answer._splice is not None:
        _opened.append(answer._splice)
    return answer


def _receive(conn: _Conn, output: Output, count: int) -> list[dict[str, object]]:
    """Read ``count`` events into ``output``; the events as they came (spliced: no data)."""
    events = []
    for _ in range(count):
        msg = conn.read_message(10.0)
        assert msg is not None
        event = msg["event"]
        events.append(event)
        output.on_event(event)
    return events


def _send_in_thread(sock: socket.socket, parts: list[bytes]) -> threading.Thread:
    def send() -> None:
        for part in parts:
            sock.sendall(part)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _stream_to(fd: int, data: bytes) -> tuple[Output, list[dict[str, object]]]:
    """``data`` sent as raw chunk events over a socketpair and read by a client whose stdout
    is ``fd`` (spliced where it can be)."""
    answer = _answer_to(fd)
    written: list[bytes] = []
    output = Output(written.append, splice=answer.splice_from)
    a, b = socket.socketpair()
    try:
        conn = _Conn(a)
        conn.payload_sink = output.take_payload
        parts = list(_frames(data))
        sender = _send_in_thread(b, parts)
        events = _receive(conn, output, len(parts) // 2)
        sender.join(DEADLINE)
    finally:
        a.close()
        b.close()
    # what did not go by splice went through the sink: write it to fd as the CLI would
    for piece in written:
        os.write(fd, piece)
    return output, events


def test_a_stream_to_a_file_is_spliced_and_byte_exact(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        output, events = _stream_to(fd, DATA)
    finally:
        os.close(fd)
    assert path.read_bytes() == DATA
    assert output.size == len(DATA)
    assert all("data" not in e for e in events)  # every payload went past Python


def test_a_stream_to_a_pipe_is_spliced_straight_into_it_and_byte_exact() -> None:
    r, w = os.pipe()
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 1 << 20):
            got.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        output, events = _stream_to(w, DATA)
    finally:
        os.close(w)
        reader.join(DEADLINE)
        os.close(r)
    assert bytes(got) == DATA
    assert output.size == len(DATA)
    assert all("data" not in e for e in events)


def test_a_stream_to_dev_null_is_spliced_and_counted() -> None:
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        output, events = _stream_to(fd, DATA)
    finally:
        os.close(fd)
    assert output.size == len(DATA)
    assert all("data" not in e for e in events)


def test_a_file_opened_to_append_is_written_the_plain_way_and_byte_exact(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    path.write_bytes(b"before")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        assert Splice.open(fd) is None  # splice refuses O_APPEND: not even tried
        output, events = _stream_to(fd, DATA)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"before" + DATA
    assert output.size == len(DATA)
    assert all("data" in e for e in events)


def test_without_splice_the_bytes_are_read_and_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "splice")
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _output, events = _stream_to(fd, DATA)
    finally:
        os.close(fd)
    assert path.read_bytes() == DATA
    assert all("data" in e for e in events)


def test_an_output_that_refuses_splice_gets_the_bytes_already_in_our_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    real = _cli_io._splice_out

    def refuse(pipe: int, out: int, count: int) -> int:
        if out == fd:
            raise OSError(22, "Invalid argument")  # a file system without splice_write
        return real(pipe, out, count)

    monkeypatch.setattr(_cli_io, "_splice_out", refuse)
    try:
        output, _events = _stream_to(fd, DATA)
    finally:
        os.close(fd)
    assert path.read_bytes() == DATA
    assert output.size == len(DATA)


def test_a_resends_repeat_is_skipped_and_only_the_new_bytes_are_spliced(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    first, total = 3 * RAW_CHUNK_MAX + 100, 6 * RAW_CHUNK_MAX
    data = DATA[:total]
    answer = _answer_to(fd)
    output = Output(lambda piece: os.write(fd, piece), splice=answer.splice_from)
    a, b = socket.socketpair()
    try:
        conn = _Conn(a)
        conn.payload_sink = output.take_payload
        # the first connection got ``first`` bytes; the resend sends everything from 0
        parts = list(_frames(data[:first])) + list(_frames(data))
        sender = _send_in_thread(b, parts)
        events = _receive(conn, output, len(parts) // 2)
        sender.join(DEADLINE)
    finally:
        a.close()
        b.close()
        os.close(fd)
    assert path.read_bytes() == data
    # a chunk that repeats bytes already written is read (and cut), never spliced
    repeated = [e for e in events[4:] if isinstance(e["at"], int) and e["at"] < first]
    assert repeated
    assert all("data" in e for e in repeated)


def test_a_stdout_nobody_reads_stops_the_client_reading_the_socket() -> None:
    r, w = os.pipe()
    answer = _answer_to(w)
    output = Output(lambda _piece: None, splice=answer.splice_from)
    a, b = socket.socketpair()
    received: list[int] = []

    def client() -> None:
        conn = _Conn(a)
        conn.payload_sink = output.take_payload
        for _ in range(len(parts) // 2):
            msg = conn.read_message(None)
            assert msg is not None
            received.append(msg["event"]["at"])

    parts = list(_frames(DATA))
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        b.setblocking(False)
        view = memoryview(b"".join(parts))
        sent = 0
        # stdout not read: the client stops, the socket fills, the sender cannot go on
        import select

        while sent < len(view):
            _, writable, _ = select.select([], [b], [], 1.0)
            if not writable:
                break
            try:
                sent += b.send(view[sent:])
            except BlockingIOError:
                continue
        assert sent < len(view) // 2, sent
        # then the reader reads: everything arrives, exactly
        got = bytearray()
        b.setblocking(True)
        sender = _send_in_thread(b, [bytes(view[sent:])])
        while len(got) < len(DATA):
            got.extend(os.read(r, 1 << 20))
        sender.join(DEADLINE)
        thread.join(DEADLINE)
    finally:
        a.close()
        b.close()
        os.close(r)
        os.close(w)
    assert bytes(got) == DATA
    assert output.size == len(DATA)


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (True, (True, RAW_CHUNK_MAX)),
        (1 << 20, (True, 1 << 20)),
        (1 << 30, (True, 1 << 20)),  # never more than a take
        (1000, (True, RAW_CHUNK_MAX)),  # never less than a chunk
        (False, (False, RAW_CHUNK_MAX)),
        (None, (False, RAW_CHUNK_MAX)),
        (0, (False, RAW_CHUNK_MAX)),
        (-5, (False, RAW_CHUNK_MAX)),
        ("yes", (False, RAW_CHUNK_MAX)),
        (1.5e6, (False, RAW_CHUNK_MAX)),
    ],
)
def test_the_raw_argument_asks_for_raw_chunks_of_a_bounded_size(
    arg: object, expected: tuple[bool, int]
) -> None:
    assert raw_request(arg) == expected
