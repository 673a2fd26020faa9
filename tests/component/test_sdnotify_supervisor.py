"""The supervisor's sd_notify messages on MockClock: READY once it serves, STATUS on changes,
STOPPING when it stops, and WATCHDOG=1 at its exact cadence — only after healthy self-checks.

A real ``Supervisor`` with fake workers and in-memory clients; its :class:`Notifier` records
each datagram it would send, with the virtual time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._sdnotify import Notifier
from trio_agentd._supervisor import Supervisor
from trio_agentd.testing import MemoryClient, MemoryListener
from trio_agentd.timing import DEFAULT_TIMING, Timing

from .conftest import advance_to, supervisor_world

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[float, str]] = []

    async def __call__(self, data: bytes) -> None:
        self.sent.append((trio.current_time(), data.decode()))

    def pings(self) -> list[float]:
        return [t for t, m in self.sent if m == "WATCHDOG=1"]

    def others(self) -> list[tuple[float, str]]:
        return [(t, m) for t, m in self.sent if m != "WATCHDOG=1"]


@contextlib.asynccontextmanager
async def world(
    tmp_path: Path, run_dir: Path, rec: Recorder, *, watchdog: float | None,
    timing: Timing = DEFAULT_TIMING, self_heal: bool = True,
) -> AsyncIterator[tuple[Supervisor, MemoryListener]]:
    notifier = Notifier("\0test", watchdog=watchdog, sender=rec)
    async with supervisor_world(tmp_path, run_dir, timing=timing, self_heal=self_heal,
                                inotify=False, notifier=notifier) as w:
        yield w.sup, w.listener


async def test_ready_then_watchdog_every_half_period_then_stopping(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    rec = Recorder()
    interval = 1.0  # WATCHDOG_USEC=2000000: a ping every second
    period = DEFAULT_TIMING.self_check_interval
    assert interval % period == 0  # every ping falls on a self-check tick
    async with world(tmp_path, run_dir, rec, watchdog=interval) as (sup, _):
        await trio.testing.wait_all_tasks_blocked()
        assert rec.sent == [(0.0, "READY=1\nSTATUS=serving 0 sessions (0 workers running)")]
        await advance_to(5.0)
        assert rec.pings() == [1.0, 2.0, 3.0, 4.0, 5.0]
        sup.request_shutdown(stop_workers=True)
        await sup.stopped.wait()
    stop_at = 5.0
    assert rec.others()[-1] == (stop_at, "STOPPING=1\nSTATUS=stopping: stopping the workers")
    assert rec.pings()[-1] <= stop_at


async def test_status_follows_the_sessions_at_the_next_self_check(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    rec = Recorder()
    period = DEFAULT_TIMING.self_check_interval
    async with world(tmp_path, run_dir, rec, watchdog=None) as (sup, listener):
        await advance_to(10 * period + period / 2)
        assert rec.others() == [(0.0, "READY=1\nSTATUS=serving 0 sessions (0 workers running)")]
        asked = trio.current_time()
        c = await MemoryClient.connect(listener, client_id="t")
        try:
            assert (await c.request("prompt", {"session": "s1", "text": "hi"})).ok
        finally:
            await c.aclose()
        await advance_to(12 * period)
        # one line, at the first tick after the session started; nothing sent in between
        assert rec.others()[1:] == [(11 * period, "STATUS=serving 1 session (1 worker running)")]
        assert asked < 11 * period
        assert rec.pings() == []  # no watchdog asked for: none sent
        sup.request_shutdown(stop_workers=False)
        await sup.stopped.wait()
        assert rec.others()[-1][1] == "STOPPING=1\nSTATUS=stopping: workers left running for" \
            " adoption"


async def test_a_watchdog_shorter_than_the_self_check_makes_the_checks_as_frequent(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    rec = Recorder()
    interval = 0.125  # WatchdogSec=0.25s: below the 0.25 s self-check interval
    async with world(tmp_path, run_dir, rec, watchdog=interval):
        await advance_to(1.0)
    assert rec.pings() == [0.125 * k for k in range(1, 9)]


async def test_a_supervisor_that_lost_its_record_stops_pinging(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    rec = Recorder()
    interval = 1.0
    # no self-heal: a deleted record stays deleted, every self-check fails
    async with world(tmp_path, run_dir, rec, watchdog=interval, self_heal=False) as (sup, _):
        await advance_to(2.5)
        assert rec.pings() == [1.0, 2.0]
        sup.ownership.registry.owner_json(sup.generation).unlink()
        await advance_to(10.0)
        assert rec.pings() == [1.0, 2.0]  # the service manager's watchdog restarts it
