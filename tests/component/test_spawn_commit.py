"""A worker's start makes its files durable in one commit (trio_agentd._procops): the token,
the session's metadata and the descriptor are staged together, after the fork, so the start
waits for one flush, never for a commit of the token that began while the fork ran."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._paths import Layout
from trio_agentd._procops import ProcessWorkerOps
from trio_agentd._registry import Ownership, Registry
from trio_agentd.timing import DEFAULT_TIMING


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
