"""A minimal Linux inotify watcher for trio (ctypes; no dependency).

A worker re-fences when the ownership registry *changes* instead of waking 4 times a second to
look: 100 idle workers polling cost ~10 % of a core, watching costs nothing until something
changes — and a lost claim is noticed sooner, not later. A slow fallback poll covers what a watch
cannot see (a registry on a filesystem that does not report events). Workers watch with
``_dnotify.DirNotify`` first, which counts against no per-user limit; this is the second choice,
where dnotify is missing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import sys

import trio

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
MASK = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
    | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
)


class Watcher:
    """Wake when anything changes in the watched directories."""

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, "inotify is Linux-only")
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd
        self.wakeups = 0
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def pending(self) -> bool:
        """Whether events are queued that :meth:`wait` has not drained yet (one ``poll``)."""
        return bool(self._poll.poll(0))

    def watch(self, path: str | os.PathLike[str]) -> bool:
        """Watch a directory (again: adding an existing watch is a no-op). False if absent."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), MASK)
        return bool(wd >= 0)

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                if not os.read(self.fd, 65536):
                    return got
                got = True
            except BlockingIOError:
                return got

    async def wait(self) -> None:
        """Return once something changed (events are drained).

        Cancellation: safe; pending events stay queued for the next call.
        """
        while True:
            if self._drain():
                self.wakeups += 1
                return
            await trio.lowlevel.wait_readable(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
