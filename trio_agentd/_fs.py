"""Small filesystem primitives: atomic JSON writes and kernel (flock) locks.

Locks never guess staleness from mtimes: the kernel drops a flock when its holder dies. After
taking one we check that the path still names the inode we locked (a temp cleaner may have
unlinked it); if not we retry on the new file.
"""

from __future__ import annotations

import errno
import fcntl
import os

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from contextlib import AbstractAsyncContextManager, AbstractContextManager
    from pathlib import Path
    from typing import Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write is retried, not ignored)."""
    n = os.write(fd, data)
    if n == len(data):  # (the usual case: no view to make)
        return
    if n <= 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    view = memoryview(data)[n:]
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the directory."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:  # noqa: SIM105 - contextlib is not imported on the ps path
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, mode: int = 0o600) -> None:
    atomic_write(path, json.dumps(obj, sort_keys=True).encode(), mode=mode)


class UntrustedFile(ValueError):
    """A state file another user could have written (or a symlink): refused like a corrupt
    one, with this message as the logged reason."""


def torn_tail(data: bytes) -> int | None:
    """Where the last line of a file's ``data`` starts if it is torn (no newline: its writer was
    killed in the middle of an append, which the kernel cuts at a page boundary), else ``None``."""
    return data.rfind(b"\n") + 1 if data and not data.endswith(b"\n") else None


def seal_torn_tail(fd: int, start: int) -> None:
    """End a torn last line (starting at ``start``) with a newline, so the next record starts a
    line of its own and parses; with no room for that byte, cut the torn line off instead."""
    try:
        write_all(fd, b"\n")
    except OSError:
        os.ftruncate(fd, start)


def open_trusted(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symlink and a file that is not ours or is writable by others.

    Raises:
        UntrustedFile: naming the path and what is wrong with it.
        OSError: as ``os.open`` (``FileNotFoundError`` when it does not exist).
    """
    from ._trust import file_problem

    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFile(f"{os.fspath(path)} is a symlink — not trusted") from None
        raise
    try:
        problem = file_problem(os.fstat(fd), os.getuid())
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise UntrustedFile(
            f"{os.fspath(path)} {problem} — not trusted; remove it if it is not yours"
        )
    return fd


def read_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """The file's bytes, or ``None`` when it (or its directory) does not exist.

    Raises:
        UntrustedFile: a symlink, or a file not ours or writable by others.
    """
    try:
        fd = open_trusted(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def read_all(fd: int) -> bytes:
    """What is left to read of ``fd``, with plain reads (a small file takes two; a file
    object would add an ``fstat``, an ``isatty`` ioctl and two ``lseek`` calls: the
    supervisor reads its owner record on every command and four times a second)."""
    parts: list[bytes] = []
    size = 1 << 16
    while chunk := os.read(fd, size):
        parts.append(chunk)
        size = min(size * 4, 1 << 24)  # (a big journal: few reads, not thousands)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _open_lock_file(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _still_names(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def try_lock(path: str | os.PathLike[str], *, shared: bool = False) -> int | None:
    """Take the flock on ``path`` without blocking: its fd, or ``None`` if someone holds it."""
    p = os.fspath(path)
    flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    for _ in range(100):
        fd = _open_lock_file(p)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _still_names(p, fd):
            return fd
        os.close(fd)  # unlinked or replaced under us: lock the new file
    raise OSError(f"lock file {p} keeps being replaced")


def unlock(fd: int) -> None:
    try:  # noqa: SIM105 - contextlib is not imported on the ps path
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    os.close(fd)


def is_locked(path: str | os.PathLike[str]) -> bool:
    """Whether someone holds an exclusive flock on ``path`` (probe with a shared lock)."""
    if not os.path.exists(path):
        return False
    fd = try_lock(path, shared=True)
    if fd is None:
        return True
    unlock(fd)
    return False


def locked(
    path: str | os.PathLike[str], *, poll: float = 0.005
) -> AbstractAsyncContextManager[int]:
    """Hold the exclusive flock on ``path``, polling without blocking the event loop.

    Cancellation: a cancelled waiter never holds the lock (nothing takes it later on its behalf,
    unlike a blocking flock in an abandoned thread).
    """
    import contextlib  # here: ps imports this module on every call, and never locks

    return contextlib.asynccontextmanager(_locked)(path, poll)


async def _locked(path: str | os.PathLike[str], poll: float) -> AsyncIterator[int]:
    import trio

    from .timing import LOCK_POLL_MAX

    delay = poll
    while True:
        fd = try_lock(path)
        if fd is not None:
            break
        await trio.sleep(delay)
        delay = min(delay * 2, LOCK_POLL_MAX)
    try:
        yield fd
    finally:
        unlock(fd)


def locked_sync(path: str | os.PathLike[str]) -> AbstractContextManager[int]:
    """Blocking variant for synchronous tools; the kernel releases it if we die."""
    import contextlib  # here: ps imports this module on every call, and never locks

    return contextlib.contextmanager(_locked_sync)(path)


def _locked_sync(path: str | os.PathLike[str]) -> Iterator[int]:
    p = os.fspath(path)
    while True:
        fd = _open_lock_file(p)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _still_names(p, fd):
            break
        os.close(fd)
    try:
        yield fd
    finally:
        unlock(fd)


def ensure_dir(path: str | Path) -> None:
    """Create a state dir (and its missing parents) 0700 whatever the umask, and prove it ours.

    Raises:
        AgentdError: ``permission_denied`` for a dir another user could write in.
    """
    from ._trust import make_private_dirs

    make_private_dirs(path)
