"""Durable stops on MockClock with fake workers: exact virtual times.

A stop (kill, eviction, shutdown) is written to the descriptor before the worker is told or
signalled; a successor finishes a recorded stop without adopting, respawning or counting it;
a kill ends a running turn at once with ``session_killed``; an eviction never cuts a turn and
idle time counts from its end; a prompt that meets a stop is served after it, not after 30 s.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from trio_agentd._handle import SessionRetired, WorkerHandle
from trio_agentd._protocol import ErrorBody, Response
from trio_agentd._recovery import Mode, StopReason, descriptor_lifecycle
from trio_agentd.agents import Agent, TurnContext
from trio_agentd.testing import FakeWorkerOps


class RecordingOps(FakeWorkerOps):
    """Descriptor writes go into the event log, as the lifecycle and reason written."""

    def persist(self, h: WorkerHandle) -> None:
        super().persist(h)
        life = descriptor_lifecycle(h.mode.value, h.stop_reason)
        self._event(f"persist {life} {h.stop_reason}".rstrip())


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
    ops.events.append((trio.current_time(), "-- ready --"))
    return h


def _after_ready(ops: FakeWorkerOps) -> list[tuple[float, str]]:
    mark = max(i for i, (_, what) in enumerate(ops.events) if what == "-- ready --")
    return ops.events[mark + 1:]


async def _prompt(h: WorkerHandle, text: str, command_id: int) -> Response:
    return await h.call("prompt", {"text": text, "command_id": command_id, "stream": False},
                        client_id="c", on_event=None)


# --- the intent is written first ---------------------------------------------------------------


@pytest.mark.parametrize("reason", [StopReason.KILL, StopReason.EVICT, StopReason.SHUTDOWN])
async def test_the_stop_is_on_disk_before_the_worker_is_signalled(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, reason: StopReason
) -> None:
    ops = RecordingOps(nursery)
    h = await _ready(ops, nursery)
    autojump_clock.jump(4.0)
    pid = h.pid
    done = h.request_stop(graceful=False, reason=reason)
    # written inside request_stop, before the supervise task can act on it
    assert _after_ready(ops) == [(4.0, f"persist stopping {reason}")]
    assert ops.processes[0].alive
    await done.wait()
    # (an eviction asks the worker first, even for a forced stop: it must not cut a turn)
    told = [] if reason is StopReason.EVICT else [(4.0, f"signal SIGTERM {pid}")]
    assert _after_ready(ops) == [
        (4.0, f"persist stopping {reason}"),
        *told,
        (4.0, f"persist stopped {reason}"),
    ]
    assert trio.current_time() == 4.0
    assert (h.mode.value, h.restarts) == (Mode.STOPPED, 0)


async def test_a_graceful_kill_is_on_disk_before_the_worker_is_asked(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery)
    h = await _ready(ops, nursery)
    proc = ops.processes[0]
    h.request_stop(graceful=True, reason=StopReason.KILL)
    assert _after_ready(ops) == [(0.0, "persist stopping kill")]
    assert proc.alive
    assert proc.signals == []
    await h.wait_stop_handled()
    assert not proc.alive
    assert proc.signals == []  # it stopped when asked
    assert _after_ready(ops)[-1] == (0.0, "persist stopped kill")


# --- a successor finishes the stop ---------------------------------------------------------------


@pytest.mark.parametrize("reason", [StopReason.KILL, StopReason.EVICT, StopReason.SHUTDOWN])
async def test_a_successor_finishes_a_recorded_stop_and_never_adopts_or_respawns(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, reason: StopReason
) -> None:
    ops = RecordingOps(nursery)
    old = await _ready(ops, nursery)
    proc = ops.processes[0]
    old.cancel_scope.cancel()  # the supervisor died; its worker runs on
    autojump_clock.jump(10.0)
    assert proc.alive
    # what ProcessWorkerOps.load makes of a descriptor "stopping" with this reason
    h = WorkerHandle(ops, "s1", "echo", "/")
    h.pid, h.start_id, h.token = old.pid, old.start_id, old.token
    h.restarts_loaded = 0
    h.loaded_stop_reason = reason
    ops.events.append((trio.current_time(), "-- ready --"))
    await nursery.start(lambda task_status: h.supervise(alive=True, wanted=True,
                                                         task_status=task_status))
    await h.wait_stop_handled()
    assert trio.current_time() == 10.0
    assert _after_ready(ops) == [
        (10.0, f"persist stopping {reason}"),
        (10.0, f"signal SIGTERM {proc.pid}"),
        (10.0, f"persist stopped {reason}"),
    ]  # no connect, no spawn
    assert not proc.alive
    assert len(ops.processes) == 1
    assert (h.mode.value, h.restarts, h.state.restarts_total) == (Mode.STOPPED, 0, 0)
    assert h.summary()["state"] == ("evicted" if reason is StopReason.EVICT else "stopped")
    autojump_clock.jump(100.0)
    await trio.testing.wait_all_tasks_blocked()
    assert len(ops.processes) == 1
    assert h.mode.value is Mode.STOPPED


async def test_a_successor_whose_recorded_worker_is_gone_stops_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery)
    h = WorkerHandle(ops, "s1", "echo", "/")
    h.pid, h.start_id = 4242, "boot:4242"  # dead: no such fake process
    h.loaded_stop_reason = StopReason.KILL
    await nursery.start(lambda task_status: h.supervise(alive=False, wanted=True,
                                                         task_status=task_status))
    await h.wait_stop_handled()
    assert trio.current_time() == 0.0
    assert ops.processes == []
    assert (h.mode.value, h.restarts, h.state.stop_reason) == (Mode.STOPPED, 0, StopReason.KILL)


# --- a kill ends its turns at once ---------------------------------------------------------------


async def test_a_kill_ends_the_running_turn_at_once_with_session_killed(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery, agent_factory=_sleepy(1000.0))
    h = await _ready(ops, nursery)
    responses: list[tuple[float, Response]] = []

    async def prompt(command_id: int) -> None:
        response = await _prompt(h, "long", command_id)
        responses.append((trio.current_time(), response))

    async with trio.open_nursery() as callers:
        callers.start_soon(prompt, 1)
        await trio.sleep(3.0)
        callers.start_soon(prompt, 2)  # queued behind the running turn
        await trio.sleep(1.0)
        assert h.idle_for(trio.current_time()) == 0.0
        h.request_stop(graceful=True, reason=StopReason.KILL)
        await h.wait_stop_handled()
    assert trio.current_time() == 4.0
    assert [t for t, _ in responses] == [4.0, 4.0]
    for _, response in responses:
        assert not response.ok
        assert isinstance(response.error, ErrorBody)
        assert response.error.code == "session_killed"
        assert "\n" not in response.error.message
    assert (h.mode.value, h.restarts) == (Mode.STOPPED, 0)
    assert ops.processes[0].signals == []  # it stopped when asked, no TERM needed


# --- prompts that meet a stop --------------------------------------------------------------------


async def test_a_prompt_meeting_an_eviction_is_served_by_a_fresh_worker_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery)
    h = await _ready(ops, nursery)
    autojump_clock.jump(5400.0)
    t0 = trio.current_time()
    h.request_stop(graceful=True, reason=StopReason.EVICT)
    response = await _prompt(h, "after", 1)
    assert response.ok
    assert trio.current_time() == t0  # not worker_connect_timeout later
    assert len(ops.processes) == 2
    assert not ops.processes[0].alive
    assert h.pid == ops.processes[1].pid
    assert (h.mode.value, h.restarts) == (Mode.READY, 0)


async def test_a_prompt_meeting_a_kill_is_sent_back_once_the_session_is_retired(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery)
    h = await _ready(ops, nursery)
    outcome: list[tuple[float, BaseException]] = []

    async def prompt() -> None:
        try:
            await _prompt(h, "after", 1)
        except SessionRetired as exc:
            outcome.append((trio.current_time(), exc))

    async with trio.open_nursery() as callers:
        h.request_stop(graceful=True, reason=StopReason.KILL)
        callers.start_soon(prompt)
        await h.wait_stop_handled()
        await trio.sleep(2.0)  # the killed session is never started again for it
        assert len(ops.processes) == 1
        assert outcome == []
        h.retire()  # what the supervisor does once the kill is done
    assert [t for t, _ in outcome] == [2.0]
    assert len(ops.processes) == 1


# --- eviction never cuts a turn --------------------------------------------------------------


async def test_an_eviction_is_declined_mid_turn_and_idle_counts_from_the_turns_end(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery, agent_factory=_sleepy(10.0))
    h = await _ready(ops, nursery)
    proc = ops.processes[0]
    responses: list[tuple[float, Response]] = []

    async def prompt() -> None:
        # straight to the worker, as a client's direct route: not through the handle
        assert h.link is not None
        response = await h.link.call("prompt", {"text": "long", "command_id": 1},
                                     client_id="c", on_event=None)
        responses.append((trio.current_time(), response))

    async with trio.open_nursery() as callers:
        callers.start_soon(prompt)
        await trio.sleep(5.0)
        h.busy = False  # as after a supervisor restart: the worker's notice never came
        h.request_stop(graceful=True, reason=StopReason.EVICT)
        await h.wait_stop_handled()
        assert trio.current_time() == 5.0
        assert h.mode.value is Mode.READY
        assert proc.alive
        assert proc.signals == []
        assert h.summary()["state"] == "ready"
        assert _after_ready(ops)[-2:] == [(5.0, "persist stopping evict"), (5.0, "persist ready")]
    assert [(t, r.ok) for t, r in responses] == [(10.0, True)]
    assert h.pid == proc.pid
    assert len(ops.processes) == 1
    for _ in range(100):  # the worker's turn_done notice may trail its answer by a step
        if h.turns == 1:
            break
        await trio.lowlevel.checkpoint()
    assert trio.current_time() == 10.0
    assert h.idle_for(trio.current_time()) == 0.0
    await trio.sleep(2.0)
    assert h.idle_for(trio.current_time()) == 2.0  # from the turn's end, not its start


async def test_a_queued_prompt_keeps_the_session_busy(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery, agent_factory=_sleepy(10.0))
    h = await _ready(ops, nursery)

    async with trio.open_nursery() as callers:
        callers.start_soon(_prompt, h, "one", 1)
        callers.start_soon(_prompt, h, "two", 2)
        await trio.sleep(15.0)  # the first turn is over, the second runs
        assert h.idle_for(trio.current_time()) == 0.0
        h.busy = False  # the worker's notices aside, the queued call counts
        assert h.idle_for(trio.current_time()) == 0.0
    assert trio.current_time() == 20.0
    await trio.sleep(3.0)
    assert h.idle_for(trio.current_time()) == 3.0


async def test_a_kill_during_an_eviction_still_kills(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = RecordingOps(nursery)
    h = await _ready(ops, nursery)
    h.request_stop(graceful=True, reason=StopReason.EVICT)
    h.request_stop(graceful=True, reason=StopReason.KILL)
    await h.wait_stop_handled()
    assert (h.mode.value, h.state.stop_reason) == (Mode.STOPPED, StopReason.KILL)
    assert signal.SIGKILL not in ops.processes[0].signals
