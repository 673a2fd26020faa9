"""The worker's journal writes zeros ahead of its records and writes its records into them.

A record written into room already on disk changes neither the file's size nor its block map,
so its ``fdatasync`` writes no inode. These tests hold the file to that, and to a reader's
view: every record is where the last one ended, and a reopen (a restart, an adoption) goes on
from there whatever the file holds after the records.
"""

from __future__ import annotations

import errno
import os
import tracemalloc
from pathlib import Path

import pytest

from trio_agentd import _journal, _workerjournal
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._journal import key_of
from trio_agentd._workerjournal import ROOM, Journal


def _accepted(n: int) -> bytes:
    return _journal.accepted("c1", n, "prompt", {"text": f"prompt {n}"})


def _completed(n: int) -> bytes:
    return _journal.completed("c1", n, f"reply {n}")


def _records(path: Path) -> bytes:
    written = _journal.written(path.read_bytes())
    assert b"\0" not in written, "a NUL byte among the records"
    return written


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "journal" / "s1.jsonl"


def test_records_go_into_room_written_ahead_and_the_size_stays(path: Path) -> None:
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    size = path.stat().st_size
    assert size >= len(_accepted(1)) + ROOM  # zeros ahead of the first record
    journal.append_durable(_completed(1))
    journal.append_durable(_accepted(2))
    assert path.stat().st_size == size  # written into the room: no new size to flush
    assert _records(path) == _accepted(1) + _completed(1) + _accepted(2)
    journal.close()


def test_room_is_made_again_once_used_and_never_over_a_record(path: Path) -> None:
    journal = Journal(path)
    lines = [_accepted(n) for n in range(2 * ROOM // len(_accepted(0)) + 10)]
    for line in lines:
        journal.append(line)
    assert _records(path) == b"".join(lines)
    assert path.stat().st_size > len(b"".join(lines))  # room again after the last
    journal.close()


def _killed(journal: Journal) -> None:
    """The journal's process dies: its file is left as it is, room and all."""
    os.close(journal._fd)


def test_a_reopened_journal_goes_on_right_after_its_last_record(path: Path) -> None:
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    _killed(journal)
    assert path.read_bytes().endswith(bytes(ROOM))
    again = Journal(path)  # a restart: the file ends in zeros
    assert list(again.state.accepted) == [key_of("c1", 1)]
    again.append_durable(_completed(1))
    assert _records(path) == _accepted(1) + _completed(1)
    assert _journal.parse(path.read_bytes()).completed == {key_of("c1", 1): "reply 1"}
    again.close()


def test_a_torn_record_in_the_room_is_sealed_and_the_next_record_parses(path: Path) -> None:
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    journal.append_durable(_completed(1))
    _killed(journal)
    data = path.read_bytes()
    torn = _journal.written(data)[:-9]  # the last record cut short by a kill, zeros after it
    path.write_bytes(torn + bytes(len(data) - len(torn)))

    again = Journal(path)
    assert key_of("c1", 1) not in again.state.completed
    again.append_durable(_accepted(2))
    state = _journal.parse(path.read_bytes())
    assert state.skipped_lines == 1  # the torn record, and only it
    assert list(state.accepted) == [key_of("c1", 1), key_of("c1", 2)]
    assert _records(path).endswith(b"\n" + _accepted(2))
    again.close()


def test_a_full_disk_for_the_room_still_writes_the_record(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    used = len(_records(path))
    real_pwrite = os.pwrite

    def no_room(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_room)
    filler = b'{"kind":"started","client_id":"c1","id":"' + b"x" * (ROOM - used) + b'"}\n'
    journal.append_durable(filler)  # past the room, with no more made: appended
    journal.append_durable(_completed(1))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    journal.append_durable(_accepted(2))  # room again, after the records, not over them
    assert _records(path) == _accepted(1) + filler + _completed(1) + _accepted(2)
    journal.close()


def test_a_failed_append_is_cut_back_and_the_next_record_follows_the_last_good_one(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    real_write = os.write

    def torn(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", torn)
    with pytest.raises(AgentdError) as failed:
        journal.append(_completed(1))
    assert failed.value.code == ErrorCode.STORAGE_ERROR
    monkeypatch.setattr(os, "write", real_write)
    journal.append_durable(_accepted(2))
    assert _records(path) == _accepted(1) + _accepted(2)
    journal.close()


def test_after_compaction_records_follow_the_compacted_ones(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_workerjournal, "COMPACT_AFTER", 4)
    journal = Journal(path)
    for n in range(1, 4):
        journal.append_durable(_accepted(n))
        journal.append_durable(_completed(n))
    journal.maybe_compact()
    compacted = _records(path)
    journal.append_durable(_accepted(9))
    assert _records(path) == compacted + _accepted(9)
    assert key_of("c1", 9) in _journal.parse(path.read_bytes()).accepted
    journal.close()


def test_a_closed_journal_gives_back_its_room(path: Path) -> None:
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    assert path.stat().st_size > len(_accepted(1))
    journal.close()
    assert path.read_bytes() == _accepted(1)


def test_no_room_is_made_on_a_filesystem_running_full(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zeros would take space other files (transcript, output, state) need first."""
    real = os.fstatvfs

    def nearly_full(fd: int) -> os.statvfs_result:
        st = real(fd)
        free_blocks = (_workerjournal.ROOM_MIN_FREE - 1) // st.f_frsize
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, free_blocks,
                                  free_blocks, *st[5:]))

    monkeypatch.setattr(os, "fstatvfs", nearly_full)
    journal = Journal(path)
    journal.append_durable(_accepted(1))
    journal.append_durable(_completed(1))
    assert path.read_bytes() == _accepted(1) + _completed(1)  # appended, nothing ahead
    monkeypatch.setattr(os, "fstatvfs", real)
    journal.append_durable(_accepted(2))  # space again: room again
    assert path.stat().st_size > len(_records(path))
    assert _records(path) == _accepted(1) + _completed(1) + _accepted(2)
    journal.close()


def test_making_room_allocates_no_buffer_of_its_size(path: Path) -> None:
    """A buffer of zeros made for each room would stay in the worker's heap, written: 64 KiB
    of its own memory in every worker. Room is written from one buffer, made at import."""
    journal = Journal(path)
    tracemalloc.start()
    try:
        journal.append_durable(_accepted(1))  # the first record: room made for it
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path.stat().st_size >= ROOM
    assert peak < ROOM // 4
    journal.close()
