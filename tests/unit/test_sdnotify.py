"""sd_notify: the pure decisions, and the wire (datagrams on a real AF_UNIX socket the test
binds, by path and abstract)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from trio_agentd._sdnotify import (
    Notifier,
    WatchdogSchedule,
    notify_address,
    status_text,
    watchdog_interval,
)
from trio_agentd.timing import SD_NOTIFY_TIMEOUT


def test_notify_address_paths_and_abstract_sockets() -> None:
    assert notify_address("/run/user/1000/systemd/notify") == "/run/user/1000/systemd/notify"
    assert notify_address("@/org/freedesktop/systemd1/notify/123") == (
        "\0/org/freedesktop/systemd1/notify/123")
    for bad in ("relative/path", "@", "vsock:2:1234", ""):
        with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
            notify_address(bad)


def test_watchdog_interval_is_half_of_watchdog_usec_and_only_for_our_pid() -> None:
    assert watchdog_interval("30000000", None, 42) == 15.0
    assert watchdog_interval("30000000", "42", 42) == 15.0
    assert watchdog_interval("30000000", "41", 42) is None  # meant for another process
    assert watchdog_interval(None, None, 42) is None
    assert watchdog_interval("", "42", 42) is None
    for bad in ("0", "-5", "1.5", "abc"):
        with pytest.raises(ValueError, match="WATCHDOG_USEC"):
            watchdog_interval(bad, None, 42)
    with pytest.raises(ValueError, match="WATCHDOG_PID"):
        watchdog_interval("1000", "me", 42)


def test_status_text() -> None:
    assert status_text(0, 0) == "serving 0 sessions (0 workers running)"
    assert status_text(1, 1) == "serving 1 session (1 worker running)"
    assert status_text(3, 2) == "serving 3 sessions (2 workers running)"


def test_watchdog_schedule() -> None:
    s = WatchdogSchedule(15.0)
    assert not s.due(100.0)  # not started: nothing is due before READY
    s.start(10.0)
    assert not s.due(24.99)
    assert s.due(25.0)
    s.sent(25.5)
    assert not s.due(40.0)
    assert s.due(40.5)


def test_from_environ_removes_the_variables_children_must_not_inherit() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "7", "KEEP": "1"}
    n = Notifier.from_environ(env, pid=7)
    assert env == {"KEEP": "1"}
    assert n.address == "\0x"
    assert n.watchdog is not None
    assert n.watchdog.interval == 2.0
    assert n.check_period(0.25) == 0.25
    n2 = Notifier.from_environ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "200000"}, pid=7)
    assert n2.check_period(0.25) == 0.1
    n3 = Notifier.from_environ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000",
                                "WATCHDOG_PID": "8"}, pid=7)
    assert n3.watchdog is None
    assert n3.address == "\0x"
    assert not Notifier.from_environ({}, pid=7).enabled


def test_bad_values_are_logged_and_turn_that_part_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "trio_agentd.supervisor"):
        n = Notifier.from_environ({"NOTIFY_SOCKET": "rel", "WATCHDOG_USEC": "x"}, pid=7)
    assert not n.enabled
    assert n.watchdog is None
    assert "NOTIFY_SOCKET='rel' is neither" in caplog.text
    assert "WATCHDOG_USEC='x'" in caplog.text


@pytest.mark.parametrize(("env", "says"), [
    # a number no float holds: one line, not an OverflowError out of the daemon's start
    ({"WATCHDOG_USEC": "9" * 400}, "WATCHDOG_USEC='9999999999999999999999999999999999999999'…"
     " (400 characters) is not a positive number of microseconds below 2^64"),
    ({"WATCHDOG_USEC": "1" * 5000}, "(5000 characters) is not a positive number"),  # int()'s cap
    ({"WATCHDOG_USEC": str(2**64 - 1)}, "is not a positive number of microseconds below 2^64"),
    # digits int() does not take ('²'.isdigit() is true)
    ({"WATCHDOG_USEC": "²"}, "WATCHDOG_USEC='²' is not a positive number of microseconds"),
    ({"WATCHDOG_USEC": "100", "WATCHDOG_PID": "³"}, "WATCHDOG_PID='³' is not a process id"),
    ({"WATCHDOG_USEC": "100", "WATCHDOG_PID": "9" * 400}, "is not a process id"),
])
def test_garbage_watchdog_values_are_one_line_and_no_pings(
    env: dict[str, str], says: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "trio_agentd.supervisor"):
        n = Notifier.from_environ({"NOTIFY_SOCKET": "/run/n", **env}, pid=7)
    assert n.enabled
    assert n.watchdog is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert says in line
    assert line.endswith("; no watchdog pings")
    assert watchdog_interval(str(2**64 - 2), None, 7) == (2**64 - 2) / 2 / 1_000_000


@pytest.fixture
def receiver() -> Iterator[tuple[socket.socket, str]]:
    d = tempfile.mkdtemp(prefix="ta-sdn-", dir="/tmp")
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    yield s, path
    s.close()
    os.unlink(path)
    os.rmdir(d)


async def test_messages_reach_a_path_socket(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path, watchdog=None)
    await n.ready("serving 0 sessions (0 workers running)")
    await n.status("serving 0 sessions (0 workers running)")  # unchanged: not sent
    await n.status("serving 1 session (1 worker running)")
    await n.stopping("stopping: workers left running for adoption")
    await n.status("serving 0 sessions (0 workers running)")  # stopping: the status stays
    n.close()
    got = [sock.recv(4096) for _ in range(3)]
    assert got == [
        b"READY=1\nSTATUS=serving 0 sessions (0 workers running)",
        b"STATUS=serving 1 session (1 worker running)",
        b"STOPPING=1\nSTATUS=stopping: workers left running for adoption",
    ]
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)  # nothing more


async def test_messages_reach_an_abstract_socket() -> None:
    name = f"ta-test-notify-{os.getpid()}-{os.urandom(4).hex()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        env = {"NOTIFY_SOCKET": "@" + name}
        n = Notifier.from_environ(env)
        await n.send("WATCHDOG=1")
        n.close()
        assert s.recv(4096) == b"WATCHDOG=1"
    finally:
        s.close()


async def test_sends_at_once_on_a_full_socket_fail_quietly_one_after_the_other(
    receiver: tuple[socket.socket, str], caplog: pytest.LogCaptureFixture,
) -> None:
    """A service manager that reads nothing: the self-check's WATCHDOG=1 waits on the full
    socket when the shutdown's STOPPING=1 comes. Both fail within SD_NOTIFY_TIMEOUT, logged;
    neither raises (two waits on one socket were trio's BusyResourceError, out of the
    supervisor's shutdown)."""
    _, path = receiver
    n = Notifier(path, watchdog=None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as filler:
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            for _ in range(1_000_000):
                filler.sendto(b"x" * 1024, path)
        start = trio.current_time()
        try:
            with caplog.at_level(logging.DEBUG, "trio_agentd.supervisor"):
                async with trio.open_nursery() as nursery:
                    # both find the socket full in the same scheduling round
                    nursery.start_soon(n.send, "WATCHDOG=1")
                    nursery.start_soon(n.stopping, "stopping: stopping the workers")
        finally:
            n.close()
    # the second waited for the first within its own SD_NOTIFY_TIMEOUT
    assert trio.current_time() - start < 2 * SD_NOTIFY_TIMEOUT
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "failed (timed out)" in warnings[0]
    assert "2 failures" in caplog.text


async def test_a_failure_to_notify_is_logged_once_and_not_raised(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    n = Notifier(str(tmp_path / "nobody-listens"), watchdog=None)
    with caplog.at_level(logging.DEBUG, "trio_agentd.supervisor"):
        await n.ready("x")
        await n.send("WATCHDOG=1")
        await n.stopping("y")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "sd_notify to" in warnings[0].getMessage()
    assert "further failures are not logged" in warnings[0].getMessage()
    assert "3 failures" in caplog.text  # the later ones counted, at debug level
    n.close()
