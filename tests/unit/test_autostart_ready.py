"""The readiness pipe of an autostarted supervisor: the client wakes when it is told (or the
supervisor exits), not at its next probe tick; the supervisor's side takes the pipe and says
``ready`` once."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from trio_agentd import _autostart
from trio_agentd._autostart import (
    READY_FD_ENV,
    drop_ready_pipe,
    readiness_notifier,
    take_ready_fd,
    wait_for_news,
)
from trio_agentd._earlytemplate import Child

LONG = 30.0  # a probe tick no test may wait out


class _Spawned:
    """Stands for the supervisor ``spawn_daemon`` started: its pid, and its readiness pipe
    registered as ``spawn_daemon`` registers it (the test holds the write end)."""

    def __init__(self, pid: int, write_end: int) -> None:
        self.pid = pid
        self.write_end = write_end


@pytest.fixture
def spawned() -> Iterator[_Spawned]:
    r, w = os.pipe()
    proc = _Spawned(-12345, w)
    _autostart._ready_pipes[proc.pid] = r
    try:
        yield proc
    finally:
        drop_ready_pipe(proc)  # type: ignore[arg-type]
        if proc.write_end >= 0:
            os.close(proc.write_end)


def _close_write(proc: _Spawned) -> None:
    os.close(proc.write_end)
    proc.write_end = -1


def test_the_wait_ends_when_the_supervisor_says_ready(spawned: _Spawned) -> None:
    os.write(spawned.write_end, b"ready\n")
    start = time.monotonic()
    wait_for_news(spawned, LONG)  # type: ignore[arg-type]
    assert time.monotonic() - start < LONG / 2
    assert spawned.pid not in _autostart._ready_pipes  # news once: later waits are ticks


def test_the_wait_ends_when_the_supervisor_exits_without_a_word(spawned: _Spawned) -> None:
    """A supervisor that lost the race (or failed) closes the pipe by exiting: the client
    looks at once (for the winner, or for the exit status)."""
    _close_write(spawned)
    start = time.monotonic()
    wait_for_news(spawned, LONG)  # type: ignore[arg-type]
    assert time.monotonic() - start < LONG / 2
    assert spawned.pid not in _autostart._ready_pipes


def test_without_news_the_wait_is_the_probe_tick(spawned: _Spawned) -> None:
    start = time.monotonic()
    wait_for_news(spawned, 0.05)  # type: ignore[arg-type]
    assert time.monotonic() - start >= 0.04
    assert spawned.pid in _autostart._ready_pipes  # still listening for its news


def test_take_ready_fd_takes_a_pipe_out_of_the_environment_and_off_inheritance() -> None:
    r, w = os.pipe()
    try:
        os.set_inheritable(w, True)
        env = {READY_FD_ENV: str(w), "OTHER": "1"}
        assert take_ready_fd(env) == w
        assert env == {"OTHER": "1"}
        assert not os.get_inheritable(w)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("value", ["", "x", "-1", "1", "999999"])
def test_take_ready_fd_refuses_what_is_no_pipe_of_ours(value: str) -> None:
    env = {READY_FD_ENV: value}
    assert take_ready_fd(env) is None
    assert env == {}


def test_take_ready_fd_refuses_a_descriptor_that_is_not_a_pipe() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        assert take_ready_fd({READY_FD_ENV: str(fd)}) is None
    finally:
        os.close(fd)


async def test_the_notifier_says_ready_once_on_ready_and_then_closes_the_pipe() -> None:
    r, w = os.pipe()
    try:
        notifier = readiness_notifier(w)
        await notifier.status("starting")  # nothing before READY=1
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 64)
        await notifier.ready("serving")
        assert os.read(r, 64) == b"ready\n"
        assert os.read(r, 64) == b""  # closed: the client's wait is over
        await notifier.stopping("stopping")  # later messages go nowhere, without an error
    finally:
        os.close(r)


async def test_the_notifier_does_not_fail_when_its_client_is_gone() -> None:
    r, w = os.pipe()
    os.close(r)
    notifier = readiness_notifier(w)
    await notifier.ready("serving")  # EPIPE: nobody to tell, no error
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(w)  # closed all the same


def test_spawn_daemon_passes_the_pipe_only_when_asked(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: os.PathLike[str]) -> None:
    """Only the clients that wait for their supervisor open a readiness pipe (a restart's or
    doctor's successor has nobody reading it); the daemon gets no other descriptor of ours
    that it could inherit, in a new session."""
    seen: list[dict[str, object]] = []
    stray_r, stray_w = os.pipe()
    os.set_inheritable(stray_w, True)  # as one this process inherited would be

    def posix_spawn(path: str, argv: list[str], env: dict[str, str], **kw: object) -> int:
        inheritable = {fd for fd in map(int, os.listdir("/proc/self/fd"))
                       if fd > 2 and _inheritable(fd)}
        seen.append({"env": env, "inheritable": inheritable, **kw})
        return -777

    monkeypatch.setattr(os, "posix_spawn", posix_spawn)
    from trio_agentd._paths import Layout

    layout = Layout.resolve(socket=f"{tmp_path}/d.sock", home=f"{tmp_path}/home",
                            registry=f"{tmp_path}/reg")
    try:
        _autostart.spawn_daemon(layout)
        env = seen[-1]["env"]
        assert isinstance(env, dict)
        assert READY_FD_ENV not in env
        assert seen[-1]["setsid"] is True
        closed = _closed(seen[-1])
        assert stray_w in closed  # (close_fds: the daemon never holds it)
        assert _fds(seen[-1]["inheritable"]) - closed == set()
        _autostart.spawn_daemon(layout, ready_pipe=True)
        env = seen[-1]["env"]
        assert isinstance(env, dict)
        fd = int(env[READY_FD_ENV])
        closed = _closed(seen[-1])
        assert fd not in closed
        assert stray_w in closed
        assert _fds(seen[-1]["inheritable"]) - closed == {fd}  # the one descriptor it inherits
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)  # the write end is the daemon's alone: closed here
        assert -777 in _autostart._ready_pipes
    finally:
        os.close(stray_r)
        os.close(stray_w)
        drop_ready_pipe(Child(-777))
        _autostart._log_offsets.pop(-777, None)
        _autostart._spawned.clear()


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:
        return False


def _fds(value: object) -> set[int]:
    assert isinstance(value, set)
    return value


def _closed(call: dict[str, object]) -> set[int]:
    actions = call["file_actions"]
    assert isinstance(actions, list)
    return {a[1] for a in actions if a[0] == os.POSIX_SPAWN_CLOSE}
