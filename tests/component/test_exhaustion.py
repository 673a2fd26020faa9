"""Exhaustion on MockClock: the accept loop's back-off and rate-limited log at exact virtual
times (a fake listener raising EMFILE), and a real in-process supervisor whose self-check cannot
read its owner record, whose service task raises, and whose connection cap is reached."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

import trio_agentd
from trio_agentd import AgentdError, SupervisorConfig
from trio_agentd._exhaustion import RateLimitedLog, accept_forever
from trio_agentd._supervisor import Supervisor
from trio_agentd.timing import ACCEPT_BACKOFF, SERVICE_RESTART_DELAY

LOGGER = "trio_agentd.supervisor"
pytestmark = pytest.mark.timeout(30)


class _FakeSocket:
    def fileno(self) -> int:
        return 7


class FakeListener:
    """accept(): raises each error of ``script`` in turn (a non-exception is returned), then
    ClosedResourceError. Records the virtual time of every call."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.calls: list[float] = []
        self.socket = _FakeSocket()

    async def accept(self) -> object:
        await trio.lowlevel.checkpoint()
        self.calls.append(trio.current_time())
        if not self.script:
            raise trio.ClosedResourceError
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


def emfile() -> OSError:
    return OSError(errno.EMFILE, "Too many open files")


def records(caplog: pytest.LogCaptureFixture, logger: str = LOGGER) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger]


async def test_accept_backs_off_on_emfile_and_goes_on_at_exact_virtual_times(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    listener = FakeListener([emfile(), emfile(), OSError(errno.ENOBUFS, "x"), "conn-1",
                             "conn-2"])
    started: list[object] = []
    rl = RateLimitedLog(logging.getLogger(LOGGER), 10.0, clock=trio.current_time)
    await accept_forever(cast(trio.SocketListener, listener), started.append, rl=rl,
                         what="supervisor", backoff=0.25)
    assert listener.calls == [0.0, 0.25, 0.5, 0.75, 0.75, 0.75]
    assert started == ["conn-1", "conn-2"]
    assert records(caplog) == [
        (logging.ERROR, "supervisor: accept failed: too many open files (RLIMIT_NOFILE"
         f" {_soft()}) — raise `ulimit -n` or close idle clients; trying again in 0.25s"),
        (logging.ERROR, "supervisor: accept failed: out of kernel buffer space (ENOBUFS) —"
         " close idle clients; trying again in 0.25s"),
        (logging.INFO, "supervisor: accepting connections again (after 3 failed accepts)"),
    ]


async def test_accept_backoff_defaults_to_trios_and_other_errors_are_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    listener = FakeListener([emfile(), OSError(errno.EINVAL, "not listening")])
    rl = RateLimitedLog(logging.getLogger(LOGGER), 10.0, clock=trio.current_time)
    with pytest.raises(OSError, match="not listening"):
        await accept_forever(cast(trio.SocketListener, listener), lambda s: None, rl=rl,
                             what="w")
    assert listener.calls == [0.0, ACCEPT_BACKOFF]


async def test_a_long_emfile_episode_logs_one_line_per_interval_with_a_count(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    listener = FakeListener([*(emfile() for _ in range(100)), "conn"])  # 25 s of EMFILE
    rl = RateLimitedLog(logging.getLogger(LOGGER), 10.0, clock=trio.current_time)
    await accept_forever(cast(trio.SocketListener, listener), lambda s: None, rl=rl,
                         what="supervisor", backoff=0.25)
    assert listener.calls[-1] == 25.0
    got = records(caplog)
    assert len(got) == 4, got
    assert "suppressed" not in got[0][1]
    assert got[1][1].endswith("(39 similar lines suppressed in the last 10s)")  # at 10.0
    assert got[2][1].endswith("(39 similar lines suppressed in the last 10s)")  # at 20.0
    assert got[3] == (logging.INFO,
                      "supervisor: accepting connections again (after 100 failed accepts)")


def _soft() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- a real supervisor, in process -----------------------------------------------------------


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ta-x-", dir="/tmp"))  # socket paths must be short
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _config(root: Path, **kw: Any) -> SupervisorConfig:
    (root / "s").mkdir(mode=0o700, exist_ok=True)
    return SupervisorConfig(socket=str(root / "s" / "d.sock"), home=str(root / "home"),
                            registry=str(root / "reg"), stop_workers_on_exit=True, **kw)


async def _first_line(path: str) -> tuple[trio.SocketStream, dict[str, Any]]:
    stream = await trio.open_unix_socket(path)
    data = b""
    while b"\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, "closed before the first line"
        data += chunk
    return stream, dict(json.loads(data.split(b"\n", 1)[0]))


async def _ping(sup: Supervisor) -> Any:
    async with trio_agentd.open_client(sup.layout.socket, home=str(sup.layout.home),
                                       registry=str(sup.layout.registry),
                                       autostart=False) as client:
        return await client.request("ping")


async def test_a_self_check_that_cannot_read_the_record_is_logged_per_interval_and_serves(
    short_tmp: Path, autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with trio_agentd.open_supervisor(_config(short_tmp)) as sup:
        t0 = trio.current_time()
        real = sup.registry.read_owner_bytes

        def unreadable(generation: str) -> bytes | None:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(sup.registry, "read_owner_bytes", unreadable)
        await trio.sleep(25.1)  # 100 self-checks, every 250 ms
        assert not sup.shutdown_requested.is_set()
        # a command meanwhile: its ownership check cannot read either: resource_exhausted
        with pytest.raises(AgentdError) as info:
            await _ping(sup)
        assert info.value.code == "resource_exhausted"
        assert "too many open files (RLIMIT_NOFILE" in info.value.message
        monkeypatch.setattr(sup.registry, "read_owner_bytes", real)
        assert (await _ping(sup))["pong"] is True
        await trio.sleep(1)
        assert sup.ownership.statistics().restores == 0
        assert not sup.ownership.revoked.is_set()
    failing = [(r.created, r.getMessage()) for r in caplog.records
               if r.name == LOGGER and r.getMessage().startswith("self-check: cannot read")]
    # first at 0.25, then one line per 10 s interval with the count held back
    assert len(failing) == 3, failing
    assert "suppressed" not in failing[0][1]
    assert failing[1][1].endswith("(39 similar lines suppressed in the last 10s)")
    assert [m for _, m in records(caplog) if "confirmed again" in m] == [
        "self-check: ownership confirmed again"]
    assert not [r for r in caplog.records if r.exc_info]
    assert t0 == 0.0


async def test_a_service_task_that_raises_is_logged_and_started_again(
    short_tmp: Path, autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with trio_agentd.open_supervisor(_config(short_tmp)) as sup:
        calls: list[float] = []

        async def flaky() -> None:
            await trio.lowlevel.checkpoint()
            calls.append(trio.current_time())
            if len(calls) == 1:
                raise RuntimeError("boom")

        monkeypatch.setattr(sup.ownership, "ensure_current", flaky)
        await trio.sleep(1.3)
        assert not sup.shutdown_requested.is_set()
        # the check at 0.25 raised; the loop started again 0.5 s later and checks every 0.25
        assert calls == [0.25, 1.0, 1.25]
        monkeypatch.undo()
        assert (await _ping(sup))["pong"] is True
    (line,) = [r for r in caplog.records if r.getMessage().startswith("self-check failed")]
    assert line.getMessage() == (
        f"self-check failed: RuntimeError('boom'); starting it again in {SERVICE_RESTART_DELAY:g}s"
    )
    assert line.exc_info is not None  # an unexpected error keeps its traceback


async def test_beyond_max_clients_a_connection_gets_one_resource_exhausted_line(
    short_tmp: Path, autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio_agentd.open_supervisor(_config(short_tmp, max_clients=2)) as sup:
        a, hello_a = await _first_line(sup.layout.socket)
        b, hello_b = await _first_line(sup.layout.socket)
        assert hello_a["type"] == hello_b["type"] == "hello"
        c, refused = await _first_line(sup.layout.socket)
        assert refused["ok"] is False
        assert refused["error"]["code"] == "resource_exhausted"
        assert refused["error"]["message"] == (
            "the supervisor serves at most 2 client connections at once — close idle clients"
            " and try again")
        assert await c.receive_some(10) == b""  # and closed
        await a.aclose()
        await trio.sleep(0.1)
        d, hello_d = await _first_line(sup.layout.socket)  # one left: room again
        assert hello_d["type"] == "hello"
        for s in (b, c, d):
            await s.aclose()
