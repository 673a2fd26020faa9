"""A hung worker is found (liveness) on MockClock: fake processes, exact virtual times.

A fake process that is *frozen* (``FakeProcess.freeze``: SIGSTOP, or an event loop that blocks)
keeps its connections open but reads and answers nothing. With the default timing the
supervisor pings an idle worker after ``link_idle_ping_interval`` (30 s) of silence, and one
with a command outstanding after ``link_ping_interval`` (2 s) of silence counted from the
command's start at the earliest; a ping unanswered for ``link_ping_timeout`` (3 s) closes the
link as unresponsive and the planner recovers the worker as one that cannot be reached:
reconnects after 0.25 s, 1 s, 5 s (each hangs for the 2 s adopt timeout), ten deferred probes
every 5 s, then TERM (pending while stopped), KILL after the 5 s grace, and a respawn.
"""

from __future__ import annotations

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
from trio_agentd.agents import TurnContext
from trio_agentd.testing import FakeWorkerOps
from trio_agentd.testing._fakeops import FakeProcess

pytestmark = pytest.mark.timeout(30)


async def _start(ops: FakeWorkerOps, nursery: trio.Nursery) -> WorkerHandle:
    h = WorkerHandle(ops, "s1", "echo", "/")
    await nursery.start(functools.partial(h.supervise, alive=False, wanted=False))
    await h.wait_ready()  # a first prompt starts it, at virtual time 0
    assert trio.current_time() == 0.0
    return h


def mode_of(h: WorkerHandle) -> Mode:
    mode: Mode = h.mode.value
    return mode


async def advance_to(clock: trio.testing.MockClock, when: float) -> None:
    """Let virtual time run (every deadline on the way, in order) to ``when``; settle there."""
    await trio.sleep_until(when)
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == when


def pings(p: FakeProcess) -> list[float]:
    """When the worker read a ping."""
    return [t for t, op in p.received if op == "ping"]


def _echo(turn: int, text: str) -> dict[str, Any]:
    reply = f"[echo turn {turn}] {text}\n"
    return {"session": "s1", "turn": turn, "reply": reply, "bytes": len(reply.encode())}


class Outcome:
    """A prompt relayed through the handle in the background: its result or error, and when."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.at: float | None = None
        self.response: Response | None = None
        self.error: AgentdError | None = None

    async def run(self, h: WorkerHandle, text: str, command_id: int) -> None:
        try:
            self.response = await h.call(
                "prompt", {"text": text, "command_id": command_id}, client_id="c", on_event=None
            )
        except AgentdError as exc:
            self.error = exc
        self.at = trio.current_time()
        self.done.set()


async def test_a_stopped_worker_is_found_by_a_ping_and_recovered_on_the_unreachable_schedule(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    link = h.link
    assert link is not None

    # an idle link is pinged every 30 s (the worker's answer restarts the count)
    await advance_to(autojump_clock, 61.0)
    assert pings(p) == [30.0, 60.0]

    p.freeze()  # SIGSTOP at t=61: the connection stays open
    prompt = Outcome()
    nursery.start_soon(prompt.run, h, "anyone?", 1)
    await advance_to(autojump_clock, 65.875)
    assert mode_of(h) is Mode.READY
    assert not prompt.done.is_set()

    # with the prompt outstanding the pace is 2 s, counted from its start (not from the pong
    # of t=60): the ping of t=63 is unanswered at t=66, the link closes, the prompt fails
    await prompt.done.wait()
    assert prompt.at == 66.0
    assert prompt.error is not None
    assert prompt.error.code == ErrorCode.WORKER_UNRESPONSIVE
    assert prompt.error.details == {"session": "s1", "pid": p.pid}
    assert link.unresponsive == 63.0
    assert link.closed.is_set()
    await trio.testing.wait_all_tasks_blocked()
    assert mode_of(h) is Mode.RECOVERING
    assert (66.0, "worker unresponsive") in h.log
    assert h.summary()["state"] == "recovering"
    assert ops.events[-1] == (0.0, f"connect {p.pid}")  # nothing tried yet

    # then exactly the schedule of a worker that cannot be reached (LinkLost, alive)
    await h.mode.wait_value(Mode.STARTING)
    await h.mode.wait_value(Mode.READY)
    connects = [t for t, what in ops.events if what == f"connect {p.pid}"]
    assert connects[0] == 0.0  # the first start
    # reconnects 0.25 s, 1 s, 5 s after each failure (each hangs for the 2 s adopt timeout)
    assert connects[1:4] == [66.25, 69.25, 76.25]
    # ten deferred probes, 5 s after each timed-out one
    assert connects[4:] == [76.25 + 7 * k for k in range(1, 11)]
    new = ops.processes[1]
    assert [(t, what) for t, what in ops.events if not what.startswith("connect")][-3:] == [
        (148.25, f"signal SIGTERM {p.pid}"),  # pending: the process is stopped
        (153.25, f"signal SIGKILL {p.pid}"),  # after the stop grace
        (153.25, f"spawn {new.pid}"),
    ]
    assert trio.current_time() == 153.25
    assert p.signals == [signal.SIGTERM, signal.SIGKILL]
    assert not p.alive
    assert h.pid == new.pid
    assert h.restarts == 1
    assert h.unresponsive is None

    # the same command id, resent, is answered by the fresh worker
    again = await h.call("prompt", {"text": "anyone?", "command_id": 1}, client_id="c",
                         on_event=None)
    assert again.result == _echo(1, "anyone?")


async def test_an_idle_stopped_worker_is_found_by_the_idle_ping_without_any_command(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    link = h.link
    assert link is not None
    await advance_to(autojump_clock, 9.0)
    p.freeze()  # idle since t=0, nobody sends it anything
    await advance_to(autojump_clock, 32.875)
    assert mode_of(h) is Mode.READY
    assert pings(p) == []  # frozen: the ping of t=30 is never read

    # the idle ping of t=30 is unanswered at t=33: found, and recovered like the busy case
    await h.mode.wait_value(Mode.RECOVERING)
    assert trio.current_time() == 33.0
    assert link.unresponsive == 30.0
    assert (33.0, "worker unresponsive") in h.log
    assert h.summary()["state"] == "recovering"
    await advance_to(autojump_clock, 40.0)
    assert [t for t, what in ops.events if what == f"connect {p.pid}"] == [0.0, 33.25, 36.25]


async def test_a_prompt_during_the_recovery_fails_unresponsive_after_the_ping_timeout(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    await advance_to(autojump_clock, 9.0)
    p.freeze()
    await h.mode.wait_value(Mode.RECOVERING)
    assert trio.current_time() == 33.0  # the idle ping of t=30, unanswered
    await advance_to(autojump_clock, 34.0)

    prompt = Outcome()
    nursery.start_soon(prompt.run, h, "hello?", 2)
    await prompt.done.wait()
    # it gives the recovery link_ping_timeout to reach the worker again, then fails
    assert prompt.at == 37.0
    assert prompt.error is not None
    assert prompt.error.code == ErrorCode.WORKER_UNRESPONSIVE
    assert mode_of(h) is Mode.RECOVERING
    assert len(ops.processes) == 1


async def test_a_worker_continued_during_the_recovery_is_reconnected_and_answers(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    await advance_to(autojump_clock, 9.0)
    p.freeze()
    prompt = Outcome()
    nursery.start_soon(prompt.run, h, "anyone?", 1)
    await prompt.done.wait()
    # silent since t=0, but the prompt of t=9 gets its own 2 s: pinged at 11, failed at 14
    assert prompt.at == 14.0
    assert prompt.error is not None
    assert prompt.error.code == ErrorCode.WORKER_UNRESPONSIVE
    assert pings(p) == []

    await advance_to(autojump_clock, 15.0)
    p.thaw()  # SIGCONT: the reconnect of 14.25 hangs to its timeout; the next one, 1 s later
    await h.mode.wait_value(Mode.READY)
    assert trio.current_time() == 17.25
    assert [t for t, what in ops.events if what == f"connect {p.pid}"] == [0.0, 14.25, 17.25]
    assert h.pid == p.pid
    assert h.restarts == 0
    # the resend of the same command id gets one answer; the turn ran once
    again = await h.call("prompt", {"text": "anyone?", "command_id": 1}, client_id="c",
                         on_event=None)
    assert again.result == _echo(1, "anyone?")
    core = p.core  # type: ignore[attr-defined]
    assert core.turns_run == 1


class SilentAgent:
    """A turn that works for a minute without a byte of output (its worker stays responsive)."""

    replayable = True

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        await trio.sleep(60.0)
        yield f"done: {prompt}"


async def test_a_silent_long_turn_is_pinged_but_not_failed(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery, agent_factory=SilentAgent)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    prompt = Outcome()
    nursery.start_soon(prompt.run, h, "think", 1)
    await prompt.done.wait()
    assert prompt.error is None
    assert prompt.at == 60.0
    assert prompt.response is not None
    assert prompt.response.result is not None
    assert prompt.response.result["reply"] == "done: think"
    # pinged every 2 s of silence all through the turn, and every ping answered
    assert [t for t in pings(p) if t < 60.0] == [2.0 * k for k in range(1, 30)]
    assert mode_of(h) is Mode.READY
    # idle again once the answer arrived: back to one ping per 30 s of silence (a ping due at
    # t=60 itself may or may not go out beside the answer: the same instant)
    await advance_to(autojump_clock, 125.0)
    assert [t for t in pings(p) if t > 60.0] == [90.0, 120.0]
    assert mode_of(h) is Mode.READY
    assert [what for _t, what in h.log if "unresponsive" in what or "lost" in what] == []
    assert [what for _t, what in ops.events] == [f"spawn {p.pid}", f"connect {p.pid}"]


async def test_a_route_to_an_idle_stopped_worker_finds_it_within_interval_plus_timeout(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ops = FakeWorkerOps(nursery)
    h = await _start(ops, nursery)
    p = ops.processes[0]
    await advance_to(autojump_clock, 9.0)
    p.freeze()
    await advance_to(autojump_clock, 10.0)
    h.touch()  # the supervisor grants a client a route (or relays a prompt)
    await h.mode.wait_value(Mode.RECOVERING)
    # pinged 2 s after the route (it said nothing), unanswered 3 s later: not at the idle 33 s
    assert trio.current_time() == 15.0
    assert (15.0, "worker unresponsive") in h.log
