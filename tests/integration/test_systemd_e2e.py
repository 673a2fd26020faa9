"""Running under systemd, without systemd: a real supervisor process with the variables a
service manager sets.

- sd_notify: the test binds the AF_UNIX datagram socket ``NOTIFY_SOCKET`` names and reads what
  the supervisor sends (the exact cadence is asserted on MockClock in
  tests/component/test_sdnotify_supervisor.py; here, the wire).
- socket activation: the test binds and listens, and starts the supervisor with the socket as
  fd 3 and ``LISTEN_PID`` = its pid (a small wrapper that ``exec``s it), as systemd does.
- signals: SIGINT on a foreground daemon stops its workers; SIGTERM leaves them for the next.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator

import pytest

from .harness import DaemonEnv, wait_for


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw.split(b"\0") if kv)


def _worker_pid(env: DaemonEnv, session: str) -> int:
    cp = env.run("sessions", "--json")
    assert cp.returncode == 0, cp.stderr
    rows = {r["session"]: r for r in json.loads(cp.stdout)}
    return int(rows[session]["pid"])


@pytest.fixture
def notify(denv: DaemonEnv) -> Iterator[tuple[socket.socket, str]]:
    path = str(denv.root / "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(30)  # a deadline for each message, not a sleep
    yield s, path
    s.close()


def _next(s: socket.socket, *, skip_pings: bool = True) -> str:
    while True:
        msg = s.recv(4096).decode()
        if not (skip_pings and msg == "WATCHDOG=1"):
            return msg


def test_ready_status_watchdog_and_stopping_reach_the_notify_socket(
    denv: DaemonEnv, notify: tuple[socket.socket, str]
) -> None:
    s, path = notify
    sup = denv.popen("daemon", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    assert _next(s) == "READY=1\nSTATUS=serving 0 sessions (0 workers running)"
    # READY means serving: the owner record is written and the socket answers hello
    assert denv.owner()["pid"] == sup.pid
    hello = denv.hello()
    assert hello is not None
    assert hello["pid"] == sup.pid
    # pings, from the self-check loop, every WATCHDOG_USEC / 2 = 0.2 s (at most every
    # self-check, 0.25 s by default... here the watchdog is shorter, so checks follow it)
    for _ in range(3):
        assert s.recv(4096) == b"WATCHDOG=1"
    assert denv.prompt("hi", session="a") == "[echo turn 1] hi"
    assert _next(s) == "STATUS=serving 1 session (1 worker running)"
    worker = _worker_pid(denv, "a")
    # neither the worker nor the fork template inherits the service manager's variables
    # (the supervisor's own /proc environ is what it was started with)
    others = [pid for pid in denv.our_pids() if pid != sup.pid]
    assert worker in others
    for pid in others:
        assert "NOTIFY_SOCKET" not in _environ(pid), pid
        assert "WATCHDOG_USEC" not in _environ(pid), pid
    sup.send_signal(signal.SIGTERM)
    assert _next(s) == "STOPPING=1\nSTATUS=stopping: workers left running for adoption"
    assert sup.wait(timeout=30) == 0
    assert worker in denv.our_pids()


def test_a_watchdog_meant_for_another_pid_is_not_pinged(
    denv: DaemonEnv, notify: tuple[socket.socket, str]
) -> None:
    s, path = notify
    sup = denv.popen("daemon", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000",
                                    "WATCHDOG_PID": "1"})
    assert _next(s, skip_pings=False).startswith("READY=1\n")
    assert denv.prompt("hi") == "[echo turn 1] hi"  # many self-checks later...
    # ... the next message is the status change, then stopping: never a ping
    assert _next(s, skip_pings=False).startswith("STATUS=serving 1 session")
    sup.send_signal(signal.SIGTERM)
    assert _next(s, skip_pings=False).startswith("STOPPING=1\n")
    assert sup.wait(timeout=30) == 0


def test_an_autostarted_supervisor_notifies_no_one(
    denv: DaemonEnv, notify: tuple[socket.socket, str]
) -> None:
    # a client run by some Type=notify unit autostarts a supervisor: that unit's socket is
    # not the supervisor's to notify
    s, path = notify
    cp = denv.run("-p", "hi", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    assert cp.returncode == 0, cp.stderr
    sup = int(denv.owner()["pid"])
    worker = _worker_pid(denv, "default")
    assert "NOTIFY_SOCKET" not in _environ(worker)
    os.kill(sup, signal.SIGTERM)
    wait_for(lambda: sup not in denv.our_pids(), timeout=30, what="the supervisor to exit")
    s.setblocking(False)
    with pytest.raises(BlockingIOError):
        s.recv(4096)  # it has exited: anything it sent would be here


# --- socket activation -------------------------------------------------------------------------

# what systemd does between fork and exec: the socket onto fd 3, LISTEN_PID = the pid that
# then execs the daemon (sh's redirections cannot name an fd above 9: a Python exec wrapper)
_WRAPPER = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="trio-agentd.socket")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _activated(denv: DaemonEnv, fd: int) -> subprocess.Popen[str]:
    """Start ``trio-agentd daemon`` with ``fd`` as its fd 3 and LISTEN_PID its own pid."""
    argv = denv.argv("daemon")
    p = subprocess.Popen(
        [argv[0], "-c", _WRAPPER, str(fd), *argv], env=denv.env, pass_fds=(fd,),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    denv.procs.append(p)
    return p


def _listening_unix(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    s.listen(16)
    return s


def test_socket_activation_serves_on_the_inherited_socket_and_never_unlinks_it(
    denv: DaemonEnv,
) -> None:
    listener = _listening_unix(denv.socket)
    inode = os.lstat(denv.socket).st_ino
    # a client that connects before the supervisor runs (what wakes a socket unit) is
    # queued, and greeted once the supervisor starts
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.settimeout(30)
    early.connect(denv.socket)
    sup = _activated(denv, listener.fileno())
    listener.close()  # the supervisor's copy is the only one now
    try:
        hello = json.loads(early.makefile("rb").readline())
    finally:
        early.close()
    assert hello["pid"] == sup.pid
    assert denv.prompt("hi", session="act") == "[echo turn 1] hi"
    assert denv.owner()["pid"] == sup.pid
    assert os.lstat(denv.socket).st_ino == inode  # served on it, never bound again
    assert "a socket passed by the service manager" in denv.log_text()
    worker = _worker_pid(denv, "act")
    others = [pid for pid in denv.our_pids() if pid != sup.pid]
    assert worker in others
    for pid in others:
        assert not any(k.startswith("LISTEN_") for k in _environ(pid)), pid
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0
    # the service manager's socket: left where it is (systemd keeps listening on it)
    assert os.lstat(denv.socket).st_ino == inode
    assert denv.owner_records() == []
    assert worker in denv.our_pids()


def test_an_activated_supervisor_whose_socket_file_is_removed_binds_its_own(
    denv: DaemonEnv,
) -> None:
    listener = _listening_unix(denv.socket)
    sup = _activated(denv, listener.fileno())
    listener.close()
    wait_for(lambda: (denv.hello() or {}).get("pid") == sup.pid, timeout=30,
             what="the activated supervisor to answer")
    inherited = os.lstat(denv.socket).st_ino
    os.unlink(denv.socket)  # a cleaner; clients could no longer reach it
    wait_for(lambda: os.path.lexists(denv.socket), timeout=30,
             what="the self-check to bind the path again")
    assert os.lstat(denv.socket).st_ino != inherited
    assert denv.prompt("hi") == "[echo turn 1] hi"
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0
    assert not os.path.lexists(denv.socket)  # that one it bound itself: removed on exit


def _refused(p: subprocess.Popen[str]) -> str:
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert "Traceback" not in err
    ours = [line for line in err.splitlines() if line.startswith("trio-agentd: error:")]
    assert len(ours) == 1, err
    return ours[0]


def test_socket_activation_refuses_a_regular_file(denv: DaemonEnv) -> None:
    with open(denv.root / "not-a-socket", "w") as f:
        line = _refused(_activated(denv, f.fileno()))
    assert line == ("trio-agentd: error: socket activation: fd 3 is a regular file, not a socket"
                    f" — the .socket unit must say ListenStream={denv.socket} (`trio-agentd"
                    " service install --socket-activation` writes one)")
    assert denv.owner_records() == []
    assert not os.path.lexists(denv.socket)


def test_socket_activation_without_a_passed_fd_says_none_was_passed(denv: DaemonEnv) -> None:
    # LISTEN_PID and LISTEN_FDS set, fd 3 closed: the daemon's own log file takes fd 3 before
    # the listener is looked for, and is no socket a service manager passed
    argv = denv.argv("daemon")
    p = subprocess.Popen(
        [argv[0], "-c", "import os, sys\nos.environ.update(LISTEN_PID=str(os.getpid()),"
         " LISTEN_FDS='1')\nos.execv(sys.argv[1], sys.argv[1:])", *argv], env=denv.env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    denv.procs.append(p)
    line = _refused(p)
    assert line.startswith("trio-agentd: error: socket activation: LISTEN_FDS=1 but no fd 3 was"
                           " passed to the daemon (fd 3 is its own "), line
    assert "daemon.log) — start it from a .socket unit, or unset LISTEN_PID and LISTEN_FDS" in line
    assert denv.owner_records() == []
    assert not os.path.lexists(denv.socket)


def test_socket_activation_refuses_a_socket_on_another_path(denv: DaemonEnv) -> None:
    other = denv.socket_at("other.sock")
    s = _listening_unix(other)
    try:
        line = _refused(_activated(denv, s.fileno()))
    finally:
        s.close()
    assert f"fd 3 listens on {other}, not on the supervisor's socket {denv.socket}" in line
    assert f"or run the daemon with --socket {other}" in line
    assert denv.owner_records() == []


def test_socket_activation_refuses_a_tcp_socket(denv: DaemonEnv) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        line = _refused(_activated(denv, s.fileno()))
    finally:
        s.close()
    assert "fd 3 is a TCP/IP (AF_INET) socket, not a Unix socket" in line


# --- signals to a foreground daemon -----------------------------------------------------------

def _foreground(denv: DaemonEnv) -> subprocess.Popen[str]:
    sup = denv.popen("daemon")
    wait_for(lambda: (denv.hello() or {}).get("pid") == sup.pid, timeout=30,
             what="the foreground supervisor to answer")
    return sup


def test_ctrl_c_on_a_foreground_daemon_stops_its_workers(denv: DaemonEnv) -> None:
    sup = _foreground(denv)
    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    assert denv.prompt("one", session="b") == "[echo turn 1] one"
    workers = [_worker_pid(denv, "a"), _worker_pid(denv, "b")]
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=60) == 0
    assert "signal SIGINT: shutting down, stopping the workers" in denv.log_text()
    assert "(workers stopped)" in denv.log_text()
    # nothing is left for the next command to find: no worker, record, socket or template
    assert denv.our_pids() == []
    assert not any(w in denv.our_pids() for w in workers)
    assert denv.owner_records() == []
    assert not os.path.lexists(denv.socket)
    # the sessions keep their history: the next prompt starts them again
    assert denv.prompt("two", session="a") == "[echo turn 2] two"


def test_sigterm_on_a_foreground_daemon_leaves_its_workers_for_the_next(
    denv: DaemonEnv,
) -> None:
    sup = _foreground(denv)
    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    worker = _worker_pid(denv, "a")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 0
    assert "signal SIGTERM: stopping, workers left running" in denv.log_text()
    assert worker in denv.our_pids()
    assert denv.owner_records() == []
    assert not os.path.lexists(denv.socket)
    # adopted by the next supervisor (autostarted here), same worker
    assert denv.prompt("two", session="a") == "[echo turn 2] two"
    assert _worker_pid(denv, "a") == worker

