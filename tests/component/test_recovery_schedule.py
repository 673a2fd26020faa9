"""The recovery schedule on MockClock: fake processes, exact virtual times."""

from __future__ import annotations

import dataclasses
import functools
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._handle import WorkerHandle
from trio_agentd._protocol import Response
from trio_agentd._recovery import Mode
from trio_agentd.agents import Agent, TurnContext
from trio_agentd.testing import Behaviour, FakeWorkerOps
from trio_agentd.timing import DEFAULT_TIMING


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
    assert response.result == {"session": "s1", "turn": 1, "reply": "[echo turn 1] hi\n",
                               "bytes": 17}


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


async def test_a_worker_dead_before_its_link_says_so_is_never_handed_out(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    # a route asked for the moment after a kill -9, before the link's reader has seen the
    # end: the dead worker's link would only fail the client (and cost it a back-off)
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    first = ops.processes[0]
    t0 = trio.current_time()
    first.die()
    dead = h.link
    assert h.mode.value is Mode.READY
    assert dead is not None
    assert not dead.closed.is_set()
    link = await h.wait_ready()
    assert link is not dead
    assert link is h.link
    assert not link.closed.is_set()
    assert h.pid == ops.processes[1].pid != first.pid
    assert trio.current_time() == t0
    assert h.restarts == 1


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


# --- helpers for the schedule tests below ------------------------------------------------------


def mode_of(h: WorkerHandle) -> Mode:
    """The session's mode now (a call, so that mypy does not narrow it across awaits)."""
    mode: Mode = h.mode.value
    return mode


async def advance_to(clock: trio.testing.MockClock, when: float) -> None:
    """Jump the virtual clock to ``when`` (at most onto the next deadline) and let it settle."""
    clock.jump(when - trio.current_time())
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == when


async def _supervise(
    h: WorkerHandle, nursery: trio.Nursery, *, alive: bool, wanted: bool = True
) -> None:
    await nursery.start(functools.partial(h.supervise, alive=alive, wanted=wanted))


def _prompt_args(text: str, command_id: int) -> dict[str, Any]:
    return {"text": text, "command_id": command_id}


async def _prompt(h: WorkerHandle, text: str, command_id: int) -> Response:
    return await h.call("prompt", _prompt_args(text, command_id), client_id="c", on_event=None)


def _echo(turn: int, text: str) -> dict[str, Any]:
    reply = f"[echo turn {turn}] {text}\n"
    return {"session": "s1", "turn": turn, "reply": reply, "bytes": len(reply.encode())}


# a recovery that goes straight from a lost link to the stop: no reconnects, no deferred rounds
STOP_AT_ONCE = dataclasses.replace(
    DEFAULT_TIMING, worker_retry_delays=(), max_deferred_recovery_rounds=0
)


# --- (a) a worker that refuses every connection ---------------------------------------------


async def test_refusing_worker_reconnects_defers_then_is_stopped_and_respawned(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    autojump_clock.jump(10.0)
    t0 = trio.current_time()
    p.behaviour = Behaviour.REFUSES  # alive, but every new connection is refused at once
    p.cut()
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == t0
    assert mode_of(h) is Mode.RECOVERING
    assert _since(ops, t0) == []

    reconnects = [0.25, 1.25, 6.25]  # after 0.25 s, 1 s, 5 s (a refusal takes no time)
    deferred = [6.25 + 5.0 * k for k in range(1, 11)]  # ten probes, every 5 s
    assert deferred[-1] == 56.25
    # step onto each deadline in turn: nothing just before it, the attempt exactly at it
    for n, at in enumerate(reconnects + deferred[:2]):
        await advance_to(autojump_clock, t0 + at - 0.125)
        assert len(_since(ops, t0)) == n
        await advance_to(autojump_clock, t0 + at)
        assert _since(ops, t0)[n:] == [(at, f"connect {p.pid}")]
        assert mode_of(h) is Mode.RECOVERING
    assert h.state.attempts == 3
    assert h.state.rounds == 2

    await h.mode.wait_value(Mode.STARTING)
    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() - t0 == 56.25
    new = ops.processes[1]
    assert _since(ops, t0) == [
        *[(at, f"connect {p.pid}") for at in reconnects + deferred],
        (56.25, f"signal SIGTERM {p.pid}"),
        (56.25, f"spawn {new.pid}"),
        (56.25, f"connect {new.pid}"),
    ]
    assert not p.alive
    assert p.signals == [signal.SIGTERM]
    assert h.pid == new.pid
    assert h.restarts == 1
    response = await _prompt(h, "back", 1)
    assert response.result == _echo(1, "back")


# --- (b) restart intensity --------------------------------------------------------------------


async def _kill_whenever_ready(h: WorkerHandle, ops: FakeWorkerOps) -> list[int]:
    """Kill each worker as soon as the session is ready on it, until the session fails;
    the killed pids."""
    killed: list[int] = []
    for _ in range(10):  # bounded: the session must fail well before
        await h.mode.wait_value(lambda m: m in (Mode.READY, Mode.FAILED))
        if mode_of(h) is Mode.FAILED:
            break
        assert h.pid is not None
        killed.append(h.pid)
        ops.by_pid[h.pid].die()
        await h.mode.wait_value(lambda m: m is not Mode.READY)
    return killed


async def test_crash_loop_fails_after_five_respawns_until_retry(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    killed = await _kill_whenever_ready(h, ops)
    assert mode_of(h) is Mode.FAILED
    assert trio.current_time() == 0.0
    spawns = [what for _, what in ops.events if what.startswith("spawn")]
    # the first start (a prompt's demand) and exactly five crash respawns
    assert spawns == [f"spawn {pid}" for pid in range(2000, 2006)]
    assert killed == list(range(2000, 2006))
    assert h.restarts == 5
    assert all(not p.alive for p in ops.processes)

    with pytest.raises(AgentdError) as info:
        await _prompt(h, "anyone?", 1)
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert "`trio-agentd retry s1`" in info.value.message
    assert len(ops.processes) == 6  # a prompt does not wake a failed session
    assert trio.current_time() == 0.0

    h.retry()
    await h.mode.wait_value(lambda m: m is not Mode.FAILED)
    response = await _prompt(h, "again", 2)
    assert response.ok
    assert response.result == _echo(1, "again")
    assert h.pid == ops.processes[6].pid == 2006
    assert mode_of(h) is Mode.READY
    assert h.restarts == 5  # a retry is not a crash respawn


async def test_prompt_right_after_retry_succeeds(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    assert len(await _kill_whenever_ready(h, ops)) == 6
    assert mode_of(h) is Mode.FAILED
    h.retry()
    response = await _prompt(h, "again", 1)
    assert response.result == _echo(1, "again")


# --- (c) a fresh worker that never becomes ready ------------------------------------------------


async def test_spawn_that_never_becomes_ready_is_abandoned_after_the_connect_timeout(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(
        nursery, behaviours=[Behaviour.ANSWERS, Behaviour.NEVER_READY, Behaviour.ANSWERS]
    )
    h = await _start(ops, nursery)
    autojump_clock.jump(4.0)
    t0 = trio.current_time()
    ops.processes[0].die()
    await trio.testing.wait_all_tasks_blocked()
    stuck = ops.processes[1]
    assert _since(ops, t0) == [(0.0, f"spawn {stuck.pid}")]
    assert mode_of(h) is Mode.STARTING

    await advance_to(autojump_clock, t0 + 29.875)
    assert mode_of(h) is Mode.STARTING
    assert len(_since(ops, t0)) == 1
    assert stuck.alive

    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() - t0 == 30.0
    fresh = ops.processes[2]
    assert _since(ops, t0) == [
        (0.0, f"spawn {stuck.pid}"),
        (30.0, f"signal SIGTERM {stuck.pid}"),
        (30.0, f"spawn {fresh.pid}"),
        (30.0, f"connect {fresh.pid}"),
    ]
    assert not stuck.alive
    assert h.pid == fresh.pid
    assert h.restarts == 2  # the crash respawn and the respawn after the abandoned one


async def test_abandoned_spawn_that_survives_the_kill_fails_the_session(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(
        nursery, behaviours=[Behaviour.ANSWERS, Behaviour.NEVER_READY, Behaviour.ANSWERS]
    )
    h = await _start(ops, nursery)
    t0 = trio.current_time()
    ops.processes[0].die()
    await trio.testing.wait_all_tasks_blocked()
    stuck = ops.processes[1]
    stuck.behaviour = Behaviour.SURVIVES_KILL  # still never ready; now nothing kills it either
    with trio.move_on_after(60.0):
        await h.mode.wait_value(lambda m: m is not Mode.STARTING)
    assert _since(ops, t0) == [
        (0.0, f"spawn {stuck.pid}"),
        (30.0, f"signal SIGTERM {stuck.pid}"),
        (35.0, f"signal SIGKILL {stuck.pid}"),
    ]
    assert mode_of(h) is Mode.FAILED
    assert trio.current_time() - t0 == 37.0


# --- (d) a worker that survives the kill of recovery's stop ------------------------------------


async def test_worker_that_survives_recoverys_kill_fails_the_session_without_a_second_spawn(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, timing=STOP_AT_ONCE)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    autojump_clock.jump(2.0)
    t0 = trio.current_time()
    p.behaviour = Behaviour.SURVIVES_KILL
    p.cut()  # alive, link lost: with no reconnects configured, recovery stops it at once
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.STOPPING
    assert _since(ops, t0) == [(0.0, f"signal SIGTERM {p.pid}")]

    await advance_to(autojump_clock, t0 + 4.875)
    assert len(_since(ops, t0)) == 1
    await advance_to(autojump_clock, t0 + 5.0)
    assert _since(ops, t0) == [(0.0, f"signal SIGTERM {p.pid}"), (5.0, f"signal SIGKILL {p.pid}")]
    await advance_to(autojump_clock, t0 + 6.875)
    assert mode_of(h) is Mode.STOPPING

    await h.mode.wait_value(Mode.FAILED)
    assert trio.current_time() - t0 == 7.0
    # and it stays so: never a second worker beside one we could not stop
    with trio.move_on_after(120.0):
        await h.mode.wait_value(lambda m: m is not Mode.FAILED)
    assert mode_of(h) is Mode.FAILED
    assert _since(ops, t0) == [(0.0, f"signal SIGTERM {p.pid}"), (5.0, f"signal SIGKILL {p.pid}")]
    assert ops.processes == [p]
    assert p.alive
    assert h.restarts == 0
    with pytest.raises(AgentdError) as info:
        await _prompt(h, "hello?", 1)
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE


async def test_failure_after_an_unkillable_worker_is_not_blamed_on_restarts(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, timing=STOP_AT_ONCE)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    p.behaviour = Behaviour.SURVIVES_KILL
    p.cut()
    await h.mode.wait_value(Mode.FAILED)
    assert h.restarts == 0
    with pytest.raises(AgentdError) as info:
        await _prompt(h, "hello?", 1)
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert "restarted more than" not in info.value.message


# --- (e) a held shutdown admission --------------------------------------------------------------


async def test_dead_worker_is_not_respawned_while_the_admission_is_held(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    first = ops.processes[0]
    autojump_clock.jump(1.0)
    t0 = trio.current_time()
    ops.admission = True
    first.die()
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.RECOVERING
    assert _since(ops, t0) == []

    await advance_to(autojump_clock, t0 + 3.0)  # one jump over many polls
    assert mode_of(h) is Mode.RECOVERING
    assert _since(ops, t0) == []
    # and polled tick by tick for five more seconds (ending between two polls)
    before = trio.current_time()
    with trio.move_on_after(5.025):
        await h.mode.wait_value(lambda m: m is not Mode.RECOVERING)
    assert trio.current_time() == before + 5.025
    assert mode_of(h) is Mode.RECOVERING
    assert _since(ops, t0) == []
    assert len(ops.processes) == 1

    released = trio.current_time()
    ops.admission = False
    last_poll = max(t for t, what in h.log if what == "wait 0.05")
    assert released - DEFAULT_TIMING.admission_poll < last_poll < released
    await h.mode.wait_value(Mode.READY)
    new = ops.processes[1]
    spawned_at = last_poll + DEFAULT_TIMING.admission_poll
    assert trio.current_time() == spawned_at
    assert _since(ops, t0)[-2:] == [
        (spawned_at - t0, f"spawn {new.pid}"), (spawned_at - t0, f"connect {new.pid}")
    ]
    assert len(_since(ops, t0)) == 2
    assert h.restarts == 1  # a deferred crash respawn still counts


async def test_recoverys_stop_waits_for_a_held_admission(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    t0 = trio.current_time()
    ops.admission = True
    p.behaviour = Behaviour.REFUSES
    p.cut()
    with trio.move_on_after(60.0):
        await h.mode.wait_value(Mode.STOPPING)
    assert [what for _, what in _since(ops, t0)] == [f"connect {p.pid}"] * 13
    assert mode_of(h) is Mode.RECOVERING
    assert p.signals == []


# --- (f) adoption at supervisor start -----------------------------------------------------------


async def test_adopting_a_live_worker_connects_at_once_without_a_spawn(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = WorkerHandle(ops, "s1", "echo", "/")
    await ops.spawn(h)  # left running by the previous supervisor
    p = ops.processes[0]
    assert ops.events == [(0.0, f"spawn {p.pid}")]
    await _supervise(h, nursery, alive=True)
    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() == 0.0
    assert ops.events == [(0.0, f"spawn {p.pid}"), (0.0, f"connect {p.pid}")]
    assert h.pid == p.pid
    assert ops.processes == [p]
    assert h.restarts == 0
    response = await _prompt(h, "still here", 1)
    assert response.result == _echo(1, "still here")
    assert ops.processes == [p]


async def test_adopting_a_hung_worker_times_out_then_follows_the_reconnect_schedule(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, behaviours=[Behaviour.HUNG, Behaviour.ANSWERS])
    h = WorkerHandle(ops, "s1", "echo", "/")
    await ops.spawn(h)
    p = ops.processes[0]
    await _supervise(h, nursery, alive=True)
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.ADOPTING
    assert ops.events == [(0.0, f"spawn {p.pid}"), (0.0, f"connect {p.pid}")]

    await advance_to(autojump_clock, 1.875)
    assert mode_of(h) is Mode.ADOPTING
    await advance_to(autojump_clock, 2.0)  # the adopt connect timeout
    assert mode_of(h) is Mode.RECOVERING
    assert h.log[-3:] == [
        (2.0, "connect timed out"), (2.0, "mode recovering"), (2.0, "wait 0.25")
    ]
    await advance_to(autojump_clock, 2.125)
    assert len(ops.events) == 2
    await advance_to(autojump_clock, 2.25)
    assert ops.events[2:] == [(2.25, f"connect {p.pid}")]

    await h.mode.wait_value(Mode.READY)
    # each attempt hangs for the 2 s adopt timeout; the delays run from the timeout
    reconnects = [2.25, 5.25, 12.25]
    deferred = [12.25 + 7.0 * k for k in range(1, 11)]
    new = ops.processes[1]
    assert ops.events == [
        (0.0, f"spawn {p.pid}"),
        *[(t, f"connect {p.pid}") for t in [0.0, *reconnects, *deferred]],
        (84.25, f"signal SIGTERM {p.pid}"),
        (84.25, f"spawn {new.pid}"),
        (84.25, f"connect {new.pid}"),
    ]
    assert trio.current_time() == 84.25
    assert h.pid == new.pid
    assert h.restarts == 1


# --- (g) commands across a crash ----------------------------------------------------------------


def _gated_agent(gate: trio.Event, entered: trio.MemorySendChannel[int]) -> type[Agent]:
    """An agent class whose n-th instance (one per fake worker) reports ``n`` when a turn
    starts and answers only once ``gate`` is set."""

    class GatedAgent:
        replayable = True
        made = 0

        def __init__(self) -> None:
            GatedAgent.made += 1
            self.n = GatedAgent.made

        async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
            entered.send_nowait(self.n)
            await gate.wait()
            yield f"worker {self.n} turn {ctx.turn}: {prompt}"

    return GatedAgent


async def test_prompt_in_flight_when_the_worker_dies_is_answered_by_the_respawned_worker(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    gate = trio.Event()
    entered_send, entered = trio.open_memory_channel[int](8)
    ops = FakeWorkerOps(nursery, agent_factory=_gated_agent(gate, entered_send))
    h = await _start(ops, nursery)
    first = ops.processes[0]
    responses: list[Response] = []

    async def prompt() -> None:
        responses.append(await _prompt(h, "hi", 7))

    async with trio.open_nursery() as callers:
        callers.start_soon(prompt)
        assert await entered.receive() == 1  # the first worker runs the turn ...
        autojump_clock.jump(1.5)
        t0 = trio.current_time()
        first.die()  # ... and is killed in the middle of it
        assert await entered.receive() == 2  # the same command, resent to the new worker
        assert trio.current_time() == t0
        assert responses == []
        assert mode_of(h) is Mode.READY
        assert h.pid == ops.processes[1].pid != first.pid
        gate.set()
    assert len(responses) == 1
    assert responses[0].ok
    assert responses[0].result == {"session": "s1", "turn": 1, "reply": "worker 2 turn 1: hi",
                                   "bytes": 19}
    assert trio.current_time() == t0
    assert h.restarts == 1
    assert entered.statistics().current_buffer_used == 0  # no third run


class SlowSpawnOps(FakeWorkerOps):
    """Fake ops whose spawns take ``spawn_delay`` seconds before the worker listens."""

    spawn_delay = 3.0

    async def spawn(self, h: WorkerHandle) -> None:
        await trio.sleep(self.spawn_delay)
        await super().spawn(h)


async def test_prompt_sent_while_the_session_is_starting_waits_then_succeeds(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = SlowSpawnOps(nursery)
    h = await _start(ops, nursery)
    assert trio.current_time() == 3.0
    first = ops.processes[0]
    assert (await _prompt(h, "one", 1)).result == _echo(1, "one")
    t0 = trio.current_time()
    first.die()
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.STARTING
    assert len(ops.processes) == 1  # the new one is not even spawned yet

    response = await _prompt(h, "two", 2)
    assert trio.current_time() - t0 == 3.0
    assert response.ok
    assert response.result == _echo(1, "two")  # turn 1: a fresh worker answered
    assert h.pid == ops.processes[1].pid != first.pid
    assert _since(ops, t0) == [(3.0, f"spawn {h.pid}"), (3.0, f"connect {h.pid}")]


# --- (h) a graceful stop ------------------------------------------------------------------------


async def test_graceful_stop_asks_the_worker_and_sends_no_signal(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    autojump_clock.jump(5.0)
    t0 = trio.current_time()
    h.request_stop(graceful=True)
    await h.mode.wait_value(Mode.STOPPED)
    assert trio.current_time() == t0
    assert p.core.stop_requested.is_set()  # type: ignore[attr-defined]
    assert not p.alive
    assert p.signals == []
    assert _since(ops, t0) == []
    assert [what for t, what in h.log if t == t0] == ["mode stopping", "stopped", "mode stopped"]
    assert h.restarts == 0
    # stopped means stopped: nothing respawns it on its own
    with trio.move_on_after(100.0):
        await h.mode.wait_value(lambda m: m is not Mode.STOPPED)
    assert _since(ops, t0) == []


# --- stop requests that arrive during an action the shell does not interrupt -------------------


async def test_stop_requested_during_recoverys_stop_does_not_respawn(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, timing=STOP_AT_ONCE)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    t0 = trio.current_time()
    p.behaviour = Behaviour.IGNORES_TERM
    p.cut()  # link lost, alive: recovery stops it at once (TERM, 5 s grace, KILL)
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.STOPPING
    await advance_to(autojump_clock, t0 + 1.0)
    h.request_stop(graceful=False)  # `trio-agentd kill` while recovery is stopping it
    await h.mode.wait_value(lambda m: m in (Mode.STOPPED, Mode.FAILED))
    assert _since(ops, t0) == [(0.0, f"signal SIGTERM {p.pid}"), (5.0, f"signal SIGKILL {p.pid}")]
    assert mode_of(h) is Mode.STOPPED
    assert h.restarts == 0


async def test_stop_requested_during_a_spawn_that_never_becomes_ready_is_honoured(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, behaviours=[Behaviour.NEVER_READY])
    h = WorkerHandle(ops, "s1", "echo", "/")
    await _supervise(h, nursery, alive=False, wanted=True)
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.STARTING
    stuck = ops.processes[0]
    await advance_to(autojump_clock, 1.0)
    h.request_stop(graceful=True)
    with trio.move_on_after(100.0):
        await h.mode.wait_value(lambda m: m in (Mode.STOPPED, Mode.FAILED))
    assert ops.events == [(0.0, f"spawn {stuck.pid}"), (30.0, f"signal SIGTERM {stuck.pid}")]
    assert mode_of(h) is Mode.STOPPED
    assert trio.current_time() == 30.0


async def test_a_handles_schedule_notes_stay_bounded_newest_kept(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    from trio_agentd._handle import LOG_KEEP

    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    first = h.log[0]  # its start
    for i in range(10 * LOG_KEEP):  # a long-lived session: link lost, reconnected, ...
        h._note(f"note {i}")
    assert LOG_KEEP <= len(h.log) <= 2 * LOG_KEEP
    assert h.log[-1][1] == f"note {10 * LOG_KEEP - 1}"
    assert first not in h.log


def _task_names(task: trio.lowlevel.Task) -> list[str]:
    names = []
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            names += [child.name.rsplit(".", 1)[-1], *_task_names(child)]
    return names


async def test_a_ready_session_costs_the_supervisor_three_tasks_and_no_nursery_per_wait(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    # each live session waits, for its whole life, on its link's end or a stop: that wait
    # runs in the supervise task itself, as the liveness watch does in its own (a task with a
    # nursery is kilobytes a session, thousands of sessions)
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    await trio.testing.wait_all_tasks_blocked()
    (supervise,) = [t for t in nursery.child_tasks if t.name.endswith("supervise")
                    or "lambda" in t.name]
    assert h.mode.value is Mode.READY
    assert sorted(_task_names(supervise)) == ["run_reader", "watch_liveness"]
