"""The worker's watch on the ownership registry: re-fence when it changes (dnotify, else
inotify, else a poll), and the fence's record reads cached while nothing changed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from .timing import Timing

if TYPE_CHECKING:
    from ._workerconn import Conn

log = logging.getLogger("trio_agentd.worker")


class RegistryWatcher(Protocol):
    """What the re-fence needs of a registry watcher: ``_dnotify.DirNotify``,
    ``_inotify.Watcher``, or a fake one (``trio_agentd.testing.FakeWatcher``)."""

    def watch(self, path: Path) -> bool: ...

    def pending(self) -> bool: ...

    async def wait(self) -> None: ...


def watched_refence(
    watcher: RegistryWatcher, registry: Path, timing: Timing,
    conns: Callable[[], Iterable[Conn]], on_wake: Callable[[], None] = lambda: None,
) -> tuple[Callable[[str], None], Callable[[], Awaitable[None]]]:
    """``(watch_claims, wait_change)`` for a :class:`WorkerCore` that re-fences when the
    registry changes: an authenticated supervisor's record dir is watched, and the re-fence
    loop waits for a change, or ``refence_fallback`` at most (a change not reported).
    ``on_wake`` runs each time the loop wakes, once the watches are in place again."""

    def watch_claims(generation: str) -> None:
        watcher.watch(registry)
        watcher.watch(registry / f"{generation}.owner")
        on_wake()

    async def wait_change() -> None:
        with trio.move_on_after(timing.refence_fallback):
            await watcher.wait()
        # a record dir that was removed and made again needs its watch again
        for conn in conns():
            watcher.watch(registry / f"{conn.fence.claim.generation}.owner")
        on_wake()

    return watch_claims, wait_change


class CachedRecords:
    """The fence's record reads, from memory while the registry watch reports no change.

    A command's fence check reads its supervisor's record (an open, a stat, a read): most of
    what a worker spends on a prompt beyond the journal's flush. With the registry watched the
    kernel says whether anything changed (``pending``: a counter for dnotify, one ``poll`` for
    inotify): while no change is pending and the re-fence loop has not woken since (it takes
    the changes, watches a record dir made again, and wakes on the slow fallback poll anyway),
    the bytes read last are the bytes on disk. A pending change means a read from disk,
    uncached, until the loop has dealt with it. Only a few generations are remembered (a
    supervisor and its successor).
    """

    _KEEP = 4

    def __init__(self, read: Callable[[str], bytes | None], pending: Callable[[], bool]) -> None:
        self._read = read
        self._pending = pending
        self._cache: dict[str, bytes | None] = {}
        self.reads = 0  # reads that went to the file

    def invalidate(self) -> None:
        self._cache.clear()

    def __call__(self, generation: str) -> bytes | None:
        if self._pending():
            self._cache.clear()  # something changed: read, and trust nothing until the loop ran
            self.reads += 1
            return self._read(generation)
        if generation in self._cache:
            return self._cache[generation]
        self.reads += 1
        raw = self._read(generation)
        if len(self._cache) >= self._KEEP:
            self._cache.clear()
        self._cache[generation] = raw
        return raw


def registry_watcher(registry: Path, *, poll: bool) -> Any:
    """A watcher on the registry: dnotify (no per-user limit), else inotify (whose instances
    are the user's, 128 by default, shared with every program), else None (then: polling).
    Made in the worker's main thread, inside its trio run."""
    if poll:
        return None
    watcher: Any
    try:
        from ._dnotify import DirNotify

        watcher = DirNotify()
    except OSError as exc:
        log.info("no dnotify (%s): watching the registry with inotify", exc)
        try:
            from ._inotify import Watcher

            watcher = Watcher()
        except OSError as exc2:
            log.warning("no inotify either (%s): re-fencing by polling every 250 ms (raise"
                        " fs.inotify.max_user_instances if that is the cause)", exc2)
            return None
    watcher.watch(registry)
    return watcher
