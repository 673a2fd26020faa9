"""The worker's journal file: appends, the group-commit flusher, durability, compaction.

What a record means and what replay decides is :mod:`._journal` (pure); this is the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import trio

from . import _fs, _journal
from ._errors import AgentdError
from ._fs import write_all
from ._storage import errno_name, storage_error

log = logging.getLogger("trio_agentd.worker")


COMPACT_AFTER = 2000  # journal lines
ROOM = 64 * 1024  # zeros written ahead of the records (see Journal._make_room)
ROOM_MIN_FREE = 64 * 1024 * 1024  # ... only while the filesystem has this much space free
_ZEROS = memoryview(bytes(ROOM))  # what room is written from: made once, in the fork template
# (a buffer made per room would stay in each worker's heap, written, its own 64 KiB)
KEEP_COMPLETED = 500


class Journal:
    """The worker's command journal, with group commit.

    ``append`` writes a record at once (so it survives a ``kill -9`` of this process: it is in
    the page cache, in order), into zeros written ahead of it (:meth:`_make_room`: a reader
    stops at them); ``await sync(seq)`` returns once that record is on disk. One
    flusher task runs ``fdatasync`` in a thread and covers every record written before it
    started, so a turn's ``completed`` and the next turn's ``accepted`` share one flush, and
    so do the records of concurrent commands. Durability is unchanged: nobody is answered, and
    no command runs, before its record is on disk.

    Failed writes (ENOSPC, EDQUOT, EFBIG, EIO) raise ``storage_error`` and leave no torn record:
    a failed append is cut back to the last good offset. A failed flush means nothing written
    since the last good flush can be trusted: the file is cut back to that flush, every
    ``sync`` of a record after it raises ``storage_error``, the acceptance of every command that
    never started is forgotten (a resend runs it), and the records of commands that did run
    (started, outcomes) are kept in memory and written again before anything else
    (:attr:`backlog`), so a resend gets its result and nothing runs twice.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        _fs.ensure_dir(path.parent)
        data = _fs.read_bytes(path) or b""
        self.state = _journal.parse(data)
        self._lines = len(self.state.accepted) + len(self.state.completed)
        self._fd = _fs.open_trusted(path, os.O_WRONLY | os.O_CREAT)
        # the file's end, records or room; never before the end of the records (_offset)
        self._room_end = os.fstat(self._fd).st_size
        records = _journal.written(data)  # (the rest is room made ahead)
        os.lseek(self._fd, len(records), os.SEEK_SET)
        torn = _fs.torn_tail(records)
        if torn is not None:
            _fs.seal_torn_tail(self._fd, torn)  # ("\n" at the end of records, or cut there)
            self._room_end = os.fstat(self._fd).st_size
            os.lseek(self._fd, min(len(records) + 1, self._room_end), os.SEEK_SET)
        self._offset = os.lseek(self._fd, 0, os.SEEK_CUR)  # end of the last good record
        self._torn: int | None = None  # a cut that failed: the offset to cut back to first
        self.written = 0  # sequence number of the last record written
        self._durable = 0  # ... and of the last one known to be on disk
        self._durable_offset = self._offset
        self._unflushed: list[tuple[int, int, bytes]] = []  # (seq, end offset, line)
        self.backlog: list[bytes] = []  # records of commands that ran, to write again
        self._lost: list[tuple[int, int, OSError]] = []  # (after, through, why)
        self._durable_changed = trio.Event()
        self._wanted = trio.Event()
        self._flusher_running = False
        self._flushing = False
        self.flushes = 0
        self.storage_failures = 0
        self.last_storage_error: AgentdError | None = None

    def append(self, line: bytes, *more: bytes, keep: bool = False) -> int:
        """Write a record (not yet durable), or several with one write (``more``); the
        sequence number of the last for :meth:`sync`.

        ``keep``: the record is the outcome of a command that ran; if it cannot be written it is
        still applied, and kept in :attr:`backlog` to be written before the next record.

        Raises:
            AgentdError: ``storage_error``; nothing of the records is left in the file.
        """
        try:
            self._write_backlog()
            self._write(line, more)
        except AgentdError:
            if keep:
                self.backlog.append(line)
                self.backlog.extend(more)
                self._apply(line)
                for extra in more:
                    self._apply(extra)
            raise
        self._apply(line)
        for extra in more:
            self._apply(extra)
        return self.written

    def _apply(self, line: bytes) -> None:
        rec = _journal.record_of(line)
        self.state.apply(rec)
        if rec.get("kind") not in ("started", "dropped", "group", "group_stopped"):
            # markers ride along: compaction counts commands
            self._lines += 1

    def _write(self, line: bytes, more: tuple[bytes, ...] = ()) -> None:
        if self._torn is not None:
            try:
                os.ftruncate(self._fd, self._torn)
            except OSError as exc:
                raise self._failed(exc) from exc
            self._end_at(self._torn)
            self._torn = None
        start = self._offset
        data = b"".join((line, *more)) if more else line
        if start + len(data) > self._room_end:
            self._make_room(start + len(data))
        try:
            write_all(self._fd, data)
        except OSError as exc:
            self._cut(start)
            raise self._failed(exc) from exc
        self._offset = start + len(line)
        self._room_end = max(self._room_end, start + len(data))
        self.written += 1
        self._unflushed.append((self.written, self._offset, line))
        for extra in more:
            self._offset += len(extra)
            self.written += 1
            self._unflushed.append((self.written, self._offset, extra))

    def _make_room(self, need: int) -> None:
        """Write zeros ahead of the records, past ``need``, so that the records written into
        them later change no size or block map: their ``fdatasync`` then writes the data and
        flushes, without a write of the inode first (about a third less time per flush on
        ext4). The zeros are made durable by the next flush, with the records before them.

        Room is made only while the filesystem has :data:`ROOM_MIN_FREE` free, so that on a
        disk running full the zeros do not take the space other files need first; the record
        is then written past the end as before. No room at all (a full disk) is not an error
        here either: the record's own write reports it.
        """
        at = self._room_end  # (past every record: see _write)
        end = need + ROOM
        try:
            fs = os.fstatvfs(self._fd)
            if fs.f_bavail * fs.f_frsize < ROOM_MIN_FREE:
                return
            while at < end:
                at += os.pwrite(self._fd, _ZEROS[: min(ROOM, end - at)], at)
        except OSError as exc:
            log.debug("journal %s: no room made ahead (%s); appending", self.path, exc)
        finally:
            self._room_end = at

    def _end_at(self, offset: int) -> None:
        """The file now ends at ``offset`` (cut back): the next record is written there."""
        os.lseek(self._fd, offset, os.SEEK_SET)
        self._room_end = offset

    def _write_backlog(self) -> None:
        while self.backlog:
            self._write(self.backlog[0])
            del self.backlog[0]

    def _cut(self, offset: int) -> None:
        """Cut the file back to ``offset`` (a torn record); if even that fails, before the
        next write."""
        try:
            os.ftruncate(self._fd, offset)
        except OSError as exc:
            log.error("journal %s: cannot cut a torn record at %d: %s", self.path, offset, exc)
            self._torn = offset
            return
        self._end_at(offset)
        self._torn = None  # (a cut that failed before was to this offset or past it)

    def _failed(self, exc: OSError) -> AgentdError:
        err = storage_error(self.path, exc)
        self.storage_failures += 1
        self.last_storage_error = err
        log.error("journal %s: a write or flush failed: %s (%s)", self.path, errno_name(exc),
                  exc)
        return err

    def lost(self, seq: int) -> AgentdError | None:
        """Why record ``seq`` will never be durable (a flush failed after it), or ``None``."""
        for after, through, exc in self._lost:
            if after < seq <= through:
                err = storage_error(self.path, exc)
                err.__cause__ = exc
                return err
        return None

    async def sync(self, seq: int, *, inline: bool = False) -> None:
        """Return once record ``seq`` (and every one before it) is on disk.

        ``inline``: nobody else is waiting, so flush here without a thread hop (the lowest
        latency for a lone command; concurrent commands share the flusher's flushes).

        Raises:
            AgentdError: ``storage_error``: a flush failed after the record was written (or the
                backlog, written first, could not be).

        Cancellation: the caller stops waiting; the flush goes on for the others.
        """
        seq = self._sync_target(seq)
        while not self._synced(seq, inline):
            self._wanted.set()
            event = self._durable_changed
            await event.wait()

    def synced(self, seq: int, *, inline: bool = False) -> bool:
        """Make record ``seq`` durable without waiting if that can be done here: ``True``
        once it is on disk (flushed here if ``inline`` or no flusher runs), ``False`` if
        the flusher has to do it, or a backlog be written first (:meth:`sync` then does it
        and waits). A command that needs no wait so skips the scheduler and any scope
        around its wait.

        Raises:
            AgentdError: ``storage_error``, as :meth:`sync`.
        """
        return not self.backlog and self._synced(seq, inline)

    def _sync_target(self, seq: int) -> int:
        """The record to wait for: ``seq``, or the last of the backlog, written first."""
        if self.backlog:
            self._write_backlog()
            seq = max(seq, self.written)
        return seq

    def _synced(self, seq: int, inline: bool) -> bool:
        while True:
            err = self.lost(seq)
            if err is not None:
                raise err
            if self._durable >= seq:
                return True
            if not self._flusher_running or (inline and not self._flushing):
                self._flush_now()
                continue
            return False

    def append_durable(self, line: bytes) -> None:
        """Write and flush inline (startup recovery, before the flusher runs).

        Raises:
            AgentdError: ``storage_error`` (the record is kept in :attr:`backlog`).
        """
        seq = self.append(line, keep=True)
        self._flush_now()
        err = self.lost(seq)
        if err is not None:
            raise err

    def _flush_now(self) -> None:
        target, offset = self.written, self._offset
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._flush_failed(exc)
            return  # the caller finds its record lost
        self.flushes += 1
        self._mark_durable(target, offset)

    def _mark_durable(self, seq: int, offset: int) -> None:
        if seq > self._durable:
            self._durable = seq
            self._durable_offset = offset
            self._unflushed = [u for u in self._unflushed if u[0] > seq]
            self._durable_changed.set()
            self._durable_changed = trio.Event()

    def _flush_failed(self, exc: OSError) -> None:
        """A flush failed: nothing after the last good one can be trusted (fsync errors
        are reported once and the data may be gone). Cut back to it; keep what ran."""
        self._failed(exc)
        self._lost.append((self._durable, self.written, exc))
        state = self.state
        kept: list[bytes] = []
        for _seq, _end, line in self._unflushed:
            rec = _journal.record_of(line)
            k = _journal.key_of(str(rec.get("client_id", "")), rec.get("id", ""))
            ran = k in state.started or k in state.completed or k in state.interrupted
            if rec.get("kind") == "accepted" and not ran:
                state.accepted.pop(k, None)  # never ran: forgotten, a resend runs it
                self._lines -= 1
                continue
            kept.append(line)
        self._unflushed = []
        self.backlog[:0] = kept
        self._cut(self._durable_offset)
        self._offset = self._durable_offset
        self._durable_changed.set()  # every waiter looks again: theirs may be lost
        self._durable_changed = trio.Event()

    async def run_flusher(self) -> None:
        """Group commit: flush whatever was written since the last flush, in a thread."""
        self._flusher_running = True
        try:
            while True:
                await self._wanted.wait()
                self._wanted = trio.Event()
                target, offset = self.written, self._offset
                if target <= self._durable:
                    continue
                self._flushing = True
                try:
                    await trio.to_thread.run_sync(os.fdatasync, self._fd)
                except OSError as exc:
                    self._flush_failed(exc)
                    continue
                finally:
                    self._flushing = False
                self.flushes += 1
                self._mark_durable(target, offset)
        finally:
            self._flusher_running = False
            if self._durable < self.written or self.backlog:
                # stopping: whoever still waits is answered by one last flush, here
                with contextlib.suppress(AgentdError):  # logged; waiters see their record lost
                    self._write_backlog()
                    self._flush_now()

    def wants_compaction(self) -> bool:
        return self._lines >= COMPACT_AFTER

    def maybe_compact(self) -> None:
        """Rewrite the journal when it grew long; only when every record is durable.

        A rewrite that fails (no space) is logged and left for a later turn.
        """
        if (self._lines < COMPACT_AFTER or self._flushing or self._durable < self.written
                or self.backlog or self._torn is not None):
            return
        from ._fs import atomic_write

        try:
            atomic_write(self.path, _journal.compacted(self.state, KEEP_COMPLETED))
        except OSError as exc:
            log.warning("journal %s: compaction failed (%s); trying again later", self.path, exc)
        if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
            return  # not replaced
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        self.state = _journal.parse(self.path.read_bytes())
        self._lines = len(self.state.accepted) + len(self.state.completed)
        self._offset = self._durable_offset = os.fstat(self._fd).st_size
        self._end_at(self._offset)

    def close(self) -> None:
        """Close the file, giving back the room made ahead (a stopped worker's journal takes
        no more space than its records), and making a cut still owed: records a failed flush
        lost (their clients were told they did not run) must not be read after a restart."""
        if self._torn is not None:
            try:
                os.ftruncate(self._fd, self._torn)
                os.fdatasync(self._fd)
            except OSError as exc:
                log.error("journal %s: cannot cut back at %d on stop: %s; the next worker may"
                          " find commands its clients were told did not run", self.path,
                          self._torn, exc)
        elif self._room_end > self._offset:
            try:
                os.ftruncate(self._fd, self._offset)
            except OSError as exc:  # (the zeros stay: a reader stops at them)
                log.warning("journal %s: could not give back the room made ahead: %s",
                            self.path, exc)
        os.close(self._fd)
