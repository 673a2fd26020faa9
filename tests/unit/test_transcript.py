"""The transcript's per-line costs: its timestamps and its size, kept without asking the
file system for each line."""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._rotate import Limits
from trio_agentd._session import Transcript, iso_ms


@given(st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False))
def test_iso_ms_writes_what_datetime_writes(t: float) -> None:
    expected = dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds")
    assert iso_ms(t) == expected.replace("+00:00", "Z")


def test_iso_ms_formats_each_second_anew() -> None:
    assert iso_ms(1_800_000_000.5) == "2027-01-15T08:00:00.500Z"
    assert iso_ms(1_800_000_001.25) == "2027-01-15T08:00:01.250Z"
    assert iso_ms(1_800_000_000.999) == "2027-01-15T08:00:00.999Z"


def test_lines_are_appended_without_a_stat_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transcript = Transcript(tmp_path / "s1")
    stats = 0
    real = os.fstat

    def counted(fd: int) -> os.stat_result:
        nonlocal stats
        stats += 1
        return real(fd)

    monkeypatch.setattr(os, "fstat", counted)
    for turn in range(1, 11):
        transcript.append({"kind": "turn", "turn": turn, "prompt": "p", "reply": "r"})
    transcript.close()
    assert stats <= 2  # the file opened (open_trusted's check) and its size, once
    assert len((tmp_path / "s1" / "transcript.jsonl").read_bytes().splitlines()) == 10


def test_the_kept_size_still_rotates_at_the_limit(tmp_path: Path) -> None:
    transcript = Transcript(tmp_path / "s1", Limits(max_bytes=400, backups=2))
    for turn in range(1, 21):
        transcript.append({"kind": "turn", "turn": turn, "prompt": "p" * 20, "reply": "r"})
    transcript.close()
    path = tmp_path / "s1" / "transcript.jsonl"
    assert path.stat().st_size <= 400
    assert (tmp_path / "s1" / "transcript.jsonl.1").stat().st_size <= 400
    assert Transcript(tmp_path / "s1").turns == 20


def _torn_transcript(tmp_path: Path) -> tuple[Path, bytes]:
    """A transcript whose writer was killed in the middle of its third line: the kernel cut the
    write at a page boundary, so the file ends without that line's newline."""
    first = Transcript(tmp_path / "s1")
    first.append({"kind": "turn", "turn": 1, "prompt": "p1", "reply": "r\n",
                  "client_id": "c", "id": 1})
    first.append({"kind": "turn", "turn": 2, "prompt": "p2", "reply": "r\n",
                  "client_id": "c", "id": 2})
    first.close()
    good = first.path.read_bytes()
    with first.path.open("ab") as f:
        f.write(b'{"kind":"turn","turn":3,"prompt":"p3","re')
    return first.path, good


def test_a_torn_last_line_is_sealed_so_the_next_line_parses(tmp_path: Path) -> None:
    path, good = _torn_transcript(tmp_path)
    again = Transcript(tmp_path / "s1")
    assert again.turns == 2  # the torn turn is not counted (the journal transcribes it again)
    again.event("worker_started", pid=1)
    again.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert lines[-3] == b'{"kind":"turn","turn":3,"prompt":"p3","re'  # alone on its line
    assert json.loads(lines[-2])["event"] == "worker_started"
    assert path.read_bytes().startswith(good)


def test_a_torn_last_line_is_cut_off_when_there_is_no_room_to_seal_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, good = _torn_transcript(tmp_path)
    from trio_agentd import _fs

    real = _fs.write_all

    def no_room_for_the_seal(fd: int, data: bytes) -> None:
        if data == b"\n":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(_fs, "write_all", no_room_for_the_seal)
    again = Transcript(tmp_path / "s1")
    again.event("worker_started", pid=1)
    again.close()
    data = path.read_bytes()
    assert data.startswith(good)
    assert json.loads(data[len(good):])["event"] == "worker_started"
