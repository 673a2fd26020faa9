"""Forgetting a session (``rm``, ``kill``) deletes its descriptor and token for good: when
``forget`` returns, a group commit that was writing the descriptor at that moment has ended and
unlinked it again, so a supervisor killed right after ``rm`` answered cannot find the session
and bring it back."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from trio_agentd import _groupwrite
from trio_agentd._groupwrite import GroupWriter
from trio_agentd._paths import Layout
from trio_agentd._procops import ProcessWorkerOps
from trio_agentd._registry import Ownership, Registry
from trio_agentd.timing import DEFAULT_TIMING


async def test_forget_returns_once_a_descriptor_being_committed_is_gone(tmp_path: Path) -> None:
    layout = Layout(home=tmp_path / "home", socket="/tmp/x/d.sock", registry=tmp_path / "reg")
    layout.workers_dir.mkdir(parents=True)
    own = Ownership(Registry(layout.registry), layout, generation="g", app_version="t",
                    protocol=1)
    ops = ProcessWorkerOps(layout, own, DEFAULT_TIMING)
    in_commit = trio.Event()
    release = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def blocking(batch: list[tuple[str, str]]) -> dict[str, OSError]:
        trio.from_thread.run_sync(in_commit.set, trio_token=token)
        trio.from_thread.run(release.wait, trio_token=token)
        return _groupwrite.commit(batch)

    ops.writer = GroupWriter(commit_batch=blocking)
    descriptor = layout.descriptor_path("b")
    ops.writer.stage(descriptor, b"{}")
    forgotten: list[bool] = []

    async def forget() -> None:
        await ops.forget("b")
        forgotten.append(descriptor.exists())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.writer.durable)
        await in_commit.wait()
        nursery.start_soon(forget)
        await trio.testing.wait_all_tasks_blocked()
        assert forgotten == []  # the commit that holds the descriptor still runs
        release.set()
    assert forgotten == [False]
    assert not descriptor.exists()
