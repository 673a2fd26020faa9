"""Forgetting a session (``rm``, ``kill``) deletes its descriptor and token for good: when
``forget`` returns, a group commit that was writing the descriptor at that moment has ended and
unlinked it again, so a supervisor killed right after ``rm`` answered cannot find the session
and bring it back."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from trio_agentd._groupwrite import GroupWriter
from trio_agentd._paths import Layout
from trio_agentd._procops import ProcessWorkerOps
from trio_agentd._registry import Ownership, Registry
from trio_agentd.timing import DEFAULT_TIMING

from ..held_commit import HeldCommit


async def test_forget_returns_once_a_descriptor_being_committed_is_gone(tmp_path: Path) -> None:
    layout = Layout(home=tmp_path / "home", socket="/tmp/x/d.sock", registry=tmp_path / "reg")
    layout.workers_dir.mkdir(parents=True)
    own = Ownership(Registry(layout.registry), layout, generation="g", app_version="t",
                    protocol=1)
    ops = ProcessWorkerOps(layout, own, DEFAULT_TIMING)
    held = HeldCommit()
    ops.writer = GroupWriter(commit_batch=held)
    descriptor = layout.descriptor_path("b")
    ops.writer.stage(descriptor, b"{}")
    forgotten: list[bool] = []

    async def forget() -> None:
        await ops.forget("b")
        forgotten.append(descriptor.exists())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.writer.durable)
        await held.started.wait()
        nursery.start_soon(forget)
        await trio.testing.wait_all_tasks_blocked()
        assert forgotten == []  # the commit that holds the descriptor still runs
        held.release.set()
    assert forgotten == [False]
    assert not descriptor.exists()
