"""Atomic file replacement with group commit, for the supervisor's worker descriptors.

One descriptor write on its own is a temp file, ``fsync``, rename and ``fsync`` of the dir: two
flushes. A session's start writes its descriptor twice and its stop twice, so launching or
stopping 100 sessions made 400 flushes, one after another, on the supervisor's event loop
(0.36 s of it blocked here on ext4, measured, before any other work).

:class:`GroupWriter` keeps the same guarantee for a whole batch at once: :meth:`~GroupWriter.
stage` writes the temp file at once (no flush); a commit, in a thread, makes every staged temp
file durable (an ``fsync`` of each, never a ``syncfs``: that would flush the whole filesystem,
other programs' writes too), renames each over its target, and ``fsync``\\ s each directory
once. A reader sees the old file or the new one, whole, and after a power loss too. Until its
commit a write is not visible: whoever must not act before its write is durable awaits
:meth:`~GroupWriter.durable` (a worker's gate, a stop). The commits run one at a time; writes
staged during one go to the next, so concurrent starts and stops share their flushes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import trio

from . import _fs
from ._fs import write_all

log = logging.getLogger("trio_agentd.groupwrite")

Commit = Callable[[list[tuple[str, str]]], dict[str, OSError]]


# fsyncs of one commit in flight at once, at most (see _sync_data)
SYNC_THREADS = 16


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _side_by_side(fn: Callable[[str], None], items: list[str]) -> dict[str, Exception]:
    """``fn(item)`` for each item, up to ``SYNC_THREADS`` of them in flight at once; what
    raised, by item (every call has ended by the time this returns).

    The calling thread (the commit's) takes its share of the items with the helper threads
    it starts: a batch of n starts n - 1 threads, none for one item. A thread's start costs
    more than a small file's fsync on a fast disk, and a respawn's commit holds two files (its
    token and its descriptor): with a helper for each it took 1.6-1.9 ms, measured, against
    0.6-0.8 ms with the commit's thread doing one of the two."""
    import threading

    todo = iter(items)
    lock = threading.Lock()
    failed: dict[str, Exception] = {}

    def work() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            try:
                fn(item)
            except Exception as exc:  # reported to the caller, by item
                failed[item] = exc

    helpers = [threading.Thread(target=work, name="trio-agentd fsync", daemon=True)
               for _ in range(min(len(items), SYNC_THREADS) - 1)]
    started: list[threading.Thread] = []
    try:
        for t in helpers:
            t.start()
            started.append(t)
    finally:
        work()  # (also when a thread could not be started: the items are done here)
        for t in started:
            t.join()
    return failed


def _sync_data(tmps: list[str]) -> None:
    """Make the temp files' data durable: an ``fsync`` of each, and nothing else. (A
    ``syncfs`` would flush every dirty page of the filesystem, other programs' too: on a
    shared disk it took from 1 to over 80 ms, measured, where the few small files a commit
    wrote take well under 1 ms each.)

    A batch's fsyncs run side by side (``SYNC_THREADS`` at most, :func:`_side_by_side`): the
    filesystem's journal makes fsyncs that wait at the same time durable in one commit, where
    one after another each waits for its own. A clean shutdown with 100 sessions commits 100
    descriptors twice: 100 fsyncs took 55-180 ms one after another and 22-35 ms eight at a
    time on the shared disk (ext4), measured. Raises OSError (the first one; every fsync has
    ended by then)."""
    failed = _side_by_side(_fsync_file, tmps)
    for tmp in tmps:
        if tmp in failed:
            raise failed[tmp]


def _sync_dirs(dirs: list[str]) -> dict[str, OSError]:
    """``fsync`` each directory, side by side as :func:`_sync_data` does its files (a launch
    of many sessions commits each one's own session directory: one per session, with the
    descriptors' and tokens'); what failed, by directory."""
    failed: dict[str, OSError] = {}
    for d, problem in _side_by_side(_fs.fsync_dir, dirs).items():
        if not isinstance(problem, OSError):
            raise problem
        failed[d] = problem
    return failed


def commit(batch: list[tuple[str, str]]) -> dict[str, OSError]:
    """Make ``(path, temp file)`` pairs durable and rename each over its path (in a thread).
    What failed, by path (its temp file is removed; the old file stays whole)."""
    failed: dict[str, OSError] = {}
    dirs = sorted({os.path.dirname(p) or "." for p, _ in batch})
    try:
        _sync_data([t for _, t in batch])
    except OSError:
        # find out which: one at a time (a failed flush may have lost data: never rename it)
        for path, tmp in batch:
            try:
                _fsync_file(tmp)
            except OSError as exc:
                failed[path] = exc
    for path, tmp in batch:
        if path in failed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            continue
        try:
            os.replace(tmp, path)
        except OSError as exc:
            failed[path] = exc
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    for d, why in _sync_dirs(dirs).items():
        for path, _ in batch:
            if (os.path.dirname(path) or ".") == d:
                failed.setdefault(path, why)
    return failed


class GroupWriter:
    """Staged atomic writes, committed in groups. Used from one trio run."""

    def __init__(self, *, commit_batch: Commit = commit, threaded: bool = True) -> None:
        """``threaded=False`` commits on the event loop itself (blocking it, as a plain atomic
        write does): for ``MockClock`` tests, where a wait on a thread lets virtual time jump."""
        self._commit = commit_batch
        self._threaded = threaded
        self._staged: dict[str, str] = {}  # path -> its newest temp file
        self._seq = 0  # writes staged so far
        self._done = 0  # ... and committed (durable, or failed)
        self._committing: set[str] = set()  # paths of the commit under way
        self._dropped: set[str] = set()  # forgotten while their commit was under way
        self._failed: dict[str, tuple[int, OSError]] = {}  # path -> (seq, why), newest
        self._changed = trio.Event()
        self._wanted = trio.Event()
        self._busy = False
        self.running = False  # a :meth:`run` task commits what is staged
        self.commits = 0

    def stage(self, path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> int:
        """Write ``data`` for ``path`` into a temp file beside it (no flush yet); the write's
        sequence number for :meth:`durable`. A newer write of the same path replaces it.

        Raises:
            OSError: the temp file could not be written (nothing is staged; the old one is).
        """
        path = os.fspath(path)
        directory = os.path.dirname(path) or "."
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        old = self._staged.pop(path, None)
        if old is not None:
            with contextlib.suppress(OSError):
                os.unlink(old)
        self._staged[path] = tmp
        self._dropped.discard(path)
        self._seq += 1
        self._wanted.set()
        return self._seq

    def drop(self, path: str | os.PathLike[str]) -> None:
        """Forget staged writes of ``path`` (the file is being deleted): none brings it back."""
        path = os.fspath(path)
        tmp = self._staged.pop(path, None)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if path in self._committing:
            self._dropped.add(path)  # unlinked again once that commit is done

    async def settled(self) -> None:
        """Return once no commit is under way: a path dropped while one held it is unlinked by
        then (a file the caller deleted cannot come back after this returns)."""
        while self._busy:
            await self._changed.wait()

    @property
    def pending(self) -> int:
        return len(self._staged)

    async def durable(self, seq: int | None = None, path: str | os.PathLike[str] | None = None
                      ) -> None:
        """Return once write ``seq`` (default: every write staged so far) is committed.

        Raises:
            OSError: ``path``'s write could not be committed (the file keeps its old content).

        Cancellation: the caller stops waiting; a commit under way completes.
        """
        target = self._seq if seq is None else seq
        while self._done < target:
            if self._busy:
                await self._changed.wait()
            else:
                await self._commit_staged()
        if path is not None:
            failure = self._failed.get(os.fspath(path))
            if failure is not None and failure[0] >= (seq or 0):
                raise failure[1]

    async def run(self) -> None:
        """Commit whatever is staged, as soon as it is (a service task)."""
        self.running = True
        try:
            while True:
                await self._wanted.wait()
                self._wanted = trio.Event()
                if self._busy:
                    await self._changed.wait()
                if self._staged:
                    await self._commit_staged()
        finally:
            self.running = False

    async def _commit_staged(self) -> None:
        self._busy = True
        batch = list(self._staged.items())
        upto = self._seq
        self._staged.clear()
        self._committing = {p for p, _ in batch}
        failed: dict[str, OSError] = {}
        try:
            if batch:
                if self._threaded:
                    failed = await trio.to_thread.run_sync(self._commit, batch)
                else:
                    await trio.lowlevel.checkpoint()
                    failed = self._commit(batch)
                self.commits += 1
        except BaseException:
            for _, tmp in batch:  # the thread did not finish (cannot happen but for bugs)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
        finally:
            for path in self._dropped:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._dropped.clear()
            self._committing = set()
            for path, exc in failed.items():
                log.error("could not write %s: %s", path, exc)
                self._failed[path] = (upto, exc)
            for path, _ in batch:
                if path not in failed:
                    self._failed.pop(path, None)
            self._done = max(self._done, upto)
            self._busy = False
            self._changed.set()
            self._changed = trio.Event()
