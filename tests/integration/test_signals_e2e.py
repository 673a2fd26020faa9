"""Signals, sent by pid to the supervisor or worker a test started: each is logged, and does
what docs/operations.md's table says."""

from __future__ import annotations

import functools
import json
import os
import signal
from collections.abc import Callable

import pytest

from .harness import DaemonEnv, wait_for


def _rows(env: DaemonEnv) -> dict[str, dict[str, object]]:
    cp = env.run("sessions", "--json")
    assert cp.returncode == 0, cp.stderr
    return {str(r["session"]): r for r in json.loads(cp.stdout)}


def _gone(env: DaemonEnv, pid: int) -> bool:
    return pid not in env.our_pids()


def _logged(line: str, text: Callable[[], str]) -> bool:
    return line in text()


def _worker_log(env: DaemonEnv, session: str) -> str:
    return (env.home / "sessions" / session / "worker.log").read_text(errors="replace")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT])
def test_an_operators_stop_signal_to_a_worker_is_a_clean_stop_not_a_crash(
    denv: DaemonEnv, sig: signal.Signals
) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    for turn in range(2, 6):  # more often than the restart intensity allows crashes
        pid = int(str(_rows(denv)["w"]["pid"]))
        os.kill(pid, sig)
        wait_for(functools.partial(_gone, denv, pid), timeout=20, what="the worker to exit")
        wait_for(lambda: _rows(denv)["w"]["state"] == "stopped", timeout=20,
                 what="the session to be stopped")
        row = _rows(denv)["w"]
        assert row["restarts"] == 0, row
        assert f"signal {sig.name}: stopping cleanly" in _worker_log(denv, "w")
        assert f"stopped cleanly on signal {sig.name}" in denv.log_text()
        # the next prompt starts it again, uncounted
        assert denv.prompt(f"t{turn}", session="w") == f"[echo turn {turn}] t{turn}"
        row = _rows(denv)["w"]
        assert (row["state"], row["restarts"]) == ("ready", 0)
        assert row["pid"] != pid


def test_other_signals_to_a_worker_are_logged_and_ignored(denv: DaemonEnv) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    pid = int(str(_rows(denv)["w"]["pid"]))
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        os.kill(pid, sig)
        line = f"signal {sig.name}: ignored"
        wait_for(functools.partial(_logged, line, lambda: _worker_log(denv, "w")),
                 timeout=20, what=f"the worker to log {sig.name}")
    assert denv.prompt("two", session="w") == "[echo turn 2] two"
    row = _rows(denv)["w"]
    assert (row["pid"], row["restarts"]) == (pid, 0)


def test_other_signals_to_the_supervisor_are_logged_and_ignored_quit_stops_it(
    denv: DaemonEnv,
) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    sup = int(denv.owner()["pid"])
    worker = int(str(_rows(denv)["w"]["pid"]))
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        os.kill(sup, sig)
        wait_for(functools.partial(_logged, f"signal {sig.name}: ignored", denv.log_text),
                 timeout=20, what=f"the supervisor to log {sig.name}")
    assert denv.prompt("two", session="w") == "[echo turn 2] two"
    assert int(denv.owner()["pid"]) == sup
    os.kill(sup, signal.SIGQUIT)
    wait_for(lambda: sup not in denv.our_pids(), timeout=20, what="the supervisor to stop")
    assert "signal SIGQUIT: stopping, workers left running" in denv.log_text()
    assert worker in denv.our_pids()  # left running: the next supervisor adopts it
    assert denv.prompt("three", session="w") == "[echo turn 3] three"
    assert int(str(_rows(denv)["w"]["pid"])) == worker
