"""The data plane end to end: open_client prompts workers directly (real processes, kill -9).

The client gets a route (worker socket, pid, grant) from the supervisor once and then talks to
the session's worker itself, so a supervisor killed -9 does not interrupt it; a worker killed
-9, or a route whose supervisor was replaced, sends it back to the supervisor for a new route,
with the same ``(client_id, id)`` so the command runs once.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError
from trio_agentd._client import Client

from .harness import DaemonEnv, wait_for

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")

LINES = 50
STREAMER = (
    f"exec:sh -c 'for i in $(seq 1 {LINES}); do echo line$i; sleep 0.02; done'"
)
REPLAYABLE = "tests.fixture_agents:slow_replayable"

pytestmark = pytest.mark.timeout(120)


async def wait_until(predicate: Callable[[], T], *, within: float, what: str) -> T:
    """The harness's ``wait_for`` (a deadline, never a fixed sleep), off the event loop."""
    return await trio.to_thread.run_sync(
        functools.partial(wait_for, predicate, timeout=within, what=what)
    )


def _client(denv: DaemonEnv) -> Any:
    return trio_agentd.open_client(denv.socket, home=str(denv.home), registry=str(denv.registry))


def _worker_pids(env: DaemonEnv) -> dict[str, int]:
    return {d["session"]: d["pid"] for d in env.descriptors()}


async def _kill9_and_wait(denv: DaemonEnv, pid: int, what: str) -> None:
    os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: pid not in denv.our_pids(), within=10, what=f"{what} to die")


def _spy_route_errors(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record why each exchange on a direct route failed (error code, or 'lost')."""
    seen: list[str] = []
    original = client._exchange_on

    async def spy(conn: Any, rid: int, op: str, args: dict[str, Any], on_event: Any) -> Any:
        try:
            return await original(conn, rid, op, args, on_event)
        except AgentdError as exc:
            if conn.hello is None:
                seen.append(exc.code)
            raise
        except Exception:
            if conn.hello is None:
                seen.append("lost")
            raise

    monkeypatch.setattr(client, "_exchange_on", spy)
    return seen


# --- (a) a supervisor killed -9 does not interrupt a routed client ---------------------------


async def test_prompts_go_direct_and_survive_a_supervisor_kill9_without_rerouting(
    denv: DaemonEnv,
) -> None:
    with trio.fail_after(60):
        async with _client(denv) as client:
            assert await client.prompt("d", "one") == "[echo turn 1] one\n"
            sup = denv.owner()["pid"]
            worker = _worker_pids(denv)["d"]
            assert sorted(denv.our_pids()) == sorted(
                [sup, worker, *denv.fork_templates(), *denv.spare_workers()])

            await _kill9_and_wait(denv, sup, "the supervisor")
            assert await client.prompt("d", "two") == "[echo turn 2] two\n"
            assert await client.prompt("d", "three") == "[echo turn 3] three\n"
            chunks = [c async for c in client.stream_prompt("d", "four")]
            assert chunks == ["[echo turn 4] four\n"]

            assert client.reroutes == 0
            assert client.reconnects == 0
            assert _worker_pids(denv)["d"] == worker
            # nobody started a supervisor for it: only the worker runs (the supervisor's
            # fork template exits once it sees its supervisor gone)
            await wait_until(lambda: denv.our_pids() == [worker], within=10,
                             what="only the worker to run")
            # the dead supervisor's record is still there, unchanged
            assert denv.owner()["pid"] == sup


# --- (b) a stream goes on through a supervisor kill -9 ---------------------------------------


async def test_stream_through_a_supervisor_kill9_mid_stream_every_line_once_in_order(
    denv: DaemonEnv,
) -> None:
    with trio.fail_after(60):
        async with _client(denv) as client:
            pieces: list[str] = []
            killed = False
            async for piece in client.stream_prompt("x", "go", agent=STREAMER):
                pieces.append(piece)
                if not killed and "line5\n" in "".join(pieces):
                    killed = True
                    sup = denv.owner()["pid"]
                    os.kill(sup, signal.SIGKILL)
            assert killed
            text = "".join(pieces)
            assert text == "".join(f"line{i}\n" for i in range(1, LINES + 1))
            assert len(pieces) > 2  # it streamed, not one final chunk
            assert client.reroutes == 0
            await wait_until(lambda: sup not in denv.our_pids(), within=10,
                             what="the supervisor to die")
            await wait_until(lambda: denv.our_pids() == [_worker_pids(denv)["x"]], within=10,
                             what="only the worker to run")


# --- (c) a worker killed -9 mid-turn: re-route, the command runs to completion once -----------


async def test_worker_kill9_mid_turn_reroutes_and_answers_once(
    denv: DaemonEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs.log"
    # the session's environment is the client's (creator_args): the worker imports the
    # fixture agent from the repo and logs its runs here
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("TA_FIXTURE_FILE", str(runs))
    monkeypatch.setenv("TA_FIXTURE_DELAY", "1.5")

    def lines() -> list[str]:
        return runs.read_text().splitlines() if runs.exists() else []

    with trio.fail_after(90):
        async with _client(denv) as client:
            seen = _spy_route_errors(client, monkeypatch)
            assert await client.prompt("r", "warm", agent=REPLAYABLE) == "[slow turn 1] warm\n"
            worker = _worker_pids(denv)["r"]
            answers: list[str] = []

            async def payload() -> None:
                answers.append(await client.prompt("r", "payload", agent=REPLAYABLE))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(payload)
                await wait_until(lambda: "start payload" in lines(), within=20,
                                 what="the turn to start")
                await _kill9_and_wait(denv, worker, "the worker")
            assert answers == ["[slow turn 2] payload\n"]
            assert client.reroutes >= 1
            assert seen[0] in ("lost", "worker_unavailable")
            # interrupted once, replayed by the new worker once, completed once
            assert lines().count("start payload") == 2
            assert lines().count("done payload") == 1
            assert lines().count("done warm") == 1
            assert _worker_pids(denv)["r"] != worker
            # the same session goes on
            assert await client.prompt("r", "after") == "[slow turn 3] after\n"
            assert lines().count("done payload") == 1


# --- (d) after a restart, an old route is refused and the client re-routes -------------------


async def test_restart_old_route_gets_grant_refused_and_reroutes_transparently(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(90):
        async with _client(denv) as client:
            seen = _spy_route_errors(client, monkeypatch)
            assert await client.prompt("g", "one") == "[echo turn 1] one\n"
            assert await client.prompt("g", "two") == "[echo turn 2] two\n"
            old = denv.owner()
            worker = _worker_pids(denv)["g"]
            old_route = dict(client._routes["g"])

            cp = await trio.to_thread.run_sync(functools.partial(denv.run, "restart"))
            assert cp.returncode == 0, cp.stderr
            assert denv.owner()["generation"] != old["generation"]

            assert await client.prompt("g", "three") == "[echo turn 3] three\n"
            assert seen == ["grant_refused"]
            assert client.reroutes == 1
            new_route = client._routes["g"]
            assert new_route["generation"] == denv.owner()["generation"]
            assert new_route["generation"] != old_route["generation"]
            assert new_route["worker_pid"] == worker == _worker_pids(denv)["g"]
            assert await client.prompt("g", "four") == "[echo turn 4] four\n"
            assert client.reroutes == 1


# --- (e) the sessions table counts direct turns ----------------------------------------------


async def test_sessions_table_counts_turns_prompted_directly(denv: DaemonEnv) -> None:
    with trio.fail_after(60):
        async with _client(denv) as client:
            for i in range(1, 4):
                assert await client.prompt("t", f"p{i}") == f"[echo turn {i}] p{i}\n"
            assert await client.prompt("u", "only") == "[echo turn 1] only\n"
            rows = await client.sessions()
            assert [(r["session"], r["turns"], r["state"]) for r in rows] == [
                ("t", 3, "ready"), ("u", 1, "ready"),
            ]
            chunks = [c async for c in client.stream_prompt("t", "p4")]
            assert chunks == ["[echo turn 4] p4\n"]
            rows = await client.sessions()
            assert [(r["session"], r["turns"]) for r in rows] == [("t", 4), ("u", 1)]
            assert client.reroutes == 0
