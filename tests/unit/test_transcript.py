"""The transcript's per-line costs: its timestamps and its size, kept without asking the
file system for each line."""

from __future__ import annotations

import datetime as dt
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
