"""Socket activation: which LISTEN_* variables are for us, and the proof that an inherited fd
is the supervisor's own listening socket (pure verdicts, then real fds)."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_agentd._errors import AgentdError
from trio_agentd._sdactivate import ListenerFacts, listen_request, listener_problem, take_listener


def test_listen_request() -> None:
    assert listen_request("42", "1", None, 42) is True
    assert listen_request("42", "1", "trio-agentd.socket", 42) is True
    assert listen_request("41", "1", None, 42) is False  # another process's
    assert listen_request(None, "1", None, 42) is False
    assert listen_request("42", None, None, 42) is False
    assert listen_request("42", "0", None, 42) is False
    with pytest.raises(AgentdError, match="exactly one listening socket"):
        listen_request("42", "2", None, 42)
    with pytest.raises(AgentdError, match="LISTEN_FDS='x'"):
        listen_request("42", "x", None, 42)
    with pytest.raises(AgentdError, match="LISTEN_PID='me'"):
        listen_request("me", "1", None, 42)
    with pytest.raises(AgentdError, match="LISTEN_FDNAMES='a:b' names 2"):
        listen_request("42", "1", "a:b", 42)


def _sock_stat(uid: int, mode: int = 0o600) -> os.stat_result:
    return os.stat_result((stat.S_IFSOCK | mode, 1, 1, 1, uid, 0, 0, 0, 0, 0))


GOOD = ListenerFacts(fd=3, expected="/run/u/ta/daemon.sock", fd_mode=stat.S_IFSOCK | 0o777,
                     family=socket.AF_UNIX, type=socket.SOCK_STREAM, listening=True,
                     name="/run/u/ta/daemon.sock", path_stat=_sock_stat(1000), uid=1000)


def _with(**kw: object) -> ListenerFacts:
    from dataclasses import replace

    return replace(GOOD, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("facts", "says"), [
    (_with(fd_mode=None), "fd 3 is not open"),
    (_with(inheritable=False, target="/h/daemon.log"), "no fd 3 was passed to the daemon (fd 3"
     " is its own /h/daemon.log)"),
    (_with(fd_mode=stat.S_IFREG | 0o600), "fd 3 is a regular file, not a socket"),
    (_with(fd_mode=stat.S_IFIFO | 0o600), "fd 3 is a pipe, not a socket"),
    (_with(family=socket.AF_INET), "fd 3 is a TCP/IP (AF_INET) socket, not a Unix socket"),
    (_with(type=socket.SOCK_DGRAM), "not SOCK_STREAM"),
    (_with(listening=False), "does not listen"),
    (_with(name=b"\0abstract"), "not bound to a path"),
    (_with(name=""), "not bound to a path"),
    (_with(name="/tmp/other.sock"), "fd 3 listens on /tmp/other.sock, not on the supervisor's"
     " socket /run/u/ta/daemon.sock"),
    (_with(path_stat=None), "that path is gone"),
    (_with(path_stat=os.stat_result((stat.S_IFREG | 0o600, 1, 1, 1, 1000, 0, 0, 0, 0, 0))),
     "is a regular file, not the socket"),
    (_with(path_stat=_sock_stat(0)), "owned by uid 0, not by you (uid 1000)"),
    (_with(path_stat=_sock_stat(1000, 0o666)), "set SocketMode=0600"),
])
def test_listener_problem_names_the_cause_and_the_fix(facts: ListenerFacts, says: str) -> None:
    problem = listener_problem(facts)
    assert problem is not None
    assert says in problem
    assert "\n" not in problem


def test_listener_problem_accepts_our_socket() -> None:
    assert listener_problem(GOOD) is None
    assert listener_problem(_with(name="/run/u/ta/./daemon.sock")) is None


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ta-sda-", dir="/tmp"))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _env(pid: int | None = None) -> dict[str, str]:
    return {"LISTEN_PID": str(pid or os.getpid()), "LISTEN_FDS": "1",
            "LISTEN_FDNAMES": "trio-agentd.socket", "OTHER": "x"}


def test_take_listener_proves_a_real_listening_socket(sockdir: Path) -> None:
    path = str(sockdir / "d.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    s.listen(4)
    fd = s.detach()
    os.set_inheritable(fd, True)
    env = _env()
    got = take_listener(env, path, fd=fd)
    assert env == {"OTHER": "x"}  # LISTEN_* removed
    assert got is not None
    try:
        assert got.sock.fileno() == fd
        assert not os.get_inheritable(fd)  # workers do not inherit it
        assert got.ino == os.lstat(path).st_ino
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        c.close()
    finally:
        got.sock.close()


def test_take_listener_ignores_another_pids_variables_but_removes_them(sockdir: Path) -> None:
    env = _env(pid=os.getpid() + 1)
    assert take_listener(env, str(sockdir / "d.sock"), fd=9999) is None
    assert env == {"OTHER": "x"}


def test_take_listener_refuses_a_tcp_socket_and_a_file(sockdir: Path) -> None:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    os.set_inheritable(tcp.fileno(), True)  # as passed through exec
    try:
        with pytest.raises(AgentdError, match="TCP/IP"):
            take_listener(_env(), str(sockdir / "d.sock"), fd=tcp.fileno())
    finally:
        tcp.close()
    with open(sockdir / "f", "w") as f:
        os.set_inheritable(f.fileno(), True)
        with pytest.raises(AgentdError, match="regular file"):
            take_listener(_env(), str(sockdir / "d.sock"), fd=f.fileno())


def test_take_listener_knows_an_fd_it_opened_itself_was_not_passed(sockdir: Path) -> None:
    """LISTEN_FDS set but no fd passed: the daemon's own files take the free fd (its log,
    close-on-exec as everything Python opens); that is no socket from a service manager."""
    with open(sockdir / "daemon.log", "w") as f:
        fd = f.fileno()
        with pytest.raises(AgentdError) as caught:
            take_listener(_env(), str(sockdir / "d.sock"), fd=fd)
    assert caught.value.message.startswith(
        f"socket activation: LISTEN_FDS=1 but no fd {fd} was passed to the daemon (fd {fd} is"
        f" its own {sockdir / 'daemon.log'}) — start it from a .socket unit, or unset LISTEN_PID"
        " and LISTEN_FDS")
    # a socket it made itself is no more passed than a file
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(AgentdError, match="was passed to the daemon"):
            take_listener(_env(), str(sockdir / "d.sock"), fd=s.fileno())
    finally:
        s.close()


def test_take_listener_refuses_a_socket_dir_others_may_enter(sockdir: Path) -> None:
    path = str(sockdir / "d.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o600)
    s.listen(1)
    os.set_inheritable(s.fileno(), True)
    os.chmod(sockdir, 0o755)
    try:
        with pytest.raises(AgentdError, match="not 0700"):
            take_listener(_env(), path, fd=s.fileno())
    finally:
        os.chmod(sockdir, 0o700)
        s.close()
