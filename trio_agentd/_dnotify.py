"""Directory change notification by signal (Linux dnotify), for trio: no instance limit.

Workers watch the ownership registry to re-fence when it changes. inotify does that well, but its
instances are a per-user budget (``fs.inotify.max_user_instances``, 128 by default) shared with
every program the user runs: editors, file sync, ``tail -f``, systemd's path units. One instance
per worker would leave a user with 100 sessions almost none for their editor, and from about the
128th session on the workers would fall back to polling (300 sessions measured 32.5 % of a core
idle that way, against 1.3 % for 100). dnotify marks a directory through an open descriptor and
sends the process ``SIGIO`` when an entry in it is created, deleted, renamed, written or changes
its attributes: one descriptor per watched directory, and no per-user limit.

The signal only counts: a Python handler adds one to every live watcher's counter and wakes its
trio run (``TrioToken.run_sync_soon`` is signal-safe). The kernel makes ``SIGIO`` pending inside
the writer's system call and hands it to the main thread when that thread can take it, so a
change made before a command reached the worker is counted by the time the worker looks at the
counter for that command. (Should a helper thread take the signal instead, the count lands at the
main thread's next bytecode boundary: the window inotify's queue does not have, and the reason the
fence still reads the record itself for any generation it has not read before.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import threading
from types import FrameType

import trio

_F_NOTIFY: int = getattr(fcntl, "F_NOTIFY", -1)  # Linux only
MASK = (
    getattr(fcntl, "DN_MODIFY", 0) | getattr(fcntl, "DN_CREATE", 0)
    | getattr(fcntl, "DN_DELETE", 0) | getattr(fcntl, "DN_RENAME", 0)
    | getattr(fcntl, "DN_ATTRIB", 0) | getattr(fcntl, "DN_MULTISHOT", 0)
)

_live: set[DirNotify] = set()  # the watchers SIGIO counts for (a worker has one)


def _on_sigio(signum: int, frame: FrameType | None) -> None:
    for watcher in list(_live):
        watcher._count()


class DirNotify:
    """Wake when anything changes in the watched directories (the ``_inotify.Watcher`` shape).

    Must be made in the main thread, inside ``trio.run``: it installs the ``SIGIO`` handler and
    wakes that run. Once closed, ``SIGIO`` is ignored (never its default action, which would end
    the process).
    """

    def __init__(self) -> None:
        if _F_NOTIFY < 0:
            raise OSError(errno.ENOSYS, "dnotify (fcntl F_NOTIFY) is Linux-only")
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.EINVAL, "dnotify: a signal handler needs the main thread")
        self._token = trio.lowlevel.current_trio_token()
        self._changes = 0  # SIGIOs counted
        self._seen = 0  # changes the last wait() returned for
        self._event = trio.Event()
        self._dirs: dict[str, tuple[int, int, int]] = {}  # path -> (fd, st_dev, st_ino)
        self.wakeups = 0
        if not _live:
            signal.signal(signal.SIGIO, _on_sigio)
        _live.add(self)

    def _count(self) -> None:
        self._changes += 1
        # once its run has ended nothing waits on this watcher any more
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._wake, idempotent=True)

    def _wake(self) -> None:
        self._event.set()

    def pending(self) -> bool:
        """Whether a change was signalled that :meth:`wait` has not returned for yet."""
        return self._changes != self._seen

    def watch(self, path: str | os.PathLike[str]) -> bool:
        """Watch a directory (again: the same directory is a no-op, one made again is watched
        anew). False if absent."""
        key = os.fspath(path)
        held = self._dirs.get(key)
        if held is not None:
            try:
                st = os.stat(key)
            except OSError:
                self._forget(key)
                return False
            if (st.st_dev, st.st_ino) == held[1:]:
                return True
            self._forget(key)
        try:
            fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.fcntl(fd, _F_NOTIFY, MASK)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        self._dirs[key] = (fd, st.st_dev, st.st_ino)
        return True

    def _forget(self, key: str) -> None:
        held = self._dirs.pop(key, None)
        if held is not None:
            os.close(held[0])

    def _prune(self) -> None:
        """Let go of watched directories that were removed (a successor's record dir stays)."""
        for key, (fd, _dev, _ino) in list(self._dirs.items()):
            if os.fstat(fd).st_nlink == 0:
                self._forget(key)

    async def wait(self) -> None:
        """Return once something changed since the last return.

        Cancellation: safe; a change signalled meanwhile is returned for by the next call.
        """
        while self._changes == self._seen:
            self._event = trio.Event()
            await self._event.wait()
        self._seen = self._changes
        self.wakeups += 1
        self._prune()

    def close(self) -> None:
        for key in list(self._dirs):
            self._forget(key)
        _live.discard(self)
        if not _live and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGIO, signal.SIG_IGN)
