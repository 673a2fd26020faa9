"""The recovery schedule of SPEC §6 on MockClock: fake processes, exact virtual times."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._recovery import Mode
from trio_agentd.testing import Behaviour, FakeWorkerOps


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()


async def _start(ops: FakeWorkerOps, nursery: trio.Nursery) -> WorkerHandle:
    h = WorkerHandle(ops, "s1", "echo", "/")
    await nursery.start(lambda task_status: h.supervise(alive=False, wanted=False,
                                                         task_status=task_status))
    assert h.mode.value is Mode.STOPPED
    await h.wait_ready()  # a first prompt starts it
    ops.events.append((trio.current_time(), "-- started --"))
    return h


def _since(ops: FakeWorkerOps, t0: float) -> list[tuple[float, str]]:
    """Events after the session started, with times relative to ``t0``."""
    mark = max(i for i, (_, what) in enumerate(ops.events) if what == "-- started --")
    return [(t - t0, what) for t, what in ops.events[mark + 1 :]]


async def test_fresh_spawn_is_ready_at_once_and_answers(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    assert trio.current_time() == 0.0
    response = await h.call("prompt", {"text": "hi", "command_id": 1}, client_id="c",
                            on_event=None)
    assert response.ok
    assert response.result == {"session": "s1", "turn": 1, "reply": "[echo turn 1] hi"}


async def test_dead_worker_is_respawned_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    first = ops.processes[0]
    autojump_clock.jump(3.0)
    t0 = trio.current_time()
    first.die()
    await h.mode.wait_value(Mode.STARTING)
    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() == t0
    assert h.pid == ops.processes[1].pid != first.pid
    assert h.restarts == 1
    assert _since(ops, t0) == [(0.0, f"spawn {h.pid}"), (0.0, f"connect {h.pid}")]


async def test_hung_worker_reconnects_defers_then_stops_and_respawns_on_schedule(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, behaviours=[Behaviour.ANSWERS, Behaviour.ANSWERS])
    h = await _start(ops, nursery)
    p = ops.processes[0]
    autojump_clock.jump(10.0)
    t0 = trio.current_time()
    p.behaviour = Behaviour.HUNG  # alive, but every new connection hangs
    p.cut()
    await h.mode.wait_value(Mode.STARTING)
    await h.mode.wait_value(Mode.READY)
    events = _since(ops, t0)
    connects = [t for t, what in events if what == f"connect {p.pid}"]
    # three reconnects after 0.25 s, 1 s, 5 s (each hangs for the 2 s adopt timeout) ...
    assert connects[:3] == [0.25, 3.25, 10.25]
    # ... then ten deferred probes every 5 s after the previous one timed out
    assert connects[3:] == [10.25 + 7 * k for k in range(1, 11)]
    # then TERM (it dies on TERM) and an immediate respawn
    assert (82.25, f"signal SIGTERM {p.pid}") in events
    new = ops.processes[1]
    assert (82.25, f"spawn {new.pid}") in events
    assert trio.current_time() - t0 == 82.25
    assert h.pid == new.pid


async def test_worker_that_ignores_term_is_killed_after_the_grace(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    p.behaviour = Behaviour.IGNORES_TERM
    t0 = trio.current_time()
    h.request_stop(graceful=False)
    await h.mode.wait_value(Mode.STOPPED)
    assert _since(ops, t0) == [
        (0.0, f"signal SIGTERM {p.pid}"),
        (5.0, f"signal SIGKILL {p.pid}"),
    ]
    assert not p.alive
