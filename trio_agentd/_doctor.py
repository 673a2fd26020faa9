"""Discovery, probes and repair for ``ps``, ``doctor`` and ``shutdown`` (the I/O shell).

Everything here is synchronous and trio-free (plain sockets, flock, signals), so ``ps`` stays
cheap. Decisions are :mod:`._doctor_plan`'s; this module observes and executes.
"""

from __future__ import annotations

import _socket
import contextlib
import errno
import json
import os
import stat as _stat
import time

from . import _fs
from ._defaults import CLIENT, ClientTiming
from ._doctor_plan import (
    Hello,
    Observation,
    Record,
    Repair,
    Status,
    Step,
    Verdict,
    classify,
    remedy,
    scan_reason,
)
from ._errors import AgentdError, ErrorCode
from ._identity import (
    liveness,
    read_start_id,
    signal_group_identity_checked,
    signal_identity_checked,
)
from ._ownership import CorruptRecord, OwnerRecord, Scope
from ._paths import Layout, default_socket_dir, normalize_socket_path, socket_key
from ._plain import Frozen, Plain
from ._procstate import Liveness
from ._registryfiles import (
    GUARD_FILE,
    OWNER_FILE,
    SCOPE_FILE,
    SHUTDOWN_LOCK_FILE,
    move_aside,
    owner_dir_name,
    record_names,
    tombstone_name,
    write_tombstone,
)
from ._trust import prove_peer, prove_socket_dir
from ._version import APP_VERSION, PROTOCOL_VERSION

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .timing import Timing

    # (socket file exists, accepts connections, hello or None)
    ProbeResult = tuple[bool, bool, dict[str, Any] | None]

# --- observing -----------------------------------------------------------------------------------


class Found(Frozen):
    """One supervisor (or its remains) as ps/doctor report it."""

    __slots__ = ("home_proven", "observation", "record", "socket", "verdict")
    socket: str
    verdict: Verdict
    observation: Observation
    record: Record | None
    home_proven: bool

    def __init__(
        self, *, socket: str, verdict: Verdict, observation: Observation, record: Record | None,
        home_proven: bool,
    ) -> None:
        s = object.__setattr__
        s(self, "socket", socket)
        s(self, "verdict", verdict)
        s(self, "observation", observation)
        s(self, "record", record)
        s(self, "home_proven", home_proven)

    def as_json(self, *, now: float | None = None) -> dict[str, Any]:
        """The row of ``ps --json``; its uptime counts to ``now`` (epoch seconds; default: the
        wall clock at the call)."""
        v, rec, hello = self.verdict, self.record, self.observation.hello
        now = time.time() if now is None else now
        return {
            "socket": self.socket,
            "status": str(v.status),
            "cause": v.cause,
            "pid": v.pid,
            "generation": v.generation,
            "app_version": hello.app_version if hello else None,
            "protocol": hello.protocol if hello else None,
            "sessions": self.observation.sessions,
            "uptime_s": _uptime(rec.created_at, now) if rec and rec.created_at else None,
            "is_default": self.observation.is_default,
            "remedy": remedy(self.socket, v),
        }


def _uptime(created_at: str, now: float) -> float | None:
    """Seconds from ``created_at`` (ISO 8601) to ``now`` (epoch seconds). Pure."""
    epoch = utc_epoch(created_at)
    if epoch is None:  # another shape of ISO 8601: datetime parses it (or refuses it)
        try:
            import datetime as _dt

            created = _dt.datetime.fromisoformat(created_at.replace("Z", "+00:00"))
        except ValueError:
            return None
        if created.tzinfo is None:
            return None  # a time without its zone is no instant
        epoch = created.timestamp()
    return round(now - epoch, 1)


def utc_epoch(text: str) -> float | None:
    """Seconds since the epoch of ``YYYY-MM-DDTHH:MM:SS[.fraction](Z|+00:00)`` — the shape
    records carry — without importing ``datetime``; ``None`` for anything else. Pure."""
    if text.endswith("Z"):
        t = text[:-1]
    elif text.endswith("+00:00"):
        t = text[:-6]
    else:
        return None
    frac = t[19:]
    fields = (t[0:4], t[5:7], t[8:10], t[11:13], t[14:16], t[17:19])
    if (len(t) < 19 or (t[4], t[7], t[10], t[13], t[16]) != ("-", "-", "T", ":", ":")
            or not all(f.isascii() and f.isdigit() for f in fields)
            or (frac and (frac[0] != "." or not (frac[1:].isascii() and frac[1:].isdigit())))):
        return None
    y, m, d, hh, mm, ss = (int(f) for f in fields)
    if not (1 <= m <= 12 and 1 <= d <= _month_days(y, m) and hh < 24 and mm < 60 and ss < 60):
        return None
    # days from 1970-01-01 to y-m-d in the proleptic Gregorian calendar
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    days = era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468
    return days * 86400 + hh * 3600 + mm * 60 + ss + (float("0" + frac) if frac else 0.0)


def _month_days(y: int, m: int) -> int:
    if m == 2:
        return 29 if y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) else 28
    return 30 if m in (4, 6, 9, 11) else 31


def _records(registry: str | os.PathLike[str]) -> list[Record]:
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
            phase=str(rec.phase), alive=liveness(rec.pid, rec.start_id) is not Liveness.DEAD,
            created_at=rec.created_at,
        ))
    return out


def _scoped_sockets(registry: str | os.PathLike[str]) -> list[str]:
    out = []
    registry = os.fspath(registry)
    with contextlib.suppress(OSError):
        for name in record_names(registry):
            with contextlib.suppress(CorruptRecord, _fs.UntrustedFile):
                raw = _read_trusted(os.path.join(registry, name, SCOPE_FILE))
                if raw is not None:
                    out.append(Scope.from_json(raw).socket)
    return out


def _descriptors(home: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every worker descriptor (``<home>/daemons/*/workers/*.json``, no hidden names)."""
    out = []
    for path in _descriptor_paths(os.path.join(os.fspath(home), "daemons")):
        with contextlib.suppress(OSError, ValueError):
            obj = json.loads(_read_trusted(path) or b"")
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _descriptor_paths(daemons: str) -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for key in os.listdir(daemons):
            if key.startswith("."):
                continue
            workers = os.path.join(daemons, key, "workers")
            with contextlib.suppress(OSError):
                out += [os.path.join(workers, name) for name in os.listdir(workers)
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
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                sock = _supervisor_socket(name, uid, want)
                if sock is not None:
                    out.append(sock)
    return out


def _supervisor_socket(pid: str, uid: int, home: str) -> str | None:
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


def _lease_holder(sock: str) -> int | None:
    """The pid the socket's lease file (``<socket>.lock``) names, if it can be read."""
    raw = _read_small(f"{sock}.lock")
    try:
        pid = json.loads(raw or b"").get("pid")
    except (ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _environ_home(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                if entry.startswith(b"TRIO_AGENTD_HOME="):
                    return entry.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        return None
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
    records = _records(layout.registry_dir) if records is None else records
    descriptors = _descriptors(layout.home_dir) if descriptors is None else descriptors
    sockets.update(r.socket for r in records)
    sockets.update(_scoped_sockets(layout.registry_dir))
    sockets.update(str(d["socket"]) for d in descriptors if d.get("socket"))
    sock_dir = default_socket_dir()
    with contextlib.suppress(OSError):
        for name in os.listdir(sock_dir):
            if name.endswith(".sock") and not name.startswith("w-"):
                sockets.add(os.path.join(sock_dir, name))
    return sorted(normalize_socket_path(s) for s in sockets)


class Untrusted(Exception):
    """The socket's dir or its listening peer is not ours: nothing was read or sent."""


def probe_hello(path: str, timing: Timing | ClientTiming = CLIENT) -> ProbeResult:
    """``(socket file exists, accepts connections, hello or None)`` — no commands sent.

    Raises:
        Untrusted: the socket's dir or its peer failed the proof (the message says why).
    """
    got = probe_hellos([path], timing)[path]
    if isinstance(got, Untrusted):
        raise got
    return got


def probe_hellos(
    paths: list[str], timing: Timing | ClientTiming = CLIENT
) -> dict[str, ProbeResult | Untrusted]:
    """:func:`probe_hello` of many sockets at once: each is proven and connected first, then
    the hellos are read as they come, with one ``poll`` (no trio), so N supervisors cost
    about the wake-up of one, not N in a row. Every connection is closed before returning."""
    import select

    out: dict[str, ProbeResult | Untrusted] = {}
    pending: dict[int, tuple[str, _socket.socket, bytearray]] = {}
    try:
        for path in paths:
            try:
                got = _connect_proven(path, timing)
            except Untrusted as exc:
                out[path] = exc
                continue
            if isinstance(got, tuple):
                out[path] = got
                continue
            pending[got.fileno()] = (path, got, bytearray())
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timing.hello_timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            for fd, _events in poller.poll(max(1, int(left * 1000))):
                path, s, data = pending[fd]
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                data += chunk
                if chunk and b"\n" not in data:
                    continue
                poller.unregister(fd)
                del pending[fd]
                s.close()
                out[path] = (True, True, _hello_of(bytes(data)))
    finally:
        for path, s, _data in pending.values():
            s.close()
            out[path] = (True, True, None)  # accepted, but no hello in time
    return out


def _connect_proven(path: str, timing: Timing | ClientTiming) -> _socket.socket | ProbeResult:
    """A non-blocking connection to ``path`` whose dir and peer are proven ours, or the probe's
    result when there is nothing to read a hello from.

    Raises:
        Untrusted: the socket's dir or its peer failed the proof.
    """
    try:
        prove_socket_dir(os.path.dirname(path))
    except AgentdError as exc:
        if exc.code == ErrorCode.DAEMON_UNAVAILABLE:
            return False, False, None
        raise Untrusted(str(exc.details.get("untrusted", exc.message))) from None
    if not os.path.lexists(path):
        return False, False, None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.setblocking(False)
    err = s.connect_ex(path)
    if err in (errno.EAGAIN, errno.EINPROGRESS):  # its backlog is full: wait, as one would
        s.settimeout(timing.connect_timeout)
        try:
            s.connect(path)
            err = 0
        except OSError:
            pass
        s.setblocking(False)
    if err != 0:
        s.close()
        return True, False, None
    try:
        prove_peer(s, path)
    except AgentdError as exc:
        s.close()
        raise Untrusted(str(exc.details.get("untrusted", exc.message))) from None
    return s


def _hello_of(data: bytes) -> dict[str, Any] | None:
    """The hello in the first line of ``data``, or ``None`` (no whole line, not a hello)."""
    if b"\n" not in data:
        return None
    try:
        obj = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and obj.get("type") == "hello" else None


def observe(
    socket: str, layout: Layout, *, timing: Timing | ClientTiming = CLIENT,
    records: list[Record] | None = None, descriptors: list[dict[str, Any]] | None = None,
    probed: ProbeResult | Untrusted | None = None,
) -> tuple[Observation, Record | None]:
    """What is known of one socket; ``probed``: its :func:`probe_hello` result, if taken."""
    try:
        if probed is None:
            probed = probe_hello(socket, timing)
        if isinstance(probed, Untrusted):
            raise probed
        exists, accepts, raw = probed
    except Untrusted as exc:
        obs = Observation(socket=socket, is_default=(socket == layout.socket),
                          socket_file=os.path.lexists(socket), accepts=False,
                          untrusted=str(exc))
        return obs, None
    records = _records(layout.registry_dir) if records is None else records
    by_gen = {r.generation: r for r in records}
    hello: Hello | None = None
    hello_record: Record | None = None
    corrupt = revoked = False
    hello_alive = True
    if raw is not None:
        gen = raw.get("generation")
        hello = Hello(
            generation=str(gen) if gen else None, pid=int(raw.get("pid", 0) or 0),
            start_id=raw.get("start_id"), protocol=int(raw.get("protocol", 0) or 0),
            app_version=str(raw.get("app_version", "")),
        )
        if hello.generation:
            hello_record = by_gen.get(hello.generation)
            registry = layout.registry_dir
            owner_json = os.path.join(registry, owner_dir_name(hello.generation), OWNER_FILE)
            corrupt = hello_record is None and os.path.exists(owner_json)
            revoked = os.path.exists(os.path.join(registry, tombstone_name(hello.generation)))
        # final liveness re-check: a supervisor that is stopping is not wedged
        hello_alive = liveness(hello.pid, hello.start_id) is not Liveness.DEAD
    if descriptors is None:
        descriptors = _descriptors(layout.home_dir)
    descs = [d for d in descriptors if d.get("socket") == socket]
    tracked = sum(
        1 for d in descs
        if isinstance(d.get("pid"), int) and liveness(int(d["pid"]), d.get("start_id"))
        is not Liveness.DEAD
    )
    obs = Observation(
        socket=socket, is_default=(socket == layout.socket), socket_file=exists,
        accepts=accepts, hello=hello, hello_record=hello_record, hello_record_corrupt=corrupt,
        revoked=revoked, hello_pid_alive=hello_alive,
        socket_records=tuple(r for r in records if r.socket == socket and r.alive),
        tracked_workers=tracked, sessions=len(descs),
    )
    return obs, hello_record


def survey(
    layout: Layout, timing: Timing | ClientTiming = CLIENT, *, scan: bool | None = None
) -> list[Found]:
    """ps: every supervisor found, classified, ordered by socket.

    First every socket the files name (:func:`discover`); then, last, the command lines of
    this user's running supervisors of this home (:func:`scanned_sockets`), which find one
    that lost the files that name it. The scan reads every process's ``/proc`` entry, so it
    runs only when it may find something (``scan=None``: :func:`._doctor_plan.scan_reason`
    on what the files gave and on the listening sockets — nothing found, anything unhealthy,
    a socket file deleted under its listener, a socket of ours no file names); ``scan=True``
    always, ``scan=False`` never.
    """
    records = _records(layout.registry_dir)
    descs = _descriptors(layout.home_dir)  # read once, not once per socket
    named = discover(layout, records=records, descriptors=descs)
    more: set[str] = set()
    listeners: list[tuple[str, bool, str]] | None = None
    if scan is not True:
        listeners = listening_sockets(set(named))
        if listeners is not None:
            listeners = _resolve_unnamed(listeners, layout.home_dir, more)
    found = _classified(sorted({*named, *more}), layout, timing, records, descs)
    if scan is None:
        scan = scan_reason([f.verdict.status for f in found], listeners) is not None
    if scan:
        scanned = {normalize_socket_path(s) for s in scanned_sockets(layout.home)}
        rest = scanned - set(named) - more
        if rest:
            found += _classified(sorted(rest), layout, timing, records, descs)
            found.sort(key=lambda f: f.socket)
    return found


def _resolve_unnamed(
    listeners: list[tuple[str, bool, str]], home: str | os.PathLike[str], into: set[str]
) -> list[tuple[str, bool, str]]:
    """A socket of ours that no file names is asked who holds its lease (``<socket>.lock``),
    and that one process whether it is a supervisor of this home on that socket (the scan's
    test, for one pid): if so the socket goes ``into`` the sockets to observe; if it is no
    supervisor of this home it is left out. Only a lease that tells nothing leaves it unnamed
    (then the whole scan runs)."""
    uid = os.getuid()
    want = os.path.normpath(os.fspath(home))
    out = []
    for path, named, file in listeners:
        if file == "ours" and not named:
            pid = _lease_holder(path)
            sock = None if pid is None else _supervisor_socket(str(pid), uid, want)
            if pid is not None and sock is None:
                named = True  # another home's supervisor (or none): not ours to list
            elif sock is not None and normalize_socket_path(sock) == normalize_socket_path(path):
                into.add(normalize_socket_path(path))
                named = True
        out.append((path, named, file))
    return out


def _classified(
    sockets: list[str], layout: Layout, timing: Timing | ClientTiming,
    records: list[Record], descs: list[dict[str, Any]],
) -> list[Found]:
    found = []
    probes = probe_hellos(sockets, timing)  # all at once
    for sock in sockets:
        obs, rec = observe(sock, layout, timing=timing, records=records, descriptors=descs,
                           probed=probes[sock])
        verdict = classify(obs, protocol=PROTOCOL_VERSION, app_version=APP_VERSION)
        if verdict is None:
            continue
        if rec is None and verdict.generation:
            rec = next((r for r in records if r.generation == verdict.generation), None)
        # generations/<g>/ under this home's state dir of that socket
        home_proven = bool(verdict.generation) and os.path.isdir(os.path.join(
            layout.home_dir, "daemons", socket_key(sock), "generations", str(verdict.generation)))
        found.append(Found(socket=sock, verdict=verdict, observation=obs, record=rec,
                           home_proven=home_proven))
    return found


# --- repairing -----------------------------------------------------------------------------------


class Hooks(Plain):
    """The side effects of a repair, injectable for tests of the executor."""

    __slots__ = (
        "kill",
        "launch",
        "release_admission",
        "remove_socket",
        "reprobe",
        "revoke",
        "take_admission",
        "wait_hello",
    )
    reprobe: Callable[[str], Verdict | None]
    kill: Callable[[int, str | None], bool]  # True once the process is confirmed gone
    launch: Callable[[str, str], None]  # (socket, admission ticket)
    wait_hello: Callable[[str, str], dict[str, Any] | None]  # (socket, old gen) → new hello
    revoke: Callable[[str], None]
    remove_socket: Callable[[str], None]
    take_admission: Callable[[], str | None]  # ticket, or None if someone else holds it
    release_admission: Callable[[], None]

    def __init__(
        self, reprobe: Callable[[str], Verdict | None], kill: Callable[[int, str | None], bool],
        launch: Callable[[str, str], None],
        wait_hello: Callable[[str, str], dict[str, Any] | None], revoke: Callable[[str], None],
        remove_socket: Callable[[str], None], take_admission: Callable[[], str | None],
        release_admission: Callable[[], None],
    ) -> None:
        self.reprobe = reprobe
        self.kill = kill
        self.launch = launch
        self.wait_hello = wait_hello
        self.revoke = revoke
        self.remove_socket = remove_socket
        self.take_admission = take_admission
        self.release_admission = release_admission


class Outcome(Plain):
    __slots__ = ("done", "failed", "new_generation", "new_pid", "repair")
    repair: Repair
    done: list[tuple[Step, str]]
    failed: tuple[Step, str] | None
    new_pid: int | None
    new_generation: str | None

    def __init__(
        self, repair: Repair, done: list[tuple[Step, str]] | None = None,
        failed: tuple[Step, str] | None = None, new_pid: int | None = None,
        new_generation: str | None = None,
    ) -> None:
        self.repair = repair
        self.done = [] if done is None else done
        self.failed = failed
        self.new_pid = new_pid
        self.new_generation = new_generation

    @property
    def ok(self) -> bool:
        return self.repair.declined is None and self.failed is None

    def as_json(self) -> dict[str, Any]:
        return {
            "steps": [{"step": str(s), "result": r} for s, r in self.done],
            "failed": None if self.failed is None
            else {"step": str(self.failed[0]), "result": self.failed[1]},
            "declined": self.repair.declined,
            "new_pid": self.new_pid,
            "new_generation": self.new_generation,
        }


def execute(repair: Repair, hooks: Hooks, *, on_step: Callable[[Step, str], None]) -> Outcome:
    """Run a repair's steps in order; stop at the first that fails (never make things worse).

    The admission, once taken, is released whatever happens.
    """
    out = Outcome(repair)
    if repair.declined:
        return out
    ticket: str | None = None
    try:
        for step in repair.steps:
            ok, text = _run_step(step, repair, hooks, ticket, out)
            if step is Step.TAKE_ADMISSION and ok:
                ticket = text.split()[-1]
                text = "held"
            if not ok:
                out.failed = (step, text)
                on_step(step, f"FAILED: {text}")
                return out
            out.done.append((step, text))
            on_step(step, text)
        return out
    finally:
        if ticket is not None and Step.RELEASE_ADMISSION not in [s for s, _ in out.done]:
            hooks.release_admission()


def _run_step(
    step: Step, repair: Repair, hooks: Hooks, ticket: str | None, out: Outcome
) -> tuple[bool, str]:
    v, sock = repair.verdict, repair.socket
    match step:
        case Step.PROVE_HOME:
            return True, f"generation {v.generation} belongs to this home"
        case Step.TAKE_ADMISSION:
            got = hooks.take_admission()
            if got is None:
                return False, "another shutdown or doctor --fix holds the admission"
            return True, f"ticket {got}"
        case Step.REPROBE_SAME | Step.REPROBE_DEAD:
            again = hooks.reprobe(sock)
            if step is Step.REPROBE_DEAD:
                if again is not None and again.status is not Status.ORPHAN_FILE:
                    return False, f"now {again.status}: left alone"
                return True, "still nobody listening"
            if again is None or again.status not in (Status.OWNERSHIP_LOST, Status.UNREACHABLE):
                status = again.status if again else "gone"
                return False, f"no longer wedged ({status}): left alone"
            if (again.generation, again.pid) != (v.generation, v.pid):
                return False, (f"a different supervisor is there now (generation"
                               f" {again.generation}): never kill a successor")
            return True, f"generation {v.generation} still {again.status}"
        case Step.REVOKE:
            assert v.generation is not None
            hooks.revoke(v.generation)
            return True, f"tombstone written for generation {v.generation}"
        case Step.KILL:
            assert v.pid is not None
            if not hooks.kill(v.pid, v.start_id):
                return False, f"pid {v.pid} survived SIGKILL: socket and workers left as they are"
            return True, f"killed pid {v.pid}, exit confirmed"
        case Step.REMOVE_SOCKET:
            hooks.remove_socket(sock)
            return True, "socket file removed"
        case Step.RELAUNCH:
            assert ticket is not None
            hooks.launch(sock, ticket)
            return True, "new supervisor launched on the same socket"
        case Step.WAIT_HELLO:
            hello = hooks.wait_hello(sock, str(v.generation))
            if hello is None:
                return False, "the new supervisor did not answer (see its daemon.log)"
            out.new_pid = int(hello.get("pid", 0))
            out.new_generation = str(hello.get("generation"))
            return True, f"new supervisor pid {out.new_pid} answers (sessions are re-adopted)"
        case Step.RELEASE_ADMISSION:
            hooks.release_admission()
            return True, "released"


class RealHooks:
    """Hooks that act on this machine."""

    def __init__(self, layout: Layout, timing: Timing | None = None) -> None:
        from .timing import DEFAULT_TIMING

        self.layout = layout
        self.timing = timing or DEFAULT_TIMING
        self._admission_fd: int | None = None

    def hooks(self) -> Hooks:
        return Hooks(
            reprobe=self.reprobe, kill=self.kill, launch=self.launch, wait_hello=self.wait_hello,
            revoke=self.revoke, remove_socket=self.remove_socket,
            take_admission=self.take_admission, release_admission=self.release_admission,
        )

    def _layout_for(self, sock: str) -> Layout:
        return Layout(home=self.layout.home, socket=sock, registry=self.layout.registry)

    def reprobe(self, sock: str) -> Verdict | None:
        """The verdict once it has held for the re-probe window: a supervisor that answers at
        any moment of it is not repaired (it was slow, not wedged)."""
        deadline = time.monotonic() + self.timing.reprobe_window
        while True:
            obs, _ = observe(sock, self._layout_for(sock), timing=self.timing)
            verdict = classify(obs, protocol=PROTOCOL_VERSION, app_version=APP_VERSION)
            if verdict is None or not verdict.problem or time.monotonic() >= deadline:
                return verdict
            time.sleep(self.timing.probe_interval)

    def kill(self, pid: int, start_id: str | None) -> bool:
        import signal

        # SIGKILL alone: it ends a stopped process too, and a SIGCONT first would let a revoked
        # supervisor run between the two signals and answer queued clients "ownership_lost"
        signal_identity_checked(pid, start_id, signal.SIGKILL)
        deadline = time.monotonic() + self.timing.kill_confirm_timeout
        while time.monotonic() < deadline:
            if liveness(pid, start_id) is Liveness.DEAD:
                return True
            time.sleep(0.005)
        return liveness(pid, start_id) is Liveness.DEAD

    def launch(self, sock: str, ticket: str) -> None:
        from ._autostart import spawn_daemon

        spawn_daemon(self._layout_for(sock), extra_env={"TRIO_AGENTD_ADMISSION_TICKET": ticket})

    def wait_hello(self, sock: str, old_generation: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.timing.startup_timeout
        while time.monotonic() < deadline:
            try:
                _, _, hello = probe_hello(sock, self.timing)
            except Untrusted:
                return None  # someone else's now: not what we launched
            if hello is not None and hello.get("generation") != old_generation:
                return hello
            time.sleep(self.timing.probe_interval)
        return None

    def revoke(self, generation: str) -> None:
        registry = self.layout.registry
        with _fs.locked_sync(registry / GUARD_FILE):
            write_tombstone(registry, generation, {"by": "doctor", "pid": os.getpid()})
            move_aside(registry, owner_dir_name(generation))

    def remove_socket(self, sock: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)

    def take_admission(self) -> str | None:
        path = self.layout.registry / SHUTDOWN_LOCK_FILE
        _fs.ensure_dir(self.layout.registry)
        deadline = time.monotonic() + 5
        while True:
            fd = _fs.try_lock(path)
            if fd is not None:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        ticket = os.urandom(8).hex()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "ticket": ticket}).encode(), 0)
        self._admission_fd = fd
        return ticket

    def release_admission(self) -> None:
        if self._admission_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._admission_fd, 0)
            _fs.unlock(self._admission_fd)
            self._admission_fd = None


def stop_orphan_workers(layout: Layout, sock: str, timing: Timing | None = None) -> list[int]:
    """TERM (then KILL) the live workers of a socket whose supervisor is gone; identity-checked."""
    import signal

    from .timing import DEFAULT_TIMING

    timing = timing or DEFAULT_TIMING
    stopped = []
    for d in _descriptors(layout.home):
        pid, sid = d.get("pid"), d.get("start_id")
        if d.get("socket") != sock or not isinstance(pid, int) or not isinstance(sid, str):
            continue
        if read_start_id(pid) != sid:
            continue
        # a worker leads its own process group (pgid == pid)
        signal_group_identity_checked(pid, pid, sid, signal.SIGTERM)
        deadline = time.monotonic() + timing.stop_grace
        while time.monotonic() < deadline and liveness(pid, sid) is not Liveness.DEAD:
            time.sleep(0.01)
        if liveness(pid, sid) is not Liveness.DEAD:
            signal_group_identity_checked(pid, pid, sid, signal.SIGKILL)
        stopped.append(pid)
    return stopped
