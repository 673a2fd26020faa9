"""One session handle on fake worker processes: the recovery schedule on MockClock."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import trio

from .._handle import WorkerHandle
from ._fakeops import Behaviour, FakeWorkerOps

if TYPE_CHECKING:
    from .._protocol import Response
    from ..agents import Agent
    from ..timing import Timing


@dataclasses.dataclass
class FakeSession:
    """A :class:`WorkerHandle` supervised in a nursery, its worker processes fake.

    Made by :func:`open_fake_session` (or the ``agentd_fake_session`` fixture). Its worker is
    not spawned yet: the first :meth:`prompt` (or ``handle.call`` / ``handle.wait_ready``)
    spawns it.

    Attributes:
        handle: the session as the supervisor sees it: ``handle.mode`` (a
            ``WatchedValue`` of :class:`Mode`, as ``trio_util.AsyncValue``:
            ``await handle.mode.wait_value(Mode.READY)``), ``handle.pid``,
            ``handle.restarts``, ``handle.log``.
        ops: its fake processes: ``ops.processes[i]`` is the i-th spawn (``.die()`` is
            ``kill -9``), ``ops.events`` the log of ``(virtual time, "spawn PID" | ...)``.
        nursery: where the handle and the fake processes run.
    """

    handle: WorkerHandle
    ops: FakeWorkerOps
    nursery: trio.Nursery
    _command_ids: itertools.count[int] = dataclasses.field(
        default_factory=lambda: itertools.count(1), init=False, repr=False
    )

    async def prompt(self, text: str, *, client_id: str = "test") -> Response:
        """Send a prompt as the supervisor would (a new ``command_id`` each time): the
        worker's response: ``.ok``, and ``.result["reply"]`` or ``.error``.

        Waits until the session is ready, spawning its worker if none runs.

        Raises:
            AgentdError: ``worker_unavailable`` if the session failed or was not ready within
                ``Timing.worker_connect_timeout``.
        """
        args: dict[str, Any] = {"text": text, "command_id": next(self._command_ids)}
        return await self.handle.call("prompt", args, client_id=client_id, on_event=None)


@contextlib.asynccontextmanager
async def open_fake_session(
    session_id: str = "s1",
    *,
    agent: str = "echo",
    cwd: str = "/",
    behaviours: list[Behaviour] | None = None,
    timing: Timing | None = None,
    agent_factory: Callable[[], Agent] | None = None,
) -> AsyncIterator[FakeSession]:
    """Supervise one new session on :class:`FakeWorkerOps` in a nursery of its own.

    Nothing is spawned on entry (``handle.supervise_new``): the first command starts the
    worker, as the supervisor's first prompt to a session does. On exit the nursery is
    cancelled (the fake processes with it).

    Args:
        behaviours: each successive spawn's :class:`Behaviour`; the last one repeats
            (default: every worker answers).
        timing: the handle's schedule (default :data:`~trio_agentd.timing.DEFAULT_TIMING`).
        agent_factory: a new agent for each fake worker (default: the echo agent, whose
            reply to ``hi`` on turn 1 is ``"[echo turn 1] hi\\n"``).
    """
    from ..timing import DEFAULT_TIMING

    async with trio.open_nursery() as nursery:
        ops = FakeWorkerOps(nursery, behaviours=behaviours, timing=timing or DEFAULT_TIMING,
                            agent_factory=agent_factory)
        handle = WorkerHandle(ops, session_id, agent, cwd)
        await nursery.start(handle.supervise_new)
        yield FakeSession(handle, ops, nursery)
        nursery.cancel_scope.cancel()
