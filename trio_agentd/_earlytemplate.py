"""Start the daemon's worker fork template first thing, before the daemon imports anything.

A cold prompt (no supervisor yet) waits on two Python starts that run side by side on their
own cores: the supervisor's (interpreter, trio, its modules) and its fork template's (the
same, plus what a worker imports). The later of the two to be ready is on the prompt's path.
So the template is started before the daemon has imported even ``subprocess``: this module
imports nothing but ``os``, ``sys`` and the C modules ``_socket`` and ``_signal``, and starts
the template with ``posix_spawn``, as ``subprocess.Popen`` would start it: stdin its end of a
socketpair, stdout ``/dev/null``, stderr the daemon's, the signals Python ignores set back to
their defaults, no other descriptor (every inheritable one above stderr is closed in the
child: an autostarted daemon's readiness pipe is one). Unlike ``Popen`` it cannot set the
child's working directory; the template moves itself to ``/`` first thing.

The fork server (:mod:`._forkserver`) takes the started template (:func:`take`) when it runs.
"""

from __future__ import annotations

import os
import sys

TEMPLATE_FLAG = "--template"
# what a template must not inherit from a daemon a service manager started (the supervisor
# takes these for itself and removes them before anything else is started)
MANAGER_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                     "LISTEN_PID", "LISTEN_FDNAMES")


def isolated_python(module: str) -> list[str]:
    """The argv prefix of every process we start: nothing imported from the cwd (``-P``) or
    from ``PYTHON*`` variables (``-E``); the installed package and its dependencies only."""
    return [sys.executable, "-E", "-P", "-m", module]


class Early:
    """A template started by :func:`start`: its pid, our end of its socket (a descriptor)
    and the environment it got."""

    __slots__ = ("env", "pid", "sock_fd")

    def __init__(self, pid: int, sock_fd: int, env: dict[str, str]) -> None:
        self.pid = pid
        self.sock_fd = sock_fd
        self.env = env


_early: Early | None = None


class Child:
    """A child :func:`os.posix_spawn` started: its pid, and its exit status once it has exited
    (:meth:`poll`, which reaps it; as ``subprocess.Popen.poll``)."""

    __slots__ = ("pid", "returncode")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit status if it has exited (reaped now), else ``None``."""
        if self.returncode is None:
            try:
                got, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 0  # reaped by someone else (as ``Popen.poll`` takes it)
            else:
                if got:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def start() -> None:
    """Start the template now (once; later calls do nothing). A failure to start it is not an
    error: the fork server's first start starts one. Not under socket activation
    (``LISTEN_FDS`` set): there descriptors 3 and up are the service manager's until the
    daemon has taken its listener; a socketpair opened now could sit on fd 3 in place of one
    that was not passed, and the activation check would judge our own socket."""
    global _early
    if _early is not None or os.environ.get("LISTEN_FDS"):
        return
    import _socket

    env = {k: v for k, v in os.environ.items() if k not in MANAGER_VARIABLES}
    try:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError:
        return
    try:
        stdio, copies = stdio_actions(theirs.fileno(), os.devnull, 2)
        try:
            pid = os.posix_spawn(
                sys.executable, [*isolated_python("trio_agentd.worker"), TEMPLATE_FLAG], env,
                file_actions=[*stdio, *close_actions()], setsigdef=default_signals(),
            )
        finally:
            for fd in copies:
                os.close(fd)
    except OSError:
        ours.close()
        return
    finally:
        theirs.close()
    _early = Early(pid, ours.detach(), env)


# a posix_spawn file action: (POSIX_SPAWN_OPEN, fd, path, flags, mode), (POSIX_SPAWN_DUP2,
# fd, new fd) or (POSIX_SPAWN_CLOSE, fd)
Action = tuple[int, int] | tuple[int, int, int] | tuple[int, int, str, int, int]


def stdio_actions(stdin: int | str, stdout: int | str, stderr: int | str
                  ) -> tuple[list[Action], list[int]]:
    """The file actions that give a ``posix_spawn``-ed child these stdin, stdout and stderr
    (each a descriptor of ours, or a path to open), and the descriptors the caller closes
    once the child is spawned. A descriptor given that is one of 0-2 itself (our stdout was
    closed, say) is copied above 2 first, and nothing is closed in the child after (our
    descriptors are close-on-exec), so no action undoes another."""
    copies: dict[int, int] = {}
    for source in (stdin, stdout, stderr):
        if isinstance(source, int) and source <= 2 and source not in copies:
            import fcntl

            copies[source] = fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, 3)
    actions: list[Action] = []
    for target, source in enumerate((stdin, stdout, stderr)):
        if isinstance(source, str):
            flags = os.O_RDONLY if target == 0 else os.O_WRONLY
            actions.append((os.POSIX_SPAWN_OPEN, target, source, flags, 0))
        else:
            actions.append((os.POSIX_SPAWN_DUP2, copies.get(source, source), target))
    return actions, list(copies.values())


def close_actions(exclude: set[int] | frozenset[int] = frozenset()) -> list[Action]:
    """The file actions that close, in a ``posix_spawn``-ed child, every inheritable
    descriptor of ours above stderr but ``exclude`` (``subprocess``'s ``close_fds``; the
    close-on-exec ones go by themselves)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    actions: list[Action] = []
    for name in names:
        fd = int(name)
        if fd <= 2 or fd in exclude:
            continue
        try:
            if os.get_inheritable(fd):
                actions.append((os.POSIX_SPAWN_CLOSE, fd))
        except OSError:
            continue  # (the listing's own descriptor, closed by now)
    return actions


def default_signals() -> list[int]:
    """The signals Python ignores that a child gets back at their defaults (``subprocess``'s
    ``restore_signals``)."""
    import _signal  # type: ignore[import-not-found]  # (``signal`` imports ``enum``)

    return [getattr(_signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ")
            if hasattr(_signal, name)]


def take() -> Early | None:
    """The template :func:`start` started, for the fork server to run (once)."""
    global _early
    early, _early = _early, None
    return early
