"""A worker's start makes its files durable in one commit (trio_agentd._procops): the token,
the session's metadata and the descriptor are staged together, after the fork, so the start
waits for one flush, never for a commit of the token that began while the fork ran."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._paths import Layout
from trio_agentd._procops import ProcessWorkerOps
from trio_agentd._recovery import StopReason
from trio_agentd._registry import Ownership, Registry
from trio_agentd.timing import DEFAULT_TIMING

from .conftest import World, supervisor_world


class _ForkedOps(ProcessWorkerOps):
    """The fork answers with a real process (for its identity) and pipes to a stand-in for
    the worker's start-gate protocol; the fork takes a while, as a real one does: every other
    task (the writer's) runs meanwhile."""

    def __init__(self, layout: Layout, ownership: Ownership, proc: subprocess.Popen[bytes]
                 ) -> None:
        super().__init__(layout, ownership, DEFAULT_TIMING)
        self.proc = proc
        self.gate: list[bytes] = []

    async def _fork(self, env: dict[str, str], log_fd: int
                    ) -> tuple[int, trio.lowlevel.FdStream, trio.lowlevel.FdStream] | None:
        await trio.testing.wait_all_tasks_blocked()
        stdin_ours, stdin_worker = trio.testing.memory_stream_pair()
        stdout_worker, stdout_ours = trio.testing.memory_stream_pair()
        assert self.nursery is not None
        self.nursery.start_soon(self._worker, stdin_worker, stdout_worker)
        return self.proc.pid, stdin_ours, stdout_ours  # type: ignore[return-value]

    async def _worker(self, stdin: trio.abc.Stream, stdout: trio.abc.Stream) -> None:
        buf = b""
        while buf.count(b"\n") < 2:
            chunk = await stdin.receive_some()
            if not chunk:
                return
            buf += chunk
        self.gate = buf.splitlines()[1:2]
        await stdout.send_all(b"ready\n")
        await stdout.aclose()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process, for the worker's identity (start id); killed by its pid after."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


async def test_a_start_waits_for_one_commit_of_all_its_files(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    layout = Layout(home=tmp_path / "home", socket=str(tmp_path / "s" / "d.sock"),
                    registry=tmp_path / "reg")
    layout.workers_dir.mkdir(parents=True, mode=0o700)
    own = Ownership(Registry(layout.registry), layout, generation="g", app_version="t",
                    protocol=1)
    ops = _ForkedOps(layout, own, sleeper)
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        nursery.start_soon(ops.writer.run)
        await trio.testing.wait_all_tasks_blocked()
        h = WorkerHandle(ops, "s1", "echo", str(tmp_path))
        await ops.spawn(h)
        assert ops.gate == [b"go"]
        assert ops.writer.commits == 1
        for path in (layout.token_path("s1"), layout.descriptor_path("s1"),
                     layout.session_dir("s1") / "session.json"):
            assert path.is_file(), path
        nursery.cancel_scope.cancel()



def _written_descriptors(w: World, session: str = "s1") -> list[tuple[str, int]]:
    """(lifecycle, pid) of each descriptor of ``session`` the supervisor writes (stages for
    its next commit) from now on, in order."""
    written: list[tuple[str, int]] = []
    writer = w.sup.ops.writer
    real_stage = writer.stage
    target = str(w.sup.layout.descriptor_path(session))

    def stage(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> int:
        if os.fspath(path) == target:
            desc = json.loads(data)
            written.append((desc["lifecycle"], desc["pid"]))
        return real_stage(path, data, mode=mode)

    writer.stage = stage  # type: ignore[method-assign]
    return written


async def test_a_crash_respawn_commits_one_starting_descriptor_the_new_workers(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    # the descriptor already says the session's worker is wanted: the respawn's own write
    # (starting, the new pid) is the only one before the new worker's gate, so the gate
    # waits for one commit, never first for a commit of one that names the dead worker
    async with supervisor_world(tmp_path, run_dir) as w:
        assert (await w.prompt("one")).ok
        first = w.machine.processes[0]
        assert w.descriptor()["lifecycle"] == "ready"
        written = _written_descriptors(w)
        first.die()
        assert (await w.prompt("two")).ok
        second = w.machine.processes[1]
        assert written == [("starting", second.pid), ("ready", second.pid)]
        assert w.sup.table.known("s1").restarts == 1
        assert w.descriptor()["restarts"] == 1


async def test_a_start_after_an_eviction_writes_starting_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    # a descriptor that says stopped is not left so while a worker starts: ``starting`` is
    # written as the start begins (with the pid it recorded), as before
    async with supervisor_world(tmp_path, run_dir) as w:
        assert (await w.prompt("one")).ok
        h = w.sup.table.known("s1")
        await h.request_stop(reason=StopReason.EVICT).wait()
        await w.sup.ops.durable()
        assert w.descriptor()["lifecycle"] == "stopped"
        written = _written_descriptors(w)
        assert (await w.prompt("two")).ok
        old, new = w.machine.processes[0].pid, w.machine.processes[1].pid
        assert written == [("starting", old), ("starting", new), ("ready", new)]
