"""Fixtures and helpers the component tests share: a nursery, a short socket dir, a check that
the worker logged no error, and a whole supervisor on fake workers with in-memory clients."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._protocol import Response
from trio_agentd._sdnotify import Notifier
from trio_agentd._supervisor import Supervisor, SupervisorConfig
from trio_agentd.agents import Agent
from trio_agentd.testing import FakeWorkerOps, MemoryClient, MemoryListener
from trio_agentd.timing import DEFAULT_TIMING, Timing


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for the test's own tasks, cancelled when the test is done."""
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short private dir for socket paths (sun_path is 108 bytes; pytest's tmp_path may be
    longer), removed whatever the test did."""
    path = Path(tempfile.mkdtemp(prefix="ta-c-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def no_worker_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The worker logs unexpected exceptions of a connection instead of raising them: fail a
    test that made the worker log an error (``pytest.mark.usefixtures("no_worker_errors")``)."""
    yield
    # (in teardown ``caplog.records`` holds the teardown's records only: ask for the test's)
    records = [*caplog.get_records("setup"), *caplog.get_records("call")]
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert errors == []


@dataclasses.dataclass
class World:
    """A supervisor under test, its fake machine and its in-memory listener."""

    sup: Supervisor
    machine: FakeWorkerOps
    listener: MemoryListener
    nursery: trio.Nursery

    @property
    def timing(self) -> Timing:
        return self.sup.timing

    @property
    def record(self) -> Path:
        return self.sup.ownership.registry.owner_json(self.sup.generation)

    def descriptor(self, session: str = "s1") -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.sup.layout.descriptor_path(session).read_bytes())
        return data

    async def client(self, client_id: str = "test") -> MemoryClient:
        return await MemoryClient.connect(self.listener, client_id=client_id)

    async def prompt(self, text: str, *, session: str = "s1", client_id: str = "test",
                     request_id: int | None = None) -> Response:
        c = await self.client(client_id)
        try:
            return await c.request("prompt", {"session": session, "text": text},
                                   request_id=request_id)
        finally:
            await c.aclose()


# No test here runs longer than this in virtual time. A supervisor in the test process takes
# SIGALRM for itself (it logs and ignores it), so pytest-timeout's alarm cannot end a test
# that waits for ever: this limit does, in virtual time (a second or so of real time).
VIRTUAL_LIMIT = 1000.0


async def _virtual_time_limit() -> None:
    await trio.sleep(VIRTUAL_LIMIT)
    raise AssertionError(f"the test still runs at virtual time {VIRTUAL_LIMIT:g}s")


@contextlib.asynccontextmanager
async def supervisor_world(
    tmp_path: Path,
    run_dir: Path,
    *,
    timing: Timing = DEFAULT_TIMING,
    agent_factory: Callable[[], Agent] | None = None,
    self_heal: bool = True,
    inotify: bool = True,
    notifier: Notifier | None = None,
) -> AsyncIterator[World]:
    """A supervisor on a fake machine, served in its own nursery, at virtual time 0; shut down
    (its workers left running) when the body is done."""
    config = SupervisorConfig(
        socket=str(run_dir / "s.sock"), home=str(tmp_path / "home"),
        registry=str(tmp_path / "registry"), self_heal=self_heal, timing=timing,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_virtual_time_limit)  # the body runs in this nursery's scope
        machine = FakeWorkerOps(nursery, timing=timing, agent_factory=agent_factory,
                                registry_dir=config.layout().registry, inotify=inotify)
        listener = MemoryListener()
        sup = Supervisor(config, worker_ops=machine.for_supervisor, listener=listener,
                         notifier=notifier)
        await nursery.start(sup.serve)
        assert trio.current_time() == 0.0
        yield World(sup, machine, listener, nursery)
        if not sup.stopped.is_set():
            sup.request_shutdown(stop_workers=False)
            await sup.stopped.wait()
        nursery.cancel_scope.cancel()


async def advance_to(when: float) -> None:
    """Let virtual time run (every deadline on the way, in order) to ``when``; settle there."""
    await trio.sleep_until(when)
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == when
