"""Log rotation, the transcript's bounds, reading and printing a history, the follower queue."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from trio_agentd._followers import Followers
from trio_agentd._logs import Printer, Tail, history
from trio_agentd._rotate import Limits, RotatingLog, limits_from_env, shift
from trio_agentd._session import Transcript


def test_limits_from_env() -> None:
    assert limits_from_env({}) == Limits(50 * 1024 * 1024, 10)
    assert limits_from_env({"TRIO_AGENTD_LOG_MAX_BYTES": "0",
                            "TRIO_AGENTD_LOG_BACKUPS": "3"}) == Limits(0, 3)
    with pytest.raises(ValueError, match="TRIO_AGENTD_LOG_BACKUPS must be a whole number >= 1"):
        limits_from_env({"TRIO_AGENTD_LOG_BACKUPS": "0"})
    with pytest.raises(ValueError, match=r"TRIO_AGENTD_LOG_MAX_BYTES .* \(got '1e6'\)"):
        limits_from_env({"TRIO_AGENTD_LOG_MAX_BYTES": "1e6"})


def test_shift_keeps_backups_files(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    for i in range(5):
        log.write_text(str(i))
        shift(log, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.log.1", "x.log.2"]
    assert (tmp_path / "x.log.1").read_text() == "4"
    assert (tmp_path / "x.log.2").read_text() == "3"


def test_rotating_log_is_bounded_and_moves_stdio(tmp_path: Path) -> None:
    path = tmp_path / "daemon.log"
    stdio = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # "stderr"
    handler = RotatingLog(path, Limits(100, 2), stdio=(stdio,))
    logger = logging.getLogger("test.rotate")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for i in range(20):
            logger.warning("line %02d %s", i, "x" * 20)  # 29 bytes a line
        os.write(stdio, b"direct\n")
    finally:
        logger.removeHandler(handler)
        handler.close()
        os.close(stdio)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["daemon.log", "daemon.log.1", "daemon.log.2"]
    for name in names:
        assert (tmp_path / name).stat().st_size <= 100
    current = path.read_text()
    assert current.endswith("line 19 xxxxxxxxxxxxxxxxxxxx\ndirect\n")  # stdio follows it
    kept = "".join((tmp_path / n).read_text() for n in reversed(names[1:])) + current
    numbers = [int(line.split()[1]) for line in kept.splitlines() if line.startswith("line")]
    assert numbers == list(range(numbers[0], 20))  # the newest, in order, none lost between
    assert numbers[0] > 0  # the oldest were deleted


def _turn(t: Transcript, n: int, reply: str = "r\n") -> None:
    t.append({"kind": "turn", "turn": n, "prompt": f"p{n}", "reply": reply,
              "bytes": len(reply), "client_id": "c", "id": n})


def test_transcript_rotates_and_turns_go_on(tmp_path: Path) -> None:
    t = Transcript(tmp_path, Limits(400, 2))
    for n in range(1, 21):
        _turn(t, n)
    t.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["transcript.jsonl", "transcript.jsonl.1", "transcript.jsonl.2"]
    for name in files:
        assert (tmp_path / name).stat().st_size <= 400
    first = json.loads((tmp_path / "transcript.jsonl").read_text().splitlines()[0])
    assert (first["kind"], first["event"]) == ("event", "rotated")

    again = Transcript(tmp_path, Limits(400, 2))
    assert again.turns == 20
    assert again.rotated_through == first["turns"]
    # a turn in a deleted file is transcribed already (a journal's old result is not redone)
    assert again.has(("c", "1"), 1)
    assert again.has(("c", "20"), 20)
    assert not again.has(("c", "21"), 21)


def test_a_line_bigger_than_the_limit_is_written_once(tmp_path: Path) -> None:
    t = Transcript(tmp_path, Limits(100, 2))
    _turn(t, 1)
    _turn(t, 2, "y" * 500)
    _turn(t, 3)
    t.close()
    recs = [r for r in history(tmp_path) if r["kind"] == "turn"]
    assert [r["turn"] for r in recs] == [1, 2, 3]


def test_history_last_n_across_files(tmp_path: Path) -> None:
    t = Transcript(tmp_path, Limits(300, 50))
    t.event("worker_started", pid=1)
    for n in range(1, 9):
        _turn(t, n)
        if n == 6:
            t.event("cancelled", turn=7, prompt="p", error="turn 7 was cancelled")
    t.close()
    assert len(list(tmp_path.iterdir())) > 2
    every = list(history(tmp_path))
    assert [r.get("turn") for r in every if r["kind"] == "turn"] == list(range(1, 9))
    assert every[0]["event"] == "worker_started"
    last = list(history(tmp_path, 3))
    assert [(r["kind"], r.get("turn")) for r in last if r.get("event") != "rotated"] == [
        ("event", 7), ("turn", 7), ("turn", 8)]
    assert list(history(tmp_path, 0)) == []
    assert len([r for r in history(tmp_path, 100) if r["kind"] == "turn"]) == 8


def _print(recs: list[dict[str, object]], *, as_json: bool = False) -> bytes:
    out: list[bytes] = []
    p = Printer(out.append, as_json=as_json)
    for rec in recs:
        p.record(rec)
    p.end()
    return b"".join(out)


def test_human_form(tmp_path: Path) -> None:
    big = tmp_path / "3.out"
    big.write_bytes(b"\x00\xffbinary")
    got = _print([
        {"kind": "event", "event": "worker_started", "pid": 7, "at": "T0"},
        {"kind": "turn", "turn": 1, "prompt": "hi", "reply": "hello\n", "bytes": 6,
         "at": "T1"},
        {"kind": "turn", "turn": 2, "prompt": "x\n", "reply": "no newline", "bytes": 10,
         "stderr": "warn\n", "stderr_bytes": 5, "exit_status": 7, "at": "T2"},
        {"kind": "turn", "turn": 3, "prompt": "b", "output": str(big), "bytes": 8, "at": "T3"},
        {"kind": "event", "event": "worker_started", "pid": 8, "at": "T4"},
        {"kind": "event", "event": "cancelled", "turn": 4, "prompt": "c",
         "error": "turn 4 was cancelled", "at": "T5"},
        {"kind": "turn", "turn": 4, "prompt": "d", "output": str(tmp_path / "gone"),
         "bytes": 3, "at": "T6"},
    ])
    assert got == (
        b"==> worker started, pid 7 \xc2\xb7 T0\n"
        b"==> turn 1 \xc2\xb7 T1 \xc2\xb7 prompt:\nhi\n==> output (6 bytes):\nhello\n"
        b"==> turn 2 \xc2\xb7 T2 \xc2\xb7 prompt:\nx\n==> output (10 bytes):\nno newline"
        b"\n\\ no newline at end of output\n"
        b"==> stderr (5 bytes):\nwarn\n==> exit status 7\n"
        b"==> turn 3 \xc2\xb7 T3 \xc2\xb7 prompt:\nb\n==> output (8 bytes):\n\x00\xffbinary"
        b"\n\\ no newline at end of output\n"
        b"==> worker started, pid 8 \xc2\xb7 T4 (the one before it ended without stopping:"
        b" killed or crashed)\n"
        b"==> turn 4 \xc2\xb7 prompt:\nc\n==> cancelled \xc2\xb7 T5: turn 4 was cancelled\n"
        b"==> turn 4 \xc2\xb7 T6 \xc2\xb7 prompt:\nd\n==> output (3 bytes):\n"
        b"(the output file " + str(tmp_path / "gone").encode() + b" is gone)\n"
    )


def test_json_form_is_one_object_a_line() -> None:
    rec = {"kind": "turn", "turn": 1, "prompt": "hi", "reply": "é\n", "bytes": 3}
    assert [json.loads(line) for line in _print([rec, rec], as_json=True).splitlines()] == [
        rec, rec]


def test_tail_reads_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "t.log"
    path.write_bytes(b"a\nb")
    tail = Tail(path, from_end=False)
    assert list(tail.lines()) == [b"a\n"]
    with open(path, "ab") as f:
        f.write(b"\nc\n")
    shift(path, 3)
    path.write_bytes(b"d\n")
    assert list(tail.lines()) == [b"b\n", b"c\n", b"d\n"]
    assert list(tail.lines()) == []
    tail.close()


def test_a_follower_that_falls_behind_is_dropped_never_waited_for() -> None:
    followers = Followers(max_bytes=10)
    slow, fast = followers.add(), followers.add()
    # the first piece always fits, however big
    followers.chunk(["c", "1"], 1, lambda: "p", 0, b"x" * 30)
    assert not slow.dropped
    assert [e["kind"] for e in fast.queue] == ["turn_started", "chunk"]
    fast.queue.clear()
    fast.done(30)
    followers.chunk(["c", "1"], 1, lambda: "p", 30, b"y" * 5)
    assert slow.dropped  # 30 + 5 queued > 10: let go, its queue freed
    assert len(slow.queue) == 0
    assert not fast.dropped
    followers.turn_done(1)
    assert [e["kind"] for e in fast.queue] == ["chunk", "turn_done"]
    assert followers.current is None


def test_daemon_log_last_lines_then_follow_across_a_rotation(tmp_path: Path) -> None:
    from trio_agentd._logs import follow_daemon_log

    path = tmp_path / "daemon.log"
    path.write_bytes(b"one\ntwo\nthree\n")
    out: list[bytes] = []

    def append() -> None:
        path.write_bytes(path.read_bytes() + b"four\n")

    def rotate() -> None:
        shift(path, 2)
        path.write_bytes(b"five\n")

    steps = iter([append, rotate])

    class Done(Exception):
        pass

    def sleep(_seconds: float) -> None:
        step = next(steps, None)
        if step is None:
            raise Done
        step()

    with pytest.raises(Done):
        follow_daemon_log(path, out.append, last=2, follow=True, sleep=sleep)
    assert out == [b"two\n", b"three\n", b"four\n", b"five\n"]
    out.clear()
    follow_daemon_log(path, out.append, last=None, follow=False)
    assert out == [b"five\n"]


def test_a_full_disk_loses_log_lines_quietly_and_the_next_line_counts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    from trio_agentd import _fs, _rotate

    path = tmp_path / "worker.log"
    handler = RotatingLog(path, Limits(0, 0))
    logger = logging.getLogger("test.fulldisk")
    logger.propagate = False
    logger.addHandler(handler)
    real = _fs.write_all
    full = True

    def write(fd: int, data: bytes) -> None:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(_rotate, "write_all", write)
    try:
        logger.warning("before 1")
        logger.warning("before 2")
        full = False
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
        handler.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(f"2 log line(s) lost: ENOSPC writing {path} (No space left on"
                             " device)")
    assert lines[1] == "after"
    captured = capsys.readouterr()
    assert "Logging error" not in captured.err + captured.out
    assert "Traceback" not in captured.err + captured.out


def test_a_transcript_line_keeps_its_text_as_utf8_and_a_non_utf8_prompt_as_escapes(
    tmp_path: Path,
) -> None:
    t = Transcript(tmp_path)
    t.append({"kind": "turn", "turn": 1, "prompt": "héllo ✓", "client_id": "c", "id": "1"})
    t.append({"kind": "turn", "turn": 2, "prompt": b"caf\xe9".decode(errors="surrogateescape"),
              "client_id": "c", "id": "2"})
    t.close()
    lines = (tmp_path / "transcript.jsonl").read_bytes().splitlines()
    assert '"prompt":"héllo ✓"'.encode() in lines[0]  # UTF-8, not \u escapes
    assert b'"prompt":"caf\\udce9"' in lines[1]  # not UTF-8: an escape, as before
    assert [r["prompt"] for r in history(tmp_path) if r["kind"] == "turn"] == [
        "héllo ✓", "caf\udce9"]
    assert Transcript(tmp_path).turns == 2
