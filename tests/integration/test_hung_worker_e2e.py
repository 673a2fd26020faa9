"""A hung worker is found, end to end: real supervisor and workers, SIGSTOP and SIGCONT by pid.

The supervisor runs with short liveness and recovery timings (``TRIO_AGENTD_TIMING``); the
clients (the CLI, and :class:`SyncClient` in this process) keep their defaults: a direct route
pings a worker silent for 2 s and gives up 3 s after the ping.

What a prompt to a stopped worker gets: ``worker_unresponsive``, never an answer from a
respawned worker — the planner first spends its reconnects and deferred rounds on the stopped
one (it may be continued), and a prompt fails within the bound instead of waiting for that.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_agentd._cli_exit import EXIT_OWN
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient

from .harness import DaemonEnv, daemon_env, wait_for

REPO = Path(__file__).resolve().parents[2]
PING_INTERVAL, PING_TIMEOUT = 0.2, 0.5  # the supervisor's
CLIENT_BOUND = 2.0 + 3.0  # the clients' default link_ping_interval + link_ping_timeout

pytestmark = pytest.mark.timeout(120)


def _timing(deferred_rounds: int, **more: float) -> str:
    return json.dumps({
        **more,
        "link_ping_interval": PING_INTERVAL,
        "link_ping_timeout": PING_TIMEOUT,
        "worker_retry_delays": [0.2, 0.2, 0.2],
        "adopt_connect_timeout": 0.3,
        "deferred_recovery_recheck": 0.5,
        "max_deferred_recovery_rounds": deferred_rounds,
        "stop_grace": 0.3,
    })


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid``; in any case continue it afterwards (SIGCONT by pid; it may be gone)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _is_stopped(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :][:1] == b"T"


def _pid_of(env: DaemonEnv, session: str) -> int:
    return next(int(d["pid"]) for d in env.descriptors() if d["session"] == session)


def _state(client: SyncClient, session: str) -> str:
    rows = client.request("sessions")
    return str(next(r["state"] for r in rows if r["session"] == session))


def _layout(env: DaemonEnv) -> Layout:
    return Layout(home=env.home, socket=env.socket, registry=env.registry)


def test_stopped_idle_worker_fails_prompts_unresponsive_then_is_respawned() -> None:
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": _timing(deferred_rounds=4)}) as env:
        assert env.prompt("one", session="h") == "[echo turn 1] one"
        old = _pid_of(env, "h")
        client = SyncClient(_layout(env), autostart=False)
        try:
            with _stopped(old):
                wait_for(lambda: _is_stopped(old), timeout=5, what="the worker to stop")
                started = time.monotonic()
                with pytest.raises(AgentdError) as info:
                    client.request("prompt", {"session": "h", "text": "two"})
                took = time.monotonic() - started
                assert info.value.code == ErrorCode.WORKER_UNRESPONSIVE, info.value
                # found by the supervisor within its ping interval + timeout (0.7 s); a client
                # that attached before that waits out its hello timeout (1.5 s) first
                assert took < 1.5 + PING_INTERVAL + PING_TIMEOUT + 1.5, took
                assert _state(client, "h") == "recovering"
                # the schedule: reconnects, deferred rounds, TERM (pending), KILL, respawn
                wait_for(lambda: _pid_of(env, "h") != old, timeout=30,
                         what="the stopped worker to be replaced")
                wait_for(lambda: _state(client, "h") == "ready", timeout=30,
                         what="the session to be ready again")
                wait_for(lambda: old not in env.our_pids(), timeout=10,
                         what="the stopped worker to be killed")
            # the transcript survived: the respawned worker runs turn 2
            assert env.prompt("three", session="h") == "[echo turn 2] three"
            assert "is unresponsive" in env.log_text()
        finally:
            client.close()


def test_stopped_worker_mid_turn_fails_the_waiting_prompt_and_answers_after_sigcont(
    tmp_path: Path,
) -> None:
    extra = {"PYTHONPATH": str(REPO), "TA_FIXTURE_FILE": str(tmp_path / "runs.log"),
             "TA_FIXTURE_DELAY": str(CLIENT_BOUND + 1.5)}
    agent = "tests.fixture_agents:slow_replayable"
    # the worker tells its supervisor a turn started from a task of its own: stopped between
    # the agent's first step and that notice, it is on an idle link to the supervisor, pinged
    # after link_idle_ping_interval (short here) instead of PING_INTERVAL
    timing = _timing(deferred_rounds=60, link_idle_ping_interval=1.0)
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": timing, **extra}) as env:
        # a turn silent for longer than the client's bound is not a hung worker: it answers
        # the client's pings all along, and its prompt gets its answer
        cp = env.run("-p", "-s", "m", "--agent", agent, "warm")
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout == "[slow turn 1] warm\n"
        worker = _pid_of(env, "m")

        p = env.popen("-p", "-s", "m", "--agent", agent, "payload")
        runs = tmp_path / "runs.log"
        wait_for(lambda: "start payload" in runs.read_text(), timeout=20,
                 what="the turn to start")
        client = SyncClient(_layout(env), autostart=False)
        try:
            with _stopped(worker):
                wait_for(lambda: _is_stopped(worker), timeout=5, what="the worker to stop")
                started = time.monotonic()
                out, err = p.communicate(timeout=60)
                took = time.monotonic() - started
                assert p.returncode == EXIT_OWN, (out, err)
                assert out == ""
                assert "answers nothing, not even a ping within 3s" in err, err
                assert took < CLIENT_BOUND + 2.0, took
                wait_for(lambda: _state(client, "m") == "recovering", timeout=10,
                         what="the supervisor to find the stopped worker")
                assert _pid_of(env, "m") == worker
            # SIGCONT: the next reconnect reaches it; the same worker answers again
            wait_for(lambda: _state(client, "m") == "ready", timeout=30,
                     what="the continued worker to be reconnected")
            assert _pid_of(env, "m") == worker
            cp = env.run("-p", "-s", "m", "--agent", agent, "after")
            assert cp.returncode == 0, cp.stderr
            assert cp.stdout == "[slow turn 3] after\n"  # the stopped turn finished: turn 2
            assert runs.read_text().splitlines().count("done payload") == 1
        finally:
            client.close()


def test_a_supervisor_stopped_after_the_hello_fails_the_request_within_its_bound(
    denv: DaemonEnv,
) -> None:
    """A client already connected when its supervisor stops (SIGSTOP) is not left waiting for
    ever: the request's silence is met with a ping, and a ping unanswered within the client's
    patience fails the request naming ``doctor --fix``; the supervisor, continued, serves on."""
    from trio_agentd._defaults import ClientTiming

    class Short(ClientTiming):
        link_ping_interval = 0.5
        patience = 1.5

    assert denv.prompt("start") == "[echo turn 1] start"
    sup = int(denv.owner()["pid"])
    client = SyncClient(_layout(denv), timing=Short(), autostart=False)
    try:
        client.connect()
        with _stopped(sup):
            wait_for(lambda: _is_stopped(sup), timeout=5, what="the supervisor to stop")
            started = time.monotonic()
            with pytest.raises(AgentdError) as info:
                client.request("sessions", retry_for=0)
            took = time.monotonic() - started
        assert info.value.code == ErrorCode.DAEMON_UNAVAILABLE
        assert "answers nothing, not even a ping within 1.5s" in info.value.message
        assert "doctor --fix" in info.value.message
        assert 1.5 <= took < 1.5 + 0.5 + 2.0, took
    finally:
        client.close()
    assert denv.prompt("again") == "[echo turn 2] again"
