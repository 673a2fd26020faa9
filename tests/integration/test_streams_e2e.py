"""A turn's output end to end: big, binary, resent, paused and flooded (real processes).

Every byte an agent writes must reach the client exactly once and unchanged, however big;
records stay small (big output lives in its own file); a reader that stops reading stops the
agent instead of growing anyone's memory.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import random
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import trio

import trio_agentd

from .harness import DaemonEnv, wait_for

MiB = 1 << 20


# --- helpers ---------------------------------------------------------------------------------


def cli(denv: DaemonEnv, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    """The CLI as a user runs it, stdout captured as bytes."""
    return subprocess.run(
        [sys.executable, "-m", "trio_agentd", *args], env=denv.env, capture_output=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )


def shell_prompt(denv: DaemonEnv, session: str, script: str) -> bytes:
    cp = cli(denv, "-p", "-s", session, "--agent", "shell", "--", script)
    assert cp.returncode == 0, (cp.returncode, cp.stderr[-2000:])
    assert cp.stderr == b""
    return cp.stdout


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def worker_pid(denv: DaemonEnv, session: str) -> int:
    pids = [int(d["pid"]) for d in denv.descriptors() if d.get("session") == session]
    assert len(pids) == 1, denv.descriptors()
    return pids[0]


def unsent_bytes(sock: socket.socket) -> int:
    """Bytes written to ``sock`` that its peer has not read yet (SIOCOUTQ)."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int(struct.unpack("i", buf)[0])


class Raw:
    """The wire protocol by hand on the supervisor's socket: frames in, frames out."""

    def __init__(self, path: str, timeout: float = 30) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        hello = self.read()
        assert hello["type"] == "hello", hello

    def send(self, frame: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(frame, separators=(",", ":")).encode() + b"\n")

    def read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            data = self.sock.recv(1 << 20)
            assert data, "the supervisor closed the connection"
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        assert len(line) <= 1 << 20, len(line)  # the frame limit
        return dict(json.loads(line))

    def close(self) -> None:
        self.sock.close()


def collect(conn: Raw, rid: int) -> tuple[bytes, dict[str, Any], int]:
    """Read request ``rid``'s chunk events and response: the output as the chunks' offsets
    place it (each byte exactly once, no gap), the response, and the number of chunks."""
    out = bytearray()
    chunks = 0
    while True:
        msg = conn.read()
        assert msg.get("id") == rid, msg
        if msg["type"] == "response":
            return bytes(out), msg, chunks
        assert msg["type"] == "event", msg
        event = msg["event"]
        assert event["kind"] == "chunk", event
        data = base64.b64decode(event["data"], validate=True)
        assert 0 < len(data) <= 256 * 1024
        at = event["at"]
        assert at == len(out), f"chunk at {at} after {len(out)} bytes: a gap or a repeat"
        out += data
        chunks += 1


@contextlib.contextmanager
def raw(path: str, timeout: float = 30) -> Iterator[Raw]:
    conn = Raw(path, timeout)
    try:
        yield conn
    finally:
        conn.close()


def write_random(path: Path, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


# --- 1-3: the CLI writes the agent's bytes exactly; records stay small ------------------------


def test_cli_output_over_1mib_is_exact(denv: DaemonEnv) -> None:
    expected = "".join(f"{i}\n" for i in range(1, 300001)).encode()
    assert len(expected) > MiB
    out = shell_prompt(denv, "big", "seq 1 300000")
    assert len(out) == len(expected)
    assert out == expected


def test_cli_20mb_random_is_byte_exact_and_records_stay_small(denv: DaemonEnv) -> None:
    src = denv.root / "random.bin"
    expected = write_random(src, 20_000_000, seed=20240601)
    out = shell_prompt(denv, "rnd", f"cat '{src}'")
    assert len(out) == len(expected)
    assert out == expected

    # the records point to the output; none of their lines carries it
    journals = list((denv.home / "daemons").glob("*/journal/rnd.jsonl"))
    assert len(journals) == 1, journals
    transcript = denv.home / "sessions" / "rnd" / "transcript.jsonl"
    for path in (journals[0], transcript):
        lines = path.read_bytes().splitlines()
        assert lines, path
        longest = max(len(line) for line in lines)
        assert longest < 64 * 1024, (path, longest)
    turns = [json.loads(line) for line in transcript.read_bytes().splitlines()]
    turns = [t for t in turns if t.get("kind") == "turn"]
    assert len(turns) == 1, turns
    assert "reply" not in turns[0]
    assert turns[0]["bytes"] == 20_000_000
    output = Path(turns[0]["output"])
    assert output == denv.home / "sessions" / "rnd" / "output" / "1.out"
    assert output.stat().st_size == 20_000_000
    assert output.read_bytes() == expected
    journal_text = journals[0].read_bytes()
    assert str(output).encode() in journal_text
    assert b'"bytes":20000000' in journal_text


def test_cli_every_byte_value_is_exact(denv: DaemonEnv) -> None:
    src = denv.root / "all-bytes.bin"
    expected = bytes(range(256)) * 1000
    src.write_bytes(expected)
    assert shell_prompt(denv, "bin", f"cat '{src}'") == expected
    # small, but not UTF-8: it goes to a file, not into the records as text
    transcript = denv.home / "sessions" / "bin" / "transcript.jsonl"
    turn = [t for t in map(json.loads, transcript.read_bytes().splitlines())
            if t["kind"] == "turn"][-1]
    assert "reply" not in turn
    assert turn["bytes"] == len(expected)
    assert Path(turn["output"]).read_bytes() == expected


# --- 4: a resend of a completed command gets its whole answer, without running it again ------


def test_resend_of_a_completed_big_command_gets_it_all_and_does_not_run_again(
    denv: DaemonEnv,
) -> None:
    denv.prompt("start the daemon")
    src = denv.root / "big.bin"
    expected = write_random(src, 3 * MiB + 12345, seed=4)
    counter = denv.root / "runs.txt"
    request: dict[str, Any] = {
        "type": "request", "id": 1, "client_id": "c1", "op": "prompt",
        "args": {"session": "big", "agent": "shell",
                 "text": f"echo run >> '{counter}'; cat '{src}'"},
    }
    with raw(denv.socket) as conn:
        conn.send(request)
        first, response, chunks = collect(conn, 1)
    assert response["ok"], response
    assert first == expected
    assert chunks >= len(expected) // (256 * 1024)
    assert response["result"]["bytes"] == len(expected)
    assert "reply" not in response["result"]
    assert counter.read_text() == "run\n"

    for stream in (True, False):  # streamed or not, an answer too big to come whole comes
        with raw(denv.socket) as conn:
            conn.send({**request, "args": {**request["args"], "stream": stream}})
            again, response2, _ = collect(conn, 1)
        assert response2 == response
        assert again == expected
    assert counter.read_text() == "run\n"  # ran once


# --- 5: a paused reader loses nothing; nobody's memory grows ----------------------------------


async def test_paused_stream_reader_blocks_the_agent_and_memory_stays_flat(
    denv: DaemonEnv,
) -> None:
    total = 50_000_000
    denv.prompt("start the daemon")
    sup = int(denv.owner()["pid"])
    with trio.fail_after(50):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry), autostart=False
        ) as client:
            # an async generator (annotated as an iterator): closed when we are done with it
            agen = cast(AsyncGenerator[bytes, None], client.stream_prompt_bytes(
                "flood", f"head -c {total} /dev/zero", agent="shell"))
            async with contextlib.aclosing(agen):
                first = await agen.__anext__()
                got = len(first)
                assert first == b"\0" * got
                worker = worker_pid(denv, "flood")
                heads = [p for p in psutil.Process(worker).children(recursive=True)
                         if p.name() == "head"]
                assert len(heads) == 1, heads
                out_file = denv.home / "sessions" / "flood" / "output" / "1.out"
                before = (rss_kib(sup), rss_kib(worker))
                await trio.sleep(1.5)  # the pause itself (nothing to wait for: we stall)
                mid_size = out_file.stat().st_size
                await trio.sleep(1.5)
                during = (rss_kib(sup), rss_kib(worker))
                end_size = out_file.stat().st_size
                # the agent is stuck on its full pipe: alive, and nothing more comes out
                assert heads[0].is_running()
                assert heads[0].status() != psutil.STATUS_ZOMBIE
                assert end_size == mid_size, (mid_size, end_size)
                assert end_size < total // 2, end_size
                growth = [(b - a) // 1024 for a, b in zip(before, during, strict=True)]
                assert all(g < 20 for g in growth), f"RSS growth MiB (sup, worker): {growth}"
                zeros = True
                async for piece in agen:
                    got += len(piece)
                    zeros = zeros and not piece.strip(b"\0")
            assert got == total
            assert zeros
    wait_for(lambda: not heads[0].is_running() or heads[0].status() == psutil.STATUS_ZOMBIE,
             timeout=10, what="head to exit")


# --- 6: a client that sends and never reads cannot grow the supervisor ------------------------


def flood_pings(conn: Raw, n: int) -> tuple[int, bool]:
    """Send ``n`` pings on ``conn`` without reading: the complete requests that went into the
    socket, and whether the supervisor stopped taking them (not writable for 2 s: backpressure,
    which is fine — the point is that nothing grows without bound)."""
    payload = b"".join(
        json.dumps({"type": "request", "id": i, "client_id": "flood", "op": "ping"},
                   separators=(",", ":")).encode() + b"\n"
        for i in range(1, n + 1)
    )
    conn.sock.setblocking(False)
    sent = 0
    stalled = False
    deadline = time.monotonic() + 30
    while sent < len(payload):
        assert time.monotonic() < deadline, f"neither stalled nor done within 30 s ({sent} B)"
        try:
            sent += conn.sock.send(payload[sent:])
        except BlockingIOError:
            _, writable, _ = select.select([], [conn.sock], [], 2)
            if not writable:
                stalled = True
                break
    return payload[:sent].count(b"\n"), stalled


def test_pipelined_flood_without_reading_keeps_memory_bounded_and_others_served(
    denv: DaemonEnv,
) -> None:
    denv.prompt("start the daemon")
    sup = int(denv.owner()["pid"])
    with raw(denv.socket) as flood:
        whole, stalled = flood_pings(flood, 5000)
        if not stalled:
            wait_for(lambda: unsent_bytes(flood.sock) == 0, timeout=20,
                     what="the supervisor to read every request")
        samples = [rss_kib(sup)]
        # others are served while the flood sits unread
        assert denv.prompt("still here", session="other") == "[echo turn 1] still here"
        samples.append(rss_kib(sup))
        assert max(samples) < 60 * 1024, f"supervisor RSS KiB: {samples}"
        # and the flood's answers all come once it reads
        flood.sock.setblocking(True)
        flood.sock.settimeout(30)
        ids = set()
        for _ in range(whole):
            msg = flood.read()
            assert msg["type"] == "response", msg
            assert msg["ok"], msg
            ids.add(msg["id"])
        assert ids == set(range(1, whole + 1))


def test_flood_of_30000_unread_pings_meets_backpressure_or_stays_small(denv: DaemonEnv) -> None:
    """A client that only sends must not make the supervisor hold an answer task per request
    without bound: it should stop reading (the client's sends then block) long before."""
    denv.prompt("start the daemon")
    sup = int(denv.owner()["pid"])
    start = rss_kib(sup)
    with raw(denv.socket) as flood:
        requests, stalled = flood_pings(flood, 30_000)
        if not stalled:
            wait_for(lambda: unsent_bytes(flood.sock) == 0, timeout=20,
                     what="the supervisor to read every request")
        assert denv.prompt("still here", session="other") == "[echo turn 1] still here"
        growth = (rss_kib(sup) - start) // 1024
        assert growth < 30, (
            f"supervisor grew {growth} MiB holding the answers to {requests} requests nobody"
            f" reads (stalled: {stalled})")


# --- 7: the Trio client is binary-safe -------------------------------------------------------


BINARY = r"printf '\000\377\200abc'"  # octal: /bin/sh may be dash, whose printf has no \x


async def test_trio_client_prompt_bytes_is_binary_safe(denv: DaemonEnv) -> None:
    denv.prompt("start the daemon")
    with trio.fail_after(30):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry), autostart=False
        ) as client:
            assert await client.prompt_bytes("bin", BINARY, agent="shell") == b"\x00\xff\x80abc"


async def test_trio_client_stream_prompt_bytes_is_binary_safe(denv: DaemonEnv) -> None:
    denv.prompt("start the daemon")
    with trio.fail_after(30):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry), autostart=False
        ) as client:
            streamed = b"".join(
                [piece async for piece in client.stream_prompt_bytes("bin", BINARY, agent="shell")]
            )
            assert streamed == b"\x00\xff\x80abc"
            # a small text answer and a big one come whole too
            assert await client.prompt_bytes("bin", "printf 'ok'") == b"ok"
            big = await client.prompt_bytes("bin", "head -c 3000000 /dev/zero")
            assert big == bytes(3_000_000)


def _binary_unstreamed(denv: DaemonEnv) -> tuple[bytes, dict[str, Any], bytes]:
    """A small binary output asked for with stream=False, then the same command resent."""
    denv.prompt("start the daemon")
    request: dict[str, Any] = {
        "type": "request", "id": 1, "client_id": "c1", "op": "prompt",
        "args": {"session": "bin", "agent": "shell", "text": BINARY, "stream": False}}
    with raw(denv.socket) as conn:
        conn.send(request)
        first, response, _ = collect(conn, 1)
    assert response["ok"], response
    with raw(denv.socket) as conn:
        conn.send(request)
        again, response2, _ = collect(conn, 1)
    assert response2 == response
    return first, response["result"], again


def test_resend_of_an_unstreamed_small_binary_answer_carries_its_bytes(denv: DaemonEnv) -> None:
    _, result, again = _binary_unstreamed(denv)
    assert result["bytes"] == 6
    assert "reply" not in result  # not UTF-8: kept in a file
    assert again == b"\x00\xff\x80abc"  # _answer_if_done sends the kept file


def test_unstreamed_small_binary_answer_carries_its_bytes_the_first_time(
    denv: DaemonEnv,
) -> None:
    first, _, _ = _binary_unstreamed(denv)
    assert first == b"\x00\xff\x80abc"


# --- a session's kept output is bounded -------------------------------------------------------


def test_a_sessions_kept_output_is_bounded_oldest_turns_first() -> None:
    """With ``logs.output_max_bytes`` at 150 kB, three turns of 100 kB each: after each one
    the older turns' files go until the rest fit; the newest stays. A resend of the first
    command is told its output is no longer kept (it ran: it is not run again), not given
    part of it; ``logs`` says the file is gone."""
    from .harness import daemon_env

    with daemon_env(extra_env={"TRIO_AGENTD_OUTPUT_MAX_BYTES": "150000"}) as denv:
        denv.prompt("start the daemon")
        src = denv.root / "100k.bin"
        expected = write_random(src, 100_000, seed=7)
        counter = denv.root / "runs.txt"
        out_dir = denv.home / "sessions" / "bounded" / "output"
        for turn in (1, 2, 3):
            request = {
                "type": "request", "id": turn, "client_id": "c1", "op": "prompt",
                "args": {"session": "bounded", "agent": "shell",
                         "text": f"echo run >> '{counter}'; cat '{src}'"},
            }
            with raw(denv.socket) as conn:
                conn.send(request)
                got, response, _ = collect(conn, turn)
            assert response["ok"], response
            assert got == expected
            assert sorted(p.name for p in out_dir.iterdir()) == [f"{turn}.out"]
        first = {"type": "request", "id": 1, "client_id": "c1", "op": "prompt",
                 "args": {"session": "bounded", "agent": "shell", "text": "not run again"}}
        with raw(denv.socket) as conn:
            conn.send(first)
            again, response, chunks = collect(conn, 1)
        assert (again, chunks) == (b"", 0)
        assert not response["ok"]
        assert response["error"]["code"] == "storage_error", response
        assert "no longer kept" in response["error"]["message"]
        assert counter.read_text() == "run\n" * 3  # nothing ran again
        history = cli(denv, "logs", "bounded")
        assert history.returncode == 0, history.stderr
        assert b"1.out is gone" in history.stdout
