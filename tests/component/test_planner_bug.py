"""A recovery-planner bug (an observation the table has no cell for) fails that session alone:
logged once with its traceback, the session ``failed`` with an internal-error cause, the
daemon (here: the nursery of every supervise task) serving on, and ``retry`` clears it."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._recovery import Action, Mode, Observation, Serve, TimerFired
from trio_agentd.testing import FakeWorkerOps


async def _ready(ops: FakeWorkerOps, nursery: trio.Nursery, sid: str) -> WorkerHandle:
    h = WorkerHandle(ops, sid, "echo", "/")
    await nursery.start(lambda task_status: h.supervise(alive=False, wanted=False,
                                                         task_status=task_status))
    await h.wait_ready()
    return h


async def test_an_illegal_observation_fails_only_its_session_and_retry_clears_it(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.fail_after(60):  # virtual seconds: a deadline, never a hang
        ops = FakeWorkerOps(nursery)
        bad = await _ready(ops, nursery, "bad")
        good = await _ready(ops, nursery, "good")
        first_pid = bad.pid
        injected: list[Observation] = []
        real = WorkerHandle._perform

        async def perform(self: WorkerHandle, action: Action) -> Observation:
            if self is bad and isinstance(action, Serve) and not injected:
                injected.append(TimerFired())  # a timer while ready: no action yields that
                return injected[0]
            return await real(self, action)

        monkeypatch.setattr(WorkerHandle, "_perform", perform)
        caplog.set_level(logging.ERROR, logger="trio_agentd.supervisor")
        # the patched _perform applies from the next action: make the bad session serve anew
        assert ops.processes[0].pid == first_pid
        ops.processes[0].cut()
        await bad.mode.wait_value(Mode.FAILED)
        assert injected
        assert bad.cause.startswith("internal error: recovery planner: TimerFired is illegal in"
                                    " mode 'ready'")
        assert "trio-agentd retry bad" in bad.cause
        bugs = [r for r in caplog.records if "internal error" in r.getMessage()]
        assert len(bugs) == 1
        assert bugs[0].exc_info is not None
        # everything else is served
        response = await good.call("prompt", {"text": "hi", "command_id": 1}, client_id="c",
                                   on_event=None)
        assert response.ok
        # retry: the worker that may still run is stopped first, then a fresh one serves
        old = bad.pid
        bad.retry()
        await bad.wait_retried()
        await bad.mode.wait_value(Mode.READY)
        assert bad.cause == ""
        assert bad.pid != old
        assert not any(p.pid == old and p.alive for p in ops.processes)
        response = await bad.call("prompt", {"text": "again", "command_id": 1}, client_id="c",
                                  on_event=None)
        assert response.ok
