"""Autostart of a supervisor by a client (SPEC §2), shared by the sync and async clients.

The CLI calls :func:`autostart_and_wait` in-process (it is short-lived, so the daemon is
re-parented when it exits). A Trio program must not keep a detached daemon as its child (it would
linger as a zombie after the daemon exits), so ``open_client`` runs the same function in a short
helper process, ``python -m trio_agentd._autostart``, which exits once the daemon answers.

The client spawns ``python -E -P -m trio_agentd --socket S --home H --registry R daemon
--autostarted`` detached (new session, cwd ``/``, stdio to the daemon log: nothing is imported from
the client's cwd) and polls for a hello. A spawned daemon that loses the
race to another one exits 0 quietly (``--autostarted``), so the client keeps polling for the
winner; one that exits non-zero makes the client fail with the exit code and the log's tail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ._defaults import CLIENT, ClientTiming
from ._errors import AgentdError, ErrorCode
from ._paths import Layout

if TYPE_CHECKING:
    from .timing import Timing



# variables that tell one process which daemon to be; a spawned daemon gets flags instead
_INTERNAL_ENV = frozenset({"TRIO_AGENTD_ADMISSION_TICKET", "TRIO_AGENTD_REGISTRY_DIR",
                           "TRIO_AGENTD_HOME", "TRIO_AGENTD_SOCKET"})


def spawn_daemon(
    layout: Layout, *, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``trio-agentd daemon --autostarted`` detached, stdio to the daemon log."""
    from ._fs import ensure_dir, open_trusted
    from ._trust import isolated_python

    try:
        ensure_dir(layout.state_dir)
    except AgentdError as exc:
        if exc.code != ErrorCode.CONFIG:
            raise
        raise AgentdError(
            exc.code, f"{exc.message} (the home {layout.home} comes from"
            f" {layout.home_origin()}; --home and TRIO_AGENTD_HOME choose another)", exc.details,
        ) from None
    log_fd = open_trusted(layout.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    # the daemon's own variables name this layout; nothing internal is left for its agents
    env = {k: v for k, v in os.environ.items() if k not in _INTERNAL_ENV}
    env.update(extra_env or {})
    try:
        return subprocess.Popen(
            [*isolated_python("trio_agentd"), "--socket", layout.socket,
             "--home", str(layout.home), "--registry", str(layout.registry),
             "daemon", "--autostarted"],
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            start_new_session=True,
            close_fds=True,
            cwd="/",  # the daemon never holds the client's cwd (or its mount) busy
            env=env,
        )
    finally:
        os.close(log_fd)


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        data = path.read_bytes()[-8192:]
    except OSError:
        return "(no daemon log)"
    text = data.decode(errors="replace").strip().splitlines()[-lines:]
    return "\n".join(text) or "(empty daemon log)"


def startup_failed(layout: Layout, code: int) -> AgentdError:
    return AgentdError(
        ErrorCode.DAEMON_UNAVAILABLE,
        f"the supervisor exited during startup with code {code}; last lines of"
        f" {layout.log_path}:\n{log_tail(layout.log_path)}",
        {"exit_code": code},
    )


def startup_timeout(layout: Layout, seconds: float) -> AgentdError:
    return AgentdError(
        ErrorCode.DAEMON_UNAVAILABLE,
        f"no supervisor answered on {layout.socket} within {seconds:g}s; last lines of"
        f" {layout.log_path}:\n{log_tail(layout.log_path)}",
    )


def autostart_and_wait(layout: Layout, timing: Timing | ClientTiming = CLIENT) -> None:
    """Spawn a supervisor and wait until *a* supervisor (ours or a race winner) says hello.

    Raises:
        AgentdError: ``daemon_unavailable`` with the exit code and log tail if the spawned
            supervisor failed, or after ``startup_timeout``.
    """
    from . import _fs
    from ._syncclient import probe

    deadline = time.monotonic() + timing.startup_timeout
    # one client spawns, the others wait for its supervisor's hello: a crowd of clients
    # starting at once does not start a crowd of supervisors that all but one lose
    from ._trust import make_private_dirs

    problem = layout.home_problem()
    if problem is not None:  # the supervisor could not start: say why and what to set
        raise problem
    # a fresh machine has no socket dir yet; one that fails the proof is refused, never reused
    make_private_dirs(layout.socket_dir, private=True)
    lock_path = layout.socket + ".autostart"
    proc: subprocess.Popen[bytes] | None = None
    lock_fd: int | None = None
    try:
        while time.monotonic() < deadline:
            got = probe(layout, timing)
            if got is not None:
                got[0].close()
                return
            if proc is None:
                lock_fd = _fs.try_lock(lock_path)
                if lock_fd is not None:
                    got = probe(layout, timing)  # someone may have finished meanwhile
                    if got is not None:
                        got[0].close()
                        return
                    proc = spawn_daemon(layout)
            elif (rc := proc.poll()) is not None and rc != 0:
                raise startup_failed(layout, rc)
            time.sleep(timing.probe_interval)
        raise startup_timeout(layout, timing.startup_timeout)
    finally:
        if lock_fd is not None:
            _fs.unlock(lock_fd)


def main() -> None:
    """``python -m trio_agentd._autostart --socket S --home H --registry R`` (for open_client)."""
    from ._errors import AgentdError

    p = argparse.ArgumentParser(prog="trio-agentd-autostart")
    p.add_argument("--socket", required=True)
    p.add_argument("--home", required=True)
    p.add_argument("--registry", required=True)
    args = p.parse_args()
    layout = Layout.resolve(socket=args.socket, home=args.home, registry=args.registry)
    from .timing import timing_from_env

    try:
        autostart_and_wait(layout, timing_from_env())
    except AgentdError as exc:
        print(exc.message, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
