"""A worker's start fsyncs its transcript only when recovery brought lines into it (turns the
journal completed that the transcript lacks): not on every start, where it would make only
the ``worker_started`` line durable while the worker accepts nothing (a respawn waits)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from trio_agentd import _journal
from trio_agentd._session import Transcript
from trio_agentd._workerjournal import Journal
from trio_agentd.testing import MemoryRegistry, make_worker_core


async def _start_and_count_transcript_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal_lines: list[bytes]
) -> tuple[int, list[dict[str, object]]]:
    path = tmp_path / "journal" / "s1.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(journal_lines))
    journal = Journal(path)
    transcript = Transcript(tmp_path / "sessions" / "s1")
    core = make_worker_core(MemoryRegistry())
    core.journal, core.transcript = journal, transcript
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(core.serve)
            fd = transcript._fd
            nursery.cancel_scope.cancel()
    finally:
        journal.close()
        transcript.close()
    lines = [json.loads(line) for line in transcript.path.read_bytes().splitlines()]
    return synced.count(fd) if fd is not None else 0, lines


async def test_a_start_with_nothing_to_bring_into_the_transcript_does_not_fsync_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs, lines = await _start_and_count_transcript_fsyncs(tmp_path, monkeypatch, [])
    assert fsyncs == 0
    assert [line.get("event") for line in lines] == ["worker_started"]


async def test_a_start_that_brings_a_completed_turn_into_the_transcript_fsyncs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = {"session": "s1", "turn": 1, "reply": "[echo turn 1] hi\n", "bytes": 17}
    fsyncs, lines = await _start_and_count_transcript_fsyncs(tmp_path, monkeypatch, [
        _journal.accepted("c", 1, "prompt", {"text": "hi"}),
        _journal.completed("c", 1, result),
    ])
    assert fsyncs == 1
    assert [(line["kind"], line.get("turn"), line.get("recovered")) for line in lines] == [
        ("event", None, None), ("turn", 1, True)]
