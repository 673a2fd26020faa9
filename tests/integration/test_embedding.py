"""The Trio API: open_supervisor inside a Trio program, open_client against it (real processes)."""

from __future__ import annotations

import os

import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError, SupervisorConfig

from .harness import DaemonEnv


def _config(env: DaemonEnv) -> SupervisorConfig:
    return SupervisorConfig(
        socket=env.socket, home=str(env.home), registry=str(env.registry),
        stop_workers_on_exit=True,
    )


async def test_open_supervisor_and_open_client_prompt_and_stream(denv: DaemonEnv) -> None:
    with trio.fail_after(30):
        async with trio_agentd.open_supervisor(_config(denv)) as sup:
            assert await trio.Path(denv.socket).exists()
            async with trio_agentd.open_client(
                denv.socket, home=str(denv.home), registry=str(denv.registry), autostart=False
            ) as client:
                assert client.hello.generation == sup.generation
                assert await client.prompt("s1", "hello") == "[echo turn 1] hello\n"
                chunks = [c async for c in client.stream_prompt("s1", "streamed")]
                assert chunks == ["[echo turn 2] streamed\n"]
                rows = await client.sessions()
                assert [(r["session"], r["turns"], r["state"]) for r in rows] == [
                    ("s1", 2, "ready")
                ]
                with pytest.raises(AgentdError) as info:
                    await client.request("no_such_op")
                assert info.value.code == "unknown_op"
                with pytest.raises(AgentdError) as info:
                    await client.prompt("s1", "x", agent="other:agent")
                assert info.value.code == "bad_request"
        # the supervisor stopped: socket and record gone, worker stopped
        assert not await trio.Path(denv.socket).exists()
        assert list(denv.registry.glob("*.owner")) == []
    assert denv.our_pids() == []


async def test_open_client_autostarts_a_daemon(denv: DaemonEnv) -> None:
    # the harness env carries the private paths; open_client reads them from os.environ
    with trio.fail_after(60):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry)
        ) as client:
            assert await client.prompt("auto", "hi") == "[echo turn 1] hi\n"
            assert client.hello.pid != os.getpid()
    # the autostarted supervisor, its worker and its worker fork template
    assert len(denv.our_pids()) == 3


async def test_open_client_without_daemon_and_without_autostart_fails_clearly(
    denv: DaemonEnv,
) -> None:
    with pytest.raises(AgentdError) as info:
        async with trio_agentd.open_client(denv.socket, home=str(denv.home), autostart=False):
            pass  # pragma: no cover
    assert info.value.code == "daemon_unavailable"
    assert denv.socket in info.value.message
