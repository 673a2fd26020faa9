"""Cancel: the escalation of signals at exact virtual times, and the worker's ``cancel`` op."""

from __future__ import annotations

import signal
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._protocol import Request, Response
from trio_agentd.agents import ExecAgent, TurnContext, _exec
from trio_agentd.testing import MemoryRegistry, make_worker_core

from .test_worker_refence import SupervisorEnd, connect_owner

GRACE = 5.0


async def request(
    sup: SupervisorEnd, rid: int, op: str, args: dict[str, object], *,
    client_id: str = "client-1",
) -> None:
    await sup.ms.send(Request(id=rid, op=op, client_id=client_id, args=dict(args)))


async def responses(sup: SupervisorEnd, ids: set[int]) -> dict[int, Response]:
    """The responses to ``ids`` (in any order; events and the rest skipped)."""
    got: dict[int, Response] = {}
    while set(got) != ids:
        msg = await sup.receive()
        assert msg is not None, f"connection closed; got {got}"
        if isinstance(msg, Response) and isinstance(msg.id, int) and msg.id in ids:
            got[msg.id] = msg
    return got


async def test_a_cancelled_turn_gets_int_then_term_then_kill_at_exact_times(
    mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the process ignores every signal but the real SIGKILL, so each step waits its whole
    # bound; the virtual clock moves only when the test moves it (a real process's exit is
    # real I/O, which an autojumping clock could skip past)
    sent: list[tuple[float, signal.Signals]] = []
    real = _exec._signal_group

    def record(pgid: int, sig: int) -> None:
        sent.append((trio.current_time(), signal.Signals(sig)))
        if sig == signal.SIGKILL:
            real(pgid, sig)

    monkeypatch.setattr(_exec, "_signal_group", record)
    ctx = TurnContext(session_id="s", turn=1, cwd=tmp_path, session_dir=tmp_path)
    agent = ExecAgent(["/bin/sh", "-c", "echo ready; exec sleep 1000"], kill_grace=GRACE)
    chunks = agent.turn("", ctx)
    assert isinstance(chunks, AsyncGenerator)
    assert await anext(chunks) == b"ready\n"
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(chunks.aclose)  # as the worker closes a cancelled turn
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [(t0, signal.SIGINT)]
        mock_clock.jump(GRACE - 0.001)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [(t0, signal.SIGINT)]  # not a moment early
        mock_clock.jump(0.001)
        await trio.testing.wait_all_tasks_blocked()
        assert sent[1:] == [(t0 + GRACE, signal.SIGTERM)]
        mock_clock.jump(_exec._TERM_GRACE)
    assert sent[2:] == [(t0 + GRACE + _exec._TERM_GRACE, signal.SIGKILL)]


class _Blocking:
    """Runs until cancelled; counts how often it ran and how often it was cut short."""

    replayable = False

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cut = 0

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        yield f"working on {prompt}\n"
        self.started.set()
        try:
            await trio.sleep_forever()
        finally:
            self.cut += 1
        yield "never"  # pragma: no cover


async def test_cancel_by_command_id_ends_the_turn_and_the_session_serves_on(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = _Blocking()
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup = await connect_owner(nursery, core, rec)
    await sup.prompt(1, "long", command_id="c1")
    await agent.started.wait()
    # another client's command of the same id is another command: nothing to cancel
    await request(sup, 2, "cancel", {"command_id": "c1"}, client_id="someone-else")
    await request(sup, 3, "cancel", {"command_id": "c1"})
    answers = await responses(sup, {1, 2, 3})
    assert answers[2].result == {"cancelled": False, "reason": "no such turn is running"}
    assert answers[3].result == {"cancelled": True}
    assert answers[1].ok is False
    assert answers[1].error.code == "command_cancelled"  # type: ignore[union-attr]
    assert agent.cut == 1
    # the session takes the next prompt at once; the same command resent stays cancelled
    await request(sup, 4, "cancel", {})
    assert (await responses(sup, {4}))[4].result == {"cancelled": False,
                                                     "reason": "no such turn is running"}
    await sup.prompt(5, "long", command_id="c1")
    again = (await responses(sup, {5}))[5]
    assert again.error.code == "command_cancelled"  # type: ignore[union-attr]


async def test_cancel_without_an_id_ends_the_running_turn(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = _Blocking()
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup = await connect_owner(nursery, core, rec)
    await sup.prompt(1, "long", command_id="c1")
    await agent.started.wait()
    await request(sup, 2, "cancel", {})
    answers = await responses(sup, {1, 2})
    assert answers[2].result == {"cancelled": True}
    assert answers[1].error.code == "command_cancelled"  # type: ignore[union-attr]
    assert core.status()["busy"] is False
