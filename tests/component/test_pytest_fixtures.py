"""The trio_agentd pytest plugin's MockClock fixtures, as this project's own tests load them
(through the installed entry point), and the context managers behind them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd.testing import (
    Behaviour,
    FakeSession,
    FakeSupervisor,
    Mode,
    open_fake_session,
    open_fake_supervisor,
)
from trio_agentd.timing import DEFAULT_TIMING, Timing

SHORT_CHECKS = dataclasses.replace(DEFAULT_TIMING, self_check_interval=7.0)


@pytest.mark.parametrize("agentd_behaviours", [[Behaviour.REFUSES, Behaviour.ANSWERS]])
async def test_parametrized_behaviours_reach_the_fake_session_and_the_last_one_repeats(
    autojump_clock: trio.testing.MockClock, agentd_fake_session: FakeSession
) -> None:
    s = agentd_fake_session
    assert s.ops.processes == []
    assert s.handle.mode.value is Mode.STOPPED
    assert (await s.prompt("hi")).result["reply"] == "[echo turn 1] hi\n"
    refused, first = s.ops.processes
    assert (refused.behaviour, first.behaviour) == (Behaviour.REFUSES, Behaviour.ANSWERS)
    assert [what for _, what in s.ops.events] == [
        f"spawn {refused.pid}", f"connect {refused.pid}", f"signal SIGTERM {refused.pid}",
        f"spawn {first.pid}", f"connect {first.pid}"]

    first.die()
    await trio.testing.wait_all_tasks_blocked()
    third = s.ops.processes[2]
    assert third.behaviour is Behaviour.ANSWERS  # the last behaviour repeats
    assert s.handle.pid == third.pid
    assert (await s.prompt("again")).ok
    assert trio.current_time() == 0.0


@pytest.mark.parametrize("agentd_timing", [SHORT_CHECKS])
async def test_the_fake_supervisor_uses_the_timing_given_and_keeps_its_files_in_tmp_path(
    autojump_clock: trio.testing.MockClock, agentd_fake_supervisor: FakeSupervisor,
    agentd_timing: Timing, tmp_path: Path,
) -> None:
    fake = agentd_fake_supervisor
    assert fake.timing is agentd_timing
    assert fake.sup.layout.home.is_relative_to(tmp_path)
    record = fake.sup.ownership.registry.owner_json(fake.sup.generation)
    assert record.is_relative_to(tmp_path)
    record.unlink()
    await trio.sleep_until(agentd_timing.self_check_interval)
    await trio.testing.wait_all_tasks_blocked()  # the self-check due now has run
    assert record.exists()


async def test_a_fake_supervisor_test_that_waits_for_ever_fails_at_its_time_limit(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    with pytest.RaisesGroup(pytest.RaisesExc(AssertionError, match="at 100s of trio time")):
        async with open_fake_supervisor(tmp_path, time_limit=100.0):
            await trio.sleep_forever()
    assert trio.current_time() == 100.0


async def test_open_fake_session_spawns_on_the_first_command_and_ends_with_its_block(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_fake_session("mine", agent="echo") as s:
        await trio.sleep(5)
        assert s.ops.processes == []
        assert (await s.prompt("hi")).result["session"] == "mine"
        (p,) = s.ops.processes
        assert s.ops.events[0] == (5.0, f"spawn {p.pid}")
    # the worker's tasks were cancelled with the block's nursery: nothing kept it open
    assert trio.current_time() == 5.0
