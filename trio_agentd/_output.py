"""A turn's output: streamed in bounded chunks, kept small in records, binary-safe.

A turn has no size limit. The worker passes each piece an agent yields on at once, as chunk
events of at most :data:`CHUNK_MAX` bytes (base64 in the frame, well under the frame limit).
A turn has two streams, its reply (stdout) and its diagnostics (stderr, chunk events marked
``"stream": "stderr"``), kept apart end to end. Every chunk carries its byte offset in its
stream (``at``), so a client that resends a command and gets the output again from the start
keeps exactly one copy of every byte.

Each stream is also kept for a resend after the turn ended: up to :data:`INLINE_MAX` bytes in
memory (small UTF-8 text goes into the journal and the transcript: ``reply``, ``stderr``); past
that, in a file of its own that the records point to (``output``, ``stderr_output``), so no
record grows with it. ``bytes`` and ``stderr_bytes`` give each stream's size.

What a session keeps of its turns' files is bounded: once a spilled turn has ended, the oldest
turns' files go while the session's together take more than ``logs.output_max_bytes``
(:func:`prune`). The newest turn's stay whatever their size. A resend of a command whose
output went is answered ``storage_error`` (it ran; its output is no longer kept), and ``logs``
says the file is gone.

Zero copy (Linux): once a stream is in its file, output an agent leaves in its pipe
(:class:`~trio_agentd.agents.Waiting`) is moved from the pipe into the file with ``splice``
(:meth:`TurnOutput.take`) and sent from the file to a raw peer with ``sendfile``, in chunks of
:data:`RAW_CHUNK_MAX`; the bytes never pass through Python. Where either call is missing
(:data:`ZERO_COPY` false) the same output is read and written the portable way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from . import _fs

INLINE_MAX = 64 * 1024  # bytes of a reply kept in the records themselves
CHUNK_MAX = 256 * 1024  # bytes per chunk event (≈ 342 KiB of base64 in a 1 MiB frame)
RAW_CHUNK_MAX = CHUNK_MAX  # bytes per raw chunk sent from a file (what a client buffers is
# counted in chunks, so a chunk is no bigger raw than base64)
TAKE_MAX = 1 << 20  # bytes moved from an agent's pipe at once (the pipe's size: see widen_pipe)

ZERO_COPY = hasattr(os, "splice") and hasattr(os, "sendfile")
"""Whether pipe → output file (``splice``) and output file → socket (``sendfile``) may skip
Python; a test turns it off to run the portable path."""

STDOUT = "stdout"
STDERR = "stderr"
STREAMS = (STDOUT, STDERR)

FIELDS = {STDOUT: ("reply", "output", "bytes"), STDERR: ("stderr", "stderr_output", "stderr_bytes")}
"""Per stream, the record fields of its inline text, its spill file and its size."""


def chunk_event(at: int, data: bytes, stream: str = STDOUT) -> dict[str, Any]:
    event: dict[str, Any] = {"kind": "chunk", "at": at, "data": data}
    if stream != STDOUT:
        event["stream"] = stream
    return event


def event_stream(event: dict[str, Any]) -> str | None:
    """The stream a chunk event belongs to; ``None`` for a stream this version does not know."""
    stream = event.get("stream", STDOUT)
    return stream if stream in STREAMS else None


def pieces(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``data`` in slices of at most :data:`CHUNK_MAX` bytes, with their offsets in it."""
    for i in range(0, len(data), CHUNK_MAX):
        yield i, data[i : i + CHUNK_MAX]


class TurnOutput:
    """The bytes one turn produced so far; spills to ``path`` once past :data:`INLINE_MAX`.

    ``path`` None keeps everything in memory (tests, and workers without a session dir); a
    worker's turns name it with a ``str`` (a turn whose output stays in memory joins no
    ``Path``).
    """

    def __init__(self, path: Path | str | None, stream: str = STDOUT) -> None:
        self.path = path
        self.stream = stream
        self.size = 0
        self._memory: bytearray | None = bytearray()
        self._fd: int | None = None

    def add(self, data: bytes) -> None:
        """Keep ``data``.

        Raises:
            OSError: the spill file could not be written (a full disk): the caller fails the
                turn's record with ``storage_error``.
        """
        if self._memory is not None and (
            self.path is None or len(self._memory) + len(data) <= INLINE_MAX
        ):
            self._memory += data
        else:
            if self._fd is None:
                self._spill()
            assert self._fd is not None
            _fs.write_all(self._fd, data)
        self.size += len(data)

    def _spill(self) -> None:
        assert self.path is not None
        _fs.ensure_dir(Path(self.path).parent)
        # readable too: the live stream is sent from it (sendfile)
        self._fd = _fs.open_trusted(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        if self._memory:
            _fs.write_all(self._fd, bytes(self._memory))
        self._memory = None

    def take(self, fd: int, size: int) -> tuple[int, bytes | None]:
        """Move up to ``size`` bytes waiting in pipe ``fd`` into the output: ``(count, None)``
        when they went from the pipe straight into the file (``splice``: read them back with
        :attr:`file_fd`), else ``(count, data)``. ``count`` 0: nothing was there after all.

        Raises:
            OSError: the spill file could not be written (a full disk), or the pipe failed.
        """
        if self._fd is None or not ZERO_COPY:
            try:
                data = os.read(fd, min(size, TAKE_MAX))
            except BlockingIOError:
                return 0, b""
            self.add(data)
            return len(data), data
        try:
            count = os.splice(fd, self._fd, min(size, TAKE_MAX))
        except BlockingIOError:
            return 0, None
        self.size += count
        return count, None

    @property
    def spilled(self) -> bool:
        """Whether the output went to its file (past :data:`INLINE_MAX`, or not UTF-8)."""
        return self._memory is None

    @property
    def file_fd(self) -> int | None:
        """The spill file, open for reading too (``None`` while the output is in memory)."""
        return self._fd

    def read(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """``(offset, bytes)`` pieces of what was kept, from ``start`` to the current end."""
        end = self.size
        if self._memory is not None:
            for at, piece in pieces(bytes(self._memory[start:end])):
                yield start + at, piece
            return
        assert self.path is not None
        yield from read_file(self.path, start, end)

    def result_fields(self) -> dict[str, Any]:
        """What the records keep: the text itself when small and UTF-8, else where it is. An
        empty stderr keeps nothing (the stdout fields are always there)."""
        text, where, size = FIELDS[self.stream]
        if self.stream != STDOUT and not self.size:
            return {}
        if self._memory is not None:
            try:
                return {text: bytes(self._memory).decode(), size: self.size}
            except UnicodeDecodeError:
                if self.path is None:
                    return {size: self.size}  # not kept (a worker without a session dir)
                self._spill()
        assert self.path is not None
        return {where: str(self.path), size: self.size}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_file(path: Path | str, start: int, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """``(offset, bytes)`` pieces of a spilled output file (nothing if it is gone)."""
    try:
        fd = _fs.open_trusted(path)
    except FileNotFoundError:
        return
    try:
        at = start
        while end is None or at < end:
            want = CHUNK_MAX if end is None else min(CHUNK_MAX, end - at)
            data = os.pread(fd, want, at)
            if not data:
                return
            yield at, data
            at += len(data)
    finally:
        os.close(fd)


def stored_pieces(result: Any, stream: str = STDOUT) -> Iterator[tuple[int, bytes]]:
    """One stream of what a completed command's result keeps, as ``(offset, bytes)`` pieces."""
    if not isinstance(result, dict):
        return
    text, where, _size = FIELDS[stream]
    reply = result.get(text)
    if isinstance(reply, str):
        yield from pieces(reply.encode(errors="surrogateescape"))
    elif isinstance(result.get(where), str):
        yield from read_file(Path(result[where]), 0)


def inline(result: Any) -> bool:
    """Whether a result carries all its output in itself (no stream kept in a file)."""
    return (
        isinstance(result, dict)
        and "reply" in result
        and ("stderr" in result or not result.get("stderr_bytes"))
    )


def prune(out_dir: Path, budget: int, keep: Collection[str]) -> list[str]:
    """Remove the oldest turns' output files (``<turn>.out``, ``<turn>.err``) from
    ``out_dir`` while all of them take more than ``budget`` bytes, never one named in ``keep``
    (the turn that just ended). The names removed, oldest first.

    Without a bound a session's disk use grows with every large turn, forever: a session that
    printed a 1 GB file a hundred times would keep 100 GB.
    """
    files: list[tuple[int, str, int]] = []
    try:
        with os.scandir(out_dir) as entries:
            for entry in entries:
                stem, _dot, ext = entry.name.partition(".")
                if ext not in ("out", "err") or not stem.isdigit():
                    continue
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                files.append((int(stem), entry.name, size))
    except FileNotFoundError:
        return []
    total = sum(size for _turn, _name, size in files)
    removed: list[str] = []
    for _turn, name, size in sorted(files):
        if total <= budget:
            break
        if name in keep:
            continue
        with contextlib.suppress(FileNotFoundError):  # gone already (a cleaner): no room
            os.unlink(out_dir / name)
        total -= size
        removed.append(name)
    return removed


def missing_output(result: Any) -> str | None:
    """The first file a completed command's result points to that is gone, if any."""
    if not isinstance(result, dict):
        return None
    for stream in STREAMS:
        _text, where, size = FIELDS[stream]
        path = result.get(where)
        if isinstance(path, str) and result.get(size) and not os.path.exists(path):
            return path
    return None
