"""After an upgrade the supervisor replaces adopted workers of another version once their
session is idle (MockClock, fake workers): an eviction the worker declines while a turn runs,
then a start as for a prompt — never counted as a crash."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._protocol import APP_VERSION, PROTOCOL_VERSION, Response
from trio_agentd._recovery import Mode
from trio_agentd.agents import Agent, TurnContext
from trio_agentd.testing import FakeWorkerOps


def _sleepy(seconds: float) -> type[Agent]:
    class SleepyAgent:
        replayable = False

        async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
            await trio.sleep(seconds)
            yield f"turn {ctx.turn}: {prompt}"

    return SleepyAgent


async def _ready(ops: FakeWorkerOps, nursery: trio.Nursery) -> WorkerHandle:
    h = WorkerHandle(ops, "s1", "echo", "/")
    await nursery.start(lambda task_status: h.supervise(alive=False, wanted=False,
                                                         task_status=task_status))
    await h.wait_ready()
    return h


async def test_a_worker_reports_its_version_and_one_of_another_is_outdated(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    h = await _ready(FakeWorkerOps(nursery), nursery)
    assert (h.worker_version, h.worker_protocol) == (APP_VERSION, PROTOCOL_VERSION)
    assert h.summary()["version"] == APP_VERSION
    assert not h.outdated
    h.worker_version = "0.0.9"  # as a worker adopted from an older installation says
    assert h.outdated
    h.worker_version, h.worker_protocol = APP_VERSION, PROTOCOL_VERSION - 1
    assert h.outdated
    h.worker_version = None  # a worker older than the field says nothing: another version
    h.worker_protocol = PROTOCOL_VERSION
    assert h.outdated


async def test_an_idle_outdated_worker_is_replaced_at_once_not_counted_as_a_crash(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _ready(ops, nursery)
    first = ops.processes[0]
    h.worker_version = "0.0.9"
    await trio.sleep(7.0)
    assert await h.replace_worker()
    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() == 7.0
    assert not first.alive
    assert h.pid == ops.processes[1].pid != first.pid
    assert (h.worker_version, h.outdated, h.restarts) == (APP_VERSION, False, 0)
    assert h.summary()["state"] == "ready"
    response = await h.call("prompt", {"text": "hi", "command_id": 1}, client_id="c",
                            on_event=None)
    assert response.result["reply"] == "[echo turn 1] hi\n"


async def test_a_busy_outdated_worker_declines_and_is_replaced_after_its_turn(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, agent_factory=_sleepy(10.0))
    h = await _ready(ops, nursery)
    first = ops.processes[0]
    h.worker_version = "0.0.9"
    answers: list[tuple[float, Response]] = []

    async def prompt() -> None:
        assert h.link is not None  # a client's direct route: straight to the worker
        response = await h.link.call("prompt", {"text": "long", "command_id": 1},
                                     client_id="c", on_event=None)
        answers.append((trio.current_time(), response))

    async with trio.open_nursery() as callers:
        callers.start_soon(prompt)
        await trio.sleep(5.0)
        assert not await h.replace_worker()  # a turn runs: it keeps serving
        assert (trio.current_time(), h.mode.value, h.pid) == (5.0, Mode.READY, first.pid)
        assert first.alive
        assert h.summary()["state"] == "ready"
    assert [(t, r.ok) for t, r in answers] == [(10.0, True)]
    assert await h.replace_worker()
    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() == 10.0
    assert (h.pid, h.worker_version, h.restarts) == (ops.processes[1].pid, APP_VERSION, 0)
