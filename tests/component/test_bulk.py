"""Many sessions at once on MockClock with fake workers: worker starts overlap up to a bound,
and a batch stop tells every worker before it waits for any, with one grace for them all."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._handle import StopBatch, WorkerHandle
from trio_agentd._workerlink import WorkerLink
from trio_agentd.testing import Behaviour, FakeWorkerOps, open_fake_supervisor
from trio_agentd.timing import MAX_PARALLEL_SPAWNS

SPAWN_TIME = 1.0


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()


class Overlap:
    """Counts the spawns under way; each takes SPAWN_TIME of virtual time."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    def wrap(self, start: Callable[..., Any]) -> Callable[..., Any]:
        async def slow_start(h: WorkerHandle, **kw: Any) -> None:
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                await trio.sleep(SPAWN_TIME)
                await start(h, **kw)
            finally:
                self.now -= 1

        return slow_start


async def test_spawns_overlap_up_to_the_bound_and_no_further(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    overlap = Overlap()
    ops.start_process = overlap.wrap(ops.start_process)  # type: ignore[method-assign]
    limiter = trio.CapacityLimiter(3)
    handles = [WorkerHandle(ops, f"s{i}", "echo", "/", spawn_limiter=limiter) for i in range(8)]
    ready: dict[str, float] = {}

    async def start(h: WorkerHandle) -> None:
        await h.wait_ready()
        ready[h.session_id] = trio.current_time()

    for h in handles:
        await nursery.start(lambda task_status, h=h: h.supervise(
            alive=False, wanted=False, task_status=task_status))
    async with trio.open_nursery() as starts:
        for h in handles:
            starts.start_soon(start, h)
    assert overlap.most == 3
    # three at a time, each from its slot: its deadline is not eaten by the queue
    assert sorted(ready.values()) == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0]


async def test_the_supervisor_starts_many_sessions_at_most_the_bound_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with open_fake_supervisor(tmp_path) as fake:
        overlap = Overlap()
        fake.machine.start_process = overlap.wrap(  # type: ignore[method-assign]
            fake.machine.start_process)
        n = MAX_PARALLEL_SPAWNS + 4
        answers: list[float] = []

        async def one(i: int) -> None:
            response = await fake.prompt("hi", session=f"s{i}")
            assert response.ok, response
            answers.append(trio.current_time())

        async with trio.open_nursery() as prompts:
            for i in range(n):
                prompts.start_soon(one, i)
        assert overlap.most == MAX_PARALLEL_SPAWNS
        assert sorted(answers) == [SPAWN_TIME] * MAX_PARALLEL_SPAWNS + [2 * SPAWN_TIME] * 4


class Order(FakeWorkerOps):
    """Logs each worker told to stop (its answer to ``stop``) and each wait for an exit."""

    order: list[str]

    async def connect(self, h: WorkerHandle, **kw: Any) -> WorkerLink:
        link = await super().connect(h, **kw)
        call = link.call

        async def logged(op: str, args: dict[str, Any], **kw: Any) -> Any:
            response = await call(op, args, **kw)
            if op == "stop":
                self.order.append(f"told {h.session_id}")
            return response

        link.call = logged  # type: ignore[method-assign]
        return link

    async def wait_exit(self, h: WorkerHandle) -> None:
        self.order.append(f"wait {h.session_id}")
        await super().wait_exit(h)


async def _ready_handles(ops: FakeWorkerOps, nursery: trio.Nursery, n: int
                         ) -> list[WorkerHandle]:
    handles = [WorkerHandle(ops, f"s{i}", "echo", "/") for i in range(n)]
    for h in handles:
        await nursery.start(lambda task_status, h=h: h.supervise(
            alive=False, wanted=True, task_status=task_status))
    for h in handles:
        await h.wait_ready()
    return handles


async def test_a_batch_stop_tells_every_worker_before_it_waits_for_any(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = Order(nursery)
    ops.order = []
    handles = await _ready_handles(ops, nursery, 5)
    t0 = trio.current_time()
    batch = StopBatch(t0 + ops.timing.stop_grace)
    done = [h.request_stop(graceful=True, batch=batch) for h in handles]
    for event in done:
        await event.wait()
    told = [i for i, what in enumerate(ops.order) if what.startswith("told")]
    waits = [i for i, what in enumerate(ops.order) if what.startswith("wait")]
    assert len(told) == len(waits) == 5
    assert max(told) < min(waits), ops.order
    assert trio.current_time() == t0  # the workers exit when told: no grace spent
    assert all(not p.alive for p in ops.processes)


async def test_a_session_still_starting_does_not_hold_up_the_batch(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = Order(nursery, behaviours=[Behaviour.ANSWERS, Behaviour.ANSWERS,
                                     Behaviour.NEVER_READY])
    ops.order = []
    handles = await _ready_handles(ops, nursery, 2)
    starting = WorkerHandle(ops, "late", "echo", "/")
    await nursery.start(lambda task_status: starting.supervise(
        alive=False, wanted=True, task_status=task_status))
    await trio.testing.wait_all_tasks_blocked()
    t0 = trio.current_time()
    batch = StopBatch(t0 + ops.timing.stop_grace)
    done = [h.request_stop(graceful=True, batch=batch) for h in [*handles, starting]]
    for event in done[:2]:
        await event.wait()
    assert trio.current_time() == t0  # not after the starting one's stop_grace
    assert [p.alive for p in ops.processes] == [False, False, True]


async def test_a_new_session_is_made_without_waiting_for_a_scheduling_round(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Creating a session never yields (no lock, no awaited task start): 100 new sessions at
    once do not queue behind each other one scheduling round each. Shown with a cancelled
    scope, where any checkpoint would raise."""
    async with open_fake_supervisor(tmp_path) as fake:
        with trio.CancelScope() as scope:
            scope.cancel()
            handles = [await fake.sup.table.get_session(f"s{i}", None, "/", create=True)
                       for i in range(100)]
        assert not scope.cancelled_caught
        assert [h.session_id for h in handles] == [f"s{i}" for i in range(100)]
        response = await fake.prompt("hi", session="s7")  # its worker starts on demand
        assert response.ok, response
