"""Size-bounded logs: ``NAME`` → ``NAME.1`` → … → ``NAME.<backups>``, the oldest deleted.

Used for the supervisor's ``daemon.log``, each session's ``worker.log`` (both also the process's
stderr, so a rotation points stderr at the new file: a traceback at exit lands there too) and
each session's ``transcript.jsonl`` (see :class:`trio_agentd._session.Transcript`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from . import _defaults
from ._defaults import ENV_LOG_BACKUPS, ENV_LOG_MAX_BYTES, ENV_OUTPUT_MAX_BYTES
from ._fs import write_all
from ._storage import errno_name


@dataclass(frozen=True, slots=True)
class Limits:
    max_bytes: int = _defaults.LOG_MAX_BYTES  # 0: never rotate
    backups: int = _defaults.LOG_BACKUPS
    # a session's turn output files kept in all (0: no bound): see _output.prune
    output_max_bytes: int = _defaults.OUTPUT_MAX_BYTES


def limits_from_env(env: dict[str, str] | None = None) -> Limits:
    """The limits from ``TRIO_AGENTD_LOG_MAX_BYTES`` / ``TRIO_AGENTD_LOG_BACKUPS`` /
    ``TRIO_AGENTD_OUTPUT_MAX_BYTES``.

    Raises:
        ValueError: a value that is not a whole number >= 0 (backups >= 1), naming it.
    """
    source = os.environ if env is None else env
    max_bytes = _whole(source, ENV_LOG_MAX_BYTES, _defaults.LOG_MAX_BYTES, 0)
    backups = _whole(source, ENV_LOG_BACKUPS, _defaults.LOG_BACKUPS, 1)
    output = _whole(source, ENV_OUTPUT_MAX_BYTES, _defaults.OUTPUT_MAX_BYTES, 0)
    return Limits(max_bytes, backups, output)


def _whole(env: os._Environ[str] | dict[str, str], name: str, default: int, least: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name} must be a whole number >= {least} (got {raw!r})")
    return value


def backup_path(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def existing_files(path: Path, backups: int | None = None) -> list[Path]:
    """The files of a rotated log, oldest first, ending with ``path`` itself (if it exists)."""
    out: list[Path] = []
    n = 1
    while backups is None or n <= backups:
        p = backup_path(path, n)
        if not p.exists():
            break
        out.append(p)
        n += 1
    out.reverse()
    if path.exists():
        out.append(path)
    return out


def shift(path: Path, backups: int) -> None:
    """``path`` becomes ``path.1``, ``path.1`` becomes ``path.2`` …; ``path.<backups>`` goes."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(backup_path(path, backups))
    for n in range(backups - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.replace(backup_path(path, n), backup_path(path, n + 1))
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, backup_path(path, 1))


class RotatingLog(logging.Handler):
    """A log file that rotates once past ``limits.max_bytes``.

    ``stdio``: descriptors (1, 2) that were the log file when this handler was made, and are
    pointed at each new file after a rotation, so what the process (or an agent it started)
    writes there stays bounded too. Several processes may append to one log (a supervisor and
    the autostarted one that lost the race): each rotates by the size it sees, as supervisord's
    own rotation does.
    """

    def __init__(self, path: Path, limits: Limits, *, stdio: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.path = path
        self.limits = limits
        self._fd = self._open()
        self._lost = 0  # lines the file system refused since the last one written
        self._lost_cause = ""
        ident = _identity(self._fd)
        self._stdio = tuple(fd for fd in stdio if _identity(fd) == ident)

    def _open(self) -> int:
        from ._fs import open_trusted

        return open_trusted(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def emit(self, record: logging.LogRecord) -> None:
        """Write one line. A write the file system refuses (a full disk, a file-size limit)
        loses the line, never the process, and prints no traceback anywhere: the lines lost
        are counted, and the first line that can be written again says how many and why."""
        try:
            data = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:
            self.handleError(record)  # a bug in a log call: logging's own report
            return
        self.acquire()
        try:
            if self._lost:
                note = (f"{logging.Formatter().formatTime(record)} {self._lost} log line(s)"
                        f" lost: {self._lost_cause}\n").encode()
                self._maybe_rotate(len(note) + len(data))
                write_all(self._fd, note)
                self._lost, self._lost_cause = 0, ""
            else:
                self._maybe_rotate(len(data))
            write_all(self._fd, data)
        except OSError as exc:
            self._lost += 1
            self._lost_cause = f"{errno_name(exc)} writing {self.path} ({exc.strerror or exc})"
        finally:
            self.release()

    def _maybe_rotate(self, adding: int) -> None:
        limit = self.limits.max_bytes
        if limit <= 0:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == _identity(self._fd):
            if st.st_size == 0 or st.st_size + adding <= limit:
                return
            shift(self.path, self.limits.backups)
        # rotated here, or by another process (or deleted): continue in a new file
        fd = self._open()
        for target in self._stdio:
            with contextlib.suppress(OSError):
                os.dup2(fd, target)
        os.close(self._fd)
        self._fd = fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        super().close()


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


