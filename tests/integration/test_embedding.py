"""Embedding with real processes: open_supervisor inside a Trio program, and open_client inside
asyncio and Trio programs alike (the client tests run once per backend: ``anyio_backend``)."""

from __future__ import annotations

import os
import signal
from contextlib import AbstractAsyncContextManager

import anyio
import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError, Client, SupervisorConfig

from ..anyio_support import assert_on
from .harness import DaemonEnv


def _config(env: DaemonEnv) -> SupervisorConfig:
    return SupervisorConfig(
        socket=env.socket, home=str(env.home), registry=str(env.registry),
        stop_workers_on_exit=True,
    )


async def test_open_supervisor_and_open_client_prompt_and_stream(denv: DaemonEnv) -> None:
    # the supervisor is a Trio program: embedded, it runs on Trio only
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


def _open(env: DaemonEnv, *, autostart: bool = True) -> AbstractAsyncContextManager[Client]:
    return trio_agentd.open_client(env.socket, home=str(env.home), registry=str(env.registry),
                                   autostart=autostart)


@pytest.mark.anyio
async def test_open_client_autostarts_a_daemon(denv: DaemonEnv, anyio_backend: str) -> None:
    assert_on(anyio_backend)
    # the harness env carries the private paths; open_client reads them from os.environ
    with anyio.fail_after(60):
        async with _open(denv) as client:
            assert await client.prompt("auto", "hi") == "[echo turn 1] hi\n"
            assert client.hello.pid != os.getpid()
    # the autostarted supervisor, its worker and its worker fork template (and its spares)
    assert len(set(denv.our_pids()) - set(denv.spare_workers())) == 3


@pytest.mark.anyio
async def test_open_client_without_daemon_and_without_autostart_fails_clearly(
    denv: DaemonEnv, anyio_backend: str
) -> None:
    assert_on(anyio_backend)
    with pytest.raises(AgentdError) as info:
        async with trio_agentd.open_client(denv.socket, home=str(denv.home), autostart=False):
            pass  # pragma: no cover
    assert info.value.code == "daemon_unavailable"
    assert denv.socket in info.value.message


@pytest.mark.anyio
async def test_the_async_api_on_each_backend(denv: DaemonEnv, anyio_backend: str) -> None:
    assert_on(anyio_backend)
    with anyio.fail_after(60):
        async with _open(denv) as client:
            assert await client.prompt("e", "hello") == "[echo turn 1] hello\n"
            assert [c async for c in client.stream_prompt("e", "more")] == [
                "[echo turn 2] more\n"]
            # every byte value, raw, through the direct route to the worker
            every = bytes(range(256))
            printf = "printf '" + "".join(f"\\{b:03o}" for b in every) + "'"
            assert await client.prompt_bytes("b", printf, agent="shell") == every
            assert b"".join([c async for c in client.stream_prompt_bytes("b", printf)]) == every
            turn = await client.prompt_turn("b", "echo out; echo err >&2; exit 3")
            assert (turn.stdout, turn.stderr, turn.exit_status) == (b"out\n", b"err\n", 3)
            rows = {r["session"]: r for r in await client.sessions()}
            assert (rows["e"]["turns"], rows["b"]["turns"]) == (2, 3)
            assert (await client.status())["pid"] == client.hello.pid
            killed = await client.request("kill_session", {"session": "b"})
            assert killed["killed"] is True
            assert [r["session"] for r in await client.sessions()] == ["e"]
            with pytest.raises(AgentdError) as info:
                await client.request("no_such_op")
            assert info.value.code == "unknown_op"
            assert (client.reroutes, client.reconnects) == (0, 0)


@pytest.mark.anyio
async def test_cancel_on_each_backend_fails_the_prompt_with_command_cancelled(
    denv: DaemonEnv, anyio_backend: str
) -> None:
    assert_on(anyio_backend)
    with anyio.fail_after(60):
        async with _open(denv) as client:
            seen: list[str] = []
            cancelled: list[bool] = []

            async def read_and_cancel() -> None:
                async for chunk in client.stream_prompt("t", "echo started; sleep 1000",
                                                        agent="shell"):
                    seen.append(chunk)
                    cancelled.append(await client.cancel("t"))  # once the turn ended

            with pytest.raises(AgentdError) as info:
                await read_and_cancel()
            assert info.value.code == "command_cancelled"
            assert (seen, cancelled) == (["started\n"], [True])
            assert await client.cancel("t") is False
            assert await client.prompt("t", "echo next") == "next\n"


@pytest.mark.anyio
async def test_a_cancel_scope_stops_waiting_and_the_turn_goes_on(
    denv: DaemonEnv, anyio_backend: str
) -> None:
    """Cancelling the caller (a deadline, a request handler going away) stops waiting for the
    prompt; the turn goes on in its worker, and the client serves on."""
    assert_on(anyio_backend)
    with anyio.fail_after(60):
        async with _open(denv) as client:
            with anyio.CancelScope() as scope:
                async for _chunk in client.stream_prompt(
                    "c", "echo started; sleep 1000", agent="shell"
                ):
                    scope.cancel()
            assert scope.cancelled_caught
            assert await client.prompt("other", "still here") == "[echo turn 1] still here\n"
            rows = {r["session"]: r for r in await client.sessions()}
            assert rows["c"]["busy"] is True  # its turn still runs
            assert await client.cancel("c") is True


@pytest.mark.anyio
async def test_the_callers_own_error_comes_out_bare(denv: DaemonEnv, anyio_backend: str) -> None:
    assert_on(anyio_backend)

    class Mine(Exception):
        pass

    async def body() -> None:
        async with _open(denv) as client:
            await client.prompt("m", "x")
            raise Mine

    with anyio.fail_after(60), pytest.raises(Mine):  # not an ExceptionGroup
        await body()


@pytest.mark.anyio
async def test_a_killed_supervisor_is_replaced_and_the_request_resent(
    denv: DaemonEnv, anyio_backend: str
) -> None:
    assert_on(anyio_backend)
    with anyio.fail_after(90):
        async with _open(denv) as client:
            assert await client.prompt("k", "one") == "[echo turn 1] one\n"
            first = client.hello.pid
            os.kill(first, signal.SIGKILL)  # the supervisor this test autostarted
            rows = await client.sessions()  # reconnects, autostarting a new supervisor
            assert client.reconnects == 1
            assert client.hello.pid != first
            assert [r["session"] for r in rows] == ["k"]  # the worker was adopted
            assert await client.prompt("k", "two") == "[echo turn 2] two\n"
