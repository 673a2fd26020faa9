"""Socket activation: the supervisor takes its listening socket from its service manager.

systemd (a ``.socket`` unit) binds the socket, starts the service when a client connects, and
passes the socket as fd 3 with ``LISTEN_FDS=1``, ``LISTEN_PID=<the service's pid>`` and maybe
``LISTEN_FDNAMES``. The supervisor then does not bind: it proves the inherited fd is an AF_UNIX
``SOCK_STREAM`` socket that listens on exactly the supervisor's socket path, in a socket dir of
ours (mode 0700), and that the socket file is ours (our uid, no group or other bits); anything
else ends the daemon with one line naming the cause and the fix. The ``LISTEN_*`` variables are
removed from the environment at once (workers and successors must not inherit them), and a
socket the supervisor did not bind is never unlinked by it.

The verdicts (:func:`listen_request`, :func:`listener_problem`) are pure; :func:`take_listener`
is the I/O shell.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Final

from ._errors import AgentdError, ErrorCode
from ._trust import prove_socket_dir

LISTEN_ENV: Final = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
SD_LISTEN_FDS_START: Final = 3


def _refuse(message: str) -> AgentdError:
    return AgentdError(ErrorCode.CONFIG, f"socket activation: {message}")


def listen_request(pid_s: str | None, fds_s: str | None, names_s: str | None, pid: int) -> bool:
    """Whether the service manager passed this process its listening socket (as fd 3).

    ``LISTEN_PID`` unset or another pid's: not for us (False). For us, exactly one fd must be
    passed; ``LISTEN_FDNAMES``, if set, must name as many.

    Raises:
        AgentdError: ``config``, one line naming the variable, its value and the fix.
    """
    if not pid_s or not fds_s:
        return False
    if not pid_s.isdigit():
        raise _refuse(f"LISTEN_PID={pid_s!r} is not a process id")
    if int(pid_s) != pid:
        return False
    if not fds_s.isdigit():
        raise _refuse(f"LISTEN_FDS={fds_s!r} is not a number of file descriptors")
    count = int(fds_s)
    if count == 0:
        return False
    if count != 1:
        raise _refuse(
            f"LISTEN_FDS={count}: the supervisor takes exactly one listening socket — give its"
            " .socket unit a single ListenStream= (the supervisor's socket path)"
        )
    if names_s is not None and len(names_s.split(":")) != count:
        raise _refuse(f"LISTEN_FDNAMES={names_s!r} names {len(names_s.split(':'))} sockets, but"
                      f" LISTEN_FDS={count}")
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerFacts:
    """What was found about the inherited fd and the socket file, for :func:`listener_problem`."""

    fd: int
    expected: str  # the supervisor's socket path
    fd_mode: int | None  # st_mode of fstat(fd); None: the fd is not open
    family: int | None = None
    type: int | None = None
    listening: bool = False
    name: str | bytes | None = None  # getsockname()
    path_stat: os.stat_result | None = None  # lstat of ``expected``; None: missing
    uid: int = 0  # ours
    # whether the fd survives exec: one a service manager passed does; one this process opened
    # itself (Python opens everything close-on-exec), e.g. its log file on a free fd 3, does not
    inheritable: bool = True
    target: str | None = None  # readlink of /proc/self/fd/<fd>, for the message


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a socket"


def listener_problem(f: ListenerFacts) -> str | None:
    """Why the inherited fd cannot be the supervisor's listening socket, or ``None``."""
    fix = (f"the .socket unit must say ListenStream={f.expected} (`trio-agentd service install"
           " --socket-activation` writes one)")
    if f.fd_mode is None:
        return f"LISTEN_FDS=1 but fd {f.fd} is not open — {fix}"
    if not f.inheritable:
        what = f" (fd {f.fd} is its own {f.target})" if f.target else ""
        return (f"LISTEN_FDS=1 but no fd {f.fd} was passed to the daemon{what} — start it from"
                f" a .socket unit, or unset LISTEN_PID and LISTEN_FDS; {fix}")
    if not stat.S_ISSOCK(f.fd_mode):
        return f"fd {f.fd} is {_kind(f.fd_mode)}, not a socket — {fix}"
    if f.family != socket.AF_UNIX:
        fam = {int(socket.AF_INET): "a TCP/IP (AF_INET)", int(socket.AF_INET6): "an AF_INET6"
               }.get(-1 if f.family is None else f.family, f"a family-{f.family}")
        return f"fd {f.fd} is {fam} socket, not a Unix socket — {fix}"
    if f.type != socket.SOCK_STREAM:
        return f"fd {f.fd} is a Unix socket of type {f.type}, not SOCK_STREAM — {fix}"
    if not f.listening:
        return f"fd {f.fd} is a Unix socket that does not listen — {fix}"
    if isinstance(f.name, bytes) or not f.name or f.name.startswith("\0"):
        return f"fd {f.fd} is not bound to a path (abstract or unnamed socket) — {fix}"
    if os.path.normpath(f.name) != os.path.normpath(f.expected):
        return (f"fd {f.fd} listens on {f.name}, not on the supervisor's socket {f.expected} —"
                f" {fix}, or run the daemon with --socket {f.name}")
    st = f.path_stat
    if st is None:
        return (f"fd {f.fd} listens on {f.expected}, but that path is gone — restart the"
                " .socket unit")
    if not stat.S_ISSOCK(st.st_mode):
        return (f"{f.expected} is {_kind(st.st_mode)}, not the socket fd {f.fd} listens on —"
                " remove it and restart the .socket unit")
    if st.st_uid != f.uid:
        return (f"socket {f.expected} is owned by uid {st.st_uid}, not by you (uid {f.uid}) —"
                " not trusted; use a user unit (systemctl --user)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return (f"socket {f.expected} has mode {mode:04o} (group or others may use it) — set"
                " SocketMode=0600 in the .socket unit")
    return None


@dataclass(frozen=True, slots=True)
class InheritedListener:
    """A proven listening socket from the service manager, and the socket file's inode (the
    self-check notices a replaced or removed file by it)."""

    sock: socket.socket
    ino: int


def take_listener(
    environ: MutableMapping[str, str], expected: str, *, pid: int | None = None,
    fd: int = SD_LISTEN_FDS_START,
) -> InheritedListener | None:
    """The listening socket passed by the service manager, proven ours, or ``None`` when none
    was passed to this process. ``LISTEN_*`` are removed from ``environ`` either way, and the
    fd is made close-on-exec. ``fd``: where the socket is (3, as the protocol says; tests
    pass another).

    Raises:
        AgentdError: ``config`` (or ``permission_denied`` for an untrusted socket dir), one
            line naming the cause and the fix.
    """
    raw = {k: environ.pop(k, None) for k in LISTEN_ENV}
    if not listen_request(raw["LISTEN_PID"], raw["LISTEN_FDS"], raw["LISTEN_FDNAMES"],
                          os.getpid() if pid is None else pid):
        return None
    facts = _facts(fd, expected)
    problem = listener_problem(facts)
    if problem is not None:
        raise _refuse(problem)
    prove_socket_dir(os.path.dirname(expected))
    assert facts.path_stat is not None
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return InheritedListener(sock, facts.path_stat.st_ino)


def _facts(fd: int, expected: str) -> ListenerFacts:
    try:
        fd_mode = os.fstat(fd).st_mode
        inheritable = os.get_inheritable(fd)
    except OSError:
        return ListenerFacts(fd=fd, expected=expected, fd_mode=None, uid=os.getuid())
    if not inheritable or not stat.S_ISSOCK(fd_mode):
        try:
            target: str | None = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = None
        return ListenerFacts(fd=fd, expected=expected, fd_mode=fd_mode, uid=os.getuid(),
                             inheritable=inheritable, target=target)
    # a socket object that does not own the fd: dup, inspect, close the dup
    probe = socket.socket(fileno=os.dup(fd))
    try:
        family = probe.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
        kind = probe.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        listening = bool(probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        name = probe.getsockname() if family == socket.AF_UNIX else None
    finally:
        probe.close()
    try:
        path_stat: os.stat_result | None = os.lstat(expected)
    except OSError:
        path_stat = None
    return ListenerFacts(fd=fd, expected=expected, fd_mode=fd_mode, family=family, type=kind,
                         listening=listening, name=name, path_stat=path_stat, uid=os.getuid())
