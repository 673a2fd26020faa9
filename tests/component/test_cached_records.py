"""The fence's record reads come from memory while the registry watch reports no change, and
from the file as soon as it does (real dnotify and inotify, real dir, real clock)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from trio_agentd._dnotify import DirNotify
from trio_agentd._fs import read_bytes
from trio_agentd._inotify import Watcher
from trio_agentd._refence import CachedRecords, watched_refence
from trio_agentd.timing import DEFAULT_TIMING


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize("make", [pytest.param(DirNotify, id="dnotify"),
                                  pytest.param(Watcher, id="inotify")])
async def test_record_reads_are_cached_until_the_registry_changes(
    tmp_path: Path, make: Callable[[], DirNotify | Watcher],
) -> None:
    registry = tmp_path / "reg"
    record = registry / "g1.owner" / "owner.json"
    record.parent.mkdir(parents=True)
    record.write_bytes(b"A")
    watcher = make()
    try:
        records = CachedRecords(lambda g: read_bytes(registry / f"{g}.owner" / "owner.json"),
                                watcher.pending)
        # the loop re-watches the record dir of every connection's claim
        conn = cast(Any, SimpleNamespace(fence=SimpleNamespace(claim=SimpleNamespace(
            generation="g1"))))
        watch_claims, wait_change = watched_refence(
            watcher, registry, DEFAULT_TIMING, lambda: [conn], on_wake=records.invalidate)
        watch_claims("g1")
        assert records("g1") == b"A"
        assert records("g1") == b"A"
        assert records.reads == 1  # the second check cost no file access

        _replace(record, b"B")  # a successor replaces the record: seen at the very next check
        assert records("g1") == b"B"
        assert records("g1") == b"B"
        assert records.reads == 3  # events pending: nothing cached until the loop drains them
        with trio.fail_after(5):
            await wait_change()
        assert records("g1") == b"B"
        assert records("g1") == b"B"
        assert records.reads == 4

        record.unlink()  # a cleaner deletes it
        assert records("g1") is None
        with trio.fail_after(5):
            await wait_change()
        assert records("g1") is None
        record.parent.rmdir()  # the record dir goes and comes back with a new record
        with trio.fail_after(5):
            await wait_change()
        record.parent.mkdir()
        record.write_bytes(b"C")
        assert records("g1") == b"C"
        with trio.fail_after(5):
            await wait_change()  # watches the new dir again
        assert records("g1") == b"C"
        _replace(record, b"D")
        assert records("g1") == b"D"  # the new dir's changes are seen too
    finally:
        watcher.close()
