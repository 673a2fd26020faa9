"""Where supervisors may be, for ``ps`` and ``doctor``: the registry's records, the state
dir's descriptors, the socket dir, the kernel's listening sockets and, last, the command
lines of this user's running supervisors. Local reads only, no connection.
"""

from __future__ import annotations

import os
import stat as _stat

from . import _fs
from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._doctor_plan import (
    Record,
)
from ._identity import liveness, proc_environ
from ._ownership import CorruptRecord, OwnerRecord, Scope
from ._paths import Layout, default_socket_dir, normalize_socket_path
from ._procstate import Liveness
from ._registryfiles import (
    OWNER_FILE,
    SCOPE_FILE,
    owner_dir_name,
    record_names,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from typing import Any


def read_records(registry: str | os.PathLike[str], *, check_alive: bool = True) -> list[Record]:
    """Every readable owner record. ``check_alive=False``: each ``alive`` is left ``False``
    for a caller that reads the liveness of their pids later, once (``ps``, after the
    hellos: :func:`._doctor._classified`)."""
    out: list[Record] = []
    registry = os.fspath(registry)
    try:
        names = record_names(registry)
    except OSError:
        return out  # unreadable: ps shows what it can find without it
    for name in names:
        try:
            raw = _read_trusted(os.path.join(registry, name, OWNER_FILE))
            if raw is None:
                continue
            rec = OwnerRecord.from_json(raw)
        except (CorruptRecord, _fs.UntrustedFile):
            continue
        out.append(Record(
            generation=rec.generation, pid=rec.pid, start_id=rec.start_id, socket=rec.socket,
            phase=str(rec.phase),
            alive=check_alive and liveness(rec.pid, rec.start_id) is not Liveness.DEAD,
            created_at=rec.created_at,
        ))
    return out


def _scoped_sockets(registry: str | os.PathLike[str], read: set[str]) -> list[str]:
    """The sockets the ``scope.json`` of the record dirs name, but of those dirs in ``read``:
    their ``owner.json`` was read, and a scope is the immutable part of its record (its
    socket is the record's), so it is read only where the record could not be."""
    out: list[str] = []
    registry = os.fspath(registry)
    try:
        names = record_names(registry)
    except OSError:
        return out
    for name in names:
        if name in read:
            continue
        try:
            raw = _read_trusted(os.path.join(registry, name, SCOPE_FILE))
            if raw is not None:
                out.append(Scope.from_json(raw).socket)
        except (CorruptRecord, _fs.UntrustedFile):
            continue
        except OSError:
            break  # an unreadable registry: what was read is what there is
    return out


def read_descriptors(home: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every worker descriptor (``<home>/daemons/*/workers/*.json``, no hidden names)."""
    out = []
    for path in _descriptor_paths(os.path.join(os.fspath(home), "daemons")):
        try:
            raw = _read_trusted(path)
            obj = json.loads(raw) if raw else None  # gone meanwhile: no json import to say so
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _descriptor_paths(daemons: str) -> list[str]:
    out: list[str] = []
    try:
        keys = os.listdir(daemons)
    except OSError:
        return out
    for key in keys:
        if key.startswith("."):
            continue
        workers = os.path.join(daemons, key, "workers")
        try:
            names = os.listdir(workers)
        except OSError:
            continue
        out += [os.path.join(workers, name) for name in names
                if name.endswith(".json") and not name.startswith(".")]
    return out


def _flag(args: list[str], *names: str) -> str | None:
    for flag in names:
        if flag in args[:-1]:
            return args[args.index(flag) + 1]
        for arg in args:
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def daemon_socket_of(argv: list[str]) -> str | None:
    """The socket a ``trio_agentd … daemon`` command line serves (``--socket``), or ``None``
    if it is not a supervisor's command line (or names no socket). Pure."""
    args = _daemon_args(argv)
    return None if args is None else _flag(args, "--socket", "--daemon-socket")


def daemon_home_of(argv: list[str]) -> str | None:
    """The ``--home`` a supervisor's command line names, if any. Pure."""
    args = _daemon_args(argv)
    return None if args is None else _flag(args, "--home")


def _daemon_args(argv: list[str]) -> list[str] | None:
    try:
        at = argv.index("-m")
    except ValueError:
        return None
    args = argv[at + 1 :]
    if not args or args[0] != "trio_agentd" or "daemon" not in args:
        return None
    return args


def scanned_sockets(home: str | os.PathLike[str]) -> list[str]:
    """Sockets of this user's running supervisors of ``home``, from their command lines: the
    last line of discovery, for a supervisor that lost every file that names it. (A supervisor
    started without ``--home`` is counted by the ``TRIO_AGENTD_HOME`` it runs with.)"""
    out: list[str] = []
    uid = os.getuid()
    want = os.path.normpath(os.fspath(home))
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            sock = pid_supervisor_socket(name, uid, want)
            if sock is not None:
                out.append(sock)
    return out


def pid_supervisor_socket(pid: str, uid: int, home: str) -> str | None:
    """The socket process ``pid`` serves if it is a supervisor of this user and of ``home``
    (normalised), else ``None``. Reads its command line (and only for a supervisor its owner
    and maybe its environment)."""
    raw = _read_small(f"/proc/{pid}/cmdline")
    if raw is None or b"trio_agentd" not in raw:
        return None  # gone, not ours to read, or no supervisor: the common case, one read
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    sock = daemon_socket_of(argv)
    if sock is None:
        return None
    try:
        if os.stat(f"/proc/{pid}").st_uid != uid:
            return None
    except OSError:
        return None
    its_home = daemon_home_of(argv) or _environ_home(pid)
    if its_home is None or os.path.normpath(its_home) != home:
        return None
    return sock


def _read_small(path: str) -> bytes | None:
    """A small file's bytes (a /proc entry), without a Python file object; ``None`` if it
    cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_fd(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_trusted(path: str) -> bytes | None:
    """``_fs.read_bytes`` (a symlink or a file not ours refused with ``UntrustedFile``,
    ``None`` if missing) without a Python file object: ps reads one per record, scope and
    worker descriptor."""
    try:
        fd = _fs.open_trusted(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def socket_lease_holder(sock: str) -> int | None:
    """The pid the socket's lease file (``<socket>.lock``) names, if it can be read."""
    raw = _read_small(f"{sock}.lock")
    if not raw:
        return None  # no lease file: said without json.loads(b""), whose error imports json
    try:
        pid = json.loads(raw).get("pid")
    except (ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def flock_holders() -> list[int] | None:
    """The pids that hold a flock, from one read of ``/proc/locks`` (``None`` if it cannot
    be read). Every supervisor holds its lease's flock from before it binds its socket until
    it exits, even if the lease file was deleted: a supervisor that listens is among them."""
    data = _read_small("/proc/locks")
    return None if data is None else parse_flock_holders(data)


def parse_flock_holders(data: bytes) -> list[int]:
    """The holders' pids in the text of ``/proc/locks`` (``1: FLOCK  ADVISORY  WRITE <pid>
    <dev>:<inode> 0 EOF``; a waiter's line, ``1: -> FLOCK …``, holds nothing). Pure."""
    pids = set()
    for line in data.split(b"\n"):
        fields = line.split(None, 5)
        if len(fields) >= 5 and fields[1] == b"FLOCK" and fields[4].isdigit():
            pids.add(int(fields[4]))
    pids.discard(0)  # a holder in another pid namespace: no /proc entry of ours to read
    return sorted(pids)


def _environ_home(pid: str) -> str | None:
    for entry in proc_environ(int(pid)):
        if entry.startswith(b"TRIO_AGENTD_HOME="):
            return entry.split(b"=", 1)[1].decode(errors="replace")
    return None


def listening_sockets(named: set[str]) -> list[tuple[str, bool, str]] | None:
    """The listening Unix sockets of this network namespace that look like a supervisor's (a
    ``*.sock``, not a worker's ``w-*.sock``), from one read of ``/proc/net/unix``, as
    :func:`._doctor_plan.scan_reason` takes them: ``(path, named, "ours" | "foreign" |
    "gone")``. ``None`` if they cannot be listed. A supervisor whose socket file was deleted
    still listens at the path it bound: this is how its loss shows without a process scan."""
    data = _read_small("/proc/net/unix")
    return None if data is None else _parse_listeners(data, named)


def _parse_listeners(data: bytes, named: set[str]) -> list[tuple[str, bool, str]]:
    uid = os.getuid()
    out: list[tuple[str, bool, str]] = []
    for line in data.split(b"\n")[1:]:
        # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: listening
        parts = line.split(None, 7)
        if len(parts) < 8 or parts[3] != b"00010000":
            continue
        raw = parts[7]
        if raw.startswith(b"@") or not raw.endswith(b".sock"):
            continue  # abstract, or not named like a supervisor's socket
        if os.path.basename(raw).startswith(b"w-"):
            continue  # a worker's
        path = os.fsdecode(raw)
        try:
            st = os.lstat(path)
        except OSError:
            file = "gone"
        else:
            file = ("gone" if not _stat.S_ISSOCK(st.st_mode)
                    else "ours" if st.st_uid == uid else "foreign")
        out.append((path, normalize_socket_path(path) in named, file))
    return out


def discover(
    layout: Layout, *, records: list[Record] | None = None,
    descriptors: list[dict[str, Any]] | None = None,
) -> list[str]:
    """Every socket the files name: records, scopes, descriptors, the default socket and the
    socket files in the default socket dir (not the process scan: :func:`survey` adds it)."""
    sockets = {layout.socket}
    records = read_records(layout.registry_dir) if records is None else records
    descriptors = read_descriptors(layout.home_dir) if descriptors is None else descriptors
    sockets.update(r.socket for r in records)
    sockets.update(_scoped_sockets(layout.registry_dir,
                                   {owner_dir_name(r.generation) for r in records}))
    sockets.update(str(d["socket"]) for d in descriptors if d.get("socket"))
    sock_dir = default_socket_dir()
    try:
        names = os.listdir(sock_dir)
    except OSError:
        names = []
    sockets.update(os.path.join(sock_dir, name) for name in names
                   if name.endswith(".sock") and not name.startswith("w-"))
    return sorted(normalize_socket_path(s) for s in sockets)
