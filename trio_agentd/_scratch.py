"""The fork template's rehearsal scratch directories: where they go, and clearing those a
killed template left (a template killed in the middle of a run never removes its own)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from ._identity import _pid_exists

SCRATCH_PREFIX = "trio-agentd-rehearsal-"


def clear_stale(root: str) -> list[str]:
    """Remove the scratch directories that templates killed mid-run left in ``root`` (named
    ``SCRATCH_PREFIX<pid>-…``, ours, not a symlink, their pid gone); the names removed. A
    live pid's (another template's, rehearsing now; or a reused pid) are left alone."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SCRATCH_PREFIX):
            continue
        pid_text = name[len(SCRATCH_PREFIX):].partition("-")[0]
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (not pid_text.isdigit() or not stat.S_ISDIR(st.st_mode)
                or st.st_uid != os.getuid() or _pid_exists(int(pid_text))):
            continue
        shutil.rmtree(path, onerror=_gone_is_fine)
        removed.append(name)
    return removed


def _gone_is_fine(_func: object, _path: str, exc_info: tuple[type[BaseException],
                                                           BaseException, object]) -> None:
    """A race with another template clearing the same directory: whoever removes a file
    first wins; any other error is raised."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def scratch_root(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Where the scratch directories go: ``$TMPDIR`` if set; else ``/dev/shm`` where it can
    be written (memory: the rehearsal's journal flushes cost no disk, and no slow disk makes
    a request wait behind them); else the system's temporary directory (``None``)."""
    if env.get("TMPDIR"):
        return env["TMPDIR"]
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def root_of(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The directory the scratch directories of a template with environment ``env`` go in."""
    return scratch_root(env) or tempfile.gettempdir()
