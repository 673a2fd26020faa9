"""End to end: running out of descriptors is an error for one request, never the end of the
daemon. A real supervisor under a low RLIMIT_NOFILE, idle clients beyond it, sessions beyond
it, the real CLI."""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError, SupervisorConfig

from .harness import DaemonEnv, wait_for

HARD = 64


def _nofile_64() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (HARD, HARD))


def _start_daemon(denv: DaemonEnv, preexec: Callable[[], None]) -> subprocess.Popen[str]:
    daemon = subprocess.Popen(
        denv.argv("daemon"), env=denv.env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, preexec_fn=preexec,
    )
    denv.procs.append(daemon)
    wait_for(lambda: denv.hello() is not None, timeout=30, what="the daemon to listen")
    return daemon


def _first_line(s: socket.socket) -> dict[str, object] | None:
    data = b""
    while b"\n" not in data:
        try:
            chunk = s.recv(65536)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return dict(json.loads(data.split(b"\n", 1)[0]))


def _connect(path: str) -> tuple[socket.socket, dict[str, object] | None]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s, _first_line(s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1][1:2] not in (b"Z", b"X")


def test_idle_clients_beyond_the_descriptor_limit_get_one_error_line_and_the_daemon_lives(
    denv: DaemonEnv,
) -> None:
    daemon = _start_daemon(denv, _nofile_64)
    assert denv.prompt("warm", session="a") == "[echo turn 1] warm"
    idle: list[socket.socket] = []
    refused: dict[str, object] | None = None
    try:
        for _ in range(3 * HARD):
            s, first = _connect(denv.socket)
            if first is not None and first.get("type") == "hello":
                idle.append(s)
                continue
            s.close()
            refused = first
            break
        assert refused is not None, f"{len(idle)} idle clients never exhausted the daemon"
        assert len(idle) < HARD
        error = refused["error"]
        assert isinstance(error, dict)
        assert error["code"] == "resource_exhausted", refused
        assert "too many open files (RLIMIT_NOFILE 64)" in str(error["message"])

        # a prompt while the daemon is out of descriptors: one clear line, exit non-zero (to
        # a session with no cached route: one with a route goes straight to its worker)
        cp = denv.run("-p", "-s", "c", "during")
        assert cp.returncode != 0
        assert "too many open files (RLIMIT_NOFILE 64)" in cp.stderr, cp.stderr
        assert "Traceback" not in cp.stderr
        assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr

        # several self-checks (every 250 ms) find the owner record unreadable meanwhile
        wait_for(lambda: "cannot read the owner record" in denv.log_text(), timeout=10,
                 what="a self-check to meet EMFILE")
        assert _alive(daemon.pid)
        assert Path(denv.socket).exists()
    finally:
        for s in idle:
            s.close()
    # the idle clients are gone: the daemon serves again, old session and new
    wait_for(lambda: (denv.hello() or {}).get("type") == "hello", timeout=10,
             what="a hello after the idle clients closed")
    assert denv.prompt("after", session="a") == "[echo turn 2] after"
    assert denv.prompt("new", session="b") == "[echo turn 1] new"
    assert _alive(daemon.pid)
    assert daemon.poll() is None
    log = denv.log_text()
    assert "Traceback" not in log, log
    assert "RLIMIT_NOFILE" in log  # the limits it started with are in its log
    assert "ownership_lost" not in log
    assert "no longer owns" not in log
    assert "Restored" not in log


def test_forty_new_sessions_under_a_low_limit_fail_cleanly_and_all_answer_later(
    denv: DaemonEnv,
) -> None:
    # hard 4096: the daemon raises its soft limit to it; then we lower the soft limit of the
    # running daemon (as an operator's prlimit would), and raise it again later
    daemon = _start_daemon(
        denv, lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (HARD, 4096))
    )
    assert resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)[0] == 4096
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (40, 4096))
    ok, exhausted = [], []
    for i in range(40):
        cp = denv.run("-p", "-s", f"s{i}", f"hello {i}")
        assert _alive(daemon.pid), f"the supervisor exited at session {i}: {denv.log_text()}"
        if cp.returncode == 0:
            assert cp.stdout.strip() == f"[echo turn 1] hello {i}"
            ok.append(i)
        else:
            assert "RLIMIT_NOFILE 40" in cp.stderr, cp.stderr
            assert "Traceback" not in cp.stderr
            exhausted.append(i)
    assert ok, exhausted
    assert exhausted, ok
    assert Path(denv.socket).exists()

    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (4096, 4096))
    for i in range(40):
        turn = 2 if i in ok else 1
        assert denv.prompt(f"again {i}", session=f"s{i}") == f"[echo turn {turn}] again {i}"
    assert daemon.poll() is None
    assert "Traceback" not in denv.log_text()


# --- in process: a spawn out of descriptors, and the session cap (real workers) ------------


def _config(env: DaemonEnv, **kw: Any) -> SupervisorConfig:
    return SupervisorConfig(socket=env.socket, home=str(env.home), registry=str(env.registry),
                            stop_workers_on_exit=True, **kw)


async def test_a_spawn_out_of_descriptors_fails_that_prompt_and_the_next_prompt_spawns_it(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = trio.lowlevel.open_process
    calls = 0

    async def no_pipes(*args: Any, **kw: Any) -> trio.Process:
        nonlocal calls
        await trio.lowlevel.checkpoint()
        calls += 1
        raise OSError(errno.EMFILE, "Too many open files")  # as os.pipe() raises it

    with trio.fail_after(60):
        async with trio_agentd.open_supervisor(_config(denv)) as sup, trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry), autostart=False
        ) as client:
            monkeypatch.setattr(trio.lowlevel, "open_process", no_pipes)
            for _ in range(2):  # and again: still a clear error, never "failed"
                with pytest.raises(AgentdError) as info:
                    await client.prompt("s1", "hello")
                assert info.value.code == "resource_exhausted"
                assert "could not start the worker of session s1: too many open files" \
                    " (RLIMIT_NOFILE" in info.value.message
            assert calls >= 2
            assert not sup.shutdown_requested.is_set()
            monkeypatch.setattr(trio.lowlevel, "open_process", real)
            assert await client.prompt("s1", "hello") == "[echo turn 1] hello\n"
            assert await client.prompt("s2", "other") == "[echo turn 1] other\n"


async def test_creating_a_session_beyond_max_sessions_is_resource_exhausted(
    denv: DaemonEnv,
) -> None:
    with trio.fail_after(60):
        async with trio_agentd.open_supervisor(_config(denv, max_sessions=1)), \
                trio_agentd.open_client(denv.socket, home=str(denv.home),
                                        registry=str(denv.registry), autostart=False) as client:
            assert await client.prompt("s1", "hello") == "[echo turn 1] hello\n"
            with pytest.raises(AgentdError) as info:
                await client.prompt("s2", "hello")
            assert info.value.code == "resource_exhausted"
            assert info.value.message == (
                "this supervisor already keeps the most sessions it may (1, stopped ones"
                " included) — `trio-agentd kill` sessions you no longer need")
            assert await client.prompt("s1", "again") == "[echo turn 2] again\n"
