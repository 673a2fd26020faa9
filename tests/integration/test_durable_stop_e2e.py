"""Durable stops end to end: real supervisors, workers and CLIs; kill -9; real descriptors.

(a) a kill survives the death of the supervisor carrying it out: its successor finishes it;
(b) prompts in flight during a kill end at once (``session_killed``) or are served by a fresh
worker, none waits for the 30 s readiness timeout; (c) eviction never cuts a running turn, not
even in a supervisor that adopted the worker in the middle of it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from .harness import DaemonEnv, daemon_env, wait_for

# well under worker_connect_timeout (30 s): what a prompt meeting a stop may take at most
DEADLINE = 12.0


def _descriptor_path(env: DaemonEnv, session: str) -> Path | None:
    found = list((env.home / "daemons").glob(f"*/workers/{session}.json"))
    return found[0] if found else None


def _descriptor(env: DaemonEnv, session: str) -> dict[str, Any] | None:
    path = _descriptor_path(env, session)
    if path is None:
        return None
    try:
        return dict(json.loads(path.read_bytes()))
    except (OSError, ValueError):
        return None


def _sessions(env: DaemonEnv) -> dict[str, dict[str, Any]]:
    cp = env.run("sessions", "--json", timeout=DEADLINE)
    assert cp.returncode == 0, cp.stderr
    return {r["session"]: r for r in json.loads(cp.stdout)}


def _kill9_supervisor(env: DaemonEnv) -> int:
    sup = int(env.owner()["pid"])
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: sup not in env.our_pids(), timeout=10, what="the supervisor to die")
    return sup


def _alive(pid: int, env: DaemonEnv) -> bool:
    return pid in env.our_pids()


def test_successor_finishes_a_kill_recorded_in_the_descriptor(denv: DaemonEnv) -> None:
    assert denv.prompt("one", session="k") == "[echo turn 1] one"
    worker = int(_descriptor(denv, "k")["pid"])  # type: ignore[index]
    _kill9_supervisor(denv)
    assert _alive(worker, denv)
    # what a supervisor killed in the middle of `trio-agentd kill k` leaves behind
    path = _descriptor_path(denv, "k")
    assert path is not None
    desc = json.loads(path.read_bytes())
    desc.update(lifecycle="stopping", stop_reason="kill")
    tmp = path.with_name(".k.tmp")
    tmp.write_text(json.dumps(desc))
    tmp.chmod(0o600)
    os.replace(tmp, path)
    # the successor (autostarted by this command) finishes the kill
    _sessions(denv)
    wait_for(lambda: not _alive(worker, denv), timeout=DEADLINE, what="the worker to be stopped")
    wait_for(lambda: "k" not in _sessions(denv), timeout=DEADLINE, what="k to be forgotten")
    assert _descriptor_path(denv, "k") is None
    assert "k" not in _sessions(denv)  # not respawned
    # a later prompt creates the session anew: a fresh worker, no restart counted
    assert denv.prompt("two", session="k").endswith("two")
    row = _sessions(denv)["k"]
    assert row["restarts"] == 0
    assert row["pid"] != worker


def test_kill9_of_the_supervisor_while_a_kill_is_stopping_is_finished_by_its_successor(
    denv: DaemonEnv,
) -> None:
    started = denv.root / "started"
    # a turn whose script ignores SIGINT and SIGTERM: ending it takes the exec runner's grace
    # (SIGINT, 2 s, then SIGTERM and SIGKILL), so the kill is "stopping" for a while
    script = f"trap '' INT TERM; touch {started}; sleep 60; echo never"
    p = denv.popen("-p", "-s", "k", "--agent", "shell", script)
    wait_for(started.exists, timeout=30, what="the turn to start")
    worker = int(_descriptor(denv, "k")["pid"])  # type: ignore[index]
    killer = denv.popen("kill", "k")
    wait_for(lambda: (_descriptor(denv, "k") or {}).get("lifecycle") == "stopping",
             timeout=10, interval=0.005, what="the kill to be recorded")
    _kill9_supervisor(denv)
    killer.communicate(timeout=30)
    desc = _descriptor(denv, "k")
    if desc is not None:  # (unless the stop finished just before the kill -9)
        assert (desc["lifecycle"], desc["stop_reason"]) in (
            ("stopping", "kill"), ("stopped", "kill"))
    # the prompt's client: its turn was cut short by the kill, one line, at once
    t0 = time.monotonic()
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - t0 < DEADLINE
    assert p.returncode != 0
    assert out == ""
    assert err.count("\n") == 1, err
    assert "was killed" in err
    # the successor finishes the kill: no adoption, no respawn, no restart counted
    rows = _sessions(denv)
    assert "k" not in rows or rows["k"]["state"] in ("stopping", "stopped")
    wait_for(lambda: not _alive(worker, denv), timeout=DEADLINE, what="the worker to be gone")
    wait_for(lambda: "k" not in _sessions(denv), timeout=DEADLINE, what="k to be forgotten")
    assert _descriptor_path(denv, "k") is None
    assert "never" not in out


def test_prompts_in_flight_during_a_kill_end_at_once_or_get_a_fresh_worker(
    denv: DaemonEnv,
) -> None:
    started = denv.root / "started"
    long_turn = denv.popen("-p", "-s", "q", "--agent", "shell",
                           f"touch {started}; sleep 60; echo never")
    wait_for(started.exists, timeout=30, what="the long turn to start")
    worker = int(_descriptor(denv, "q")["pid"])  # type: ignore[index]
    # three prompts queued behind it (each its own client, on its own direct route)
    # (wherever each is when the kill comes: at the worker, or asking for its route)
    queued = [denv.popen("-p", "-s", "q", f"echo queued-{i}") for i in range(3)]
    t0 = time.monotonic()
    killer = denv.popen("kill", "q")
    # and three that arrive while it is being killed
    during = [denv.popen("-p", "-s", "q", f"echo during-{i}") for i in range(3)]
    _, err = killer.communicate(timeout=30)
    assert killer.returncode == 0, err
    results = []
    for proc in [long_turn, *queued, *during]:
        o, e = proc.communicate(timeout=30)
        results.append((proc.returncode, o, e))
    elapsed = time.monotonic() - t0
    assert elapsed < DEADLINE, (elapsed, results)
    rc, o, e = results[0]
    assert rc != 0
    assert "was killed" in e
    assert e.count("\n") == 1
    for i, (rc, o, e) in enumerate(results[1:4]):
        assert (rc != 0 and "was killed" in e) or (rc == 0 and o == f"queued-{i}\n"), (o, e)
    for i, (rc, o, e) in enumerate(results[4:]):
        # a session created anew in the same directory starts a new shell and may say so first
        # (on stderr, or with the reply while the worker shows stderr there)
        o = o.split("\n", 1)[1] if o.startswith("[a new shell started in") else o
        assert (rc != 0 and "was killed" in e) or (rc == 0 and o == f"during-{i}\n"), (o, e)
        assert "did not become ready" not in e
    assert not _alive(worker, denv)
    rows = _sessions(denv)
    if "q" in rows:  # created anew by a prompt that came during the kill
        assert rows["q"]["restarts"] == 0
        assert rows["q"]["pid"] != worker


def test_a_long_turn_is_not_evicted_even_by_a_supervisor_that_adopted_it_mid_turn() -> None:
    timing = '{"idle_eviction": 1, "idle_sweep_period": 0.2, "stop_grace": 1}'
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": timing}) as env:
        started = env.root / "started"
        p = env.popen("-p", "-s", "long", "--agent", "shell",
                      f"touch {started}; sleep 5; echo done")
        wait_for(started.exists, timeout=30, what="the turn to start")
        worker = int(_descriptor(env, "long")["pid"])  # type: ignore[index]
        # a new supervisor adopts the worker mid-turn (it missed the turn's start); started by
        # another session's prompt (`sessions` would ask the worker whether it is busy)
        _kill9_supervisor(env)
        assert env.prompt("hi", session="other") == "[echo turn 1] hi"
        out, err = p.communicate(timeout=30)
        assert (p.returncode, out) == (0, "done\n"), err
        assert _alive(worker, env)
        assert _descriptor(env, "long")["pid"] == worker  # type: ignore[index]
        # idle from the end of the turn: then it is evicted
        wait_for(lambda: (_descriptor(env, "long") or {}).get("stop_reason") == "evict",
                 timeout=DEADLINE, what="the idle sweep to evict it after its turn")
        wait_for(lambda: not _alive(worker, env), timeout=DEADLINE, what="the worker to exit")
        rows = json.loads(env.run("sessions", "--json").stdout)
        assert {r["session"]: r["state"] for r in rows}["long"] == "evicted"
