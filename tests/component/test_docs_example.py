"""The example of docs/testing.md, kept as a test so the documentation cannot rot."""

from __future__ import annotations

import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._recovery import Mode
from trio_agentd.testing import FakeWorkerOps


# --- docs/testing.md example begins ---
async def test_a_crashed_worker_is_respawned_under_the_same_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        ops = FakeWorkerOps(nursery)  # fake processes, in-memory worker connections
        session = WorkerHandle(ops, "s1", "echo", "/")
        await nursery.start(session.supervise_new)
        first = await session.call("prompt", {"text": "hi", "command_id": 1},
                                   client_id="me", on_event=None)
        assert first.result["reply"] == "[echo turn 1] hi\n"

        ops.processes[0].die()  # kill -9
        await session.mode.wait_value(Mode.STARTING)
        await session.mode.wait_value(Mode.READY)
        assert session.pid == ops.processes[1].pid  # respawned at once...
        assert trio.current_time() == 0.0  # ...at exactly the same virtual instant
        assert session.restarts == 1
        nursery.cancel_scope.cancel()
# --- docs/testing.md example ends ---
