"""The trust boundary is the uid: proofs that a directory, a file or a socket peer is ours.

Every client proves a socket before it sends a byte (:func:`prove_socket_dir` before connecting,
:func:`prove_peer` after); the supervisor and the workers prove the socket dir before every bind;
every directory the daemon creates is made 0700 whatever the umask (:func:`make_private_dirs`);
files another user could have written are refused by ``_fs.read_bytes``.

The verdicts are pure functions of a stat result and our uid (:func:`dir_problem`,
:func:`file_problem`), so the unit tests can feed them faked ``stat`` results; the rest is a thin
shell of ``lstat``/``mkdir``/``getsockopt`` calls. Kept free of trio and cheap to import: the
CLI's warm path proves its socket on every command.
"""

from __future__ import annotations

import os
import stat
import sys

from ._defaults import ENV_LOG_BACKUPS, ENV_LOG_MAX_BYTES, ENV_OUTPUT_MAX_BYTES
from ._earlytemplate import isolated_python as isolated_python
from ._errors import AgentdError, ErrorCode, NoSupervisor
from ._paths import FIX_HOME

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import socket
    from collections.abc import Mapping
    from typing import Protocol

    from ._paths import Layout

    class _Socket(Protocol):
        def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


def dir_problem(st: os.stat_result, uid: int, *, private: bool) -> str | None:
    """Why a directory (its ``lstat``) is not trusted, or ``None`` if it is.

    ``private``: no group or other permission bits at all (a socket dir); otherwise only no
    group or other *write* bit (a state dir: nobody else can add or replace files in it).
    """
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if private and mode & 0o077:
        return f"has mode {mode:04o} (group or others may use it), not 0700"
    if mode & 0o022:
        return f"has mode {mode:04o} (group or others may write in it)"
    return None


def file_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a state file (its ``fstat``) is not trusted, or ``None`` if it is."""
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if mode & 0o022:
        return f"has mode {mode:04o} (group or others may write it)"
    return None


def _refuse(kind: str, path: str, problem: str, fix: str) -> AgentdError:
    return AgentdError(
        ErrorCode.PERMISSION_DENIED,
        f"{kind} {path} {problem} — not trusted, nothing was sent; {fix}",
        {"path": path, "untrusted": problem},
    )


def prove_socket_dir(path: str) -> None:
    """The socket dir is a real directory of ours with mode 0700 (no group/other bits).

    Raises:
        AgentdError: ``permission_denied`` naming the path, what is wrong and the fix;
            ``daemon_unavailable`` if it does not exist (nothing can listen there).
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise NoSupervisor(f"no supervisor is running on {path} (no such directory)") from None
    problem = dir_problem(st, os.getuid(), private=True)
    if problem is not None:
        raise _refuse(
            "socket directory", path, f"{problem} (owner uid {st.st_uid}, mode"
            f" {stat.S_IMODE(st.st_mode):04o})",
            "remove it if it is not yours, or use another --socket"
            if st.st_uid != os.getuid() or stat.S_ISLNK(st.st_mode)
            else f"remove it (rm -r {path}) or run: chmod 700 {path}",
        )


def peer_uid(sock: _Socket) -> int | None:
    """The uid of a connected Unix-socket peer (``SO_PEERCRED``), or ``None`` where the OS has
    no such option (there the socket dir's proof stands alone)."""
    import _socket  # not socket: its import costs more than a ps

    option = getattr(_socket, "SO_PEERCRED", None)
    if option is None:
        return None
    raw = sock.getsockopt(_socket.SOL_SOCKET, option, 12)  # struct ucred: pid, uid, gid
    return int.from_bytes(raw[4:8], sys.byteorder, signed=True)


def prove_peer(sock: _Socket, path: str) -> None:
    """The process listening on ``path`` runs as our uid.

    Raises:
        AgentdError: ``permission_denied`` naming the socket and the peer's uid.
    """
    uid = peer_uid(sock)
    if uid is not None and uid != os.getuid():
        raise _refuse(
            "socket", path, f"is served by a process of uid {uid}, not yours (uid {os.getuid()})",
            "stop that process or use another --socket",
        )


def bind_private(path: str, backlog: int = 128) -> socket.socket:
    """A Unix stream socket bound at ``path`` with mode 0600 (nobody else may connect) and
    listening; the caller has proven the dir and dealt with what was at the path. Bound on the
    caller's thread: the path is in the daemon's private socket dir, so the lookup does not
    block (trio's ``bind`` of a path runs in a thread, whose start costs more).

    Raises:
        OSError: the bind or listen failed (the socket is closed).
    """
    import socket

    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            raw.bind(path)
        finally:
            os.umask(old)
        raw.listen(backlog)
    except BaseException:
        raw.close()
        raise
    return raw


def make_private_dirs(path: str | os.PathLike[str], *, private: bool = False) -> None:
    """Create ``path`` and its missing parents, each 0700 whatever the umask, and prove it.

    Existing parents are left as they are; an existing ``path`` is never chmodded: if it fails
    the proof (another owner, writable by others; when ``private``: a symlink, or any
    group/other bit) it is refused.

    Raises:
        AgentdError: ``permission_denied`` (or ``config`` when it cannot be created) naming the
            path, the cause and the fix.
    """
    target = os.path.normpath(os.path.abspath(os.fspath(path)))
    missing: list[str] = []
    cur = target
    while not os.path.lexists(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)  # never follows a symlink at d: it would exist
        except FileExistsError:
            continue  # made by someone meanwhile: proven below if it is the target
        except OSError as exc:
            raise AgentdError(
                ErrorCode.CONFIG,
                f"cannot create directory {d}: {exc.strerror} — check the permissions of"
                f" {os.path.dirname(d)}",
                {"path": d},
            ) from None
        os.chmod(d, 0o700)  # a umask of 0777 would have left it 0000
    # a socket dir must not be a symlink; a state dir may be one (a home moved to another
    # disk), and then what it points to is proven
    st = os.lstat(target) if private else os.stat(target)
    problem = dir_problem(st, os.getuid(), private=private)
    if problem is not None:
        kind = "socket directory" if private else "directory"
        raise AgentdError(
            ErrorCode.PERMISSION_DENIED,
            f"{kind} {target} {problem} — not trusted; remove it if it is not yours, or"
            f" fix it (chmod 700 {target})",
            {"path": target, "untrusted": problem},
        )


# --- what reaches an agent ---------------------------------------------------------------------

# the daemon's own knobs a worker reads at start (and then removes from its environment)
WORKER_KNOBS = (
    "TRIO_AGENTD_TIMING", "TRIO_AGENTD_REFENCE_POLL", ENV_LOG_MAX_BYTES, ENV_LOG_BACKUPS,
    ENV_OUTPUT_MAX_BYTES,
)


def agent_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What an agent sees: the creating client's environment minus the daemon's variables."""
    return {k: v for k, v in env.items() if not k.startswith("TRIO_AGENTD_")}


def session_environment(meta: Mapping[str, object]) -> dict[str, str]:
    """The environment recorded for a session at its creation (``env`` of its metadata).

    A session recorded before environments were (or by a client that sent none) gets the
    daemon's own environment, minus the daemon's variables.
    """
    env = meta.get("env")
    if isinstance(env, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        return agent_environment(env)
    return agent_environment(os.environ)


def daemon_knobs(env: Mapping[str, str]) -> dict[str, str]:
    return {k: env[k] for k in WORKER_KNOBS if k in env}


def agent_import_path(cwd: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """Where a ``module:attribute`` agent is imported from: the session's cwd, then the
    ``PYTHONPATH`` of the environment it was created with (relative entries from the cwd)."""
    out: list[str] = [cwd]
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            path = os.path.normpath(os.path.join(cwd, entry))
            if path not in out:
                out.append(path)
    return tuple(out)


def creation_blocker(path: str) -> str | None:
    """Why ``path`` can neither exist nor be created, judged without creating anything.

    ``None`` if it exists as a directory, or its nearest existing ancestor is a directory we
    may write in (whether ``mkdir`` then succeeds is only known by trying)."""
    cur = path
    while True:
        try:
            st = os.stat(cur)
        except (FileNotFoundError, NotADirectoryError):  # find what is missing, or a file
            parent = os.path.dirname(cur)
            if parent == cur:
                return f"{cur} does not exist"
            cur = parent
            continue
        except OSError as exc:
            return f"{cur}: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{cur} is not a directory"
        if cur != path and not os.access(cur, os.W_OK | os.X_OK):
            return f"{cur} is not writable, so {path} cannot be created"
        if cur == path and not os.access(cur, os.R_OK | os.X_OK):
            return f"{cur} is not readable"
        return None


def home_problem(layout: Layout) -> AgentdError | None:
    """An error naming the cause and the fix if the home or the registry cannot be used
    (cannot exist, nor be created); ``None`` otherwise. Creates nothing."""
    try:
        home = layout.home_dir
        registry = layout.registry_dir
    except AgentdError as exc:
        return exc
    for what, path, fix in (
        ("home", home, FIX_HOME),
        ("ownership registry", registry,
         "set TRIO_AGENTD_REGISTRY_DIR to a directory you can write, or fix HOME"),
    ):
        why = creation_blocker(path)
        if why is None:
            continue
        if what == "home" and layout.home_source is not None:
            fix = f"set {layout.home_source} to a directory you can write"
        elif what == "home":
            fix = f"{fix} (the home comes from {layout.home_origin()})"
        elif layout.registry_explicit and os.environ.get("TRIO_AGENTD_REGISTRY_DIR"):
            fix = "set TRIO_AGENTD_REGISTRY_DIR to a directory you can write"
        return AgentdError(
            ErrorCode.CONFIG, f"cannot use {path} as the {what}: {why} — {fix}",
            {"path": path},
        )
    return None
