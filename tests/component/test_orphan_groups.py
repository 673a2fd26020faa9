"""A turn's process group is reported before it runs the agent's work, and a group is stopped
only while its leader is the recorded incarnation (real processes, no daemon)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._identity import GroupIdentity, read_start_id
from trio_agentd.agents import ShellAgent, TurnContext
from trio_agentd.agents._exec import run_command, stop_orphan_group


def _ctx(tmp_path: Path, on_group: object = None) -> TurnContext:
    return TurnContext(session_id="s", turn=1, cwd=tmp_path, session_dir=tmp_path,
                       on_group=on_group)  # type: ignore[arg-type]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :][:1].decode()


async def test_the_group_is_reported_before_the_agent_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    seen: list[tuple[GroupIdentity, bool]] = []

    def on_group(g: GroupIdentity) -> None:
        seen.append((g, marker.exists()))

    agent = ShellAgent()
    try:
        chunks = [c async for c in agent.turn(f"touch {marker}; echo $$", _ctx(tmp_path,
                                                                               on_group))]
    finally:
        await agent.aclose()
    [(group, ran_before)] = seen
    assert not ran_before
    assert marker.exists()
    assert int(b"".join(c for c in chunks if isinstance(c, bytes))) == group.pid
    assert group.pgid == group.pid
    assert group.start_id is not None


async def test_a_hook_that_raises_refuses_the_turn_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    def on_group(g: GroupIdentity) -> None:
        raise AgentdError(ErrorCode.STORAGE_ERROR, "cannot journal it")

    with pytest.raises(AgentdError) as info:
        async for _ in run_command(["/bin/sh", "-c", f"touch {marker}"], _ctx(tmp_path, on_group),
                                   stdin=b"prompt", merge_stderr=True):
            pass
    assert info.value.code == ErrorCode.STORAGE_ERROR
    assert not marker.exists()


@pytest.fixture
def group() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["/bin/sh", "-c", "sleep 1000 & wait"], start_new_session=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


async def test_a_group_whose_leader_is_another_incarnation_is_left_alone(
    group: subprocess.Popen[bytes],
) -> None:
    real = read_start_id(group.pid)
    assert real is not None
    wrong = GroupIdentity(group.pid, group.pid, real.rsplit(":", 1)[0] + ":1")
    assert await stop_orphan_group(wrong) == "gone"
    assert group.poll() is None


async def test_a_recorded_live_group_is_stopped(group: subprocess.Popen[bytes]) -> None:
    g = GroupIdentity(group.pid, group.pid, read_start_id(group.pid))
    assert await stop_orphan_group(g) == "stopped"
    assert group.wait(timeout=10) == -signal.SIGTERM
