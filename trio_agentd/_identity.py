"""Process identity: a start id that names one incarnation, liveness, identity-checked signals.

A pid alone is not an identity: pids are reused. We pair it with a *start id* (on Linux the
boot id plus the start time in clock ticks from ``/proc/<pid>/stat``, less the boottime offset
of the observer's time namespace, so every observer names a process alike; elsewhere psutil's create
time). A process "is alive" only when its pid exists and its start id still matches. A process
whose identity cannot be read counts as alive but is never signalled.
"""

from __future__ import annotations

import os
import sys

from ._defaults import EXIT_POLL
from ._procstate import GroupIdentity as GroupIdentity
from ._procstate import Liveness as Liveness

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

_boot_id: str | None = None


def _linux_boot_id() -> str:
    global _boot_id
    if _boot_id is None:
        try:
            with open(f"{_PROC}/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError:
            _boot_id = "noboot"
    return _boot_id


_boottime_offset_ticks: int | None = None
_PROC = "/proc"  # tests point it at a fake


def _parse_boottime_offset(text: str, ticks_per_second: int) -> int:
    """The ``boottime`` line of ``/proc/<pid>/timens_offsets`` (``boottime <s> <ns>``), in
    clock ticks (floored); 0 if absent."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] in ("boottime", "7"):  # 7: CLOCK_BOOTTIME
            total_ns = int(fields[1]) * 1_000_000_000 + int(fields[2])
            return total_ns * ticks_per_second // 1_000_000_000
    return 0


def _own_boottime_offset_ticks() -> int:
    """The boottime offset of our time namespace, in clock ticks (0 outside one, or on a kernel
    without time namespaces). The kernel adds the *reader's* offset to the starttime field of
    every ``/proc/<pid>/stat`` it shows: subtracting it gives the same id to every observer."""
    global _boottime_offset_ticks
    if _boottime_offset_ticks is None:
        try:
            with open(f"{_PROC}/self/timens_offsets") as f:
                text = f.read()
            _boottime_offset_ticks = _parse_boottime_offset(text, os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError):
            _boottime_offset_ticks = 0
    return _boottime_offset_ticks


def read_start_id(pid: int) -> str | None:
    """The start id of ``pid``, or ``None`` when no such process (or it cannot be read).

    On Linux ``<boot id>:<start time in clock ticks since boot>``, the start time as the host
    counts it: the boottime offset of the observer's time namespace, which the kernel adds to
    what ``/proc`` shows, is taken off, so observers in different time namespaces agree (exact
    for offsets in whole ticks, as ``unshare --boottime`` makes them)."""
    if pid <= 0:
        return None
    if sys.platform.startswith("linux"):
        return _start_id_of(proc_stat_fields(pid))
    try:
        import psutil

        return f"ct:{psutil.Process(pid).create_time():.6f}"
    except Exception:
        return None


def proc_stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after pid and comm, or ``None`` if it cannot be
    read (comm may contain spaces and parentheses: split after the last ')'). From index 0:
    state, ppid, pgrp, session, ..., starttime at 19."""
    data = _read_proc(f"{_PROC}/{pid}/stat")
    return None if data is None else data[data.rfind(b")") + 2 :].split()


def proc_cmdline(pid: int) -> list[bytes] | None:
    """The arguments of ``/proc/<pid>/cmdline``, or ``None`` if it cannot be read."""
    data = _read_proc(f"{_PROC}/{pid}/cmdline")
    if data is None:
        return None
    return data.split(b"\0")[:-1] if data.endswith(b"\0") else data.split(b"\0")


def proc_environ(pid: int) -> list[bytes]:
    """The ``NAME=value`` entries of ``/proc/<pid>/environ``; none if it cannot be read."""
    data = _read_proc(f"{_PROC}/{pid}/environ")
    return [] if data is None else data.split(b"\0")


def _read_proc(path: str) -> bytes | None:
    """A ``/proc`` file's bytes, or ``None`` if it cannot be read: open, read, close and no
    more (a Python file object adds an fstat, an ioctl and an lseek to every read, and ps
    reads one per supervisor)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _start_id_of(tail: list[bytes] | None) -> str | None:
    if tail is None:
        return None
    try:
        # field 22 (starttime) is index 19 after pid and comm are removed
        start = int(tail[19]) - _own_boottime_offset_ticks()
        return f"{_linux_boot_id()}:{start}"
    except (IndexError, ValueError):
        return None


def own_start_id() -> str:
    sid = read_start_id(os.getpid())
    assert sid is not None
    return sid


def _answers_signal_0(send: Callable[[int, int], None], target: int) -> bool:
    """Signal 0 by ``send`` (``os.kill``, ``os.killpg``): whether ``target`` exists; a
    process of another user counts."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _pid_exists(pid: int) -> bool:
    """Whether the pid is taken (by any process: a pid alone is no identity)."""
    return _answers_signal_0(os.kill, pid)


def liveness(pid: int, start_id: str | None) -> Liveness:
    """Is the process incarnation ``(pid, start_id)`` still running?"""
    if pid <= 0:
        return Liveness.DEAD
    if sys.platform.startswith("linux"):
        # one read of its stat tells identity and state, and that the pid is taken
        return stat_liveness(pid, start_id, proc_stat_fields(pid))
    if not _pid_exists(pid):
        return Liveness.DEAD
    current = read_start_id(pid)
    if current is None:
        # raced with exit, or unreadable
        return Liveness.UNKNOWN if _pid_exists(pid) else Liveness.DEAD
    if start_id is None:
        return Liveness.UNKNOWN
    return Liveness.ALIVE if current == start_id else Liveness.DEAD


def stat_liveness(pid: int, start_id: str | None, tail: list[bytes] | None) -> Liveness:
    """:func:`liveness` from ``tail``, the :func:`proc_stat_fields` of ``pid`` read once (so
    a caller that asks about one pid more than once reads it once)."""
    current = _start_id_of(tail)
    if current is None:
        # no such pid, raced with exit, or unreadable
        return Liveness.UNKNOWN if pid > 0 and _pid_exists(pid) else Liveness.DEAD
    if start_id is None:
        return Liveness.UNKNOWN
    if tail is None or _dying(tail):
        return Liveness.DEAD
    return Liveness.ALIVE if current == start_id else Liveness.DEAD


_PF_EXITING = 0x4  # include/linux/sched.h: the task is exiting


def is_zombie(pid: int) -> bool:
    """Dead for our purposes: a zombie, or already exiting (its fds, sockets included, are
    closed before it becomes a zombie — a crash must not look alive in that window)."""
    if not sys.platform.startswith("linux"):
        return False
    tail = proc_stat_fields(pid)
    return tail is not None and _dying(tail)


def _dying(tail: list[bytes]) -> bool:
    """A zombie or an exiting task, from the fields of its ``/proc/<pid>/stat``."""
    if not tail or tail[0] in (b"Z", b"X"):
        return True
    try:
        return bool(int(tail[6]) & _PF_EXITING)  # field 9, flags
    except (IndexError, ValueError):
        return False


def is_alive(pid: int, start_id: str | None) -> bool:
    return liveness(pid, start_id) is not Liveness.DEAD


def wait_gone(pid: int, start_id: str | None, timeout: float, *,
              poll: float = EXIT_POLL) -> bool:
    """Block until process ``pid`` (identity-checked by ``start_id``) is gone, ``timeout``
    seconds at most, looking every ``poll``; True if it is gone.

    For the blocking CLI, which waits on a supervisor that is not its child (without trio: the
    warm path stays without it). Where the kernel gives a pidfd, the wait also ends the moment
    the process exits (a pidfd is readable then), not at the next look: ``shutdown`` answers
    as soon as its supervisor is gone.
    """
    import select
    import time

    deadline = time.monotonic() + timeout
    pidfd_open = getattr(os, "pidfd_open", None)
    fd: int | None = None
    if pidfd_open is not None and pid > 0:
        try:
            fd = pidfd_open(pid)
        except OSError:
            fd = None  # gone already, or no pidfds here: look every poll
    try:
        poller = select.poll()
        if fd is not None:
            poller.register(fd, select.POLLIN)
        while is_alive(pid, start_id):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(max(1, round(min(left, poll) * 1000)))  # a pidfd: wakes at the exit
        return True
    finally:
        if fd is not None:
            os.close(fd)


def signal_identity_checked(pid: int, start_id: str | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the incarnation ``start_id``.

    On Linux a pidfd pins the process between the identity check and the signal, so a pid that
    is reused in between is never hit. Returns whether the signal was delivered.
    """
    if start_id is None or pid <= 0:
        return False
    import signal

    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is not None and send is not None:
        try:
            fd = pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return False
        try:
            if read_start_id(pid) != start_id:
                return False
            try:
                send(fd, sig)
            except ProcessLookupError:
                return False
            return True
        finally:
            os.close(fd)
    if read_start_id(pid) != start_id:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def signal_group_identity_checked(
    pgid: int, leader_pid: int, start_id: str | None, sig: int
) -> bool:
    """Signal a process group whose leader is the incarnation ``(leader_pid, start_id)``.

    The group is signalled only while its leader still has the recorded identity; if the leader
    is gone the group cannot be identified safely and only the leader check decides.
    """
    if start_id is None or read_start_id(leader_pid) != start_id:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Does any process (a zombie counts) still belong to group ``pgid``? A probe only."""
    return _answers_signal_0(os.killpg, pgid)


def kill_group_members(group: GroupIdentity, sig: int) -> list[int]:
    """Signal, one by one, the live members of a group whose leader is already gone.

    Only where pidfds exist (Linux): each candidate is pinned by a pidfd before its group,
    session and start time are read, so a pid reused in between is never hit. A member must
    be in group ``pgid`` *and* session ``pgid`` (the leader's ``setsid``) and have started no
    earlier than the leader. Returns the pids signalled.
    """
    import signal

    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None or group.start_id is None:
        return []
    try:
        leader_start = int(group.start_id.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return []
    hit: list[int] = []
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            fd = pidfd_open(pid)
        except OSError:
            continue
        try:
            fields = proc_stat_fields(pid)
            try:
                # after pid and comm: state(0) ppid(1) pgrp(2) session(3) ... starttime(19)
                ours = (fields is not None and int(fields[2]) == group.pgid
                        and int(fields[3]) == group.pgid and int(fields[19]) >= leader_start
                        and fields[0] not in (b"Z", b"X"))
            except (IndexError, ValueError):
                ours = False
            if ours:
                try:
                    send(fd, sig)
                    hit.append(pid)
                except OSError:
                    pass
        finally:
            os.close(fd)
    return hit


def group_members(group: GroupIdentity) -> list[int]:
    """The live (non-zombie) processes of a group, leader included, while its leader is still
    the recorded incarnation; else none (see :func:`kill_group_members`)."""
    if read_start_id(group.pid) != group.start_id:
        return []
    return sorted(kill_group_members(group, 0))


def peer_credentials(stream: object) -> tuple[int, int] | None:
    """``(pid, uid)`` of the peer of a Unix-socket stream (SO_PEERCRED), or ``None``."""
    import socket as _socket
    import struct

    sock = getattr(stream, "socket", None)
    if sock is None:
        return None
    try:
        creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


# MSG_PEEK | MSG_DONTWAIT as a plain int, made on the first call (this module does not import
# ``socket`` itself; an import statement and an IntFlag ``|`` on every call were two thirds of
# the check's cost, and a client makes it before every prompt on a direct route)
_peek_now = 0


def peer_shut(sock: socket.socket) -> bool:
    """Whether the peer of a connected, non-blocking Unix socket (a stdlib ``socket``) shut
    its side with nothing left to read, found without reading or waiting (one ``recv`` with
    ``MSG_PEEK``). Bytes waiting, or nothing yet: ``False``; a broken connection: ``True``
    (nothing will come from it either)."""
    global _peek_now
    if not _peek_now:
        import socket as _socket

        _peek_now = int(_socket.MSG_PEEK | _socket.MSG_DONTWAIT)
    try:
        return not sock.recv(1, _peek_now)
    except BlockingIOError:
        return False
    except OSError:
        return True
