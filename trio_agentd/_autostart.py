"""Autostart of a supervisor by a client, shared by the sync and async clients.

The CLI calls :func:`autostart_and_wait` in-process (it is short-lived, so the daemon is
re-parented when it exits). A Trio program must not keep a detached daemon as its child (it would
linger as a zombie after the daemon exits), so ``open_client`` runs the same function in a short
helper process, ``python -m trio_agentd._autostart``, which exits once the daemon answers.

The client spawns ``python -E -P -m trio_agentd --socket S --home H --registry R daemon
--autostarted`` detached (new session, cwd ``/``, stdio to the daemon log: nothing is imported from
the client's cwd) and probes for a hello every ``probe_interval``. Between probes it waits on a
*readiness pipe* the daemon inherits (its write end, named by ``TRIO_AGENTD_AUTOSTART_FD``):
the daemon writes ``ready`` to it once it serves hellos (the moment it would tell a service
manager ``READY=1``) and closes it, so the client probes at once instead of at its next tick;
an end of file (the daemon exited, having lost the race or failed) wakes it too. The pipe only
says when to look: what the client trusts is still the probe's proof of the socket and its
peer. A spawned daemon that loses the race to another one exits 0 quietly (``--autostarted``),
so the client keeps probing for the winner; one that exits non-zero makes the client fail with
the exit code and the log's tail.

Upgrades use the same path (:func:`hand_over`). A client that meets a supervisor of an older
installation (a lower protocol, or the same protocol and a lower app version) asks it to release
the socket with the ``shutdown`` op and ``stop_workers: false`` — an op every protocol version
has — once no session is busy, waits for it to exit, and spawns a supervisor from its own
installation (its own ``sys.executable``), which adopts the workers. Busy sessions are waited
for at most ``handover_wait``; then the client says what to run (``trio-agentd restart``, which
hands over at once: running turns go on in their workers).
"""

from __future__ import annotations

import os
import sys
import time

from ._defaults import CLIENT, HANDOVER_EXIT_GRACE, HANDOVER_POLL, ClientTiming
from ._earlytemplate import Child, default_signals
from ._errors import AgentdError, ErrorCode
from ._paths import Layout
from ._version import APP_VERSION, PROTOCOL_VERSION

# typing.TYPE_CHECKING without importing typing or pathlib: a cold prompt (no supervisor yet)
# imports this module on its way to starting one
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any

    from ._sdnotify import Notifier
    from ._syncconn import _Conn
    from .timing import Timing



# the write end of the readiness pipe of an autostarted daemon (a descriptor number)
READY_FD_ENV = "TRIO_AGENTD_AUTOSTART_FD"
# variables that tell one process which daemon to be; a spawned daemon gets flags instead
_INTERNAL_ENV = frozenset({"TRIO_AGENTD_ADMISSION_TICKET", "TRIO_AGENTD_REGISTRY_DIR",
                           "TRIO_AGENTD_HOME", "TRIO_AGENTD_SOCKET", READY_FD_ENV})


# the supervisors this process spawned that may still run: reaped by the next spawn once they
# have exited (a long-lived client that autostarts more than once keeps no zombie beyond that)
_spawned: list[Child] = []


def spawn_daemon(
    layout: Layout, *, extra_env: dict[str, str] | None = None, ready_pipe: bool = False
) -> Child:
    """Start ``trio-agentd daemon --autostarted`` detached (a new session, cwd ``/``), stdin
    ``/dev/null``, stdout and stderr the daemon log, no descriptor of ours but the readiness
    pipe's write end (``ready_pipe``: for :func:`wait_for_news`).

    Started with ``posix_spawn``, not ``subprocess``: a cold prompt does not import it (nor
    ``threading``, which would cost the CLI the interpreter's teardown at its exit). The
    daemon moves to ``/`` itself first thing (``posix_spawn`` cannot set a working
    directory; the daemon never holds the client's cwd, or its mount, busy)."""
    from ._earlytemplate import close_actions, isolated_python, stdio_actions
    from ._fs import ensure_dir, open_trusted

    _spawned[:] = [p for p in _spawned if p.poll() is None]
    try:
        ensure_dir(layout.state_dir_name)
    except AgentdError as exc:
        if exc.code != ErrorCode.CONFIG:
            raise
        raise AgentdError(
            exc.code, f"{exc.message} (the home {layout.home} comes from"
            f" {layout.home_origin()}; --home and TRIO_AGENTD_HOME choose another)", exc.details,
        ) from None
    log_fd = open_trusted(layout.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    offset = os.fstat(log_fd).st_size  # what this start writes comes after: its own lines
    # the daemon's own variables name this layout; nothing internal is left for its agents
    env = {k: v for k, v in os.environ.items() if k not in _INTERNAL_ENV}
    env.update(extra_env or {})
    ready_r: int | None = None
    ready_w: int | None = None
    if ready_pipe:
        import contextlib

        with contextlib.suppress(OSError):  # no descriptors to spare: probes on ticks alone
            ready_r, ready_w = os.pipe()
    if ready_w is not None:
        env[READY_FD_ENV] = str(ready_w)
    argv = [*isolated_python("trio_agentd"), "--socket", layout.socket,
            "--home", layout.home_dir, "--registry", layout.registry_dir,
            "daemon", "--autostarted"]
    try:
        if ready_w is not None:
            os.set_inheritable(ready_w, True)  # (closed here right after the spawn)
        keep = set() if ready_w is None else {ready_w}
        stdio, copies = stdio_actions(os.devnull, log_fd, log_fd)
        try:
            pid = os.posix_spawn(argv[0], argv, env, setsid=True, setsigdef=default_signals(),
                                 file_actions=[*stdio, *close_actions(exclude=keep)])
        finally:
            for fd in copies:
                os.close(fd)
    except BaseException:
        if ready_r is not None:
            os.close(ready_r)
        raise
    finally:
        os.close(log_fd)
        if ready_w is not None:
            os.close(ready_w)  # the daemon's alone: its exit is the pipe's end of file
    proc = Child(pid)
    _spawned.append(proc)
    _log_offsets[proc.pid] = offset
    if ready_r is not None:
        _ready_pipes[proc.pid] = ready_r
    return proc


# the read end of the readiness pipe of each supervisor this process spawned (by pid)
_ready_pipes: dict[int, int] = {}


def wait_for_news(proc: Child | None, seconds: float) -> None:
    """Wait ``seconds`` before the next probe, or less: until ``proc`` (a supervisor spawned
    here) writes ``ready`` on its readiness pipe or exits (end of file). Once it has said
    either, its pipe is closed and later waits are plain sleeps."""
    fd = _ready_pipes.get(proc.pid) if proc is not None else None
    if fd is None or proc is None:
        time.sleep(seconds)
        return
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(max(0, round(seconds * 1000))):  # (POLLHUP too: it exited)
        drop_ready_pipe(proc)


def drop_ready_pipe(proc: Child | None) -> None:
    """Close our end of ``proc``'s readiness pipe (if it has one still)."""
    fd = _ready_pipes.pop(proc.pid, None) if proc is not None else None
    if fd is not None:
        os.close(fd)


def take_ready_fd(environ: dict[str, str] | os._Environ[str]) -> int | None:
    """In an autostarted daemon: the write end of its client's readiness pipe, taken out of
    ``environ`` (no child inherits it: not the variable, not the descriptor); ``None`` when
    there is none, or the variable names no pipe of ours."""
    import stat

    raw = environ.pop(READY_FD_ENV, None)
    if raw is None or not raw.isdigit():
        return None
    fd = int(raw)
    try:
        if fd <= 2 or not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        os.set_inheritable(fd, False)
    except OSError:
        return None
    return fd


def tell_ready(fd: int) -> None:
    """Say ``ready`` on the readiness pipe ``fd`` and close it (the client may be gone)."""
    try:
        os.write(fd, b"ready\n")
    except OSError:
        pass  # its client gave up waiting (EPIPE): nobody to tell
    finally:
        os.close(fd)


def readiness_notifier(fd: int) -> Notifier:
    """The notifier of an autostarted daemon: its ``READY=1`` (sent once it serves hellos) is
    :func:`tell_ready` on ``fd``; everything else goes nowhere, as for any daemon without a
    service manager."""
    from ._sdnotify import Notifier

    left = [fd]

    async def send(data: bytes) -> None:
        import trio

        if left and b"READY=1" in data.split(b"\n"):
            tell_ready(left.pop())
        await trio.lowlevel.checkpoint()

    return Notifier(None, sender=send)


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        data = path.read_bytes()[-8192:]
    except OSError:
        return "(no daemon log)"
    text = data.decode(errors="replace").strip().splitlines()[-lines:]
    return "\n".join(text) or "(empty daemon log)"


# where each supervisor this process spawned began writing in the daemon log (by pid)
_log_offsets: dict[int, int] = {}
_ERROR_PREFIX = "trio-agentd: error: "  # the daemon's one line for a cause it names


def startup_failed(layout: Layout, code: int, pid: int | None = None) -> AgentdError:
    """The supervisor ``pid`` (spawned here) exited during startup: the cause it named in its
    own lines of the daemon log, first and alone; else its last lines (never older ones)."""
    since = _log_offsets.pop(pid, None) if pid is not None else None
    if since is not None:
        own = _own_lines(layout.log_path, since)
        causes = [line[len(_ERROR_PREFIX):] for line in own if line.startswith(_ERROR_PREFIX)]
        if causes:
            return AgentdError(
                ErrorCode.DAEMON_UNAVAILABLE,
                f"{causes[-1]} (the supervisor exited during startup with code {code}; its"
                f" log: {layout.log_path})",
                {"exit_code": code},
            )
        tail = "\n".join(own[-8:]) or "(it wrote nothing)"
    else:
        tail = log_tail(layout.log_path)
    return AgentdError(
        ErrorCode.DAEMON_UNAVAILABLE,
        f"the supervisor exited during startup with code {code}; last lines of"
        f" {layout.log_path}:\n{tail}",
        {"exit_code": code},
    )


def _own_lines(path: Path, since: int) -> list[str]:
    """The lines written to ``path`` from byte ``since`` on (at most the last 8 KiB)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(since, size - 8192))
            data = f.read(8192)
    except OSError:
        return []
    return data.decode(errors="replace").strip().splitlines()


def startup_timeout(layout: Layout, seconds: float) -> AgentdError:
    return AgentdError(
        ErrorCode.DAEMON_UNAVAILABLE,
        f"no supervisor answered on {layout.socket} within {seconds:g}s; last lines of"
        f" {layout.log_path}:\n{log_tail(layout.log_path)}",
    )


def autostart_and_wait(
    layout: Layout,
    timing: Timing | ClientTiming = CLIENT,
    *,
    trace: Callable[[str], object] | None = None,
) -> None:
    """Spawn a supervisor and wait until *a* supervisor (ours or a race winner) says hello.
    ``trace`` (``-v``) is told what happened: started (its pid), or found another's.

    Raises:
        AgentdError: ``daemon_unavailable`` with the exit code and log tail if the spawned
            supervisor failed, or after ``startup_timeout``.
    """
    from . import _fs
    from ._syncconn import probe

    deadline = time.monotonic() + timing.startup_timeout
    # one client spawns, the others wait for its supervisor's hello: a crowd of clients
    # starting at once does not start a crowd of supervisors that all but one lose
    from ._trust import home_problem, make_private_dirs

    problem = home_problem(layout)
    if problem is not None:  # the supervisor could not start: say why and what to set
        raise problem
    # a fresh machine has no socket dir yet; one that fails the proof is refused, never reused
    make_private_dirs(layout.socket_dir, private=True)
    lock_path = layout.socket + ".autostart"
    proc: Child | None = None
    lock_fd: int | None = None
    try:
        while time.monotonic() < deadline:
            got = probe(layout, timing)
            if got is not None:
                got[0].close()
                if trace is not None:
                    how = (f"started supervisor pid {proc.pid}" if proc is not None
                           else "another client started supervisor")
                    trace(f"autostart: {how}; pid {got[1].get('pid')} answers")
                return
            if proc is None:
                lock_fd = _fs.try_lock(lock_path)
                if lock_fd is not None:
                    got = probe(layout, timing)  # someone may have finished meanwhile
                    if got is not None:
                        got[0].close()
                        if trace is not None:
                            trace(f"autostart: supervisor pid {got[1].get('pid')} came up"
                                  " meanwhile")
                        return
                    proc = spawn_daemon(layout, ready_pipe=True)
                    if trace is not None:
                        trace(f"autostart: spawned supervisor pid {proc.pid}; waiting for"
                              " its hello")
            elif (rc := proc.poll()) is not None and rc != 0:
                raise startup_failed(layout, rc, proc.pid)
            wait_for_news(proc, timing.probe_interval)
        raise startup_timeout(layout, timing.startup_timeout)
    finally:
        drop_ready_pipe(proc)
        if lock_fd is not None:
            _fs.unlock(lock_fd)


# --- upgrades: handing the socket over to a supervisor of this installation -------------------


def version_key(version: object) -> tuple[int, ...]:
    """The leading numbers of a version string, for ordering (``"0.10.1"`` > ``"0.9"``);
    ``()`` for something that is not a version (it sorts before any)."""
    if not isinstance(version, str):
        return ()
    out: list[int] = []
    for part in version.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if digits == 0:
            break
        out.append(int(part[:digits]))
        if digits != len(part):
            break
    return tuple(out)


def _protocol_of(hello: dict[str, Any]) -> int:
    p = hello.get("protocol")
    return p if isinstance(p, int) and not isinstance(p, bool) else -1


def is_ours(hello: dict[str, Any]) -> bool:
    """The supervisor that said ``hello`` runs this installation's version and protocol."""
    return _protocol_of(hello) == PROTOCOL_VERSION and hello.get("app_version") == APP_VERSION


def is_older(hello: dict[str, Any]) -> bool:
    """The supervisor that said ``hello`` is of an older installation than this client: a
    lower protocol, or the same protocol and a lower app version. Only those are handed over
    by themselves (two installations used side by side must not replace each other on every
    command); ``trio-agentd restart`` replaces any other version."""
    theirs = (_protocol_of(hello), version_key(hello.get("app_version")))
    return theirs < (PROTOCOL_VERSION, version_key(APP_VERSION))


def busy_sessions(rows: object) -> list[str]:
    """The sessions of a ``sessions`` answer that run or queue a turn. A supervisor older than
    the ``busy`` field says it by an idle time of 0 on a ready session."""
    names: list[str] = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        busy = row.get("busy")
        if not isinstance(busy, bool):
            busy = row.get("state") == "ready" and row.get("idle_s") == 0
        if busy:
            names.append(str(row.get("session")))
    return names


def _handover_wait(timing: Timing | ClientTiming) -> float:
    if isinstance(timing, ClientTiming):  # the CLI: the config file or TRIO_AGENTD_TIMING
        from ._config import effective_timing

        return effective_timing().handover_wait
    return timing.handover_wait


def hand_over(
    layout: Layout,
    timing: Timing | ClientTiming = CLIENT,
    *,
    force: bool = False,
    progress: Callable[[str], object] | None = None,
) -> tuple[_Conn, dict[str, Any]]:
    """Replace the supervisor on the socket with one of this installation, keeping its
    sessions and workers; return a connection to the supervisor that serves at the end and
    its hello.

    Once no session is busy (at once with ``force``) the old supervisor is asked to release
    (``shutdown`` with ``stop_workers: false``: it drains, releases its record and socket and
    exits, its workers keep running), and a supervisor is spawned from this installation; it
    adopts the workers. Busy sessions are named once through ``progress`` and waited for at
    most ``handover_wait``. One client hands over at a time (the autostart lock); the others
    wait for it.

    Returns the old supervisor's connection (after saying through ``progress`` what to run)
    when its sessions stayed busy and it speaks this client's protocol.

    Raises:
        AgentdError: ``version_mismatch`` when busy sessions outlast the wait and the old
            supervisor speaks another protocol; ``daemon_unavailable`` when it does not exit
            or ours does not start.
    """
    from . import _fs
    from ._syncconn import _Lost, probe

    wait = _handover_wait(timing)
    start = time.monotonic()
    deadline = start + wait + HANDOVER_EXIT_GRACE + timing.startup_timeout
    lock_path = layout.socket + ".autostart"
    lock_fd: int | None = None
    proc: Child | None = None
    said_busy = False
    try:
        while True:
            got = probe(layout, timing, patience=timing.patience, progress=progress)
            if got is not None and is_ours(got[1]):
                return got
            if time.monotonic() > deadline:
                if got is not None:
                    got[0].close()
                raise startup_timeout(layout, deadline - start)
            if lock_fd is None:
                lock_fd = _fs.try_lock(lock_path)
            if lock_fd is None:
                # another client is handing over or starting a supervisor: wait for it
                if got is not None:
                    got[0].close()
                time.sleep(timing.probe_interval)
                continue
            if got is None:  # the old one is gone: start ours
                if proc is None:
                    proc = spawn_daemon(layout, ready_pipe=True)
                elif (rc := proc.poll()) is not None and rc != 0:
                    raise startup_failed(layout, rc, proc.pid)
                wait_for_news(proc, timing.probe_interval)
                continue
            conn, hello = got
            try:
                # the successor serves the home the old one serves: a home set here that is
                # another one is refused (naming both); a client that set none uses its home
                served = _served_layout(layout, hello)
            except AgentdError:
                conn.close()
                raise
            layout = served
            try:
                busy = [] if force else _busy_of(conn)
            except (OSError, _Lost, AgentdError) as exc:
                conn.close()  # it is going away by itself (or was not reachable): look again
                if isinstance(exc, AgentdError) and exc.code not in (
                    ErrorCode.SHUTTING_DOWN, ErrorCode.DAEMON_UNAVAILABLE
                ):
                    raise
                time.sleep(timing.probe_interval)
                continue
            if busy:
                pid, old = hello.get("pid"), hello.get("app_version")
                names = ", ".join(busy)
                if time.monotonic() - start >= wait:
                    advice = (
                        f"supervisor pid {pid} (trio-agentd {old}) was not replaced: session(s)"
                        f" {names} still busy after {wait:g}s — run `trio-agentd restart` to"
                        f" replace it with {APP_VERSION} now (running turns go on)"
                    )
                    if _protocol_of(hello) != PROTOCOL_VERSION:
                        conn.close()
                        raise AgentdError(ErrorCode.VERSION_MISMATCH, advice,
                                          {"busy": busy, "app_version": old})
                    if progress is not None:
                        progress(advice)
                    return got
                if not said_busy and progress is not None:
                    progress(f"supervisor pid {pid} runs trio-agentd {old}; waiting up to"
                             f" {wait:g}s for busy session(s) {names} to finish before handing"
                             f" over to {APP_VERSION}…")
                said_busy = True
                conn.close()
                time.sleep(HANDOVER_POLL)
                continue
            _release(layout, conn, hello)
            drop_ready_pipe(proc)
            proc = None  # (a supervisor we spawned lost to another one, now released too)
    finally:
        drop_ready_pipe(proc)
        if lock_fd is not None:
            _fs.unlock(lock_fd)


def _served_layout(layout: Layout, hello: dict[str, Any]) -> Layout:
    """``layout`` with the home the supervisor that said ``hello`` serves, when this client set
    no home of its own.

    Raises:
        AgentdError: ``config`` when the home set here is another one.
    """
    layout.check_served_home(hello.get("home"))
    served = hello.get("home")
    if layout.home_source is not None or not isinstance(served, str) or not served:
        return layout
    if os.path.abspath(served) == str(layout.home):
        return layout
    return Layout(home=os.path.abspath(served), socket=layout.socket,
                  registry=layout._registry, home_source=None)


def _busy_of(conn: _Conn) -> list[str]:
    from ._syncconn import _await_response

    conn.send({"type": "request", "id": "handover-sessions", "client_id": "handover",
               "op": "sessions", "args": {}})
    return busy_sessions(_await_response(conn, "handover-sessions", None))


def _release(layout: Layout, conn: _Conn, hello: dict[str, Any]) -> None:
    """Ask the supervisor to release the socket and exit, leaving its workers running (the
    ``shutdown`` op with ``stop_workers: false``, which every protocol version has); wait for
    it to exit."""
    from ._identity import wait_gone
    from ._syncconn import _await_response, _Lost

    try:
        conn.send({"type": "request", "id": "handover", "client_id": "handover",
                   "op": "shutdown", "args": {"stop_workers": False}})
        _await_response(conn, "handover", None)
    except (OSError, _Lost):
        pass  # it went away meanwhile: as good
    except AgentdError as exc:
        if exc.code != ErrorCode.SHUTTING_DOWN:
            raise
    finally:
        conn.close()
    pid, start_id = hello.get("pid"), hello.get("start_id")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return
    start_id = start_id if isinstance(start_id, str) else None
    if not wait_gone(pid, start_id, HANDOVER_EXIT_GRACE):
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            f"supervisor pid {pid} (trio-agentd {hello.get('app_version')}) was asked to"
            f" hand {layout.socket} over to {APP_VERSION} but did not exit within"
            f" {HANDOVER_EXIT_GRACE:g}s — run `trio-agentd doctor --fix`",
        )


def main() -> None:
    """``python -m trio_agentd._autostart --socket S --home H --registry R [--handover]``
    (for open_client: a supervisor is started, or handed over to, from a helper process)."""
    import argparse  # (here: a client's autostart imports this module, not its parser)

    from ._errors import AgentdError

    p = argparse.ArgumentParser(prog="trio-agentd-autostart")
    p.add_argument("--socket", required=True)
    p.add_argument("--home", required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--handover", action="store_true")
    p.add_argument("--handover-wait", type=float)
    args = p.parse_args()
    layout = Layout.resolve(socket=args.socket, home=args.home, registry=args.registry)
    import dataclasses

    from .timing import timing_from_env

    try:
        timing = timing_from_env()
        if args.handover_wait is not None:
            timing = dataclasses.replace(timing, handover_wait=args.handover_wait)
        if args.handover:
            conn, _hello = hand_over(layout, timing,
                                     progress=lambda line: print(line, file=sys.stderr))
            conn.close()
        else:
            autostart_and_wait(layout, timing)
    except AgentdError as exc:
        print(exc.message, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
