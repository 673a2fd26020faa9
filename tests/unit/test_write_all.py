"""A short ``os.write`` (a nearly full disk, a signal) is retried, never taken for the whole
write: an atomic write that ignored it would rename a truncated file into place."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from trio_agentd import _fs


def _short_writes(monkeypatch: pytest.MonkeyPatch, at_most: int) -> list[int]:
    real = os.write
    sizes: list[int] = []

    def write(fd: int, data: bytes | memoryview) -> int:
        n = real(fd, bytes(data)[:at_most])
        sizes.append(n)
        return n

    monkeypatch.setattr(os, "write", write)
    return sizes


def test_an_atomic_write_survives_short_writes(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 40
    sizes = _short_writes(monkeypatch, 1000)
    _fs.atomic_write(tmp_path / "journal", data)
    assert (tmp_path / "journal").read_bytes() == data
    assert len(sizes) == 11  # ten full pieces and the rest


def test_a_write_that_writes_nothing_is_a_full_disk(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "journal").write_bytes(b"old")
    _short_writes(monkeypatch, 0)
    with pytest.raises(OSError, match="No space left") as info:
        _fs.atomic_write(tmp_path / "journal", b"new")
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "journal").read_bytes() == b"old"  # nothing truncated renamed into place
    assert [p.name for p in tmp_path.iterdir()] == ["journal"]  # and no temp file left
